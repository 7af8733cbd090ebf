"""Hugging Face ``config.json`` to :class:`LlamaConfig` and back, and the weight names:
next to the config they build, so that :mod:`jaxzero.models` needs nothing above it
(:mod:`jaxzero.hf` reads and writes the weights, and re-exports these names).

``transformers`` 5 keeps the rotary settings under ``rope_parameters``
(``{"rope_type", "rope_theta", ...}``); earlier versions keep ``rope_theta`` at the top
level and the scaling under ``rope_scaling``. Both are read; what this module writes
for a model it did not load carries both spellings, so either line loads it.

The architectures are one decoder with options (:data:`ARCHITECTURES`): what each
puts on its projections, whether it has Qwen3's q/k norms, and where it keeps its
sliding window (Mistral: ``sliding_window`` on every layer; Qwen2/Qwen3:
``use_sliding_window`` with ``sliding_window``, and ``layer_types`` or, before
``transformers`` 5, ``max_window_layers``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxzero.errors import Error
from jaxzero.models.llama import FULL_ATTENTION, SLIDING, LlamaConfig
from jaxzero.models.rope import ROPE_TYPES

__all__ = ["HFError", "hf_config", "hf_names", "llama_config"]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class Family:
    """What an architecture sets of the one decoder: its ``model_type``; its projection
    biases, ``(q/k/v, o)`` fixed or None when ``attention_bias`` decides both; Qwen3's
    q/k norms; where its sliding window is kept (``None``: it has none, ``"all"``:
    ``sliding_window`` on every layer, ``"layers"``: Qwen2's and Qwen3's
    ``use_sliding_window``/``layer_types``/``max_window_layers``); and whether it has
    ``mlp_bias``."""

    model_type: str
    biases: tuple[bool, bool] | None
    qk_norm: bool = False
    window: str | None = None
    mlp_bias: bool = False


# the one list of what jaxzero reads (and refuses everything else by name)
ARCHITECTURES = {
    "LlamaForCausalLM": Family("llama", None, mlp_bias=True),
    "Qwen2ForCausalLM": Family("qwen2", (True, False), window="layers"),
    "Qwen3ForCausalLM": Family("qwen3", None, qk_norm=True, window="layers"),
    "MistralForCausalLM": Family("mistral", (False, False), window="all"),
}
SUPPORTED = ", ".join(ARCHITECTURES)
MAX_WINDOW_LAYERS = 28  # transformers' default for Qwen2 and Qwen3


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


def architecture(raw: dict[str, Any]) -> str:
    """The architecture a ``config.json`` names (``architectures[0]``, or its
    ``model_type``'s when it lists none); an unsupported one is refused in one line
    naming it and the supported ones."""
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs:
        arch = str(archs[0])
    elif isinstance(archs, str) and archs:
        arch = archs
    else:
        by_type = {f.model_type: a for a, f in ARCHITECTURES.items()}
        arch = by_type.get(str(raw.get("model_type")), f"of model_type {raw.get('model_type')!r}")
    if arch not in ARCHITECTURES:
        raise HFError(f"architecture {arch} is not supported: jaxzero loads {SUPPORTED}")
    return arch


def _windows(raw: dict[str, Any], family: Family) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` as ``transformers`` reads them for ``family``,
    in one spelling: ``(None, None)`` when no layer is windowed, ``layer_types`` None
    when every layer is."""
    if family.window is None:  # Llama has no window: transformers ignores these keys
        return None, None
    window = raw.get("sliding_window")
    if family.window == "layers" and not raw.get("use_sliding_window", False):
        window = None  # what transformers' Qwen2Config/Qwen3Config do
    layers = raw.get("num_hidden_layers")
    if not isinstance(layers, int):  # llama_config refuses it
        return None, None
    types = raw.get("layer_types") if family.window == "layers" else None
    if types is None:  # Mistral: every layer; before transformers 5: from max_window_layers on
        first = raw.get("max_window_layers", MAX_WINDOW_LAYERS) if family.window == "layers" else 0
        types = [
            SLIDING if window is not None and i >= first else FULL_ATTENTION for i in range(layers)
        ]
    if not isinstance(types, list | tuple) or len(types) != layers:
        raise HFError(f"{CONFIG}: layer_types must list one type for each of the {layers} layers")
    for i, t in enumerate(types):
        if t not in (FULL_ATTENTION, SLIDING):
            raise HFError(
                f"layer_types: layer {i} is {t!r}, which is not supported "
                f"(jaxzero has {FULL_ATTENTION} and {SLIDING})"
            )
    if SLIDING in types and window is None:
        raise HFError(
            f"layer_types has {SLIDING} layers but use_sliding_window is false or "
            "sliding_window null: transformers cannot run it either"
        )
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise HFError(f"sliding_window must be a positive integer, got {window!r}")
    if window is None or SLIDING not in types:
        return None, None
    return window, (None if FULL_ATTENTION not in types else tuple(types))


def llama_config(raw: dict[str, Any], **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``config.json`` (already parsed); ``overrides`` set
    jaxzero's own fields (``seq_len``, ``remat``, ``attention``)."""
    arch = architecture(raw)
    family = ARCHITECTURES[arch]
    biases = family.biases
    if raw.get("hidden_act", "silu") != "silu":
        raise HFError(f"hidden_act {raw['hidden_act']!r} is not supported (SwiGLU needs silu)")
    window, layer_types = _windows(raw, family)
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
        mlp_bias=family.mlp_bias and bool(raw.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        sliding_window=window,
        layer_types=layer_types,
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
    arch = _architecture_of(cfg)
    family = ARCHITECTURES[arch]
    rope = {"rope_type": "default", **(cfg.rope_scaling or {})}
    skip = ("qkv_bias", "o_bias", "rope_scaling", "seq_len", "remat", "attention", "qk_norm")
    out = {
        "architectures": [arch],
        "model_type": family.model_type,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip},
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "rope_scaling": cfg.rope_scaling,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if family.biases is not None:  # fixed by the architecture
        out.pop("attention_bias")
    if not family.mlp_bias:
        out.pop("mlp_bias")
    if family.window == "layers":
        windows = cfg.windows or ()
        types = [SLIDING if w == cfg.sliding_window else FULL_ATTENTION for w in windows]
        types = types or [FULL_ATTENTION] * cfg.num_hidden_layers
        leading_full = next((i for i, t in enumerate(types) if t == SLIDING), len(types))
        out.update(
            use_sliding_window=bool(windows),
            sliding_window=cfg.sliding_window if windows else None,
            # transformers 4 reads this, not layer_types: exact when windowed layers come last
            max_window_layers=leading_full,
            layer_types=types,
        )
    elif family.window is None:
        out.pop("sliding_window")
        out.pop("layer_types")
    else:  # every layer windowed
        out["sliding_window"] = cfg.sliding_window if cfg.windows else None
        out.pop("layer_types")
    return out


def _architecture_of(cfg: LlamaConfig) -> str:
    """The architecture that holds exactly ``cfg`` (a model built here, with no source
    config.json), or one line saying none does."""
    windows = cfg.windows
    if cfg.o_bias and not cfg.qkv_bias:
        raise HFError("no supported architecture has an o_proj bias without q/k/v biases")
    if cfg.qk_norm:
        if cfg.qkv_bias != cfg.o_bias:
            raise HFError("Qwen3 (q/k norms) has biases on all of q, k, v, o or on none")
        arch = "Qwen3ForCausalLM"
    elif cfg.qkv_bias != cfg.o_bias:
        arch = "Qwen2ForCausalLM"
    elif windows is None:
        arch = "LlamaForCausalLM"
    elif not cfg.qkv_bias and len(set(windows)) == 1:
        arch = "MistralForCausalLM"
    else:
        raise HFError(
            "no supported architecture has sliding windows on some layers only (or with "
            "biases on every projection) without Qwen2's biases or Qwen3's q/k norms"
        )
    if cfg.mlp_bias and not ARCHITECTURES[arch].mlp_bias:
        raise HFError(f"{arch} has no mlp_bias: only LlamaForCausalLM does")
    return arch


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
