"""Activation memory of a GPT-like transformer (Korthikanti et al. 2022), per device.

The third part of :mod:`jaxzero.accounting.estimate`'s per-device memory, beside the
model states: what one micro-batch keeps for backward, with and without recomputation.
Pure, like the rest of the formulas. Bytes throughout.

Example:
  >>> shape = GPTShape(layers=12, d_model=768, heads=12, vocab=50257, seq_len=1024)
  >>> shape.num_params()
  124439808
"""

from __future__ import annotations

from dataclasses import dataclass


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
class Activations:
    """Activation bytes per device (Korthikanti et al. 2022, no tensor/sequence parallel).

    Attributes:
      per_layer: bytes one transformer block keeps for backward.
      layers: bytes for all blocks (with full remat: the saved block inputs plus one
        block's activations being recomputed).
      output: the output layer's logits and softmax, 4·s·b·(h + V) bytes.
    """

    per_layer: float
    layers: float
    output: float

    @property
    def total(self) -> float:
        return self.layers + self.output


def activation_bytes(
    shape: GPTShape,
    micro_batch: int = 1,
    remat: str = "none",
    fused_attention: bool = False,
    bytes_per_value: float = 2.0,
) -> Activations:
    """Activation memory of one micro-batch on one device.

    Without recomputation a block keeps s·b·h·(34 + 5·a·s/h) bytes in 16-bit; a
    fused (flash) attention never materialises the a·s² scores, dropping the second
    term. Full remat keeps only each block's input (2·s·b·h) and recomputes one
    block at a time in backward. fp32 activations double everything.

    Args:
      shape: model dimensions.
      micro_batch: sequences per device per micro-batch (b).
      remat: "none" or "full".
      fused_attention: attention scores are not stored.
      bytes_per_value: 2 for 16-bit activations, 4 for fp32.
    """
    if remat not in ("none", "full"):
        raise ValueError(f"remat must be 'none' or 'full', got {remat!r}")
    for name in ("layers", "d_model", "heads", "vocab", "seq_len"):
        if getattr(shape, name) < 1:
            raise ValueError(f"{name} must be positive, got {getattr(shape, name)!r}")
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be positive, got {micro_batch!r}")
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
