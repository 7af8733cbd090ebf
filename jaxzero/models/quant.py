"""Block-wise quantization of frozen weight matrices (QLoRA's base), as pure functions.

A frozen base weight is stored as integer codes plus one float32 absmax ``scale`` per
block of :data:`BLOCK` consecutive elements of its LAST axis (the input dimension of a
``(out, in)`` weight, as bitsandbytes and qwix block it), so that a layer's weight costs
:func:`bytes_per_param` bytes an element instead of 2 or 4. The loader quantizes on the
host (:func:`quantize`, numpy, on the slice it has read); the jitted step dequantizes
one layer at a time in the forward pass (:func:`dequantize`, JAX).
:func:`dequantize_np` is the numpy reference, equal to the JAX one bit for bit: both
are the same float32 operations (a product with a constant or a table look-up, then a
product with the scale), each correctly rounded in IEEE float32, leaving a compiler
nothing to round its own way (only a backend flushing subnormals could differ, and then
only on values below 1e-38).

Kinds: ``int8`` (``round(w / absmax * 127)``, symmetric, codes in [-127, 127]) and
``nf4`` (QLoRA's NormalFloat4 codebook :data:`NF4`, two 4-bit codes a byte).

Example:
  >>> w = np.linspace(-1, 1, 256, dtype=np.float32).reshape(2, 128)
  >>> q = quantize(w, "nf4")
  >>> q["codes"].shape, q["codes"].dtype, q["scale"].shape, q["scale"].dtype
  ((2, 64), dtype('uint8'), (2, 2), dtype('float32'))
  >>> int(q["codes"][0, 0])  # w[0, 0] = -1, w[0, 1] ~ -0.99: codes 0 and 0 -> byte 0x00
  0
  >>> bool(np.array_equal(np.asarray(dequantize(q, "nf4")), dequantize_np(q, "nf4")))
  True
  >>> quantized_shapes((4, 2, 128), "int8")["scale"]
  ShapeDtypeStruct(shape=(4, 2, 2), dtype=float32)
  >>> bytes_per_param("int8"), bytes_per_param("nf4")
  (1.0625, 0.5625)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

__all__ = ["dequantize", "quantize"]

KINDS = ("int8", "nf4")
BLOCK = 64  # elements a scale covers, along the last axis (bitsandbytes' default blocksize)

# NormalFloat4: bitsandbytes-foundation/bitsandbytes, bitsandbytes/functional.py,
# get_4bit_type("nf4") (the same table as bitsandbytes/backends/utils.py _NF4_QUANT_TABLE
# and csrc/kernels.cu), generated there by create_normal_map(offset=0.9677083): the
# quantiles of N(0, 1) normalized to [-1, 1], sorted, with an exact 0. QLoRA,
# https://arxiv.org/abs/2305.14314. Stored as float32, as bitsandbytes holds them.
NF4 = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)
NF4.flags.writeable = False


def _nf4_bounds() -> np.ndarray:
    """float32 thresholds t with ``x <= t[i]`` exactly when x (float32) is no farther from
    NF4[i] than from NF4[i + 1]: nearest code, ties to the lower index (as bitsandbytes'
    bucketize on the midpoints). The midpoints are exact in float64 (two float32 values
    of exponents -4..0 sum within 53 bits); rounding each down to float32 keeps the
    comparison exact for float32 x, which float32 midpoints rounded to nearest would not."""
    c = NF4.astype(np.float64)
    mid = (c[:-1] + c[1:]) / 2
    t = mid.astype(np.float32)
    return np.where(t > mid, np.nextafter(t, np.float32(-np.inf)), t)


_NF4_BOUNDS = _nf4_bounds()

# int8 decodes as codes * float32(1/127), not codes / 127: XLA rewrites a division by a
# constant into a product with its reciprocal (jit or not), so numpy's true division
# would differ from the device's in the last bit for some codes. Written as the product
# on both sides, every backend rounds the same two products the same way.
_INV127 = np.float32(1) / np.float32(127)


def _check_kind(kind: str, who: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"{who}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")


def _blocks(shape: tuple[int, ...], kind: str, block: int, who: str) -> int:
    """The number of scale blocks of a weight's last axis; a one-line ValueError for a kind,
    block or shape that cannot be quantized, before any work."""
    _check_kind(kind, who)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"{who}: block must be a positive integer, got {block!r}")
    if kind == "nf4" and block % 2:
        # two codes a byte: an odd block would pack codes of two blocks into one byte
        raise ValueError(
            f"{who}: nf4 packs two codes a byte, so its block must be even, got {block}"
        )
    if len(shape) < 1 or shape[-1] % block:
        raise ValueError(
            f"{who}: a weight of shape {tuple(shape)} cannot be quantized in blocks of {block}: "
            f"its last axis must be a multiple of {block}"
        )
    return shape[-1] // block


def quantize(w: np.ndarray, kind: str, block: int = BLOCK) -> dict[str, np.ndarray]:
    """``{"codes", "scale"}`` of ``w`` (float, any leading dims, last axis a multiple of
    ``block``): numpy, on the host, where the loader holds the slice it has read, so the
    full-precision weight never reaches the device.

    ``scale`` (float32, ``(*lead, in // block)``) is each block's absmax; a block of zeros
    has scale 0 and the codes of 0 (int8: 0; nf4: index 7, the codebook's 0.0), so it
    dequantizes to 0, not NaN. int8: ``rint(w / scale * 127)`` (half to even), int8.
    nf4: the index of the codebook value nearest to ``w / scale`` (ties: the lower index),
    packed two a byte along the last axis, element 2k in the high nibble and 2k + 1 in the
    low one (bitsandbytes' order): uint8 ``(*lead, in // 2)``. Computed in float32."""
    w = np.asarray(w, dtype=np.float32)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"quantize: a weight of shape {w.shape} holds a NaN or an infinity")
    return _quantize(np, w, kind, block)


def quantize_traced(w: jax.Array, kind: str, block: int = BLOCK) -> dict[str, jax.Array]:
    """:func:`quantize` in JAX, for a fresh model's init under ``jit`` (a checkpoint's base
    is quantized on the host as it is read); the same operations, so the same codes."""
    return _quantize(jnp, w.astype(jnp.float32), kind, block)


def _quantize(xp: Any, w: Any, kind: str, block: int) -> dict[str, Any]:
    """:func:`quantize`'s arithmetic in numpy or ``jax.numpy`` (``xp``)."""
    nb = _blocks(tuple(w.shape), kind, block, "quantize")
    lead = w.shape[:-1]
    wb = w.reshape(*lead, nb, block)
    scale = xp.max(xp.abs(wb), axis=-1, initial=np.float32(0))
    x = wb / xp.where(scale == 0, np.float32(1), scale)[..., None]  # |x| <= 1
    if kind == "int8":
        codes = xp.clip(xp.rint(x * np.float32(127)), -127, 127).astype(np.int8)
        return {"codes": codes.reshape(w.shape), "scale": scale}
    bounds = xp.asarray(_NF4_BOUNDS)
    idx = xp.searchsorted(bounds, x, side="left").astype(np.uint8).reshape(w.shape)
    packed = (idx[..., 0::2] << np.uint8(4)) | idx[..., 1::2]
    return {"codes": packed.astype(np.uint8), "scale": scale}


def dequantize(
    q: Mapping[str, ArrayLike], kind: str, dtype: DTypeLike = jnp.float32, block: int = BLOCK
) -> jax.Array:
    """The weight ``q`` stands for, in ``dtype``: JAX, traced in the jitted step, per layer
    in the forward pass, so only one layer's weight is ever held at full precision. Any
    leading dims (a stacked ``(L, out, in)`` weight or one layer's ``(out, in)``). The
    float32 values equal :func:`dequantize_np`'s bit for bit; then cast to ``dtype``."""
    _check_kind(kind, "dequantize")
    codes = jnp.asarray(q["codes"])
    scale = jnp.asarray(q["scale"], jnp.float32)
    if kind == "int8":
        values = codes.astype(jnp.float32) * _INV127
    else:
        nibbles = jnp.stack([codes >> 4, codes & 0xF], axis=-1).astype(jnp.int32)
        values = jnp.asarray(NF4)[nibbles.reshape(*codes.shape[:-1], codes.shape[-1] * 2)]
    shape = values.shape
    nb = _blocks(shape, kind, block, "dequantize")
    _check_scale(shape, scale.shape, nb, block)
    out = values.reshape(*shape[:-1], nb, block) * scale[..., None]
    return out.reshape(shape).astype(dtype)


def dequantize_np(q: Mapping[str, ArrayLike], kind: str, block: int = BLOCK) -> np.ndarray:
    """float32 numpy reference of :func:`dequantize`: the same operations in the same order,
    for tests and for host-side checks of a loaded weight."""
    _check_kind(kind, "dequantize_np")
    codes = np.asarray(q["codes"])
    scale = np.asarray(q["scale"], np.float32)
    if kind == "int8":
        values = codes.astype(np.float32) * _INV127
    else:
        nibbles = np.stack([codes >> 4, codes & 0xF], axis=-1)
        values = NF4[nibbles.reshape(*codes.shape[:-1], codes.shape[-1] * 2)]
    shape = values.shape
    nb = _blocks(shape, kind, block, "dequantize_np")
    _check_scale(shape, scale.shape, nb, block)
    out = values.reshape(*shape[:-1], nb, block) * scale[..., None]
    return out.reshape(shape)


def _check_scale(shape: tuple[int, ...], scale: tuple[int, ...], nb: int, block: int) -> None:
    """Codes and scale of different weights (or a wrong ``block``) fail here, by name,
    rather than as a broadcast error deep in the step."""
    if tuple(scale) != (*shape[:-1], nb):
        raise ValueError(
            f"dequantize: scale of shape {tuple(scale)} does not fit a weight of shape "
            f"{tuple(shape)} in blocks of {block}: "
            f"expected {(*shape[:-1], nb)}"
        )


def bytes_per_param(kind: str, block: int = BLOCK) -> float:
    """Stored bytes per weight element, scales included (int8: 1 + 4/block, nf4:
    0.5 + 4/block), for the memory accounting of a quantized frozen base."""
    _blocks((block,), kind, block, "bytes_per_param")
    return (1.0 if kind == "int8" else 0.5) + 4 / block


def quantized_shapes(
    shape: tuple[int, ...], kind: str, block: int = BLOCK
) -> dict[str, jax.ShapeDtypeStruct]:
    """What :func:`quantize` returns for a weight of ``shape``, without data: the engine
    plans shardings and memory from shapes before any weight is read."""
    shape = tuple(int(d) for d in shape)
    nb = _blocks(shape, kind, block, "quantized_shapes")
    lead = shape[:-1]
    if kind == "int8":
        codes = jax.ShapeDtypeStruct(shape, jnp.int8)
    else:
        codes = jax.ShapeDtypeStruct((*lead, shape[-1] // 2), jnp.uint8)
    return {"codes": codes, "scale": jax.ShapeDtypeStruct((*lead, nb), jnp.float32)}
