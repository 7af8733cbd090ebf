"""The train state and where each part of it lives, per ZeRO stage.

This is jaxzero's sharding policy in one place (``state_specs``):

=====  =======================  ======================  ==================
stage  working params           fp32 master (bf16 only)  optimizer state
=====  =======================  ======================  ==================
0      replicated               replicated              replicated
1, 2   replicated               sharded                 sharded
3      sharded                  sharded                 sharded
=====  =======================  ======================  ==================

The EMA of the weights (``Engine(ema=...)``, fp32) lies as the master does, in fp32
training too. Model state (BatchNorm statistics, ``Engine(model_state=...)``) is
replicated at every stage. Gradients live only inside the step (see ``step.py``).
Sharded leaves are stored padded (``LeafLayout.padded_shape``); replicated leaves keep
their shape. The optimizer only ever sees logical (unpadded) shapes: the step strips the padding
before ``tx.update`` and restores it after, so the stored layout cannot change
what any optimizer computes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxzero.mesh import DATA, REPLICA
from jaxzero.partition import LeafLayout, is_layout, leaf_layout, path_str
from jaxzero.types import Layouts, OptState, Params, Specs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything that persists between steps.

    Attributes:
      step: number of updates applied (int32 scalar, replicated).
      params: working params in the compute dtype (bf16 or fp32).
      master: fp32 master params in bf16 training; ``None`` in fp32 training,
        where the working params are the master copy.
      opt_state: the optax state; param-shaped leaves laid out like the master, the
        rest by their own shapes (:func:`opt_layouts`).
      frozen: the params that do not train (``Engine(trainable=...)``), each stored
        once in the dtype it was given, laid out as the stage lays out working params;
        ``None`` when every param trains. ``params``, ``master`` and ``opt_state`` then
        hold the trainable ones only (:mod:`jaxzero.frozen`).
      ema: the exponential moving average of the trainable params (``Engine(ema=...)``,
        :mod:`jaxzero.ema`): fp32, laid out (and with offload, held in host memory) as
        the master is; ``None`` without one.
      model_state: state the model changes without training it (BatchNorm's running
        statistics, ``Engine(model_state=...)``, :mod:`jaxzero.model_state`): replicated
        (a few floats per channel), in the dtypes it was given; ``None`` without.
    """

    # a jax.Array in a state; the trees of the same structure (state_specs, the checkpoint's
    # leaf names) hold a PartitionSpec, a sharding or None there
    step: Any
    params: Params
    master: Params
    opt_state: OptState
    frozen: Params = None
    ema: Params = None
    model_state: Any = None


def params_sharded(stage: int) -> bool:
    return stage == 3


def master_sharded(stage: int) -> bool:
    """Master params, optimizer state and reduced gradients: sharded from stage 1."""
    return stage >= 1


def logical_shapes(layouts: Layouts, dtype: Any = jnp.float32) -> Params:
    """``ShapeDtypeStruct`` of every param at its logical (unpadded) shape."""
    return jax.tree.map(
        lambda lay: jax.ShapeDtypeStruct(lay.shape, dtype), layouts, is_leaf=is_layout
    )


def stored_shapes(layouts: Layouts, sharded: bool, dtype: Any) -> Params:
    """``ShapeDtypeStruct`` of every leaf as stored: padded when sharded."""
    return jax.tree.map(
        lambda lay: jax.ShapeDtypeStruct(lay.padded_shape if sharded else lay.shape, dtype),
        layouts,
        is_leaf=is_layout,
    )


def opt_layouts(
    tx: optax.GradientTransformation, layouts: Layouts, min_shard_size: int = 64
) -> OptState:
    """A layout for every optimizer-state leaf, decided by the leaf's own shape.

    The state is built from the logical params, so its leaves have the shapes the
    optimizer means. A leaf under a param's path with that param's shape (Adam's
    moments, Lion's momentum, also inside ``masked`` and ``multi_transform``)
    shares the param's layout, so an elementwise update stays on its device. Any
    other leaf (factored second moments, projections, counts) gets the default
    layout of its own shape: sharded along its best dimension, or replicated when
    small. ``MaskedNode`` and empty states have no leaves and need none.

    Returns:
      A tree of :class:`LeafLayout` with the optimizer state's structure.
    """
    by_path = {lay.path: lay for lay in jax.tree.leaves(layouts, is_leaf=is_layout)}
    n = next(iter(by_path.values())).num_shards if by_path else 1
    shapes = jax.eval_shape(tx.init, logical_shapes(layouts))

    def one(path: Any, leaf: jax.ShapeDtypeStruct) -> LeafLayout:
        for i in range(len(path)):  # longest suffix first: "1/mu/blocks/w" -> "blocks/w"
            lay = by_path.get(path_str(path[i:]))
            if lay is not None and lay.shape == tuple(leaf.shape):
                return lay
        return leaf_layout(path_str(path), leaf.shape, n, min_shard_size=min_shard_size)

    return jax.tree_util.tree_map_with_path(one, shapes)


def _specs(layouts: Layouts, sharded: bool, axes: Any = DATA) -> Specs:
    return jax.tree.map(
        lambda lay: lay.spec(axes) if sharded else lay.working_spec(), layouts, is_leaf=is_layout
    )


def master_axes(hpz: bool) -> Any:
    """The mesh axes the master, optimizer state and reduced gradients are split over:
    the data axis, or with hpZ every device (the working params stay within a group)."""
    return (DATA, REPLICA) if hpz else DATA


def state_specs(
    stage: int,
    layouts: Layouts,
    opt_lays: OptState,
    mixed: bool,
    frozen: Layouts = None,
    hpz: bool = False,
    ema: bool = False,
    model_state: Any = None,
) -> TrainState:
    """PartitionSpecs of every leaf of the TrainState (same structure). Frozen params
    (``frozen``: their layouts) lie as the working params do: sharded at stage 3 only.
    ``hpz``: the master and optimizer state over every device, the params within a group.
    ``ema``: the state keeps an EMA, laid out as the master. ``model_state``: its shapes
    (None: none), replicated."""
    return TrainState(
        step=P(),
        params=_specs(layouts, params_sharded(stage)),
        master=master_specs(stage, layouts, hpz) if mixed else None,
        opt_state=_specs(opt_lays, master_sharded(stage), master_axes(hpz)),
        frozen=None if frozen is None else _specs(frozen, params_sharded(stage)),
        ema=master_specs(stage, layouts, hpz) if ema else None,
        model_state=None if model_state is None else jax.tree.map(lambda _: P(), model_state),
    )


def master_specs(stage: int, layouts: Layouts, hpz: bool = False) -> Specs:
    """fp32 master params (and reduced gradients): replicated in stage 0, then sharded."""
    return _specs(layouts, master_sharded(stage), master_axes(hpz))
