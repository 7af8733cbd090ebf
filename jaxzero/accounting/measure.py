"""Memory and communication accounting of a compiled ZeRO step, measured beside theory.

The point of ZeRO is a claim about bytes: how much each device holds and how
much it sends. This module measures both from what JAX actually built instead of
trusting the code that asked for it:

* persistent memory per device, read from device 0's shards of the train state, split
  into the device's own memory and host memory by each array's ``sharding.memory_kind``
  (``pinned_host``/``unpinned_host``: ZeRO-Offload's master and optimizer state);
* the compiled step's memory (``compiled.memory_analysis()``), its device peak without
  the host-resident state (:func:`compiled_memory`), and the entry parameters and
  outputs the compiled program keeps in host memory, with the transfers that move them
  (:func:`jaxzero.accounting.hlo.host_transfers`);
* every collective in the compiled HLO (``compiled.as_text()``), with its buffer
  sizes, replica groups and the number of times it runs per step. A collective
  inside a ``while`` body (scanned layers, micro-batches) appears once in the text
  but runs ``known_trip_count`` times, so the HLO's computations are parsed into a
  call graph and each collective is weighted by the number of times its
  computation runs, summed over every path from ENTRY;
* bytes on the wire per device with the ring formulas of docs/zero.md;

and puts the formulas of :mod:`jaxzero.accounting.estimate` next to them.

The HLO parser (:mod:`jaxzero.accounting.hlo`) and the collectives found with it
(:mod:`jaxzero.accounting.comm`) need only the text; the predictions are in
:mod:`jaxzero.accounting.expected` and the :class:`~jaxzero.accounting.table.Report`
that holds and prints it all in :mod:`jaxzero.accounting.table`. :func:`report`
ties everything to an Engine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.accounting import formulas
from jaxzero.accounting.comm import (
    SCALAR_ELEMENTS,
    Collective,
    collectives_from_hlo,
    traffic,
)
from jaxzero.accounting.expected import (
    LayoutExpectation,
    Theory,
    layout_expectation,
    theory,
    unsplit_elements,
)
from jaxzero.accounting.expected import inter_group_bytes as inter_group_bytes
from jaxzero.accounting.groups import scope
from jaxzero.accounting.hlo import HostTransfers, host_transfers
from jaxzero.accounting.table import CompiledMemory, Report
from jaxzero.offload import is_host
from jaxzero.partition import is_layout

__all__ = ["report"]

if TYPE_CHECKING:
    from jaxzero.engine import Engine
    from jaxzero.plan import Plan
    from jaxzero.state import TrainState

# ----------------------------------------------------------------------------- memory


def compiled_memory(compiled: Any, host: HostTransfers | None = None) -> CompiledMemory:
    """Read a compiled executable's memory analysis.

    ``host``: the program's host-resident arguments and outputs
    (:func:`~jaxzero.accounting.hlo.host_transfers` of its text; None: read from it).
    A backend that places buffers by memory space (GPU) reports their bytes apart
    (``host_argument_size_in_bytes``, ...) and leaves them out of the device figures; the
    CPU backend reports none and counts them as ordinary arguments and outputs: then the
    host-resident bytes the text declares are taken out of the device peak
    (:attr:`CompiledMemory.device_peak`) and reported as the host's.
    """
    m = compiled.memory_analysis()
    get = lambda name: int(getattr(m, name, 0) or 0)  # noqa: E731
    mem = CompiledMemory(
        argument=get("argument_size_in_bytes"),
        output=get("output_size_in_bytes"),
        temp=get("temp_size_in_bytes"),
        alias=get("alias_size_in_bytes"),
        generated_code=get("generated_code_size_in_bytes"),
        host_argument=get("host_argument_size_in_bytes"),
        host_output=get("host_output_size_in_bytes"),
        host_temp=get("host_temp_size_in_bytes"),
        host_alias=get("host_alias_size_in_bytes"),
    )
    if mem.host_argument or mem.host_output:
        return mem  # the backend split them: the device figures hold no host bytes
    if host is None:
        if not _in_host_memory(compiled):
            return mem  # nothing in host memory: no need to read the text
        host = host_transfers(compiled.as_text())
    if not host.parameter_bytes and not host.output_bytes:
        return mem
    return dataclasses.replace(
        mem,
        host_argument=int(host.parameter_bytes),
        host_output=int(host.output_bytes),
        host_alias=int(host.alias_bytes),
        counted_host=int(host.resident_bytes),
    )


def _in_host_memory(compiled: Any) -> bool:
    """Whether a compiled program takes or returns an array in host memory."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    return any(is_host(s) for s in shardings)


def device0_bytes(tree: Any, device: Any = None, memory: str | None = None) -> int:
    """Bytes that one device holds of a pytree of jax.Arrays (its addressable shard).

    Args:
      tree: arrays (None leaves and Python scalars count 0).
      device: the device to read; default the first shard of each array (device 0 of a
        mesh whose first device is addressable).
      memory: ``"host"``: only the arrays in host memory (``pinned_host``,
        ``unpinned_host``: offload); ``"device"``: only the others; None: all.
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        if not shards:
            continue
        if memory is not None and (memory == "host") != is_host(leaf.sharding):
            continue
        shard = shards[0]
        if device is not None:
            shard = next((s for s in shards if s.device == device), shards[0])
        total += int(shard.data.nbytes)
    return total


def _stage3_notes(
    plan: Plan, collectives: list[Collective], scalar_elements: int, frozen_elements: int = 0
) -> list[str]:
    """Explain stage-3 traffic below 3Ψ: how much the backward pass gathers again.

    The design gathers every param twice (forward, backward) per reduce-scatter of
    its gradient. Counting elements (not bytes, so dtypes do not matter) shows how
    much of that second gather the compiled step really does. Frozen params are
    gathered too but never reduced: ``frozen_elements`` (their sharded elements as
    stored, padding included) joins each micro-batch's reduced elements as what one
    forward pass gathers.
    """
    if plan.stage != 3:
        return []

    def elements(kind: str) -> int:
        return sum(
            c.runs * b.elements
            for c in collectives
            if c.kind == kind
            for b in c.buffers
            if b.elements >= scalar_elements
        )

    gathered, scattered = elements("all-gather"), elements("reduce-scatter")
    scattered += plan.settings.step.micro_batches * frozen_elements  # once a forward pass
    notes = []
    if not plan.settings.step.per_layer:
        notes.append(
            "per_layer=False: the engine gathers the whole tree once per micro-batch and keeps "
            "it through the backward pass (coarse stage 3): the theory column counts one gather "
            "(2Ψb), not ZeRO-3's two (3Ψb)"
        )
    if plan.settings.step.per_layer and scattered and gathered < 2 * scattered * (1 - 1e-3):
        notes.append(
            f"the backward pass gathers {max(gathered / scattered - 1, 0):.1%} of the params "
            "again (design: 100%); it keeps the rest from the forward pass, alive until used"
        )
    return notes


def _itemsize(dtype: Any) -> int:
    return int(np.dtype(dtype).itemsize)


def _persistent(state: TrainState, device: Any) -> dict[str, int]:
    """Device 0's bytes of the state: params, master, optimizer, frozen (the params that
    do not train, 0 when all do), ema (an EMA of the weights, 0 without), other (the
    step, model state such as BatchNorm statistics: replicated, a few floats a channel)
    and total; and of
    the total, what lives in the device's own memory (``device``) and in host memory
    (``host``: offload)."""
    persistent = {
        "params": device0_bytes(state.params, device),
        "master": device0_bytes(state.master, device),
        "optimizer": device0_bytes(state.opt_state, device),
        "frozen": device0_bytes(getattr(state, "frozen", None), device),
        "ema": device0_bytes(getattr(state, "ema", None), device),
    }
    whole = device0_bytes(state, device)
    persistent["other"] = whole - sum(persistent.values())
    persistent["total"] = whole
    persistent["host"] = device0_bytes(state, device, memory="host")
    persistent["device"] = whole - persistent["host"]
    return persistent


def _predictions(plan: Plan, state: TrainState, replicas: int) -> tuple[Theory, LayoutExpectation]:
    """The formulas and the leaf-by-leaf count for this plan's Ψ, N, dtypes and stage."""
    cfg = plan.settings.step
    n = plan.num_shards
    psi = _psi(plan)
    param_bytes, grad_bytes = _itemsize(cfg.compute_dtype), _itemsize(cfg.reduce_dtype)
    master_bytes = 4.0 if state.master is not None else 0.0
    opt_lays = [x.local() for x in jax.tree.leaves(plan.opt_layouts, is_leaf=is_layout)]
    opt_sizes = [x.dtype.itemsize for x in jax.tree.leaves(state.opt_state)]
    per_param = sum(lay.size * b for lay, b in zip(opt_lays, opt_sizes, strict=True)) / psi
    k = cfg.micro_batches
    gathers = 2 if cfg.per_layer else 1  # coarse stage 3 gathers once
    frozen = _frozen_leaves(plan)
    th = theory(
        psi,
        n,
        plan.stage,
        param_bytes,
        grad_bytes,
        master_bytes,
        per_param,
        k,
        param_gathers=gathers,
        replicas=replicas,
        frozen_bytes=sum(math.prod(lay.shape) * size for lay, size in frozen),
        offload=cfg.offload,
        qwz=cfg.qwz,
        qgz_bits=cfg.qgz_bits,
        quant_block=cfg.quant_block,
        hpz=cfg.hpz,
        ema=plan.has_ema,
    )
    layouts = [lay.local() for lay in plan.leaves()]
    ex = layout_expectation(
        layouts,
        n,
        plan.stage,
        param_bytes,
        grad_bytes,
        master_bytes,
        list(zip(opt_lays, opt_sizes, strict=True)),
        k,
        param_gathers=gathers,
        replicas=replicas,
        frozen=frozen,
        offload=cfg.offload,
        qwz=cfg.qwz,
        qgz_bits=cfg.qgz_bits,
        quant_block=cfg.quant_block,
        hpz=cfg.hpz,
        ema=plan.has_ema,
    )
    return th, ex


def _psi(plan: Plan) -> int:
    """Ψ the formulas take: the trainable params, or with a model axis a model device's
    share of them (each split param's slice, each other whole)."""
    if plan.settings.model_shards == 1:
        return int(plan.num_params)
    return sum(lay.local().size for lay in plan.leaves())


def _frozen_leaves(plan: Plan) -> list[tuple[Any, int]]:
    """``(layout, itemsize)`` of every frozen param, in its stored dtype (none when every
    param trains)."""
    if getattr(plan, "mask", None) is None:
        return []
    dtypes = jax.tree.leaves(plan.frozen_dtypes)
    return [
        (lay, int(jnp.dtype(d).itemsize))
        for lay, d in zip(plan.frozen_leaves(), dtypes, strict=True)
    ]


def _layout_notes(ex: LayoutExpectation, psi: int, stage: int = 0) -> list[str]:
    """How padding and replicated small leaves explain bytes beyond the formulas."""
    notes = []
    if ex.padded_params != psi:
        notes.append(
            f"padding to multiples of N stores {ex.padded_params - psi:,} extra elements "
            f"({100 * (ex.padded_params / psi - 1):.3f}% of Ψ); sharded memory and traffic "
            "grow with it (the 'layouts' column counts it)"
        )
    if ex.replicated_params:
        notes.append(
            f"{ex.replicated_params:,} params sit in leaves too small to shard: replicated, "
            "their gradients all-reduced (the 'layouts' column counts them)"
        )
    if ex.frozen_params:
        notes.append(
            f"{ex.frozen_params:,} frozen params are stored once in their own dtype, with no "
            "gradient, master or optimizer state (the 'frozen params' row); "
            + (
                "sharded at stage 3, they are all-gathered with the params, never reduced"
                if stage == 3
                else "replicated below stage 3, they send nothing"
            )
        )
    return notes


def _config(
    plan: Plan, ex: LayoutExpectation, replicas: int, scalar_elements: int
) -> dict[str, Any]:
    """The report's ``config``: what the figures were measured for."""
    cfg = plan.settings.step
    return {
        "stage": plan.stage,
        "num_shards": plan.num_shards,
        "replicas": replicas,
        "devices": int(plan.mesh.devices.size),
        "precision": plan.settings.precision,
        "compute_dtype": str(np.dtype(cfg.compute_dtype)),
        "reduce_dtype": str(np.dtype(cfg.reduce_dtype)),
        "micro_batches": cfg.micro_batches,
        "bucket_mb": cfg.bucket_bytes / 2**20,
        "whole_tree_bucket_mb": cfg.whole_tree_bucket_bytes / 2**20,  # per_layer=False, stage 3
        "donate": plan.settings.donate,  # without donation the peak holds two states
        "num_params": int(plan.num_params),
        "padded_params": ex.padded_params,
        "num_frozen": ex.frozen_params,  # params that do not train (Engine(trainable=...))
        "padded_frozen": ex.padded_frozen,
        "scalar_elements": scalar_elements,
        # beyond ZeRO (issue 47): what lives in host memory, and the wire formats
        "offload": "optimizer" if cfg.offload else None,
        "qwz": cfg.qwz,
        "qgz_bits": cfg.qgz_bits,
        "hpz": cfg.hpz,
        "quant_block": cfg.quant_block,
        "ema": plan.has_ema,  # an EMA of the weights in the state (as the master)
        # tensor and sequence parallelism: each layer split over this many devices, and
        # the Ψ the formulas take then (a model device's share)
        "model_shards": plan.settings.model_shards,
        "ulysses": plan.settings.step.ulysses,  # each row's sequence split over the data axis
        "params_a_model_device": _psi(plan),
    }


def report(
    engine: Engine,
    state: TrainState,
    batch: Any,
    *,
    model: Any = None,
    scalar_elements: int = SCALAR_ELEMENTS,
    compiled: Any = None,
) -> Report:
    """Measure an Engine's step and compare it with the ZeRO formulas.

    Compiles the step (``engine.compile``) without running it, reads device 0's
    share of ``state`` and parses the compiled HLO. With a ``model`` mesh axis (tensor
    and sequence parallelism) ZeRO's formulas count a model device's params over the
    data devices, its traffic across model groups; the traffic within a group is put
    beside :func:`jaxzero.accounting.formulas.tensor_parallel_bytes`. With Ulysses
    (``ulysses=True``) the all-to-alls are put beside
    :func:`~jaxzero.accounting.formulas.ulysses_bytes`, the rest beside ZeRO's formulas.

    Args:
      engine: an initialised :class:`jaxzero.Engine`: what is read of it is its
        :attr:`~jaxzero.Engine.plan` and its compiled step (:meth:`~jaxzero.Engine.compile`).
      state: its TrainState (from ``engine.init``).
      batch: a sample global batch.
      model: the model the engine trains; needed with a model axis or Ulysses, whose
        traffic formulas take its shape (a Llama's ``config``).
      scalar_elements: buffers with fewer elements count as scalars.
      compiled: an already compiled step, to skip compiling again.
    """
    plan = engine.plan
    m = plan.settings.model_shards
    model_axis = _model_axis_bytes(plan, batch, model) if m > 1 else 0.0
    sequence = _ulysses_bytes(plan, batch, model) if plan.settings.step.ulysses else 0.0
    persistent = _persistent(state, plan.mesh.devices.flat[0])
    compiled = compiled if compiled is not None else engine.compile(state, batch)
    text = compiled.as_text()
    hlo = collectives_from_hlo(text)
    host = host_transfers(text)
    n = plan.num_shards
    replicas = int(plan.mesh.devices.size) // n // m
    # with a model axis, its groups are the scopes: within one (model), across (data)
    tr = traffic(hlo.collectives, scalar_elements, group_size=m if m > 1 else n)
    th, ex = _predictions(plan, state, replicas)
    notes = list(hlo.notes) + _layout_notes(ex, _psi(plan), plan.stage)
    held = sum(
        math.prod(lay.padded_shape) for lay, _ in _frozen_leaves(plan) if lay.dim is not None
    )
    across = [c for c in hlo.collectives if m == 1 or scope(c.replica_groups, m) == "inter"]
    notes += _stage3_notes(plan, across, scalar_elements, held)
    config = _config(plan, ex, replicas, scalar_elements)
    memory = compiled_memory(compiled, host)
    return Report(
        config, persistent, th, ex, memory, tr, hlo.collectives, notes, host_transfers=host,
        model_axis=model_axis, ulysses=sequence,
    )  # fmt: skip


def _llama_config(model: Any, what: str) -> Any:
    """The config of the Llama an engine trains, whose shape the formulas of ``what``
    (a model axis, Ulysses) take."""
    cfg: Any = getattr(model, "config", None)
    if not hasattr(cfg, "num_key_value_heads"):
        raise ValueError(
            f"this engine splits {what}: pass the Llama it trains "
            "(report(engine, state, batch, model=llama)), whose shape the formula of that "
            "traffic takes"
        )
    return cfg


def _ulysses_bytes(plan: Plan, batch: Any, model: Any) -> float:
    """The formula's bytes a device sends in Ulysses' all-to-alls a step
    (:func:`~jaxzero.accounting.formulas.ulysses_bytes`)."""
    cfg = _llama_config(model, "each sequence over the data devices (ulysses)")
    step = plan.settings.step
    if step.qgz_bits:
        raise ValueError(
            "report tells Ulysses' all-to-alls from ZeRO's collectives by their kind, which "
            "qgZ's quantized reductions share: report one of them at a time"
        )
    rows, seq = batch["inputs"].shape[:2]
    tokens = rows * seq / int(plan.mesh.devices.size)  # a device's slice of its rows
    return formulas.ulysses_bytes(
        tokens, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size,
        cfg.num_hidden_layers, plan.num_shards, _itemsize(step.compute_dtype),
        recompute=cfg.remat != "none",
    )  # fmt: skip


def _model_axis_bytes(plan: Plan, batch: Any, model: Any) -> float:
    """The formula's bytes a device sends along the model axis a step (tensor and
    sequence parallelism, :func:`~jaxzero.accounting.formulas.tensor_parallel_bytes`)."""
    m = plan.settings.model_shards
    cfg = _llama_config(model, f"each layer over a model axis of {m} devices")
    step = plan.settings.step
    rows, seq = batch["inputs"].shape[:2]
    tokens = rows // (int(plan.mesh.devices.size) // m) * seq  # a model group's, every micro
    unsplit = unsplit_elements(plan.leaves(), plan.stage)
    return formulas.tensor_parallel_bytes(
        tokens, cfg.hidden_size, cfg.num_hidden_layers, m, _itemsize(step.compute_dtype),
        unsplit, _itemsize(step.reduce_dtype),
    )  # fmt: skip
