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
``transformers`` 5, ``max_window_layers``; Gemma 2/3: ``layer_types``, or every
second / sixth layer full; SmolLM3: ``layer_types``, or the no-rope layers when
``use_sliding_window``). SmolLM3 adds ``no_rope_layers``; Gemma 2 and 3 their norms,
GeGLU, embedding scale, attention scale and soft-caps, Gemma 3 a rope base of its
sliding layers (``rope_parameters`` keyed by layer type in ``transformers`` 5,
``rope_local_base_freq`` before). Qwen3.5 (text) adds its Gated DeltaNet layers
(``layer_types`` of ``linear_attention``/``full_attention``, or one full layer in every
``full_attention_interval``), their ``linear_*`` shapes, the gated attention output,
``partial_rotary_factor`` (in ``rope_parameters``; its ``mrope_*`` keys change nothing
for text, whose three position rows are equal) and the ``1 + weight`` norms.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxzero.errors import Error
from jaxzero.models.llama import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING, STACKS, LlamaConfig
from jaxzero.models.llama_layers import ACTIVATIONS
from jaxzero.models.rope import ROPE_TYPES

__all__ = ["HFError", "hf_config", "hf_names", "is_stacked", "llama_config"]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class Family:
    """What an architecture sets of the one decoder: its ``model_type``; its projection
    biases, ``(q/k/v, o)`` fixed or None when ``attention_bias`` decides both; Qwen3's
    q/k norms; where its sliding window is kept (``None``: it has none, ``"all"``:
    ``sliding_window`` on every layer, ``"layers"``: Qwen2's and Qwen3's
    ``use_sliding_window``/``layer_types``/``max_window_layers``, ``"types"``: Gemma's
    ``layer_types`` or one full layer in every ``pattern`` (Gemma 3: its config's
    ``sliding_window_pattern``, default 6), ``"nope"``: SmolLM3's
    ``layer_types`` or its no-rope layers); whether it has ``mlp_bias``; SmolLM3's
    ``no_rope_layers``; Gemma's norms, GeGLU and scales (``gemma``), whether it applies
    ``attn_logit_softcapping`` (Gemma 2; ``transformers``' Gemma 3 reads the key and
    ignores it), Gemma 3's local rope base; Qwen3.5's linear-attention layers, gated
    attention output, partial rope and ``1 + weight`` norms (``hybrid``); and the values
    its ``transformers`` config class gives keys a ``config.json`` lacks."""

    model_type: str
    biases: tuple[bool, bool] | None
    qk_norm: bool = False
    window: str | None = None
    mlp_bias: bool = False
    no_rope: bool = False
    gemma: bool = False
    attn_softcap: bool = False
    local_rope: bool = False
    pattern: int = 0
    hybrid: bool = False
    defaults: tuple[tuple[str, Any], ...] = ()


_GEMMA = (
    ("head_dim", 256),
    ("hidden_activation", "gelu_pytorch_tanh"),
    ("query_pre_attn_scalar", 256),
    ("sliding_window", 4096),
    ("tie_word_embeddings", True),
)
# the one list of what jaxzero reads (and refuses everything else by name)
ARCHITECTURES = {
    "LlamaForCausalLM": Family("llama", None, mlp_bias=True),
    "Qwen2ForCausalLM": Family("qwen2", (True, False), window="layers"),
    "Qwen3ForCausalLM": Family("qwen3", None, qk_norm=True, window="layers"),
    "MistralForCausalLM": Family("mistral", (False, False), window="all"),
    "SmolLM3ForCausalLM": Family(
        "smollm3",
        None,
        window="nope",
        mlp_bias=True,
        no_rope=True,
        defaults=(("rope_theta", 2e6), ("tie_word_embeddings", True)),
    ),
    "Gemma2ForCausalLM": Family(
        "gemma2",
        None,
        window="types",
        gemma=True,
        attn_softcap=True,
        pattern=2,
        defaults=(*_GEMMA, ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)),
    ),
    "Gemma3ForCausalLM": Family(
        "gemma3_text",
        None,
        qk_norm=True,
        window="types",
        gemma=True,
        local_rope=True,
        defaults=(*_GEMMA, ("rope_theta", 1e6), ("rope_local_base_freq", 1e4)),
    ),
    "Qwen3_5ForCausalLM": Family(
        "qwen3_5_text",
        None,
        qk_norm=True,
        hybrid=True,
        defaults=(
            ("head_dim", 256),
            ("num_key_value_heads", 4),
            ("partial_rotary_factor", 0.25),
            ("linear_conv_kernel_dim", 4),
            ("linear_key_head_dim", 128),
            ("linear_value_head_dim", 128),
            ("linear_num_key_heads", 16),
            ("linear_num_value_heads", 32),
        ),
    ),
}
# LlamaConfig's fields of Qwen3.5's linear-attention layers, as config.json names them
LINEAR_FIELDS = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
SUPPORTED = ", ".join(ARCHITECTURES)
# LlamaConfig's fields of Gemma's options (False or None: off)
GEMMA_FIELDS = (
    "norm_offset",
    "sandwich_norms",
    "embed_scale",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
)
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


# rope_parameters' keys that are not the scaling's: Qwen3.5's partial rope, and its
# multimodal rope's sections, which give text (three equal position rows) plain rope
_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _rope(raw: dict[str, Any], partial: bool = False) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either spelling; ``None`` scaling: default.
    ``partial``: the family reads ``partial_rotary_factor`` (Qwen3.5), else it must be 1."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in (params or legacy).items() if k not in _NOT_SCALING}
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind not in ROPE_TYPES:
        raise HFError(f"rope type {kind!r} is not supported (jaxzero has {', '.join(ROPE_TYPES)})")
    if not partial and _partial_rotary_factor(raw) != 1.0:
        raise HFError("partial_rotary_factor != 1 is not supported")
    return float(theta), (None if kind == "default" else {"rope_type": kind, **scaling})


def _partial_rotary_factor(raw: dict[str, Any]) -> float:
    """The fraction of each head rope rotates: ``rope_parameters``' (transformers 5) or
    the top level's."""
    params = raw.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))


def _qwen3_5(raw: dict[str, Any], family: Family) -> dict[str, Any]:
    """The :class:`LlamaConfig` fields of Qwen3.5's options (none for the others): its
    ``layer_types`` (or one full layer in every ``full_attention_interval``, as
    ``transformers`` fills them), the linear layers' shapes, the gated attention output,
    partial rope and ``1 + weight`` norms."""
    if not family.hybrid:
        return {}
    layers = raw.get("num_hidden_layers")
    types = raw.get("layer_types")
    if types is None and isinstance(layers, int):
        every = raw.get("full_attention_interval", 4)
        types = [LINEAR_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(layers)]
    if not isinstance(types, list | tuple) or (isinstance(layers, int) and len(types) != layers):
        raise HFError(f"{CONFIG}: layer_types must list one type for each of the {layers} layers")
    for i, t in enumerate(types):
        if t not in (FULL_ATTENTION, LINEAR_ATTENTION):
            raise HFError(
                f"layer_types: layer {i} is {t!r}, which is not supported "
                f"(jaxzero's Qwen3.5 has {LINEAR_ATTENTION} and {FULL_ATTENTION})"
            )
    return dict(
        layer_types=tuple(types),
        norm_offset=True,
        attn_output_gate=True,
        partial_rotary_factor=_partial_rotary_factor(raw),
        **{name: raw[name] for name in LINEAR_FIELDS},
    )


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
    types = raw.get("layer_types") if family.window != "all" else None
    if types is None and family.window == "types":  # Gemma: one full layer in every pattern
        # Gemma 3 reads the pattern from sliding_window_pattern; Gemma 2 alternates
        every = raw.get("sliding_window_pattern", 6) if family.local_rope else family.pattern
        types = [SLIDING if (i + 1) % every else FULL_ATTENTION for i in range(layers)]
    elif types is None and family.window == "nope":  # SmolLM3: the no-rope layers, if any
        rope = _no_rope_layers(raw, layers)
        on = raw.get("use_sliding_window", False) and window is not None
        types = [SLIDING if on and not r else FULL_ATTENTION for r in rope]
    elif types is None:  # Mistral: every layer; before transformers 5: from max_window_layers on
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
            f"layer_types has {SLIDING} layers but no sliding_window (null, or "
            "use_sliding_window false): transformers cannot run it either"
        )
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise HFError(f"sliding_window must be a positive integer, got {window!r}")
    if window is None or SLIDING not in types:
        return None, None
    return window, (None if FULL_ATTENTION not in types else tuple(types))


def _no_rope_layers(raw: dict[str, Any], layers: int) -> list[int]:
    """SmolLM3's flag a layer (1: rotary, 0: none): ``no_rope_layers`` (its first
    ``layers``, as ``transformers`` indexes it), or every ``no_rope_layer_interval``-th
    layer without."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        every = raw.get("no_rope_layer_interval", 4)
        return [int((i + 1) % every != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) < layers or any(f not in (0, 1) for f in flags):
        raise HFError(f"no_rope_layers must list a 0 or 1 for each of the {layers} layers")
    return [int(f) for f in flags[:layers]]


def _gemma3_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """``(rope_theta, rope_scaling, rope_local_base_freq)`` of Gemma 3: the full
    layers' and the sliding layers' from ``rope_parameters`` keyed by layer type
    (``transformers`` 5), or ``rope_theta``/``rope_scaling`` and
    ``rope_local_base_freq`` (earlier)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL_ATTENTION in params or SLIDING in params):
        full = {"rope_theta": raw["rope_theta"], **(params.get(FULL_ATTENTION) or {})}
        local = {"rope_theta": raw["rope_local_base_freq"], **(params.get(SLIDING) or {})}
        theta, scaling = _rope({"rope_parameters": full})
        local_theta, local_scaling = _rope({"rope_parameters": local})
        if local_scaling is not None:
            raise HFError(
                f"rope_parameters.{SLIDING}: rope type {local_scaling['rope_type']!r} is not "
                "supported on Gemma 3's sliding layers (jaxzero has default there)"
            )
        return theta, scaling, local_theta
    theta, scaling = _rope(raw)
    return theta, scaling, float(raw["rope_local_base_freq"])


def _gemma(raw: dict[str, Any], family: Family) -> dict[str, Any]:
    """The :class:`LlamaConfig` fields of Gemma's options (none for the others)."""
    if not family.gemma:
        return {}
    if raw.get("use_bidirectional_attention"):
        raise HFError("use_bidirectional_attention=true is not supported: jaxzero is causal")

    def cap(key: str) -> float | None:
        return None if raw.get(key) is None else float(raw[key])

    return dict(
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]),
        attn_logit_softcapping=cap("attn_logit_softcapping") if family.attn_softcap else None,
        final_logit_softcapping=cap("final_logit_softcapping"),
    )


def llama_config(raw: dict[str, Any], **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``config.json`` (already parsed); ``overrides`` set
    jaxzero's own fields (``seq_len``, ``remat``, ``attention``)."""
    arch = architecture(raw)
    family = ARCHITECTURES[arch]
    raw = {**dict(family.defaults), **raw}
    biases = family.biases
    act = raw.get("hidden_activation", raw.get("hidden_act", "silu"))
    if family.gemma:  # transformers' Gemma reads hidden_activation, not hidden_act
        act = raw["hidden_activation"]
    if act not in ACTIVATIONS:
        raise HFError(f"activation {act!r} is not supported (jaxzero has {', '.join(ACTIVATIONS)})")
    window, layer_types = _windows(raw, family)
    local_theta = None
    if family.local_rope:
        theta, scaling, local_theta = _gemma3_rope(raw)
    else:
        theta, scaling = _rope(raw, partial=family.hybrid)
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
        hidden_act=act,
        initializer_range=float(raw.get("initializer_range", 0.02)),
        seq_len=min(max_pos, 2048),
        **_gemma(raw, family),
    )
    fields.update(_qwen3_5(raw, family))  # its layer_types: linear and full attention
    if family.no_rope and isinstance(fields["num_hidden_layers"], int):
        flags = _no_rope_layers(raw, fields["num_hidden_layers"])
        fields["no_rope_layers"] = None if all(flags) else tuple(flags)
    if local_theta is not None and window is not None:
        fields["rope_local_base_freq"] = local_theta
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
    skip: tuple[str, ...] = ("qkv_bias", "o_bias", "rope_scaling", "seq_len", "remat")
    skip = (*skip, "attention", "qk_norm")
    skip = (*skip, *GEMMA_FIELDS, "no_rope_layers", "rope_local_base_freq", "hidden_act")
    skip = (*skip, "partial_rotary_factor", "attn_output_gate", *LINEAR_FIELDS)
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
    windows = cfg.windows or ()
    types = [SLIDING if w == cfg.sliding_window else FULL_ATTENTION for w in windows]
    types = types or [FULL_ATTENTION] * cfg.num_hidden_layers
    if family.window == "layers":
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
    elif family.window == "all":  # every layer windowed
        out["sliding_window"] = cfg.sliding_window if cfg.windows else None
        out.pop("layer_types")
    else:  # SmolLM3, Gemma: layer_types (Gemma's masks want a window even if no layer has one)
        unused = None if family.window == "nope" else cfg.max_position_embeddings
        out.update(
            sliding_window=cfg.sliding_window if windows else unused,
            layer_types=types,
        )
    if family.no_rope:
        out.update(
            no_rope_layers=list(cfg.no_rope_layers or (1,) * cfg.num_hidden_layers),
            use_sliding_window=bool(windows),
            # SmolLM3Config's defaults are its own tokenizer's ids, past a smaller vocabulary
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
    if family.gemma:
        scalar = cfg.query_pre_attn_scalar or cfg.head_size
        out.pop("hidden_act")
        out.update(
            hidden_activation=cfg.hidden_act,
            # an int in transformers' Gemma configs
            query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
            attn_logit_softcapping=cfg.attn_logit_softcapping,
            final_logit_softcapping=cfg.final_logit_softcapping,
        )
    if family.hybrid:  # Qwen3.5: its layer types, linear layers' shapes, partial rope
        out.update(
            layer_types=list(cfg.layer_types or [FULL_ATTENTION] * cfg.num_hidden_layers),
            rope_parameters={
                **out["rope_parameters"],
                "partial_rotary_factor": cfg.partial_rotary_factor,
            },
            **{name: getattr(cfg, name) for name in LINEAR_FIELDS},
        )
    if family.local_rope:  # a rope a layer type; transformers 4's spelling too
        full = {**rope, "rope_theta": cfg.rope_theta}
        local = cfg.rope_local_base_freq
        sliding = full if local is None else {"rope_type": "default", "rope_theta": local}
        out.update(
            rope_parameters={FULL_ATTENTION: full, SLIDING: sliding},
            rope_local_base_freq=sliding["rope_theta"],
        )
    return out


def _architecture_of(cfg: LlamaConfig) -> str:
    """The architecture that holds exactly ``cfg`` (a model built here, with no source
    config.json), or one line saying none does."""
    windows = cfg.windows
    if cfg.interval or cfg.attn_output_gate:
        return _qwen3_5_of(cfg)
    if cfg.partial_rotary_factor != 1.0:
        raise HFError(
            "no supported architecture but Qwen3.5 (linear_attention layers, attn_output_gate) "
            "has partial_rotary_factor != 1"
        )
    gemma = [f for f in GEMMA_FIELDS if getattr(cfg, f)]
    if gemma:
        return _gemma_of(cfg, gemma)
    if cfg.hidden_act != "silu" or cfg.rope_local_base_freq is not None:
        raise HFError(
            "no supported architecture has hidden_act or rope_local_base_freq without "
            "Gemma's norms (norm_offset, sandwich_norms, embed_scale)"
        )
    if cfg.no_rope_layers is not None:
        if cfg.qk_norm or cfg.qkv_bias != cfg.o_bias:
            raise HFError(
                "SmolLM3 (no_rope_layers) has no q/k norms, and biases on all of q, k, v, o "
                "or on none"
            )
        return "SmolLM3ForCausalLM"
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


def _qwen3_5_of(cfg: LlamaConfig) -> str:
    """Qwen3.5 when ``cfg`` has its options together (gated attention output, q/k norms,
    ``1 + weight`` norms) and nothing it lacks, or one line saying what does not fit."""
    needed = ("attn_output_gate", "qk_norm", "norm_offset")
    missing = [f for f in needed if not getattr(cfg, f)]
    other = [f for f in GEMMA_FIELDS if f != "norm_offset" and getattr(cfg, f)]
    if missing or other or cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias or cfg.windows:
        raise HFError(
            f"Qwen3_5ForCausalLM has {', '.join(needed)} together, biases on all of q, k, v, o "
            "or on none, and no mlp_bias, sliding windows or Gemma's other options: "
            f"this model {'lacks ' + missing[0] if missing else 'has more'}"
        )
    return "Qwen3_5ForCausalLM"


def _gemma_of(cfg: LlamaConfig, gemma: list[str]) -> str:
    """Gemma 2 or Gemma 3 (q/k norms) when ``cfg`` has all of Gemma's norms and nothing
    either lacks, or one line saying what does not fit."""
    needed = ("norm_offset", "sandwich_norms", "embed_scale")
    missing = [f for f in needed if f not in gemma]
    if missing:
        raise HFError(f"Gemma has {', '.join(needed)} together: this model lacks {missing[0]}")
    arch = "Gemma3ForCausalLM" if cfg.qk_norm else "Gemma2ForCausalLM"
    if cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias or cfg.no_rope_layers is not None:
        raise HFError(
            f"{arch} has biases on all of q, k, v, o or on none, no mlp_bias and no no_rope_layers"
        )
    if arch == "Gemma3ForCausalLM" and cfg.attn_logit_softcapping is not None:
        raise HFError(
            "Gemma3ForCausalLM does not apply attn_logit_softcapping in transformers "
            "(q/k norms with soft-capped scores is no supported architecture)"
        )
    if arch == "Gemma2ForCausalLM" and cfg.rope_local_base_freq is not None:
        raise HFError("Gemma2ForCausalLM has one rope base (rope_local_base_freq: Gemma 3's)")
    return arch


# --------------------------------------------------------------------------- weight names


def is_stacked(name: str) -> bool:
    """Whether the jaxzero param ``name`` stacks layers on its leading dim (``layers/...``,
    ``linear_layers/...``)."""
    return name.split("/", 1)[0] in STACKS


def hf_names(name: str, layers: int | LlamaConfig) -> list[str]:
    """The checkpoint tensors of the jaxzero param ``name`` (``partition.path_str``'s
    ``a/b/c``): one per layer for the stacked params (``model.layers.{i}.``), else one.
    ``layers``: the model's config, whose layer types say which layers each stack holds
    (``layers``: the attention layers, ``linear_layers``: Qwen3.5's linear-attention
    ones), or a layer count (every layer in ``layers``).

    A mapping between two persisted formats, not a second naming of leaves: Hugging
    Face names a tensor by its module path joined by ``.``, under ``model.``, and
    has one tensor per layer where jaxzero stacks them.

    Example:
      >>> hf_names("layers/mlp/up_proj/weight", 2)
      ['model.layers.0.mlp.up_proj.weight', 'model.layers.1.mlp.up_proj.weight']
    """
    path = name.split("/")
    if path[0] in STACKS:
        rest = ".".join(path[1:])
        index = range(layers) if isinstance(layers, int) else layers.stack_layers(path[0])
        return [f"model.layers.{i}.{rest}" for i in index]
    if path[0] == "lm_head":
        return [".".join(path)]
    return ["model." + ".".join(path)]
