"""Tensor and sequence parallelism's collectives (Megatron-LM), explicit, for ``shard_map``.

A layer split over a ``model`` mesh axis computes on each device's slice of its weights and
meets the others in four places (Shoeybi et al. 2019; Korthikanti et al. 2022):

* :func:`copy_to` — Megatron's *f*: identity forward, all-reduce of the input's gradient
  backward. Before a column-parallel linear (each device computes a slice of the outputs
  from the whole input).
* :func:`reduce_from` — Megatron's *g*: all-reduce forward (the partial sums of a
  row-parallel linear, each device holding a slice of the inputs), identity backward.
* :func:`gather_seq` — sequence parallelism's *g*: all-gather along the sequence forward,
  reduce-scatter of the gradient backward; in *f*'s place, the norms and residuals before
  it each device's slice of the sequence.
* :func:`scatter_seq` — sequence parallelism's *ḡ*: reduce-scatter along the sequence
  forward, all-gather of the gradient backward; in *g*'s place.

*f* and *g* are ``jax.custom_vjp`` whose backward is written out: with ``shard_map``'s
``check_vma`` off (jaxzero's step) a ``psum`` transposes to a ``psum``, which is neither.
The gather and the reduce-scatter are JAX's own, each the other's transpose in either
mode, so a step's gradients hold the collectives these functions name and no others.
:func:`vocab_cross_entropy` is the vocabulary-parallel loss: each device holds a slice of
the logits' vocabulary, and the maximum, the normaliser and the target's logit are
reduced over the axis, never the full logits on one device. The ``reference_*``
functions are the same on lists of per-device numpy arrays, for tests.

Example (inside ``shard_map`` over a mesh with a ``model`` axis, ``x`` replicated on it,
``w1`` split by columns and ``w2`` by rows: one all-reduce forward, one backward):
  >>> def mlp(x, w1, w2):  # doctest: +SKIP
  ...     return reduce_from(jax.nn.gelu(copy_to(x) @ w1) @ w2)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxzero.hooks import GATHERED

__all__ = [
    "copy_to", "gather_seq", "reduce_from", "reference_copy_to_grad",
    "reference_gather_seq", "reference_scatter_seq", "reference_vocab_cross_entropy",
    "scatter_seq", "vocab_cross_entropy", "vocab_embed",
]  # fmt: skip

MODEL = "model"  # the mesh axis a layer's weights are split over


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to(x: jax.Array, axis: str = MODEL) -> jax.Array:
    """The input of a column-parallel layer: unchanged forward; its gradient, each
    device's from its slice of the outputs, summed over ``axis`` backward."""
    return x


def _copy_fwd(x: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return x, None


def _copy_bwd(axis: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.psum(g, axis),)


copy_to.defvjp(_copy_fwd, _copy_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from(x: jax.Array, axis: str = MODEL) -> jax.Array:
    """The output of a row-parallel layer: the devices' partial sums added over ``axis``
    forward; the (replicated) gradient passed to each device's part backward."""
    return jax.lax.psum(x, axis)


def _reduce_fwd(x: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return jax.lax.psum(x, axis), None


def _reduce_bwd(axis: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (g,)


reduce_from.defvjp(_reduce_fwd, _reduce_bwd)


def gather_seq(x: jax.Array, dim: int = 1, axis: str = MODEL) -> jax.Array:
    """Sequence parallelism before a column-parallel layer: each device's slice of the
    sequence (dimension ``dim``) gathered into the whole forward; the whole sequence's
    gradient, a partial sum on each device, reduce-scattered back to the slices (the
    all-gather's transpose). Named :data:`jaxzero.hooks.GATHERED`, so a layer under
    :func:`jaxzero.hooks.remat_layer` gathers it again in the backward pass instead
    of keeping it."""
    return checkpoint_name(jax.lax.all_gather(x, axis, axis=dim, tiled=True), GATHERED)


def scatter_seq(x: jax.Array, dim: int = 1, axis: str = MODEL) -> jax.Array:
    """Sequence parallelism after a row-parallel layer: the devices' partial sums of the
    whole sequence reduce-scattered into each device's slice (dimension ``dim``) forward;
    the slices' gradients gathered into the whole backward (the reduce-scatter's
    transpose)."""
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def vocab_cross_entropy(
    logits_BxSxVl: jax.Array, targets_BxS: jax.Array, axis: str = MODEL
) -> jax.Array:
    """Each token's cross-entropy (``B x S``, fp32, the same on every device of ``axis``)
    from each device's slice of the vocabulary: this device holds ids
    ``[i * Vl, (i + 1) * Vl)``, ``i`` its index on ``axis``. Three reductions over the
    axis of ``B x S`` values (the maximum, the normaliser, the target's logit); the
    gradient is each device's slice of ``softmax - onehot``, with no collective."""
    return _vocab_forward(logits_BxSxVl, targets_BxS, axis)[0]


def _vocab_forward(
    logits: jax.Array, targets: jax.Array, axis: str
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """The loss, and for the backward the slice's probabilities, the targets' index in
    the slice (-1 where the target is another device's: no one-hot is kept, it is made
    again from these ids) and the logits' dtype (an empty array of it)."""
    z = logits.astype(jnp.float32)
    vl = z.shape[-1]
    local = targets - jax.lax.axis_index(axis) * vl
    mine = (local >= 0) & (local < vl)
    top = jax.lax.pmax(jnp.max(z, axis=-1), axis)  # for stability only
    exp = jnp.exp(z - top[..., None])
    total = jax.lax.psum(jnp.sum(exp, axis=-1), axis)
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, vl - 1)[..., None], axis=-1)[..., 0]
    target = jax.lax.psum(jnp.where(mine, picked, 0.0), axis)
    dtype = jnp.zeros((0,), logits.dtype)
    return jnp.log(total) + top - target, (
        exp / total[..., None],
        jnp.where(mine, local, -1),
        dtype,
    )


def _vocab_bwd(
    axis: str, res: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array
) -> tuple[jax.Array, None]:
    probs, local, dtype = res
    onehot = jax.nn.one_hot(local, probs.shape[-1], dtype=jnp.float32)  # -1: all zeros
    return ((probs - onehot) * g[..., None]).astype(dtype.dtype), None


vocab_cross_entropy.defvjp(_vocab_forward, _vocab_bwd)


def vocab_embed(embed_VlxD: jax.Array, tokens_BxS: jax.Array, axis: str = MODEL) -> jax.Array:
    """The vocabulary-parallel embedding's lookup: this device holds rows
    ``[i * Vl, (i + 1) * Vl)`` of the table (``i`` its index on ``axis``), looks up the
    tokens it holds and gives zeros for the others, so the devices' results sum to the
    whole lookup (:func:`reduce_from`, or :func:`scatter_seq` for sequence parallelism).
    No collective here; the table's gradient is this device's rows' scatter-add."""
    vl = embed_VlxD.shape[0]
    local = tokens_BxS - jax.lax.axis_index(axis) * vl
    mine = (local >= 0) & (local < vl)
    rows = jnp.take(embed_VlxD, jnp.clip(local, 0, vl - 1), axis=0)
    return jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype))


# ----------------------------------------------------------------- numpy references


def reference_copy_to_grad(grads: Sequence[np.ndarray]) -> list[np.ndarray]:
    """:func:`copy_to`'s backward: every device gets the sum of the devices' gradients."""
    total = np.sum(grads, axis=0)
    return [total.copy() for _ in grads]


def reference_gather_seq(slices: Sequence[np.ndarray], dim: int = 1) -> list[np.ndarray]:
    """:func:`gather_seq` forward (and :func:`scatter_seq` backward): the slices joined."""
    whole = np.concatenate(slices, axis=dim)
    return [whole.copy() for _ in slices]


def reference_scatter_seq(parts: Sequence[np.ndarray], dim: int = 1) -> list[np.ndarray]:
    """:func:`scatter_seq` forward (and :func:`gather_seq` backward): the sum, split."""
    return list(np.split(np.sum(parts, axis=0), len(parts), axis=dim))


def reference_vocab_cross_entropy(slices: Sequence[np.ndarray], targets: np.ndarray) -> np.ndarray:
    """:func:`vocab_cross_entropy` from the devices' slices of the vocabulary, in float64."""
    z = np.concatenate([np.asarray(s, np.float64) for s in slices], axis=-1)
    top = z.max(axis=-1, keepdims=True)
    log_total = np.log(np.exp(z - top).sum(axis=-1)) + top[..., 0]
    return log_total - np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
