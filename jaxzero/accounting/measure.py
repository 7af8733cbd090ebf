"""Memory and communication accounting of a compiled ZeRO step, measured beside theory.

The point of ZeRO is a claim about bytes: how much each device holds and how
much it sends. This module measures both from what JAX actually built instead of
trusting the code that asked for it:

* persistent memory per device, read from device 0's shards of the train state;
* the compiled step's memory (``compiled.memory_analysis()``);
* every collective in the compiled HLO (``compiled.as_text()``), with its buffer
  sizes, replica groups and the number of times it runs per step. A collective
  inside a ``while`` body (scanned layers, micro-batches) appears once in the text
  but runs ``known_trip_count`` times, so the HLO's computations are parsed into a
  call graph and each collective is weighted by the number of times its
  computation runs, summed over every path from ENTRY;
* bytes on the wire per device with the ring formulas of docs/zero.md;

and puts the formulas of :mod:`jaxzero.accounting.estimate` next to them.

The HLO parser (:mod:`jaxzero.accounting.hlo`) and the collectives found with it
(:mod:`jaxzero.accounting.comm`) need only the text; :func:`report`
ties everything to an Engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxzero.accounting import estimate as est
from jaxzero.accounting.comm import (
    SCALAR_ELEMENTS,
    Collective,
    Traffic,
    collectives_from_hlo,
    traffic,
)
from jaxzero.accounting.hlo import Buffer
from jaxzero.partition import is_layout

__all__ = ["report"]

if TYPE_CHECKING:
    from jaxzero.engine import Engine
    from jaxzero.plan import Plan
    from jaxzero.state import TrainState

# ----------------------------------------------------------------------------- memory


@dataclass
class CompiledMemory:
    """``compiled.memory_analysis()`` per device, in bytes."""

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int

    @property
    def peak(self) -> int:
        """Argument + output + temp − alias: what the step needs at once."""
        return self.argument + self.output + self.temp - self.alias


def compiled_memory(compiled: Any) -> CompiledMemory:
    """Read a compiled executable's memory analysis."""
    m = compiled.memory_analysis()
    return CompiledMemory(
        argument=int(m.argument_size_in_bytes),
        output=int(m.output_size_in_bytes),
        temp=int(m.temp_size_in_bytes),
        alias=int(m.alias_size_in_bytes),
        generated_code=int(getattr(m, "generated_code_size_in_bytes", 0)),
    )


def device0_bytes(tree: Any, device: Any = None) -> int:
    """Bytes that one device holds of a pytree of jax.Arrays (its addressable shard).

    Args:
      tree: arrays (None leaves and Python scalars count 0).
      device: the device to read; default the first shard of each array (device 0 of a
        mesh whose first device is addressable).
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        if not shards:
            continue
        shard = shards[0]
        if device is not None:
            shard = next((s for s in shards if s.device == device), shards[0])
        total += int(shard.data.nbytes)
    return total


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


def inter_group_bytes(
    psi: float, n: int, replicas: int, stage: int, grad_bytes: float, micro_batches: int = 1
) -> float:
    """Hybrid sharding's traffic across groups, per device per step.

    Each device all-reduces its reduced gradient shard (Ψ/N elements) with the
    devices at its position in the other R − 1 groups: 2 (Ψ b / N)(R − 1)/R, once
    per step in stage 1 and once per micro-batch in stages 2–3 (they reduce per
    micro-batch). Stage 0 has no shards: its one all-reduce spans every device.
    """
    if stage == 0 or replicas <= 1:
        return 0.0
    times = micro_batches if stage >= 2 else 1
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
    """
    prec = est.Precision(
        param=param_bytes,
        grad=param_bytes,
        master=master_bytes,
        optimizer=optimizer_per_param,
    )
    ms = est.model_state_bytes(psi, n, stage, prec)
    n_ring = n * replicas if stage == 0 else n  # stage 0 all-reduces over every device
    cm = est.comm_bytes(psi, n_ring, stage, grad_bytes, param_bytes, micro_batches, param_gathers)
    inter = inter_group_bytes(psi, n, replicas, stage, grad_bytes, micro_batches)
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
) -> LayoutExpectation:
    """Leaf-by-leaf persistent bytes and traffic for the engine's layouts.

    Args:
      layouts: objects with ``shape``, ``dim`` (None: replicated) and ``padded_shape``.
      n, stage, param_bytes, grad_bytes, master_bytes, micro_batches, param_gathers,
        replicas: as for :func:`theory`.
      optimizer: ``(layout, itemsize)`` of every optimizer-state leaf (sharded with
        the master from stage 1, by its own layout).
    """
    frac = (n - 1) / n if n > 1 else 0.0
    every = n * replicas  # replicated leaves (and stage 0) all-reduce over every device
    frac_all = (every - 1) / every if every > 1 else 0.0
    k = micro_batches
    persistent = sum(_stored_per_device(lay, n, stage >= 1) * size for lay, size in optimizer)
    comm = inter = 0.0
    padded_total = replicated = 0
    for lay in layouts:
        size = math.prod(lay.shape)
        persistent += (
            _stored_per_device(lay, n, stage == 3) * param_bytes
            + _stored_per_device(lay, n, stage >= 1) * master_bytes
        )
        if lay.dim is None:
            replicated += size
            padded_total += size
            # stage 0 and 1 reduce once per step, stages 2-3 once per micro-batch (hook)
            comm += (k if stage >= 2 else 1) * 2 * size * grad_bytes * frac_all
            continue
        padded = math.prod(lay.padded_shape)
        padded_total += padded
        if stage >= 1 and replicas > 1:
            inter += (k if stage >= 2 else 1) * est.ring_bytes(
                "all-reduce", padded / n * grad_bytes, replicas
            )
        if stage == 0:
            comm += 2 * size * grad_bytes * frac_all
        elif stage == 1:
            comm += padded * (grad_bytes + param_bytes) * frac
        elif stage == 2:
            comm += padded * (k * grad_bytes + param_bytes) * frac
        else:
            comm += k * padded * (grad_bytes + param_gathers * param_bytes) * frac
    return LayoutExpectation(persistent, comm + inter, padded_total, replicated, inter)


# ----------------------------------------------------------------------------- report


@dataclass
class Report:
    """Measured accounting of one compiled step beside the theory (bytes per device).

    Attributes:
      config: stage, N, precision, dtypes, micro-batches, Ψ (logical and padded).
      persistent: measured bytes of device 0 per category (params, master,
        optimizer, other) and their total.
      theory: the formulas' figures for Ψ (no padding, everything sharded).
      expected: the same counted leaf by leaf over the engine's layouts (padding,
        replicated small leaves), which explains any gap to ``theory``.
      compiled: the step's compiled memory (peak = argument + output + temp − alias).
      traffic: measured bytes on the wire.
      collectives: every collective found, with runs per step.
      notes: anything counted with less certainty, and how padding explains excess.
    """

    config: dict[str, Any]
    persistent: dict[str, int]
    theory: Theory
    expected: LayoutExpectation
    compiled: CompiledMemory
    traffic: Traffic
    collectives: list[Collective]
    notes: list[str] = field(default_factory=list)

    @property
    def persistent_ratio(self) -> float:
        """Measured persistent bytes / theory (params + master + optimizer state)."""
        return self.persistent["total"] / self.theory.persistent

    @property
    def comm_ratio(self) -> float:
        """Measured gradient/param traffic (as compiled) / theory; nan when theory is 0."""
        return self.traffic.grad_param / self.theory.comm if self.theory.comm else math.nan

    @property
    def comm_ratio_logical(self) -> float:
        """As :attr:`comm_ratio`, at the element types the program asked for.

        Differs from ``comm_ratio`` only where the backend widened a collective
        (the CPU backend runs bf16 collectives in f32).
        """
        t = self.theory.comm
        return self.traffic.grad_param_logical / t if t else math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compiled"]["peak"] = self.compiled.peak
        nan_none = lambda x: None if math.isnan(x) else x
        d["ratios"] = {
            "persistent": self.persistent_ratio,
            "persistent_vs_layouts": self.persistent["total"] / self.expected.persistent,
            "comm": nan_none(self.comm_ratio),
            "comm_logical": nan_none(self.comm_ratio_logical),
            "comm_logical_vs_layouts": (
                self.traffic.grad_param_logical / self.expected.comm if self.expected.comm else None
            ),
        }
        for label, got, formula, _ in _scope_rows(self):
            key = "comm_intra" if label.startswith("within") else "comm_inter"
            if formula:
                d["ratios"][key] = got / formula
        d["collectives"] = [
            {
                "name": c.name,
                "kind": c.kind,
                "opcode": c.opcode,
                "computation": c.computation,
                "buffers": [_fmt_buffer(b) for b in c.buffers],
                "logical_buffers": [_fmt_buffer(b) for b in c.logical_buffers],
                "group_size": c.group_size,
                "num_groups": len(c.replica_groups),
                "runs": c.runs,
                "bytes_per_run": c.bytes_per_run,
                "bytes_per_step": c.bytes_per_step,
            }
            for c in self.collectives
        ]
        return d

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _scope_lines(self, mb, ratio) -> list[str]:
        lines = []
        for label, got, formula, layouts in _scope_rows(self):
            line = f"{'  ' + label:<30}{mb(got)}"
            if formula is not None:
                line += f"{mb(formula)}{ratio(got, formula)}"
                if layouts is not None:
                    line += f"{mb(layouts)}{ratio(got, layouts)}"
            lines.append(line)
        return lines

    def table(self) -> str:
        """Measured vs. theory, MB = 1e6 bytes."""
        c, t, p, e = self.config, self.theory, self.persistent, self.expected
        mb = lambda x: f"{x / 1e6:12.4f}"
        ratio = lambda a, b: f"{a / b:8.3f}" if b else "       -"
        head = f"{'':<30}{'measured':>12}{'formula':>12}{'ratio':>8}{'layouts':>12}{'ratio':>8}"
        lines = [
            f"stage {c['stage']}, N = {c['num_shards']}, {c['precision']} "
            f"(compute {c['compute_dtype']}, gradient reduce {c['reduce_dtype']}), "
            f"{c['micro_batches']} micro-batch(es)"
            + (
                f"; hybrid: {c['replicas']} groups of {c['num_shards']} devices, the state "
                "replicated across groups"
                if c.get("replicas", 1) > 1
                else ""
            ),
            f"Ψ = {c['num_params']:,} (stored {e.padded_params:,} with padding; "
            f"{e.replicated_params:,} in replicated small leaves); optimizer state "
            f"{t.optimizer_per_param:.2f} bytes per param",
            "",
            "persistent memory per device (MB)",
            head,
            f"{'working params':<30}{mb(p['params'])}{mb(t.params)}{ratio(p['params'], t.params)}",
            f"{'fp32 master':<30}{mb(p['master'])}{mb(t.master)}{ratio(p['master'], t.master)}",
            f"{'optimizer state':<30}{mb(p['optimizer'])}{mb(t.optimizer)}"
            f"{ratio(p['optimizer'], t.optimizer)}",
            f"{'other (step, counters)':<30}{mb(p['other'])}",
            f"{'total':<30}{mb(p['total'])}{mb(t.persistent)}{ratio(p['total'], t.persistent)}"
            f"{mb(e.persistent)}{ratio(p['total'], e.persistent)}",
            f"{'+ gradients (formula)':<30}{'':>12}{mb(t.model_states)}",
            "",
            "compiled step per device (MB)",
            f"{'':<30}{'argument':>12}{'output':>12}{'temp':>12}{'alias':>12}{'peak':>12}",
            f"{'':<30}{mb(self.compiled.argument)}{mb(self.compiled.output)}"
            f"{mb(self.compiled.temp)}{mb(self.compiled.alias)}{mb(self.compiled.peak)}",
            "",
            "communication per device per step (MB on the wire, ring)",
            head,
            f"{'gradients + params':<30}{mb(self.traffic.grad_param)}{mb(t.comm)}"
            f"{ratio(self.traffic.grad_param, t.comm)}",
        ]
        if self.traffic.grad_param_logical != self.traffic.grad_param:
            lines.append(
                f"{'  at the program dtypes':<30}{mb(self.traffic.grad_param_logical)}{mb(t.comm)}"
                f"{ratio(self.traffic.grad_param_logical, t.comm)}{mb(e.comm)}"
                f"{ratio(self.traffic.grad_param_logical, e.comm)}"
            )
        else:
            lines[-1] += f"{mb(e.comm)}{ratio(self.traffic.grad_param, e.comm)}"
        for kind, b in sorted(self.traffic.by_kind.items()):
            lines.append(f"{'  ' + kind:<30}{mb(b)}")
        lines += self._scope_lines(mb, ratio)
        lines.append(f"{'scalars (loss, norms)':<30}{mb(self.traffic.scalars)}")
        lines += ["", f"collectives: {self.traffic.ops} ops, {self.traffic.runs} runs per step"]
        for col in self.collectives:
            shapes = " ".join(_fmt_buffer(b) for b in col.buffers)
            lines.append(
                f"  {col.kind:<18} x{col.runs:<4} N={col.group_size:<3} {shapes[:48]:<48}"
                f"{mb(col.bytes_per_step)}"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _scope_rows(report: Report) -> list[tuple[str, float, float | None, float | None]]:
    """Hybrid meshes: (label, measured, formula, layouts) for traffic inside / across groups."""
    c, t, e = report.config, report.theory, report.expected
    if c.get("replicas", 1) <= 1:
        return []
    got = report.traffic.by_scope_logical or report.traffic.by_scope
    return [
        (
            f"within a group (N = {c['num_shards']})",
            got.get("intra", 0.0),
            t.comm_intra,
            e.comm - e.comm_inter if c["stage"] > 0 else None,
        ),
        (f"across groups (R = {c['replicas']})", got.get("inter", 0.0), t.comm_inter, e.comm_inter),
        ("spanning both", got.get("both", 0.0), None, None),
    ]


def _stage3_notes(plan: Plan, collectives: list[Collective], scalar_elements: int) -> list[str]:
    """Explain stage-3 traffic below 3Ψ: how much the backward pass gathers again.

    The design gathers every param twice (forward, backward) per reduce-scatter of
    its gradient. Counting elements (not bytes, so dtypes do not matter) shows how
    much of that second gather the compiled step really does.
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


def _fmt_buffer(b: Buffer) -> str:
    return f"{b.dtype}[{','.join(map(str, b.shape))}]"


def _itemsize(dtype: Any) -> int:
    return int(np.dtype(dtype).itemsize)


def report(
    engine: Engine,
    state: TrainState,
    batch: Any,
    *,
    scalar_elements: int = SCALAR_ELEMENTS,
    compiled: Any = None,
) -> Report:
    """Measure an Engine's step and compare it with the ZeRO formulas.

    Compiles the step (``engine.compile``) without running it, reads device 0's
    share of ``state`` and parses the compiled HLO.

    Args:
      engine: an initialised :class:`jaxzero.Engine`: what is read of it is its
        :attr:`~jaxzero.Engine.plan` and its compiled step (:meth:`~jaxzero.Engine.compile`).
      state: its TrainState (from ``engine.init``).
      batch: a sample global batch.
      scalar_elements: buffers with fewer elements count as scalars.
      compiled: an already compiled step, to skip compiling again.
    """
    plan = engine.plan
    cfg = plan.settings.step
    dev0 = plan.mesh.devices.flat[0]
    persistent = {
        "params": device0_bytes(state.params, dev0),
        "master": device0_bytes(state.master, dev0),
        "optimizer": device0_bytes(state.opt_state, dev0),
    }
    whole = device0_bytes(state, dev0)
    persistent["other"] = whole - sum(persistent.values())
    persistent["total"] = whole

    compiled = compiled if compiled is not None else engine.compile(state, batch)
    hlo = collectives_from_hlo(compiled.as_text())
    n = plan.num_shards
    replicas = int(plan.mesh.devices.size) // n
    tr = traffic(hlo.collectives, scalar_elements, group_size=n)

    psi = int(plan.num_params)
    reduce_dtype = cfg.reduce_dtype
    param_bytes, grad_bytes = _itemsize(cfg.compute_dtype), _itemsize(reduce_dtype)
    master_bytes = 4.0 if state.master is not None else 0.0
    opt_lays = jax.tree.leaves(plan.opt_layouts, is_leaf=is_layout)
    opt_sizes = [x.dtype.itemsize for x in jax.tree.leaves(state.opt_state)]
    per_param = sum(lay.size * b for lay, b in zip(opt_lays, opt_sizes, strict=True)) / psi
    k = cfg.micro_batches
    gathers = 2 if cfg.per_layer else 1  # coarse stage 3 gathers once
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
    )
    layouts = plan.leaves()
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
    )
    notes = list(hlo.notes)
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
    notes += _stage3_notes(plan, hlo.collectives, scalar_elements)
    config = {
        "stage": plan.stage,
        "num_shards": n,
        "replicas": replicas,
        "devices": int(plan.mesh.devices.size),
        "precision": plan.settings.precision,
        "compute_dtype": str(np.dtype(cfg.compute_dtype)),
        "reduce_dtype": str(np.dtype(reduce_dtype)),
        "micro_batches": k,
        "bucket_mb": cfg.bucket_bytes / 2**20,
        "whole_tree_bucket_mb": cfg.whole_tree_bucket_bytes / 2**20,  # per_layer=False, stage 3
        "donate": plan.settings.donate,  # without donation the peak holds two states
        "num_params": psi,
        "padded_params": ex.padded_params,
        "scalar_elements": scalar_elements,
    }
    return Report(config, persistent, th, ex, compiled_memory(compiled), tr, hlo.collectives, notes)
