"""Tensor and sequence parallelism for the Llama family: where each weight is split over
the ``model`` axis, what a model must be for it, and the loss computed that way.

Megatron-LM's layout (Shoeybi et al. 2019) with sequence parallelism (Korthikanti et
al. 2022), in Hugging Face's names and orientations (``out x in``):

=====================================  ==========================  ==================
weight                                 split over ``model``        as
=====================================  ==========================  ==================
``q_proj``, ``k_proj``, ``v_proj``     rows (output: heads)        column-parallel
``gate_proj``, ``up_proj``             rows (output: F)            column-parallel
``o_proj``, ``down_proj``              columns (input)             row-parallel
``embed_tokens``, ``lm_head``          rows (vocabulary)           vocabulary-parallel
norms, row-parallel biases             none: each device a copy
=====================================  ==========================  ==================

``k_proj``/``v_proj`` (and their biases) are split only when the axis divides the
key/value heads; when it is a multiple of them each device computes every key/value
head and keeps the one its query heads share (Megatron's replication). Between the
blocks each device holds its slice of the sequence (norms, residuals, the
embedding's sum): a block gathers it (:func:`~jaxzero.tensor_parallel.gather_seq`)
and reduce-scatters its output (:func:`~jaxzero.tensor_parallel.scatter_seq`), so a
layer does two all-gathers and two reduce-scatters of ``B x S x D`` forward and
again backward, the bytes of Megatron's two all-reduces. A weight not split is used
on each device's own part of the sequence or heads, so its gradient is summed over
the axis (:mod:`jaxzero.step`). The logits are the whole sequence's, of each device's
slice of the vocabulary, and the loss is
:func:`~jaxzero.tensor_parallel.vocab_cross_entropy`'s: no device holds all the
logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jax.sharding import PartitionSpec as P

from jaxzero.mesh import MODEL
from jaxzero.partition import Rule

if TYPE_CHECKING:
    from jaxzero.models.llama import LlamaConfig
    from jaxzero.models.lora import LoraConfig

# the stacked layers' leaves: L x out x in (weights), L x out (biases)
_COLUMN = r"^layers/(self_attn/q_proj|mlp/(gate|up)_proj)/(weight|bias)$"
_KV = r"^layers/self_attn/[kv]_proj/(weight|bias)$"
_ROW = r"^layers/(self_attn/o_proj|mlp/down_proj)/weight$"
_VOCAB = r"^(embed_tokens|lm_head)/weight$"


def check(cfg: LlamaConfig, lora: LoraConfig | None, m: int) -> None:
    """Refuse, in one line naming what to change, a model the ``model`` axis of ``m``
    devices cannot split."""
    if cfg.linear_attention_layers:
        raise ValueError(
            "tensor parallelism does not split Qwen3.5's Gated DeltaNet layers yet: train "
            "this model with ZeRO over the data axis (model=1)"
        )
    if lora is not None:
        raise ValueError(
            "tensor parallelism with LoRA adapters is not supported yet: fine-tune LoRA with "
            "ZeRO over the data axis (model=1)"
        )
    h, kv = cfg.num_attention_heads, cfg.kv_heads
    for what, n in (
        ("num_attention_heads", h),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ):
        if n % m:
            raise ValueError(
                f"tensor parallelism over {m} devices splits {what}={n}, which {m} does not "
                "divide: use a model axis that divides it"
            )
    if kv % m and m % kv:
        raise ValueError(
            f"tensor parallelism over {m} devices: num_key_value_heads={kv} must be a "
            f"multiple of {m} (split) or divide it (replicated); use a model axis that does"
        )


def check_ulysses(cfg: LlamaConfig, n: int) -> None:
    """Refuse a model Ulysses over ``n`` devices cannot split by heads."""
    if cfg.linear_attention_layers:
        raise ValueError(
            "Ulysses does not split Qwen3.5's Gated DeltaNet layers (a recurrence over the "
            "sequence) yet: train this model without ulysses"
        )
    if cfg.num_attention_heads % n:
        raise ValueError(
            f"Ulysses over {n} devices gives each a slice of num_attention_heads="
            f"{cfg.num_attention_heads}, which {n} does not divide: use a data axis that does"
        )


def rules(cfg: LlamaConfig, m: int) -> list[Rule]:
    """The layout rules of tensor parallelism over ``m`` devices (the table above)."""
    out: list[Rule] = [
        (_COLUMN, P(None, MODEL)),
        (_ROW, P(None, None, MODEL)),
        (_VOCAB, P(MODEL)),
    ]
    if cfg.kv_heads % m == 0:
        out.append((_KV, P(None, MODEL)))
    return out


def sequence_check(tokens_BxS: Any, m: int) -> None:
    """Sequence parallelism splits each sequence over the ``model`` axis."""
    s = tokens_BxS.shape[1]
    if s % m:
        raise ValueError(
            f"sequence parallelism splits each sequence over the {m} devices of the model "
            f"axis: a sequence of {s} tokens does not divide; use a seq_len that {m} divides"
        )
