"""The reference models, and the one place a run's ``model:`` section becomes one.

``arch: gpt`` is the Flax Linen GPT (:mod:`jaxzero.models.gpt`); ``arch: llama`` the
Flax NNX Llama (:mod:`jaxzero.models.llama`), whose Hugging Face ``config.json``
parsing is :mod:`jaxzero.models.llama_hf` (:mod:`jaxzero.hf` loads and saves the
weights). Both implement :class:`Model` and take the same shape fields, defined once
in :class:`ModelConfig`; the Llama reads ``n_kv_heads``, ``head_dim`` and
``rope_theta`` too. Nothing here imports a layer above the models (``hf``,
``accounting``, ``train``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxzero.models.fields import ARCHS, LLAMA_ONLY, ModelConfig, model_config
from jaxzero.models.gpt import GPT, GPTConfig
from jaxzero.models.llama import Llama, LlamaConfig
from jaxzero.models.llama_hf import llama_config, read_json
from jaxzero.models.lora import LoraConfig
from jaxzero.models.protocol import Model, ReferenceModel

__all__ = [
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Model",
    "ModelConfig",
    "ReferenceModel",
    "from_fields",
    "llama_ff",
]


def llama_ff(d_model: int) -> int:
    """SwiGLU width with a 4·d GELU MLP's parameters (3 matrices of 8/3·d), to 32."""
    return 32 * math.ceil(8 * d_model / 3 / 32)


def from_fields(
    fields: ModelConfig | Mapping[str, Any],
    hf_raw: dict[str, Any] | None = None,
    lora: LoraConfig | None = None,
) -> Model:
    """A ``GPT`` or ``Llama`` from a run's model fields: a :class:`ModelConfig`, or a
    mapping of its fields (absent or ``None`` ones take :class:`ModelConfig`'s
    defaults); ``vocab_size`` must be set.

    ``hf_raw``: the contents of the ``config.json`` that ``model.hf_config`` names, when
    the caller has it already (a fine-tune's processes compute it; reading the file
    that one of them writes would race it). ``lora``: adapters on a Llama-family model
    (:mod:`jaxzero.models.lora`).
    """
    m = model_config(fields)
    if m.hf_config or hf_raw is not None:  # a fine-tuned checkpoint's architecture
        raw = read_json(Path(m.hf_config or "").expanduser()) if hf_raw is None else hf_raw
        llama = Llama(
            llama_config(raw, seq_len=m.seq_len, remat=m.remat, attention=m.attention), lora
        )
        llama.hf_config = raw  # hf.save / export --format hf write this architecture
        return llama
    if m.vocab_size is None:
        raise ValueError("model.vocab_size is not set (a run takes it from its data)")
    if m.arch == "gpt":
        if lora is not None:
            raise ValueError("LoRA adapts Llama-family models (model.arch: llama, or a fine-tune)")
        extra = [k for k in LLAMA_ONLY if getattr(m, k) is not None and k != "rope_theta"]
        if extra:
            raise ValueError(f"model.{extra[0]} applies to arch: llama only")
        gpt_fields = {f.name for f in dataclasses.fields(GPTConfig)}
        return GPT(GPTConfig(**{k: v for k, v in dataclasses.asdict(m).items() if k in gpt_fields}))
    if m.arch == "llama":
        return Llama(
            LlamaConfig(
                vocab_size=m.vocab_size,
                hidden_size=m.d_model,
                intermediate_size=m.d_ff or llama_ff(m.d_model),
                num_hidden_layers=m.n_layers,
                num_attention_heads=m.n_heads,
                num_key_value_heads=m.n_kv_heads,
                head_dim=m.head_dim,
                rope_theta=float(m.rope_theta),
                tie_word_embeddings=m.tie_embeddings,
                seq_len=m.seq_len,
                max_position_embeddings=max(m.seq_len, 2048),
                remat=m.remat,
                attention=m.attention,
            ),
            lora,
        )
    raise ValueError(f"unknown model.arch {m.arch!r}: use one of {ARCHS}")
