"""Params read back to the host: whole, unpadded fp32, one leaf or the tree.

Every process calls (a leaf sharded over processes is gathered across them first):
:meth:`jaxzero.Engine.gather_params` takes the whole tree, a writer (``hf.save``) one
leaf at a time so it holds one param on the host, not the model.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxzero.ema import NO_EMA
from jaxzero.frozen import merge
from jaxzero.partition import LeafLayout, is_layout, unpad
from jaxzero.plan import Plan
from jaxzero.state import TrainState
from jaxzero.types import Params


def gather_leaf(x: jax.Array, lay: LeafLayout) -> np.ndarray:
    """One stored param, whole and unpadded, as fp32 on this host (all processes call)."""
    if jax.process_count() > 1 and not x.is_fully_replicated:
        if x.sharding.memory_kind != "device":  # offloaded: gathered from the device
            x = jax.device_put(x, x.sharding.with_memory_kind("device"))
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(unpad(np.asarray(jax.device_get(x)), lay), np.float32)


def _stored(plan: Plan, state: TrainState, ema: bool = False) -> Params:
    """Every param as the state stores it (trainable: fp32 master, or with ``ema`` the
    EMA of the weights), the whole tree."""
    if ema:
        check_ema(state)
    src = state.ema if ema else state.master if plan.mixed else state.params
    return merge(plan.mask, src, state.frozen)


def check_ema(state: TrainState) -> None:
    """Refuse, in one line, to read the EMA of a state that keeps none."""
    if state.ema is None:
        raise ValueError(NO_EMA)


def gather_params(plan: Plan, state: TrainState, ema: bool = False) -> Params:
    """Full fp32 params on the host, with the structure ``init`` was given (frozen ones
    included, converted to fp32); ``ema``: the EMA of the trainable ones instead of
    their live values (:mod:`jaxzero.ema`)."""
    return jax.tree.map(gather_leaf, _stored(plan, state, ema), plan.all_layouts())


def iter_params(
    plan: Plan, state: TrainState, ema: bool = False
) -> Iterator[tuple[LeafLayout, np.ndarray]]:
    """``(layout, full fp32 param)`` one leaf at a time, in tree order (frozen ones
    included), so a writer holds one param on the host, not the model; ``ema``: the
    EMA's. Every process must iterate."""
    lays = jax.tree.leaves(plan.all_layouts(), is_leaf=is_layout)
    for x, lay in zip(jax.tree.leaves(_stored(plan, state, ema)), lays, strict=True):
        yield lay, gather_leaf(x, lay)
