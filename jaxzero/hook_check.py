"""Trace-time proof that a per-layer model reaches its params only through ``use_params``.

With ``per_layer=True`` at stages 2–3 the model receives :class:`~jaxzero.hooks.Stored`
leaves: a device's slice (stage 3) or the whole param (stage 2) plus a zero
gradient slot. Arithmetic on a ``Stored`` raises, but ``jax.tree`` utilities look
inside it and hand out the raw slice and slot, so an L2 penalty over
``jax.tree.leaves(params)`` or a ``jax.tree.map`` reparametrisation before
``use_params`` would silently compute the wrong loss or gradient.

:func:`check_uses` traces the loss once and follows every stored array through the
jaxpr (into ``jit``, ``scan``, ``checkpoint``, ``cond``, ``while`` and custom
derivatives). The only things a stored array may meet on its way to
``use_params`` are views that index away stacked leading dims (what a ``scan`` or
``x[i]`` over stacked layers does) and dtype casts. Anything else raises a
``TypeError`` naming the param, the operation and the user's source line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from jaxzero.partition import LeafLayout

# views that select stacked layers: allowed while the sharded dim stays whole
_VIEWS = {"slice", "dynamic_slice", "squeeze", "reshape", "gather", "index_in_dim"}
_CASTS = {"convert_element_type", "copy", "copy_p", "device_put", "reduce_precision"}

Taint = frozenset  # of param paths
Found = list[tuple[str, str, str]]  # (param path, primitive, where)


def _is_use(eqn) -> bool:
    """The ``custom_vjp`` call of :func:`jaxzero.hooks._use` (its forward is ``_use``)."""
    if eqn.primitive.name != "custom_vjp_call":
        return False
    info = getattr(eqn.params.get("call_jaxpr"), "jaxpr", None)
    src = getattr(getattr(info, "debug_info", None), "func_src_info", "") or ""
    return src.startswith("_use ") and "jaxzero" in src


def _view_ok(in_shape: Sequence[int], out_shape: Sequence[int], lay: LeafLayout) -> bool:
    """Whether a view changes only a stacked leading dim that is not the sharded one."""
    common = 0
    while (common < min(len(in_shape), len(out_shape))
           and in_shape[len(in_shape) - 1 - common] == out_shape[len(out_shape) - 1 - common]):
        common += 1
    if common == len(in_shape) and len(out_shape) == len(in_shape):
        return True  # same shape
    if common < len(in_shape) - 1 or len(out_shape) - common > 1:
        return False  # more than the leading dim changed
    changed = len(lay.shape) - len(in_shape)  # the layout dim that in_shape[0] is
    return lay.dim is None or changed < lay.dim


def _where(eqn) -> str:
    from jax._src import source_info_util

    return source_info_util.summarize(eqn.source_info)


def _sub(j) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def _walk(jaxpr: Jaxpr, taints: Sequence[Taint], lays: dict[str, LeafLayout],
          found: Found) -> list[Taint]:
    """Propagate taint from ``jaxpr``'s inputs to its outputs, recording misuses."""
    env: dict[Var, Taint] = {v: t for v, t in zip(jaxpr.invars, taints, strict=True) if t}
    get = lambda v: env.get(v, Taint()) if isinstance(v, Var) else Taint()
    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        if not any(ins) or _is_use(eqn):
            continue
        outs = _through(eqn, ins, lays, found)
        for v, t in zip(eqn.outvars, outs, strict=True):
            if t:
                env[v] = t
    return [get(v) for v in jaxpr.outvars]


def _through(eqn, ins: list[Taint], lays: dict[str, LeafLayout], found: Found) -> list[Taint]:
    name, p = eqn.primitive.name, eqn.params
    none = [Taint()] * len(eqn.outvars)
    if name in _CASTS or name in _VIEWS:
        src, shape = eqn.invars[0], eqn.outvars[0].aval.shape
        bad = [path for path in ins[0]
               if name in _VIEWS and not _view_ok(src.aval.shape, shape, lays[path])]
        bad += [path for t in ins[1:] for path in t]  # a stored array used as an index
        if not bad:
            return [ins[0]] * len(eqn.outvars)
        found.extend((path, name, _where(eqn)) for path in sorted(set(bad)))
        return none
    if name == "scan":
        body, n_c, n_carry = _sub(p["jaxpr"]), p["num_consts"], p["num_carry"]
        ins = list(ins)
        for _ in range(4):  # a carry may pick up taint from the previous iteration
            outs = _walk(body, ins, lays, found)
            carry = [a | b for a, b in zip(ins[n_c:n_c + n_carry], outs[:n_carry], strict=True)]
            if carry == ins[n_c:n_c + n_carry]:
                return outs
            ins[n_c:n_c + n_carry] = carry
        return outs
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        carry = list(ins[nc + nb:])
        for _ in range(4):
            _walk(_sub(p["cond_jaxpr"]), ins[:nc] + carry, lays, found)
            outs = _walk(_sub(p["body_jaxpr"]), ins[nc:nc + nb] + carry, lays, found)
            new = [a | b for a, b in zip(carry, outs, strict=True)]
            if new == carry:
                return carry
            carry = new
        return carry
    if name == "cond":
        if ins[0]:
            found.extend((path, "cond", _where(eqn)) for path in sorted(ins[0]))
        outs = [_walk(_sub(b), ins[1:], lays, found) for b in p["branches"]]
        return [Taint().union(*ts) for ts in zip(*outs, strict=True)]
    subs = [v for v in p.values() if isinstance(v, ClosedJaxpr | Jaxpr)]
    if len(subs) == 1 and len(_sub(subs[0]).invars) == len(ins):  # jit, checkpoint, custom_*
        return _walk(_sub(subs[0]), ins, lays, found)
    for t in ins:
        found.extend((path, name, _where(eqn)) for path in sorted(t))
    return none


def misuses(fn: Callable, stored: Any, *args: Any) -> Found:
    """Where ``fn(stored, *args)`` uses a ``Stored`` leaf other than through ``use_params``."""
    from jaxzero.hooks import Stored

    is_stored = lambda x: isinstance(x, Stored)
    leaves, treedef = jax.tree.flatten(stored, is_leaf=is_stored)
    lays = {x.op.layout.path: x.op.layout for x in leaves if is_stored(x)}

    def flat(leaves, *args):
        return fn(jax.tree.unflatten(treedef, leaves), *args)

    closed = jax.make_jaxpr(flat)(leaves, *args)
    taints: list[Taint] = []
    for x in leaves:  # a Stored flattens to (value, slot)
        n = len(jax.tree.leaves(x))
        taints += [Taint({x.op.layout.path}) if is_stored(x) else Taint()] * n
    taints += [Taint()] * (len(closed.jaxpr.invars) - len(taints))
    found: Found = []
    _walk(closed.jaxpr, taints, lays, found)
    return list(dict.fromkeys(found))


def check_uses(fn: Callable, stored: Any, *args: Any) -> None:
    """Raise ``TypeError`` if ``fn(stored, *args)`` bypasses ``use_params`` anywhere."""
    found = misuses(fn, stored, *args)
    if not found:
        return
    sites: dict[tuple[str, str], list[str]] = {}
    for path, prim, where in found:
        sites.setdefault((prim, where), []).append(path)
    lines = "\n".join(
        f"  {prim} at {where}: " + ", ".join(map(repr, paths[:6]))
        + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
        for (prim, where), paths in list(sites.items())[:6])
    more = f"\n  ... and {len(sites) - 6} more places" if len(sites) > 6 else ""
    raise TypeError(
        "with per-layer gathering (per_layer=True, stages 2-3) the loss must reach params "
        "only through jaxzero.use_params, but it computes with stored params directly "
        f"(jax.tree utilities look inside them: the raw slice, not the param):\n{lines}{more}\n"
        "Call use_params first and compute with its result (an L2 penalty, a "
        "reparametrisation), or build the Engine with per_layer=False."
    )
