"""The reference GPT: a pre-LN decoder in Flax Linen, blocks stacked and scanned.

The model knows one thing about sharding: it passes each layer's params through
:func:`jaxzero.use_params` right where the layer uses them. Blocks are stacked
along a leading layer dim and run with ``lax.scan``, so stage 3 gathers one block
at a time and the compiled program has one block body whatever the depth.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.hooks import remat_layer, use_params
from jaxzero.models.common import (  # noqa: F401 - attention_impl: part of this API
    ATTENTION,
    REMAT_POLICIES,
    KVCache,
    LayerCache,
    attention_impl,
    causal_attention,
    new_cache,
    positions,
    token_loss,
)
from jaxzero.models.protocol import ReferenceModel


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``d_ff`` defaults to ``4 * d_model``."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None
    tie_embeddings: bool = True
    remat: str = "none"  # activation checkpointing of each block: none | full | dots
    attention: str = "auto"  # auto (cuDNN's fused kernel on GPUs in bf16) | xla | cudnn

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat {self.remat!r}: use one of {list(REMAT_POLICIES)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"unknown attention {self.attention!r}: use one of {ATTENTION}")

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    With a ``cache`` (sampling) the tokens attend to it instead, and the block returns
    it with their keys and values written in; in training it is None throughout."""

    cfg: GPTConfig

    @nn.compact
    def __call__(
        self,
        x_BxSxD: jax.Array,
        segment_ids_BxS: jax.Array | None = None,
        cache: LayerCache | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        cfg, dt = self.cfg, x_BxSxD.dtype
        b, s, d = x_BxSxD.shape
        h, dh = cfg.n_heads, d // cfg.n_heads
        init = nn.initializers.normal(0.02)
        out_init = nn.initializers.normal(0.02 / np.sqrt(2 * cfg.n_layers))
        y = nn.LayerNorm(dtype=dt, name="ln1")(x_BxSxD)
        # no qkv bias: the key bias has no gradient (softmax ignores it), only noise
        qkv_BxSx3D = nn.Dense(3 * d, dtype=dt, use_bias=False, kernel_init=init, name="qkv")(y)
        q, k, v = jnp.split(qkv_BxSx3D.reshape(b, s, 3 * h, dh), 3, axis=2)
        if cache is None:
            att_BxSxHxK = causal_attention(q, k, v, cfg.attention, segment_ids_BxS)
        else:
            att_BxSxHxK, cache = cache.attend(q, k, v)
        x_BxSxD = x_BxSxD + nn.Dense(d, dtype=dt, kernel_init=out_init, name="proj")(
            att_BxSxHxK.reshape(b, s, d)
        )
        y = nn.LayerNorm(dtype=dt, name="ln2")(x_BxSxD)
        y_BxSxF = nn.gelu(nn.Dense(cfg.ff, dtype=dt, kernel_init=init, name="fc")(y))
        return x_BxSxD + nn.Dense(d, dtype=dt, kernel_init=out_init, name="out")(y_BxSxF), cache


class GPT(ReferenceModel):
    """Token + position embeddings, ``n_layers`` scanned blocks, final LN, LM head.

    Params (a plain nested dict)::

        wte          V x D   token embedding (also the head when tied)
        wpe          S x D   position embedding
        blocks/...   L x ... one stacked leaf per block param (ln1, qkv, proj, ln2, fc, out)
        ln_f/scale, ln_f/bias      D
        head/kernel  D x V   (untied only)

    The :class:`~jaxzero.models.Model` protocol: ``engine``, ``num_params``,
    ``flops_per_token`` and ``generate`` come from :class:`ReferenceModel`.

    Example:
      >>> model = GPT(GPTConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2))
      >>> params = model.init(jax.random.key(0))
      >>> model.apply(params, jnp.zeros((1, 8), jnp.int32)).shape
      (1, 8, 256)
    """

    STACKED = r"^blocks/"

    def __init__(self, config: GPTConfig):
        self.config = config
        self.block = Block(config)

    def init(self, rng: jax.Array) -> dict[str, Any]:
        """Fresh fp32 params (pure: ``Engine.init_from`` runs it sharded from birth).

        Compiled: run eagerly, op by op, even the 2-layer test GPT took 8 s, against 2 s
        to compile it (once per config)."""
        return _init(self.config, rng)

    def apply(
        self,
        params: dict[str, Any],
        tokens_BxS: jax.Array,
        segment_ids_BxS: jax.Array | None = None,
    ) -> jax.Array:
        """Logits (fp32) for every position. With ``segment_ids`` (packed documents)
        positions restart at each document and attention stays inside it."""
        c = self.config
        s = tokens_BxS.shape[1]
        if s > c.seq_len:
            raise ValueError(f"sequence of {s} tokens is longer than seq_len {c.seq_len}")
        emb = use_params({"wte": params["wte"], "wpe": params["wpe"]})
        x_BxSxD = emb["wte"][tokens_BxS] + emb["wpe"][positions(tokens_BxS, segment_ids_BxS)]

        def layer(x, p):
            return self.block.apply({"params": use_params(p)}, x, segment_ids_BxS)[0], None

        layer = remat_layer(layer, REMAT_POLICIES[c.remat])  # stage 3: re-gather in backward
        x_BxSxD, _ = jax.lax.scan(layer, x_BxSxD, params["blocks"])
        return self._logits(params, emb["wte"], x_BxSxD)

    def _logits(self, params: dict[str, Any], wte: jax.Array, x_BxSxD: Any) -> jax.Array:
        """Final LN and the LM head (tied: ``wte``), fp32 logits."""
        ln_f = use_params(params["ln_f"])
        x_BxSxD = nn.LayerNorm(dtype=x_BxSxD.dtype).apply({"params": ln_f}, x_BxSxD)
        head_DxV = wte.T if self.config.tie_embeddings else use_params(params["head"])["kernel"]
        return jnp.einsum("bsd,dv->bsv", x_BxSxD, head_DxV).astype(jnp.float32)

    def loss_fn(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
        """Next-token cross-entropy (nats per token) of ``batch["inputs"/"targets"]``;
        ``segment_ids`` and ``loss_mask`` as :func:`jaxzero.models.common.token_loss`."""
        return token_loss(self.apply(params, batch["inputs"], batch.get("segment_ids")), batch)

    def attention_shape(self) -> tuple[int, int]:
        """Attention FLOPs of :meth:`flops_per_token` (6·N + 12·L·D·S): ``(L, D)``."""
        return self.config.n_layers, self.config.d_model

    def new_cache(self, params: dict[str, Any]) -> KVCache:
        """An empty key/value cache over the ``seq_len`` window (sampling)."""
        c = self.config
        return new_cache(
            c.n_layers, c.seq_len, c.n_heads, c.d_model // c.n_heads, params["wte"].dtype
        )

    def decode(
        self,
        params: dict[str, Any],
        tokens_BxT: jax.Array,
        start: jax.Array,
        cache: KVCache,
        last: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """Logits (fp32, ``B x V``) of the token at index ``last`` of ``tokens``, which sit
        at positions ``start ..`` after the ones in ``cache``; and the cache with
        them in. The blocks are :meth:`apply`'s, so the logits are its logits."""
        pos_T = start + jnp.arange(tokens_BxT.shape[1])
        x_BxTxD = params["wte"][tokens_BxT] + params["wpe"][pos_T][None]

        def layer(x, p_and_kv):
            p, k, v = p_and_kv
            out: Any = self.block.apply({"params": p}, x, None, LayerCache(k, v, start))
            return out[0], (out[1].k, out[1].v)

        x_BxTxD, cache = jax.lax.scan(layer, x_BxTxD, (params["blocks"], *cache))
        x_Bx1xD = jax.lax.dynamic_slice_in_dim(x_BxTxD, last, 1, axis=1)
        return self._logits(params, params["wte"], x_Bx1xD)[:, 0], cache


@functools.partial(jax.jit, static_argnums=0)
def _init(c: GPTConfig, rng: jax.Array) -> dict[str, Any]:
    k_tok, k_pos, k_blocks, k_head = jax.random.split(rng, 4)
    x = jnp.zeros((1, c.seq_len, c.d_model), jnp.float32)
    blocks = jax.vmap(lambda k: Block(c).init(k, x)["params"])(
        jax.random.split(k_blocks, c.n_layers)
    )
    params = {
        "wte": 0.02 * jax.random.normal(k_tok, (c.vocab_size, c.d_model)),
        "wpe": 0.01 * jax.random.normal(k_pos, (c.seq_len, c.d_model)),
        "blocks": blocks,
        "ln_f": {"scale": jnp.ones(c.d_model), "bias": jnp.zeros(c.d_model)},
    }
    if not c.tie_embeddings:
        params["head"] = {"kernel": 0.02 * jax.random.normal(k_head, (c.d_model, c.vocab_size))}
    return params
