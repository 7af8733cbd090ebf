"""Hugging Face ``config.json`` to :class:`LlamaConfig` and back, and the weight names:
next to the config they build, so that :mod:`jaxzero.models` needs nothing above it
(:mod:`jaxzero.hf` reads and writes the weights, and re-exports these names).

``transformers`` 5 keeps the rotary settings under ``rope_parameters``
(``{"rope_type", "rope_theta", ...}``); earlier versions keep ``rope_theta`` at the top
level and the scaling under ``rope_scaling``. Both are read; what this module writes
for a model it did not load carries both spellings, so either line loads it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxzero.errors import Error
from jaxzero.models.llama import LlamaConfig
from jaxzero.models.rope import ROPE_TYPES

__all__ = ["HFError", "hf_config", "hf_names", "llama_config"]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# what each architecture puts on its projections: (q/k/v bias, o bias) fixed, or None
# when the config's ``attention_bias`` decides both
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", None),
    "Qwen2ForCausalLM": ("qwen2", (True, False)),
    "MistralForCausalLM": ("mistral", (False, False)),
}
SUPPORTED = ", ".join(ARCHITECTURES)


class HFError(Error, ValueError):
    """A Hugging Face directory jaxzero cannot use; its message is one line."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a missing, unreadable or non-object file is one line."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(
            f"{path.parent} has no {path.name}: not a Hugging Face model directory"
        ) from None
    except (OSError, ValueError) as e:
        raise HFError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise HFError(f"{path} is not a JSON object")
    return value


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either spelling; ``None`` scaling: default."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in (params or legacy).items() if k != "rope_theta"}
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind not in ROPE_TYPES:
        raise HFError(f"rope type {kind!r} is not supported (jaxzero has {', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFError("partial_rotary_factor != 1 is not supported")
    return float(theta), (None if kind == "default" else {"rope_type": kind, **scaling})


def llama_config(raw: dict[str, Any], **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``config.json`` (already parsed); ``overrides`` set
    jaxzero's own fields (``seq_len``, ``remat``, ``attention``)."""
    archs = raw.get("architectures") or [raw.get("model_type", "?")]
    arch = archs[0] if isinstance(archs, list) and archs else str(archs)
    if arch not in ARCHITECTURES:
        raise HFError(f"architecture {arch} is not supported: jaxzero loads {SUPPORTED}")
    _, biases = ARCHITECTURES[arch]
    if raw.get("hidden_act", "silu") != "silu":
        raise HFError(f"hidden_act {raw['hidden_act']!r} is not supported (SwiGLU needs silu)")
    if arch == "MistralForCausalLM" and raw.get("sliding_window") is not None:
        raise HFError(
            f"sliding_window={raw['sliding_window']} is not supported: jaxzero's "
            "attention is full causal (set it to null only if every sequence is "
            "shorter than the window)"
        )
    if raw.get("use_sliding_window"):
        raise HFError(
            "use_sliding_window=true is not supported: jaxzero's attention is full causal"
        )
    theta, scaling = _rope(raw)
    bias = bool(raw.get("attention_bias", False))
    qkv_bias, o_bias = biases if biases is not None else (bias, bias)
    try:
        fields = {
            "vocab_size": raw["vocab_size"],
            "hidden_size": raw["hidden_size"],
            "intermediate_size": raw["intermediate_size"],
            "num_hidden_layers": raw["num_hidden_layers"],
            "num_attention_heads": raw["num_attention_heads"],
        }
    except KeyError as e:
        raise HFError(f"{CONFIG} has no {e.args[0]!r}") from None
    max_pos = raw.get("max_position_embeddings", 2048)
    fields.update(
        num_key_value_heads=raw.get("num_key_value_heads"),
        head_dim=raw.get("head_dim"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        initializer_range=float(raw.get("initializer_range", 0.02)),
        seq_len=min(max_pos, 2048),
    )
    fields.update(overrides)
    try:
        return LlamaConfig(**fields)
    except (TypeError, ValueError) as e:
        raise HFError(f"{CONFIG}: {e}") from None


def hf_config(cfg: LlamaConfig, dtype: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` that ``transformers`` loads ``cfg`` from: the source's own
    (architecture, token ids, everything jaxzero does not read) when there is one."""
    if source is not None:  # tie: a shipped lm_head of other values unties (hf.model)
        return {
            **source,
            "dtype": dtype,
            "torch_dtype": dtype,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        }
    if cfg.o_bias and not cfg.qkv_bias:
        raise HFError("no supported architecture has an o_proj bias without q/k/v biases")
    if cfg.qkv_bias != cfg.o_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        arch, model_type = "LlamaForCausalLM", "llama"
    rope = {"rope_type": "default", **(cfg.rope_scaling or {})}
    out = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        **{
            f.name: getattr(cfg, f.name)
            for f in dataclasses.fields(cfg)
            if f.name not in ("qkv_bias", "o_bias", "rope_scaling", "seq_len", "remat", "attention")
        },
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "rope_scaling": cfg.rope_scaling,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if model_type == "qwen2":
        out.pop("attention_bias")
        out["use_sliding_window"] = False
    return out


# --------------------------------------------------------------------------- weight names


def hf_names(name: str, num_layers: int) -> list[str]:
    """The checkpoint tensors of the jaxzero param ``name`` (``partition.path_str``'s
    ``a/b/c``): one per layer for the stacked ``layers/...`` params
    (``model.layers.{i}.``), else one.

    A mapping between two persisted formats, not a second naming of leaves: Hugging
    Face names a tensor by its module path joined by ``.``, under ``model.``, and
    has one tensor per layer where jaxzero stacks them.

    Example:
      >>> hf_names("layers/mlp/up_proj/weight", 2)
      ['model.layers.0.mlp.up_proj.weight', 'model.layers.1.mlp.up_proj.weight']
    """
    path = name.split("/")
    if path[0] == "layers":
        rest = ".".join(path[1:])
        return [f"model.layers.{i}.{rest}" for i in range(num_layers)]
    if path[0] == "lm_head":
        return [".".join(path)]
    return ["model." + ".".join(path)]
