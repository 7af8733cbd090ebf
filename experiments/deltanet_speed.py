"""Gated DeltaNet against causal softmax attention of the same width: speed and memory.

One mixer each, forward and backward under ``jax.jit`` (the gradient of a random
projection of its output w.r.t. its weights and its input), batch 1, fp32:

- ``deltanet``: Qwen3.5's ``linear_attention`` mixer scaled down (hidden 256, 2 key
  heads of 64 serving 4 value heads of 64, conv kernel 4): the q/k/v, z, a, b
  projections, :func:`~jaxzero.models.deltanet.causal_conv1d`, the chunked
  :func:`~jaxzero.models.deltanet.gated_delta_rule` (chunk 64), the gated RMSNorm and
  the output projection;
- ``attention``: q/k/v/o projections of the same width (4 heads of 64) around
  :func:`jaxzero.models.common.causal_attention` with ``attention="xla"``.

At each sequence length (512, 2048, 8192): tokens/s (the median step of a few, after
the compile) and the compiled peak (``memory_analysis()``: temp + argument + output
bytes), the ratios between the two, and each mixer's peak ratio per 4x the sequence
(linear: 4x; attention's S x S scores: up to 16x). Printed and written to
``experiments/results/deltanet_speed.csv`` (rows with :func:`environment`'s columns).

    python -m experiments.deltanet_speed                 # ~1.5 minutes on 2 cores
    python -m experiments.deltanet_speed --tiny --out /tmp/d   # a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.results_io import write_csv  # noqa: E402
from jaxzero.models import deltanet as dn  # noqa: E402
from jaxzero.models.common import causal_attention  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SHAPES = {  # hidden, key heads, value heads, head dim, conv kernel, chunk
    "qwen3.5-like": dict(hidden=256, key_heads=2, value_heads=4, head_dim=64, conv=4, chunk=64),
    "tiny": dict(hidden=32, key_heads=1, value_heads=2, head_dim=8, conv=4, chunk=16),
}


def deltanet_params(rng: np.random.Generator, hidden, key_heads, value_heads, head_dim, conv):
    gk, hv = key_heads * head_dim, value_heads * head_dim
    w = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32) / np.sqrt(shape[0]))
    return {
        "qkv_DxC": w(hidden, 2 * gk + hv),
        "z_DxF": w(hidden, hv),
        "ab_Dx2H": w(hidden, 2 * value_heads),
        "conv_CxW": w(2 * gk + hv, conv),
        "a_log_H": jnp.log(jnp.linspace(1.0, 8.0, value_heads)),
        "dt_bias_H": jnp.ones(value_heads),
        "norm_V": jnp.ones(head_dim),
        "out_FxD": w(hv, hidden),
    }


def deltanet_mixer(p, x_BxSxD, key_heads, value_heads, head_dim, chunk):
    b, s, _ = x_BxSxD.shape
    gk = key_heads * head_dim
    qkv = dn.causal_conv1d(x_BxSxD @ p["qkv_DxC"], p["conv_CxW"])
    q = qkv[..., :gk].reshape(b, s, key_heads, head_dim)
    k = qkv[..., gk : 2 * gk].reshape(b, s, key_heads, head_dim)
    v = qkv[..., 2 * gk :].reshape(b, s, value_heads, head_dim)
    a_BxSxH, b_BxSxH = jnp.split(x_BxSxD @ p["ab_Dx2H"], 2, axis=-1)
    g = dn.decay(a_BxSxH, p["a_log_H"], p["dt_bias_H"])
    o, _ = dn.gated_delta_rule(q, k, v, g, dn.beta_gate(b_BxSxH), chunk=chunk)
    z = (x_BxSxD @ p["z_DxF"]).reshape(o.shape)
    return dn.gated_rms_norm(o, z, p["norm_V"], 1e-6).reshape(b, s, -1) @ p["out_FxD"]


def attention_params(rng: np.random.Generator, hidden, value_heads, head_dim, **_):
    f = value_heads * head_dim
    w = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32) / np.sqrt(shape[0]))
    return {"qkv_Dx3F": w(hidden, 3 * f), "out_FxD": w(f, hidden)}


def attention_mixer(p, x_BxSxD, value_heads, head_dim, **_):
    b, s, _ = x_BxSxD.shape
    q, k, v = jnp.split((x_BxSxD @ p["qkv_Dx3F"]).reshape(b, s, 3 * value_heads, head_dim), 3, 2)
    return causal_attention(q, k, v, "xla").reshape(b, s, -1) @ p["out_FxD"]


def train_step(mixer):
    """Forward and backward: the gradient of <mixer(x), cotangent> w.r.t. params and x."""

    def loss(p, x, co):
        return jnp.sum(mixer(p, x) * co)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def measure(name: str, mixer, params, seq: int, hidden: int, min_time: float) -> dict:
    rng = np.random.default_rng(seq)
    x = jnp.asarray(rng.normal(size=(1, seq, hidden)).astype(np.float32))
    co = jnp.asarray(rng.normal(size=(1, seq, hidden)).astype(np.float32))
    t0 = time.perf_counter()
    compiled = train_step(mixer).lower(params, x, co).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    jax.block_until_ready(compiled(params, x, co))  # warm
    times: list[float] = []
    while len(times) < 3 or (sum(times) < min_time and len(times) < 50):
        t = time.perf_counter()
        jax.block_until_ready(compiled(params, x, co))
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    return {
        "mixer": name,
        "seq": seq,
        "batch": 1,
        "step_s": round(step, 5),
        "tokens_per_s": round(seq / step, 1),
        "peak_mib": round(peak / 2**20, 2),
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "compile_s": round(compile_s, 2),
        "steps_timed": len(times),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--tiny", action="store_true", help="tiny dims, sequences 64 and 256")
    p.add_argument("--min-time", type=float, default=2.0, help="seconds of timed steps a row")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the CSV goes")
    args = p.parse_args(argv)
    shape = SHAPES["tiny" if args.tiny else "qwen3.5-like"]
    seqs = [64, 256] if args.tiny else args.seqs
    d, g, h, hd = shape["hidden"], shape["key_heads"], shape["value_heads"], shape["head_dim"]
    rng = np.random.default_rng(0)
    mixers = {
        "deltanet": (
            lambda p, x: deltanet_mixer(p, x, g, h, hd, shape["chunk"]),
            deltanet_params(rng, d, g, h, hd, shape["conv"]),
            dn.flops_per_token(d, g, h, hd, hd, shape["conv"], shape["chunk"]),
        ),
        "attention": (
            lambda p, x: attention_mixer(p, x, h, hd),
            attention_params(rng, d, h, hd),
            None,  # per row: 6·params + 12·S·width, the accounting's formula
        ),
    }
    print(
        f"{'tiny' if args.tiny else 'qwen3.5-like'}: hidden {d}, DeltaNet {g} key / {h} value "
        f"heads of {hd}, attention {h} heads of {hd}; fwd+bwd, batch 1, fp32, "
        f"{jax.default_backend()}, {os.cpu_count()} cores, jax {jax.__version__}"
    )
    rows: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for seq in seqs:
        for name, (mixer, params, flops) in mixers.items():
            row = measure(name, mixer, params, seq, d, args.min_time)
            n = sum(x.size for x in jax.tree.leaves(params))
            row["params"] = n
            row["flops_per_token"] = flops if flops else 6.0 * n + 12.0 * seq * h * hd
            rows.append(row)
            print(
                f"  S={seq:5d} {name:9s} {row['tokens_per_s']:10.0f} tok/s  "
                f"peak {row['peak_mib']:9.2f} MiB  (compile {row['compile_s']} s)",
                flush=True,
            )
            write_csv(args.out / "deltanet_speed.csv", rows)
    print(table(rows))
    return rows


def table(rows: list[dict]) -> str:
    """The Markdown table: each sequence's two mixers, their ratio, and each mixer's
    peak growth from the sequence before (x per 4x S)."""
    by = {(r["mixer"], r["seq"]): r for r in rows}
    seqs = sorted({r["seq"] for r in rows})
    lines = [
        "| S | DeltaNet tok/s | attention tok/s | speed DeltaNet/attn | DeltaNet peak MiB | "
        "attention peak MiB | peak attn/DeltaNet | DeltaNet peak growth | attention peak growth |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, s in enumerate(seqs):
        d, a = by[("deltanet", s)], by[("attention", s)]
        grow = ["", ""]
        if i:
            prev = seqs[i - 1]
            grow = [
                f"{r['peak_mib'] / by[(r['mixer'], prev)]['peak_mib']:.2f}x per {s // prev}x S"
                for r in (d, a)
            ]
        lines.append(
            f"| {s} | {d['tokens_per_s']:.0f} | {a['tokens_per_s']:.0f} | "
            f"{d['tokens_per_s'] / a['tokens_per_s']:.2f} | {d['peak_mib']:.1f} | "
            f"{a['peak_mib']:.1f} | {a['peak_mib'] / d['peak_mib']:.2f} | {grow[0]} | {grow[1]} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
