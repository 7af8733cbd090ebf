"""LoRA and QLoRA against full fine-tuning: device bytes per stage, and step time on CPU.

1. Llama 3.2 1B's shapes (configs/llama-1b.yaml) on 8 simulated devices, bf16 with fp32
   masters and AdamW, compiled nowhere and allocated nowhere (``Engine.abstract_state``):
   each device's persistent bytes by part (working params, fp32 master, optimizer state,
   frozen base) for full fine-tuning, LoRA (rank 16 on every projection, the base bf16)
   and QLoRA (the projections int8 or nf4), stages 0-3, beside the formulas
   (16Ψ a trainable param: 2 + 4 + 8, sharded as the stage shards it; 2 bytes a frozen
   bf16 param, 1 + 4/64 int8, 0.5 + 4/64 nf4, /N at stage 3 only). And what a
   checkpoint holds: the working params, fp32 masters and optimizer state of what trains
   (14 bytes a param: every param, or the adapters alone).
2. Step time of LoRA against full fine-tuning on a small Llama (d=256, 4 layers,
   seq 128, global batch 16 x 128, 2 simulated devices, fp32), interleaved, median of
   ``--runs`` runs of ``--steps`` steps each, at stages 0 and 3.

Writes experiments/results/lora_memory.csv and lora_memory.md:

    python -m experiments.lora_memory [--runs 3 --steps 5]
"""

from __future__ import annotations

import argparse
import pathlib
import time

from jaxzero.mesh import simulate_devices

simulate_devices(8)  # before JAX starts its backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import yaml  # noqa: E402

import jaxzero  # noqa: E402
from experiments.results_io import write_csv  # noqa: E402
from jaxzero.accounting.planner import shard_bytes  # noqa: E402
from jaxzero.models import from_fields  # noqa: E402
from jaxzero.models.lora import LoraConfig  # noqa: E402
from jaxzero.models.lora import trainable as lora_trainable  # noqa: E402
from jaxzero.models.quant import bytes_per_param  # noqa: E402

ROOT = pathlib.Path(__file__).parent.parent
OUT = ROOT / "experiments" / "results"
GB = 1e9
VARIANTS = {
    "full": None,
    "lora": LoraConfig(rank=16, alpha=32),
    "qlora-int8": LoraConfig(rank=16, alpha=32, base_dtype="int8"),
    "qlora-nf4": LoraConfig(rank=16, alpha=32, base_dtype="nf4"),
}


def _bytes(name: str, lora: LoraConfig | None, stage: int, n: int = 8) -> dict:
    fields = yaml.safe_load((ROOT / "configs" / "llama-1b.yaml").read_text())["model"]
    m = from_fields(fields, lora=lora)
    engine = m.engine(optax.adamw(1e-4), mesh=jaxzero.make_mesh(n), stage=stage, precision="bf16")
    shapes = jax.eval_shape(m.init, jax.random.key(0))
    if lora is not None:  # a bf16 base stays bf16 (hf.load); codes and scales as they are

        def base(path: object, s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            name = jaxzero.partition.path_str(path)  # type: ignore[arg-type]
            keep = lora_trainable(name) or "weight_" in name
            return s if keep else jax.ShapeDtypeStruct(s.shape, np.dtype("bfloat16"))

        shapes = jax.tree_util.tree_map_with_path(base, shapes)
    state = engine.abstract_state(shapes)
    parts = {k: shard_bytes(getattr(state, k)) for k in ("params", "master", "opt_state")}
    parts["frozen"] = shard_bytes(state.frozen) if state.frozen is not None else 0
    psi, frozen_n = engine.num_params, engine.num_frozen
    split = lambda sharded: n if sharded else 1
    per_frozen = 2.0
    if lora is not None and lora.base_dtype is not None:  # the formula on the weights' count
        q = bytes_per_param(lora.base_dtype)
        weights = sum(
            s.size * 64 for p, s in jax.tree_util.tree_leaves_with_path(shapes)
            if jax.tree_util.keystr(p).endswith("'weight_scale']")
        )  # fmt: skip
        plain = frozen_n - sum(
            s.size for p, s in jax.tree_util.tree_leaves_with_path(shapes)
            if "weight_" in jax.tree_util.keystr(p)
        )  # fmt: skip
        frozen_formula = (2.0 * plain + q * weights) / split(stage == 3)
    else:
        frozen_formula = per_frozen * frozen_n / split(stage == 3)
    formula = (
        2.0 * psi / split(stage == 3)
        + 4.0 * psi / split(stage >= 1)
        + 8.0 * psi / split(stage >= 1)
    )
    return {
        "variant": name,
        "stage": stage,
        "trainable": psi,
        "frozen": frozen_n,
        **{f"{k}_gb": v / GB for k, v in parts.items()},
        "total_gb": sum(parts.values()) / GB,
        "formula_gb": (formula + frozen_formula) / GB,
        # what a checkpoint holds: the working params, fp32 master and optimizer state of
        # what trains (a LoRA run's base is read again from its files)
        "checkpoint_gb": sum(
            x.size * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves((state.params, state.master, state.opt_state))
        )
        / GB,
    }


def _step_time(lora: LoraConfig | None, stage: int, runs: int, steps: int) -> list[float]:
    fields = dict(arch="llama", vocab_size=256, d_model=256, n_layers=4, n_heads=4, seq_len=128)
    m = from_fields(fields, lora=lora)
    engine = m.engine(optax.adamw(1e-4), mesh=jaxzero.make_mesh(2), stage=stage)
    state = engine.init_from(m.init, jax.random.key(0))
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 256, (16, 129)).astype(np.int32)
    batch = engine.shard_batch({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    state, out = engine.step(state, batch)  # compile
    jax.block_until_ready(out)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(steps):
            state, out = engine.step(state, batch)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / steps)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    rows = [_bytes(n, v, s) for n, v in VARIANTS.items() for s in range(4)]
    lines = [
        "| variant | stage | trainable | frozen | params | master | optimizer | frozen "
        "base | total GB/device | formula | checkpoint GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['stage']} | {r['trainable']:,} | {r['frozen']:,} | "
            f"{r['params_gb']:.3f} | {r['master_gb']:.3f} | {r['opt_state_gb']:.3f} | "
            f"{r['frozen_gb']:.3f} | {r['total_gb']:.3f} | {r['formula_gb']:.3f} | "
            f"{r['checkpoint_gb']:.3f} |"
        )
    print("\n".join(lines))
    timing = []
    for stage in (0, 3):
        t_full, t_lora = [], []
        for _ in range(2):  # interleaved: ABAB
            t_full += _step_time(None, stage, args.runs, args.steps)
            t_lora += _step_time(LoraConfig(rank=16, alpha=32), stage, args.runs, args.steps)
        full, lora = float(np.median(t_full)), float(np.median(t_lora))
        timing.append(f"| {stage} | {1e3 * full:.1f} | {1e3 * lora:.1f} | {lora / full:.2f} |")
    table = [
        "| stage | full fine-tune ms/step | LoRA r=16 ms/step | LoRA / full |",
        "|---|---|---|---|",
    ]
    print("\n".join(table + timing))
    OUT.mkdir(parents=True, exist_ok=True)
    write_csv(OUT / "lora_memory.csv", rows)
    (OUT / "lora_memory.md").write_text(
        "\n".join(lines) + "\n\n" + "\n".join(table + timing) + "\n"
    )


if __name__ == "__main__":
    main()
