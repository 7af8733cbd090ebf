"""The collectives of a compiled program: sizes, groups, runs per step, bytes on the wire.

A collective inside a ``while`` body (scanned layers, micro-batches) is weighted by
the number of times its computation runs (:func:`jaxzero.accounting.hlo.multiplicities`).
Bytes on the wire use the ring formulas of docs/zero.md
(:func:`jaxzero.accounting.estimate.ring_bytes`). Only the text is needed:
:func:`collectives_from_hlo` works on any SPMD program. Its device groups are read
in :mod:`jaxzero.accounting.groups`, the element types XLA widened traced back in
:mod:`jaxzero.accounting.widening`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jaxzero.accounting import estimate as est
from jaxzero.accounting.groups import SCOPES, groups_of, scope
from jaxzero.accounting.groups import parse_replica_groups as parse_replica_groups
from jaxzero.accounting.hlo import (
    Buffer,
    HloType,
    call_edges,
    flatten_type,
    multiplicities,
    parse_hlo,
    parse_type,
)
from jaxzero.accounting.widening import logical_buffers

COLLECTIVE_KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
)
SCALAR_ELEMENTS = 64  # buffers with fewer elements are scalars (loss, norms, counters)


@dataclass(frozen=True)
class Collective:
    """One collective op of the compiled step.

    Attributes:
      name: instruction name.
      kind: all-reduce, reduce-scatter, all-gather, all-to-all or collective-permute
        (async ``-start`` forms are reported under their base kind, once).
      opcode: the opcode as printed (e.g. ``all-gather-start``). A collective that an
        ``async-start`` wraps is found in the wrapped computation, under its own opcode.
      computation: the HLO computation holding it.
      buffers: the FULL buffers S of the ring formulas (all-gather: output;
        reduce-scatter: input; all-reduce / all-to-all / permute: operand), one per
        tuple element.
      replica_groups: device groups the collective runs over.
      group_size: N of the ring formula (devices per group).
      runs: times it runs per step (product of loop trip counts, summed over paths).
      logical_buffers: ``buffers`` with the element type the values had before XLA
        widened them for the collective (the CPU backend runs bf16 collectives in
        f32, converting before and after); equal to ``buffers`` when nothing was widened.
    """

    name: str
    kind: str
    opcode: str
    computation: str
    buffers: tuple[Buffer, ...]
    replica_groups: tuple[tuple[int, ...], ...]
    group_size: int
    runs: int
    logical_buffers: tuple[Buffer, ...] = ()

    @property
    def promoted(self) -> bool:
        """XLA widened at least one buffer's element type (e.g. bf16 -> f32 on CPU)."""
        return bool(self.logical_buffers) and self.logical_buffers != self.buffers

    def wire_bytes(self, buffer: Buffer) -> float:
        """Bytes one device sends for ``buffer`` in one run (ring algorithm)."""
        return est.ring_bytes(self.kind, buffer.nbytes, self.group_size)

    @property
    def bytes_per_run(self) -> float:
        return sum(self.wire_bytes(b) for b in self.buffers)

    @property
    def bytes_per_step(self) -> float:
        return self.runs * self.bytes_per_run


def _scale_dim(b: Buffer, dim: int, factor: int) -> Buffer:
    if not b.shape:
        return Buffer(b.dtype, (factor,))
    shape = list(b.shape)
    shape[dim] *= factor
    return Buffer(b.dtype, tuple(shape))


def _full_buffers(
    kind: str, opcode: str, t: HloType, group_size: int, scatter_dim: int = 0
) -> tuple[Buffer, ...]:
    """The buffers S that the ring formulas take, from a collective's result type.

    A reduce-scatter's result is one shard: the full input is ``group_size`` times
    larger along the scatter dimension. Async ``-start`` ops return tuples that hold
    operands beside results; the result half is the one that matters.
    """
    if opcode.endswith("-start"):
        if kind == "collective-permute" and isinstance(t, tuple):
            t = t[0]  # (operand, output, context u32[], ...)
        elif kind in ("all-gather", "reduce-scatter", "all-to-all") and isinstance(t, tuple):
            if len(t) == 2:
                t = t[1]  # (operands, outputs)
    bufs = [b for b in flatten_type(t) if b.dtype not in ("token", "opaque")]
    if kind == "reduce-scatter":
        bufs = [_scale_dim(b, scatter_dim, group_size) for b in bufs]
    return tuple(bufs)


def _kind(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVE_KINDS else None


@dataclass
class HloCollectives:
    """All collectives of a module, and notes on anything counted with less certainty."""

    collectives: list[Collective]
    notes: list[str] = field(default_factory=list)


def collectives_from_hlo(text: str) -> HloCollectives:
    """Find every collective in compiled HLO text and how often it runs per step.

    Args:
      text: ``compiled.as_text()`` of an SPMD-partitioned module.

    Returns:
      The collectives (``-done`` halves skipped) with their runs per step.
    """
    module = parse_hlo(text)
    edges, notes = call_edges(module)
    runs = multiplicities(module, edges)
    num_devices = max(module.num_partitions, 1) * max(module.replica_count, 1)
    branch_comps = {e.callee for e in edges if e.via.startswith("conditional.")}
    defs = {c: {i.name: i for i in instrs} for c, instrs in module.computations.items()}
    out: list[Collective] = []
    for comp, instrs in module.computations.items():
        for ins in instrs:
            kind = _kind(ins.opcode)
            if kind is None:
                continue
            groups, size = groups_of(ins, kind, num_devices)
            n_runs = runs.get(comp, 0)
            if n_runs == 0:
                notes.append(f"{ins.name} in {comp} is not reachable from ENTRY; counted once")
                n_runs = 1
            if comp in branch_comps:
                notes.append(f"{ins.name} sits in a conditional branch: counted as if taken")
            dm = re.search(r"dimensions=\{(\d+)", ins.attrs)
            bufs = _full_buffers(
                kind, ins.opcode, parse_type(ins.type_text), size, int(dm.group(1)) if dm else 0
            )
            logical = logical_buffers(defs, comp, ins, bufs)
            out.append(
                Collective(ins.name, kind, ins.opcode, comp, bufs, groups, size, n_runs, logical)
            )
    if any(c.promoted for c in out):
        notes.append(
            "XLA widened some collectives' element type (converts around them; the CPU "
            "backend runs bf16 collectives in f32): 'logical' bytes use the narrow type"
        )
    return HloCollectives(out, notes)


@dataclass
class Traffic:
    """Bytes on the wire per device per step, split the way the theory is.

    Attributes:
      grad_param: gradient and parameter traffic (buffers of at least
        ``scalar_elements`` elements).
      scalars: small buffers (loss, gradient norm, counters).
      by_kind: grad_param bytes per collective kind.
      ops: collective instructions found; runs: their total executions per step.
      grad_param_logical: ``grad_param`` counted at the element types the program
        asked for, before the backend widened any (equal on GPU/TPU, and in fp32).
      by_scope: grad_param bytes by :func:`scope` (all ``"intra"`` on a plain mesh).
      by_scope_logical: the same at the program's element types.
      by_kind_logical: ``by_kind`` at the program's element types.
    """

    grad_param: float
    scalars: float
    by_kind: dict[str, float]
    ops: int
    runs: int
    grad_param_logical: float
    by_scope: dict[str, float] = field(default_factory=dict)
    by_scope_logical: dict[str, float] = field(default_factory=dict)
    by_kind_logical: dict[str, float] = field(default_factory=dict)


def traffic(
    collectives: list[Collective],
    scalar_elements: int = SCALAR_ELEMENTS,
    group_size: int | None = None,
) -> Traffic:
    """Sum ring bytes × runs per step, splitting scalar buffers from the real traffic.

    ``group_size``: devices per group of a hybrid mesh, to split traffic by
    :func:`scope` (None: one group, everything ``"intra"``).
    """
    big = small = logical = 0.0
    by_kind: dict[str, float] = {}
    by_kind_logical: dict[str, float] = {}
    by_scope = dict.fromkeys(SCOPES, 0.0)
    by_scope_logical = dict.fromkeys(SCOPES, 0.0)
    for c in collectives:
        narrow = c.logical_buffers or c.buffers
        where = "intra" if group_size is None else scope(c.replica_groups, group_size)
        # XLA:CPU prints an all-to-all as a tuple of its N chunks (qgZ's): one buffer's
        # size, not each chunk's, says whether it is a scalar
        whole = sum(b.elements for b in c.buffers) if c.kind == "all-to-all" else None
        for b, nb in zip(c.buffers, narrow, strict=True):
            sent = c.runs * c.wire_bytes(b)
            if (b.elements if whole is None else whole) < scalar_elements:
                small += sent
            else:
                big += sent
                asked = c.runs * c.wire_bytes(nb)
                logical += asked
                by_kind[c.kind] = by_kind.get(c.kind, 0.0) + sent
                by_kind_logical[c.kind] = by_kind_logical.get(c.kind, 0.0) + asked
                by_scope[where] += sent
                by_scope_logical[where] += asked
    runs = sum(c.runs for c in collectives)
    return Traffic(
        big, small, by_kind, len(collectives), runs, logical, by_scope, by_scope_logical,
        by_kind_logical,
    )  # fmt: skip
