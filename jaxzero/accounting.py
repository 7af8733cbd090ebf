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
* bytes on the wire per device with the ring formulas of the design doc;

and puts the formulas of :mod:`jaxzero.estimate` next to them.

The HLO parser only needs the text and is usable without an Engine
(:func:`collectives_from_hlo`); :func:`report` ties everything to an Engine.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from jaxzero import estimate as est

COLLECTIVE_KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
)
SCALAR_ELEMENTS = 64  # buffers with fewer elements are scalars (loss, norms, counters)

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "token": 0, "opaque": 0,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type (``f32`` -> 4; all fp8 kinds -> 1)."""
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    if dtype.startswith("f8"):
        return 1
    if dtype.startswith("f4") or dtype.startswith("e2m1"):
        return 0.5
    raise ValueError(f"unknown HLO element type {dtype!r}")


# ----------------------------------------------------------------------------- HLO types


@dataclass(frozen=True)
class Buffer:
    """One array: its element type and dimensions."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> float:
        return self.elements * dtype_bytes(self.dtype)


# A parsed HLO type: a Buffer, or a tuple of types.
HloType = Buffer | tuple


def _strip_layouts(text: str) -> str:
    """Drop ``{1,0:T(8,128)}`` layouts and ``/*index=5*/`` comments from a type."""
    text = re.sub(r"/\*.*?\*/", "", text)
    prev = None
    while prev != text:
        prev, text = text, re.sub(r"\{[^{}]*\}", "", text)
    return text


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)(?:\[([^\]]*)\])?")


def parse_type(text: str) -> HloType:
    """Parse an HLO shape such as ``(f32[8,16]{1,0}, bf16[])`` into Buffers and tuples."""
    s = _strip_layouts(text).replace(" ", "")
    pos = 0

    def node() -> HloType:
        nonlocal pos
        if s.startswith("(", pos):
            pos += 1
            items = []
            while not s.startswith(")", pos):
                items.append(node())
                if s.startswith(",", pos):
                    pos += 1
            pos += 1
            return tuple(items)
        m = _ARRAY_RE.match(s, pos)
        if not m:
            raise ValueError(f"cannot parse HLO type {text!r} at {s[pos:]!r}")
        pos = m.end()
        dims = tuple(int(d) for d in re.findall(r"\d+", m.group(2) or ""))
        # dynamic dims are written "<=8": the bound is the size we keep
        return Buffer(m.group(1), dims)

    return node()


def flatten_type(t: HloType) -> list[Buffer]:
    """All Buffers of a type, depth first."""
    if isinstance(t, Buffer):
        return [t]
    return [b for item in t for b in flatten_type(item)]


# ----------------------------------------------------------------------------- HLO module


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction, as much as the accounting needs.

    Attributes:
      name: instruction name without ``%``.
      type_text: the result shape as printed.
      opcode: e.g. ``all-gather``, ``while``, ``fusion``.
      attrs: the text after the operand list (attributes, backend_config, ...).
      operands: names of the operand instructions.
      root: whether it is its computation's ROOT.
      operand_text: the operand list as printed (``parameter(3)`` keeps its number here).
    """

    name: str
    type_text: str
    opcode: str
    attrs: str
    operands: tuple[str, ...] = ()
    root: bool = False
    operand_text: str = ""


@dataclass
class HloModule:
    """Computations of an HLO module, by name, and its ENTRY."""

    computations: dict[str, list[Instruction]]
    entry: str
    num_partitions: int = 1
    replica_count: int = 1


def _match_paren(s: str, start: int) -> int:
    """Index just past the bracket group opening at ``s[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(s)):
        c = s[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in {s[start:start + 80]!r}")


_INSTR_RE = re.compile(r"^\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(")


def parse_instruction(line: str) -> Instruction | None:
    """Split one instruction line into name, type, opcode and attributes."""
    m = _INSTR_RE.match(line)
    if not m:
        return None
    name, rest = m.group(2), re.sub(r"/\*.*?\*/", "", m.group(3))
    if rest.startswith("("):
        end = _match_paren(rest, 0)
    else:
        end = len(rest.split(" ", 1)[0])
    type_text, rest = rest[:end], rest[end:].lstrip()
    om = re.match(r"([a-z][a-z0-9\-_.]*)\(", rest)
    if not om:
        return None
    close = _match_paren(rest, om.end() - 1)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[om.end() : close - 1]))
    return Instruction(
        name, type_text, om.group(1), rest[close:], operands, bool(m.group(1)),
        rest[om.end() : close - 1],
    )


def parse_hlo(text: str) -> HloModule:
    """Parse ``compiled.as_text()`` into computations of instructions."""
    comps: dict[str, list[Instruction]] = {}
    entry = None
    current: list[Instruction] | None = None
    num_partitions = replica_count = 1
    for line in text.splitlines():
        if line.startswith("HloModule"):
            if m := re.search(r"num_partitions=(\d+)", line):
                num_partitions = int(m.group(1))
            if m := re.search(r"replica_count=(\d+)", line):
                replica_count = int(m.group(1))
            continue
        if current is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                hm = _HEADER_RE.match(line)
                if hm:
                    current = comps.setdefault(hm.group(2), [])
                    if hm.group(1):
                        entry = hm.group(2)
            continue
        if line.rstrip() == "}":
            current = None
            continue
        instr = parse_instruction(line)
        if instr is not None:
            current.append(instr)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return HloModule(comps, entry, num_partitions, replica_count)


# ----------------------------------------------------------------------------- call graph

_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations|select|scatter|comparator)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


@dataclass(frozen=True)
class CallEdge:
    """``caller`` runs ``callee`` ``factor`` times each time ``caller`` itself runs."""

    caller: str
    callee: str
    factor: int
    via: str  # opcode and attribute, e.g. "while.body"
    instruction: str


def trip_count(instr: Instruction) -> int | None:
    """``known_trip_count`` from a while op's backend_config, or None if XLA did not know."""
    m = _TRIP_RE.search(instr.attrs)
    return int(m.group(1)) if m else None


def call_edges(module: HloModule) -> tuple[list[CallEdge], list[str]]:
    """Every computation-to-computation call, weighted, plus notes on uncertain ones.

    A while body runs trip-count times per execution of the while, its condition
    once more. Async ``-done``/``-update`` ops name the same wrapped computation as
    their ``-start``; only the start is followed, so the wrapped collective counts
    once. A conditional's branches count once each (an upper bound).
    """
    edges: list[CallEdge] = []
    notes: list[str] = []
    for comp, instrs in module.computations.items():
        for ins in instrs:
            if ins.opcode.endswith("-done") or ins.opcode.endswith("-update"):
                continue
            attrs = _STRING_RE.sub('""', re.sub(r"metadata=\{[^}]*\}", "", ins.attrs))
            trips = trip_count(ins) if ins.opcode == "while" else None
            if ins.opcode == "while" and trips is None:
                notes.append(
                    f"while {ins.name} in {comp} has no known_trip_count; its body is counted once"
                )
            for m in _CALLEE_RE.finditer(attrs):
                key = m.group(1)
                for callee in re.findall(r"%?([\w.\-]+)", m.group(2)):
                    if callee not in module.computations:
                        continue
                    factor = 1
                    if ins.opcode == "while" and trips is not None:
                        factor = trips if key == "body" else trips + 1
                    edges.append(CallEdge(comp, callee, factor, f"{ins.opcode}.{key}", ins.name))
    return edges, notes


def multiplicities(module: HloModule, edges: list[CallEdge] | None = None) -> dict[str, int]:
    """Times each computation runs per execution of ENTRY.

    The sum, over every call path from ENTRY, of the product of the factors along
    it: nested loops multiply, a computation called from two places adds up.
    Computations not reachable from ENTRY get 0.
    """
    if edges is None:
        edges, _ = call_edges(module)
    callers: dict[str, list[CallEdge]] = {}
    for e in edges:
        callers.setdefault(e.callee, []).append(e)
    memo: dict[str, int] = {module.entry: 1}

    def runs(comp: str, seen: frozenset[str]) -> int:
        if comp in memo:
            return memo[comp]
        if comp in seen:
            raise ValueError(f"cycle in HLO call graph at {comp}")
        total = sum(e.factor * runs(e.caller, seen | {comp}) for e in callers.get(comp, []))
        memo[comp] = total
        return total

    return {c: runs(c, frozenset()) for c in module.computations}


# ----------------------------------------------------------------------------- collectives

_GROUPS_RE = re.compile(
    r"replica_groups=(\{(?:[^{}]|\{[^{}]*\})*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)"
)
_PAIRS_RE = re.compile(r"source_target_pairs=(\{(?:[^{}]|\{[^{}]*\})*\})")


def parse_replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups from ``{{0,1},{2,3}}``, ``{}`` (all devices) or iota ``[2,4]<=[4,2]T(1,0)``.

    The iota form means: ``iota(prod(reshape))`` reshaped to ``reshape``, transposed
    by the permutation (if any), then reshaped to ``[num_groups, group_size]``.
    """
    text = text.strip()
    if text.startswith("{"):
        groups = tuple(
            tuple(int(x) for x in re.findall(r"\d+", g)) for g in re.findall(r"\{([^{}]*)\}", text)
        )
        groups = tuple(g for g in groups if g)
        return groups or (tuple(range(num_devices)),)
    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not m:
        raise ValueError(f"cannot parse replica groups {text!r}")
    out_shape = [int(x) for x in m.group(1).split(",")]
    reshape = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape(out_shape[0], -1) if len(out_shape) > 1 else ids.reshape(1, -1)
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
    return src.startswith(_FLOATS) and dst.startswith(_FLOATS) and (
        dtype_bytes(src) < dtype_bytes(dst)
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
        if u.opcode == "convert" and _is_narrower_float(_first_dtype(u), dtype or "f32"):
            got = {_first_dtype(u)}
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
                groups = (
                    parse_replica_groups(gm.group(1), num_devices)
                    if gm else (tuple(range(num_devices)),)
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
    """

    grad_param: float
    scalars: float
    by_kind: dict[str, float]
    ops: int
    runs: int
    grad_param_logical: float


def traffic(collectives: list[Collective], scalar_elements: int = SCALAR_ELEMENTS) -> Traffic:
    """Sum ring bytes × runs per step, splitting scalar buffers from the real traffic."""
    big = small = logical = 0.0
    by_kind: dict[str, float] = {}
    for c in collectives:
        narrow = c.logical_buffers or c.buffers
        for b, nb in zip(c.buffers, narrow, strict=True):
            sent = c.runs * c.wire_bytes(b)
            if b.elements < scalar_elements:
                small += sent
            else:
                big += sent
                logical += c.runs * c.wire_bytes(nb)
                by_kind[c.kind] = by_kind.get(c.kind, 0.0) + sent
    runs = sum(c.runs for c in collectives)
    return Traffic(big, small, by_kind, len(collectives), runs, logical)


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
    import jax

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


def count_moments(opt_state: Any, params: Any) -> int:
    """How many params-shaped pytrees the optimizer state holds (Adam: mu and nu -> 2).

    A structural fact about the optimizer, used for the theory's K; not a byte count.
    """
    import jax

    target = jax.tree.structure(params)
    found = 0

    def visit(x: Any) -> bool:
        nonlocal found
        try:
            if jax.tree.structure(x) == target and jax.tree.leaves(x):
                found += 1
                return True
        except Exception:  # noqa: BLE001 - exotic nodes simply are not moments
            return False
        return False

    jax.tree.leaves(opt_state, is_leaf=visit)
    return found


@dataclass
class Theory:
    """The design doc's figures for this engine's Ψ, N, dtypes and stage (bytes/device)."""

    params: float
    master: float
    optimizer: float
    grads: float
    persistent: float
    model_states: float
    comm_grad: float
    comm_param: float
    comm: float
    moments: int


def theory(
    psi: float,
    n: int,
    stage: int,
    param_bytes: float,
    grad_bytes: float,
    master_bytes: float,
    moments: int,
    micro_batches: int = 1,
    moment_bytes: float = 4.0,
    param_gathers: int = 2,
) -> Theory:
    """Model-state memory and communication from :mod:`jaxzero.estimate`'s formulas.

    Args:
      psi: logical parameter count.
      n: shards (N).
      stage: ZeRO stage.
      param_bytes: working-param element size (also what stage 1-3 all-gather).
      grad_bytes: element size of gradients on the wire (the reduce dtype).
      master_bytes: 4 with an fp32 master copy, else 0.
      moments: params-shaped optimizer moments (Adam: 2).
      micro_batches: gradient-accumulation steps per optimizer step.
      moment_bytes: bytes per moment element (fp32).
      param_gathers: stage-3 gathers per param and micro-batch (see ``est.comm_bytes``).
    """
    prec = est.Precision(
        param=param_bytes, grad=param_bytes, master=master_bytes,
        optimizer=moments * moment_bytes,
    )
    ms = est.model_state_bytes(psi, n, stage, prec)
    cm = est.comm_bytes(psi, n, stage, grad_bytes, param_bytes, micro_batches, param_gathers)
    return Theory(
        params=ms.params, master=ms.master, optimizer=ms.optimizer, grads=ms.grads,
        persistent=ms.persistent, model_states=ms.total, comm_grad=cm.grad,
        comm_param=cm.param, comm=cm.total, moments=moments,
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


def layout_expectation(
    layouts: list[Any],
    n: int,
    stage: int,
    param_bytes: float,
    grad_bytes: float,
    master_bytes: float,
    moments: int,
    micro_batches: int = 1,
    moment_bytes: float = 4.0,
    param_gathers: int = 2,
) -> LayoutExpectation:
    """Leaf-by-leaf persistent bytes and traffic for the engine's layouts.

    Args:
      layouts: objects with ``shape``, ``dim`` (None: replicated) and ``padded_shape``.
      n, stage, param_bytes, grad_bytes, master_bytes, moments, micro_batches,
        moment_bytes, param_gathers: as for :func:`theory`.
    """
    frac = (n - 1) / n if n > 1 else 0.0
    k = micro_batches
    persistent = comm = 0.0
    padded_total = replicated = 0
    for lay in layouts:
        size = math.prod(lay.shape)
        if lay.dim is None:
            replicated += size
            padded_total += size
            persistent += size * (param_bytes + master_bytes + moments * moment_bytes)
            # stage 0 and 1 reduce once per step, stages 2-3 once per micro-batch (hook)
            comm += (k if stage >= 2 else 1) * 2 * size * grad_bytes * frac
            continue
        padded = math.prod(lay.padded_shape)
        padded_total += padded
        shard = padded / n
        params = shard if stage == 3 else size
        state = shard if stage >= 1 else size
        persistent += params * param_bytes + state * (master_bytes + moments * moment_bytes)
        if stage == 0:
            comm += 2 * size * grad_bytes * frac
        elif stage == 1:
            comm += padded * (grad_bytes + param_bytes) * frac
        elif stage == 2:
            comm += padded * (k * grad_bytes + param_bytes) * frac
        else:
            comm += k * padded * (grad_bytes + param_gathers * param_bytes) * frac
    return LayoutExpectation(persistent, comm, padded_total, replicated)


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
        """Measured persistent bytes / theory (params + master + moments)."""
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
                self.traffic.grad_param_logical / self.expected.comm if self.expected.comm
                else None
            ),
        }
        d["collectives"] = [
            {
                "name": c.name, "kind": c.kind, "opcode": c.opcode, "computation": c.computation,
                "buffers": [_fmt_buffer(b) for b in c.buffers],
                "logical_buffers": [_fmt_buffer(b) for b in c.logical_buffers],
                "group_size": c.group_size, "num_groups": len(c.replica_groups), "runs": c.runs,
                "bytes_per_run": c.bytes_per_run, "bytes_per_step": c.bytes_per_step,
            }
            for c in self.collectives
        ]
        return d

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """Measured vs. theory, MB = 1e6 bytes."""
        c, t, p, e = self.config, self.theory, self.persistent, self.expected
        mb = lambda x: f"{x / 1e6:12.4f}"
        ratio = lambda a, b: f"{a / b:8.3f}" if b else "       -"
        head = f"{'':<30}{'measured':>12}{'formula':>12}{'ratio':>8}{'layouts':>12}{'ratio':>8}"
        lines = [
            f"stage {c['stage']}, N = {c['num_shards']}, {c['precision']} "
            f"(compute {c['compute_dtype']}, gradient reduce {c['reduce_dtype']}), "
            f"{c['micro_batches']} micro-batch(es)",
            f"Ψ = {c['num_params']:,} (stored {e.padded_params:,} with padding; "
            f"{e.replicated_params:,} in replicated small leaves); {t.moments} optimizer "
            "moment(s) per param",
            "",
            "persistent memory per device (MB)",
            head,
            f"{'working params':<30}{mb(p['params'])}{mb(t.params)}"
            f"{ratio(p['params'], t.params)}",
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


def _stage3_notes(engine: Any, collectives: list[Collective], scalar_elements: int) -> list[str]:
    """Explain stage-3 traffic below 3Ψ: how much the backward pass gathers again.

    The design gathers every param twice (forward, backward) per reduce-scatter of
    its gradient. Counting elements (not bytes, so dtypes do not matter) shows how
    much of that second gather the compiled step really does.
    """
    if engine.stage != 3:
        return []

    def elements(kind: str) -> int:
        return sum(
            c.runs * b.elements for c in collectives if c.kind == kind
            for b in c.buffers if b.elements >= scalar_elements
        )

    gathered, scattered = elements("all-gather"), elements("reduce-scatter")
    notes = []
    if not getattr(engine, "per_layer", True):
        notes.append(
            "per_layer=False: the engine gathers the whole tree once per micro-batch and keeps "
            "it through the backward pass (coarse stage 3): the theory column counts one gather "
            "(2Ψb), not ZeRO-3's two (3Ψb)"
        )
    if getattr(engine, "per_layer", True) and scattered and gathered < 2 * scattered * (1 - 1e-3):
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
    engine: Any,
    state: Any,
    batch: Any,
    *,
    scalar_elements: int = SCALAR_ELEMENTS,
    compiled: Any = None,
) -> Report:
    """Measure an Engine's step and compare it with the ZeRO formulas.

    Compiles the step (``engine.compile``) without running it, reads device 0's
    share of ``state`` and parses the compiled HLO.

    Args:
      engine: a :class:`jaxzero.Engine`.
      state: its TrainState (from ``engine.init``).
      batch: a sample global batch.
      scalar_elements: buffers with fewer elements count as scalars.
      compiled: an already compiled step, to skip compiling again.
    """
    import jax

    from jaxzero.partition import is_layout

    dev0 = engine.mesh.devices.flat[0]
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
    tr = traffic(hlo.collectives, scalar_elements)

    psi = int(engine.num_params)
    reduce_dtype = engine.reduce_dtype or engine.compute_dtype
    param_bytes, grad_bytes = _itemsize(engine.compute_dtype), _itemsize(reduce_dtype)
    master_bytes = 4.0 if state.master is not None else 0.0
    moments = count_moments(state.opt_state, state.params)
    n, k = engine.num_shards, engine.micro_batches
    gathers = 2 if getattr(engine, "per_layer", True) else 1  # coarse stage 3 gathers once
    th = theory(psi, n, engine.stage, param_bytes, grad_bytes, master_bytes, moments, k,
                param_gathers=gathers)
    layouts = jax.tree.leaves(engine.layouts, is_leaf=is_layout)
    ex = layout_expectation(
        layouts, n, engine.stage, param_bytes, grad_bytes, master_bytes, moments, k,
        param_gathers=gathers,
    )
    notes = list(hlo.notes)
    if moments == 0:
        notes.append("no params-shaped moments found in the optimizer state; theory assumes none")
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
    notes += _stage3_notes(engine, hlo.collectives, scalar_elements)
    config = {
        "stage": engine.stage,
        "num_shards": n,
        "devices": int(engine.mesh.devices.size),
        "precision": engine.precision,
        "compute_dtype": str(np.dtype(engine.compute_dtype)),
        "reduce_dtype": str(np.dtype(reduce_dtype)),
        "micro_batches": k,
        "num_params": psi,
        "padded_params": ex.padded_params,
        "scalar_elements": scalar_elements,
    }
    return Report(
        config, persistent, th, ex, compiled_memory(compiled), tr, hlo.collectives, notes
    )
