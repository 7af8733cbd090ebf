"""The reference models, and the one place a run's ``model:`` section becomes one.

``arch: gpt`` is the Flax Linen GPT (:mod:`jaxzero.models.gpt`); ``arch: llama`` the
Flax NNX Llama (:mod:`jaxzero.models.llama`), which also loads and saves Hugging Face
checkpoints (:mod:`jaxzero.hf`). Both take the same shape fields; the Llama reads
``n_kv_heads``, ``head_dim`` and ``rope_theta`` too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxzero.models.gpt import GPT, GPTConfig
from jaxzero.models.llama import Llama, LlamaConfig

ARCHS = ("gpt", "llama")
LLAMA_ONLY = ("n_kv_heads", "head_dim", "rope_theta")


def llama_ff(d_model: int) -> int:
    """SwiGLU width with a 4·d GELU MLP's parameters (3 matrices of 8/3·d), to 32."""
    return 32 * math.ceil(8 * d_model / 3 / 32)


def from_fields(fields: dict[str, Any], hf_raw: dict[str, Any] | None = None) -> Any:
    """A ``GPT`` or ``Llama`` from a run's model fields (``ModelConfig`` as a dict;
    absent fields take their defaults, ``vocab_size`` must be set).

    ``hf_raw``: the contents of the ``config.json`` that ``fields["hf_config"]`` names,
    when the caller has it already (a fine-tune's processes compute it; reading the
    file that one of them writes would race it).
    """
    arch = fields.get("arch") or "gpt"
    get = lambda k, default=None: default if fields.get(k) is None else fields[k]
    if fields.get("hf_config") or hf_raw is not None:  # a fine-tuned checkpoint's
        # here, not at the top: jaxzero.hf.config imports jaxzero.models.llama (a cycle)
        from jaxzero.hf.config import llama_config, read_json

        raw = read_json(Path(fields["hf_config"]).expanduser()) if hf_raw is None else hf_raw
        model = Llama(
            llama_config(
                raw,
                seq_len=get("seq_len", 128),
                remat=get("remat", "none"),
                attention=get("attention", "auto"),
            )
        )
        model.hf_config = raw  # hf.save / export --format hf write this architecture
        return model
    if arch == "gpt":
        extra = [k for k in LLAMA_ONLY if fields.get(k) is not None and k != "rope_theta"]
        if extra:
            raise ValueError(f"model.{extra[0]} applies to arch: llama only")
        names = (
            "vocab_size",
            "seq_len",
            "d_model",
            "n_layers",
            "n_heads",
            "d_ff",
            "tie_embeddings",
            "remat",
            "attention",
        )
        return GPT(GPTConfig(**{k: fields[k] for k in names if fields.get(k) is not None}))
    if arch == "llama":
        d = get("d_model", 128)
        return Llama(
            LlamaConfig(
                vocab_size=fields["vocab_size"],
                hidden_size=d,
                intermediate_size=get("d_ff", llama_ff(d)),
                num_hidden_layers=get("n_layers", 4),
                num_attention_heads=get("n_heads", 4),
                num_key_value_heads=get("n_kv_heads"),
                head_dim=get("head_dim"),
                rope_theta=float(get("rope_theta", 10000.0)),
                tie_word_embeddings=get("tie_embeddings", True),
                seq_len=get("seq_len", 128),
                max_position_embeddings=max(get("seq_len", 128), 2048),
                remat=get("remat", "none"),
                attention=get("attention", "auto"),
            )
        )
    raise ValueError(f"unknown model.arch {arch!r}: use one of {ARCHS}")
