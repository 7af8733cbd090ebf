"""ZeRO++'s quantized collectives, qwZ and qgZ, on block-quantized buffers; numpy references.

ZeRO++ (Wang et al. 2023, arXiv:2306.10209) sends ZeRO-3's weights and gradients quantized:

* qwZ (:func:`gather_quantized`): each device quantizes its own slice to int8 (blocks
  never straddle devices), all-gathers it with its scales and dequantizes: about half of
  bf16's bytes. The fp32 master and its update stay exact; only the forward's copy rounds.
* qgZ (:func:`reduce_scatter_quantized`): a reduce-scatter cannot sum int8 on the wire
  without overflowing, so each device quantizes its N rows of the padded gradient, one
  all-to-all hands device i every device's row i, and it sums them in float32. With
  extra (replica) axes a second hop all-gathers the quantized group sums across groups
  and sums them (DeepSpeed's two hops); with hpZ's state split over every device, a
  second all-to-all across groups instead. int8: about a quarter of fp32's bytes.

Wire format of a device's row of W values (the sharded dim first, as
:mod:`jaxzero.collectives` packs): W bytes (int8) or ceil(W/2) (int4, two a byte, the
first in the low nibble), then each block's float32 scale as 4 bytes, in one int8 buffer
so one collective moves both. A block is ``block`` consecutive values of the row.

Error (:func:`error_bound`): a value is rounded to a multiple of its block's scale
``absmax / qmax`` (qmax 127 for int8, 7 for int4), so it is off by at most half of it;
a sum over devices by at most the sum of its terms' bounds (with a second hop, plus each
group sum's). The ``reference_*`` functions compute both on lists of per-device numpy
arrays with their own numpy indexing, so that they share no bug with the JAX code.

Example:
  >>> import jax.numpy as jnp
  >>> x = jnp.array([127.0, -63.5, 2.0, 0.0, 0.0])
  >>> q, scales = quantize(x, block=3, bits=8)
  >>> q.tolist(), scales.tolist()  # -63.5 rounds half to even; a zero block: scale 0
  ([[127, -64, 2], [0, 0, 0]], [1.0, 0.0])
  >>> dequantize(q, scales, (5,), jnp.float32, 8).tolist()
  [127.0, -64.0, 2.0, 0.0, 0.0]
  >>> error_bound(np.asarray(x), block=3, bits=8).tolist()  # absmax / 254 per block
  [0.5, 0.5, 0.5, 0.0, 0.0]
  >>> gather_wire_bytes(elements=8 * 4096, n=8, block=2048)  # 7 x (4096 + 2 x 4)
  28728.0
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero import collectives
from jaxzero.collectives import _dim, _local_dim
from jaxzero.mesh import DATA
from jaxzero.partition import LeafLayout, pad

__all__ = [
    "dequantize",
    "error_bound",
    "gather_buckets_quantized",
    "gather_packed_quantized",
    "gather_quantized",
    "gather_wire_bytes",
    "quantize",
    "reduce_scatter_buckets_quantized",
    "reduce_scatter_packed_quantized",
    "reduce_scatter_quantized",
    "reduce_scatter_wire_bytes",
    "reference_gather_quantized",
    "reference_quantize",
    "reference_reduce_scatter_quantized",
]

QMAX = {8: 127, 4: 7}  # symmetric: -qmax..qmax, so a zero stays exactly zero


def _qmax(block: int, bits: int) -> int:
    if bits not in QMAX:
        raise ValueError(f"bits={bits!r}: 8 (int8) or 4 (int4)")
    if block < 1 or (bits == 4 and block % 2):
        raise ValueError(f"block={block!r}: a positive number of elements, even for int4")
    return QMAX[bits]


def quantize(x: jax.Array, block: int, bits: int = 8) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax quantization of ``x`` flattened, a float32 scale per ``block``
    elements (the last block padded with zeros).

    Returns ``(q, scales)``: q ``(blocks, block)`` int8 in [-127, 127], or for ``bits=4``
    ``(blocks, block // 2)`` uint8 holding two values in [-7, 7] a byte (so the wire
    carries half a byte an element); ``scales = absmax / qmax`` (0 for a zero block,
    which dequantizes to exact zeros).
    """
    qmax = _qmax(block, bits)
    flat = jnp.ravel(x).astype(jnp.float32)
    nb = -(-flat.size // block)
    rows = jnp.pad(flat, (0, nb * block - flat.size)).reshape(nb, block)
    absmax = jnp.max(jnp.abs(rows), axis=1)
    inv = jnp.where(absmax > 0, qmax / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    q = jnp.clip(jnp.round(rows * inv[:, None]), -qmax, qmax).astype(jnp.int8)
    if bits == 4:  # two's complement nibbles, the even element low
        u = jax.lax.bitcast_convert_type(q, jnp.uint8) & 0xF
        q = u[:, 0::2] | (u[:, 1::2] << 4)
    return q, absmax * np.float32(1 / qmax)  # a product: XLA would make a quotient one


def _values(q: jax.Array, bits: int) -> jax.Array:
    """The int8 values of a payload, flat (int4: unpacked, sign-extended)."""
    if bits == 8:
        return q.reshape(-1)
    u = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(-1)
    nibbles = jnp.stack([u & 0xF, u >> 4], axis=-1).reshape(-1).astype(jnp.int8)
    return (nibbles ^ 8) - 8


def _scaled(values: jax.Array, scales: jax.Array, block: int, size: int) -> jax.Array:
    """``values * scale`` in float32, first ``size`` elements (views and one multiply,
    so that hooks' re-gather policy recomputes it instead of saving it)."""
    per = jnp.broadcast_to(scales[:, None], (scales.size, block)).reshape(-1)[:size]
    return values[:size].astype(jnp.float32) * per


def dequantize(
    q: jax.Array, scales: jax.Array, shape: Sequence[int], dtype: jnp.dtype, bits: int = 8
) -> jax.Array:
    """The array of ``shape`` and ``dtype`` that :func:`quantize` gave ``(q, scales)`` for."""
    block = q.shape[-1] * (2 if bits == 4 else 1)
    return _scaled(_values(q, bits), scales, block, math.prod(shape)).reshape(shape).astype(dtype)


def _payload_bytes(size: int, bits: int) -> int:
    return -(-size * bits // 8)


def _encode(row: jax.Array, block: int, bits: int) -> jax.Array:
    """A 1-D row as its wire buffer: the payload without padding, then the scales' bytes."""
    q, scales = quantize(row, block, bits)
    payload = jax.lax.bitcast_convert_type(q, jnp.int8).reshape(-1)
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.int8).reshape(-1)
    return jnp.concatenate([payload[: _payload_bytes(row.size, bits)], scale_bytes])


def _decode(wire: jax.Array, size: int, block: int, bits: int) -> jax.Array:
    """:func:`_encode`'s row back, in float32."""
    cut = _payload_bytes(size, bits)
    scales = jax.lax.bitcast_convert_type(wire[cut:].reshape(-1, 4), jnp.float32)
    return _scaled(_values(wire[:cut], bits), scales, block, size)


# --- qwZ: the stage-3 weight all-gather ----------------------------------------------


def gather_packed_quantized(
    values: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    offsets: Sequence[int],
    block: int,
) -> list[jax.Array]:
    """:func:`jaxzero.collectives.gather_packed` with the row sent as int8 + scales.

    Non-float leaves (an int8 frozen base) are gathered exactly.
    """
    if not all(jnp.issubdtype(v.dtype, jnp.floating) for v in values):
        return collectives.gather_packed(values, layouts, offsets)
    rows = [
        jnp.moveaxis(v, _local_dim(lay, o), 0).reshape(-1)
        for v, lay, o in zip(values, layouts, offsets, strict=True)
    ]
    row = jnp.concatenate(rows)
    wire = jax.lax.all_gather(_encode(row, block, 8), DATA)  # (N, bytes)
    full = jax.vmap(lambda w: _decode(w, row.size, block, 8))(wire)  # (N, W) float32
    out, start = [], 0
    for v, lay, o in zip(values, layouts, offsets, strict=True):
        d = _local_dim(lay, o)
        moved = jnp.moveaxis(v, d, 0).shape
        part = full[:, start : start + v.size].reshape(-1, *moved[1:]).astype(v.dtype)
        part = jax.lax.slice_in_dim(part, 0, lay.shape[_dim(lay)], axis=0)
        out.append(jnp.moveaxis(part, 0, d))
        start += v.size
    return out


def gather_quantized(
    x: jax.Array, layout: LeafLayout, offset: int = 0, block: int = 2048
) -> jax.Array:
    """:func:`jaxzero.collectives.gather` with the slice sent as int8 + scales."""
    if layout.dim is None:
        return x
    return gather_packed_quantized([x], [layout], [offset], block)[0]


# --- qgZ: the gradient reduce-scatter ------------------------------------------------


def _hop(rows: jax.Array, axes: str | tuple[str, ...], block: int, bits: int) -> jax.Array:
    """One all-to-all hop: ``rows`` (K, W) quantized, row block k of K/n sent to device k of
    ``axes`` (n devices), every device's block for this one dequantized and summed in
    float32, in device order as the reference sums: (K/n, W)."""
    k, width = rows.shape
    wires = jax.lax.all_to_all(
        jax.vmap(lambda r: _encode(r, block, bits))(rows), axes, 0, 0, tiled=True
    )
    got = jax.vmap(lambda w: _decode(w, width, block, bits))(wires)
    n = jax.lax.axis_size(axes)
    return functools.reduce(jnp.add, list(got.reshape(n, k // n, width)))


def reduce_scatter_packed_quantized(
    grads: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    offsets: Sequence[int],
    extra_axes: Sequence[str] = (),
    block: int = 2048,
    bits: int = 8,
    scatter_extra: bool = False,
) -> list[jax.Array]:
    """:func:`jaxzero.collectives.reduce_scatter_packed` through an all-to-all of quantized
    rows and a float32 sum, then over ``extra_axes`` a quantized all-gather and sum (or
    with ``scatter_extra``, hpZ's state over every device, a second all-to-all); float32."""
    rows, shapes = [], []
    for g, lay, o in zip(grads, layouts, offsets, strict=True):
        moved = jnp.moveaxis(pad(g, lay, o), _local_dim(lay, o), 0)
        shapes.append((moved.shape[0] // lay.num_shards, *moved.shape[1:]))
        rows.append(moved.reshape(lay.num_shards, -1))
    packed = jnp.concatenate(rows, axis=1)  # (shards, W): row k is device k's to sum
    mine = _hop(packed, DATA, block, bits)  # this device's row(s): 1, or R with hpZ
    if extra_axes and scatter_extra:  # hpZ: row r of the group's R to group r
        mine = _hop(mine, tuple(extra_axes), block, bits)
    elif extra_axes:  # the second hop: this slice's group sums, from every group
        wires = jax.lax.all_gather(_encode(mine[0], block, bits), tuple(extra_axes))
        got = jax.vmap(lambda w: _decode(w, mine.shape[1], block, bits))(wires)
        mine = functools.reduce(jnp.add, list(got))[None]
    out, start = [], 0
    for r, shape, lay, o in zip(rows, shapes, layouts, offsets, strict=True):
        piece = mine[0, start : start + r.shape[1]].reshape(shape)
        out.append(jnp.moveaxis(piece, 0, _local_dim(lay, o)))
        start += r.shape[1]
    return out


def reduce_scatter_quantized(
    g: jax.Array,
    layout: LeafLayout,
    extra_axes: Sequence[str] = (),
    offset: int = 0,
    block: int = 2048,
    bits: int = 8,
    scatter_extra: bool = False,
) -> jax.Array:
    """:func:`jaxzero.collectives.reduce_scatter` quantized; a replicated leaf keeps the
    exact all-reduce."""
    if layout.dim is None:
        return collectives.all_reduce(g, extra_axes)
    return reduce_scatter_packed_quantized(
        [g], [layout], [offset], extra_axes, block, bits, scatter_extra
    )[0]


def gather_buckets_quantized(
    values: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    bucket_bytes: int,
    offsets: Sequence[int] | None = None,
    block: int = 2048,
) -> list[jax.Array]:
    """:func:`jaxzero.collectives.gather_buckets`, each bucket's all-gather quantized."""
    packed = lambda v, lay, o: gather_packed_quantized(v, lay, o, block)
    per_leaf = lambda v, lay, o: gather_quantized(v, lay, o, block)
    return collectives._bucketed(packed, per_leaf, values, layouts, offsets, bucket_bytes)


def reduce_scatter_buckets_quantized(
    grads: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    bucket_bytes: int,
    extra_axes: Sequence[str] = (),
    offsets: Sequence[int] | None = None,
    block: int = 2048,
    bits: int = 8,
    scatter_extra: bool = False,
) -> list[jax.Array]:
    """:func:`jaxzero.collectives.reduce_scatter_buckets`, each bucket quantized."""
    args = (extra_axes, block, bits, scatter_extra)
    packed = lambda g, lay, o: reduce_scatter_packed_quantized(g, lay, o, *args)
    per_leaf = lambda g, lay, o: reduce_scatter_quantized(g, lay, extra_axes, o, *args[1:])
    return collectives._bucketed(packed, per_leaf, grads, layouts, offsets, bucket_bytes)


# --- bytes on the wire: ring convention of jaxzero.accounting.formulas.ring_bytes ----


def _buffer_bytes(elements: int, block: int, bits: int) -> int:
    return _payload_bytes(elements, bits) + 4 * -(-elements // block)


def gather_wire_bytes(elements: int, n: int, block: int) -> float:
    """Bytes one device sends for a qwZ all-gather of ``elements`` (the whole padded
    array, ``n`` rows): ``(n-1)/n`` of the full buffer, ``n`` rows of int8 + scales."""
    return (n - 1) / n * n * _buffer_bytes(elements // n, block, 8)


def reduce_scatter_wire_bytes(
    elements: int, n: int, block: int, bits: int, replicas: int = 1, scatter_extra: bool = False
) -> float:
    """Bytes one device sends for a qgZ reduce-scatter of a padded gradient of
    ``elements`` over ``n`` devices: the all-to-all of its ``n`` quantized rows,
    ``(n-1)/n`` of them, plus with ``replicas`` groups the all-gather of its quantized
    slice across them, ``(replicas-1)`` slices. ``scatter_extra`` (hpZ): ``n x replicas``
    rows, the first all-to-all sends ``(n-1)/n`` of them, the second ``(replicas-1)``."""
    rows = n * replicas if scatter_extra else n
    row = _buffer_bytes(elements // rows, block, bits)
    return (n - 1) / n * rows * row + (replicas - 1) * row


# --- references: lists of per-device numpy arrays ------------------------------------


def reference_quantize(x: np.ndarray, block: int, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize` in numpy."""
    qmax = _qmax(block, bits)
    flat = np.asarray(x, np.float32).ravel()
    rows = np.zeros((-(-flat.size // block), block), np.float32)
    rows.reshape(-1)[: flat.size] = flat
    absmax = np.abs(rows).max(axis=1)
    inv = np.divide(np.float32(qmax), absmax, out=np.zeros_like(absmax), where=absmax > 0)
    q = np.clip(np.rint(rows * inv[:, None]), -qmax, qmax).astype(np.int8)
    if bits == 4:
        nib = q.view(np.uint8) & np.uint8(0xF)
        q = nib[:, 0::2] | (nib[:, 1::2] << np.uint8(4))
    return q, absmax * np.float32(1 / qmax)


def _np_roundtrip(row: np.ndarray, block: int, bits: int) -> np.ndarray:
    """A row quantized and dequantized (float32), by numpy alone."""
    q, scales = reference_quantize(row, block, bits)
    if bits == 4:
        nib = np.stack([q & 0xF, q >> 4], axis=-1).reshape(q.shape[0], -1).astype(np.int16)
        q = np.where(nib > 7, nib - 16, nib)
    return (q.astype(np.float32) * scales[:, None]).reshape(-1)[: row.size]


def error_bound(x: np.ndarray, block: int, bits: int = 8) -> np.ndarray:
    """Per element of ``x`` (blocks over ``x`` flattened): how far its quantized value may
    be, half its block's scale, ``absmax / (2 qmax)`` (plus float32 rounding)."""
    scales = reference_quantize(x, block, bits)[1]
    return np.repeat(scales / 2, block)[: np.size(x)].reshape(np.shape(x))


def _leaves(per_device: Sequence, layouts: LeafLayout | Sequence[LeafLayout]) -> tuple:
    """One leaf (array, layout) or several (lists): both as lists."""
    if isinstance(layouts, LeafLayout):
        return [[np.asarray(x)] for x in per_device], [layouts], True
    return [[np.asarray(x) for x in xs] for xs in per_device], list(layouts), False


def reference_gather_quantized(
    slices: Sequence, layouts: LeafLayout | Sequence[LeafLayout], block: int, bound: bool = False
) -> list:
    """:func:`gather_packed_quantized` (one layout: :func:`gather_quantized`) on each
    device's slice(s); ``bound=True``: :func:`error_bound` of each gathered element."""
    devs, lays, single = _leaves(slices, layouts)
    rows = [
        np.concatenate(
            [np.moveaxis(x, lay.dim, 0).ravel() for x, lay in zip(xs, lays, strict=True)]
        )
        for xs in devs
    ]
    done = [error_bound(r, block) if bound else _np_roundtrip(r, block, 8) for r in rows]
    out, start = [], 0
    for x, lay in zip(devs[0], lays, strict=True):
        moved = np.moveaxis(x, lay.dim, 0).shape
        full = np.concatenate([d[start : start + x.size].reshape(moved) for d in done])
        out.append(np.moveaxis(full[: lay.shape[lay.dim]], 0, lay.dim).astype(x.dtype))
        start += x.size
    return [out[0] if single else list(out) for _ in slices]


def reference_reduce_scatter_quantized(
    grads: Sequence,
    layouts: LeafLayout | Sequence[LeafLayout],
    block: int,
    bits: int = 8,
    replicas: int = 1,
    bound: bool = False,
    scatter_extra: bool = False,
) -> list:
    """:func:`reduce_scatter_packed_quantized` (one layout: :func:`reduce_scatter_quantized`)
    on each device's full gradient(s), devices in mesh order (group-major with
    ``replicas`` groups); ``bound=True``: the sum of the terms' :func:`error_bound`."""
    devs, lays, single = _leaves(grads, layouts)
    n, shards = len(devs) // replicas, lays[0].num_shards  # shards: n, or n x R with hpZ
    rows = []  # per device: (shards, W) float32, row k for device k
    for xs in devs:
        parts = []
        for x, lay in zip(xs, lays, strict=True):
            full = np.zeros(lay.padded_shape, np.float32)
            full[tuple(slice(0, s) for s in x.shape)] = x
            parts.append(np.moveaxis(full, lay.dim, 0).reshape(shards, -1))
        rows.append(np.concatenate(parts, axis=1))
    per = shards // n  # rows a device sums in its group: 1, or R with hpZ
    total = lambda terms: np.sum(terms, axis=0)  # in order, device 0 first
    trip = lambda r: _np_roundtrip(r, block, bits)
    bnd = lambda r: error_bound(r, block, bits)
    # the first hop: device k's t-th row, summed over its group's devices
    at = lambda f, k, t: total([f(rows[k // n * n + j][k % n * per + t]) for j in range(n)])
    values = [[at(trip, k, t) for t in range(per)] for k in range(len(devs))]
    result = [[at(bnd, k, t) for t in range(per)] for k in range(len(devs))] if bound else values

    def second(k: int) -> np.ndarray:
        """Device k = (group g, i): every group's sum of its row (g with hpZ, else its one)
        quantized again and summed; bound: each one's own plus its terms'."""
        g, i = divmod(k, n)
        t, peers = (g if scatter_extra else 0), [h * n + i for h in range(replicas)]
        if bound:
            return total([bnd(values[p][t]) + result[p][t] for p in peers])
        return total([trip(values[p][t]) for p in peers])

    if replicas > 1:
        result = [[second(k)] for k in range(len(devs))]
    out = []
    for k in range(len(devs)):
        mine, start, pieces = result[k][0], 0, []
        for lay in lays:
            s = lay.shard_shape
            shape = (s[lay.dim], *s[: lay.dim], *s[lay.dim + 1 :])  # the sharded dim first
            piece = mine[start : start + math.prod(s)].reshape(shape)
            pieces.append(np.moveaxis(piece, 0, lay.dim))
            start += math.prod(s)
        out.append(pieces[0] if single else pieces)
    return out
