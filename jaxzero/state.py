"""The train state and where each part of it lives, per ZeRO stage.

This is jaxzero's sharding policy in one place (``state_specs``):

=====  =======================  ======================  ==================
stage  working params           fp32 master (bf16 only)  optimizer state
=====  =======================  ======================  ==================
0      replicated               replicated              replicated
1, 2   replicated               sharded                 sharded
3      sharded                  sharded                 sharded
=====  =======================  ======================  ==================

Gradients live only inside the step (see ``step.py``). Sharded leaves are stored
padded (``LeafLayout.padded_shape``); replicated working params keep their shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxzero.partition import LeafLayout, is_layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything that persists between steps.

    Attributes:
      step: number of updates applied (int32 scalar, replicated).
      params: working params in the compute dtype (bf16 or fp32).
      master: fp32 master params in bf16 training; ``None`` in fp32 training,
        where the working params are the master copy.
      opt_state: the optax state, param-shaped leaves laid out like the master.
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any


def params_sharded(stage: int) -> bool:
    return stage == 3


def master_sharded(stage: int) -> bool:
    """Master params, optimizer state and reduced gradients: sharded from stage 1."""
    return stage >= 1


def stored_shapes(layouts: Any, sharded: bool, dtype: Any) -> Any:
    """``ShapeDtypeStruct`` of every leaf as stored: padded when sharded."""
    return jax.tree.map(
        lambda lay: jax.ShapeDtypeStruct(lay.padded_shape if sharded else lay.shape, dtype),
        layouts,
        is_leaf=is_layout,
    )


def _specs(layouts: Any, sharded: bool) -> Any:
    return jax.tree.map(lambda lay: lay.spec() if sharded else P(), layouts, is_leaf=is_layout)


def opt_state_specs(tx: optax.GradientTransformation, layouts: Any, sharded: bool) -> Any:
    """Param-shaped optimizer leaves follow the master layout; the rest is replicated."""
    shapes = jax.eval_shape(tx.init, stored_shapes(layouts, sharded, jnp.float32))
    return optax.tree_map_params(
        tx,
        lambda _, lay: lay.spec() if sharded else P(),
        shapes,
        layouts,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, LeafLayout | jax.ShapeDtypeStruct),
    )


def state_specs(stage: int, layouts: Any, tx: optax.GradientTransformation, mixed: bool):
    """PartitionSpecs of every leaf of the TrainState (same structure)."""
    return TrainState(
        step=P(),
        params=_specs(layouts, params_sharded(stage)),
        master=master_specs(stage, layouts) if mixed else None,
        opt_state=opt_state_specs(tx, layouts, master_sharded(stage)),
    )


def master_specs(stage: int, layouts: Any) -> Any:
    """fp32 master params (and reduced gradients): replicated in stage 0, then sharded."""
    return _specs(layouts, master_sharded(stage))
