"""The ZeRO formulas: model states and ring communication per device, per stage (pure).

The per-device formulas of docs/zero.md (``shared/design/zero.md``), importing nothing
of jaxzero: model states (params, gradients, fp32 master, optimizer state) and the bytes
each collective sends on a ring. :mod:`jaxzero.accounting.estimate` builds ``jaxzero
estimate``'s table on them (and re-exports them), :mod:`jaxzero.accounting.expected`
the measured report's theory column, the planner its prune: one definition.

GB here means 1e9 bytes, as in the ZeRO paper.

Frozen params (a LoRA run's base, ``Engine(trainable=...)``) are counted apart from the
trainable Ψ: a frozen param gets no gradient, no fp32 master and no optimizer state, so
it costs only its stored bytes (2Ψf for a bf16 base), replicated at stages 0-2 and
sharded at stage 3 (2Ψf/N), where it is all-gathered with the params and never reduced.

Beyond ZeRO (issue 47): ``offload`` (ZeRO-Offload, stages 1-3) keeps the fp32 master
and the optimizer state in host memory, sharded as before: the device's persistent state
drops by KΨ/N (12Ψ/N in mixed precision with Adam; 8Ψ/N in fp32, whose params are the
master) and the host holds it (:attr:`ModelStates.host`), each step moving it to the
device and back over the host link. ``qwz`` (stage 3's weight all-gathers in int8) and
``qgz_bits`` (gradients reduce-scattered in int8/int4 through an all-to-all) change the
bytes on the wire to :mod:`jaxzero.zeropp`'s formulas (payload and fp32 scales, one per
``quant_block`` elements): that module defines the wire format, so it defines its bytes.

Example:
  >>> round(model_state_bytes(7.5e9, 64, 1).total / 1e9, 1)
  31.4
  >>> model_state_bytes(1e6, 8, 3, frozen=7e9).frozen / 1e9  # 2 bytes each, / N
  1.75
  >>> off = model_state_bytes(7e9, 8, 3, offload=True)  # 12Ψ/N to the host
  >>> round(off.device / 1e9, 2), round(off.host / 1e9, 2)
  (1.75, 10.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

# Bytes per parameter of an EMA of the weights (``Engine(ema=...)``): fp32, as the master.
EMA_BYTES = 4.0

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
      offload: the master and the optimizer moments live in host memory (ZeRO-Offload):
        :attr:`host` holds them, :attr:`device` and :attr:`device_total` leave them out.
      ema: an EMA of the trainable params (``Engine(ema=...)``): fp32 and laid out as
        the master, 4Ψ/N from stage 1 (4Ψ at stage 0), in host memory with offload.
    """

    params: float
    grads: float
    master: float
    optimizer: float
    frozen: float = 0.0
    offload: bool = False
    ema: float = 0.0

    @property
    def trainable(self) -> float:
        """The trainable params' persistent bytes: params + master + moments."""
        return self.params + self.master + self.optimizer

    @property
    def persistent(self) -> float:
        """What the train state holds between steps: params + master + moments, the
        frozen params and the EMA."""
        return self.trainable + self.frozen + self.ema

    @property
    def total(self) -> float:
        """The paper's figure: persistent state plus gradients."""
        return self.persistent + self.grads

    @property
    def host(self) -> float:
        """Bytes held in host memory for this device: master + moments (+ EMA) with
        offload, else 0."""
        return self.master + self.optimizer + self.ema if self.offload else 0.0

    @property
    def device(self) -> float:
        """The persistent bytes on the device itself: :attr:`persistent` less :attr:`host`."""
        return self.persistent - self.host

    @property
    def device_total(self) -> float:
        """The device's share of the paper's figure: :attr:`total` less :attr:`host`."""
        return self.total - self.host


def model_state_bytes(
    psi: float,
    n: int,
    stage: int,
    prec: Precision | None = None,
    frozen: float = 0.0,
    frozen_bytes_per_param: float = 2.0,
    offload: bool = False,
    hpz_replicas: int = 1,
    ema: bool = False,
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
      offload: ZeRO-Offload (stages 1-3): the master and the moments in host memory.
      hpz_replicas: ZeRO++ hpZ on a hybrid mesh of this many groups of ``n``: the master
        and the moments are split over all ``n x hpz_replicas`` devices.
      ema: the state keeps an EMA of the trainable params (:attr:`ModelStates.ema`).

    Raises:
      ValueError: offload at stage 0 (the engine refuses it: nothing is sharded).
    """
    _check(psi, n, stage)
    _check_offload(offload, stage)
    prec = prec or precision_bytes()
    os_div = n * hpz_replicas if stage >= 1 else 1
    g_div = n if stage >= 2 else 1
    p_div = n if stage >= 3 else 1
    return ModelStates(
        params=prec.param * psi / p_div,
        grads=prec.grad * psi / g_div,
        master=prec.master * psi / os_div,
        optimizer=prec.optimizer * psi / os_div,
        frozen=frozen_state_bytes(frozen, n, stage, frozen_bytes_per_param),
        offload=offload,
        ema=EMA_BYTES * psi / os_div if ema else 0.0,
    )


def _check_offload(offload: bool, stage: int) -> None:
    if offload and stage == 0:
        raise ValueError(
            "offload needs stage 1, 2 or 3: at stage 0 every device holds the whole state"
        )


def formula(
    stage: int,
    prec: Precision | None = None,
    frozen_bytes_per_param: float = 0.0,
    offload: bool = False,
    ema: bool = False,
) -> str:
    """docs/zero.md's memory formula of a stage as text, Ψ trainable and Ψf frozen:
    ``'2Ψ + 14Ψ/N'`` (stage 2, mixed-precision Adam), ``'16Ψ/N + 2Ψf/N'`` (stage 3 with
    a bf16 frozen base). ``frozen_bytes_per_param`` 0: no frozen term. ``offload``: the
    device's part alone (``'4Ψ/N'`` at stage 3); :func:`host_formula` gives the host's.
    ``ema``: an EMA's 4Ψ with the master (``'20Ψ/N'`` at stage 3)."""
    prec = prec or precision_bytes()
    _check_devices(1, stage)
    _check_offload(offload, stage)
    k = 0.0 if offload else prec.k + (EMA_BYTES if ema else 0.0)
    whole, sharded = {
        0: (prec.param + prec.grad + k, 0.0),
        1: (prec.param + prec.grad, k),
        2: (prec.param, prec.grad + k),
        3: (0.0, prec.param + prec.grad + k),
    }[stage]
    terms = [f"{whole:g}Ψ"] if whole else []
    terms += [f"{sharded:g}Ψ/N"] if sharded else []
    if frozen_bytes_per_param:
        terms.append(f"{frozen_bytes_per_param:g}Ψf" + ("/N" if stage >= 3 else ""))
    return " + ".join(terms) or "0"


def host_formula(
    stage: int, prec: Precision | None = None, offload: bool = True, ema: bool = False
) -> str:
    """The host memory's formula per device with offload: ``'12Ψ/N'`` (mixed-precision
    Adam: the fp32 master and the moments), ``'8Ψ/N'`` in fp32 (the moments alone),
    4Ψ/N more with an EMA; ``'0'`` without offload."""
    prec = prec or precision_bytes()
    _check_devices(1, stage)
    _check_offload(offload, stage)
    k = prec.k + (EMA_BYTES if ema else 0.0)
    return f"{k:g}Ψ/N" if offload and k else "0"


def max_params(
    device_bytes: float,
    n: int,
    stage: int,
    prec: Precision | None = None,
    frozen: float = 0.0,
    frozen_bytes_per_param: float = 2.0,
    offload: bool = False,
    ema: bool = False,
) -> float:
    """Largest Ψ whose model states (with gradients) fit in ``device_bytes`` per device.

    The inverse of :func:`model_state_bytes`, ignoring activations and buffers, as the
    ZeRO paper's section 5 does (N = 64, 32 GB: about 7.6B / 14.4B / 128B for stages 1-3).
    With ``frozen`` params (Ψf at ``frozen_bytes_per_param``): the largest trainable Ψ
    beside them (0 when they alone fill the device). With ``offload`` the device holds
    only its part (:attr:`ModelStates.device_total`): the host's memory is not checked.
    ``ema``: an EMA of the weights takes its 4Ψ/N too.
    """
    if not device_bytes > 0:
        raise ValueError(f"device memory must be positive, got {device_bytes!r}")
    per_param = model_state_bytes(1.0, n, stage, prec, offload=offload, ema=ema).device_total
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


def quantized_gather_bytes(elements: float, n: int, block: int) -> float:
    """Bytes one device sends for a qwZ all-gather of ``elements`` (the whole padded
    buffer): int8 payload and a float32 scale per ``block`` elements of each device's
    slice, on a ring (:func:`jaxzero.zeropp.gather_wire_bytes`, the wire format's own)."""
    from jaxzero.zeropp import gather_wire_bytes  # the wire format's module defines its bytes

    return 0.0 if n <= 1 else float(gather_wire_bytes(int(elements), n, block))


def quantized_reduce_bytes(
    elements: float, n: int, block: int, bits: int, replicas: int = 1
) -> float:
    """Bytes one device sends for a qgZ reduce-scatter of ``elements`` (the padded
    gradient) over ``n`` devices: an all-to-all of its quantized rows, and with
    ``replicas`` groups an all-gather of its quantized slice across them
    (:func:`jaxzero.zeropp.reduce_scatter_wire_bytes`)."""
    from jaxzero.zeropp import reduce_scatter_wire_bytes

    if n <= 1 and replicas <= 1:
        return 0.0
    return float(reduce_scatter_wire_bytes(int(elements), n, block, bits, replicas))


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
    qwz: bool = False,
    qgz_bits: int = 0,
    quant_block: int = 2048,
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
      qwz: stage 3 gathers the params as int8 + scales (:func:`quantized_gather_bytes`);
        the frozen params' gathers are counted in their stored dtype.
      qgz_bits: 8 or 4: stages 1-3 reduce-scatter the gradients quantized
        (:func:`quantized_reduce_bytes`); 0: in ``grad_bytes``.
      quant_block: elements a quantization scale covers.
    """
    _check(psi, n, stage)
    _check_frozen(frozen, frozen_bytes_per_param)
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    check_quantized(stage, qwz, qgz_bits, quant_block)
    pb = grad_bytes if param_bytes is None else param_bytes
    k = micro_batches
    g_full, p_full = psi * grad_bytes, psi * pb
    if stage == 0:
        return Communication(grad=ring_bytes("all-reduce", g_full, n), param=0.0)
    if qgz_bits:
        reduce = quantized_reduce_bytes(psi, n, quant_block, qgz_bits)
    else:
        reduce = ring_bytes("reduce-scatter", g_full, n)
    if stage == 1:
        return Communication(grad=reduce, param=ring_bytes("all-gather", p_full, n))
    if stage == 2:
        return Communication(grad=k * reduce, param=ring_bytes("all-gather", p_full, n))
    gathers = param_gathers * k
    held = gathers * ring_bytes("all-gather", frozen * frozen_bytes_per_param, n)
    if qwz:
        gather = quantized_gather_bytes(psi, n, quant_block)
    else:
        gather = ring_bytes("all-gather", p_full, n)
    return Communication(grad=k * reduce, param=gathers * gather + held, frozen=held)


def tensor_parallel_bytes(
    tokens: float,
    hidden: int,
    layers: int,
    m: int,
    act_bytes: float = 4.0,
    unsplit: float = 0.0,
    grad_bytes: float = 4.0,
) -> float:
    """Bytes one device sends along the ``model`` axis per optimizer step: tensor
    parallelism with sequence parallelism (Megatron-LM; docs/tensor-parallel.md).

    Each layer's two blocks (attention, MLP) all-gather the sequence going in and
    reduce-scatter it coming out, forward and (transposed) backward, and gather it once
    more in the backward pass (the block keeps its slice only): 10 collectives of
    ``tokens x hidden`` a layer, Megatron's 4 all-reduces a layer (8) plus the
    re-gathers. The embedding's reduce-scatter and the final norm's gather add 4 (with
    their transposes), the vocabulary-parallel cross-entropy 3 all-reduces of a float32
    a token, and the gradients of the ``unsplit`` params (norms, replicated key/value
    heads), one device's part of each, an all-reduce once a step.

    Args:
      tokens: the tokens a model group trains on in the step (its rows of the global
        batch x the sequence, over every micro-batch).
      hidden: D. layers: L. m: the model axis' size.
      act_bytes: bytes of an activation (the compute dtype).
      unsplit: elements of the unsplit params' gradients a device all-reduces.
      grad_bytes: bytes of a gradient element (the reduce dtype).
    """
    if m <= 1:
        return 0.0
    sequence = (10 * layers + 4) * ring_bytes("all-gather", tokens * hidden * act_bytes, m)
    loss = 3 * ring_bytes("all-reduce", tokens * 4.0, m)
    return sequence + loss + ring_bytes("all-reduce", unsplit * grad_bytes, m)


def ulysses_bytes(
    tokens: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    layers: int,
    n: int,
    act_bytes: float = 4.0,
    recompute: bool = False,
) -> float:
    """Bytes one device sends in DeepSpeed-Ulysses' all-to-alls per optimizer step
    (context parallelism over ``n`` devices; docs/tensor-parallel.md).

    Each attention layer exchanges q, k and v from sequence slices to head slices and its
    output back: ``tokens x head_dim x (2H + 2G)`` elements a device, ``G`` the
    key/value heads (repeated to ``H`` first where ``n`` does not divide them), each
    all-to-all sending (n − 1)/n of its buffer. The backward pass sends their
    transposes, and a layer recomputed there (``remat``) its forward's once more.

    Args:
      tokens: the tokens a device holds in the step (its slice of each of its rows, over
        every micro-batch).
      heads, kv_heads, head_dim, layers: the model's attention.
      n: the devices a sequence is split over.
      act_bytes: bytes of an activation (the compute dtype).
      recompute: the layers are recomputed in the backward pass (remat).
    """
    if n <= 1:
        return 0.0
    g = kv_heads if kv_heads % n == 0 else heads
    one = tokens * head_dim * (2 * heads + 2 * g) * act_bytes * (n - 1) / n
    return (3 if recompute else 2) * layers * one


def check_quantized(stage: int, qwz: bool, qgz_bits: int, quant_block: int) -> None:
    """The engine's rules for qwZ and qgZ (:func:`jaxzero.settings.beyond_zero`), for the
    formulas: qwz at stage 3 only, qgz at stages 1-3, in 8 or 4 bits."""
    if qwz and stage != 3:
        raise ValueError(f"qwz quantizes stage 3's weight all-gathers; got stage {stage}")
    if qgz_bits not in (0, 4, 8):
        raise ValueError(f"qgz bits must be 8 (int8), 4 (int4) or 0 (off), got {qgz_bits!r}")
    if qgz_bits and stage == 0:
        raise ValueError("qgz reduce-scatters the gradients: stages 1-3 (stage 0 all-reduces)")
    if isinstance(quant_block, bool) or not isinstance(quant_block, int) or quant_block < 1:
        raise ValueError(f"quant_block must be a positive number of elements, got {quant_block!r}")
