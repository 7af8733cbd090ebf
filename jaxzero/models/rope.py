"""Rotary position embeddings as ``transformers`` computes them (Llama, Qwen2, Mistral,
Gemma): the inverse frequencies with ``rope_theta`` and ``linear`` or ``llama3``
scaling, and the half-split ``rotate_half`` rotation. Training and cached sampling both
use them."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")


def rope_frequencies(cfg: Any) -> np.ndarray:
    """Inverse frequencies (``rotary_dim / 2``, fp32) of ``cfg.rope_theta`` and
    ``cfg.rope_scaling``, computed as ``transformers`` does: ``rotary_dim`` is the
    head's dimension, or its rotated part under a ``partial_rotary_factor`` (Qwen3.5)."""
    return inverse_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)


def inverse_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> np.ndarray:
    """Inverse frequencies (``dim / 2``, fp32) of base ``theta``, scaled by ``scaling``
    (``transformers``' dict, None: default): Gemma 3's local layers have a base of
    their own."""
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / np.float32(theta) ** exponent).astype(np.float32)
    rs = scaling or {}
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv = inv / np.float32(rs["factor"])
    elif kind == "llama3":  # Llama 3.1: low frequencies slowed by factor, a smooth band between
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > old / low, inv / np.float32(factor), inv)
        smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rotary(positions_BxS: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``cos``, ``sin`` (``B x S x head_dim``, fp32) for the positions."""
    freqs = positions_BxS[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x_BxSxHxK: jax.Array, cos_BxSxR: jax.Array, sin_BxSxR: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin``, ``rotate_half`` swapping the two halves; a
    table narrower than the head (``R < K``: a ``partial_rotary_factor``, Qwen3.5)
    rotates the head's first ``R`` dims so and passes the rest unchanged, as
    ``transformers``' ``apply_rotary_pos_emb`` does."""
    r = cos_BxSxR.shape[-1]
    x_rot, x_pass = x_BxSxHxK[..., :r], x_BxSxHxK[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos = cos_BxSxR[:, :, None].astype(x_BxSxHxK.dtype)
    sin = sin_BxSxR[:, :, None].astype(x_BxSxHxK.dtype)
    out = x_rot * cos + rotated * sin
    return out if r == x_BxSxHxK.shape[-1] else jnp.concatenate([out, x_pass], axis=-1)
