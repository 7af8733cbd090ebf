"""Tensor and sequence parallelism composed with ZeRO: traffic along each mesh axis and
activation memory, measured on the compiled step beside the formulas.

A Llama-shaped model is compiled (not run) on 8 simulated CPU devices:

* traffic: at (data=4, model=2) and (data=2, model=4), stages 0-3, every collective of
  the compiled HLO counted with its loop trip count and the ring formulas, split by the
  axis its device groups run along (within a model group: the ``model`` axis; across
  groups at the same position: ``data``). Beside it, the formulas:
  :func:`jaxzero.accounting.formulas.tensor_parallel_bytes` along ``model``; ZeRO's
  (:func:`~jaxzero.accounting.formulas.comm_bytes`) along ``data``, for Ψ the params a
  model device holds (each split leaf's slice, each unsplit one whole); at stage 3 the
  layers' params are gathered twice a micro-batch (forward, and again in the backward
  pass) and the embedding, head and final norm once a step (kept for the backward, the
  gather hoisted out of the micro-batch loop by XLA): (2k + k)Ψ_layers + (1 + k)Ψ_rest
  where docs/zero.md says 3kΨ.
* activation memory: the compiled step's temp bytes (its working memory: activations,
  gradients, the update's temporaries) at 8 rows a model group on (data=1, model=m),
  m = 1, 2, 4, for L and 2L layers; a layer's is the difference over L. Their ratios
  to m = 1's are what sequence and tensor parallelism divide. Ulysses: a device's temp
  against one device's on the same whole rows (1, 2 and 4 rows, sequence 1,024). The
  whole temp, not its growth a row: XLA's buffer assignment packs the temp unevenly
  from one batch to the next (the growth from 1 to 2 rows and from 3 to 4 differ by
  10%), and at equal gradients (stage 0) the whole temp's ratio bounds the activations'.
* a long fine-tune: Llama-3.2-1B's shape, one 32k-token row, bf16, ZeRO-3, on one
  device against Ulysses over 8 (compiled only).

Writes experiments/results/tp_traffic.{csv,md}. Two to four minutes on 2 CPU cores:

    python -m experiments.tp_traffic [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import sys

from jaxzero.mesh import simulate_devices

N_DEVICES = 8
simulate_devices(N_DEVICES)  # before JAX starts its backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxzero  # noqa: E402
from experiments.results_io import write_csv  # noqa: E402
from jaxzero.accounting import formulas  # noqa: E402
from jaxzero.accounting.comm import collectives_from_hlo, traffic  # noqa: E402
from jaxzero.accounting.expected import unsplit_elements  # noqa: E402
from jaxzero.models.llama import Llama, LlamaConfig  # noqa: E402
from jaxzero.partition import is_layout  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MODEL = LlamaConfig(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    seq_len=256,
    remat="none",
)
TINY = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    seq_len=16,
)


def _compiled(cfg: LlamaConfig, mesh, stage: int, rows: int, micro: int = 1):
    model = Llama(cfg)
    engine = model.engine(optax.adamw(1e-3), mesh=mesh, stage=stage, micro_batches=micro)
    state = engine.abstract_state(jax.eval_shape(model.init, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((rows, cfg.seq_len), np.int32)
    return engine, engine.compile(state, {"inputs": tokens, "targets": tokens})


def traffic_row(cfg: LlamaConfig, data: int, model: int, stage: int, micro: int) -> dict:
    mesh = jaxzero.make_mesh(N_DEVICES, model=model)
    rows = 2 * data * micro
    engine, compiled = _compiled(cfg, mesh, stage, rows, micro)
    found = collectives_from_hlo(compiled.as_text()).collectives
    tr = traffic(found, group_size=model)  # intra: a model group; inter: the data axis
    lays = jax.tree.leaves(engine.plan.layouts, is_leaf=is_layout)
    layers = sum(math.prod(x.local().shape) for x in lays if re.search(Llama.STACKED, x.path))
    local = sum(math.prod(x.local().shape) for x in lays)
    tokens = rows // data * cfg.seq_len
    along_model = formulas.tensor_parallel_bytes(
        tokens,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        model,
        unsplit=unsplit_elements(engine.plan.leaves(), stage),
    )
    along_data = formulas.comm_bytes(local, data, stage, 4.0, micro_batches=micro).total
    if stage == 3:  # the rest is gathered once a step: kept for the backward, and XLA
        # hoists its gather out of the micro-batch loop (its params do not change there)
        along_data -= (2 * micro - 1) * formulas.ring_bytes(
            "all-gather", (local - layers) * 4.0, data
        )
    return {
        "data": data,
        "model": model,
        "stage": stage,
        "micro_batches": micro,
        "params": engine.num_params,
        "params_a_model_device": local,
        "tokens_a_group": tokens,
        "model_axis_bytes": tr.by_scope["intra"],
        "model_axis_formula": along_model,
        "model_axis_ratio": round(tr.by_scope["intra"] / along_model, 4),
        "data_axis_bytes": tr.by_scope["inter"],
        "data_axis_formula": along_data,
        "data_axis_ratio": round(tr.by_scope["inter"] / along_data, 4) if along_data else None,
        "both_axes_bytes": tr.by_scope["both"],
        "scalar_bytes": tr.scalars,
    }


def memory_row(cfg: LlamaConfig, model: int, rows: int = 8) -> dict:
    """The compiled temp of a device of (data=1, model=``model``) at ``rows`` rows, stage
    0: the whole step's working memory, activations and all; a layer's, from L to 2L."""
    mesh = jaxzero.make_mesh(model, model=model)  # one data device: the model group alone
    deeper = dataclasses.replace(cfg, num_hidden_layers=2 * cfg.num_hidden_layers)
    temp = [_compiled(c, mesh, 0, rows)[1].memory_analysis().temp_size_in_bytes
            for c in (cfg, deeper)]  # fmt: skip
    return {
        "model": model,
        "layers": cfg.num_hidden_layers,
        "rows": rows,
        "temp": temp[0],
        "a_layer": (temp[1] - temp[0]) / cfg.num_hidden_layers,
    }


def ulysses_row(
    cfg: LlamaConfig, n: int, rows: int, stage: int = 0, precision: str = "fp32"
) -> dict:
    """Ulysses over ``n`` data devices (each a slice of every row's sequence) against one
    device holding the same whole rows: each one's compiled temp (the working memory)
    and arguments (the state)."""
    out: dict = {"sequence": cfg.seq_len, "devices": n, "rows": rows, "stage": stage}
    for label, mesh, ulysses in (("one", jaxzero.make_mesh(1), False),
                                 ("ulysses", jaxzero.make_mesh(n), True)):  # fmt: skip
        model = Llama(cfg)
        engine = model.engine(optax.adamw(1e-3), mesh=mesh, stage=stage, precision=precision,
                              ulysses=ulysses)  # fmt: skip
        state = engine.abstract_state(jax.eval_shape(model.init, jax.random.key(0)))
        tokens = jax.ShapeDtypeStruct((rows, cfg.seq_len), np.int32)
        m = engine.compile(state, {"inputs": tokens, "targets": tokens}).memory_analysis()
        out[f"{label}_temp"] = m.temp_size_in_bytes
        out[f"{label}_arguments"] = m.argument_size_in_bytes
        out["params"] = engine.num_params
    out["ratio"] = round(out["ulysses_temp"] / out["one_temp"], 4)
    return out


# Llama-3.2-1B's shape (1.24B params, tied head), a 32k-token row: the long fine-tune
# Ulysses is for (compiled, never run: XLA's attention keeps each head's scores)
LONG = LlamaConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    seq_len=32768,
    max_position_embeddings=131072,
    remat="full",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model: the code paths only")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else MODEL
    grid = [(4, 2, s, 1) for s in range(4)] + [(2, 4, s, 1) for s in range(4)]
    grid += [(4, 2, 3, 2)]  # micro-batches: the sequence traffic is the group's tokens
    if args.tiny:
        grid = [(4, 2, 3, 2), (2, 4, 1, 1)]
    rows = []
    print(f"{'mesh':>12} {'stage':>5} {'k':>2} | {'model axis: measured/formula':>30} | "
          f"{'data axis: measured/formula':>30}")  # fmt: skip
    for data, model, stage, micro in grid:
        r = traffic_row(cfg, data, model, stage, micro)
        rows.append(r)
        print(
            f"{f'({data}, {model})':>12} {stage:>5} {micro:>2} | "
            f"{r['model_axis_bytes'] / 2**20:9.2f} / {r['model_axis_formula'] / 2**20:8.2f} MiB "
            f"= {r['model_axis_ratio']:6.4f} | "
            f"{r['data_axis_bytes'] / 2**20:9.2f} / {r['data_axis_formula'] / 2**20:8.2f} MiB "
            f"= {r['data_axis_ratio'] or 0:6.4f}",
            flush=True,
        )
    memory = [memory_row(cfg, m) for m in (1, 2, 4)]
    base, layer = memory[0]["temp"], memory[0]["a_layer"]
    print(f"\nthe compiled temp a device, {memory[0]['rows']} rows a model group "
          f"({cfg.num_hidden_layers} layers), and a layer's, against model=1:")  # fmt: skip
    for r in memory:
        r["ratio"] = round(r["temp"] / base, 4)
        r["layer_ratio"] = round(r["a_layer"] / layer, 4)
        print(f"  model={r['model']}: {r['temp'] / 2**20:8.3f} MiB = {r['ratio']:.4f} of "
              f"model=1 ({r['ratio'] * r['model']:.3f} / model); a layer "
              f"{r['a_layer'] / 2**20:7.3f} MiB = {r['layer_ratio']:.4f} "
              f"({r['layer_ratio'] * r['model']:.3f} / model)")  # fmt: skip
    long = dataclasses.replace(cfg, seq_len=4 * cfg.seq_len)
    ulysses = [ulysses_row(long, 4, rows) for rows in ((1,) if args.tiny else (1, 2, 4))]
    print(f"\nUlysses over 4 devices, sequence {long.seq_len}: the compiled temp a device "
          "against one device's on the same rows")  # fmt: skip
    for r in ulysses:
        print(f"  {r['rows']} row(s): {r['ulysses_temp'] / 2**20:.3f} MiB against "
              f"{r['one_temp'] / 2**20:.3f} = {r['ratio']:.4f}")  # fmt: skip
    if not args.tiny:
        r = ulysses_row(LONG, 8, 1, stage=3, precision="bf16")  # a long fine-tune
        print(f"\n{r['params'] / 1e9:.2f}B params, one {r['sequence']}-token row, bf16, "
              f"stage 3: temp {r['one_temp'] / 2**30:.1f} GiB on one device, "
              f"{r['ulysses_temp'] / 2**30:.1f} GiB a device of {r['devices']} with Ulysses "
              f"= {r['ratio']:.4f}")  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "tp_traffic.csv", rows)
        write_csv(args.out / "tp_memory.csv", memory)
        write_csv(args.out / "ulysses_memory.csv", ulysses)
        write_csv(args.out / "ulysses_long.csv", [r])
        (args.out / "tp_traffic.md").write_text(markdown(cfg, rows, memory, ulysses, r))
    return 0


def markdown(
    cfg: LlamaConfig, rows: list[dict], memory: list[dict], ulysses: list[dict], long: dict
) -> str:
    """The tables docs/tensor-parallel.md quotes."""
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    out = [
        "# Tensor and sequence parallelism with ZeRO: traffic and activations, compiled\n",
        "Generated by `python -m experiments.tp_traffic`. A Llama of "
        f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
        f"heads ({cfg.num_key_value_heads} key/value), MLP {cfg.intermediate_size}, vocabulary "
        f"{cfg.vocab_size}, sequence {cfg.seq_len}, fp32, 2 rows a model group and micro-batch; "
        "8 simulated CPU devices. MiB a device a step.\n",
        "| data | model | stage | k | model axis | formula | ratio | data axis | formula | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['data']} | {r['model']} | {r['stage']} | {r['micro_batches']} | "
            f"{mib(r['model_axis_bytes'])} | {mib(r['model_axis_formula'])} | "
            f"{r['model_axis_ratio']:.4f} | {mib(r['data_axis_bytes'])} | "
            f"{mib(r['data_axis_formula'])} | {r['data_axis_ratio']:.4f} |"
        )
    out += [
        "",
        f"The compiled temp a device (the step's working memory: activations, gradients, "
        f"what the update needs), {memory[0]['rows']} rows a model group on (data=1, "
        f"model=m), stage 0, for {cfg.num_hidden_layers} layers; and a layer's share (from "
        f"{cfg.num_hidden_layers} to {2 * cfg.num_hidden_layers} layers):\n",
        "| model | temp, MiB | of model=1 | a layer, MiB | of model=1 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in memory:
        out.append(
            f"| {r['model']} | {mib(r['temp'])} | {r['ratio']:.4f} | "
            f"{mib(r['a_layer'])} | {r['layer_ratio']:.4f} |"
        )
    out += [
        "",
        "Ulysses (`Engine(ulysses=True)`): each of n data devices holds a slice of every row's "
        "sequence; the compiled temp a device against one device's on the same whole rows "
        "(stage 0):\n",
        "| sequence | devices | rows | one device, MiB | Ulysses, MiB a device | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in ulysses:
        out.append(
            f"| {r['sequence']} | {r['devices']} | {r['rows']} | {mib(r['one_temp'])} | "
            f"{mib(r['ulysses_temp'])} | {r['ratio']:.4f} |"
        )
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    r = long
    out += [
        "",
        f"A long fine-tune: Llama-3.2-1B's shape ({r['params'] / 1e9:.2f}B params, tied "
        f"head), one {r['sequence']}-token row, bf16, stage 3, layers recomputed, XLA's "
        "attention (compiled, not run):\n",
        "| sequence | devices | one device: temp, GiB | arguments | Ulysses a device: temp, "
        "GiB | arguments | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {r['sequence']} | {r['devices']} | {gib(r['one_temp'])} | "
        f"{gib(r['one_arguments'])} | {gib(r['ulysses_temp'])} | "
        f"{gib(r['ulysses_arguments'])} | {r['ratio']:.4f} |",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
