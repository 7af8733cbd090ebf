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

A ``loss_fn`` with a third parameter gets ``rng``: one PRNG key per row of its batch,
``fold_in(fold_in(key(seed), step), global_row)``, so a row's randomness (dropout)
depends on the step and its row of the global batch only: the same at any stage,
device count and micro-batching. ``eval_loss`` passes ``rng=None`` (no dropout).

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
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weighted:
    """A loss as ``total`` (a sum) and ``weight`` (what it sums over, e.g. tokens)."""

    total: jax.Array
    weight: jax.Array


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


def unpack(out: Any) -> tuple[jax.Array, jax.Array | None, Any]:
    """``(total or mean, weight or None, aux or None)`` of any form a loss may return."""
    aux = None
    if isinstance(out, tuple):
        if len(out) != 2:
            raise TypeError(f"loss_fn returned a tuple of {len(out)}; return {FORMS}")
        out, aux = out
    if isinstance(out, Weighted):
        return _scalar(out.total, "total"), _scalar(out.weight, "weight"), aux
    return _scalar(out, "loss"), None, aux


def takes_rng(loss_fn: Callable) -> bool:
    """Whether ``loss_fn`` has a third positional parameter (the rows' keys)."""
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # builtins, some C callables
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def row_keys(seed: int, step: jax.Array | int, first_row: jax.Array | int, rows: int) -> jax.Array:
    """One key per row: ``fold_in(fold_in(key(seed), step), first_row + i)``."""
    base = jax.random.fold_in(jax.random.key(seed), step)
    return jax.vmap(lambda r: jax.random.fold_in(base, r))(first_row + jnp.arange(rows))


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout of ``x`` (leading dim: rows) with one key per row (``rng``);
    identity when ``rng`` is None (evaluation) or ``rate`` is 0."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(rng)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
