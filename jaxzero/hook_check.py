"""Trace-time proof that a per-layer model reaches its params only through ``use_params``.

With ``per_layer=True`` at stages 2–3 the model receives :class:`~jaxzero.hooks.Stored`
leaves: a device's slice (stage 3) or the whole param (stage 2) plus a zero
gradient slot. Arithmetic on a ``Stored`` raises, but ``jax.tree`` utilities look
inside it and hand out the raw slice and slot, so an L2 penalty over
``jax.tree.leaves(params)`` or a ``jax.tree.map`` reparametrisation before
``use_params`` would silently compute the wrong loss or gradient.

:func:`check_uses` traces the loss once with *probe* leaves, whose ``use_params``
returns arrays of the right shape that do not depend on the stored ones, and
follows every stored array through the jaxpr. Any equation that still reads one is
a misuse, except views that index away stacked leading dims (what a ``scan`` or
``x[i]`` over stacked layers does) and dtype casts. The walk follows ``jit``,
``scan``, ``while``, ``cond``, ``checkpoint`` and ``custom_jvp``/``custom_vjp``
calls; a stored array that enters any other primitive with a sub-program (a nested
``shard_map``, a new control-flow primitive) is refused by name, never passed.

Only JAX's public extended API is used (``jax.extend``): primitives are matched by
identity, sub-programs found with ``jaxprs_in_params``, and how a loop's inputs map
to its body's is read off the shapes, never off a primitive's private parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias, cast

import jax
from jax.core import ShapedArray
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var, jaxprs_in_params
from jax.extend.core import primitives as prim
from jax.extend.source_info_util import summarize

from jaxzero.hooks import Stored
from jaxzero.partition import LeafLayout
from jaxzero.types import Params

# views that select stacked layers: allowed while the sharded dim stays whole
_VIEWS = {prim.slice_p, prim.dynamic_slice_p, prim.squeeze_p, prim.reshape_p, prim.gather_p}
_CASTS = {prim.convert_element_type_p, prim.copy_p, prim.device_put_p, prim.reduce_precision_p}
# primitives whose one sub-program takes the equation's inputs and gives its outputs
_CALLS = {
    prim.jit_p,
    prim.closed_call_p,
    prim.call_p,
    prim.remat_p,
    prim.custom_jvp_call_p,
    prim.custom_vjp_call_p,
}

Taint: TypeAlias = frozenset[str]  # of param paths


@dataclasses.dataclass(frozen=True)
class Misuse:
    """A stored param read by ``primitive`` at ``where`` other than through use_params.

    ``opaque``: the primitive has a sub-program this check cannot follow.
    """

    path: str
    primitive: str
    where: str
    opaque: bool = False


def _view_ok(in_shape: Sequence[int], out_shape: Sequence[int], lay: LeafLayout) -> bool:
    """Whether a view changes only a stacked leading dim that is not the sharded one."""
    common = 0
    while (
        common < min(len(in_shape), len(out_shape))
        and in_shape[len(in_shape) - 1 - common] == out_shape[len(out_shape) - 1 - common]
    ):
        common += 1
    if common == len(in_shape) and len(out_shape) == len(in_shape):
        return True  # same shape
    if common < len(in_shape) - 1 or len(out_shape) - common > 1:
        return False  # more than the leading dim changed
    changed = len(lay.shape) - len(in_shape)  # the layout dim that in_shape[0] is
    return lay.dim is None or changed < lay.dim


class _Walk:
    """Taint propagation through a jaxpr, collecting :class:`Misuse` records."""

    def __init__(self, lays: dict[str, LeafLayout]) -> None:
        self.lays = lays
        self.found: list[Misuse] = []
        self.site = ""  # the innermost user line seen on the way down

    def flag(self, eqn: JaxprEqn, paths: Iterable[str], opaque: bool = False) -> None:
        where = summarize(eqn.source_info) or self.site  # JAX's own code is filtered out
        self.found.extend(Misuse(p, eqn.primitive.name, where, opaque) for p in sorted(paths))

    def jaxpr(
        self, jaxpr: Jaxpr, taints: Sequence[Taint], eqn: JaxprEqn | None = None
    ) -> list[Taint]:
        """Propagate taint from ``jaxpr``'s inputs to its outputs (``eqn``: the one
        whose sub-program it is)."""
        outer = self.site
        self.site = (summarize(eqn.source_info) if eqn is not None else "") or outer
        try:
            return self._eqns(jaxpr, taints)
        finally:
            self.site = outer

    def _eqns(self, jaxpr: Jaxpr, taints: Sequence[Taint]) -> list[Taint]:
        env: dict[Var, Taint] = {v: t for v, t in zip(jaxpr.invars, taints, strict=True) if t}
        get = lambda v: env.get(v, Taint()) if isinstance(v, Var) else Taint()
        for eqn in jaxpr.eqns:
            ins = [get(v) for v in eqn.invars]
            if any(ins):
                for v, t in zip(eqn.outvars, self.eqn(eqn, ins), strict=True):
                    if t:
                        env[v] = t
        return [get(v) for v in jaxpr.outvars]

    def eqn(self, eqn: JaxprEqn, ins: list[Taint]) -> list[Taint]:
        p = eqn.primitive
        subs = list(jaxprs_in_params(eqn.params))
        if p in _VIEWS or p in _CASTS:
            src, shape = eqn.invars[0], _array(eqn.outvars[0]).shape
            bad = {
                path
                for path in ins[0]
                if p in _VIEWS and not _view_ok(_array(src).shape, shape, self.lays[path])
            }
            bad |= {path for t in ins[1:] for path in t}  # a stored array used as an index
            if not bad:
                return [ins[0]] * len(eqn.outvars)
            self.flag(eqn, bad)
        elif p is prim.scan_p and len(subs) == 1 and _fits(subs[0], eqn.invars, eqn.outvars):
            return self.scan(eqn, subs[0], ins)
        elif p is prim.while_p and len(subs) == 2:
            return self.while_(eqn, subs, ins)
        elif p is prim.cond_p and all(_fits(b, eqn.invars[1:], eqn.outvars) for b in subs):
            if ins[0]:
                self.flag(eqn, ins[0])  # a branch chosen by a param's value
            outs = [self.jaxpr(b, ins[1:], eqn) for b in subs]
            return [Taint().union(*ts) for ts in zip(*outs, strict=True)]
        elif p in _CALLS and len(subs) == 1 and _fits(subs[0], eqn.invars, eqn.outvars):
            return self.jaxpr(subs[0], ins, eqn)
        else:
            self.flag(eqn, Taint().union(*ins), opaque=bool(subs))
        return [Taint()] * len(eqn.outvars)

    def scan(self, eqn: JaxprEqn, body: Jaxpr, ins: list[Taint]) -> list[Taint]:
        """Inputs are consts, carries, xs; outputs carries, ys. Stacked xs and ys have
        one more (leading) dim outside the body than inside; consts and carries do not."""
        n_carry = _prefix(eqn.outvars, body.outvars, same_rank=True)
        n_xs = _prefix(eqn.invars[::-1], body.invars[::-1], same_rank=False)
        start = len(ins) - n_xs - n_carry
        ins = list(ins)
        while True:  # a carry may pick up taint from the previous iteration
            outs = self.jaxpr(body, ins, eqn)
            carry = [
                a | b for a, b in zip(ins[start : start + n_carry], outs[:n_carry], strict=True)
            ]
            if carry == ins[start : start + n_carry]:
                return outs
            ins[start : start + n_carry] = carry

    def while_(self, eqn: JaxprEqn, subs: list[Jaxpr], ins: list[Taint]) -> list[Taint]:
        """Inputs are the condition's consts, the body's consts, then the carries (the
        outputs). The condition is the sub-program with one boolean scalar output."""
        n = len(eqn.outvars)
        cond_first = _is_predicate(subs[0]) or not _is_predicate(subs[1])
        cond, body = subs if cond_first else subs[::-1]
        nc, nb = len(cond.invars) - n, len(body.invars) - n
        if nc < 0 or nb < 0 or nc + nb + n != len(ins):
            self.flag(eqn, Taint().union(*ins), opaque=True)
            return [Taint()] * n
        carry = list(ins[nc + nb :])
        while True:
            self.jaxpr(cond, ins[:nc] + carry, eqn)
            outs = self.jaxpr(body, ins[nc : nc + nb] + carry, eqn)
            new = [a | b for a, b in zip(carry, outs, strict=True)]
            if new == carry:
                return carry
            carry = new


def _array(v: Var | Literal) -> ShapedArray:
    """``v``'s abstract value, an array's here (jax types it as any abstract value)."""
    return cast(ShapedArray, v.aval)


def _fits(sub: Jaxpr, invars: Sequence[Var | Literal], outvars: Sequence[Var | Literal]) -> bool:
    return len(sub.invars) == len(invars) and len(sub.outvars) == len(outvars)


def _prefix(outer: Sequence[Var | Literal], inner: Sequence[Var | Literal], same_rank: bool) -> int:
    """How many leading vars have the same rank outside and inside (or one more outside)."""
    n = 0
    for o, i in zip(outer, inner, strict=False):
        if (_array(o).ndim == _array(i).ndim) != same_rank:
            break
        n += 1
    return n


def _is_predicate(sub: Jaxpr) -> bool:
    return (
        len(sub.outvars) == 1
        and isinstance(sub.outvars[0].aval, ShapedArray)  # not a token
        and sub.outvars[0].aval.shape == ()
        and sub.outvars[0].aval.dtype == bool
    )


def misuses(fn: Callable[..., object], stored: Params, *args: object) -> list[Misuse]:
    """Where ``fn(stored, *args)`` uses a ``Stored`` leaf other than through ``use_params``."""
    is_stored = lambda x: isinstance(x, Stored)
    leaves, treedef = jax.tree.flatten(stored, is_leaf=is_stored)
    probes = [
        Stored(x.value, x.slot, dataclasses.replace(x.op, probe=True)) if is_stored(x) else x
        for x in leaves
    ]
    lays = {x.op.layout.path: x.op.layout for x in leaves if is_stored(x)}

    def flat(leaves: list[object], *args: object) -> object:  # leaves: arrays and Stored
        return fn(jax.tree.unflatten(treedef, leaves), *args)

    closed = jax.make_jaxpr(flat)(probes, *args)
    taints: list[Taint] = []
    for x in leaves:  # a Stored flattens to (value, slot)
        n = len(jax.tree.leaves(x))
        taints += [Taint({x.op.layout.path}) if is_stored(x) else Taint()] * n
    taints += [Taint()] * (len(closed.jaxpr.invars) - len(taints))
    walk = _Walk(lays)
    walk.jaxpr(closed.jaxpr, taints)
    return list(dict.fromkeys(walk.found))


def _sites(found: list[Misuse]) -> str:
    sites: dict[tuple[str, str], list[str]] = {}
    for m in found:
        sites.setdefault((m.primitive, m.where), []).append(m.path)
    lines = "\n".join(
        f"  {name} at {where}: "
        + ", ".join(map(repr, paths[:6]))
        + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
        for (name, where), paths in list(sites.items())[:6]
    )
    more = f"\n  ... and {len(sites) - 6} more places" if len(sites) > 6 else ""
    return lines + more


def check_uses(fn: Callable[..., object], stored: Params, *args: object) -> None:
    """Raise ``TypeError`` if ``fn(stored, *args)`` bypasses ``use_params`` anywhere."""
    found = misuses(fn, stored, *args)
    opaque = [m for m in found if m.opaque]
    if opaque:
        raise TypeError(
            "with per-layer gathering (per_layer=True, stages 2-3) jaxzero checks that the "
            "loss reaches params only through jaxzero.use_params, but stored params enter a "
            f"primitive whose inside it cannot follow:\n{_sites(opaque)}\n"
            "Call use_params first and pass its result into that primitive, or build the "
            "Engine with per_layer=False."
        )
    if found:
        raise TypeError(
            "with per-layer gathering (per_layer=True, stages 2-3) the loss must reach params "
            "only through jaxzero.use_params, but it computes with stored params directly "
            f"(jax.tree utilities look inside them: the raw slice, not the param):\n"
            f"{_sites(found)}\n"
            "Call use_params first and compute with its result (an L2 penalty, a "
            "reparametrisation), or build the Engine with per_layer=False."
        )
