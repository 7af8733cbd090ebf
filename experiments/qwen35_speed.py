"""A Qwen3.5-shaped model against a Qwen3-shaped one of the same width and depth: speed
and memory of a training step on one device.

Both are :class:`~jaxzero.models.llama.Llama` s built from a
:class:`~jaxzero.models.llama.LlamaConfig` with their family's options (hidden 256,
intermediate 768, 4 layers, 4 query heads of 64 over 2 key/value heads, q/k norms,
vocab 512, untied head, ``attention="xla"``):

- ``qwen3``: four full-attention layers (rope on every dim of each head);
- ``qwen3.5``: Qwen3.5's arrangement, three Gated DeltaNet ``linear_attention`` layers
  (2 key heads of 64 serving 4 value heads of 64, conv kernel 4, chunks of 64) then one
  ``full_attention`` layer (a quarter of each head rotated, its output gated), norms
  ``1 + weight``;
- ``deltanet-layers``: the Qwen3.5 model's own decoder layer of the linear kind
  (:class:`~jaxzero.models.llama_layers.DecoderLayer`, ``linear=True``: input norm,
  Gated DeltaNet, MLP) four times between the embedding and the head, no attention
  layer at all: the DeltaNet layers' own memory, which the one attention layer of
  ``qwen3.5`` hides once its S x S scores dominate.

A training step is ``jax.jit(jax.value_and_grad(loss))`` of the mean next-token
cross-entropy (the model's ``loss_fn``) over batch 1, fp32 params and activations. At
each sequence length (512, 2048, 8192): tokens/s (the median of the timed steps after a
warm one) and the compiled peak (``memory_analysis()``: temp + argument + output bytes),
each model's ratio to ``qwen3``, and each model's peak growth per 4x the sequence
(linear: about 4x; XLA's attention materialises the S x S scores: up to 16x). A step
whose compiled peak is over ``--max-gib`` is compiled (its peak recorded) but not run.
Beside each compiled temp (the activations and the backward's workspace), the activation
model ``jaxzero estimate`` uses (:class:`~jaxzero.accounting.activations.DecoderShape`,
fp32, no remat, XLA attention) and the ratio of the two.
Printed and written to ``experiments/results/qwen35_speed.csv`` (rows with
:func:`environment`'s columns) and ``qwen35_speed.md``.

    python -m experiments.qwen35_speed                   # ~3 minutes on 2 cores
    python -m experiments.qwen35_speed --tiny --out /tmp/q    # a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.results_io import environment, write_csv  # noqa: E402
from jaxzero.accounting.activations import DecoderShape, activation_bytes  # noqa: E402
from jaxzero.models.llama import CHUNK, Llama, LlamaConfig  # noqa: E402
from jaxzero.models.llama_layers import DecoderLayer  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODELS = ("qwen3", "qwen3.5", "deltanet-layers")
SIZES = {  # the shared width and depth
    "default": dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "tiny": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    ),
}


def qwen3_config(size: dict[str, int], seq: int) -> LlamaConfig:
    """Qwen3's options: q/k norms, rope on every dim, no biases."""
    return LlamaConfig(
        **size,
        qk_norm=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=max(seq, 2048),
        seq_len=seq,
        attention="xla",
    )


def qwen3_5_config(size: dict[str, int], seq: int) -> LlamaConfig:
    """Qwen3.5's options on the same width and depth: linear-attention layers in groups
    of three before each full one, (1 + w) norms, partial rope, the gated output."""
    n, d = size["num_hidden_layers"], size["head_dim"]
    return dataclasses.replace(
        qwen3_config(size, seq),
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * (n // 4),
        norm_offset=True,
        partial_rotary_factor=0.25,
        attn_output_gate=True,
        linear_num_key_heads=max(1, size["num_attention_heads"] // 2),
        linear_num_value_heads=size["num_attention_heads"],
        linear_key_head_dim=d,
        linear_value_head_dim=d,
        linear_conv_kernel_dim=4,
    )


def model_step(cfg: LlamaConfig) -> tuple[Any, Any, float]:
    """The model's ``value_and_grad(loss_fn)``, its fp32 params and FLOPs per token."""
    model = Llama(cfg)
    params = model.init(jax.random.key(0))
    return jax.value_and_grad(model.loss_fn), params, model.flops_per_token()


def deltanet_layers_step(cfg: LlamaConfig) -> tuple[Any, Any, float]:
    """The embedding, ``num_hidden_layers`` of the Qwen3.5 model's linear-attention
    decoder layers, the final norm's place left out, the head: its ``value_and_grad``."""
    rngs = nnx.Rngs(0)
    layers = [DecoderLayer(cfg, rngs, None, True) for _ in range(cfg.num_hidden_layers)]
    graphdef = nnx.split(layers[0])[0]
    key = jax.random.split(jax.random.key(1), 2)
    params = {
        "layers": [nnx.split(layer)[1] for layer in layers],
        "embed": 0.02 * jax.random.normal(key[0], (cfg.vocab_size, cfg.hidden_size)),
        "head": 0.02 * jax.random.normal(key[1], (cfg.hidden_size, cfg.vocab_size)),
    }

    def loss(p, batch):
        x = p["embed"][batch["inputs"]]
        for state in p["layers"]:
            x = nnx.merge(graphdef, state)(x, None, None)[0]
        logits = x @ p["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    # 6 x the params (the matmuls') and the delta rule's mixing of each of its layers
    rule = Llama(cfg).linear_rule_flops() / len(cfg.linear_attention_layers)
    n = sum(x.size for x in jax.tree.leaves(params))
    return jax.value_and_grad(loss), params, 6.0 * n + rule * cfg.num_hidden_layers


def formula_bytes(name: str, cfg: LlamaConfig) -> float:
    """The activation model's bytes for one sequence of ``cfg`` in fp32: the model's
    layers, or for ``deltanet-layers`` as many Gated DeltaNet layers and no attention."""
    shape = DecoderShape.of(cfg, CHUNK)
    if name == "deltanet-layers":
        shape = dataclasses.replace(shape, layers=0, linear_layers=cfg.num_hidden_layers)
    return activation_bytes(shape, 1, bytes_per_value=4.0).total


def measure(step: Any, params: Any, seq: int, vocab: int, min_time: float, max_gib: float):
    rng = np.random.default_rng(seq)
    tokens = jnp.asarray(rng.integers(0, vocab, (1, seq + 1)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(params, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    row: dict[str, Any] = {
        "peak_mib": round(peak / 2**20, 2),
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "compile_s": round(compile_s, 2),
    }
    if peak > max_gib * 2**30:  # compiled, not run: its peak alone
        return row | {"step_s": 0, "tokens_per_s": 0, "steps_timed": 0}
    jax.block_until_ready(compiled(params, batch))  # warm
    times: list[float] = []
    while not times or (sum(times) < min_time and len(times) < 20):
        t = time.perf_counter()
        jax.block_until_ready(compiled(params, batch))
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    return row | {
        "step_s": round(step_s, 5),
        "tokens_per_s": round(seq / step_s, 1),
        "steps_timed": len(times),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--tiny", action="store_true", help="tiny dims, sequences 64 and 256")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of timed steps a row")
    p.add_argument("--max-gib", type=float, default=16.0, help="run no step of a larger peak")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the CSV and table go")
    args = p.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "default"]
    seqs = [64, 256] if args.tiny else args.seqs
    configs = {"qwen3": qwen3_config, "qwen3.5": qwen3_5_config, "deltanet-layers": qwen3_5_config}
    steps = {"qwen3": model_step, "qwen3.5": model_step, "deltanet-layers": deltanet_layers_step}
    head = (
        f"hidden {size['hidden_size']}, {size['num_hidden_layers']} layers, vocab "
        f"{size['vocab_size']}; fwd+bwd (value_and_grad of the loss), batch 1, fp32, jit, one "
        f"{jax.default_backend()} device, {os.cpu_count()} cores, jax {jax.__version__}"
    )
    print(head)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for seq in seqs:
        for name in MODELS:
            cfg = configs[name](size, seq)
            step, params, flops = steps[name](cfg)
            row = {"model": name, "seq": seq, "batch": 1, "dtype": "fp32"}
            row |= measure(step, params, seq, size["vocab_size"], args.min_time, args.max_gib)
            row["params"] = sum(x.size for x in jax.tree.leaves(params))
            row["flops_per_token"] = flops
            row["activation_formula_bytes"] = formula_bytes(name, cfg)
            row["temp_over_formula"] = round(row["temp_bytes"] / row["activation_formula_bytes"], 3)
            rows.append(row)
            print(
                f"  S={seq:5d} {name:15s} {row['tokens_per_s']:9.0f} tok/s  "
                f"peak {row['peak_mib']:9.2f} MiB  temp / activation formula "
                f"{row['temp_over_formula']:.2f}  (compile {row['compile_s']} s)",
                flush=True,
            )
            write_csv(args.out / "qwen35_speed.csv", rows)  # a crash keeps what was measured
    md = table(rows)
    print(md)
    env = environment()
    (args.out / "qwen35_speed.md").write_text(
        f"`python -m experiments.qwen35_speed{' --tiny' if args.tiny else ''}`: {head}; "
        f"{env['cpu']}, jax {env['jax']}. `deltanet-layers` is the Qwen3.5 model's "
        "linear-attention decoder layer four times (no attention layer). Ratios are to "
        "`qwen3`; growth is each model's peak over its peak at the sequence before; "
        "temp / formula is the compiled temp bytes over `jaxzero estimate`'s activation "
        "model (`DecoderShape`: layers, output, one layer's backward workspace).\n\n" + md + "\n"
    )
    return rows


def table(rows: list[dict]) -> str:
    """The Markdown table: each model's tokens/s and peak at each sequence, both as a
    ratio to ``qwen3``'s, and the peak's growth from the sequence before."""
    by = {(r["model"], r["seq"]): r for r in rows}
    seqs = sorted({r["seq"] for r in rows})
    lines = [
        "| S | model | tok/s | speed / qwen3 | peak MiB | peak / qwen3 | peak growth "
        "| temp / formula |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, s in enumerate(seqs):
        base = by[("qwen3", s)]
        for name in MODELS:
            r = by.get((name, s))
            if r is None:
                continue
            tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "not run"
            speed = (
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
                if r["tokens_per_s"] and base["tokens_per_s"]
                else ""
            )
            grow = ""
            if i and (name, seqs[i - 1]) in by:
                prev = seqs[i - 1]
                grow = f"{r['peak_mib'] / by[(name, prev)]['peak_mib']:.2f}x per {s // prev}x S"
            lines.append(
                f"| {s} | {name} | {tps} | {speed} | {r['peak_mib']:.1f} | "
                f"{r['peak_mib'] / base['peak_mib']:.2f} | {grow} | "
                f"{r['temp_over_formula']:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
