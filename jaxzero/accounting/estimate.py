"""ZeRO memory and communication estimator: the paper's formulas, no devices needed.

``jaxzero estimate`` (:mod:`jaxzero.commands.estimate`) answers "does this model fit,
and at which stage?" before anyone rents a cluster. This module is its formulas, pure
and importing nothing of jaxzero: it applies the per-device formulas of docs/zero.md
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

import math
import re
from dataclasses import asdict, dataclass, field

from jaxzero.accounting.activations import Activations, GPTShape, activation_bytes

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


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str | float) -> float:
    """``'80GB'`` (1e9), ``'79.6GiB'`` (2**30), ``'512MB'``, ``8e10`` -> bytes.

    Example:
      >>> parse_bytes("80GB"), parse_bytes("1GiB")
      (80000000000.0, 1073741824.0)
    """
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[-+]?\d+)?)\s*([a-z]*)\s*", str(text), re.IGNORECASE)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read {text!r} as bytes (examples: 80GB, 79.6GiB, 512MB, 8e10)"
            )
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return value


def format_bytes(b: float) -> str:
    """``3.07 GB``, ``26.7 MB``, ``512 kB`` (1e9, 1e6, 1e3: the ZeRO paper's GB).

    Example:
      >>> format_bytes(26.7e6), format_bytes(80e9)
      ('26.7 MB', '80 GB')
    """
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.3g} B"
