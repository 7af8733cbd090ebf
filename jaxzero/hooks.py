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
* stages 0 and 1: ``use_params`` returns the arrays as they are; with the dot barrier
  on (CPUs) its backward applies :func:`jaxzero.collectives.dot_barrier`, nothing else.

Example (a Flax Linen block)::

    Block = nn.map_variables(Block, "params", trans_in_fn=jaxzero.use_params, init=True)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive
from jax.extend.core import primitives as prim

from jaxzero import collectives, zeropp
from jaxzero.partition import LeafLayout
from jaxzero.types import Params

GATHERED = "jaxzero_gathered"
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class UseOp:
    """Static description of how one leaf is turned into its working array."""

    layout: LeafLayout
    gather: bool  # value is a slice to all-gather (stage 3), else already whole (stage 2)
    reduce_dtype: str
    extra_axes: tuple[str, ...] = ()
    offset: int = 0  # leading dims indexed away (scan over stacked layers)
    bucket_bytes: int = 0  # pack a call's collectives up to this size (0: one a leaf)
    dot_barrier: bool = False  # collectives.dot_barrier on the cotangents
    reduce: bool = True  # the backward reduce-scatters into the slot (stages 2-3); else
    # the cotangent, through the barrier only, goes back to the value (stages 0-1)
    probe: bool = False  # hook_check's trace: same shapes out, no data path from the store
    frozen: bool = False  # a frozen param (no slot): gathered outside autodiff, no gradient
    cast: str | None = None  # frozen: the compute dtype it is cast to once whole (or None)
    qwz_block: int = 0  # gather as int8, a scale per this many elements (ZeRO++ qwZ); 0: exact
    qgz_bits: int = 0  # reduce-scatter in int8/int4 (ZeRO++ qgZ); 0: exact
    quant_block: int = 2048  # elements per scale of qgZ
    scatter_extra: bool = False  # hpZ: reduce-scatter across groups too (else all-reduce)


@jax.tree_util.register_pytree_node_class
class Stored:
    """A param leaf as a device stores it, with a slot that receives its gradient."""

    def __init__(self, value: jax.Array, slot: jax.Array | None, op: UseOp) -> None:
        self.value, self.slot, self.op = value, slot, op

    def tree_flatten(self) -> tuple[tuple[jax.Array, jax.Array | None], UseOp]:
        return (self.value, self.slot), self.op

    # children: what a JAX transformation puts in the leaves' place (tracers, specs, None)
    @classmethod
    def tree_unflatten(cls, op: UseOp, children: tuple[Any, Any]) -> Stored:
        return cls(*children, op)

    def _misuse(self, *_: object, **__: object) -> NoReturn:
        raise TypeError(
            f"param {self.op.layout.path!r} is used without jaxzero.use_params(...). With "
            "per-layer gathering every layer must pass its params through use_params before "
            "computing with them; or build the Engine with per_layer=False."
        )

    __jax_array__ = __array__ = _misuse
    __add__ = __radd__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _misuse
    __getitem__ = __sub__ = __rsub__ = __truediv__ = _misuse

    @property
    def shape(self) -> NoReturn:
        self._misuse()


def _forward(ops: tuple[UseOp, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Whole working arrays: packed all-gathers of the sharded leaves (stage 3)."""
    out = list(values)
    idx = [i for i, op in enumerate(ops) if op.gather]
    if idx:
        args = (
            [values[i] for i in idx],
            [ops[i].layout for i in idx],
            ops[0].bucket_bytes,
            [ops[i].offset for i in idx],
        )
        if ops[0].qwz_block:
            full = zeropp.gather_buckets_quantized(*args, block=ops[0].qwz_block)
        else:
            full = collectives.gather_buckets(*args)
        for i, x in zip(idx, full, strict=True):
            out[i] = x
    return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _use(
    ops: tuple[UseOp, ...], values: tuple[jax.Array, ...], slots: tuple[jax.Array, ...]
) -> tuple[jax.Array, ...]:
    del slots  # only their gradients matter
    return _forward(ops, values)


def _use_fwd(
    ops: tuple[UseOp, ...], values: tuple[jax.Array, ...], slots: tuple[jax.Array, ...]
) -> tuple[tuple[jax.Array, ...], None]:
    return _forward(ops, values), None


def _use_bwd(
    ops: tuple[UseOp, ...], _: None, cotangents: tuple[jax.Array, ...]
) -> tuple[tuple[jax.Array | None, ...], tuple[jax.Array | None, ...]]:
    """Reduce the layer's gradients into the slots: packed reduce-scatters (at stages
    0–1, only the dot barrier, the gradients going back to the values).

    The cotangents are this device's alone: the step's ``shard_map`` has
    ``check_vma=False``, so JAX sums nothing across devices before they arrive (see
    :mod:`jaxzero.step`), and this reduce-scatter is the only reduction.
    """
    op = ops[0]
    gs = [
        collectives.dot_barrier(g) if o.dot_barrier else g
        for o, g in zip(ops, cotangents, strict=True)
    ]
    if not op.reduce:  # stages 0-1: the step reduces after the backward pass
        return tuple(gs), tuple(None for _ in ops)
    gs = [g.astype(op.reduce_dtype) for g in gs]  # already each device's share
    lays, offsets = [o.layout for o in ops], [o.offset for o in ops]
    if op.qgz_bits:
        red = zeropp.reduce_scatter_buckets_quantized(
            gs, lays, op.bucket_bytes, op.extra_axes, offsets, op.quant_block, op.qgz_bits,
            op.scatter_extra,
        )  # fmt: skip
    else:
        red = collectives.reduce_scatter_buckets(
            gs, lays, op.bucket_bytes, op.extra_axes, offsets, op.scatter_extra
        )
    return tuple(None for _ in ops), tuple(g.astype(jnp.float32) for g in red)


_use.defvjp(_use_fwd, _use_bwd)


def _op_of(x: Stored) -> UseOp:
    op = x.op
    offset = len(op.layout.shape) - x.value.ndim
    if not offset:
        return op
    if op.layout.dim is not None and op.layout.dim < offset:
        raise ValueError(
            f"param {op.layout.path!r} is sharded on dim {op.layout.dim}, which was "
            "indexed away before use_params (a scan over stacked layers?). Declare "
            "stacked params with Engine(stacked=REGEX) so their layer dim stays whole."
        )
    return dataclasses.replace(op, offset=offset)


def _is_stored(x: object) -> bool:
    return isinstance(x, Stored)


def use_params(tree: Params) -> Params:
    """Mark where a layer uses its params; returns them whole, ready to compute with.

    Identity on plain arrays, so a model that calls it runs unchanged outside jaxzero.
    All params passed in one call move in one collective each way (call it once per
    layer, with the layer's whole params tree).

    Args:
      tree: a layer's params (any pytree; ``Stored`` leaves come from the engine).

    Returns:
      The same structure with whole working arrays.

    Example:
      >>> import jax.numpy as jnp
      >>> use_params({"w": jnp.ones(3)})["w"].shape
      (3,)
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_stored)
    stored = [i for i, x in enumerate(leaves) if _is_stored(x)]
    if not stored:
        return tree
    probe = _op_of(leaves[stored[0]]).probe
    # frozen params are gathered outside the custom VJP: nothing differentiates them,
    # so autodiff computes no weight gradient for them (only the activations' one)
    groups = {f: [i for i in stored if leaves[i].op.frozen == f] for f in (False, True)}
    for frozen, idx in groups.items():
        if not idx:
            continue
        ops = tuple(_op_of(leaves[i]) for i in idx)
        if probe:  # so any other read of a stored array is the misuse hook_check seeks
            outs = _forward(ops, tuple(jnp.zeros_like(leaves[i].value) for i in idx))
        elif frozen:  # stored in its own dtype (a bf16 base), computed with in the run's
            outs = _forward(ops, tuple(leaves[i].value for i in idx))
            outs = tuple(
                x if op.cast is None else x.astype(op.cast) for op, x in zip(ops, outs, strict=True)
            )
        else:
            values = tuple(leaves[i].value for i in idx)
            outs = _use(ops, values, tuple(leaves[i].slot for i in idx))
        for i, op, x in zip(idx, ops, outs, strict=True):
            leaves[i] = checkpoint_name(x, GATHERED) if op.gather else x
    return jax.tree.unflatten(treedef, leaves)


# The gather inlines into concatenate + all_gather + slices; views of it are cheap.
# Not saving any of them leaves only the stored slice as the residual, so the backward
# pass gathers again. Primitives are matched by identity (jax.extend), and the
# checkpoint_name marker by JAX's own policy, so no primitive parameter is read here.
_REGATHER = frozenset(
    {
        prim.all_gather_p,
        prim.concatenate_p,
        prim.slice_p,
        prim.dynamic_slice_p,
        prim.reshape_p,
        prim.transpose_p,
        prim.squeeze_p,
        prim.broadcast_in_dim_p,
        prim.convert_element_type_p,
    }
)
# qwZ's gather also quantizes the slice and dequantizes the gathered int8 with a multiply
# (zeropp): with it on, those elementwise ops are redone too, or the dequantized params
# would be saved (a whole layer's, fp32, each layer: measured 2x the GPT's temp memory).
_REGATHER_QWZ = _REGATHER | frozenset(
    {
        prim.abs_p,
        prim.bitcast_convert_type_p,
        prim.clamp_p,
        prim.div_p,
        prim.gt_p,
        prim.max_p,
        prim.min_p,
        prim.mul_p,
        prim.pad_p,
        prim.reduce_max_p,
        prim.round_p,
        prim.select_n_p,
    }
)
_IS_GATHERED = jax.checkpoint_policies.save_only_these_names(GATHERED)  # True on it alone


def regather_policy(
    base: Callable[..., bool] | None = None, quantized: bool = False
) -> Callable[..., bool]:
    """A remat policy that never saves gathered params (and otherwise follows ``base``).

    ``base=None`` saves every other value, so only the gathers (and cheap views)
    are redone in the backward pass. ``quantized``: the gathers are qwZ's, whose
    quantize and dequantize ops are redone as well.
    """
    regather = _REGATHER_QWZ if quantized else _REGATHER

    def policy(p: Primitive, /, *args: object, **params: object) -> bool:
        if p in regather or _IS_GATHERED(p, *args, **params):
            return False
        return True if base is None else base(p, *args, **params)

    return policy


def _gathers(tree: object, quantized: bool = False) -> bool:
    """Whether ``tree`` holds params to gather (``quantized``: with qwZ)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Stored))
    return any(
        isinstance(x, Stored) and x.op.gather and (x.op.qwz_block or not quantized) for x in leaves
    )


def remat_layer(
    fn: Callable[..., R], policy: Callable[..., bool] | None = None, sequence: bool = False
) -> Callable[..., R]:
    """Wrap a layer that calls :func:`use_params` so stage 3 re-gathers in the backward.

    Without it, the backward pass of a scanned layer keeps every layer's gathered
    params alive from the forward pass, which is no memory saving at all. ``policy``
    is the layer's own activation checkpointing policy (None: save activations).
    The wrapper only remats when its arguments hold params to gather (stage 3), or
    with ``sequence`` (sequence parallelism: the layer gathers its slices of the
    sequence, :func:`jaxzero.tensor_parallel.gather_seq`, and the backward gathers them
    again, as Megatron-LM does, instead of keeping a whole sequence a block).
    """

    @functools.wraps(fn)
    def wrapped(*args: object) -> R:
        if sequence or _gathers(args):
            quantized = _gathers(args, quantized=True)
            return jax.checkpoint(fn, policy=regather_policy(policy, quantized))(*args)
        if policy is not None:
            return jax.checkpoint(fn, policy=policy)(*args)
        return fn(*args)

    return wrapped
