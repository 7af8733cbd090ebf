"""What one step should hold and send, bytes per device: the prediction side of a report.

Two predictions for the same engine: :func:`theory`, the formulas of
:mod:`jaxzero.accounting.estimate` (docs/zero.md) at the engine's Ψ, N, dtypes and
stage, with everything sharded evenly; and :func:`layout_expectation`, the same
counted leaf by leaf over the engine's actual layouts (padding, replicated small
leaves). :mod:`jaxzero.accounting.measure` puts both beside what it measures.

Both count frozen params (``Engine(trainable=...)``) apart from the trainable Ψ: their
stored bytes once (no gradient, master or optimizer state), divided by N at stage 3,
where they are all-gathered as the params are and never reduced.

Beyond ZeRO: with offload both say what of the persistent bytes the host holds (the
master and the optimizer state: ``host``; ``device`` the rest); with qwZ/qgZ the
gathers and reductions count :mod:`jaxzero.zeropp`'s quantized wire bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxzero.accounting import estimate as est


@dataclass
class Theory:
    """docs/zero.md's figures for this engine's Ψ, N, dtypes and stage (bytes/device)."""

    params: float
    master: float
    optimizer: float
    grads: float
    persistent: float
    model_states: float
    comm_grad: float
    comm_param: float
    comm: float
    optimizer_per_param: float  # bytes of optimizer state per param (Adam: 8)
    comm_intra: float = 0.0  # hybrid split of ``comm``: within a group of N devices ...
    comm_inter: float = 0.0  # ... across the R groups (the all-reduce of gradient shards)
    frozen: float = 0.0  # the frozen params' bytes (in ``persistent`` and ``model_states``)
    comm_frozen: float = 0.0  # their stage-3 all-gathers (in ``comm_param`` and ``comm``)
    host: float = 0.0  # offload: the master + optimizer state, in host memory (in ``persistent``)
    ema: float = 0.0  # an EMA of the weights: fp32 as the master (in ``persistent``)

    @property
    def device(self) -> float:
        """The persistent bytes on the device: ``persistent`` less ``host``."""
        return self.persistent - self.host


def inter_group_bytes(
    psi: float,
    n: int,
    replicas: int,
    stage: int,
    grad_bytes: float,
    micro_batches: int = 1,
    qgz_bits: int = 0,
    quant_block: int = 2048,
    hpz: bool = False,
    param_bytes: float = 2.0,
) -> float:
    """Hybrid sharding's traffic across groups, per device per step.

    Each device all-reduces its reduced gradient shard (Ψ/N elements) with the
    devices at its position in the other R − 1 groups: 2 (Ψ b / N)(R − 1)/R, once
    per step in stage 1 and once per micro-batch in stages 2–3 (they reduce per
    micro-batch). Stage 0 has no shards: its one all-reduce spans every device.
    With qgZ (``qgz_bits``) the second hop all-gathers the quantized shard across the
    groups instead (:func:`jaxzero.zeropp.reduce_scatter_wire_bytes`'s second term).
    With hpZ (``hpz``, stage 3) the shard is reduce-scattered across the groups instead
    (a quantized all-to-all with qgZ), and the new params shard (``param_bytes`` an
    element) all-gathered across them once a step: in equal dtypes the all-reduce's bytes.
    """
    if stage == 0 or replicas <= 1:
        return 0.0
    times = micro_batches if stage >= 2 else 1
    if hpz:
        gather = est.ring_bytes("all-gather", psi * param_bytes / n, replicas)
        if qgz_bits:  # the second all-to-all sends R - 1 of a device's quantized slices
            every = n * replicas
            row = est.quantized_reduce_bytes(psi, every, quant_block, qgz_bits) / (every - 1)
            return times * (replicas - 1) * row + gather
        return times * est.ring_bytes("reduce-scatter", psi * grad_bytes / n, replicas) + gather
    if qgz_bits:
        hop = est.quantized_reduce_bytes(psi, n, quant_block, qgz_bits, replicas)
        return times * (hop - est.quantized_reduce_bytes(psi, n, quant_block, qgz_bits))
    return times * est.ring_bytes("all-reduce", psi * grad_bytes / n, replicas)


def theory(
    psi: float,
    n: int,
    stage: int,
    param_bytes: float,
    grad_bytes: float,
    master_bytes: float,
    optimizer_per_param: float,
    micro_batches: int = 1,
    param_gathers: int = 2,
    replicas: int = 1,
    frozen_bytes: float = 0.0,
    offload: bool = False,
    qwz: bool = False,
    qgz_bits: int = 0,
    quant_block: int = 2048,
    hpz: bool = False,
    ema: bool = False,
) -> Theory:
    """Model-state memory and communication from :mod:`jaxzero.accounting.estimate`'s formulas.

    Args:
      psi: logical parameter count.
      n: shards (N).
      stage: ZeRO stage.
      param_bytes: working-param element size (also what stage 1-3 all-gather).
      grad_bytes: element size of gradients on the wire (the reduce dtype).
      master_bytes: 4 with an fp32 master copy, else 0.
      optimizer_per_param: optimizer-state bytes per param (fp32 Adam: 8).
      micro_batches: gradient-accumulation steps per optimizer step.
      param_gathers: stage-3 gathers per param and micro-batch (see ``est.comm_bytes``).
      replicas: hybrid sharding: R groups of ``n`` devices each hold a copy of the state.
      frozen_bytes: the frozen params' bytes, Σ elements × their stored dtype's size
        (2Ψf for a bf16 base): held once, / N at stage 3; gathered there
        ``param_gathers`` times a micro-batch as the params are; never reduced.
      offload: the master and the optimizer state in host memory (``Theory.host``).
      qwz, qgz_bits, quant_block: ZeRO++'s quantized gathers and reductions
        (:func:`jaxzero.accounting.formulas.comm_bytes`).
      hpz: ZeRO++ hpZ: the master and optimizer state over all ``n x replicas`` devices,
        the shard reduce-scattered across groups and the params gathered back
        (:func:`inter_group_bytes`).
      ema: an EMA of the weights in the state (fp32, laid out as the master).
    """
    prec = est.Precision(
        param=param_bytes,
        grad=param_bytes,
        master=master_bytes,
        optimizer=optimizer_per_param,
    )
    held = (frozen_bytes, 1.0)  # (count, bytes each) as the estimate takes them
    groups = replicas if hpz else 1
    ms = est.model_state_bytes(
        psi, n, stage, prec, *held, offload=offload, hpz_replicas=groups, ema=ema
    )
    n_ring = n * replicas if stage == 0 else n  # stage 0 all-reduces over every device
    cm = est.comm_bytes(
        psi, n_ring, stage, grad_bytes, param_bytes, micro_batches, param_gathers, *held,
        qwz=qwz, qgz_bits=qgz_bits, quant_block=quant_block,
    )  # fmt: skip
    inter = inter_group_bytes(
        psi, n, replicas, stage, grad_bytes, micro_batches, qgz_bits, quant_block, hpz,
        param_bytes,
    )  # fmt: skip
    intra = 0.0 if stage == 0 and replicas > 1 else cm.total
    return Theory(
        params=ms.params,
        master=ms.master,
        optimizer=ms.optimizer,
        grads=ms.grads,
        persistent=ms.persistent,
        model_states=ms.total,
        comm_grad=cm.grad + inter,
        comm_param=cm.param,
        comm=cm.total + inter,
        optimizer_per_param=optimizer_per_param,
        comm_intra=intra,
        comm_inter=inter,
        frozen=ms.frozen,
        comm_frozen=cm.frozen,
        host=ms.host,
        ema=ms.ema,
    )


@dataclass
class LayoutExpectation:
    """What the engine's actual leaf layouts predict, bytes per device.

    The formulas assume every element is sharded evenly. The engine pads sharded
    leaves to a multiple of N and replicates leaves too small to shard (their
    gradients are all-reduced: 2S instead of 2S or 3S, and every device stores
    them whole). Counting leaf by leaf explains the gap between measurement and
    formula exactly, which is what this is for.
    """

    persistent: float
    comm: float
    padded_params: int
    replicated_params: int
    comm_inter: float = 0.0  # hybrid: the part of ``comm`` that crosses groups
    comm_param: float = 0.0  # the part of ``comm`` that gathers params, frozen ones too
    frozen: float = 0.0  # the frozen params' stored bytes (in ``persistent``)
    comm_frozen: float = 0.0  # their stage-3 gathers (in ``comm_param``)
    frozen_params: int = 0  # their logical elements ...
    padded_frozen: int = 0  # ... and as stored (padded where sharded at stage 3)
    host: float = 0.0  # offload: the master + optimizer state's bytes (in ``persistent``)
    ema: float = 0.0  # an EMA of the weights, stored as the master (in ``persistent``)

    @property
    def comm_grad(self) -> float:
        """The part of ``comm`` that reduces gradients (the trainable params' alone)."""
        return self.comm - self.comm_param

    @property
    def device(self) -> float:
        """The persistent bytes on the device: ``persistent`` less ``host``."""
        return self.persistent - self.host


def _stored_per_device(lay: Any, n: int, sharded: bool) -> float:
    """Elements one device stores of a leaf: its padded slice when sharded, else all."""
    if lay.dim is None or not sharded:
        return math.prod(lay.shape)
    return math.prod(lay.padded_shape) / n


def layout_expectation(
    layouts: list[Any],
    n: int,
    stage: int,
    param_bytes: float,
    grad_bytes: float,
    master_bytes: float,
    optimizer: Sequence[tuple[Any, int]] = (),
    micro_batches: int = 1,
    param_gathers: int = 2,
    replicas: int = 1,
    frozen: Sequence[tuple[Any, float]] = (),
    offload: bool = False,
    qwz: bool = False,
    qgz_bits: int = 0,
    quant_block: int = 2048,
    hpz: bool = False,
    ema: bool = False,
) -> LayoutExpectation:
    """Leaf-by-leaf persistent bytes and traffic for the engine's layouts.

    Args:
      layouts: the trainable params' layouts: objects with ``shape``, ``dim`` (None:
        replicated) and ``padded_shape``.
      n, stage, param_bytes, grad_bytes, master_bytes, micro_batches, param_gathers,
        replicas: as for :func:`theory`.
      optimizer: ``(layout, itemsize)`` of every optimizer-state leaf (sharded with
        the master from stage 1, by its own layout).
      frozen: ``(layout, itemsize)`` of every frozen param (its stored dtype): stored
        as the working params are (sharded, padded, at stage 3 only), gathered there
        ``param_gathers`` times a micro-batch, never reduced.
      offload: the master and the optimizer-state leaves are in host memory (``host``).
      qwz, qgz_bits, quant_block: each sharded leaf's stage-3 gathers and its gradient's
        reduce-scatter count :mod:`jaxzero.zeropp`'s wire bytes, a leaf a collective
        (unbucketed; a bucket shares its scale blocks across leaves: a few bytes fewer).
      hpz: the master and optimizer-state leaves split over all ``n x replicas`` devices.
      ema: an EMA of the weights, fp32 leaves stored as the master's (in host memory
        with offload).
    """
    frac = (n - 1) / n if n > 1 else 0.0
    every = n * replicas  # replicated leaves (and stage 0) all-reduce over every device
    frac_all = (every - 1) / every if every > 1 else 0.0
    k = micro_batches
    n_state = n * replicas if hpz else n  # the master's and optimizer state's shards
    persistent = sum(_stored_per_device(lay, n_state, stage >= 1) * size for lay, size in optimizer)
    host = persistent if offload else 0.0
    comm = inter = gather = 0.0
    padded_total = replicated = 0
    held = held_comm = averaged = 0.0  # averaged: the EMA's bytes
    held_size = held_padded = 0
    for lay, size in frozen:
        held += _stored_per_device(lay, n, stage == 3) * size
        held_size += math.prod(lay.shape)
        sharded = stage == 3 and lay.dim is not None
        held_padded += math.prod(lay.padded_shape if sharded else lay.shape)
        if sharded:
            held_comm += k * param_gathers * math.prod(lay.padded_shape) * size * frac
    persistent += held
    for lay in layouts:
        size = math.prod(lay.shape)
        as_master = _stored_per_device(lay, n_state, stage >= 1)
        master = as_master * master_bytes
        averaged += as_master * est.EMA_BYTES if ema else 0.0
        persistent += _stored_per_device(lay, n, stage == 3) * param_bytes + master
        host += master if offload else 0.0
        if lay.dim is None:
            replicated += size
            padded_total += size
            # stage 0 and 1 reduce once per step, stages 2-3 once per micro-batch (hook)
            comm += (k if stage >= 2 else 1) * 2 * size * grad_bytes * frac_all
            continue
        padded = math.prod(lay.padded_shape)
        padded_total += padded
        times = k if stage >= 2 else 1  # reductions a step: stage 1 once, 2-3 per micro-batch
        if stage >= 1 and replicas > 1:
            inter += inter_group_bytes(
                padded, n, replicas, stage, grad_bytes, k, qgz_bits, quant_block, hpz,
                param_bytes,
            )  # fmt: skip
        if stage == 0:
            comm += 2 * size * grad_bytes * frac_all
            continue
        if qgz_bits:
            comm += times * est.quantized_reduce_bytes(padded, n, quant_block, qgz_bits)
        else:
            comm += times * padded * grad_bytes * frac
        if stage in (1, 2):
            gather += padded * param_bytes * frac
        elif qwz:
            gather += k * param_gathers * est.quantized_gather_bytes(padded, n, quant_block)
        else:
            gather += k * padded * param_gathers * param_bytes * frac
    gather += held_comm
    persistent += averaged
    host += averaged if offload else 0.0
    return LayoutExpectation(
        persistent,
        comm + gather + inter,
        padded_total,
        replicated,
        inter,
        comm_param=gather,
        frozen=held,
        comm_frozen=held_comm,
        frozen_params=held_size,
        padded_frozen=held_padded,
        host=host,
        ema=averaged,
    )


def unsplit_elements(layouts: Sequence[Any], stage: int) -> float:
    """Elements of the gradients a device all-reduces over the ``model`` axis once a step:
    those of the params tensor parallelism does not split (norms, replicated key/value
    heads), each device's reduced part of each (its data shard from stage 1, where ZeRO
    has reduced first; whole at stage 0) — :func:`jaxzero.accounting.formulas.
    tensor_parallel_bytes`'s ``unsplit``, counted over the engine's layouts."""
    return float(
        sum(
            math.prod(lay.shard_shape if stage >= 1 and lay.sharded else lay.shape)
            for lay in layouts
            if not lay.tensor_parallel
        )
    )
