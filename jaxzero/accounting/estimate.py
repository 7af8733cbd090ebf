"""ZeRO memory and communication estimator: the paper's formulas, no devices needed.

``jaxzero estimate`` (:mod:`jaxzero.commands.estimate`) answers "does this model fit,
and at which stage?" before anyone rents a cluster. This module is its formulas, pure
and importing nothing of jaxzero: it applies the per-device formulas of docs/zero.md
(``shared/design/zero.md``): model states (params, gradients, optimizer state),
activations (Korthikanti et al. 2022) and ring communication per step. The same
functions give :mod:`jaxzero.accounting.measure` its theoretical side, so measured and
predicted numbers always come from one definition.

GB here means 1e9 bytes, as in the ZeRO paper.

Frozen params (a LoRA run's base, ``Engine(trainable=...)``) are counted apart from the
trainable Ψ: a frozen param gets no gradient, no fp32 master and no optimizer state, so
it costs only its stored bytes (2Ψf for a bf16 base), replicated at stages 0-2 and
sharded at stage 3 (2Ψf/N), where it is all-gathered with the params and never reduced.

Example:
  >>> round(model_state_bytes(7.5e9, 64, 1).total / 1e9, 1)
  31.4
  >>> model_state_bytes(1e6, 8, 3, frozen=7e9).frozen / 1e9  # 2 bytes each, / N
  1.75
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

# Bytes per element of a frozen param as it is stored (``--frozen-dtype``): a frozen
# param keeps the dtype it was given (a bf16 base stays bf16), int8 a quantized base.
FROZEN_DTYPES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "int8": 1.0}

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
    _check_devices(n, stage)


def _check_devices(n: int, stage: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"number of devices must be a positive integer, got {n!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


def _check_frozen(frozen: float, bytes_per_param: float) -> None:
    for name, v in (
        ("frozen parameter count", frozen),
        ("frozen bytes per param", bytes_per_param),
    ):
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")


def frozen_state_bytes(frozen: float, n: int, stage: int, bytes_per_param: float = 2.0) -> float:
    """Per-device bytes of ``frozen`` params stored at ``bytes_per_param`` each (2: bf16).

    A frozen param has no gradient, master or optimizer state: the state holds it once,
    whole at stages 0-2 (``frozen * bytes_per_param``) and sharded at stage 3 (``/ n``).
    """
    _check_devices(n, stage)
    _check_frozen(frozen, bytes_per_param)
    return frozen * bytes_per_param / (n if stage >= 3 else 1)


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes per device for one stage (ZeRO paper, section 5).

    Attributes:
      params: working parameters.
      grads: gradients (transient: they live inside the step).
      master: fp32 master parameters (0 in fp32 training).
      optimizer: optimizer moments.
      frozen: frozen parameters (no gradient, master or optimizer state), 0 when all train.
    """

    params: float
    grads: float
    master: float
    optimizer: float
    frozen: float = 0.0

    @property
    def trainable(self) -> float:
        """The trainable params' persistent bytes: params + master + moments."""
        return self.params + self.master + self.optimizer

    @property
    def persistent(self) -> float:
        """What the train state holds between steps: params + master + moments, and
        the frozen params."""
        return self.trainable + self.frozen

    @property
    def total(self) -> float:
        """The paper's figure: persistent state plus gradients."""
        return self.persistent + self.grads


def model_state_bytes(
    psi: float,
    n: int,
    stage: int,
    prec: Precision | None = None,
    frozen: float = 0.0,
    frozen_bytes_per_param: float = 2.0,
) -> ModelStates:
    """Per-device model-state bytes: docs/zero.md's memory table.

    Stage 1 shards the optimizer state (and master), stage 2 also the gradients,
    stage 3 also the working parameters; everything sharded is divided by ``n``.

    Args:
      psi: trainable parameter count Ψ.
      n: devices that shard the state (N).
      stage: ZeRO stage 0-3.
      prec: byte counts; default mixed precision with Adam (K = 12).
      frozen: frozen parameter count Ψf (:func:`frozen_state_bytes`): stored once at
        ``frozen_bytes_per_param`` (2: a bf16 base), divided by ``n`` at stage 3 only.
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
        frozen=frozen_state_bytes(frozen, n, stage, frozen_bytes_per_param),
    )


def formula(stage: int, prec: Precision | None = None, frozen_bytes_per_param: float = 0.0) -> str:
    """docs/zero.md's memory formula of a stage as text, Ψ trainable and Ψf frozen:
    ``'2Ψ + 14Ψ/N'`` (stage 2, mixed-precision Adam), ``'16Ψ/N + 2Ψf/N'`` (stage 3 with
    a bf16 frozen base). ``frozen_bytes_per_param`` 0: no frozen term."""
    prec = prec or precision_bytes()
    _check_devices(1, stage)
    whole, sharded = {
        0: (prec.param + prec.grad + prec.k, 0.0),
        1: (prec.param + prec.grad, prec.k),
        2: (prec.param, prec.grad + prec.k),
        3: (0.0, prec.param + prec.grad + prec.k),
    }[stage]
    terms = [f"{whole:g}Ψ"] if whole else []
    terms += [f"{sharded:g}Ψ/N"] if sharded else []
    if frozen_bytes_per_param:
        terms.append(f"{frozen_bytes_per_param:g}Ψf" + ("/N" if stage >= 3 else ""))
    return " + ".join(terms)


def max_params(
    device_bytes: float,
    n: int,
    stage: int,
    prec: Precision | None = None,
    frozen: float = 0.0,
    frozen_bytes_per_param: float = 2.0,
) -> float:
    """Largest Ψ whose model states (with gradients) fit in ``device_bytes`` per device.

    The inverse of :func:`model_state_bytes`, ignoring activations and buffers, as the
    ZeRO paper's section 5 does (N = 64, 32 GB: about 7.6B / 14.4B / 128B for stages 1-3).
    With ``frozen`` params (Ψf at ``frozen_bytes_per_param``): the largest trainable Ψ
    beside them (0 when they alone fill the device).
    """
    if not device_bytes > 0:
        raise ValueError(f"device memory must be positive, got {device_bytes!r}")
    per_param = model_state_bytes(1.0, n, stage, prec).total
    left = device_bytes - frozen_state_bytes(frozen, n, stage, frozen_bytes_per_param)
    return max(left, 0.0) / per_param


@dataclass(frozen=True)
class Communication:
    """Bytes on the wire per device per step, ring algorithm.

    Attributes:
      grad: gradient reduction traffic (all-reduce or reduce-scatter).
      param: parameter all-gather traffic (the frozen params' gathers included).
      frozen: of ``param``, the frozen params' gathers (stage 3 only; never reduced).
    """

    grad: float
    param: float
    frozen: float = 0.0

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
    frozen: float = 0.0,
    frozen_bytes_per_param: float = 2.0,
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
      frozen: frozen parameter count Ψf, stored at ``frozen_bytes_per_param``: no
        gradient to reduce; at stage 3 gathered as the params are (``param_gathers``
        per micro-batch, in their stored dtype), replicated (nothing sent) below.
    """
    _check(psi, n, stage)
    _check_frozen(frozen, frozen_bytes_per_param)
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
    gathers = param_gathers * k
    held = gathers * ring_bytes("all-gather", frozen * frozen_bytes_per_param, n)
    return Communication(
        grad=k * ring_bytes("reduce-scatter", g_full, n),
        param=gathers * ring_bytes("all-gather", p_full, n) + held,
        frozen=held,
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
    frozen: float = 0.0  # the frozen params' bytes (in ``persistent``)
    comm_frozen: float = 0.0  # their stage-3 gathers (in ``comm_param``)
    formula: str = ""  # the stage's memory formula, as text (:func:`formula`)


@dataclass
class Estimate:
    """Everything ``jaxzero estimate`` prints, for every stage.

    ``num_params`` is the trainable Ψ; ``frozen_params`` (Ψf, stored at
    ``frozen_bytes_per_param``) those that do not train (a LoRA run's base)."""

    num_params: float
    devices: int
    device_memory: float
    precision: str
    optimizer: str
    k: float
    micro_batches: int
    activations: Activations | None
    stages: list[StageEstimate] = field(default_factory=list)
    frozen_params: float = 0.0
    frozen_bytes_per_param: float = 2.0

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """Human-readable table, GB = 1e9 bytes."""
        if self.frozen_params:
            return self._frozen_table()
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

    def _frozen_table(self) -> str:
        """The table with frozen params: trainable and frozen apart, each stage's formula."""
        fb = self.frozen_bytes_per_param
        lines = [
            f"Ψ = {self.num_params:.4g} trainable + Ψf = {self.frozen_params:.4g} frozen "
            f"parameters ({fb:g} bytes each, stored once: no gradient, master or optimizer "
            f"state), N = {self.devices} devices of {self.device_memory / GB:g} GB, "
            f"{self.precision} precision, {self.optimizer} (K = {self.k:g}), "
            f"{self.micro_batches} micro-batch(es) per step",
        ]
        if self.activations is not None:
            act = self.activations
            lines.append(
                f"activations per device: {act.per_layer / GB:.3f} GB per layer, "
                f"{act.total / GB:.3f} GB in all (output layer {act.output / GB:.3f} GB)"
            )
        head = (
            f"{'stage':<14}{'params':>9}{'grads':>9}{'optim':>9}{'trained':>9}{'frozen':>9}"
            f"{'states':>9}{'+act':>9}  fits  {'comm/step':>10}  {'max Ψ beside Ψf':>16}"
            f"  formula (states)"
        )
        lines += ["", "GB per device", head, "-" * len(head)]
        for r in self.stages:
            with_act = "-" if r.activations is None else f"{r.total / GB:.2f}"
            trained = r.params + r.master + r.optimizer + r.grads
            lines.append(
                f"{r.stage} ({r.name})".ljust(14)
                + f"{r.params / GB:>9.2f}{r.grads / GB:>9.2f}"
                + f"{(r.master + r.optimizer) / GB:>9.2f}{trained / GB:>9.2f}"
                + f"{r.frozen / GB:>9.2f}{r.model_states / GB:>9.2f}"
                + f"{with_act:>9}  {'yes ' if r.fits else 'NO  '}  {r.comm_total / GB:>10.2f}"
                + f"  {format_count(r.max_params):>16}  {r.formula}"
            )
        gathered = self.stages[3].comm_frozen
        s0 = self.stages[0]
        per = (s0.params + s0.grads + s0.master + s0.optimizer) / self.num_params
        w, g = s0.params / self.num_params, s0.grads / self.num_params
        lines += [
            "",
            f"trainable: ({w:g} + {g:g} + K)Ψ = {per:g}Ψ, sharded as each stage shards; "
            f"frozen: {fb:g}Ψf (its stored bytes only), divided by N at stage 3 only",
            "frozen traffic: none at stages 0-2 (no gradient; replicated); at stage 3 "
            f"{gathered / GB:.2f} GB per step of all-gathers (with the params', never reduced)",
        ]
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
    frozen_params: float = 0.0,
    frozen_bytes_per_param: float = 2.0,
) -> Estimate:
    """Memory, fit and communication for every ZeRO stage.

    Args:
      num_params: Ψ, the trainable params.
      devices: N.
      device_memory: bytes per device.
      precision: "mixed"/"bf16"/"fp16" (16-bit + fp32 master) or "fp32".
      optimizer: a key of ``OPTIMIZER_BYTES``.
      shape: GPT dimensions, for activation memory (None: model states only).
      micro_batch: sequences per device per micro-batch.
      micro_batches: gradient-accumulation steps (k).
      remat: "none" or "full" activation recomputation.
      fused_attention: no stored attention scores.
      frozen_params: Ψf, params that do not train (a LoRA run's base): stored once at
        ``frozen_bytes_per_param`` (2: bf16), sharded at stage 3 only, never reduced.
    """
    prec = precision_bytes(precision, optimizer)
    _check(num_params, devices, 0)
    _check_frozen(frozen_params, frozen_bytes_per_param)
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
        frozen_params=float(frozen_params),
        frozen_bytes_per_param=float(frozen_bytes_per_param),
    )
    held = (frozen_params, frozen_bytes_per_param)
    for stage in STAGES:
        ms = model_state_bytes(num_params, devices, stage, prec, *held)
        comm = comm_bytes(
            num_params, devices, stage, prec.grad, prec.param, micro_batches, 2, *held
        )
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
                max_params=max_params(device_memory, devices, stage, prec, *held),
                frozen=ms.frozen,
                comm_frozen=comm.frozen,
                formula=formula(stage, prec, frozen_bytes_per_param if frozen_params else 0.0),
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
