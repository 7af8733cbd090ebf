"""The optimizer update in the global view: ``tx.update`` on the sharded master state.

The update sits between the step's two ``shard_map`` calls (:mod:`jaxzero.step`), on
the sharded arrays in the global view (:func:`optimizer_update`). An elementwise
optimizer compiles to purely local code there; one that looks across elements (a global
norm, factored statistics, Newton–Schulz) gets exactly the communication it needs from
XLA, so no optimizer can silently compute something else on a slice. Padding is
stripped first (:func:`to_logical`) and put back after (:func:`to_stored`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from jaxzero.partition import is_layout, pad, unpad
from jaxzero.types import Layouts, OptState, Params


def _map_layouts(f: Callable[..., Any], layouts: Layouts, *trees: Any) -> Any:
    return jax.tree.map(lambda lay, *xs: f(lay, *xs), layouts, *trees, is_leaf=is_layout)


def to_logical(layouts: Layouts, tree: Any) -> Any:
    """``tree`` (stored: padded where sharded) at the logical shapes of ``layouts``."""
    return _map_layouts(lambda lay, x: unpad(x, lay) if x.shape != lay.shape else x, layouts, tree)


def to_stored(layouts: Layouts, tree: Any, sharded: bool) -> Any:
    """A logical ``tree`` as the state stores it: padded when ``sharded``."""
    return _map_layouts(lambda lay, x: pad(x, lay) if sharded else x, layouts, tree)


def optimizer_update(
    tx: optax.GradientTransformation,
    layouts: Layouts,
    opt_lays: OptState,
    sharded: bool,
    grads: Params,
    opt_state: OptState,
    master: Params,
    value: jax.Array | None = None,
    value_fn: Callable[[Params], jax.Array] | None = None,
) -> tuple[Params, OptState]:
    """``tx.update`` in the global view, on logical shapes; returns stored master and state.

    This runs outside ``shard_map`` on sharded global arrays, so XLA's partitioner
    adds exactly the communication the optimizer needs: none for an elementwise
    one (AdamW, Lion, SGD, masks), a scalar all-reduce for a global norm, whatever
    a factored or matrix optimizer (Adafactor, Muon) reads across a leaf. Padding
    is stripped first, so it never enters a norm, a mean or a shape-dependent rule.

    An optimizer that takes optax's extra arguments (``optax.lbfgs``'s line search,
    ``reduce_on_plateau``) gets ``value`` (the step's loss), ``grad`` (the gradient it
    updates with) and ``value_fn`` (the loss of the same batch at given logical params).
    """
    g = to_logical(layouts, grads)
    s = to_logical(opt_lays, opt_state)
    m = to_logical(layouts, master)
    if isinstance(tx, optax.GradientTransformationExtraArgs) and value is not None:
        updates, s = tx.update(g, s, m, value=value, grad=g, value_fn=value_fn)
    else:
        updates, s = tx.update(g, s, m)
    m = optax.apply_updates(m, updates)
    return to_stored(layouts, m, sharded), to_stored(opt_lays, s, sharded)


def value_fn_of(
    loss_and_grads: Callable[[Params], tuple[jax.Array, Params]],
) -> Callable[[Params], jax.Array]:
    """``value_fn(params) -> loss`` for optax's line searches, which differentiate it:
    its gradient is the step's own (reduced over devices), not autodiff of the sharded
    forward pass."""

    @jax.custom_vjp
    def value_fn(params: Params) -> jax.Array:
        return loss_and_grads(params)[0]

    def fwd(params: Params) -> tuple[jax.Array, Params]:
        return loss_and_grads(params)

    def bwd(grads: Params, ct: jax.Array) -> tuple[Params]:
        return (jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads),)

    value_fn.defvjp(fwd, bwd)
    return value_fn
