"""The three collectives of ZeRO on one leaf, and plain references to test them against.

Inside ``shard_map`` each device holds a slice of a stored (padded) leaf. These
functions move between that slice and the logical, unpadded leaf:

* :func:`gather` — all-gather the slices, drop padding (stage 3 forward, stages 1–2
  after the update).
* :func:`reduce_scatter` — pad a full gradient, sum it over devices and keep only
  this device's slice (stages 1–3).
* :func:`all_reduce` — sum a full gradient over devices (stage 0, replicated leaves).
* :func:`dot_barrier` — hand a weight gradient to them without letting XLA:CPU
  fold its transpose into the dot that made it; :func:`dot_gradients` says which
  leaves' gradients are a dot's, the only ones where it pays.

The ``reference_*`` functions do the same on a list of per-device numpy arrays,
with no JAX, so tests can check the sharded code against arithmetic anyone can read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, Literal, Var, jaxprs_in_params
from jax.extend.core import primitives as prim

from jaxzero.mesh import DATA  # the state's axis, named where no mesh is at hand
from jaxzero.partition import LeafLayout, pad, unpad
from jaxzero.types import Params


def gather(x: jax.Array, layout: LeafLayout, offset: int = 0) -> jax.Array:
    """All-gather a slice along ``layout.dim`` and strip the padding.

    ``offset`` counts leading dims already indexed away (a scan over stacked layers).
    """
    if layout.dim is None:
        return x
    full = jax.lax.all_gather(x, DATA, axis=layout.dim - offset, tiled=True)
    return unpad(full, layout, offset)


def reduce_scatter(
    g: jax.Array,
    layout: LeafLayout,
    extra_axes: Sequence[str] = (),
    offset: int = 0,
    scatter_extra: bool = False,
) -> jax.Array:
    """Sum a full (logical-shape) gradient over devices; keep this device's slice.

    ``extra_axes`` are batch axes that replicate the state (hybrid sharding): the
    slice is then also summed over them, or with ``scatter_extra`` (hpZ, the state
    split over every device) reduce-scattered over them: within the group first, then
    across groups.
    """
    if layout.dim is None:
        return all_reduce(g, extra_axes)
    dim = layout.dim - offset
    g = jax.lax.psum_scatter(pad(g, layout, offset), DATA, scatter_dimension=dim, tiled=True)
    if not extra_axes:
        return g
    if scatter_extra:
        return jax.lax.psum_scatter(g, tuple(extra_axes), scatter_dimension=dim, tiled=True)
    return jax.lax.psum(g, tuple(extra_axes))


def all_reduce(g: jax.Array, extra_axes: Sequence[str] = ()) -> jax.Array:
    """Sum a gradient over every batch axis."""
    return jax.lax.psum(g, (DATA, *extra_axes))


def dot_barrier(g: jax.Array) -> jax.Array:
    """``g`` itself, computed so XLA keeps the dot that made it in its natural layout.

    Autodiff gives the gradient of ``x @ w`` as ``transpose(dot(dy, x))``. When a
    collective consumes that directly, XLA's simplifier folds the transpose into the
    dot, leaving one that contracts its lhs's leading dim, which XLA:CPU runs with
    Eigen instead of its faster YNNPACK kernels (about 1.3x slower per dot at 2
    devices). Under ``jax.jit``'s own partitioning the all-reduce sits between the two,
    so plain jit never meets this. The first ``.T`` here cancels autodiff's, the
    barrier keeps the second from folding back; ``g``'s values pass unchanged. 2-D leaves
    only: that is where ``x @ w`` puts the transpose (an extra param-sized copy for a
    2-D gradient that was not a dot's, such as an embedding's scatter).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x_BxSxD, w = jnp.ones((4, 5, 3)), jnp.ones((3, 2))
      >>> g = jax.grad(lambda w: jnp.sum(x_BxSxD @ w))(w)
      >>> bool((jax.jit(dot_barrier)(g) == g).all())
      True
    """
    if g.ndim != 2:
        return g
    return jax.lax.optimization_barrier(g.T).T


# What a gradient may pass through after its dot and still be that dot's transpose.
_THROUGH = frozenset(
    {prim.add_jaxvals_p, prim.convert_element_type_p, prim.copy_p, prim.mul_p, prim.neg_p}
)


def dot_gradients(grad_fn: Callable[..., Params], *args: object) -> object:
    """For each leaf of ``grad_fn(*args)``, whether it may be a weight gradient's
    ``transpose(dot(...))``: where :func:`dot_barrier` pays, and nowhere else.

    Traced, not run (``args`` may be ``jax.ShapeDtypeStruct``). An embedding's
    gradient is a scatter-add, for which the barrier's two transposes of a
    table-sized leaf are pure cost. Calls and loops (``jnp.take``'s inner jit, a
    scan over layers) are followed where their outputs line up with their inner
    program's; one that cannot be seen into counts as a dot's, as does a sum with
    one (tied embeddings). Primitives are matched by identity (``jax.extend``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> loss = lambda p, t: jnp.sum(jnp.take(p["emb"], t, axis=0) @ p["w"])
      >>> p = {"emb": jnp.ones((10, 4)), "w": jnp.ones((4, 3))}
      >>> dot_gradients(jax.grad(loss), p, jnp.zeros((2, 5), jnp.int32))
      {'emb': False, 'w': True}
    """
    closed, shapes = jax.make_jaxpr(grad_fn, return_shape=True)(*args)
    flags = _from_dot(closed.jaxpr, list(closed.jaxpr.outvars), 0)
    return jax.tree.unflatten(jax.tree.structure(shapes), flags)


def _from_dot(jaxpr: Jaxpr, outs: list[Var | Literal], depth: int) -> list[bool]:
    """Whether each of ``jaxpr``'s vars ``outs`` may be a transposed dot."""
    made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

    def of(v: Var | Literal, depth: int) -> bool:
        if not isinstance(v, Var) or depth > 32:  # a literal, or too deep to follow
            return False
        eqn = made.get(v)
        if eqn is None:  # an input, a constant, a zero
            return False
        if eqn.primitive is prim.transpose_p:
            return True
        if eqn.primitive is prim.scatter_add_p:  # its update rule is a jaxpr too
            return False
        if eqn.primitive in _THROUGH:
            return any(of(x, depth + 1) for x in eqn.invars)
        inner = list(jaxprs_in_params(eqn.params))
        if not inner:
            return False  # a primitive that computes (a reduce, a select, ...), not a dot
        subs = [j for j in inner if len(j.outvars) == len(eqn.outvars)]
        if not subs:
            return True  # a program whose outputs do not line up: keep the barrier
        i = eqn.outvars.index(v)
        return any(_from_dot(j, [j.outvars[i]], depth + 1)[0] for j in subs)

    return [of(v, depth) for v in outs]


# --- packed: one collective for many leaves (a layer's params) -----------------------
#
# Each sharded leaf is viewed as N rows (its sharded dim moved first, padded), the rows
# of all leaves are concatenated, and a single collective moves them: one all-gather
# or reduce-scatter per layer instead of one per leaf.


def _dim(lay: LeafLayout) -> int:
    assert lay.dim is not None, f"{lay.path}: the packed collectives move sharded leaves only"
    return lay.dim


def _local_dim(lay: LeafLayout, offset: int) -> int:
    return _dim(lay) - offset


def gather_packed(
    values: Sequence[jax.Array], layouts: Sequence[LeafLayout], offsets: Sequence[int]
) -> list[jax.Array]:
    """:func:`gather` of several sharded leaves with one all-gather."""
    rows = [
        jnp.moveaxis(v, _local_dim(lay, o), 0).reshape(1, -1)
        for v, lay, o in zip(values, layouts, offsets, strict=True)
    ]
    full = jax.lax.all_gather(jnp.concatenate(rows, axis=1), DATA, axis=0, tiled=True)
    out, start = [], 0
    for v, lay, o in zip(values, layouts, offsets, strict=True):
        d, width = _local_dim(lay, o), v.size
        moved = jnp.moveaxis(v, d, 0).shape
        block = full[:, start : start + width].reshape(-1, *moved[1:])
        block = jax.lax.slice_in_dim(block, 0, lay.shape[_dim(lay)], axis=0)
        out.append(jnp.moveaxis(block, 0, d))
        start += width
    return out


def reduce_scatter_packed(
    grads: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    offsets: Sequence[int],
    extra_axes: Sequence[str] = (),
    scatter_extra: bool = False,
) -> list[jax.Array]:
    """:func:`reduce_scatter` of several full gradients with one reduce-scatter."""
    rows, shapes = [], []
    for g, lay, o in zip(grads, layouts, offsets, strict=True):
        moved = jnp.moveaxis(pad(g, lay, o), _local_dim(lay, o), 0)
        shapes.append((moved.shape[0] // lay.num_shards, *moved.shape[1:]))
        rows.append(moved.reshape(lay.num_shards, -1))
    packed = jax.lax.psum_scatter(
        jnp.concatenate(rows, axis=1), DATA, scatter_dimension=0, tiled=True
    )
    if extra_axes and scatter_extra:  # the N x R rows: R to the group, then 1 to the device
        packed = jax.lax.psum_scatter(packed, tuple(extra_axes), scatter_dimension=0, tiled=True)
    elif extra_axes:
        packed = jax.lax.psum(packed, tuple(extra_axes))
    out, start = [], 0
    for r, shape, lay, o in zip(rows, shapes, layouts, offsets, strict=True):
        piece = packed[0, start : start + r.shape[1]].reshape(shape)
        out.append(jnp.moveaxis(piece, 0, _local_dim(lay, o)))
        start += r.shape[1]
    return out


# --- bucketed: many leaves in a few packed collectives --------------------------------
#
# Stages 1-2 reduce-scatter every gradient and all-gather every updated param once a
# step; stages 2-3 do it for each use_params call (a layer, or the whole tree with
# per_layer=False). One collective per leaf makes each device wait at one rendezvous per leaf;
# packing them into buckets of at most ``bucket_bytes`` (DeepSpeed's
# reduce_bucket_size / allgather_bucket_size) pays one per bucket, and bounds the
# extra memory of packing to one bucket.


def buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive indices grouped so each group's total ``sizes`` stays within
    ``bucket_bytes`` (a larger single item gets its own group); 0: one item a group.

    >>> buckets([4, 4, 8, 2], 8)
    [[0, 1], [2], [3]]
    """
    out: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not out or total + size > bucket_bytes:
            out.append([])
            total = 0
        out[-1].append(i)
        total += size
    return out


def _bucketed(
    packed: Callable[[list[jax.Array], list[LeafLayout], list[int]], list[jax.Array]],
    per_leaf: Callable[[jax.Array, LeafLayout, int], jax.Array],
    xs: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    offsets: Sequence[int] | None,
    bucket_bytes: int,
) -> list[jax.Array]:
    """``packed`` on buckets of same-dtype sharded leaves (sized by their whole padded
    bytes), ``per_leaf`` on the rest; both take ``(x(s), layout(s), offset(s))``."""
    offsets = [0] * len(xs) if offsets is None else offsets
    out = list(xs)
    idx = [i for i, lay in enumerate(layouts) if lay.dim is not None]
    for i in (i for i, lay in enumerate(layouts) if lay.dim is None):
        out[i] = per_leaf(xs[i], layouts[i], offsets[i])
    for dtype in dict.fromkeys(xs[i].dtype for i in idx):
        same = [i for i in idx if xs[i].dtype == dtype]
        full = [math.prod(layouts[i].padded_shape[offsets[i] :]) * dtype.itemsize for i in same]
        for group in buckets(full, bucket_bytes):
            members = [same[j] for j in group]
            if len(members) == 1:
                i = members[0]
                out[i] = per_leaf(xs[i], layouts[i], offsets[i])
                continue
            results = packed(
                [xs[i] for i in members],
                [layouts[i] for i in members],
                [offsets[i] for i in members],
            )
            for i, x in zip(members, results, strict=True):
                out[i] = x
    return out


def gather_buckets(
    values: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    bucket_bytes: int,
    offsets: Sequence[int] | None = None,
) -> list[jax.Array]:
    """:func:`gather` of every leaf, one all-gather per bucket of slices."""
    return _bucketed(gather_packed, gather, values, layouts, offsets, bucket_bytes)


def reduce_scatter_buckets(
    grads: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    bucket_bytes: int,
    extra_axes: Sequence[str] = (),
    offsets: Sequence[int] | None = None,
    scatter_extra: bool = False,
) -> list[jax.Array]:
    """:func:`reduce_scatter` of every leaf, one reduce-scatter per bucket of gradients."""
    return _bucketed(
        lambda g, lay, o: reduce_scatter_packed(g, lay, o, extra_axes, scatter_extra),
        lambda g, lay, o: reduce_scatter(g, lay, extra_axes, o, scatter_extra),
        grads,
        layouts,
        offsets,
        bucket_bytes,
    )


# --- references: lists of per-device numpy arrays in, lists out -----------------------
#
# They pad and unpad with their own numpy indexing, on purpose not with partition.pad and
# unpad, which the code above uses: a reference that shared them would share their bugs.


def reference_gather(slices: Sequence[np.ndarray], layout: LeafLayout) -> list[np.ndarray]:
    full = np.concatenate(slices, axis=layout.dim) if layout.dim is not None else slices[0]
    logical = full[tuple(slice(0, n) for n in layout.shape)]
    return [np.array(logical) for _ in slices]


def reference_reduce_scatter(grads: Sequence[np.ndarray], layout: LeafLayout) -> list[np.ndarray]:
    total = np.sum(np.stack(grads), axis=0)
    if layout.dim is None:
        return [total for _ in grads]
    padded = np.zeros(layout.padded_shape, total.dtype)
    padded[tuple(slice(0, n) for n in layout.shape)] = total
    return np.split(padded, layout.num_shards, axis=layout.dim)


def reference_all_reduce(grads: Sequence[np.ndarray]) -> list[np.ndarray]:
    total = np.sum(np.stack(grads), axis=0)
    return [total for _ in grads]
