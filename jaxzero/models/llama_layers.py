"""The layers of the one Llama-family decoder (:mod:`jaxzero.models.llama`): the
projections (with LoRA adapters), RMSNorm, attention, the gated MLP and the decoder
layer, each keeping the Hugging Face names and orientations of its weights.

What the families differ by are options of these layers, read from
:class:`~jaxzero.models.llama.LlamaConfig`: Qwen3's and Gemma 3's q/k norms, Gemma's
``1 + weight`` RMSNorm, GeGLU, sandwich norms, attention scale and soft-capped scores;
Qwen3.5's gated attention output, partial rope and its Gated DeltaNet (linear
attention) layers, a decoder layer whose mixer is :class:`GatedDeltaNet` instead of
:class:`Attention` (the kernels: :mod:`jaxzero.models.deltanet`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxzero import loss as loss_lib
from jaxzero import tensor_parallel as tp_lib
from jaxzero.models import deltanet
from jaxzero.models.common import LayerCache, LinearCache, causal_attention
from jaxzero.models.lora import LoraConfig, check_rank
from jaxzero.models.quant import dequantize, quantize_traced
from jaxzero.models.rope import apply_rotary

if TYPE_CHECKING:
    from jaxzero.models.llama import LlamaConfig

# the gated MLP's activation by transformers' name (hidden_act / hidden_activation):
# SwiGLU (Llama, Qwen, Mistral, SmolLM3) or GeGLU with the tanh GELU (Gemma)
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


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

    def __call__(self, x: jax.Array, rng: jax.Array | None = None, bias: bool = True) -> jax.Array:
        """``rng``: the loss's key (a mask per row), for dropout on the adapter's input;
        ``bias`` False: without the bias (a row-parallel layer adds it once its partial
        sums are reduced, :meth:`add_bias`)."""
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
        return self.add_bias(y) if bias else y

    def add_bias(self, y: jax.Array) -> jax.Array:
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def _row_parallel_out(
    proj: Linear, y: jax.Array, rng: jax.Array | None, tp: str | None
) -> jax.Array:
    """A block's output projection: whole without tensor parallelism; with it, this
    device's partial sums reduce-scattered to its slice of the sequence (sequence
    parallelism's *ḡ*), then the bias, once."""
    if tp is None:
        return proj(y, rng)
    return proj.add_bias(tp_lib.scatter_seq(proj(y, rng, bias=False), 1, tp))


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
# and of a linear-attention (Gated DeltaNet) layer's mixer (Qwen3.5)
LINEAR_ATTENTION_LINEARS = tuple(
    f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
)


def linears(cfg: LlamaConfig) -> list[str]:
    """The linear modules a model of ``cfg`` has, by peft's names (LoRA's targets)."""
    return [*LINEARS, *(LINEAR_ATTENTION_LINEARS if cfg.interval else ())]


class RMSNorm(nnx.Module):
    """``weight * (x / rms(x))``, the statistics in fp32, the result in ``x``'s dtype.

    ``offset`` (Gemma): ``(1 + weight) * (x / rms(x))`` all in fp32, cast at the end, as
    ``transformers``' Gemma RMSNorm; the weight is stored as Hugging Face stores it (0
    is the identity), so a checkpoint loads as it is.
    """

    def __init__(self, dim: int, eps: float, offset: bool = False):
        self.weight = nnx.Param(jnp.zeros(dim) if offset else jnp.ones(dim))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)


def _norm(cfg: LlamaConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.norm_offset)


class Attention(nnx.Module):
    """Grouped-query attention; ``attn_output_gate`` (Qwen3.5): ``q_proj`` gives each
    head its query and a gate side by side (``2 x head_dim`` a head, query first, as
    ``transformers`` splits its output), and the attention's output is multiplied by
    ``sigmoid(gate)`` before ``o_proj``."""

    def __init__(
        self,
        cfg: LlamaConfig,
        rngs: nnx.Rngs,
        lora: LoraConfig | None = None,
        tp: str | None = None,
        cp: str | None = None,
    ):
        d, h, kv, k = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.head_size
        self.gated, self.tp, self.cp = cfg.attn_output_gate, tp, cp
        q_out = 2 * h * k if self.gated else h * k
        self.q_proj = _linear(cfg, lora, "self_attn.q_proj", d, q_out, cfg.qkv_bias, rngs)
        self.k_proj = _linear(cfg, lora, "self_attn.k_proj", d, kv * k, cfg.qkv_bias, rngs)
        self.v_proj = _linear(cfg, lora, "self_attn.v_proj", d, kv * k, cfg.qkv_bias, rngs)
        self.o_proj = _linear(cfg, lora, "self_attn.o_proj", h * k, d, cfg.o_bias, rngs)
        # Qwen3, Gemma 3: over each head's head_dim, the model's eps and norm form
        self.q_norm = _norm(cfg, k) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, k) if cfg.qk_norm else None
        self.heads, self.kv_heads, self.head_dim, self.impl = h, kv, k, cfg.attention
        self.windows = cfg.windows or ()  # the values a layer's window takes (static)
        # Gemma: scores scaled by query_pre_attn_scalar^-1/2 (None: head_dim's), capped
        q_scalar = cfg.query_pre_attn_scalar
        self.scale = None if q_scalar is None else float(q_scalar) ** -0.5
        self.softcap = cfg.attn_logit_softcapping

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
        sliding window (an int32 scalar; None: full causal attention).

        With Ulysses (``cp``: the axis a sequence is split over) q, k and v are
        exchanged (:func:`_heads_for_sequence`) so that the attention runs on the whole
        sequence (``segment_ids`` its whole rows) of this device's heads, and the
        output exchanged back.

        With tensor parallelism (``tp``: the model axis) ``x`` is this device's slice of
        the sequence, gathered whole here; the projections are this device's heads
        (their count read from the weights' shapes), key/value heads too when the axis
        divides them, else every key/value head is computed and the one this device's
        query heads share is kept; the output is this device's slice of the sequence."""
        if self.tp is not None:
            x_BxSxD = tp_lib.gather_seq(x_BxSxD, 1, self.tp)
        b, s, _ = x_BxSxD.shape
        r = _keys(rng, 4)
        gate_BxSxHK = None
        q_BxSxQ = self.q_proj(x_BxSxD, r[0])
        heads = q_BxSxQ.shape[-1] // (self.head_dim * (2 if self.gated else 1))
        if self.gated:
            qg = q_BxSxQ.reshape(b, s, heads, 2 * self.head_dim)
            q, gate_BxSxHK = qg[..., : self.head_dim], qg[..., self.head_dim :]
            gate_BxSxHK = gate_BxSxHK.reshape(b, s, heads * self.head_dim)
        else:
            q = q_BxSxQ.reshape(b, s, heads, self.head_dim)
        k = self.k_proj(x_BxSxD, r[1]).reshape(b, s, -1, self.head_dim)
        v = self.v_proj(x_BxSxD, r[2]).reshape(b, s, -1, self.head_dim)
        if self.tp is not None and heads < self.heads and k.shape[2] == self.kv_heads:
            # key/value heads replicated: this device's query heads share one of them
            at = jax.lax.axis_index(self.tp) * heads // (self.heads // self.kv_heads)
            k, v = (jax.lax.dynamic_slice_in_dim(a, at, 1, axis=2) for a in (k, v))
        if self.q_norm is not None and self.k_norm is not None:  # before rope, as Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.cp is not None:  # Ulysses: the whole sequence of this device's heads
            q, k, v = _heads_for_sequence(q, k, v, self.cp)
        # grouped-query: the kv heads are shared
        if cache is None:
            out_BxSxHxK = causal_attention(
                q, k, v, self.impl, segment_ids_BxS, window, self.windows, self.scale, self.softcap
            )
        else:
            out_BxSxHxK, cache = cache.attend(q, k, v, window, self.scale, self.softcap)
        if self.cp is not None:  # and back: this device's slice of the sequence, every head
            out_BxSxHxK = jax.lax.all_to_all(out_BxSxHxK, self.cp, 1, 2, tiled=True)
        out_BxSxHK = out_BxSxHxK.reshape(b, s, heads * self.head_dim)
        if gate_BxSxHK is not None:
            out_BxSxHK = out_BxSxHK * jax.nn.sigmoid(gate_BxSxHK)
        return _row_parallel_out(self.o_proj, out_BxSxHK, r[3], self.tp), cache


def _heads_for_sequence(
    q: jax.Array, k: jax.Array, v: jax.Array, axis: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """DeepSpeed-Ulysses' all-to-all: from this device's slice of the sequence with
    every head to the whole sequence with its slice of the heads (``H / n`` query heads,
    the key/value heads they share; repeated to one a query head first when ``n`` does
    not divide them)."""
    n = jax.lax.axis_size(axis)
    if k.shape[2] % n:
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    to_heads = lambda a: jax.lax.all_to_all(a, axis, 2, 1, tiled=True)  # noqa: E731
    return to_heads(q), to_heads(k), to_heads(v)


class Conv1d(nnx.Module):
    """The depthwise causal convolution's weight, ``channels x 1 x width`` as PyTorch's
    ``nn.Conv1d(groups=channels)`` stores it (a checkpoint loads as it is), drawn as
    PyTorch draws it (uniform in +-1/sqrt(width)); no bias (Qwen3.5 has none)."""

    def __init__(self, channels: int, width: int, rngs: nnx.Rngs):
        bound = 1.0 / width**0.5
        shape = (channels, 1, width)
        self.weight = nnx.Param(
            jax.random.uniform(rngs.params(), shape, minval=-bound, maxval=bound)
        )


class GatedRMSNorm(nnx.Module):
    """The DeltaNet output's norm, each value head's: ``weight * rms_norm(x) * silu(gate)``
    with a plain weight (ones at init, not Gemma's ``1 + weight``), as ``transformers``'
    ``Qwen3_5RMSNormGated``; the arithmetic is :func:`jaxzero.models.deltanet.gated_rms_norm`."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones(dim))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return deltanet.gated_rms_norm(x, gate, self.weight[...], self.eps)


CHUNK = 64  # the chunked delta rule's tokens a chunk (transformers' and FLA's)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear attention, ``transformers``' ``Qwen3_5GatedDeltaNet``: q, k, v
    from one projection through a causal depthwise conv (SiLU), q and k L2-normalised
    (in the kernel), a decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and a write
    strength ``beta = sigmoid(b)`` a value head and token, the gated delta rule over a
    state of ``key_dim x value_dim`` a value head, the output normed and gated by
    ``silu(z)``, then ``out_proj``. ``G`` key heads serve ``H`` value heads in groups of
    ``H / G`` consecutive ones. Memory and work grow linearly with the sequence; the
    state and the conv's last ``width - 1`` inputs are what sampling caches."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        d, g, h = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        kd, vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = g, h, kd, vd
        channels = 2 * g * kd + h * vd
        lin = lambda name, d_in, d_out: _linear(
            cfg, lora, f"linear_attn.{name}", d_in, d_out, False, rngs
        )
        self.in_proj_qkv = lin("in_proj_qkv", d, channels)
        self.in_proj_z = lin("in_proj_z", d, h * vd)
        self.in_proj_b = lin("in_proj_b", d, h)
        self.in_proj_a = lin("in_proj_a", d, h)
        self.conv1d = Conv1d(channels, cfg.linear_conv_kernel_dim, rngs)
        self.dt_bias = nnx.Param(jnp.ones(h))
        # transformers draws A in [0.01, 16] (away from 0: log A is finite)
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (h,), minval=0.01, maxval=16.0))
        )
        self.norm = GatedRMSNorm(vd, cfg.rms_norm_eps)
        self.out_proj = lin("out_proj", h * vd, d)

    def __call__(
        self,
        x_BxSxD: jax.Array,
        segment_ids_BxS: jax.Array | None = None,
        cache: LinearCache | None = None,
        rng: jax.Array | None = None,
    ) -> tuple[jax.Array, LinearCache | None]:
        """Training and prefill without a ``cache``: the chunked form over the whole
        sequence (packed documents: ``segment_ids``, the state and the conv restart at
        each document). With one (sampling): the tokens continue its state and conv
        window, and it comes back with them in (:meth:`LinearCache.step`)."""
        b, s, _ = x_BxSxD.shape
        r = _keys(rng, 5)
        qkv_BxSxC = self.in_proj_qkv(x_BxSxD, r[0])
        w_CxW = self.conv1d.weight[...][:, 0, :]
        z_BxSxHxV = self.in_proj_z(x_BxSxD, r[1]).reshape(b, s, self.value_heads, self.value_dim)
        beta_BxSxH = deltanet.beta_gate(self.in_proj_b(x_BxSxD, r[2]))
        a_BxSxH = self.in_proj_a(x_BxSxD, r[3])
        g_BxSxH = deltanet.decay(a_BxSxH, self.A_log[...], self.dt_bias[...])
        if cache is None:
            conv_BxSxC = deltanet.causal_conv1d(qkv_BxSxC, w_CxW, segment_ids_BxS)
        else:
            conv_BxSxC, cache = cache.conv(qkv_BxSxC, w_CxW)
        gk, hv = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        q = conv_BxSxC[..., :gk].reshape(b, s, self.key_heads, self.key_dim)
        k = conv_BxSxC[..., gk : 2 * gk].reshape(b, s, self.key_heads, self.key_dim)
        v = conv_BxSxC[..., 2 * gk : 2 * gk + hv].reshape(b, s, self.value_heads, self.value_dim)
        if cache is None:
            o_BxSxHxV, _ = deltanet.gated_delta_rule(
                q, k, v, g_BxSxH, beta_BxSxH, CHUNK, segment_ids_BxS=segment_ids_BxS
            )
        else:
            o_BxSxHxV, cache = cache.recur(q, k, v, g_BxSxH, beta_BxSxH)
        o_BxSxHxV = self.norm(o_BxSxHxV.astype(x_BxSxD.dtype), z_BxSxHxV)
        return self.out_proj(o_BxSxHxV.reshape(b, s, hv), r[4]), cache


class MLP(nnx.Module):
    """The gated MLP; with tensor parallelism (``tp``) its input is this device's slice of
    the sequence, gathered whole, the gate and up projections this device's columns, the
    down projection its rows, the output its slice of the sequence again."""

    def __init__(
        self,
        cfg: LlamaConfig,
        rngs: nnx.Rngs,
        lora: LoraConfig | None = None,
        tp: str | None = None,
    ):
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.tp = tp
        self.gate_proj = _linear(cfg, lora, "mlp.gate_proj", d, f, bias, rngs)
        self.up_proj = _linear(cfg, lora, "mlp.up_proj", d, f, bias, rngs)
        self.down_proj = _linear(cfg, lora, "mlp.down_proj", f, d, bias, rngs)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        r = _keys(rng, 3)
        if self.tp is not None:
            x = tp_lib.gather_seq(x, 1, self.tp)
        y = self.act(self.gate_proj(x, r[0])) * self.up_proj(x, r[1])
        return _row_parallel_out(self.down_proj, y, r[2], self.tp)


class DecoderLayer(nnx.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). With ``sandwich_norms``
    (Gemma 2/3) each branch is normed on its way out too: x + norm(attn(norm(x))), then
    x + norm(mlp(norm(x))); ``post_attention_layernorm`` is then the attention's output
    norm (Hugging Face's names: the MLP's input norm is ``pre_feedforward_layernorm``).
    ``linear`` (Qwen3.5's linear-attention layers): the mixer is ``linear_attn``, a
    :class:`GatedDeltaNet`, in attention's place (no rope, no window; its ``cache`` a
    :class:`~jaxzero.models.common.LinearCache`)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        rngs: nnx.Rngs,
        lora: LoraConfig | None = None,
        linear: bool = False,
        tp: str | None = None,
        cp: str | None = None,
    ):
        d = cfg.hidden_size
        self.input_layernorm = _norm(cfg, d)
        self.self_attn = None if linear else Attention(cfg, rngs, lora, tp, cp)
        self.linear_attn = GatedDeltaNet(cfg, rngs, lora) if linear else None
        self.post_attention_layernorm = _norm(cfg, d)
        self.pre_feedforward_layernorm = _norm(cfg, d) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = _norm(cfg, d) if cfg.sandwich_norms else None
        self.mlp = MLP(cfg, rngs, lora, tp)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array | None,
        sin: jax.Array | None,
        segment_ids_BxS: jax.Array | None = None,
        cache: LayerCache | LinearCache | None = None,
        rng: jax.Array | None = None,
        window: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache | LinearCache | None]:
        r = _keys(rng, 2)
        h = self.input_layernorm(x)
        y: jax.Array
        if self.linear_attn is not None:
            assert cache is None or isinstance(cache, LinearCache)
            y, cache = self.linear_attn(h, segment_ids_BxS, cache, r[0])
        else:  # rope's tables: a linear-attention layer has none
            assert self.self_attn is not None and cos is not None and sin is not None
            assert not isinstance(cache, LinearCache)
            y, cache = self.self_attn(h, cos, sin, segment_ids_BxS, cache, r[0], window)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + y
            return x + self.mlp(self.post_attention_layernorm(x), r[1]), cache
        x = x + self.post_attention_layernorm(y)
        y = self.mlp(self.pre_feedforward_layernorm(x), r[1])
        return x + self.post_feedforward_layernorm(y), cache


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, std: float, rngs: nnx.Rngs):
        self.weight = nnx.Param(std * jax.random.normal(rngs.params(), (vocab, dim)))
