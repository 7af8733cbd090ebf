"""A GPT as a new user writes it: a plain pytree, a Python ``for`` over layers, no Flax.

This is the model of the performance issue: layers are a list of dicts, unrolled
by tracing, LayerNorm written by hand, GELU MLP, fp32. It knows nothing of
jaxzero, so engines train it with ``per_layer=False``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def init(
    key: jax.Array, vocab: int = 256, seq_len: int = 128, d_model: int = 256, n_layers: int = 4
) -> dict:
    """Params: ``{"wte": VxD, "wpe": SxD, "layers": [ {...} x L ], "ln_f": {...}}``."""
    d, f = d_model, 4 * d_model
    keys = iter(jax.random.split(key, 2 + 4 * n_layers))
    normal = lambda shape, std=0.02: std * jax.random.normal(next(keys), shape)
    layers = [
        {
            "ln1": {"g": jnp.ones(d), "b": jnp.zeros(d)},
            "w_qkv": normal((d, 3 * d)),  # D x 3D
            "w_o": normal((d, d), 0.02 / np.sqrt(2 * n_layers)),  # D x D
            "ln2": {"g": jnp.ones(d), "b": jnp.zeros(d)},
            "w_in": normal((d, f)),
            "b_in": jnp.zeros(f),  # D x F
            "w_out": normal((f, d), 0.02 / np.sqrt(2 * n_layers)),  # F x D
            "b_out": jnp.zeros(d),
        }
        for _ in range(n_layers)
    ]
    return {
        "wte": normal((vocab, d)),
        "wpe": normal((seq_len, d), 0.01),
        "layers": layers,
        "ln_f": {"g": jnp.ones(d), "b": jnp.zeros(d)},
    }


def layer_norm(x, p, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["g"] + p["b"]


def loss_fn(params: dict, batch: dict, n_heads: int = 4) -> jax.Array:
    tokens_BxS = batch["inputs"]
    b, s = tokens_BxS.shape
    x_BxSxD = params["wte"][tokens_BxS] + params["wpe"][:s]
    d = x_BxSxD.shape[-1]
    for p in params["layers"]:
        qkv = layer_norm(x_BxSxD, p["ln1"]) @ p["w_qkv"]
        q, k, v = jnp.split(qkv.reshape(b, s, 3 * n_heads, d // n_heads), 3, axis=2)
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
        x_BxSxD = x_BxSxD + att @ p["w_o"]
        h = jax.nn.gelu(layer_norm(x_BxSxD, p["ln2"]) @ p["w_in"] + p["b_in"])
        x_BxSxD = x_BxSxD + h @ p["w_out"] + p["b_out"]
    logits = layer_norm(x_BxSxD, params["ln_f"]) @ params["wte"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """6·N + 12·L·D·S, as for the reference GPT."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len
