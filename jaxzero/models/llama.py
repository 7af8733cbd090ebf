"""The Llama family (Llama 2/3.x, Qwen2, Qwen3, Mistral) in Flax NNX, layers stacked and
scanned: one decoder, whose options are what the families differ by.

It computes what ``transformers``' ``LlamaForCausalLM`` computes, so Hugging Face
checkpoints load without any permutation (:mod:`jaxzero.hf`): RMSNorm in fp32,
rotary embeddings with the half-split ``rotate_half`` (``rope_theta``, ``llama3`` and
``linear`` scaling), SwiGLU, grouped-query attention, optional q/k/v (Qwen2) or
all-projection (Llama ``attention_bias``) biases, tied or untied embeddings; Qwen3's
``q_norm``/``k_norm`` (an RMSNorm over each head's ``head_dim`` of q and k, after the
projections and before rope); sliding-window attention on every layer (Mistral) or
on some (Qwen2/Qwen3 ``layer_types``), the window of each layer passed as data
scanned with the layers. Each weight keeps the Hugging Face name and orientation
(``q_proj/weight`` is ``out x in``), so reading or writing a checkpoint is a rename,
never a transpose.

The model knows one thing about sharding: each layer goes through
:func:`jaxzero.nnx.use` right where it runs. The decoder layers are one stacked
module (a leading layer dim on every param) run by ``lax.scan``, so stage 3 gathers
one layer at a time and the program has one layer body whatever the depth.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxzero import loss as loss_lib
from jaxzero.hooks import remat_layer, use_params
from jaxzero.models.common import (
    ATTENTION,
    FULL,
    REMAT_POLICIES,
    KVCache,
    LayerCache,
    causal_attention,
    new_cache,
    positions,
    token_loss,
)
from jaxzero.models.lora import QUANTIZED, LoraConfig, check_rank
from jaxzero.models.lora import trainable as lora_trainable
from jaxzero.models.protocol import ReferenceModel
from jaxzero.models.quant import dequantize, quantize_traced
from jaxzero.models.rope import ROPE_TYPES, apply_rotary, rope_frequencies, rotary
from jaxzero.nnx import bind, split, use

SLIDING, FULL_ATTENTION = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model, in ``transformers``' names (``config.json``'s fields).

    ``qkv_bias`` puts biases on q/k/v (Qwen2), ``o_bias`` on the output projection
    (with ``qkv_bias``: Llama's ``attention_bias``). ``rope_scaling`` is
    ``transformers``' dict (``{"rope_type": "llama3", "factor": 8.0, ...}``).
    ``qk_norm``: Qwen3's RMSNorm over each head of q and k (``q_norm``, ``k_norm``).
    ``sliding_window``: each windowed layer's token attends to the ``sliding_window``
    latest tokens, itself included (``transformers``' convention); ``layer_types``
    (``"full_attention"`` or ``"sliding_attention"`` a layer) says which layers are
    windowed, None: all of them (Mistral).
    ``seq_len`` is the training and sampling window, not a limit of the weights.
    """

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None: as many as query heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    initializer_range: float = 0.02
    seq_len: int = 128
    remat: str = "none"  # activation checkpointing of each layer: none | full | dots
    attention: str = "auto"  # auto (cuDNN's fused kernel on GPUs in bf16) | xla | cudnn

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "seq_len",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {v!r}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}: give head_dim"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads {self.kv_heads}"
            )
        if self.head_size % 2:
            raise ValueError(f"head_dim {self.head_size} must be even for rotary embeddings")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds max_position_embeddings "
                f"{self.max_position_embeddings}"
            )
        rope = (self.rope_scaling or {}).get("rope_type", "default")
        if rope not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope!r} is not supported: use one of {ROPE_TYPES}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat {self.remat!r}: use one of {list(REMAT_POLICIES)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"unknown attention {self.attention!r}: use one of {ATTENTION}")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {w!r}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # hashable
            types = self.layer_types or ()
            if len(types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(types)} entries for {self.num_hidden_layers} layers"
                )
            bad = [t for t in types if t not in (FULL_ATTENTION, SLIDING)]
            if bad:
                raise ValueError(
                    f"layer type {bad[0]!r} is not supported: use {FULL_ATTENTION} or {SLIDING}"
                )
            if SLIDING in types and w is None:
                raise ValueError(f"layer_types has {SLIDING} layers but no sliding_window")

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def windows(self) -> tuple[int, ...] | None:
        """Each layer's attention window (:data:`~jaxzero.models.common.FULL`: none), or
        None when no layer has one."""
        if self.sliding_window is None:
            return None
        types = self.layer_types or (SLIDING,) * self.num_hidden_layers
        out = tuple(self.sliding_window if t == SLIDING else FULL for t in types)
        return out if any(w != FULL for w in out) else None


# --------------------------------------------------------------------------- modules


class Linear(nnx.Module):
    """``x @ weight.T + bias`` with ``weight`` stored ``out x in``, as PyTorch stores it;
    with a LoRA ``rank``, plus ``scale * (x @ lora_A.T) @ lora_B.T`` (:mod:`jaxzero.models.lora`:
    A ``r x in`` drawn as peft draws it, B ``out x r`` at zero)."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        bias: bool,
        std: float,
        rngs: nnx.Rngs,
        rank: int = 0,
        scale: float = 1.0,
        quant: str | None = None,
        dropout: float = 0.0,
    ):
        w = std * jax.random.normal(rngs.params(), (d_out, d_in))
        self.quant = quant
        if quant is None:
            self.weight = nnx.Param(w)
        else:  # QLoRA's frozen base: codes and block scales (jaxzero.models.quant)
            q = quantize_traced(w, quant)  # a fresh model; a checkpoint's: hf.load
            self.weight_codes, self.weight_scale = nnx.Param(q["codes"]), nnx.Param(q["scale"])
        self.bias = nnx.Param(jnp.zeros(d_out)) if bias else None
        bound = 1.0 / d_in**0.5
        draw = lambda: jax.random.uniform(rngs.params(), (rank, d_in), minval=-bound, maxval=bound)
        self.lora_A = nnx.Param(draw()) if rank else None
        self.lora_B = nnx.Param(jnp.zeros((d_out, rank))) if rank else None
        self.scale, self.dropout = scale, dropout

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """``rng``: the loss's key (a mask per row), for dropout on the adapter's input."""
        if self.quant is None:
            w = self.weight[...].astype(x.dtype)
        else:  # dequantized here, one layer at a time (scan over layers)
            q = {"codes": self.weight_codes[...], "scale": self.weight_scale[...]}
            w = dequantize(q, self.quant, x.dtype)
        y = jnp.einsum("...i,oi->...o", x, w)
        if self.lora_A is not None and self.lora_B is not None:
            xa = loss_lib.dropout(x, self.dropout, rng)
            a = jnp.einsum("...i,ri->...r", xa, self.lora_A[...].astype(x.dtype))
            y = y + self.scale * jnp.einsum("...r,or->...o", a, self.lora_B[...].astype(x.dtype))
        return y if self.bias is None else y + self.bias[...].astype(x.dtype)


def _linear(
    cfg: LlamaConfig,
    lora: LoraConfig | None,
    name: str,
    d_in: int,
    d_out: int,
    bias: bool,
    rngs: nnx.Rngs,
) -> Linear:
    """The projection ``name`` (``self_attn.q_proj``), with adapters if LoRA targets it."""
    std = cfg.initializer_range
    if lora is None or not lora.matches(name):
        return Linear(d_in, d_out, bias, std, rngs)
    check_rank(lora, name, d_in, d_out)
    return Linear(
        d_in, d_out, bias, std, rngs, lora.rank, lora.scale, lora.base_dtype, lora.dropout
    )


def _keys(rng: jax.Array | None, n: int) -> list[jax.Array | None]:
    """``n`` keys of the loss's ``rng`` (each a mask per row), or ``n`` Nones."""
    return [None if rng is None else jax.random.fold_in(rng, i) for i in range(n)]


# every linear module of a decoder layer, by the name peft and transformers give it
LINEARS = tuple(f"self_attn.{p}_proj" for p in "qkvo") + tuple(
    f"mlp.{p}_proj" for p in ("gate", "up", "down")
)


class RMSNorm(nnx.Module):
    """``weight * (x / rms(x))``, the statistics in fp32, the result in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float):
        self.weight, self.eps = nnx.Param(jnp.ones(dim)), eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        d, h, kv, k = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.head_size
        self.q_proj = _linear(cfg, lora, "self_attn.q_proj", d, h * k, cfg.qkv_bias, rngs)
        self.k_proj = _linear(cfg, lora, "self_attn.k_proj", d, kv * k, cfg.qkv_bias, rngs)
        self.v_proj = _linear(cfg, lora, "self_attn.v_proj", d, kv * k, cfg.qkv_bias, rngs)
        self.o_proj = _linear(cfg, lora, "self_attn.o_proj", h * k, d, cfg.o_bias, rngs)
        # Qwen3: over each head's head_dim, the model's eps
        self.q_norm = RMSNorm(k, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.heads, self.kv_heads, self.head_dim, self.impl = h, kv, k, cfg.attention
        self.windows = cfg.windows or ()  # the values a layer's window takes (static)

    def __call__(
        self,
        x_BxSxD: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids_BxS: jax.Array | None = None,
        cache: LayerCache | None = None,
        rng: jax.Array | None = None,
        window: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """With a ``cache`` (sampling) the tokens attend to it instead, and it comes
        back with their (rotated) keys and values written in. ``window``: this layer's
        sliding window (an int32 scalar; None: full causal attention)."""
        b, s, _ = x_BxSxD.shape
        r = _keys(rng, 4)
        q = self.q_proj(x_BxSxD, r[0]).reshape(b, s, self.heads, self.head_dim)
        k = self.k_proj(x_BxSxD, r[1]).reshape(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x_BxSxD, r[2]).reshape(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # before rope, as Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # grouped-query: the kv heads are shared
        if cache is None:
            out_BxSxHxK = causal_attention(
                q, k, v, self.impl, segment_ids_BxS, window, self.windows
            )
        else:
            out_BxSxHxK, cache = cache.attend(q, k, v, window)
        return self.o_proj(out_BxSxHxK.reshape(b, s, self.heads * self.head_dim), r[3]), cache


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = _linear(cfg, lora, "mlp.gate_proj", d, f, bias, rngs)
        self.up_proj = _linear(cfg, lora, "mlp.up_proj", d, f, bias, rngs)
        self.down_proj = _linear(cfg, lora, "mlp.down_proj", f, d, bias, rngs)

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        r = _keys(rng, 3)
        return self.down_proj(jax.nn.silu(self.gate_proj(x, r[0])) * self.up_proj(x, r[1]), r[2])


class DecoderLayer(nnx.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rngs, lora)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, rngs, lora)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids_BxS: jax.Array | None = None,
        cache: LayerCache | None = None,
        rng: jax.Array | None = None,
        window: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        r = _keys(rng, 2)
        h = self.input_layernorm(x)
        y, cache = self.self_attn(h, cos, sin, segment_ids_BxS, cache, r[0], window)
        x = x + y
        return x + self.mlp(self.post_attention_layernorm(x), r[1]), cache


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, std: float, rngs: nnx.Rngs):
        self.weight = nnx.Param(std * jax.random.normal(rngs.params(), (vocab, dim)))


class LlamaModule(nnx.Module):
    """The whole causal LM as one NNX module; ``layers`` holds every decoder layer's
    params stacked on a leading dim (made with ``nnx.vmap``, run with ``lax.scan``);
    ``lora`` adds adapters to the projections it targets (:mod:`jaxzero.models.lora`)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        self.cfg = cfg
        if lora is not None:
            lora.targets_in([*LINEARS, "lm_head"])  # refuses targets that match nothing
        std = cfg.initializer_range
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, std, rngs)

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, rngs, lora)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Embedding(cfg.vocab_size, cfg.hidden_size, std, rngs)
        )

    def __call__(
        self,
        tokens_BxS: jax.Array,
        segment_ids_BxS: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        """Logits (fp32) of every position; positions count from 0 in each row, or in
        each document of packed rows (``segment_ids``, whose attention stays inside
        each document). The activations take the params' dtype (bf16 in mixed
        precision). ``rng``: the loss's key, for LoRA's dropout (None: none)."""
        cfg = self.cfg
        embed = use(self.embed_tokens).weight[...]
        x_BxSxD = embed[tokens_BxS]
        cos, sin = rotary(positions(tokens_BxS, segment_ids_BxS), rope_frequencies(cfg))

        # flax types split's result as variadic: two filters give exactly two states
        graphdef, stacked, rest = nnx.split(self.layers, nnx.Param, ...)  # type: ignore[misc]

        def layer(x, params_index_window):
            params, i, *window = params_index_window
            layer = nnx.merge(graphdef, use_params(params), rest)
            key = None if rng is None else jax.random.fold_in(rng, i)  # a key a layer
            return layer(x, cos, sin, segment_ids_BxS, None, key, *window)[0], None

        layer = remat_layer(layer, REMAT_POLICIES[cfg.remat])  # stage 3: re-gather in backward
        index = jnp.arange(cfg.num_hidden_layers)
        x_BxSxD, _ = jax.lax.scan(layer, x_BxSxD, (stacked, index, *self._windows()))
        return self._logits(embed, x_BxSxD)

    def _windows(self) -> tuple[jax.Array, ...]:
        """Each layer's window as data scanned with the layers (one int32 a layer), or
        nothing when no layer has one (the layers then run plain causal attention)."""
        windows = self.cfg.windows
        return () if windows is None else (jnp.asarray(windows, jnp.int32),)

    def _logits(self, embed_VxD: jax.Array, x_BxSxD: jax.Array) -> jax.Array:
        """Final norm and the LM head (tied: the embedding), fp32 logits."""
        x_BxSxD = use(self.norm)(x_BxSxD)
        head_VxD = embed_VxD if self.lm_head is None else use(self.lm_head).weight[...]
        return jnp.einsum("bsd,vd->bsv", x_BxSxD, head_VxD.astype(x_BxSxD.dtype)).astype(
            jnp.float32
        )

    def decode(
        self, tokens_BxT: jax.Array, start: jax.Array, cache: KVCache, last: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Logits (fp32, ``B x V``) of the token at index ``last`` of ``tokens``, which sit
        at positions ``start ..`` (rotary angles included) after the ones in ``cache``;
        and the cache with them in. The layers are :meth:`__call__`'s."""
        embed = self.embed_tokens.weight[...]
        pos_BxT = jnp.broadcast_to(start + jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
        cos, sin = rotary(pos_BxT, rope_frequencies(self.cfg))
        graphdef, stacked, rest = nnx.split(self.layers, nnx.Param, ...)  # type: ignore[misc]

        def layer(x, params_kv_window):
            params, k, v, *window = params_kv_window
            kv = LayerCache(k, v, start)
            x, kv = nnx.merge(graphdef, params, rest)(x, cos, sin, None, kv, None, *window)
            return x, (kv.k, kv.v)

        xs = (stacked, *cache, *self._windows())
        x_BxTxD, cache = jax.lax.scan(layer, embed[tokens_BxT], xs)
        x_Bx1xD = jax.lax.dynamic_slice_in_dim(x_BxTxD, last, 1, axis=1)
        return self._logits(embed, x_Bx1xD)[:, 0], cache


# --------------------------------------------------------------------------- protocol


class Llama(ReferenceModel):
    """The :class:`~jaxzero.models.Model` protocol over :class:`LlamaModule` (``engine``,
    ``num_params``, ``flops_per_token`` and ``generate`` from :class:`ReferenceModel`).

    Params are a plain nested dict in Hugging Face's names::

        embed_tokens/weight      V x D
        layers/self_attn/{q,k,v,o}_proj/{weight,bias}   L x out x in, L x out
        layers/self_attn/{q,k}_norm/weight             L x head_dim  (qk_norm only)
        layers/mlp/{gate,up,down}_proj/weight          L x out x in
        layers/{input,post_attention}_layernorm/weight L x D
        norm/weight              D
        lm_head/weight           V x D   (untied only)

    Example:
      >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
      ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      ...                   seq_len=8)
      >>> model = Llama(cfg)
      >>> params = model.init(jax.random.key(0))
      >>> model.apply(params, jnp.zeros((1, 8), jnp.int32)).shape
      (1, 8, 64)
    """

    STACKED = r"^layers/"
    # the Hugging Face directory and config.json it came from (jaxzero.hf.model, or a
    # run's model.hf_config): hf.save writes that architecture and copies its files
    hf_dir: Path | None = None
    hf_config: dict[str, Any] | None = None

    def __init__(self, config: LlamaConfig, lora: LoraConfig | None = None):
        self.config, self.lora = config, lora
        abstract = nnx.eval_shape(lambda: LlamaModule(config, nnx.Rngs(0), lora))
        self.graphdef, _, self._rest = split(abstract)
        self._template = nnx.state(abstract, nnx.Param)

    def engine(self, optimizer: Any, **kwargs: Any) -> Any:
        """:meth:`ReferenceModel.engine`; with LoRA, only the adapters train (the base is
        frozen: ``trainable`` defaults to :func:`jaxzero.models.lora.trainable`)."""
        if self.lora is not None:
            kwargs.setdefault("trainable", lora_trainable)
            if self.lora.dropout:  # the key the loss draws each row's mask from
                kwargs.setdefault("loss_takes_rng", True)
            if self.lora.base_dtype is not None:  # whole rows: a block never straddles shards
                kwargs["rules"] = (*kwargs.get("rules", ()), (QUANTIZED, 1))
        return super().engine(optimizer, **kwargs)

    def module(self, params: Any) -> LlamaModule:
        """The NNX module holding ``params`` (a nested dict as :meth:`init` returns)."""
        return bind(self.graphdef, self._template, params, self._rest)

    def init(self, rng: jax.Array) -> dict[str, Any]:
        """Fresh fp32 params (pure: ``Engine.init_from`` runs it sharded from birth)."""
        return split(LlamaModule(self.config, nnx.Rngs(rng), self.lora))[1]

    def apply(
        self,
        params: dict[str, Any],
        tokens_BxS: jax.Array,
        segment_ids_BxS: jax.Array | None = None,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        """Logits (fp32) for every position, computed in the params' dtype; ``rng`` (the
        loss's key): LoRA's dropout, when the adapters have some."""
        s = tokens_BxS.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {s} tokens is longer than max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        return self.module(params)(tokens_BxS, segment_ids_BxS, rng)

    def loss_fn(
        self, params: dict[str, Any], batch: dict[str, jax.Array], rng: jax.Array | None = None
    ) -> Any:
        """Next-token cross-entropy (nats per token) of ``batch["inputs"/"targets"]``;
        ``segment_ids`` and ``loss_mask`` as :func:`jaxzero.models.common.token_loss`;
        ``rng``: the engine's key for LoRA's dropout (:attr:`LoraConfig.dropout`)."""
        logits = self.apply(params, batch["inputs"], batch.get("segment_ids"), rng)
        return token_loss(logits, batch)

    def attention_shape(self) -> tuple[int, int]:
        """``(layers, heads x head_dim)``: attention's FLOPs (:meth:`flops_per_token`)."""
        c = self.config
        return c.num_hidden_layers, c.num_attention_heads * c.head_size

    def lookup_params(self) -> int:
        """An untied input embedding is a lookup, not a matmul (tied: it is the head)."""
        c = self.config
        return 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size

    def new_cache(self, params: dict[str, Any]) -> KVCache:
        """An empty key/value cache over the ``seq_len`` window (sampling), grouped-query:
        one slot per key/value head, not per query head."""
        c = self.config
        dtype = params["embed_tokens"]["weight"].dtype
        return new_cache(c.num_hidden_layers, c.seq_len, c.kv_heads, c.head_size, dtype)

    def decode(self, params: dict[str, Any], *step: Any) -> tuple[jax.Array, KVCache]:
        """One step of cached sampling with these params (:meth:`LlamaModule.decode`)."""
        return self.module(params).decode(*step)
