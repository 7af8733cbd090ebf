"""``jaxzero report``: compile one training step and print what it really costs.

Builds the reference GPT and an Engine for the requested stage, mesh and precision,
compiles the step without running it, and prints :mod:`jaxzero.accounting.measure`'s
measured memory and communication beside the ZeRO formulas. On a machine without
an accelerator it simulates CPU devices (default 8), so the sharding is real even
on a laptop: the collectives and per-device bytes are those a cluster would see.
``--lora-rank`` reports a LoRA step of the Llama: its base frozen in ``--base-dtype``,
counted apart from the adapters that train (the report's "frozen params" row).
``--offload optimizer`` keeps the fp32 master and the optimizer state in host memory: the
report splits the state into device and host bytes, each beside its formula, and says
which of the compiled step's parameters and outputs live in host memory and what moves
them; ``--qwz``/``--qgz`` report ZeRO++'s quantized collectives beside their formulas.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxzero
from jaxzero import cli
from jaxzero.cli import Parser, beyond_zero_options, output_problem
from jaxzero.mesh import accelerator_expected, replicas_for, simulate_devices
from jaxzero.models import from_fields


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxzero report",
        description="Compile (not run) a GPT or Llama training step; print measured memory and "
        "communication per device beside the ZeRO formulas.",
    )
    p.add_argument(
        "--stage",
        type=int,
        nargs="+",
        default=[3],
        choices=[0, 1, 2, 3],
        help="ZeRO stage(s) to report (several: one report each)",
    )
    p.add_argument("--devices", type=int, default=None, help="devices in the mesh (default all)")
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        metavar="G",
        help="hybrid sharding: shard the state within groups of G devices, replicate "
        "it across groups (default: one group of all devices)",
    )
    p.add_argument(
        "--model-axis",
        type=int,
        default=1,
        metavar="M",
        help="llama: split each layer over M neighbouring devices (tensor and sequence "
        "parallel, as mesh.model in a run); ZeRO shards over the rest",
    )
    p.add_argument(
        "--ulysses",
        action="store_true",
        help="llama: split each row's sequence over the data devices (DeepSpeed-Ulysses, "
        "as mesh.ulysses in a run); with --group-size, the rows over the groups",
    )
    p.add_argument(
        "--simulate-devices",
        type=int,
        default=None,
        help="CPU devices to simulate (default 8 when no accelerator is present)",
    )
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument(
        "--reduce-dtype",
        default=None,
        choices=["fp32", "bf16"],
        help="gradient reduction dtype (default: the compute dtype)",
    )
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
    p.add_argument(
        "--arch",
        default="gpt",
        choices=["gpt", "llama"],
        help="gpt: the reference GPT; llama: the Llama (--kv-heads for GQA)",
    )
    p.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="llama: LoRA adapters of rank R on every linear layer (alpha 2R); the base "
        "is frozen (no gradient, master or optimizer state)",
    )
    p.add_argument(
        "--base-dtype",
        default="bf16",
        choices=["bf16", "fp32", "int8", "nf4"],
        help="with --lora-rank: the frozen base's stored dtype (default bf16, as a "
        "fine-tune loads it); int8/nf4: QLoRA, the targets' weights quantized (codes and "
        "block scales), the rest of the base bf16",
    )
    beyond_zero_options(p, hpz=True)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch (default: 2 sequences per device per micro-batch)",
    )
    p.add_argument("--remat", default="none", choices=["none", "full", "dots"])
    p.add_argument(
        "--dump-hlo",
        default=None,
        metavar="PATH",
        help="also write the compiled HLO text here, the stage before the extension "
        "(x.txt: x.stage3.txt); missing parent directories are created",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _validate(args: argparse.Namespace) -> None:
    for name in ("micro_batches", "d_model", "layers", "heads", "seq_len", "vocab"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
    if args.lora_rank is not None and args.arch != "llama":
        raise ValueError("--lora-rank adapts the Llama: add --arch llama")
    if args.model_axis > 1 and args.arch != "llama":
        raise ValueError("--model-axis splits the Llama's layers: add --arch llama")
    if args.ulysses and args.arch != "llama":
        raise ValueError("--ulysses splits the Llama's attention by heads: add --arch llama")
    for name in ("devices", "simulate_devices", "batch", "group_size", "lora_rank", "model_axis"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.dump_hlo:
        for stage in args.stage:  # before compiling anything: a bad path fails at once
            problem = output_problem(hlo_path(args.dump_hlo, stage))
            if problem:
                raise ValueError(f"--dump-hlo: cannot write {args.dump_hlo!r}: {problem}")


def hlo_path(path: str, stage: int) -> Path:
    """Where stage ``stage``'s HLO goes: ``x.txt`` -> ``x.stage3.txt`` (``x`` -> ``x.stage3``)."""
    p = Path(path)
    return p.with_name(f"{p.stem}.stage{stage}{p.suffix}")


def build(args: argparse.Namespace, stage: int) -> tuple[Any, Any, Any, Any]:
    """The model, its Engine, the initial state and a sample batch for ``stage``."""
    n = args.devices or jax.device_count()
    m = args.model_axis
    mesh = jaxzero.make_mesh(n, replicas=replicas_for(args.group_size, n, n), model=m)
    lora = None
    if args.lora_rank is not None:
        from jaxzero.models.lora import LoraConfig

        quant = args.base_dtype if args.base_dtype in ("int8", "nf4") else None
        lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, base_dtype=quant)
    model = from_fields(
        dict(
            arch=args.arch,
            vocab_size=args.vocab,
            seq_len=args.seq_len,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            n_kv_heads=args.kv_heads,
            remat=args.remat,
        ),
        lora=lora,
    )
    engine = model.engine(
        optax.adamw(1e-3),
        mesh=mesh,
        stage=stage,
        precision=args.precision,
        reduce_dtype=args.reduce_dtype,
        micro_batches=args.micro_batches,
        donate=True,  # as on accelerators, whatever this machine's default
        offload=args.offload,
        qwz=args.qwz,
        qgz=args.qgz,
        quant_block=args.quant_block,
        hpz=args.hpz,
        ema=0.999 if args.ema else None,  # the decay changes no byte
        ulysses=args.ulysses,
    )

    def init(key: jax.Array) -> Any:
        params = model.init(key)
        if lora is not None and args.base_dtype != "fp32":  # as a fine-tune loads its base
            params = _frozen_in(params, engine.trainable, jnp.bfloat16)
        return params

    state = engine.init_from(init, jax.random.key(0))
    rows = engine.batch_devices // (engine.settings.num_shards if args.ulysses else 1)
    batch_size = args.batch or 2 * rows * args.micro_batches  # Ulysses: rows over groups
    tokens = jnp.zeros((batch_size, args.seq_len), jnp.int32)
    return model, engine, state, {"inputs": tokens, "targets": tokens}


def _frozen_in(params: Any, trainable: Any, dtype: Any) -> Any:
    """``params`` with every frozen float leaf (False by ``trainable``, a path predicate)
    in ``dtype``: a base as a fine-tune loads it, the adapters as initialised. QLoRA's
    quantized weights (``weight_codes``, ``weight_scale``) stay as quantized."""
    from jaxzero.partition import path_str

    def cast(path: Any, x: jax.Array) -> jax.Array:
        name = path_str(path)
        keep = trainable(name) or name.rsplit("/", 1)[-1].startswith("weight_")
        return x if keep or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def main(argv: list[str] | None = None) -> int:
    """``jaxzero report``: returns 0, or 2 with a one-line message on bad input."""

    def body(args: argparse.Namespace) -> None:
        _validate(args)
        # here: it takes 0.1 s to import (measured beside `import jaxzero`); --help need not pay
        from jaxzero.accounting import measure as accounting

        n_sim = args.simulate_devices
        if n_sim is None and not accelerator_expected():
            n_sim = max(8, args.devices or 0)
        if n_sim is not None:
            simulate_devices(n_sim)
        reports = []
        for stage in args.stage:
            model, engine, state, batch = build(args, stage)
            compiled = engine.compile(state, batch)
            if args.dump_hlo:
                hlo_path(args.dump_hlo, stage).write_text(compiled.as_text())
            reports.append(accounting.report(engine, state, batch, model=model, compiled=compiled))
        if args.json:
            out = [r.to_dict() for r in reports]
            print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        else:
            print("\n\n".join(r.table() for r in reports))

    # ValueError: _validate's checks and the model's own; RuntimeError: XLA refusing the
    # step (its first line); OSError: writing --dump-hlo
    also = (ValueError, RuntimeError, OSError)
    return cli.run("report", build_parser().parse_args, body, argv, also=also)


if __name__ == "__main__":
    sys.exit(main())
