"""Activation memory of a transformer (Korthikanti et al. 2022), per device.

The third part of :mod:`jaxzero.accounting.estimate`'s per-device memory, beside the
model states: what one micro-batch keeps for backward, with and without recomputation.
:class:`GPTShape` is Korthikanti's GPT; :class:`DecoderShape` the Llama family's decoder
(gated MLP, grouped-query attention, Gemma's and Qwen's options) with Qwen3.5's Gated
DeltaNet layers, whose activations grow linearly with the sequence where attention's
scores grow with its square. Pure, like the rest of the formulas. Bytes throughout.

Example:
  >>> shape = GPTShape(layers=12, d_model=768, heads=12, vocab=50257, seq_len=1024)
  >>> shape.num_params()
  124439808
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GPTShape:
    """The dimensions of a GPT that matter to memory.

    Attributes:
      layers: transformer blocks (L).
      d_model: hidden size (h).
      heads: attention heads (a).
      vocab: vocabulary size (V).
      seq_len: sequence length (s).
    """

    layers: int
    d_model: int
    heads: int
    vocab: int
    seq_len: int

    def num_params(self, tied: bool = True) -> int:
        """Parameters of a GPT-2 style model with biases and learned positions.

        Per block 12h² + 13h (QKV 3h²+3h, projection h²+h, MLP 8h²+5h, two layer
        norms 4h); plus token and position embeddings, the final layer norm and,
        if untied, an output projection.
        """
        h = self.d_model
        blocks = self.layers * (12 * h * h + 13 * h)
        embed = self.vocab * h + self.seq_len * h
        head = 0 if tied else self.vocab * h
        return blocks + embed + 2 * h + head


@dataclass(frozen=True)
class DecoderShape:
    """The dimensions of a Llama-family decoder that matter to activation memory.

    ``layers`` attention layers (full or windowed: the XLA path masks a window, it
    stores the same scores) and ``linear_layers`` Gated DeltaNet layers (Qwen3.5), each
    with the gated MLP of width ``d_ff``. The ``linear_*`` fields are the DeltaNet's:
    ``G`` key heads of ``K`` dims, ``H`` value heads of ``V`` dims, its kernel's
    ``chunk`` of tokens (:data:`jaxzero.models.llama.CHUNK`).
    """

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    seq_len: int
    qk_norm: bool = False  # Qwen3, Gemma 3: q and k kept before and after their norm
    sandwich_norms: bool = False  # Gemma 2/3: two more norm inputs a layer
    output_gate: bool = False  # Qwen3.5: the attention's output gate and its input
    softcap: bool = False  # Gemma 2: the scores kept before and after the cap
    linear_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    chunk: int = 64

    def __post_init__(self):
        for name in ("layers", "d_model", "heads", "kv_heads", "head_dim", "d_ff", "vocab"):
            if getattr(self, name) < (0 if name == "layers" else 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.seq_len < 1 or self.chunk < 1:
            raise ValueError(f"seq_len and chunk must be positive ({self.seq_len}, {self.chunk})")
        if self.layers + self.linear_layers < 1:
            raise ValueError("a decoder needs at least one layer")

    @classmethod
    def of(cls, c: Any, chunk: int = 64) -> DecoderShape:
        """The shape of a :class:`~jaxzero.models.llama.LlamaConfig` ``c`` (read by its
        field names: the accounting imports no model), at its ``seq_len``."""
        return cls(
            layers=len(c.attention_layers),
            d_model=c.hidden_size,
            heads=c.num_attention_heads,
            kv_heads=c.kv_heads,
            head_dim=c.head_size,
            d_ff=c.intermediate_size,
            vocab=c.vocab_size,
            seq_len=c.seq_len,
            qk_norm=c.qk_norm,
            sandwich_norms=c.sandwich_norms,
            output_gate=c.attn_output_gate,
            softcap=c.attn_logit_softcapping is not None,
            linear_layers=len(c.linear_attention_layers),
            linear_key_heads=c.linear_num_key_heads,
            linear_value_heads=c.linear_num_value_heads,
            linear_key_dim=c.linear_key_head_dim,
            linear_value_dim=c.linear_value_head_dim,
            chunk=chunk,
        )

    def _common(self) -> float:
        """Values a token keeps in either kind of layer beside its mixer: the norms'
        inputs, statistics and outputs and the residual (7h; 4h more for the sandwich
        norms), the gated MLP's gate, up, the activation's parts and their product (6f)."""
        h = self.d_model
        return 7 * h + 6 * self.d_ff + (4 * h if self.sandwich_norms else 0)

    def attention_layer(self, tokens: float, bytes_per_value: float, fused: bool) -> float:
        """Bytes an attention layer keeps for ``tokens`` tokens (``b·s``): q and k before
        and after rope (and before their norms), v, the output (and the gate's input and
        the ungated output); without a fused kernel, the ``a·s`` scores a token twice
        (the probabilities and the masked scores XLA keeps; three times with a soft-cap),
        with one the kernel's fp32 log-sum-exp."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mixer = (q + kv) * (3 if self.qk_norm else 2) + kv + q * (3 if self.output_gate else 1)
        values = self._common() + mixer
        if fused:
            return tokens * (values * bytes_per_value + 4.0 * self.heads)
        scores = self.heads * self.seq_len * (3 if self.softcap else 2)
        return tokens * (values + scores) * bytes_per_value

    def linear_layer(self, tokens: float, bytes_per_value: float) -> float:
        """Bytes a Gated DeltaNet layer keeps for ``tokens`` tokens, linear in them (no
        term grows with the sequence): the conv's shifted inputs, output and activation
        (7c, c = 2GK + HV channels), z and the gated norm's parts (7HV); the kernel's,
        fp32: q and k normalised (2GK), the chunk's k and v (H(K + V)), 14 ``C x C``
        matrices a head and chunk (the decays, scores, the inverse and its blocks: 14HC a
        token) and three masks (1 byte), and six copies of the state a chunk
        (``6HKV/C``), as the chunked kernel's backward keeps them."""
        g, h = self.linear_key_heads, self.linear_value_heads
        k, v, c = self.linear_key_dim, self.linear_value_dim, min(self.chunk, self.seq_len)
        channels = 2 * g * k + h * v
        values = self._common() + 7 * channels + 7 * h * v
        kernel = 2 * g * k + h * (k + v) + 14 * h * c + 6 * h * k * v / c
        return tokens * (values * bytes_per_value + 4.0 * kernel + 3.0 * h * c)


@dataclass(frozen=True)
class Activations:
    """Activation bytes per device (Korthikanti et al. 2022, no tensor/sequence parallel).

    Attributes:
      per_layer: bytes one (attention) layer keeps for backward.
      layers: bytes for all layers (with full remat: the saved layer inputs plus the
        largest layer's activations being recomputed).
      output: the output layer's logits and softmax, 4·s·b·(h + V) bytes.
      linear_per_layer: bytes one Gated DeltaNet layer keeps (0: the model has none).
      workspace: a decoder's backward of one layer at a time: the gradients of its
        activations, as large as the largest layer's (0 in Korthikanti's GPT formula).
    """

    per_layer: float
    layers: float
    output: float
    linear_per_layer: float = 0.0
    workspace: float = 0.0

    @property
    def total(self) -> float:
        return self.layers + self.output + self.workspace


def activation_bytes(
    shape: GPTShape | DecoderShape,
    micro_batch: int = 1,
    remat: str = "none",
    fused_attention: bool = False,
    bytes_per_value: float = 2.0,
) -> Activations:
    """Activation memory of one micro-batch on one device.

    Without recomputation a GPT block keeps s·b·h·(34 + 5·a·s/h) bytes in 16-bit; a
    fused (flash) attention never materialises the a·s² scores, dropping the second
    term. A :class:`DecoderShape`'s layers are counted by kind (its methods; a Gated
    DeltaNet layer's bytes are linear in s), with the backward's workspace of one layer.
    Full remat keeps only each layer's input
    (2·s·b·h) and recomputes one layer at a time in backward. fp32 activations double
    everything.

    Args:
      shape: model dimensions.
      micro_batch: sequences per device per micro-batch (b).
      remat: "none" or "full".
      fused_attention: attention scores are not stored.
      bytes_per_value: 2 for 16-bit activations, 4 for fp32.
    """
    if remat not in ("none", "full"):
        raise ValueError(f"remat must be 'none' or 'full', got {remat!r}")
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be positive, got {micro_batch!r}")
    if isinstance(shape, DecoderShape):
        return _decoder_bytes(shape, micro_batch, remat, fused_attention, bytes_per_value)
    for name in ("layers", "d_model", "heads", "vocab", "seq_len"):
        if getattr(shape, name) < 1:
            raise ValueError(f"{name} must be positive, got {getattr(shape, name)!r}")
    s, b, h, a = shape.seq_len, micro_batch, shape.d_model, shape.heads
    scale = bytes_per_value / 2.0
    coeff = 34.0 + (0.0 if fused_attention else 5.0 * a * s / h)
    per_layer = s * b * h * coeff * scale
    if remat == "full":
        layers = shape.layers * 2.0 * s * b * h * scale + per_layer
    else:
        layers = shape.layers * per_layer
    output = 4.0 * s * b * (h + shape.vocab) * scale
    return Activations(per_layer=per_layer, layers=layers, output=output)


def _decoder_bytes(
    shape: DecoderShape, b: int, remat: str, fused: bool, bytes_per_value: float
) -> Activations:
    tokens = float(shape.seq_len * b)
    attention = shape.attention_layer(tokens, bytes_per_value, fused) if shape.layers else 0.0
    linear = shape.linear_layer(tokens, bytes_per_value) if shape.linear_layers else 0.0
    largest = max(attention, linear)
    if remat == "full":
        inputs = (shape.layers + shape.linear_layers) * tokens * shape.d_model * bytes_per_value
        layers = inputs + largest
    else:
        layers = shape.layers * attention + shape.linear_layers * linear
    output = 2.0 * tokens * (shape.d_model + shape.vocab) * bytes_per_value
    return Activations(attention if shape.layers else linear, layers, output, linear, largest)
