"""The one sharding call a model makes: :func:`use_params` where a layer uses its params.

The engine hands a per-layer model its params as :class:`Stored` leaves: what this
device holds plus a zero "gradient slot" of the stored slice's shape. ``use_params``
turns them into the arrays the layer computes with, and its backward pass reduces
the layer's gradient into the slot at once:

* stage 3: the slice is all-gathered right before use; the backward reduce-scatters
  the cotangent. Wrap the layer in :func:`remat_layer` so the backward pass gathers
  again instead of keeping every layer's gathered params alive.
* stage 2: the params are already whole; the backward reduce-scatters the layer's
  gradient as soon as it exists, so the full gradient never exists at once.
* stages 0 and 1: leaves are plain arrays and ``use_params`` is the identity.

Example (a Flax Linen block)::

    Block = nn.map_variables(Block, "params", trans_in_fn=jaxzero.use_params, init=True)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxzero import collectives
from jaxzero.partition import LeafLayout

GATHERED = "jaxzero_gathered"


@dataclasses.dataclass(frozen=True)
class UseOp:
    """Static description of how one leaf is turned into its working array."""

    layout: LeafLayout
    gather: bool  # value is a slice to all-gather (stage 3), else already whole (stage 2)
    reduce_dtype: str
    scale: float  # 1 / (devices in the batch): the gradient of a global mean
    extra_axes: tuple[str, ...] = ()
    offset: int = 0  # leading dims indexed away (scan over stacked layers)


@jax.tree_util.register_pytree_node_class
class Stored:
    """A param leaf as a device stores it, with a slot that receives its gradient."""

    def __init__(self, value: jax.Array, slot: jax.Array, op: UseOp):
        self.value, self.slot, self.op = value, slot, op

    def tree_flatten(self):
        return (self.value, self.slot), self.op

    @classmethod
    def tree_unflatten(cls, op, children):
        return cls(*children, op)

    def _misuse(self, *_, **__):
        raise TypeError(
            f"param {self.op.layout.path!r} is used without jaxzero.use_params(...). With "
            "per-layer gathering every layer must pass its params through use_params before "
            "computing with them; or build the Engine with per_layer=False."
        )

    __jax_array__ = __array__ = _misuse
    __add__ = __radd__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _misuse
    __getitem__ = __sub__ = __rsub__ = __truediv__ = _misuse

    @property
    def shape(self):
        self._misuse()


def _apply(op: UseOp, value: jax.Array) -> jax.Array:
    return collectives.gather(value, op.layout, op.offset) if op.gather else value


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _use(op: UseOp, value: jax.Array, slot: jax.Array) -> jax.Array:
    del slot  # only its gradient matters
    return _apply(op, value)


def _use_fwd(op, value, slot):
    return _apply(op, value), None


def _use_bwd(op, _, g):
    g = g.astype(op.reduce_dtype) * jnp.asarray(op.scale, op.reduce_dtype)
    g = collectives.reduce_scatter(g, op.layout, op.extra_axes, op.offset)
    return None, g.astype(jnp.float32)


_use.defvjp(_use_fwd, _use_bwd)


def _use_leaf(x: Any) -> Any:
    if not isinstance(x, Stored):
        return x
    op = x.op
    offset = len(op.layout.shape) - x.value.ndim
    if offset:
        if op.layout.dim is not None and op.layout.dim < offset:
            raise ValueError(
                f"param {op.layout.path!r} is sharded on dim {op.layout.dim}, which was "
                "indexed away before use_params (a scan over stacked layers?). Declare "
                "stacked params with Engine(stacked=REGEX) so their layer dim stays whole."
            )
        op = dataclasses.replace(op, offset=offset)
    out = _use(op, x.value, x.slot)
    return checkpoint_name(out, GATHERED) if op.gather else out


def use_params(tree: Any) -> Any:
    """Mark where a layer uses its params; returns them whole, ready to compute with.

    Identity on plain arrays, so a model that calls it runs unchanged outside jaxzero.

    Args:
      tree: a layer's params (any pytree; ``Stored`` leaves come from the engine).

    Returns:
      The same structure with whole working arrays.

    Example:
      >>> import jax.numpy as jnp
      >>> use_params({"w": jnp.ones(3)})["w"].shape
      (3,)
    """
    return jax.tree.map(_use_leaf, tree, is_leaf=lambda x: isinstance(x, Stored))


# The gather inlines into all_gather (+ a slice dropping padding); views of it are cheap.
# Not saving any of them leaves only the stored slice as the residual, so the backward
# pass gathers again.
_REGATHER = {"all_gather", "slice", "dynamic_slice", "reshape", "transpose", "squeeze",
             "broadcast_in_dim", "convert_element_type", "expand_dims"}


def regather_policy(base: Callable[..., bool] | None = None) -> Callable[..., bool]:
    """A remat policy that never saves gathered params (and otherwise follows ``base``).

    ``base=None`` saves every other value, so only the gathers (and cheap views)
    are redone in the backward pass.
    """

    def policy(prim, *args, **params) -> bool:
        name = getattr(prim, "name", "")
        if name in _REGATHER or name == "name" and params.get("name") == GATHERED:
            return False
        return True if base is None else base(prim, *args, **params)

    return policy


def _gathers(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Stored))
    return any(isinstance(x, Stored) and x.op.gather for x in leaves)


def remat_layer(fn: Callable, policy: Callable[..., bool] | None = None) -> Callable:
    """Wrap a layer that calls :func:`use_params` so stage 3 re-gathers in the backward.

    Without it, the backward pass of a scanned layer keeps every layer's gathered
    params alive from the forward pass, which is no memory saving at all. ``policy``
    is the layer's own activation checkpointing policy (None: save activations).
    The wrapper only remats when its arguments hold params to gather (stage 3).
    """

    @functools.wraps(fn)
    def wrapped(*args):
        if _gathers(args):
            return jax.checkpoint(fn, policy=regather_policy(policy))(*args)
        if policy is not None:
            return jax.checkpoint(fn, policy=policy)(*args)
        return fn(*args)

    return wrapped
