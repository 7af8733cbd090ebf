"""ZeRO memory and communication estimator: the paper's formulas, no devices needed.

``jaxzero estimate`` answers "does this model fit, and at which stage?" before
anyone rents a cluster. It applies the per-device formulas of docs/zero.md
(``shared/design/zero.md``): model states (params, gradients, optimizer state),
activations (Korthikanti et al. 2022) and ring communication per step. The same
functions give :mod:`jaxzero.accounting.measure` its theoretical side, so measured and
predicted numbers always come from one definition.

GB here means 1e9 bytes, as in the ZeRO paper.

Example:
  >>> round(model_state_bytes(7.5e9, 64, 1).total / 1e9, 1)
  31.4
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field

import jax

from jaxzero import cli
from jaxzero.cli import Parser
from jaxzero.models import from_fields
from jaxzero.train import config as config_lib

GB = 1e9
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}

# Bytes of optimizer state per parameter, excluding any fp32 master copy. Adam keeps two
# fp32 moments; SGD with momentum one; an Adafactor-like optimizer factors its second
# moment into row and column statistics (O(rows + cols), negligible per parameter) and
# keeps no first moment.
OPTIMIZER_BYTES = {
    "adam": 8.0,
    "adamw": 8.0,
    "sgd-momentum": 4.0,
    "sgd": 0.0,
    "adafactor": 0.0,
}

# Working (16-bit or 32-bit) bytes per element, and whether an fp32 master copy exists.
PRECISIONS = {
    "mixed": (2, True),
    "bf16": (2, True),
    "fp16": (2, True),
    "fp32": (4, False),
}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for each part of the model states.

    Attributes:
      param: bytes of one working parameter (2 in 16-bit mixed precision, 4 in fp32).
      grad: bytes of one gradient element (same as the working params).
      master: bytes of the fp32 master copy (4 in mixed precision, 0 in fp32).
      optimizer: bytes of optimizer moments per parameter (8 for Adam).
    """

    param: float
    grad: float
    master: float
    optimizer: float

    @property
    def k(self) -> float:
        """The paper's K: optimizer-state bytes per parameter, master copy included."""
        return self.master + self.optimizer


def precision_bytes(precision: str = "mixed", optimizer: str = "adam") -> Precision:
    """Per-parameter byte counts for a precision and optimizer name.

    Raises:
      ValueError: on an unknown precision or optimizer, naming the valid choices.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_BYTES)}"
        )
    width, has_master = PRECISIONS[precision]
    return Precision(
        param=width,
        grad=width,
        master=4.0 if has_master else 0.0,
        optimizer=OPTIMIZER_BYTES[optimizer],
    )


def _check(psi: float, n: int, stage: int) -> None:
    if not (isinstance(psi, int | float) and math.isfinite(psi) and psi > 0):
        raise ValueError(f"parameter count must be a positive number, got {psi!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"number of devices must be a positive integer, got {n!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes per device for one stage (ZeRO paper, section 5).

    Attributes:
      params: working parameters.
      grads: gradients (transient: they live inside the step).
      master: fp32 master parameters (0 in fp32 training).
      optimizer: optimizer moments.
    """

    params: float
    grads: float
    master: float
    optimizer: float

    @property
    def persistent(self) -> float:
        """What the train state holds between steps: params + master + moments."""
        return self.params + self.master + self.optimizer

    @property
    def total(self) -> float:
        """The paper's figure: persistent state plus gradients."""
        return self.persistent + self.grads


def model_state_bytes(psi: float, n: int, stage: int, prec: Precision | None = None) -> ModelStates:
    """Per-device model-state bytes: docs/zero.md's memory table.

    Stage 1 shards the optimizer state (and master), stage 2 also the gradients,
    stage 3 also the working parameters; everything sharded is divided by ``n``.

    Args:
      psi: parameter count Ψ.
      n: devices that shard the state (N).
      stage: ZeRO stage 0-3.
      prec: byte counts; default mixed precision with Adam (K = 12).
    """
    _check(psi, n, stage)
    prec = prec or precision_bytes()
    os_div = n if stage >= 1 else 1
    g_div = n if stage >= 2 else 1
    p_div = n if stage >= 3 else 1
    return ModelStates(
        params=prec.param * psi / p_div,
        grads=prec.grad * psi / g_div,
        master=prec.master * psi / os_div,
        optimizer=prec.optimizer * psi / os_div,
    )


def max_params(device_bytes: float, n: int, stage: int, prec: Precision | None = None) -> float:
    """Largest Ψ whose model states (with gradients) fit in ``device_bytes`` per device.

    The inverse of :func:`model_state_bytes`, ignoring activations and buffers, as the
    ZeRO paper's section 5 does (N = 64, 32 GB: about 7.6B / 14.4B / 128B for stages 1-3).
    """
    if not device_bytes > 0:
        raise ValueError(f"device memory must be positive, got {device_bytes!r}")
    per_param = model_state_bytes(1.0, n, stage, prec).total
    return device_bytes / per_param


@dataclass(frozen=True)
class Communication:
    """Bytes on the wire per device per step, ring algorithm.

    Attributes:
      grad: gradient reduction traffic (all-reduce or reduce-scatter).
      param: parameter all-gather traffic.
    """

    grad: float
    param: float

    @property
    def total(self) -> float:
        return self.grad + self.param


def ring_bytes(kind: str, full_bytes: float, n: int) -> float:
    """Bytes one device sends for a ring collective over a full buffer of ``full_bytes``.

    All-reduce is a reduce-scatter followed by an all-gather, hence twice the traffic.
    ``full_bytes`` is the whole buffer: the output of an all-gather, the input of a
    reduce-scatter, the operand of an all-reduce or all-to-all.
    """
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if kind == "all-reduce":
        return 2.0 * full_bytes * frac
    if kind in ("reduce-scatter", "all-gather", "all-to-all"):
        return full_bytes * frac
    if kind == "collective-permute":
        return float(full_bytes)
    raise ValueError(f"no ring formula for collective {kind!r}")


def comm_bytes(
    psi: float,
    n: int,
    stage: int,
    grad_bytes: float = 2.0,
    param_bytes: float | None = None,
    micro_batches: int = 1,
    param_gathers: int = 2,
) -> Communication:
    """Per-device bytes on the wire per optimizer step (docs/zero.md's communication table).

    Stage 0 all-reduces the gradients once (2Ψb); stages 1 and 2 reduce-scatter the
    gradients and all-gather the updated params (Ψb each, 2Ψb together); stage 3
    gathers params in forward and again in backward and reduce-scatters gradients
    (3Ψb). All times (N−1)/N. With ``k`` micro-batches, stages 0-1 accumulate
    locally and still communicate once; stage 2 reduce-scatters each micro-batch's
    gradients as they are produced (kΨb + Ψb); stage 3 gathers and reduce-scatters
    per micro-batch (3kΨb).

    Args:
      psi: parameter count Ψ.
      n: devices (N).
      stage: ZeRO stage.
      grad_bytes: bytes per gradient element on the wire (the reduce dtype).
      param_bytes: bytes per parameter element gathered; defaults to ``grad_bytes``.
      micro_batches: gradient-accumulation steps per optimizer step (k).
      param_gathers: stage-3 gathers of each param per micro-batch: 2 (forward and
        backward, per-layer models), 1 when the whole tree is gathered once and kept
        through the backward pass (jaxzero's coarse mode, ``per_layer=False``).
    """
    _check(psi, n, stage)
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    pb = grad_bytes if param_bytes is None else param_bytes
    k = micro_batches
    g_full, p_full = psi * grad_bytes, psi * pb
    if stage == 0:
        return Communication(grad=ring_bytes("all-reduce", g_full, n), param=0.0)
    if stage == 1:
        return Communication(
            grad=ring_bytes("reduce-scatter", g_full, n), param=ring_bytes("all-gather", p_full, n)
        )
    if stage == 2:
        return Communication(
            grad=k * ring_bytes("reduce-scatter", g_full, n),
            param=ring_bytes("all-gather", p_full, n),
        )
    return Communication(
        grad=k * ring_bytes("reduce-scatter", g_full, n),
        param=param_gathers * k * ring_bytes("all-gather", p_full, n),
    )


@dataclass(frozen=True)
class GPTShape:
    """The dimensions of a GPT that matter to memory.

    Attributes:
      layers: transformer blocks (L).
      d_model: hidden size (h).
      heads: attention heads (a).
      vocab: vocabulary size (V).
      seq_len: sequence length (s).
    """

    layers: int
    d_model: int
    heads: int
    vocab: int
    seq_len: int

    def num_params(self, tied: bool = True) -> int:
        """Parameters of a GPT-2 style model with biases and learned positions.

        Per block 12h² + 13h (QKV 3h²+3h, projection h²+h, MLP 8h²+5h, two layer
        norms 4h); plus token and position embeddings, the final layer norm and,
        if untied, an output projection.
        """
        h = self.d_model
        blocks = self.layers * (12 * h * h + 13 * h)
        embed = self.vocab * h + self.seq_len * h
        head = 0 if tied else self.vocab * h
        return blocks + embed + 2 * h + head


@dataclass(frozen=True)
class Activations:
    """Activation bytes per device (Korthikanti et al. 2022, no tensor/sequence parallel).

    Attributes:
      per_layer: bytes one transformer block keeps for backward.
      layers: bytes for all blocks (with full remat: the saved block inputs plus one
        block's activations being recomputed).
      output: the output layer's logits and softmax, 4·s·b·(h + V) bytes.
    """

    per_layer: float
    layers: float
    output: float

    @property
    def total(self) -> float:
        return self.layers + self.output


def activation_bytes(
    shape: GPTShape,
    micro_batch: int = 1,
    remat: str = "none",
    fused_attention: bool = False,
    bytes_per_value: float = 2.0,
) -> Activations:
    """Activation memory of one micro-batch on one device.

    Without recomputation a block keeps s·b·h·(34 + 5·a·s/h) bytes in 16-bit; a
    fused (flash) attention never materialises the a·s² scores, dropping the second
    term. Full remat keeps only each block's input (2·s·b·h) and recomputes one
    block at a time in backward. fp32 activations double everything.

    Args:
      shape: model dimensions.
      micro_batch: sequences per device per micro-batch (b).
      remat: "none" or "full".
      fused_attention: attention scores are not stored.
      bytes_per_value: 2 for 16-bit activations, 4 for fp32.
    """
    if remat not in ("none", "full"):
        raise ValueError(f"remat must be 'none' or 'full', got {remat!r}")
    for name in ("layers", "d_model", "heads", "vocab", "seq_len"):
        if getattr(shape, name) < 1:
            raise ValueError(f"{name} must be positive, got {getattr(shape, name)!r}")
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be positive, got {micro_batch!r}")
    s, b, h, a = shape.seq_len, micro_batch, shape.d_model, shape.heads
    scale = bytes_per_value / 2.0
    coeff = 34.0 + (0.0 if fused_attention else 5.0 * a * s / h)
    per_layer = s * b * h * coeff * scale
    if remat == "full":
        layers = shape.layers * 2.0 * s * b * h * scale + per_layer
    else:
        layers = shape.layers * per_layer
    output = 4.0 * s * b * (h + shape.vocab) * scale
    return Activations(per_layer=per_layer, layers=layers, output=output)


@dataclass
class StageEstimate:
    """One stage's row of the estimate (bytes unless stated)."""

    stage: int
    name: str
    params: float
    grads: float
    master: float
    optimizer: float
    persistent: float
    model_states: float
    activations: float | None
    total: float
    fits: bool
    comm_grad: float
    comm_param: float
    comm_total: float
    max_params: float


@dataclass
class Estimate:
    """Everything ``jaxzero estimate`` prints, for every stage."""

    num_params: float
    devices: int
    device_memory: float
    precision: str
    optimizer: str
    k: float
    micro_batches: int
    activations: Activations | None
    stages: list[StageEstimate] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """Human-readable table, GB = 1e9 bytes."""
        lines = [
            f"Ψ = {self.num_params:.4g} parameters, N = {self.devices} devices of "
            f"{self.device_memory / GB:g} GB, {self.precision} precision, {self.optimizer} "
            f"(K = {self.k:g}), {self.micro_batches} micro-batch(es) per step",
        ]
        if self.activations is not None:
            act = self.activations
            lines.append(
                f"activations per device: {act.per_layer / GB:.3f} GB per layer, "
                f"{act.total / GB:.3f} GB in all (output layer {act.output / GB:.3f} GB)"
            )
        head = (
            f"{'stage':<14}{'params':>9}{'grads':>9}{'optim':>9}{'states':>9}"
            f"{'+act':>9}  fits  {'comm/step':>10}  {'max Ψ (states only)':>20}"
        )
        lines += ["", "GB per device", head, "-" * len(head)]
        for r in self.stages:
            with_act = "-" if r.activations is None else f"{r.total / GB:.2f}"
            lines.append(
                f"{r.stage} ({r.name})".ljust(14)
                + f"{r.params / GB:>9.2f}{r.grads / GB:>9.2f}"
                + f"{(r.master + r.optimizer) / GB:>9.2f}{r.model_states / GB:>9.2f}"
                + f"{with_act:>9}  {'yes ' if r.fits else 'NO  '}  {r.comm_total / GB:>10.2f}"
                + f"  {format_count(r.max_params):>20}"
            )
        return "\n".join(lines)


def format_count(x: float) -> str:
    """``7.64e9`` -> ``'7.64B'``: parameter counts as people say them."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def estimate(
    num_params: float,
    devices: int,
    device_memory: float = 80 * GB,
    precision: str = "mixed",
    optimizer: str = "adam",
    shape: GPTShape | None = None,
    micro_batch: int = 1,
    micro_batches: int = 1,
    remat: str = "none",
    fused_attention: bool = False,
) -> Estimate:
    """Memory, fit and communication for every ZeRO stage.

    Args:
      num_params: Ψ.
      devices: N.
      device_memory: bytes per device.
      precision: "mixed"/"bf16"/"fp16" (16-bit + fp32 master) or "fp32".
      optimizer: a key of ``OPTIMIZER_BYTES``.
      shape: GPT dimensions, for activation memory (None: model states only).
      micro_batch: sequences per device per micro-batch.
      micro_batches: gradient-accumulation steps (k).
      remat: "none" or "full" activation recomputation.
      fused_attention: no stored attention scores.
    """
    prec = precision_bytes(precision, optimizer)
    _check(num_params, devices, 0)
    if not device_memory > 0:
        raise ValueError(f"device memory must be positive, got {device_memory!r}")
    act = None
    if shape is not None:
        act = activation_bytes(shape, micro_batch, remat, fused_attention, prec.param)
    out = Estimate(
        num_params=float(num_params),
        devices=devices,
        device_memory=float(device_memory),
        precision=precision,
        optimizer=optimizer,
        k=prec.k,
        micro_batches=micro_batches,
        activations=act,
    )
    for stage in STAGES:
        ms = model_state_bytes(num_params, devices, stage, prec)
        comm = comm_bytes(num_params, devices, stage, prec.grad, prec.param, micro_batches)
        total = ms.total + (act.total if act else 0.0)
        out.stages.append(
            StageEstimate(
                stage=stage,
                name=STAGE_NAMES[stage],
                params=ms.params,
                grads=ms.grads,
                master=ms.master,
                optimizer=ms.optimizer,
                persistent=ms.persistent,
                model_states=ms.total,
                activations=act.total if act else None,
                total=total,
                fits=total <= device_memory,
                comm_grad=comm.grad,
                comm_param=comm.param,
                comm_total=comm.total,
                max_params=max_params(device_memory, devices, stage, prec),
            )
        )
    return out


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
    p.add_argument("--params", type=str, help="parameter count, e.g. 7.5e9, 7.5B, 350M")
    p.add_argument(
        "--config",
        metavar="YAML",
        help="a jaxzero train config: its model (GPT or "
        "Llama, counted exactly), batch, precision, remat and devices",
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
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _from_config(args: argparse.Namespace) -> Estimate:
    """The estimate of a train config: the params counted from the model itself
    (``jax.eval_shape``, nothing allocated); activations from its GPT-like dimensions."""
    cfg = config_lib.resolve(args.config, [])
    m = cfg.model
    if m.vocab_size is None:
        raise ValueError(
            f"{args.config}: model.vocab_size is needed (it is otherwise taken from the data)"
        )
    model = from_fields(asdict(m))
    psi = float(sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0)))))
    devices = cfg.parallel.devices or args.devices
    shape = GPTShape(m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.seq_len)
    rows = cfg.train.batch_size // (devices * cfg.parallel.micro_batches)
    if rows < 1:
        raise ValueError(
            f"train.batch_size {cfg.train.batch_size} gives no rows per device "
            f"on {devices} devices x {cfg.parallel.micro_batches} micro-batches"
        )
    return estimate(
        psi,
        devices,
        args.device_memory * GB,
        "mixed" if cfg.precision.compute == "bf16" else "fp32",
        args.optimizer,
        shape,
        rows,
        cfg.parallel.micro_batches,
        "full" if m.remat == "full" else "none",
        args.fused_attention,
    )


def _from_args(args: argparse.Namespace) -> Estimate:
    if args.config is not None:
        if args.params is not None or args.layers is not None:
            raise ValueError("give --config or --params/a GPT shape, not both")
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
