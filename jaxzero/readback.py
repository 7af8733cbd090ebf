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

from jaxzero.partition import LeafLayout, unpad
from jaxzero.plan import Plan
from jaxzero.state import TrainState
from jaxzero.types import Params


def gather_leaf(x: jax.Array, lay: LeafLayout) -> np.ndarray:
    """One stored param, whole and unpadded, as fp32 on this host (all processes call)."""
    if jax.process_count() > 1 and not x.is_fully_replicated:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(unpad(np.asarray(jax.device_get(x)), lay), np.float32)


def gather_params(plan: Plan, state: TrainState) -> Params:
    """Full fp32 params on the host, with the structure ``init`` was given."""
    src = state.master if plan.mixed else state.params
    return jax.tree.map(gather_leaf, src, plan.layouts)


def iter_params(plan: Plan, state: TrainState) -> Iterator[tuple[LeafLayout, np.ndarray]]:
    """``(layout, full fp32 param)`` one leaf at a time, in tree order, so a writer
    holds one param on the host, not the model. Every process must iterate."""
    src = state.master if plan.mixed else state.params
    for x, lay in zip(jax.tree.leaves(src), plan.leaves(), strict=True):
        yield lay, gather_leaf(x, lay)
