"""``jaxzero estimate``: the ZeRO formulas of :mod:`jaxzero.accounting.estimate` on a command line.

Given a parameter count, a GPT shape or a ``jaxzero train`` config (its model counted
exactly with ``jax.eval_shape``), print per-device memory and communication for
ZeRO stages 0-3. No devices needed. ``--frozen-params`` adds params that do not train
(a LoRA run's base): stored once in ``--frozen-dtype``, no gradient, master or
optimizer state; the table then shows trainable and frozen bytes apart, with each
stage's formula (``16Ψ + 2Ψf`` at stage 0 with mixed-precision Adam and a bf16 base).
``--offload optimizer`` keeps the fp32 master and the optimizer state in host memory at
stages 1-3 (device and host bytes apart, each with its formula, and the bytes each step
moves over the host link); ``--qwz`` and ``--qgz int8|int4`` count ZeRO++'s quantized
weight gathers and gradient reduce-scatters (payload and scales) beside the bytes without;
``--ema`` an EMA of the weights (fp32, stored as the master: 4Ψ/N from stage 1).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax

from jaxzero import cli, hf
from jaxzero.accounting.activations import DecoderShape, GPTShape
from jaxzero.accounting.estimate import (
    FROZEN_DTYPES,
    GB,
    OPTIMIZER_BYTES,
    PRECISIONS,
    Estimate,
    estimate,
)
from jaxzero.accounting.expected import unsplit_elements
from jaxzero.accounting.formulas import tensor_parallel_bytes, ulysses_bytes
from jaxzero.cli import Parser, beyond_zero_options
from jaxzero.models import Llama, Model, from_fields
from jaxzero.models import lora as lora_lib
from jaxzero.models.llama import CHUNK
from jaxzero.partition import is_layout, layouts_for, path_str
from jaxzero.settings import PRECISIONS as DTYPES
from jaxzero.train import config as config_lib
from jaxzero.train import finetune

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``'7.5e9'``, ``'7.5B'``, ``'350M'`` -> a number. Raises ValueError on nonsense."""
    m = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[-+]?\d+)?)\s*([kmbgt]?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read {text!r} as a number (examples: 7.5e9, 7.5B, 350M)")
    return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxzero estimate",
        description="Per-device memory and communication of ZeRO stages 0-3 (GB = 1e9 bytes).",
    )
    p.add_argument("--params", type=str, help="(trainable) parameter count, e.g. 7.5e9, 7.5B, 350M")
    p.add_argument(
        "--frozen-params",
        type=str,
        default=None,
        metavar="N",
        help="params that do not train (a LoRA run's base), e.g. 7B: stored once in "
        "--frozen-dtype, no gradient, master or optimizer state; sharded at stage 3 only",
    )
    p.add_argument(
        "--frozen-dtype",
        default="bf16",
        choices=sorted(FROZEN_DTYPES),
        help="the frozen params' stored dtype (default bf16: 2 bytes each)",
    )
    p.add_argument(
        "--config",
        metavar="YAML",
        help="a jaxzero train config: its model (GPT, Llama, or a fine-tune's "
        "train.init_from=hf:DIR with its LoRA adapters, counted exactly), batch, "
        "precision, remat and devices",
    )
    g = p.add_argument_group("GPT shape (instead of --params; also gives activation memory)")
    g.add_argument("--layers", type=int)
    g.add_argument("--d-model", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--vocab", type=int, default=50257)
    g.add_argument("--seq-len", type=int, default=1024)
    g.add_argument("--untied", action="store_true", help="separate output projection")
    p.add_argument("--devices", "-n", type=int, default=1, help="N, devices sharding the state")
    p.add_argument("--device-memory", type=float, default=80.0, help="GB per device")
    p.add_argument("--precision", default="mixed", help=f"one of {sorted(PRECISIONS)}")
    p.add_argument("--optimizer", default="adam", help=f"one of {sorted(OPTIMIZER_BYTES)}")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per device per pass")
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--remat", default="none", choices=["none", "full"])
    p.add_argument("--fused-attention", action="store_true")
    beyond_zero_options(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _beyond(args: argparse.Namespace, cfg: Any = None) -> dict[str, Any]:
    """``estimate``'s offload/qwZ/qgZ/EMA keywords: the flags, else a config's ``zero``
    section (and its ``train.ema``)."""
    zero = getattr(cfg, "zero", None)
    return {
        "offload": (args.offload or getattr(zero, "offload", None)) == "optimizer",
        "qwz": bool(args.qwz or getattr(zero, "qwz", False)),
        "qgz": args.qgz or getattr(zero, "qgz", None),
        "quant_block": args.quant_block,
        "ema": bool(args.ema or getattr(getattr(cfg, "train", None), "ema", None)),
    }


def _from_config(args: argparse.Namespace) -> Estimate:
    """The estimate of a train config: the params counted from the model itself
    (``jax.eval_shape``, or a fine-tune's checkpoint headers: nothing allocated), the
    activations from its own dimensions (a Llama-family model's by layer kind)."""
    cfg = config_lib.resolve(args.config, [])
    frozen: dict[str, Any] = {}
    model: Model
    path = finetune.source(cfg)
    if path is not None:  # what `jaxzero train` would train
        cfg = config_lib.validate(config_lib.load_file(args.config, finetune.defaults(cfg)))
        pretrained = finetune.pretrained(cfg)  # its data and tokenizer are the run's concern
        psi, frozen = _pretrained_counts(cfg, pretrained, path)
        model = pretrained
        shapes = hf.param_shapes(path, pretrained, DTYPES[cfg.precision.compute])
    else:
        if cfg.model.vocab_size is None:
            raise ValueError(
                f"{args.config}: model.vocab_size is needed (it is otherwise taken from the data)"
            )
        model = from_fields(asdict(cfg.model))
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        psi = float(sum(x.size for x in jax.tree.leaves(shapes)))
    devices = cfg.parallel.devices or args.devices
    m = cfg.mesh.model
    if devices % m:
        raise ValueError(f"mesh.model={m} must divide the {devices} devices")
    groups = _row_groups(cfg, devices) if cfg.mesh.ulysses else devices // m
    rows = cfg.train.batch_size // (groups * cfg.parallel.micro_batches)
    if rows < 1:
        raise ValueError(
            f"train.batch_size {cfg.train.batch_size} gives no rows per device "
            f"on {groups} data devices x {cfg.parallel.micro_batches} micro-batches"
        )
    split: dict[str, Any] = {}
    if m > 1:
        psi, split = _tensor_parallel(cfg, model, shapes, psi, rows)
    if cfg.mesh.ulysses:
        split = _ulysses(cfg, model, rows, devices // groups)
    return estimate(
        psi,
        devices // m,
        args.device_memory * GB,
        "mixed" if cfg.precision.compute == "bf16" else "fp32",
        args.optimizer,
        _shape(model, cfg.model),
        rows,
        cfg.parallel.micro_batches,
        "full" if cfg.model.remat == "full" else "none",
        args.fused_attention,
        **frozen,
        **_beyond(args, cfg),
        **split,
    )


def _tensor_parallel(
    cfg: Any, model: Model, shapes: Any, psi: float, rows: int
) -> tuple[float, dict[str, Any]]:
    """``mesh.model``: a model device's share of Ψ (each split param's slice, each other
    whole, by the model's own rules) and ``estimate``'s keywords for the model axis: its
    degree, Ψ and the bytes a device sends along it a step (the unsplit params' gradients
    counted whole, stage 0's: from stage 1 a device reduces its data shard of them)."""
    m = cfg.mesh.model
    rules_of = getattr(model, "tensor_parallel_rules", None)  # ReferenceModel's
    if rules_of is None:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel layout: mesh.model=1")
    rules = rules_of(m)  # refuses a model the axis cannot split
    lays = jax.tree.leaves(layouts_for(shapes, 1, rules=rules, model_shards=m), is_leaf=is_layout)
    local = float(sum(math.prod(x.local().shape) for x in lays))
    unsplit = unsplit_elements(lays, stage=0)
    c = model.config
    tokens = rows * cfg.model.seq_len * cfg.parallel.micro_batches
    act = 2.0 if cfg.precision.compute == "bf16" else 4.0
    comm = tensor_parallel_bytes(tokens, c.hidden_size, c.num_hidden_layers, m, act, unsplit, act)
    return local, {"model": m, "total_params": psi, "model_comm": comm}


def _row_groups(cfg: Any, devices: int) -> int:
    """Ulysses: the groups that split the rows (``mesh.group_size``'s; one without), each
    splitting a row's sequence over its devices."""
    size = cfg.mesh.group_size
    if size is None:
        return 1
    if size == "node" or devices % size:
        raise ValueError(
            f"mesh.ulysses with mesh.group_size={size!r}: estimate takes a group size in "
            f"devices that divides the {devices} devices"
        )
    return devices // size


def _ulysses(cfg: Any, model: Model, rows: int, n: int) -> dict[str, Any]:
    """``mesh.ulysses``: ``estimate``'s keywords: the devices a row's sequence is split
    over and the bytes of the all-to-alls a device sends a step."""
    c: Any = getattr(model, "config", None)
    if not hasattr(c, "num_key_value_heads"):
        raise ValueError(f"{type(model).__name__} has no Ulysses attention: drop mesh.ulysses")
    if cfg.model.seq_len % n:
        raise ValueError(f"mesh.ulysses: model.seq_len={cfg.model.seq_len} over {n} devices")
    tokens = rows * cfg.model.seq_len // n * cfg.parallel.micro_batches
    act = 2.0 if cfg.precision.compute == "bf16" else 4.0
    comm = ulysses_bytes(
        tokens, c.num_attention_heads, c.num_key_value_heads, c.head_size,
        c.num_hidden_layers, n, act, recompute=c.remat != "none",
    )  # fmt: skip
    return {"sequence": n, "sequence_comm": comm}


def _pretrained_counts(cfg: Any, model: Llama, path: Path) -> tuple[float, dict[str, Any]]:
    """A fine-tune's trainable params, and a LoRA run's frozen base with the bytes a
    param it is stored in (bf16 in a bf16 run, QLoRA's codes and scales), from the
    checkpoint's headers as the run stores them (:func:`jaxzero.hf.param_shapes`)."""
    dtype = DTYPES[cfg.precision.compute]
    leaves = jax.tree_util.tree_leaves_with_path(hf.param_shapes(path, model, dtype))
    if model.lora is None:
        return float(sum(x.size for _, x in leaves)), {}
    trainable = sum(x.size for p, x in leaves if lora_lib.trainable(path_str(p)))
    stored = sum(
        x.size * x.dtype.itemsize for p, x in leaves if not lora_lib.trainable(path_str(p))
    )
    # the base's count is the checkpoint's own (a QLoRA base stores codes and scales)
    plain = hf.param_shapes(path, Llama(model.config), dtype)
    count = float(sum(x.size for x in jax.tree.leaves(plain)))
    return float(trainable), {"frozen_params": count, "frozen_bytes_per_param": stored / count}


def _shape(model: Any, m: Any) -> GPTShape | DecoderShape:
    """The activation model's dimensions of ``model`` (a GPT, or a Llama-family decoder
    with its own options and Gated DeltaNet layers), at the run's sequence length."""
    if not isinstance(model, Llama):
        return GPTShape(m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.seq_len)
    return DecoderShape.of(model.config, CHUNK)


def _frozen(args: argparse.Namespace) -> dict[str, Any]:
    """``estimate``'s frozen keywords from ``--frozen-params`` and ``--frozen-dtype``."""
    if args.frozen_params is None:
        return {}
    frozen = parse_count(args.frozen_params)
    if not (math.isfinite(frozen) and frozen >= 0):
        raise ValueError(f"--frozen-params must be a count >= 0, got {args.frozen_params!r}")
    return {"frozen_params": frozen, "frozen_bytes_per_param": FROZEN_DTYPES[args.frozen_dtype]}


def _from_args(args: argparse.Namespace) -> Estimate:
    if args.config is not None:
        if args.params is not None or args.layers is not None:
            raise ValueError("give --config or --params/a GPT shape, not both")
        if args.frozen_params is not None:
            raise ValueError(
                "--frozen-params goes with --params or a GPT shape (the trainable params), "
                "not --config"
            )
        return _from_config(args)
    shape = None
    gpt = (args.layers, args.d_model, args.heads)
    if any(v is not None for v in gpt):
        if any(v is None for v in gpt):
            raise ValueError("a GPT shape needs --layers, --d-model and --heads together")
        shape = GPTShape(args.layers, args.d_model, args.heads, args.vocab, args.seq_len)
        for name in ("layers", "d_model", "heads", "vocab", "seq_len"):
            if getattr(shape, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if shape.d_model % shape.heads:
            raise ValueError(f"--d-model {shape.d_model} is not divisible by --heads {shape.heads}")
    if args.params is not None:
        psi = parse_count(args.params)
    elif shape is not None:
        psi = float(shape.num_params(tied=not args.untied))
    else:
        raise ValueError("give --params or a GPT shape (--layers, --d-model, --heads)")
    if not math.isfinite(args.device_memory) or args.device_memory <= 0:
        raise ValueError(f"--device-memory must be positive, got {args.device_memory}")
    frozen = _frozen(args)
    return estimate(
        psi,
        args.devices,
        args.device_memory * GB,
        args.precision,
        args.optimizer,
        shape,
        args.micro_batch,
        args.micro_batches,
        args.remat,
        args.fused_attention,
        **frozen,
        **_beyond(args),
    )


def main(argv: list[str] | None = None) -> int:
    """``jaxzero estimate``: print the estimate; 2 and a one-line message on bad input."""

    def body(args: argparse.Namespace) -> None:
        est = _from_args(args)
        print(json.dumps(est.to_dict(), indent=2) if args.json else est.table())

    # ValueError: the formulas refuse impossible numbers with one
    return cli.run("estimate", build_parser().parse_args, body, argv, also=(ValueError,))


if __name__ == "__main__":
    sys.exit(main())
