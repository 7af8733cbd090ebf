"""The Llama family (Llama 2/3.x, Qwen2, Qwen3, Mistral, SmolLM3, Gemma 2, Gemma 3 text,
Qwen3.5 text) in Flax NNX, layers stacked and scanned: one decoder, whose options are
what the families differ by (the layers: :mod:`jaxzero.models.llama_layers`).

It computes what ``transformers``' ``LlamaForCausalLM`` computes, so Hugging Face
checkpoints load without any permutation (:mod:`jaxzero.hf`): RMSNorm in fp32,
rotary embeddings with the half-split ``rotate_half`` (``rope_theta``, ``llama3`` and
``linear`` scaling), SwiGLU, grouped-query attention, optional q/k/v (Qwen2) or
all-projection (Llama ``attention_bias``) biases, tied or untied embeddings; Qwen3's
``q_norm``/``k_norm`` (an RMSNorm over each head's ``head_dim`` of q and k, after the
projections and before rope); sliding-window attention on every layer (Mistral) or
on some (``layer_types``); SmolLM3's layers without rope; Gemma's ``1 + weight``
RMSNorm, sandwich norms, GeGLU, embedding scale, attention scale and soft-caps,
Gemma 3's rope base of its sliding layers; Qwen3.5's Gated DeltaNet (linear
attention) layers between its full ones, its gated attention output and partial rope.
What differs between layers (the window, the rotary table) is data scanned with the
layers. Each weight keeps the Hugging Face name and orientation (``q_proj/weight`` is
``out x in``), so reading or writing a checkpoint is a rename, never a transpose.

The model knows one thing about sharding: each layer goes through
:func:`jaxzero.nnx.use` right where it runs. The decoder layers are one stacked
module (a leading layer dim on every param) run by ``lax.scan``, so stage 3 gathers
one layer at a time and the program has one layer body whatever the depth (with
Qwen3.5's two layer kinds, one body of each, two stacks scanned in groups).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxzero import tensor_parallel as tp_lib
from jaxzero.hooks import remat_layer, use_params
from jaxzero.mesh import DATA, MODEL
from jaxzero.models import deltanet, llama_tp
from jaxzero.models.common import (
    ATTENTION,
    FULL,
    REMAT_POLICIES,
    SOFTCAP_REFUSAL,
    KVCache,
    LayerCache,
    LinearCache,
    attention_impl,
    new_cache,
    positions,
    token_loss,
    tokens_loss,
)
from jaxzero.models.llama_layers import (
    ACTIVATIONS,
    CHUNK,
    DecoderLayer,
    Embedding,
    RMSNorm,
    linears,
)
from jaxzero.models.lora import QUANTIZED, LoraConfig
from jaxzero.models.lora import trainable as lora_trainable
from jaxzero.models.protocol import ReferenceModel
from jaxzero.models.rope import ROPE_TYPES, inverse_frequencies, rope_frequencies, rotary
from jaxzero.nnx import bind, split, use

SLIDING, FULL_ATTENTION = "sliding_attention", "full_attention"  # transformers' layer_types
LINEAR_ATTENTION = "linear_attention"  # Qwen3.5's Gated DeltaNet layers
ROPES = ("global", "local", "none")  # a layer's rotary embedding (LlamaConfig.ropes)
STACKS = ("layers", "linear_layers")  # the stacked layers: attention's, linear attention's


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
    ``no_rope_layers`` (SmolLM3) says which layers rotate q and k (1) and which do not
    (0); ``rope_local_base_freq`` (Gemma 3) is the rope base of the sliding layers
    (default rope, no scaling), ``rope_theta``/``rope_scaling`` the full layers'.
    Gemma's options: ``norm_offset``, ``sandwich_norms``, ``embed_scale`` (the scale in
    the activations' dtype, as ``transformers`` casts it), ``hidden_act``
    ``"gelu_pytorch_tanh"``, ``query_pre_attn_scalar`` and the two soft-caps. No fused
    attention kernel soft-caps scores: such a model runs XLA's attention
    (:meth:`attention_implementation`).
    Qwen3.5's options: ``layer_types`` with ``"linear_attention"`` layers (Gated
    DeltaNet, :class:`~jaxzero.models.llama_layers.GatedDeltaNet`, of the ``linear_*``
    shapes) in groups of ``interval - 1`` before each full-attention layer (the only
    arrangement ``transformers`` writes: ``full_attention_interval``; any other is
    refused), ``attn_output_gate`` (q_proj also gives a gate a head, the attention's
    output times its sigmoid) and ``partial_rotary_factor`` (rope on the first
    ``head_dim * factor`` dims of each head); its norms are ``norm_offset``'s.
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
    no_rope_layers: tuple[int, ...] | None = None  # SmolLM3: 1 rotary, 0 none, a layer
    rope_local_base_freq: float | None = None  # Gemma 3: the sliding layers' rope base
    hidden_act: str = "silu"  # the gated MLP's: silu (SwiGLU) | gelu_pytorch_tanh (GeGLU)
    norm_offset: bool = False  # Gemma: RMSNorm scales by 1 + weight, in fp32
    sandwich_norms: bool = False  # Gemma 2/3: the attention's and MLP's outputs normed too
    embed_scale: bool = False  # Gemma: the embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: scores times its ^-1/2 (None: head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(score / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(logit / cap)
    partial_rotary_factor: float = 1.0  # Qwen3.5: rope on this fraction of each head
    attn_output_gate: bool = False  # Qwen3.5: attention's output times sigmoid(gate)
    linear_num_key_heads: int = 16  # Qwen3.5's linear-attention layers (transformers' defaults)
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
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
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {f!r}")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(
                f"the rotary part of head_dim {self.head_size} ({self.rotary_dim}) must be "
                "even for rotary embeddings"
            )
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
            bad = [t for t in types if t not in (FULL_ATTENTION, SLIDING, LINEAR_ATTENTION)]
            if bad:
                raise ValueError(
                    f"layer type {bad[0]!r} is not supported: use {FULL_ATTENTION}, "
                    f"{SLIDING} or {LINEAR_ATTENTION}"
                )
            if SLIDING in types and w is None:
                raise ValueError(f"layer_types has {SLIDING} layers but no sliding_window")
            if LINEAR_ATTENTION in types:
                self._check_linear()
        if self.no_rope_layers is not None:
            object.__setattr__(self, "no_rope_layers", tuple(self.no_rope_layers))
            flags = self.no_rope_layers or ()
            if len(flags) != self.num_hidden_layers or any(f not in (0, 1) for f in flags):
                raise ValueError(
                    f"no_rope_layers must be {self.num_hidden_layers} flags of 0 or 1, got {flags}"
                )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported: use one of {list(ACTIVATIONS)}"
            )
        for name in (
            "rope_local_base_freq",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0):
                raise ValueError(f"LlamaConfig.{name} must be a positive number or None, got {v!r}")
        if self.attn_logit_softcapping is not None and self.attention == "cudnn":
            raise ValueError(SOFTCAP_REFUSAL)

    def _check_linear(self) -> None:
        """Linear-attention layers: in the one arrangement the decoder scans (groups of
        ``interval - 1`` linear layers and one full: no sliding layer), with no rope
        option of the other families' that ``transformers``' Qwen3.5 lacks, and positive
        shapes."""
        types = self.layer_types or ()
        k = self.interval
        group = (LINEAR_ATTENTION,) * (k - 1) + (FULL_ATTENTION,)
        if not k or len(types) % k or types != group * (len(types) // k):
            raise ValueError(
                f"layer_types {list(types)} is not supported: jaxzero's linear_attention layers "
                "come in groups of interval - 1 before each full_attention layer (Qwen3.5's "
                "full_attention_interval), the layers a multiple of the interval"
            )
        if self.no_rope_layers is not None or self.rope_local_base_freq is not None:
            raise ValueError(
                f"{LINEAR_ATTENTION} layers do not go with no_rope_layers or "
                "rope_local_base_freq (no supported architecture has both)"
            )
        for name in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {v!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )

    @property
    def interval(self) -> int:
        """Layers per group of linear-attention layers and the full one after them
        (Qwen3.5's ``full_attention_interval``); 0: no linear-attention layers."""
        types = self.layer_types or ()
        if LINEAR_ATTENTION not in types or FULL_ATTENTION not in types:
            return 0
        return types.index(FULL_ATTENTION) + 1

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The indices of the layers with (softmax) attention: the ``layers`` stack."""
        types = self.layer_types or (FULL_ATTENTION,) * self.num_hidden_layers
        return tuple(i for i, t in enumerate(types) if t != LINEAR_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """The indices of the linear-attention layers: the ``linear_layers`` stack."""
        types = self.layer_types or ()
        return tuple(i for i, t in enumerate(types) if t == LINEAR_ATTENTION)

    def stack_layers(self, stack: str) -> tuple[int, ...]:
        """The model's layer indices that the stack ``stack`` (:data:`STACKS`) holds."""
        return self.linear_attention_layers if stack == "linear_layers" else self.attention_layers

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that rope rotates: ``int(head_dim * partial_rotary_factor)``
        as ``transformers`` computes it (all of them but for Qwen3.5)."""
        return int(self.head_size * self.partial_rotary_factor)

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

    @property
    def ropes(self) -> tuple[str, ...]:
        """Each layer's rotary embedding: ``"global"`` (``rope_theta``, ``rope_scaling``),
        ``"local"`` (``rope_local_base_freq``: Gemma 3's sliding layers) or ``"none"``
        (SmolLM3's layers of ``no_rope_layers`` 0)."""
        windows = self.windows or (FULL,) * self.num_hidden_layers
        local = self.rope_local_base_freq is not None
        flags = self.no_rope_layers or (1,) * self.num_hidden_layers
        return tuple(
            "none" if not f else "local" if local and w != FULL else "global"
            for f, w in zip(flags, windows, strict=True)
        )

    def attention_implementation(
        self, dtype: Any = jnp.bfloat16, backend: str | None = None
    ) -> str:
        """The attention the layers run with inputs of ``dtype``: ``"cudnn"`` (fused) or
        ``"xla"``. Soft-capped scores (``attn_logit_softcapping``) are XLA's whatever
        ``attention`` says (``"cudnn"`` is refused): no fused kernel caps them."""
        if self.attn_logit_softcapping is not None:
            return "xla"
        return attention_impl(self.attention, dtype, backend)


class LlamaModule(nnx.Module):
    """The whole causal LM as one NNX module; ``layers`` holds every decoder layer's
    params stacked on a leading dim (made with ``nnx.vmap``, run with ``lax.scan``);
    ``lora`` adds adapters to the projections it targets (:mod:`jaxzero.models.lora`).

    With linear-attention layers (Qwen3.5) the two kinds' params differ, so each kind
    is a stack of its own: ``layers`` the attention layers, ``linear_layers`` the
    Gated DeltaNet ones; the forward scans groups of ``interval`` layers (an inner scan
    over the group's linear layers, then its attention layer), one program per kind
    whatever the depth, each layer's params gathered where it runs."""

    def __init__(
        self,
        cfg: LlamaConfig,
        rngs: nnx.Rngs,
        lora: LoraConfig | None = None,
        tp: str | None = None,
        cp: str | None = None,
    ):
        # tp: the model axis (tensor parallelism); cp: the axis Ulysses splits sequences over
        self.cfg, self.tp, self.cp = cfg, tp, cp
        if lora is not None:
            lora.targets_in([*linears(cfg), "lm_head"])  # refuses targets that match nothing
        std = cfg.initializer_range
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, std, rngs)

        def stack(n: int, linear: bool) -> DecoderLayer:
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=0, out_axes=0)
            def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
                return DecoderLayer(cfg, rngs, lora, linear, tp, cp)

            return make_layers(rngs)

        self.layers = stack(len(cfg.attention_layers), False)
        linear = cfg.linear_attention_layers
        self.linear_layers = stack(len(linear), True) if linear else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
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
        x_BxSxD = self._embed(embed, tokens_BxS)
        pos_BxS, segment_ids_BxS = self._positions(tokens_BxS, segment_ids_BxS)
        rope = self._rotary(pos_BxS)

        # flax types split's result as variadic: two filters give exactly two states
        graphdef, stacked, rest = nnx.split(self.layers, nnx.Param, ...)  # type: ignore[misc]

        def layer(x, params_index_per_layer):
            params, i, per_layer = params_index_per_layer
            layer = nnx.merge(graphdef, use_params(params), rest)
            key = None if rng is None else jax.random.fold_in(rng, i)  # a key a layer
            cos, sin, window = self._layer_inputs(rope, per_layer)
            return layer(x, cos, sin, segment_ids_BxS, None, key, window)[0], None

        # stage 3 and sequence parallelism: re-gather params and sequence in the backward
        layer = remat_layer(layer, REMAT_POLICIES[cfg.remat], self.tp is not None)
        index = jnp.asarray(cfg.attention_layers, jnp.int32)
        if self.linear_layers is None:
            x_BxSxD, _ = jax.lax.scan(layer, x_BxSxD, (stacked, index, self._per_layer()))
            return self._logits(embed, x_BxSxD)

        lin_def, lin_stacked, lin_rest = nnx.split(self.linear_layers, nnx.Param, ...)  # type: ignore[misc]

        def linear_layer(x, params_index):
            params, i = params_index
            layer = nnx.merge(lin_def, use_params(params), lin_rest)
            key = None if rng is None else jax.random.fold_in(rng, i)
            return layer(x, None, None, segment_ids_BxS, None, key)[0], None

        linear_layer = remat_layer(linear_layer, REMAT_POLICIES[cfg.remat])
        linear_index = jnp.asarray(cfg.linear_attention_layers, jnp.int32)
        k = cfg.interval - 1  # linear layers a group

        def group(x, params_index_per_layer_group):
            *full, g = params_index_per_layer_group
            # this group's linear layers: a view of the stack's leading dim (use_params
            # gathers each where it runs; the sharded dims stay whole)
            block = jax.tree.map(
                lambda a: jax.lax.dynamic_slice_in_dim(a, g * k, k), (lin_stacked, linear_index)
            )
            x, _ = jax.lax.scan(linear_layer, x, block)
            return layer(x, tuple(full))

        groups = jnp.arange(len(cfg.attention_layers), dtype=jnp.int32)
        xs = (stacked, index, self._per_layer(), groups)
        x_BxSxD, _ = jax.lax.scan(group, x_BxSxD, xs)
        return self._logits(embed, x_BxSxD)

    def _positions(
        self, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None]:
        """Each token's position and the segment ids attention masks with. Ulysses:
        ``tokens`` are this device's slice of each row: its positions are its slice of
        the whole rows', and the attention (over whole rows) gets their segment ids."""
        if self.cp is None:
            return positions(tokens_BxS, segment_ids_BxS), segment_ids_BxS
        b, s = tokens_BxS.shape
        n, i = jax.lax.axis_size(self.cp), jax.lax.axis_index(self.cp)
        if segment_ids_BxS is not None:
            segment_ids_BxS = jax.lax.all_gather(segment_ids_BxS, self.cp, axis=1, tiled=True)
        whole_BxS = positions(jnp.zeros((b, s * n), jnp.int32), segment_ids_BxS)
        return jax.lax.dynamic_slice_in_dim(whole_BxS, i * s, s, axis=1), segment_ids_BxS

    def _embed(self, embed_VxD: jax.Array, tokens_BxS: jax.Array) -> jax.Array:
        """The tokens' embeddings; Gemma's times sqrt(hidden_size), a scale rounded to
        the embeddings' dtype first as ``transformers`` rounds it. With tensor
        parallelism, ``embed`` is this device's rows of the vocabulary and the result
        its slice of the sequence (:func:`jaxzero.tensor_parallel.vocab_embed`)."""
        if self.tp is None:
            x_BxSxD = embed_VxD[tokens_BxS]
        else:
            parts_BxSxD = tp_lib.vocab_embed(embed_VxD, tokens_BxS, self.tp)
            x_BxSxD = tp_lib.scatter_seq(parts_BxSxD, 1, self.tp)
        if not self.cfg.embed_scale:
            return x_BxSxD
        return x_BxSxD * jnp.asarray(self.cfg.hidden_size**0.5, jnp.float32).astype(x_BxSxD.dtype)

    def _rotary(self, pos_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``cos``, ``sin`` of each rotary table the layers use, stacked
        (``R x B x S x K``, in the order of :data:`ROPES`); "none" is the identity
        (``cos`` 1, ``sin`` 0: q and k pass unchanged)."""
        cfg, out = self.cfg, []
        for kind in self._tables():
            if kind == "none":
                shape = (*pos_BxS.shape, cfg.rotary_dim)
                out.append((jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32)))
                continue
            local = cfg.rope_local_base_freq
            if kind == "local" and local is not None:
                inv = inverse_frequencies(cfg.rotary_dim, local)
            else:
                inv = rope_frequencies(cfg)
            out.append(rotary(pos_BxS, inv))
        return jnp.stack([c for c, _ in out]), jnp.stack([s for _, s in out])

    def _tables(self) -> list[str]:
        used = set(self.cfg.ropes)
        return [kind for kind in ROPES if kind in used]

    def _per_layer(self) -> dict[str, jax.Array]:
        """What differs between layers, as data scanned with them (one int32 a layer):
        the attention window, when a layer has one, and the rotary table, when the
        layers use several (else nothing: every layer the same program)."""
        out = {}
        if self.cfg.windows is not None:
            out["window"] = jnp.asarray(self.cfg.windows, jnp.int32)
        tables = self._tables()
        if len(tables) > 1:
            out["rope"] = jnp.asarray([tables.index(k) for k in self.cfg.ropes], jnp.int32)
        return out

    @staticmethod
    def _layer_inputs(
        rope: tuple[jax.Array, jax.Array], per_layer: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """A layer's ``cos``, ``sin`` and window from its scanned :meth:`_per_layer`."""
        table = per_layer.get("rope", 0)
        return rope[0][table], rope[1][table], per_layer.get("window")

    def _logits(self, embed_VxD: jax.Array, x_BxSxD: jax.Array) -> jax.Array:
        """Final norm and the LM head (tied: the embedding), fp32 logits; Gemma 2's
        soft-capped (``final_logit_softcapping``). With tensor parallelism: the whole
        sequence's logits of this device's slice of the vocabulary."""
        x_BxSxD = use(self.norm)(x_BxSxD)
        if self.tp is not None:
            x_BxSxD = tp_lib.gather_seq(x_BxSxD, 1, self.tp)
        head_VxD = embed_VxD if self.lm_head is None else use(self.lm_head).weight[...]
        logits = jnp.einsum("bsd,vd->bsv", x_BxSxD, head_VxD.astype(x_BxSxD.dtype)).astype(
            jnp.float32
        )
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def decode(
        self, tokens_BxT: jax.Array, start: jax.Array, cache: KVCache, last: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Logits (fp32, ``B x V``) of the token at index ``last`` of ``tokens``, which sit
        at positions ``start ..`` (rotary angles included) after the ones in ``cache``;
        and the cache with them in. The layers are :meth:`__call__`'s."""
        embed = self.embed_tokens.weight[...]
        pos_BxT = jnp.broadcast_to(start + jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
        rope = self._rotary(pos_BxT)
        graphdef, stacked, rest = nnx.split(self.layers, nnx.Param, ...)  # type: ignore[misc]

        def layer(x, params_kv_per_layer):
            params, k, v, per_layer = params_kv_per_layer
            kv = LayerCache(k, v, start)
            cos, sin, window = self._layer_inputs(rope, per_layer)
            x, kv = nnx.merge(graphdef, params, rest)(x, cos, sin, None, kv, None, window)
            return x, (kv.k, kv.v)

        x_BxTxD = self._embed(embed, tokens_BxT)
        if self.linear_layers is None:
            xs = (stacked, *cache, self._per_layer())
            x_BxTxD, cache = jax.lax.scan(layer, x_BxTxD, xs)
        else:
            x_BxTxD, cache = self._decode_groups(x_BxTxD, start, cache, last, layer, stacked)
        x_Bx1xD = jax.lax.dynamic_slice_in_dim(x_BxTxD, last, 1, axis=1)
        return self._logits(embed, x_Bx1xD)[:, 0], cache

    def _decode_groups(
        self,
        x_BxTxD: jax.Array,
        start: jax.Array,
        cache: KVCache,
        last: jax.Array,
        layer: Any,
        stacked: Any,
    ) -> tuple[jax.Array, KVCache]:
        """:meth:`decode`'s layers with linear-attention ones, in :meth:`__call__`'s
        groups: the attention layers with their keys and values (``layer``), the linear
        ones with their states and conv windows (:class:`LinearCache`; the tokens past
        ``last`` are a prefill's padding, which they skip)."""
        assert self.linear_layers is not None
        k_cache, v_cache, states, windows = cache
        lin_def, lin_stacked, lin_rest = nnx.split(self.linear_layers, nnx.Param, ...)  # type: ignore[misc]
        k = self.cfg.interval - 1
        groups = len(self.cfg.attention_layers)
        by_group = lambda a: a.reshape(groups, k, *a.shape[1:])

        def linear_layer(x, params_state_window):
            params, state, window = params_state_window
            lc = LinearCache(state, window, start, last + 1)
            x, lc = nnx.merge(lin_def, params, lin_rest)(x, None, None, None, lc)
            return x, (lc.state, lc.window)

        def group(x, xs):
            params, k_c, v_c, per_layer, linear = xs
            x, linear = jax.lax.scan(linear_layer, x, linear)
            x, kv = layer(x, (params, k_c, v_c, per_layer))
            return x, (*kv, *linear)

        linear = jax.tree.map(by_group, (lin_stacked, states, windows))
        xs = (stacked, k_cache, v_cache, self._per_layer(), linear)
        x_BxTxD, (k_c, v_c, st, win) = jax.lax.scan(group, x_BxTxD, xs)
        flat = lambda a: a.reshape(groups * k, *a.shape[2:])
        return x_BxTxD, (k_c, v_c, flat(st), flat(win))


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
        layers/{pre,post}_feedforward_layernorm/weight L x D  (sandwich_norms only)
        norm/weight              D
        lm_head/weight           V x D   (untied only)

    With linear-attention layers (Qwen3.5) ``layers/...`` holds the attention layers
    (``L`` their count, ``q_proj`` twice as wide with ``attn_output_gate``) and
    ``linear_layers/...`` the others, with the same norms and MLP and in attention's
    place::

        linear_layers/linear_attn/in_proj_{qkv,z,b,a}/weight   L' x out x in
        linear_layers/linear_attn/conv1d/weight                L' x C x 1 x width
        linear_layers/linear_attn/{dt_bias,A_log}              L' x H
        linear_layers/linear_attn/norm/weight                  L' x value_dim
        linear_layers/linear_attn/out_proj/weight              L' x D x (H x value_dim)

    Example:
      >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
      ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      ...                   seq_len=8)
      >>> model = Llama(cfg)
      >>> params = model.init(jax.random.key(0))
      >>> model.apply(params, jnp.zeros((1, 8), jnp.int32)).shape
      (1, 8, 64)
    """

    STACKED = r"^(linear_)?layers/"
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

    def _parallel_graph(self, tp: str | None = None, cp: str | None = None) -> tuple[Any, Any]:
        """The graph and non-param state of the module whose layers split over ``tp``
        (tensor parallelism) or whose attention exchanges sequence for heads over ``cp``
        (Ulysses); its params are :meth:`init`'s, bound per device by :func:`bind`."""
        lora = None if tp else self.lora  # tensor parallelism refuses adapters (llama_tp)
        abstract = nnx.eval_shape(lambda: LlamaModule(self.config, nnx.Rngs(0), lora, tp, cp))
        graphdef, _, rest = split(abstract)
        return graphdef, rest

    def tensor_parallel_rules(self, m: int) -> list[Any]:
        """The layout rules of tensor parallelism over ``m`` devices (:mod:`llama_tp`)."""
        llama_tp.check(self.config, self.lora, m)
        return llama_tp.rules(self.config, m)

    def tensor_parallel_apply(self, m: int) -> Any:
        """:meth:`apply` with the layers split over the ``model`` axis of ``m`` devices,
        per device (inside ``shard_map``): ``params`` are this device's slices
        (:meth:`tensor_parallel_rules`), ``tokens`` the whole rows (every model device's
        the same); the result is the whole sequence's logits of this device's slice of
        the vocabulary (``B x S x V/m``; ``P(..., "model")`` out of ``shard_map``)."""
        llama_tp.check(self.config, self.lora, m)
        graphdef, rest = self._parallel_graph(tp=MODEL)

        def apply(
            params: dict[str, Any], tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None = None
        ) -> jax.Array:
            llama_tp.sequence_check(tokens_BxS, m)
            return bind(graphdef, self._template, params, rest)(tokens_BxS, segment_ids_BxS)

        return apply

    def ulysses_loss(self, n: int) -> Any:
        """:meth:`loss_fn` per device under DeepSpeed-Ulysses over the ``data`` axis of
        ``n`` devices (``Engine(ulysses=True)``): the batch holds this device's slice of
        each sequence, the attention exchanges heads for sequence and back
        (:class:`~jaxzero.models.llama_layers.Attention`), everything else is the slice's
        own; the loss is the slice's (its mean, or its masked sum and count)."""
        llama_tp.check_ulysses(self.config, n)
        graphdef, rest = self._parallel_graph(cp=DATA)

        def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
            module = bind(graphdef, self._template, params, rest)
            return token_loss(module(batch["inputs"], batch.get("segment_ids")), batch)

        return loss_fn

    def tensor_parallel_loss(self, m: int) -> Any:
        """:meth:`loss_fn` with the layers split over the ``model`` axis of ``m`` devices
        (:meth:`tensor_parallel_apply`), the cross-entropy the vocabulary-parallel one."""
        apply = self.tensor_parallel_apply(m)

        def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
            logits_BxSxVl = apply(params, batch["inputs"], batch.get("segment_ids"))
            ce_BxS = tp_lib.vocab_cross_entropy(logits_BxSxVl, batch["targets"], MODEL)
            return tokens_loss(ce_BxS, batch)

        return loss_fn

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
        """``(layers, heads x head_dim)``: attention's FLOPs (:meth:`flops_per_token`),
        over the layers with (softmax) attention."""
        c = self.config
        return len(c.attention_layers), c.num_attention_heads * c.head_size

    def flops_per_token(self, num_params: int | None = None, frozen: int = 0) -> float:
        """:meth:`ReferenceModel.flops_per_token` (6 x the matmul params, attention's
        12·L·S·H·K over the attention layers) plus, for Qwen3.5's linear-attention
        layers, :meth:`linear_rule_flops`: their projections and conv are among the
        params, their mixing is the chunked delta rule's, linear in the sequence."""
        return super().flops_per_token(num_params, frozen) + self.linear_rule_flops()

    def linear_rule_flops(self) -> float:
        """Training FLOPs a token of the linear-attention layers' gated delta rule beyond
        their projections: 3 (forward and backward) x L' x
        :func:`jaxzero.models.deltanet.rule_flops_per_token`
        (``H·(C·(6K + 4V) + 2C²/3 + 6·K·V)``, chunks of ``C = min(64, seq_len)`` tokens as
        the layer runs it); 0 without them."""
        c = self.config
        n = len(c.linear_attention_layers)
        if not n:
            return 0.0
        h, k, v = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        return 3.0 * n * deltanet.rule_flops_per_token(h, k, v, min(CHUNK, c.seq_len))

    def lookup_params(self) -> int:
        """An untied input embedding is a lookup, not a matmul (tied: it is the head)."""
        c = self.config
        return 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size

    def new_cache(self, params: dict[str, Any]) -> KVCache:
        """An empty key/value cache over the ``seq_len`` window (sampling), grouped-query:
        one slot per key/value head, not per query head; with linear-attention layers
        (Qwen3.5) also their delta-rule states (fp32) and conv windows (``width - 1``
        inputs), zero: :class:`~jaxzero.models.common.LinearCache`'s, stacked."""
        c = self.config
        dtype = params["embed_tokens"]["weight"].dtype
        kv = new_cache(len(c.attention_layers), c.seq_len, c.kv_heads, c.head_size, dtype)
        n = len(c.linear_attention_layers)
        if not n:
            return kv
        h, kd, vd = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        channels = 2 * c.linear_num_key_heads * kd + h * vd
        state = jnp.zeros((n, 1, h, kd, vd), jnp.float32)
        window = jnp.zeros((n, 1, c.linear_conv_kernel_dim - 1, channels), dtype)
        return (*kv, state, window)

    def decode(self, params: dict[str, Any], *step: Any) -> tuple[jax.Array, KVCache]:
        """One step of cached sampling with these params (:meth:`LlamaModule.decode`)."""
        return self.module(params).decode(*step)
