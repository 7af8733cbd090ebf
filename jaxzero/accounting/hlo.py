"""Compiled HLO text as data: element types, instructions, computations, call graph.

:func:`multiplicities` says how many times each computation runs per step: a
``while`` body (scanned layers, micro-batches) appears once in
``compiled.as_text()`` but runs ``known_trip_count`` times, so the computations are
parsed into a call graph and every path from ENTRY is counted.
:mod:`jaxzero.accounting.comm` finds the collectives in it. :func:`host_transfers` reads
what the program keeps in host memory (``S(5)`` layouts: ZeRO-Offload's state) and the
copies that move it between host and device.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_DTYPE_BYTES = {
    "pred": 1,
    "s2": 0.25,
    "u2": 0.25,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
    "opaque": 0,
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
    raise ValueError(f"unbalanced brackets in {s[start : start + 80]!r}")


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
        name,
        type_text,
        om.group(1),
        rest[close:],
        operands,
        bool(m.group(1)),
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


# ----------------------------------------------------------------------------- host memory

HOST_MEMORY_SPACE = 5  # XLA's Layout::kHostMemorySpace: S(5) in a layout, pinned_host in JAX
_HOST_RE = re.compile(r"\bS\(" + str(HOST_MEMORY_SPACE) + r"\)")
_ARRAY_LAYOUT_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^{}]*)\})?")


@dataclass(frozen=True)
class HostTransfers:
    """What a compiled program keeps in host memory, and how it moves it.

    Attributes:
      parameters: entry parameters (arrays) whose layout is in host memory (``S(5)``).
      outputs: outputs in host memory.
      parameter_bytes: their bytes (per device: an SPMD program's shapes are shards) ...
      output_bytes: ... the outputs' ...
      alias_bytes: ... and of host outputs that alias a host parameter (a donated state:
        one buffer, counted once).
      to_device: ``copy-start`` (async) or ``copy`` instructions from host memory to the
        device's, each counted once (a ``copy-done`` completes its start).
      to_host: the same, device to host.
      copy_done: ``copy-done`` instructions that complete a host transfer.
      to_device_bytes: bytes the transfers to the device move per step (runs counted:
        a transfer in a loop body moves once per trip) ...
      to_host_bytes: ... and those back to host memory.
    """

    parameters: int = 0
    outputs: int = 0
    parameter_bytes: float = 0.0
    output_bytes: float = 0.0
    alias_bytes: float = 0.0
    to_device: int = 0
    to_host: int = 0
    copy_done: int = 0
    to_device_bytes: float = 0.0
    to_host_bytes: float = 0.0

    @property
    def resident_bytes(self) -> float:
        """Host bytes the program's arguments and outputs occupy at once: parameters +
        outputs − aliased (a donated host state is one buffer)."""
        return self.parameter_bytes + self.output_bytes - self.alias_bytes


def _top_level(text: str) -> list[str]:
    """The top-level comma-separated items of a tuple type ``(a, (b, c), d)`` (or the type
    itself when it is no tuple), layouts and comments kept."""
    s = re.sub(r"/\*.*?\*/", "", text).strip()
    if not s.startswith("("):
        return [s]
    items, depth, start = [], 0, 1
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                items.append(s[start:i])
                break
        elif c == "," and depth == 1:
            items.append(s[start:i])
            start = i + 1
    return [it.strip() for it in items if it.strip()]


def _arrays(text: str) -> list[tuple[Buffer, bool]]:
    """Every array of a type with layouts, and whether its layout is in host memory."""
    out = []
    for m in _ARRAY_LAYOUT_RE.finditer(re.sub(r"/\*.*?\*/", "", text)):
        if m.group(1) in ("token", "opaque"):
            continue
        dims = tuple(int(d) for d in re.findall(r"\d+", m.group(2) or ""))
        out.append((Buffer(m.group(1), dims), bool(_HOST_RE.search(m.group(3) or ""))))
    return out


def _host_bytes(text: str) -> tuple[int, float]:
    arrays = [b for b, host in _arrays(text) if host]
    return len(arrays), float(sum(b.nbytes for b in arrays))


def _entry_layout(header: str) -> tuple[list[str], list[str]]:
    """``entry_computation_layout={(params)->result}``: each parameter's type, and each
    output's (the result's top-level items)."""
    at = header.find("entry_computation_layout={")
    if at < 0:
        return [], []
    start = header.index("{", at)
    body = header[start + 1 : _match_paren(header, start) - 1]
    params_end = _match_paren(body, 0)
    params, result = body[:params_end], body[params_end:].lstrip()
    result = result[2:].strip() if result.startswith("->") else result
    return _top_level(params), _top_level(result)


_ALIAS_RE = re.compile(r"\{(\d*)\}\s*:\s*\((\d+)\s*,\s*\{[^}]*\}")


def _aliases(header: str) -> list[tuple[int, int]]:
    """``input_output_alias={ {0}: (0, {}, may-alias), ... }``: (output index, parameter)."""
    at = header.find("input_output_alias={")
    if at < 0:
        return []
    start = header.index("{", at)
    body = header[start + 1 : _match_paren(header, start) - 1]
    return [(int(o or 0), int(p)) for o, p in _ALIAS_RE.findall(body)]


def host_transfers(text: str) -> HostTransfers:
    """Host memory in compiled HLO text: which entry parameters and outputs live there
    (``S(5)`` in ``entry_computation_layout``), and the instructions that move data
    between it and the device (``copy-start``/``copy-done`` on GPU, or a ``copy``
    whose operand and result are in different memories).

    On CPU, XLA keeps the host layouts of the entry but moves nothing (host and device
    are one memory): an offloaded leaf is one host parameter and one host output, and
    there are no transfers. On GPU each offloaded leaf is copied to the device for the
    update and back: a ``copy-start`` from ``S(5)`` and one to it.
    """
    if not _HOST_RE.search(text):
        return HostTransfers()  # nothing in host memory: no need to parse the module
    header = next((ln for ln in text.splitlines() if ln.startswith("HloModule")), "")
    params, outputs = _entry_layout(header)
    p_host = [_host_bytes(p) for p in params]
    o_host = [_host_bytes(o) for o in outputs]
    alias = sum(
        (
            o_host[o][1]
            for o, p in _aliases(header)
            if o < len(o_host) and p < len(p_host) and o_host[o][0] and p_host[p][0]
        ),
        0.0,
    )
    module = parse_hlo(text)
    runs = multiplicities(module)
    to_dev = to_host = done = 0
    to_dev_bytes = to_host_bytes = 0.0
    starts: dict[str, bool] = {}  # copy-start name -> its copy moves to host memory
    for comp, instrs in module.computations.items():
        for ins in instrs:
            if ins.opcode not in ("copy-start", "copy"):
                continue
            if ins.opcode == "copy-start":  # (destination, source, context)
                items = _top_level(ins.type_text)
                dest, src = items[0], items[1] if len(items) > 1 else ins.operand_text
            else:
                dest, src = ins.type_text, ins.operand_text
            d_host, s_host = _host_bytes(dest)[0] > 0, _host_bytes(src)[0] > 0
            if d_host == s_host or not src:
                continue
            moved = runs.get(comp, 1) * sum(b.nbytes for b, _ in _arrays(dest))
            if d_host:
                to_host += 1
                to_host_bytes += moved
            else:
                to_dev += 1
                to_dev_bytes += moved
            starts[ins.name] = d_host
    for instrs in module.computations.values():
        done += sum(
            1
            for ins in instrs
            if ins.opcode == "copy-done" and any(op in starts for op in ins.operands)
        )
    return HostTransfers(
        parameters=sum(c for c, _ in p_host),
        outputs=sum(c for c, _ in o_host),
        parameter_bytes=sum(b for _, b in p_host),
        output_bytes=sum(b for _, b in o_host),
        alias_bytes=alias,
        to_device=to_dev,
        to_host=to_host,
        copy_done=done,
        to_device_bytes=to_dev_bytes,
        to_host_bytes=to_host_bytes,
    )
