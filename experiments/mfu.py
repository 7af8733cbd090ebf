"""Model FLOP utilisation of a ~1B-parameter GPT on one GPU, stages 0 and 3, bf16.

For each (stage, remat, attention) the script finds the largest global batch whose
compiled step fits the device (two compiles at batch 1 and 2 give the fixed and
per-sequence bytes; the prediction is compiled once more to check), trains a few
steps and prints tokens/s, MFU and peak device memory. Each configuration runs in
its own process, so peaks do not leak from one into the next.

    python -m experiments.mfu                         # one H100/H200: ~10 minutes
    python -m experiments.mfu --tiny                  # the same code path on CPU, seconds

MFU = tokens/s x FLOPs per token / peak, with FLOPs per token = 6 N + 12 L D S
(matmuls forward and backward, plus attention scores and values; N counts every
param, embeddings included) and peak = 989 TFLOP/s (dense bf16, H100/H200 SXM).
Rows go to ``experiments/results/mfu.csv`` (``--csv``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
# ~1.08B params: 20 x 12 D^2 (blocks) + V D (tied embedding/head) + S D (positions)
GPT_1B = dict(vocab_size=32768, seq_len=2048, d_model=2048, n_layers=20, n_heads=16)
TINY = dict(vocab_size=256, seq_len=128, d_model=64, n_layers=2, n_heads=4)
CONFIGS = ["0,none,auto", "0,dots,auto", "3,none,auto", "3,dots,auto", "0,dots,xla"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=CONFIGS,
        help="STAGE,REMAT,ATTENTION triples (remat: none|dots|full; attention: auto|xla|cudnn)",
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (smoke run)")
    p.add_argument("--batch", type=int, help="fixed global batch (default: largest that fits)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument(
        "--headroom",
        type=float,
        default=0.95,
        help="use at most this fraction of the memory JAX may allocate",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--csv", type=pathlib.Path, default=HERE / "results" / "mfu.csv")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one config in this process
    return p.parse_args(argv)


def run_one(args, config: str) -> dict:
    """Size the batch, train ``args.steps`` steps, return the figures (this process)."""
    stage, remat, attention = config.split(",")
    stage = int(stage)
    if args.tiny:
        from jaxzero.mesh import simulate_devices

        simulate_devices(1)
    import jax
    import numpy as np
    import optax

    import jaxzero
    from jaxzero.accounting.measure import compiled_memory
    from jaxzero.models.gpt import GPT, GPTConfig

    shape = TINY if args.tiny else GPT_1B
    max_batch = min(args.max_batch, 4) if args.tiny else args.max_batch
    model = GPT(GPTConfig(**shape, remat=remat, attention=attention))
    engine = model.engine(
        optax.adamw(1e-4, weight_decay=0.1),
        mesh=jaxzero.make_mesh(1),
        stage=stage,
        precision="bf16",
    )
    key = jax.random.key(0)
    state_shapes = engine.abstract_state(jax.eval_shape(model.init, key))
    s = shape["seq_len"]
    batch_of = lambda b: {k: jax.ShapeDtypeStruct((b, s), np.int32) for k in ("inputs", "targets")}

    @functools.cache  # each batch size compiles once; the chosen one is the one that runs
    def peak(b: int):
        compiled = engine.compile(state_shapes, batch_of(b))
        return compiled_memory(compiled).peak, compiled

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    limit = int(stats.get("bytes_limit", 1 << 30) * args.headroom)
    if args.batch:
        batch = args.batch
    else:
        p1, _ = peak(1)
        p2, _ = peak(2)
        per_seq = max(p2 - p1, 1)
        batch = max(1, min(max_batch, (limit - p1) // per_seq + 1))
        while batch > 1 and peak(batch)[0] > limit:
            batch = max(1, int(batch * 0.85))
    predicted, compiled = peak(batch)
    hlo = compiled.as_text()
    fused_attention = "cudnn$fmha" in hlo or "__cudnn" in hlo

    state = engine.init_from(model.init, key)
    tokens = np.random.default_rng(0).integers(0, shape["vocab_size"], (batch, s + 1))
    data = engine.shard_batch(
        {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    )
    for _ in range(3):  # the sized executable itself: no fourth compile
        state, m = compiled(state, data)
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(args.steps):
        state, m = compiled(state, data)
    jax.block_until_ready(m)
    seconds = (time.perf_counter() - t) / args.steps
    n_params = engine.num_params
    tokens_per_s = batch * s / seconds
    flops_per_token = model.flops_per_token(n_params)
    return {
        "stage": stage,
        "remat": remat,
        "attention": attention,
        "fused_attention": fused_attention,
        "params_M": round(n_params / 1e6, 1),
        "batch": batch,
        "seq_len": s,
        "step_ms": round(seconds * 1e3, 1),
        "tokens_per_s": round(tokens_per_s),
        "mfu_pct": round(tokens_per_s * flops_per_token / (args.peak_tflops * 1e12) * 100, 2),
        "compiled_peak_GiB": round(predicted / 2**30, 2),
        "device_peak_GiB": round(
            (device.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2
        ),
        "loss": round(float(m["loss"]), 3),
        "backend": jax.default_backend(),
    }


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args, args.one)), flush=True)
        return 0
    rows = []
    header = (
        f"{'stage':>5} {'remat':>5} {'attention':>9} {'batch':>5} {'step ms':>8} "
        f"{'tokens/s':>9} {'MFU %':>6} {'peak GiB':>8}"
    )
    print(header)
    passthrough = list(sys.argv[1:] if argv is None else argv)
    for config in args.configs:
        env = {
            **os.environ,
            "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get(
                "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"
            ),
        }
        out = subprocess.run(
            [sys.executable, "-m", "experiments.mfu", *passthrough, "--one", config],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
            env=env,
        )
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode or line is None:
            print(f"{config}: failed (exit {out.returncode})\n{out.stderr[-3000:]}")
            continue
        r = json.loads(line[len("RESULT ") :])
        rows.append(r)
        attn = r["attention"] + ("*" if r["fused_attention"] else "")
        mfu = r["mfu_pct"] if r["backend"] == "gpu" else "n/a"
        print(
            f"{r['stage']:>5} {r['remat']:>5} {attn:>9} {r['batch']:>5} {r['step_ms']:>8} "
            f"{r['tokens_per_s']:>9} {mfu:>6} "
            f"{r['device_peak_GiB'] or r['compiled_peak_GiB']:>8}",
            flush=True,
        )
    if any(r["fused_attention"] for r in rows):
        print("* cuDNN fused attention found in the compiled step")
    if rows and args.csv:
        from experiments.results_io import write_csv

        args.csv.parent.mkdir(parents=True, exist_ok=True)
        write_csv(args.csv, rows)
    return 0 if len(rows) == len(args.configs) else 1


if __name__ == "__main__":
    sys.exit(main())
