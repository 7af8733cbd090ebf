"""The model fields of a run (a config's ``model:`` section): defined here, once.

:class:`ModelConfig` is the one schema: ``jaxzero.train.config`` types and validates
a run's ``model:`` section with it, :func:`jaxzero.models.from_fields` builds a model
from it (its defaults are the ones a missing field takes), and ``jaxzero export``
writes the :data:`EXPORTED` ones into an export's ``config.json``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Arch = Literal["gpt", "llama"]
ARCHS: tuple[str, ...] = typing.get_args(Arch)
LLAMA_ONLY = ("n_kv_heads", "head_dim", "rope_theta")


@dataclass(frozen=True)
class ModelConfig:
    """Model and shape. ``vocab_size=None`` takes it from the data (256 for bytes).

    ``arch: llama`` trains the Llama (RMSNorm, rotary positions, SwiGLU, grouped-query
    attention with ``n_kv_heads``); ``d_ff=None`` is then 8/3·d_model (to 32).
    """

    arch: Arch = "gpt"
    vocab_size: int | None = None
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None  # None: GPT 4 * d_model, Llama models.llama_ff(d_model)
    tie_embeddings: bool = True
    remat: Literal["none", "full", "dots"] = "none"  # activation checkpointing policy
    attention: Literal["auto", "xla", "cudnn"] = "auto"  # auto: cuDNN on GPUs in bf16
    n_kv_heads: int | None = None  # llama: key/value heads (None: n_heads)
    head_dim: int | None = None  # llama: None: d_model // n_heads
    rope_theta: float = 10000.0  # llama: rotary base
    # a Hugging Face config.json that defines the Llama exactly (biases, rope scaling, ...);
    # train.init_from sets it to the copy in the run directory
    hf_config: str | None = None


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelConfig))
# the attention kernel is the machine's choice, not the weights': an export sampled
# elsewhere (a CPU, after a cuDNN run) picks its own
EXPORTED: tuple[str, ...] = tuple(f for f in FIELDS if f != "attention")


def model_config(fields: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    """``fields`` as a :class:`ModelConfig`: a mapping's absent or ``None`` values take
    the defaults (an export's ``config.json`` leaves some out); unknown names are refused."""
    if isinstance(fields, ModelConfig):
        return fields
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown model field {unknown[0]!r}: the fields are {', '.join(FIELDS)}")
    return ModelConfig(**{k: v for k, v in fields.items() if v is not None})
