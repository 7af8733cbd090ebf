"""The collectives of a compiled program: sizes, groups, runs per step, bytes on the wire.

A collective inside a ``while`` body (scanned layers, micro-batches) is weighted by
the number of times its computation runs (:func:`jaxzero.accounting.hlo.multiplicities`).
Bytes on the wire use the ring formulas of docs/zero.md
(:func:`jaxzero.accounting.estimate.ring_bytes`). Only the text is needed:
:func:`collectives_from_hlo` works on any SPMD program.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from jaxzero.accounting import estimate as est
from jaxzero.accounting.hlo import (
    Buffer,
    HloType,
    Instruction,
    call_edges,
    dtype_bytes,
    flatten_type,
    multiplicities,
    parse_hlo,
    parse_type,
)

COLLECTIVE_KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
)
SCALAR_ELEMENTS = 64  # buffers with fewer elements are scalars (loss, norms, counters)

_IOTA = r"\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?"
_MESH = r"mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^{}]*\}"
_GROUPS_RE = re.compile(rf"replica_groups=(\{{(?:[^{{}}]|\{{[^{{}}]*\}})*\}}|{_MESH}|{_IOTA})")
_PAIRS_RE = re.compile(r"source_target_pairs=(\{(?:[^{}]|\{[^{}]*\})*\})")


def _iota(text: str) -> np.ndarray | None:
    """``[2,4]<=[4,2]T(1,0)``: ``iota`` reshaped to the bracket after ``<=`` (else the
    first), transposed by ``T(...)`` if given, then reshaped to the first bracket."""
    m = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text.strip())
    if not m:
        return None
    dims = [int(x) for x in m.group(1).split(",")]
    base = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(math.prod(base)).reshape(base)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(dims)


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """``mesh['r'=2,'d'=4] {'r'}``: the devices that differ only along the listed axes.

    The mesh holds logical device ids in row-major order (or ``device_ids=(...)``, iota
    or listed). A listed axis may be a sub-axis ``'d':(pre)size``: the digit
    ``(index // pre) % size`` of that axis. Within a group, devices are ordered by the
    listed axes' digits in the order listed.
    """
    m = re.fullmatch(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*)\))?\s*\{([^{}]*)\}", text.strip())
    if not m:
        raise ValueError(f"cannot parse replica groups {text!r}")
    names, sizes = [], []
    for axis in m.group(1).split(","):
        name, size = axis.rsplit("=", 1)
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    if m.group(2) is None:
        ids = np.arange(math.prod(sizes))
    else:
        iota = _iota(m.group(2))
        ids = (
            iota if iota is not None else np.array([int(x) for x in re.findall(r"\d+", m.group(2))])
        )
    ids = ids.reshape(sizes)
    digits = []  # (mesh axis, pre, size) of each listed (sub-)axis, in order
    for ref in filter(None, (r.strip() for r in m.group(3).split(","))):
        rm = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", ref)
        if not rm or rm.group(1) not in names:
            raise ValueError(f"cannot parse replica groups {text!r}: axis {ref!r}")
        i = names.index(rm.group(1))
        digits.append((i, int(rm.group(2)), int(rm.group(3))) if rm.group(2) else (i, 1, sizes[i]))
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for pos in np.ndindex(*sizes):
        own = [((pos[i] // pre) % size) for i, pre, size in digits]
        rest = list(pos)
        for (i, pre, _), d in zip(digits, own, strict=True):
            rest[i] -= d * pre
        groups.setdefault(tuple(rest), []).append((tuple(own), int(ids[pos])))
    return tuple(tuple(d for _, d in sorted(g)) for g in groups.values())


def parse_replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups from ``{{0,1},{2,3}}``, ``{}`` (all devices), iota
    ``[2,4]<=[4,2]T(1,0)`` (see :func:`_iota`, reshaped to ``[num_groups, group_size]``)
    or mesh axes ``mesh['r'=2,'d'=4] {'r'}`` (:func:`_mesh_groups`; XLA's newer form).
    """
    text = text.strip()
    if text.startswith("{"):
        groups = tuple(
            tuple(int(x) for x in re.findall(r"\d+", g)) for g in re.findall(r"\{([^{}]*)\}", text)
        )
        groups = tuple(g for g in groups if g)
        return groups or (tuple(range(num_devices)),)
    if text.startswith("mesh["):
        return _mesh_groups(text)
    ids = _iota(text)
    if ids is None:
        raise ValueError(f"cannot parse replica groups {text!r}")
    ids = ids.reshape(ids.shape[0], -1) if ids.ndim > 1 else ids.reshape(1, -1)
    return tuple(tuple(int(x) for x in row) for row in ids)


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


_LAYOUT_OPS = ("bitcast", "copy", "reshape", "transpose")
_FLOATS = ("f8", "f16", "bf16", "f32", "f64")


def _callee(ins: Instruction) -> str | None:
    m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else None


def _first_dtype(ins: Instruction | None) -> str | None:
    return flatten_type(parse_type(ins.type_text))[0].dtype if ins is not None else None


def _widening_converts(
    defs: dict[str, dict[str, Instruction]], comp: str, name: str, depth: int = 0
) -> list[tuple[str, Instruction]]:
    """The last converts into ``name``'s element type, with the type they converted from.

    Walks back from the value through ops of the same element type (layout ops,
    and inside a producing fusion through its elementwise spine, e.g.
    ``convert(bf16 g) * 0.125``), stopping at each convert. Converts deeper down,
    behind an operand of another type, are not the ones that fed the collective.
    """
    ins = defs.get(comp, {}).get(name)
    if ins is None or depth > 32:
        return []
    if ins.opcode == "convert" and ins.operands:
        src = _first_dtype(defs[comp].get(ins.operands[0]))
        return [(src, ins)] if src else []
    if ins.opcode == "fusion" and (callee := _callee(ins)) in defs:
        root = next((i for i in defs[callee].values() if i.root), None)
        return _widening_converts(defs, callee, root.name, depth + 1) if root else []
    if ins.opcode in ("parameter", "get-tuple-element", "while", "call", "constant"):
        return []
    dtype = _first_dtype(ins)
    found = []
    for op in ins.operands:
        if _first_dtype(defs[comp].get(op)) == dtype:
            found += _widening_converts(defs, comp, op, depth + 1)
    return found


def _is_narrower_float(src: str, dst: str) -> bool:
    return (
        src.startswith(_FLOATS)
        and dst.startswith(_FLOATS)
        and (dtype_bytes(src) < dtype_bytes(dst))
    )


def _users(instrs: dict[str, Instruction], name: str) -> list[Instruction]:
    return [i for i in instrs.values() if name in i.operands]


def _narrowed_after(
    defs: dict[str, dict[str, Instruction]], comp: str, name: str, depth: int = 0
) -> set[str]:
    """Element types every use of ``name`` converts it down to (empty: some use does not).

    Looks through tuple element reads and into fusions, at the fused parameter.
    """
    users = _users(defs[comp], name)
    if not users or depth > 8:
        return set()
    dtype = _first_dtype(defs[comp][name])
    out: set[str] = set()
    for u in users:
        if (
            u.opcode == "convert"
            and (to := _first_dtype(u)) is not None
            and _is_narrower_float(to, dtype or "f32")
        ):
            got = {to}
        elif u.opcode == "get-tuple-element" or u.opcode in _LAYOUT_OPS:
            got = _narrowed_after(defs, comp, u.name, depth + 1)
        elif u.opcode == "fusion" and (callee := _callee(u)) in defs:
            param = _fused_param_name(defs[callee], u.operands.index(name))
            got = _narrowed_after(defs, callee, param, depth + 1) if param else set()
        else:
            got = set()
        if not got:
            return set()
        out |= got
    return out


def _fused_param_name(instrs: dict[str, Instruction], index: int) -> str | None:
    """Name of ``parameter(index)`` in a computation (its number is the operand list)."""
    for ins in instrs.values():
        if ins.opcode == "parameter" and ins.operand_text.strip() == str(index):
            return ins.name
    return None


def _logical_buffers(
    defs: dict[str, dict[str, Instruction]], comp: str, ins: Instruction, bufs: tuple[Buffer, ...]
) -> tuple[Buffer, ...]:
    """``bufs`` at the element types the program asked for, before XLA widened them.

    The CPU backend cannot reduce or gather bf16, so float normalisation wraps such
    collectives in converts to f32 and back. A reduction it widened calls a
    ``*_promoted`` computation; the narrow type is the one converted from just
    before. A widened gather is recognised by both converts: its operand comes from a
    narrower type and every use converts the result straight back to it. A convert
    the program asked for (``reduce_dtype="fp32"`` with bf16 compute) has neither
    mark and is left alone.
    """
    if len(ins.operands) != len(bufs):
        return bufs
    to_apply = re.search(r"to_apply=%?([\w.\-]+)", ins.attrs)
    promoted = bool(to_apply and to_apply.group(1).endswith("_promoted"))
    back = set() if to_apply else _narrowed_after(defs, comp, ins.name)
    out = []
    for op, b in zip(ins.operands, bufs, strict=True):
        sources = [
            src for src, _ in _widening_converts(defs, comp, op) if _is_narrower_float(src, b.dtype)
        ]
        if promoted:
            out.append(Buffer(min(sources, key=dtype_bytes) if sources else "bf16", b.shape))
        elif sources and back and set(sources) & back:
            out.append(Buffer(min(set(sources) & back, key=dtype_bytes), b.shape))
        else:
            out.append(b)
    return tuple(out)


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
            if kind == "collective-permute":
                pm = _PAIRS_RE.search(ins.attrs)
                pairs = parse_replica_groups(pm.group(1), num_devices) if pm else ()
                groups = pairs
                size = len({d for p in pairs for d in p}) or num_devices
            else:
                gm = _GROUPS_RE.search(ins.attrs)
                if gm is None and "replica_groups=" in ins.attrs:  # a form we do not know
                    at = ins.attrs.index("replica_groups=")
                    raise ValueError(
                        f"{ins.name}: cannot parse replica groups in {ins.attrs[at : at + 120]!r}"
                    )
                groups = (
                    parse_replica_groups(gm.group(1), num_devices)
                    if gm
                    else (tuple(range(num_devices)),)
                )
                size = len(groups[0])
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
            logical = _logical_buffers(defs, comp, ins, bufs)
            out.append(
                Collective(ins.name, kind, ins.opcode, comp, bufs, groups, size, n_runs, logical)
            )
    if any(c.promoted for c in out):
        notes.append(
            "XLA widened some collectives' element type (converts around them; the CPU "
            "backend runs bf16 collectives in f32): 'logical' bytes use the narrow type"
        )
    return HloCollectives(out, notes)


SCOPES = ("intra", "inter", "both")


def scope(groups: tuple[tuple[int, ...], ...], group_size: int) -> str:
    """Where a collective's traffic flows on a hybrid mesh of groups of ``group_size`` devices.

    Device ``d`` (its index in the mesh, which the SPMD program's ids follow) sits in
    group ``d // group_size`` at position ``d % group_size``. ``"intra"``: every
    replica group stays inside one group (the fast links of a node); ``"inter"``:
    it links the same position across groups (one all-reduce of the gradient shard);
    ``"both"``: it spans both (stage 0's all-reduce, replicated small leaves).
    """
    if all(len({d // group_size for d in g}) <= 1 for g in groups):
        return "intra"
    if all(len({d % group_size for d in g}) <= 1 for g in groups):
        return "inter"
    return "both"


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
    """

    grad_param: float
    scalars: float
    by_kind: dict[str, float]
    ops: int
    runs: int
    grad_param_logical: float
    by_scope: dict[str, float] = field(default_factory=dict)
    by_scope_logical: dict[str, float] = field(default_factory=dict)


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
    by_scope = dict.fromkeys(SCOPES, 0.0)
    by_scope_logical = dict.fromkeys(SCOPES, 0.0)
    for c in collectives:
        narrow = c.logical_buffers or c.buffers
        where = "intra" if group_size is None else scope(c.replica_groups, group_size)
        for b, nb in zip(c.buffers, narrow, strict=True):
            sent = c.runs * c.wire_bytes(b)
            if b.elements < scalar_elements:
                small += sent
            else:
                big += sent
                logical += c.runs * c.wire_bytes(nb)
                by_kind[c.kind] = by_kind.get(c.kind, 0.0) + sent
                by_scope[where] += sent
                by_scope_logical[where] += c.runs * c.wire_bytes(nb)
    runs = sum(c.runs for c in collectives)
    return Traffic(big, small, by_kind, len(collectives), runs, logical, by_scope, by_scope_logical)
