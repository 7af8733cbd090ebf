"""What a loss function may return, and how the step combines it over devices.

The engine calls ``loss_fn(params, batch)`` (or ``loss_fn(params, batch, rng)``, see
below) on each device's share of each micro-batch. It may return:

* a scalar: the mean loss of its rows. The step's loss is the mean of these over
  devices and micro-batches, which is the mean over the global batch when every
  share counts alike (no masks, no padding).
* :class:`Weighted` ``(total, weight)``: a sum and what it sums over (e.g. the loss
  summed over unmasked tokens, and their count). The step divides the sum over every
  device and micro-batch by the summed weight, so the update equals one device on
  the whole batch however unevenly the weight falls; ``metrics["tokens"]`` reports
  the global weight.
* either of these with an ``aux`` pytree: ``(loss, aux)``. Aux leaves are combined
  like the loss, in ``metrics["aux"]``: averaged in the scalar form; in the weighted
  form they are sums too (e.g. correct tokens), divided by the global weight.

With ``Engine(..., loss_takes_rng=True)`` the loss is called as ``loss_fn(params,
batch, rng)`` and gets ``rng``: one PRNG key for its rows
(:func:`batch_key`), which Flax takes as it is (``model.apply(..., rngs={"dropout":
rng})``, ``nnx.Dropout(...)(x, rngs=rng)``). A draw from it, or from a key split or
folded from it, whose leading dim is a multiple of the rows (``(rows, ...)``, or
``(rows * positions, ...)`` flattened) is drawn row by row, global row ``r``'s values
from ``fold_in(k, r)`` (``k``: the key as the draw gets it, after Flax's own folds),
so they depend on the seed, the step and ``r`` only: dropout is exactly the same at
any stage, device count and micro-batching as on one device. Any other draw (a mask
shared by every row) is drawn whole from the key, the same on every device; with one
row a device, every draw is over the rows. ``eval_loss`` passes ``rng=None`` (no
dropout).

Model state that changes without being trained (BatchNorm's running statistics):
with ``Engine(..., model_state=state)`` the loss is called as ``loss_fn(params, batch[,
rng], state=state, train=True)`` and returns :class:`WithState` ``(out, new_state)``,
``out`` any of the forms above and ``new_state`` of ``state``'s structure, shapes and
dtypes. ``train`` is a Python bool: False in ``eval_loss``, which uses the stored state
and drops what the loss returns (:mod:`jaxzero.model_state` says how the new state is
combined over devices and micro-batches).

Example:
  >>> import jax.numpy as jnp
  >>> def loss_fn(params, batch):
  ...     err = (batch["x"] * params["w"] - batch["y"]) ** 2
  ...     mask = batch["mask"]
  ...     return Weighted(jnp.sum(err * mask), jnp.sum(mask)), {"n": jnp.sum(mask)}
  >>> out = loss_fn({"w": 2.0}, {"x": jnp.ones(4), "y": jnp.ones(4), "mask": jnp.ones(4)})
  >>> total, weight, aux = unpack(out)
  >>> float(total / weight)
  1.0
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.random import define_prng_impl

__all__ = ["Weighted", "WithState", "batch_key", "dropout"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weighted:
    """A loss as ``total`` (a sum) and ``weight`` (what it sums over, e.g. tokens)."""

    total: jax.Array
    weight: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WithState:
    """A loss (any other form: scalar, :class:`Weighted`, with aux) and the model's new
    state (``Engine(model_state=...)``): what the loss returns when the engine keeps one."""

    out: Any
    state: Any


STATE_ARGS = ("state", "train")  # the keywords a loss gets with Engine(model_state=...)

FORMS = (
    "a scalar mean, (scalar, aux), jaxzero.Weighted(total, weight) or "
    "(jaxzero.Weighted(total, weight), aux)"
)


def _scalar(x: Any, what: str) -> jax.Array:
    try:
        shape = jnp.shape(x)
    except TypeError:
        shape = None
    if shape != () or isinstance(x, (bool, str)):
        raise TypeError(
            f"loss_fn's {what} must be a scalar, got "
            f"{getattr(x, 'shape', type(x).__name__)}; return {FORMS}"
        )
    return jnp.asarray(x, jnp.float32)


def split_state(out: Any, has_state: bool) -> tuple[Any, Any]:
    """``(out, new_state or None)`` of what a loss returned; a :class:`WithState` where
    the engine keeps no model state, or its absence where it does, refused in one line."""
    if isinstance(out, tuple) and any(isinstance(o, WithState) for o in out):
        raise TypeError(
            "loss_fn returned jaxzero.WithState inside another form: return "
            "WithState(loss_form, new_state) outermost, e.g. WithState((loss, aux), new_state)"
        )
    if has_state and not isinstance(out, WithState):
        raise TypeError(
            "the engine keeps model state (model_state=...): loss_fn must return "
            f"jaxzero.WithState(loss, new_state), got {type(out).__name__}"
        )
    if not has_state and isinstance(out, WithState):
        raise TypeError(
            "loss_fn returned jaxzero.WithState, but the engine keeps no model state: pass "
            "Engine(..., model_state=...) (an NNXEngine finds nnx.BatchStat itself)"
        )
    return (out.out, out.state) if has_state else (out, None)


def unpack(out: Any) -> tuple[jax.Array, jax.Array | None, Any]:
    """``(total or mean, weight or None, aux or None)`` of any form a loss may return."""
    if isinstance(out, WithState):
        raise TypeError(
            "loss_fn returned jaxzero.WithState inside another form: return "
            "WithState(loss_form, new_state) outermost"
        )
    aux = None
    if isinstance(out, tuple):
        if len(out) != 2:
            raise TypeError(f"loss_fn returned a tuple of {len(out)}; return {FORMS}")
        out, aux = out
    if isinstance(out, Weighted):
        return _scalar(out.total, "total"), _scalar(out.weight, "weight"), aux
    return _scalar(out, "loss"), None, aux


def check_rng_contract(
    loss_fn: Callable[..., Any], takes_rng: bool, takes_state: bool = False
) -> None:
    """Refuse a loss that cannot be called as the engine will call it.

    ``takes_rng``: the engine calls ``loss_fn(params, batch, rng)``; else
    ``loss_fn(params, batch)``. The signature is read only to refuse, never to guess:
    a loss whose third positional parameter has no default would otherwise get no key
    (or, before, a key it did not ask for); one with a default keeps its default.
    ``takes_state``: the engine also passes ``state=`` and ``train=`` by keyword
    (``Engine(model_state=...)``), which the loss must accept; without, a loss with a
    ``state`` parameter that has no default is refused (it would never get one).
    """
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # builtins, some C callables: nothing to check
        return
    kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
    named = {p.name: p for p in params if p.kind != p.POSITIONAL_ONLY}
    if takes_state:
        lacking = [a for a in STATE_ARGS if a not in named and not kwargs]
        if lacking:
            raise ValueError(
                f"the engine keeps model state (model_state=...), but loss_fn takes no "
                f"{' or '.join(repr(a) for a in lacking)} parameter: define it as "
                "loss_fn(params, batch, state, train) and return jaxzero.WithState(loss, "
                "new_state)"
            )
        params = [p for p in params if p.name not in STATE_ARGS]
    elif "state" in named and named["state"].default is inspect.Parameter.empty:
        if named["state"].kind == inspect.Parameter.KEYWORD_ONLY or not takes_rng:
            raise ValueError(
                "loss_fn takes a 'state' parameter with no default, but the engine keeps "
                "no model state: pass Engine(..., model_state=...) (BatchNorm statistics)"
            )
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if takes_rng and len(positional) < 3 and not varargs:
        raise ValueError(
            "loss_takes_rng=True, but loss_fn takes fewer than three positional "
            "parameters: define it as loss_fn(params, batch, rng)"
        )
    if not takes_rng and len(positional) >= 3 and positional[2].default is inspect.Parameter.empty:
        raise ValueError(
            f"loss_fn's third parameter {positional[2].name!r} has no default, but the "
            "engine passes two arguments: pass loss_takes_rng=True for a PRNG key there "
            "(dropout), or give it a default"
        )


# A key's data: threefry's two words, then this device's first row of the global batch.
# The rows per device are static, so each count gets an impl of its own (cached).
_KEY_WORDS = 3


def _base(data: jax.Array) -> jax.Array:
    return jax.random.wrap_key_data(data[..., :2], impl="threefry2x32")


def _rebase(data: jax.Array, base: jax.Array) -> jax.Array:
    first = jnp.broadcast_to(data[..., 2:], (*base.shape, 1))
    return jnp.concatenate([jax.random.key_data(base), first], axis=-1)


@functools.cache
def _row_impl(rows: int) -> Any:
    """The PRNG impl of :func:`batch_key` for ``rows`` rows a device."""

    def random_bits(data: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
        dtype = jnp.dtype(f"uint{bit_width}")
        base = _base(data)
        if not shape or shape[0] % rows:  # not over the rows: the same on every device
            return jax.random.bits(base, shape, dtype)
        per_row = shape[0] // rows  # e.g. positions, when (rows, positions) is flattened
        first = data[2] * per_row
        index = first + jnp.arange(shape[0], dtype=jnp.uint32)
        draw = lambda i: jax.random.bits(jax.random.fold_in(base, i), shape[1:], dtype)
        return jax.vmap(draw)(index)

    return define_prng_impl(
        key_shape=(_KEY_WORDS,),
        seed=lambda s: _rebase(jnp.zeros(_KEY_WORDS, jnp.uint32), jax.random.key(s)),
        split=lambda data, shape: _rebase(data, jax.random.split(_base(data), shape)),
        random_bits=random_bits,
        fold_in=lambda data, x: _rebase(data, jax.random.fold_in(_base(data), x)),
        name=f"jaxzero_rows{rows}",
        tag=f"rows{rows}",
    )


def batch_key(seed: int, step: jax.Array | int, first_row: jax.Array | int, rows: int) -> jax.Array:
    """The key a loss gets for ``rows`` rows from global row ``first_row``: draws over
    the rows are made row by row from ``fold_in(fold_in(key(seed), step), row)``."""
    base = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), step)
    first = jnp.asarray(first_row, jnp.uint32).reshape(1)
    data = jnp.concatenate([jax.random.key_data(base), first])
    return jax.random.wrap_key_data(data, impl=_row_impl(rows))


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout of ``x`` (leading dim: rows) with the loss's ``rng``, a mask per
    row (:func:`batch_key`); identity when ``rng`` is None (evaluation) or ``rate`` is 0."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
