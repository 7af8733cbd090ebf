"""ZeRO memory and communication estimator: the paper's formulas, no devices needed.

``jaxzero estimate`` (:mod:`jaxzero.commands.estimate`) answers "does this model fit,
and at which stage?" before anyone rents a cluster. This module is its table: the
per-device formulas of docs/zero.md (:mod:`jaxzero.accounting.formulas`, re-exported
here) with activations (Korthikanti et al. 2022), per stage, and what fits; and byte
sizes parsed and printed. The same formulas give :mod:`jaxzero.accounting.measure` its
theoretical side, so measured and predicted numbers always come from one definition.

GB here means 1e9 bytes, as in the ZeRO paper.

Example:
  >>> e = estimate(7.5e9, 64, device_memory=32e9)
  >>> [round(r.model_states / 1e9, 2) for r in e.stages]
  [120.0, 31.41, 16.64, 1.88]
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, astuple, dataclass, field

from jaxzero.accounting.activations import Activations, DecoderShape, GPTShape, activation_bytes
from jaxzero.accounting.formulas import (  # re-exported: est.model_state_bytes, ...
    EMA_BYTES,
    FROZEN_DTYPES,
    GB,
    OPTIMIZER_BYTES,
    PRECISIONS,
    STAGE_NAMES,
    STAGES,
    Communication,
    ModelStates,
    Precision,
    _check,
    _check_frozen,
    check_quantized,
    comm_bytes,
    formula,
    frozen_state_bytes,
    host_formula,
    max_params,
    model_state_bytes,
    precision_bytes,
    quantized_gather_bytes,
    quantized_reduce_bytes,
    ring_bytes,
)
from jaxzero.step_config import QGZ_BITS

__all__ = [
    "EMA_BYTES", "FROZEN_DTYPES", "GB", "OPTIMIZER_BYTES", "PRECISIONS", "STAGES", "STAGE_NAMES",
    "Communication", "Estimate", "ModelStates", "Precision", "QGZ_BITS", "StageEstimate",
    "check_quantized", "comm_bytes", "estimate", "format_bytes", "format_count", "formula",
    "frozen_state_bytes", "host_formula", "max_params", "model_state_bytes", "parse_bytes",
    "precision_bytes", "quantized_gather_bytes", "quantized_reduce_bytes", "ring_bytes",
]  # fmt: skip


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
    # offload (stages 1-3): what stays on the device (``total`` counts only it), what the
    # host holds for this device, its formula, and the bytes moved over the host link per
    # step each way (the master and the moments to the device and back)
    offload: bool = False
    device: float = 0.0  # persistent + gradients on the device (the paper's figure, less host)
    host: float = 0.0
    host_formula: str = "0"
    host_link: float = 0.0
    comm_plain: float = 0.0  # comm_total without qwZ/qgZ (in the working/reduce dtype)
    ema: float = 0.0  # an EMA of the weights (in ``persistent``; in ``host`` with offload)


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
    offload: bool = False  # ZeRO-Offload asked for (stages 1-3)
    qwz: bool = False  # stage 3 gathers int8 weights
    qgz_bits: int = 0  # gradients reduced in int8/int4 (stages 1-3)
    quant_block: int = 2048
    ema: bool = False  # the state keeps an EMA of the weights (fp32, as the master)
    # tensor parallelism: each layer split over ``model`` devices; ``num_params`` is then a
    # model device's share (of ``total_params``), ``devices`` those sharding it, and
    # ``model_comm`` the bytes a device sends along the model axis a step
    model: int = 1
    total_params: float = 0.0
    model_comm: float = 0.0
    # Ulysses: each row's sequence split over ``sequence`` devices (the activations of
    # ``micro_batch`` whole rows divided by it), ``sequence_comm`` its all-to-alls' bytes
    sequence: int = 1
    sequence_comm: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """Human-readable table, GB = 1e9 bytes."""
        if self.offload or self.qwz or self.qgz_bits or self.ema:
            return self._beyond_table()
        if self.frozen_params:
            return self._frozen_table()
        lines = [
            f"Ψ = {self.num_params:.4g} parameters, N = {self.devices} devices of "
            f"{self.device_memory / GB:g} GB, {self.precision} precision, {self.optimizer} "
            f"(K = {self.k:g}), {self.micro_batches} micro-batch(es) per step",
        ]
        lines += self._activation_line() + self._model_line()
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

    def _activation_line(self) -> list[str]:
        act = self.activations
        if act is None:
            return []
        per = f"{act.per_layer / GB:.3f} GB per layer"
        if act.linear_per_layer and act.linear_per_layer != act.per_layer:
            per = (
                f"{act.per_layer / GB:.3f} GB per attention layer, "
                f"{act.linear_per_layer / GB:.3f} GB per Gated DeltaNet layer"
            )
        return [
            f"activations per device: {per}, "
            f"{act.total / GB:.3f} GB in all (output layer {act.output / GB:.3f} GB)"
        ]

    def _model_line(self) -> list[str]:
        if self.sequence > 1:
            return [
                f"Ulysses: each row's sequence split over {self.sequence} devices, "
                f"activations / {self.sequence}; {self.sequence_comm / GB:.3f} GB a step of "
                "all-to-alls (formulas.ulysses_bytes), beside 'comm'"
            ]
        if self.model <= 1:
            return []
        return [
            f"model axis: each layer split over {self.model} devices (tensor and sequence "
            f"parallel): Ψ is a model device's share of {self.total_params:.4g}, N the "
            f"devices sharding it, activations / {self.model}; "
            f"{self.model_comm / GB:.3f} GB a step along the model axis "
            "(formulas.tensor_parallel_bytes), beside 'comm' along data"
        ]

    def _beyond_table(self) -> str:
        """The table with offload, qwZ/qgZ and/or an EMA: device and host bytes apart,
        each with its formula; the bytes on the wire beside those without quantization."""
        lines = [
            f"Ψ = {self.num_params:.4g} parameters"
            + (f" + Ψf = {self.frozen_params:.4g} frozen" if self.frozen_params else "")
            + f", N = {self.devices} devices of {self.device_memory / GB:g} GB, "
            f"{self.precision} precision, {self.optimizer} (K = {self.k:g}), "
            f"{self.micro_batches} micro-batch(es) per step",
        ]
        lines += self._activation_line() + self._model_line()
        if self.offload:
            lines.append(
                f"offload: the fp32 master and the optimizer state ({self.k:g}Ψ/N) live in "
                "host memory at stages 1-3 and cross the host link each step, to the device "
                "and back; 'fits' holds the device's bytes to its memory"
            )
        if self.ema:
            lines.append(
                "ema: an EMA of the weights, fp32 and laid out as the master (4Ψ/N from "
                "stage 1, 4Ψ at stage 0"
                + (", in host memory with offload)" if self.offload else ")")
            )
        quant = []
        if self.qwz:
            quant.append("stage 3 gathers the weights as int8")
        if self.qgz_bits:
            quant.append(f"stages 1-3 reduce-scatter the gradients as int{self.qgz_bits}")
        if quant:
            lines.append(
                "; ".join(quant) + f", a fp32 scale per {self.quant_block} elements "
                "(jaxzero.zeropp's wire bytes); 'unquantized': the same step without"
            )
        off = self.offload
        head = (
            f"{'stage':<14}{'params':>9}{'grads':>9}{'optim':>9}"
            + (f"{'frozen':>9}" if self.frozen_params else "")
            + (f"{'ema':>9}" if self.ema else "")
            + f"{'device':>9}"
            + (f"{'host':>9}" if off else "")
            + f"{'+act':>9}  fits  {'comm/step':>10}"
            + (f"{'unquant.':>10}" if quant else "")
            + (f"{'host link':>11}" if off else "")
            + f"  {'max Ψ':>7}  formula"
            + (": device | host" if off else "")
        )
        title = "GB per device" + (" (host: the host memory held for each device)" if off else "")
        lines += ["", title, head, "-" * len(head)]
        for r in self.stages:
            with_act = "-" if r.activations is None else f"{r.total / GB:.2f}"
            lines.append(
                f"{r.stage} ({r.name})".ljust(14)
                + f"{r.params / GB:>9.2f}{r.grads / GB:>9.2f}{(r.master + r.optimizer) / GB:>9.2f}"
                + (f"{r.frozen / GB:>9.2f}" if self.frozen_params else "")
                + (f"{r.ema / GB:>9.2f}" if self.ema else "")
                + f"{r.device / GB:>9.2f}"
                + (f"{r.host / GB:>9.2f}" if off else "")
                + f"{with_act:>9}  {'yes ' if r.fits else 'NO  '}  {r.comm_total / GB:>10.2f}"
                + (f"{r.comm_plain / GB:>10.2f}" if quant else "")
                + (f"{r.host_link / GB:>11.2f}" if off else "")
                + f"  {format_count(r.max_params):>7}  {r.formula}"
                + (f" | {r.host_formula}" if off else "")
            )
        if off:
            lines.append(
                "stage 0 has no offload (every device holds the whole state); 'host link': "
                "bytes each way per step; 'max Ψ': the device's states only"
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
        lines += self._activation_line() + self._model_line()
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
    shape: GPTShape | DecoderShape | None = None,
    micro_batch: int = 1,
    micro_batches: int = 1,
    remat: str = "none",
    fused_attention: bool = False,
    frozen_params: float = 0.0,
    frozen_bytes_per_param: float = 2.0,
    offload: bool = False,
    qwz: bool = False,
    qgz: str | None = None,
    quant_block: int = 2048,
    ema: bool = False,
    model: int = 1,
    total_params: float = 0.0,
    model_comm: float = 0.0,
    sequence: int = 1,
    sequence_comm: float = 0.0,
) -> Estimate:
    """Memory, fit and communication for every ZeRO stage.

    Args:
      num_params: Ψ, the trainable params.
      devices: N.
      device_memory: bytes per device.
      precision: "mixed"/"bf16"/"fp16" (16-bit + fp32 master) or "fp32".
      optimizer: a key of ``OPTIMIZER_BYTES``.
      shape: a GPT's or a decoder's dimensions, for activation memory (None: model
        states only).
      micro_batch: sequences per device per micro-batch.
      micro_batches: gradient-accumulation steps (k).
      remat: "none" or "full" activation recomputation.
      fused_attention: no stored attention scores.
      frozen_params: Ψf, params that do not train (a LoRA run's base): stored once at
        ``frozen_bytes_per_param`` (2: bf16), sharded at stage 3 only, never reduced.
      offload: ZeRO-Offload at stages 1-3 (stage 0's row is without): the master and the
        moments in host memory; ``fits`` then holds the device's part alone.
      qwz: stage 3's weight gathers in int8 (its row alone).
      qgz: ``"int8"``/``"int4"``: the gradients' reduce-scatter quantized (stages 1-3).
      quant_block: elements a quantization scale covers.
      ema: the state keeps an EMA of the weights (``Engine(ema=...)``): 4Ψ/N more.
      model: tensor parallelism's degree: ``num_params`` is then a model device's share
        (each split param's slice, each other whole), ``devices`` the N sharding it, and
        the activations of ``micro_batch`` rows are divided by ``model`` (sequence
        parallelism divides a layer's: experiments/tp_traffic.py measures 0.499 and
        0.249 of it at 2 and 4; the whole step's temp 0.504 and 0.261, a few whole-sequence
        buffers of one layer's backward pass not divided). ``total_params``: the
        model's Ψ; ``model_comm``: the bytes a device sends along the model axis a
        step (:func:`formulas.tensor_parallel_bytes`).
      sequence: Ulysses' degree: the activations of ``micro_batch`` whole rows divided by
        it (experiments/tp_traffic.py measures the compiled step's temp at 0.20-0.25 of
        one device's on 4);
        ``sequence_comm``: its all-to-alls' bytes a device a step
        (:func:`formulas.ulysses_bytes`).
    """
    prec = precision_bytes(precision, optimizer)
    _check(num_params, devices, 0)
    _check_frozen(frozen_params, frozen_bytes_per_param)
    if qgz not in (None, *QGZ_BITS):
        raise ValueError(f"qgz={qgz!r}: one of {sorted(QGZ_BITS)}")
    bits = QGZ_BITS.get(qgz or "", 0)
    check_quantized(3, qwz, bits, quant_block)
    if not device_memory > 0:
        raise ValueError(f"device memory must be positive, got {device_memory!r}")
    act = None
    if shape is not None:
        act = activation_bytes(shape, micro_batch, remat, fused_attention, prec.param)
        if model * sequence > 1:
            act = Activations(*(float(x) / (model * sequence) for x in astuple(act)))
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
        offload=offload,
        qwz=qwz,
        qgz_bits=bits,
        quant_block=quant_block,
        ema=ema,
        model=model,
        total_params=float(total_params or num_params),
        model_comm=float(model_comm),
        sequence=sequence,
        sequence_comm=float(sequence_comm),
    )
    held = (frozen_params, frozen_bytes_per_param)
    for stage in STAGES:
        off = offload and stage >= 1
        ms = model_state_bytes(num_params, devices, stage, prec, *held, offload=off, ema=ema)
        args = (num_params, devices, stage, prec.grad, prec.param, micro_batches, 2, *held)
        plain = comm_bytes(*args)
        comm = comm_bytes(
            *args, qwz=qwz and stage == 3, qgz_bits=bits if stage else 0, quant_block=quant_block
        )
        total = ms.device_total + (act.total if act else 0.0)
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
                max_params=max_params(
                    device_memory, devices, stage, prec, *held, offload=off, ema=ema
                ),
                frozen=ms.frozen,
                comm_frozen=comm.frozen,
                formula=formula(
                    stage, prec, frozen_bytes_per_param if frozen_params else 0.0, off, ema
                ),
                offload=off,
                device=ms.device_total,
                host=ms.host,
                host_formula=host_formula(stage, prec, off, ema),
                host_link=ms.host,  # each way: to the device for the update, and back
                comm_plain=plain.total,
                ema=ms.ema,
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
