"""The three collectives of ZeRO on one leaf, and plain references to test them against.

Inside ``shard_map`` each device holds a slice of a stored (padded) leaf. These
functions move between that slice and the logical, unpadded leaf:

* :func:`gather` — all-gather the slices, drop padding (stage 3 forward, stages 1–2
  after the update).
* :func:`reduce_scatter` — pad a full gradient, sum it over devices and keep only
  this device's slice (stages 1–3).
* :func:`all_reduce` — sum a full gradient over devices (stage 0, replicated leaves).

The ``reference_*`` functions do the same on a list of per-device numpy arrays,
with no JAX, so tests can check the sharded code against arithmetic anyone can read.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.mesh import DATA
from jaxzero.partition import LeafLayout, pad, unpad


def gather(x: jax.Array, layout: LeafLayout, offset: int = 0) -> jax.Array:
    """All-gather a slice along ``layout.dim`` and strip the padding.

    ``offset`` counts leading dims already indexed away (a scan over stacked layers).
    """
    if layout.dim is None:
        return x
    dim = layout.dim - offset
    full = jax.lax.all_gather(x, DATA, axis=dim, tiled=True)
    return jax.lax.slice_in_dim(full, 0, layout.shape[layout.dim], axis=dim)


def reduce_scatter(
    g: jax.Array, layout: LeafLayout, extra_axes: Sequence[str] = (), offset: int = 0
) -> jax.Array:
    """Sum a full (logical-shape) gradient over devices; keep this device's slice.

    ``extra_axes`` are batch axes that replicate the state (hybrid sharding): the
    slice is then also summed over them.
    """
    if layout.dim is None:
        return all_reduce(g, extra_axes)
    dim = layout.dim - offset
    widths = [(0, 0)] * g.ndim
    widths[dim] = (0, layout.padded_shape[layout.dim] - layout.shape[layout.dim])
    g = jnp.pad(g, widths) if widths[dim][1] else g
    g = jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(g, tuple(extra_axes)) if extra_axes else g


def all_reduce(g: jax.Array, extra_axes: Sequence[str] = ()) -> jax.Array:
    """Sum a gradient over every batch axis."""
    return jax.lax.psum(g, (DATA, *extra_axes))


# --- packed: one collective for many leaves (a layer's params) -----------------------
#
# Each sharded leaf is viewed as N rows (its sharded dim moved first, padded), the rows
# of all leaves are concatenated, and a single collective moves them: one all-gather
# or reduce-scatter per layer instead of one per leaf.


def _local_dim(lay: LeafLayout, offset: int) -> int:
    return lay.dim - offset


def gather_packed(values: Sequence[jax.Array], layouts: Sequence[LeafLayout],
                  offsets: Sequence[int]) -> list[jax.Array]:
    """:func:`gather` of several sharded leaves with one all-gather."""
    rows = [jnp.moveaxis(v, _local_dim(lay, o), 0).reshape(1, -1)
            for v, lay, o in zip(values, layouts, offsets, strict=True)]
    full = jax.lax.all_gather(jnp.concatenate(rows, axis=1), DATA, axis=0, tiled=True)
    out, start = [], 0
    for v, lay, o in zip(values, layouts, offsets, strict=True):
        d, width = _local_dim(lay, o), v.size
        moved = jnp.moveaxis(v, d, 0).shape
        block = full[:, start:start + width].reshape(-1, *moved[1:])
        block = jax.lax.slice_in_dim(block, 0, lay.shape[lay.dim], axis=0)
        out.append(jnp.moveaxis(block, 0, d))
        start += width
    return out


def reduce_scatter_packed(grads: Sequence[jax.Array], layouts: Sequence[LeafLayout],
                          offsets: Sequence[int], extra_axes: Sequence[str] = ()
                          ) -> list[jax.Array]:
    """:func:`reduce_scatter` of several full gradients with one reduce-scatter."""
    rows, shapes = [], []
    for g, lay, o in zip(grads, layouts, offsets, strict=True):
        d = _local_dim(lay, o)
        widths = [(0, 0)] * g.ndim
        widths[d] = (0, lay.padded_shape[lay.dim] - lay.shape[lay.dim])
        moved = jnp.moveaxis(jnp.pad(g, widths) if widths[d][1] else g, d, 0)
        shapes.append((moved.shape[0] // lay.num_shards, *moved.shape[1:]))
        rows.append(moved.reshape(lay.num_shards, -1))
    packed = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), DATA, scatter_dimension=0,
                                  tiled=True)
    if extra_axes:
        packed = jax.lax.psum(packed, tuple(extra_axes))
    out, start = [], 0
    for r, shape, lay, o in zip(rows, shapes, layouts, offsets, strict=True):
        piece = packed[0, start:start + r.shape[1]].reshape(shape)
        out.append(jnp.moveaxis(piece, 0, _local_dim(lay, o)))
        start += r.shape[1]
    return out


# --- references: lists of per-device numpy arrays in, lists out -----------------------


def reference_gather(slices: Sequence[np.ndarray], layout: LeafLayout) -> list[np.ndarray]:
    full = np.concatenate(slices, axis=layout.dim) if layout.dim is not None else slices[0]
    return [np.asarray(unpad(full, layout)) for _ in slices]


def reference_reduce_scatter(grads: Sequence[np.ndarray], layout: LeafLayout) -> list[np.ndarray]:
    total = np.sum(np.stack(grads), axis=0)
    if layout.dim is None:
        return [total for _ in grads]
    return np.split(pad(total, layout), layout.num_shards, axis=layout.dim)


def reference_all_reduce(grads: Sequence[np.ndarray]) -> list[np.ndarray]:
    total = np.sum(np.stack(grads), axis=0)
    return [total for _ in grads]
