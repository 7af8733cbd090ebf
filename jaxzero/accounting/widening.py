"""The element types a collective had before the backend widened them.

The CPU backend cannot reduce or gather bf16, so XLA's float normalisation wraps
such collectives in converts to f32 and back. :func:`logical_buffers` walks the HLO
around a collective to find the narrow type the program asked for, so that traffic
can be counted at it as well as at what the compiled program sends.
"""

from __future__ import annotations

import re

from jaxzero.accounting.hlo import (
    Buffer,
    Instruction,
    dtype_bytes,
    flatten_type,
    parse_type,
)

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


def _widened_from(
    defs: dict[str, dict[str, Instruction]], comp: str, name: str, depth: int = 0
) -> str | None:
    """The element type ``name`` was converted up from, when it is that convert itself
    (seen through layout ops and a producing fusion's root): nothing computed between.

    So the CPU backend leaves a gather of a narrow value that the program uses wide (a
    bf16 frozen param in an fp32 run: gathered as stored, cast up after): the convert
    up moves ahead of the gather, and no use converts its result back down.
    """
    ins = defs.get(comp, {}).get(name)
    if ins is None or depth > 16 or not ins.operands:
        return None
    if ins.opcode == "convert":
        return _first_dtype(defs[comp].get(ins.operands[0]))
    if ins.opcode in _LAYOUT_OPS:
        return _widened_from(defs, comp, ins.operands[0], depth + 1)
    if ins.opcode == "fusion" and (callee := _callee(ins)) in defs:
        root = next((i for i in defs[callee].values() if i.root), None)
        return _widened_from(defs, callee, root.name, depth + 1) if root else None
    return None


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


def logical_buffers(
    defs: dict[str, dict[str, Instruction]], comp: str, ins: Instruction, bufs: tuple[Buffer, ...]
) -> tuple[Buffer, ...]:
    """``bufs`` at the element types the program asked for, before XLA widened them.

    The CPU backend cannot reduce or gather bf16, so float normalisation wraps such
    collectives in converts to f32 and back. A reduction it widened calls a
    ``*_promoted`` computation; the narrow type is the one converted from just
    before. A widened gather is recognised by both converts: its operand comes from a
    narrower type and every use converts the result straight back to it; or, where
    the program's use is wide, by its operand being the convert up itself
    (:func:`_widened_from`; jaxzero gathers every param in its stored dtype). A
    convert the program asked for (``reduce_dtype="fp32"`` with bf16 compute) is a
    reduction's, with none of these marks, and is left alone.
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
        # a gather (nothing reduced) of a narrow value, converted up just before it
        up = None if to_apply else _widened_from(defs, comp, op)
        if promoted:
            out.append(Buffer(min(sources, key=dtype_bytes) if sources else "bf16", b.shape))
        elif sources and back and set(sources) & back:
            out.append(Buffer(min(set(sources) & back, key=dtype_bytes), b.shape))
        elif up is not None and _is_narrower_float(up, b.dtype):
            out.append(Buffer(up, b.shape))
        else:
            out.append(b)
    return tuple(out)
