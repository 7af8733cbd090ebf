"""PEFT LoRA adapters in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

What ``peft.PeftModel.from_pretrained(base, DIR)`` loads and ``save_pretrained`` writes
for a causal LM: tensors ``base_model.model.model.layers.{i}.{module}.lora_{A,B}.weight``
(A ``r x in``, B ``out x r``, one per layer where jaxzero stacks layers) and the config's
``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``. Adapters that change more than
LoRA's A and B (DoRA, biases, ``modules_to_save``, per-module ranks) are refused in one
line, never loaded in part.

Example (a round trip):
  >>> import tempfile, numpy as np
  >>> from jaxzero.models.lora import LoraConfig
  >>> cfg = LoraConfig(rank=2, alpha=4, targets=("q_proj",))
  >>> ab = {"layers/self_attn/q_proj/lora_A": np.ones((3, 2, 8), np.float32),
  ...       "layers/self_attn/q_proj/lora_B": np.zeros((3, 8, 2), np.float32)}
  >>> d = tempfile.mkdtemp()
  >>> write_adapter(d, cfg, ab, base="my/base")
  >>> got = read_adapter(d)
  >>> got.config.rank, got.config.scale, got.base
  (2, 2.0, 'my/base')
  >>> got.tensors["layers/self_attn/q_proj/lora_A"].shape
  (3, 2, 8)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxzero.hf.safetensors import SafetensorsFile
from jaxzero.hf.safetensors import write as write_safetensors
from jaxzero.models.llama import LlamaConfig
from jaxzero.models.llama_hf import HFError
from jaxzero.models.lora import MARK, LoraConfig
from jaxzero.partition import path_str

__all__ = ["Adapter", "adapters_of", "merged", "read_adapter", "write_adapter"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.(lora_[AB])\.weight$")

# config fields whose non-default value means more than LoRA's A and B
_UNSUPPORTED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "fan_in_fan_out": (False, None),
    "layers_to_transform": (None,),
    "layer_replication": (None,),
    "lora_bias": (False, None),
    "trainable_token_indices": (None,),
}


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A PEFT adapter as jaxzero holds it: the config, the tensors under jaxzero's param
    names (stacked over layers, fp32), and the base it was made for."""

    config: LoraConfig
    tensors: dict[str, np.ndarray]
    base: str | None


def _stack_of(layer: int, layers: LlamaConfig | None) -> tuple[str, int]:
    """The stack that holds the model's layer ``layer`` and its index there: every layer
    is in ``layers`` unless the config (``layers``) has linear-attention layers
    (Qwen3.5), which ``linear_layers`` holds."""
    if layers is None or not layers.interval:
        return "layers", layer
    stack = "linear_layers" if layer in layers.linear_attention_layers else "layers"
    return stack, layers.stack_layers(stack).index(layer)


def read_adapter(path: str | Path, layers: LlamaConfig | None = None) -> Adapter:
    """A PEFT LoRA adapter directory (as ``save_pretrained`` wrote it); ``layers``: the
    base's config, which says which stack each layer's tensors go to (needed for
    Qwen3.5's two layer kinds; None: every layer in ``layers``)."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise HFError(f"{path} is not a PEFT adapter: it needs {CONFIG} and {WEIGHTS}")
    raw = json.loads((path / CONFIG).read_text())
    if raw.get("peft_type") != "LORA":
        raise HFError(f"{path}: peft_type {raw.get('peft_type')!r} is not LORA")
    for field, fine in _UNSUPPORTED.items():
        if field in raw and raw[field] not in fine:
            raise HFError(
                f"{path}: {field}={raw[field]!r} is not supported (jaxzero loads plain "
                "LoRA: A and B per target module, one rank and alpha)"
            )
    f = SafetensorsFile(path / WEIGHTS)
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    for key in f.names():
        m = _KEY.match(key)
        if m is None:
            raise HFError(f"{path}: tensor {key!r} is not a decoder layer's lora_A/lora_B")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layers is not None and layer >= layers.num_hidden_layers:
            raise HFError(
                f"{path}: tensor {key!r} is of layer {layer}; the base has "
                f"{layers.num_hidden_layers} layers"
            )
        stack, index = _stack_of(layer, layers)
        name = f"{stack}/" + module.replace(".", "/") + "/" + ab
        per_layer.setdefault(name, {})[index] = np.asarray(f.tensor(key), np.float32)
    tensors = {}
    for name, by_index in sorted(per_layer.items()):
        if sorted(by_index) != list(range(len(by_index))):
            raise HFError(
                f"{path}: {name} is in layers {sorted(by_index)}: jaxzero adapts every layer "
                "alike (its layers are stacked)"
            )
        tensors[name] = np.stack([by_index[i] for i in range(len(by_index))])
    modules = sorted({n.split("/", 1)[1].rsplit("/", 1)[0].replace("/", ".") for n in tensors})
    if not modules:
        raise HFError(f"{path}: {WEIGHTS} holds no LoRA tensors")
    config = LoraConfig(
        rank=int(raw["r"]),
        alpha=float(raw["lora_alpha"]),
        targets=tuple(modules),
        use_rslora=bool(raw.get("use_rslora", False)),
        dropout=float(raw.get("lora_dropout") or 0.0),
    )
    return Adapter(config, tensors, raw.get("base_model_name_or_path"))


def check_adapter(adapter: Adapter, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse an adapter made for another base: a tensor the model has no place for, or
    of another shape (``shapes``: the model's LoRA params, by name)."""
    for name, x in adapter.tensors.items():
        want = shapes.get(name)
        if want is None:
            have = sorted({n.rsplit("/", 1)[0] for n in shapes}) or ["none"]
            raise HFError(f"{where}: the adapter has {name} but the model adapts {', '.join(have)}")
        if tuple(x.shape) != tuple(want):
            raise HFError(
                f"{where}: the adapter's {name} is {list(x.shape)}, the base needs "
                f"{list(want)}: it was made for another base model"
            )
    missing = sorted(set(shapes) - set(adapter.tensors))
    if missing:
        raise HFError(f"{where}: the adapter lacks {missing[:3]} the model adapts")


# which model layer each entry of a stack is: the model's config, or ``{stack: layers}``
# (what a checkpoint records, :func:`jaxzero.train.merged.stack_layers`)
Layers = LlamaConfig | Mapping[str, Sequence[int]]


def peft_key(name: str, layer: int, layers: Layers | None = None) -> str:
    """The PEFT tensor name of entry ``layer`` of jaxzero's stacked ``layers/.../lora_A``
    (or ``linear_layers/...``: ``layers``, the base's config or the stacks' layers, maps
    the stack's entry to the model's layer; None: the same index, every layer in
    ``layers``)."""
    stack, rest = name.split("/", 1)
    module = rest.rsplit("/", 1)[0].replace("/", ".")
    if layers is None:
        index = layer
    else:
        held = layers.stack_layers(stack) if isinstance(layers, LlamaConfig) else layers[stack]
        index = held[layer]
    return f"{PREFIX}model.layers.{index}.{module}.{name.rsplit('/', 1)[1]}.weight"


def write_adapter(
    path: str | Path,
    config: LoraConfig,
    tensors: dict[str, np.ndarray],
    base: str | None,
    dtype: Any = np.float32,
    layers: Layers | None = None,
) -> None:
    """Write ``tensors`` (jaxzero's stacked ``.../lora_A`` / ``lora_B``, host arrays)
    as a PEFT adapter directory that ``PeftModel.from_pretrained`` loads over ``base``
    (``layers``: the base's config or the stacks' layers, mapping Qwen3.5's two stacks
    to its layers; required for a model with ``linear_layers``, whose attention layers
    are not the first ones). The directory is created; files in it of these two names
    are replaced atomically, nothing else in it is touched."""
    path = Path(path)
    names = sorted(n for n in tensors if n.rsplit("/", 1)[-1] in MARK)
    if layers is None and any(n.startswith("linear_layers/") for n in names):
        raise HFError(
            "write_adapter: adapters of linear_layers (Qwen3.5) need layers= (the base's "
            "config) to name each by its model layer"
        )
    path.mkdir(parents=True, exist_ok=True)
    entries, arrays = [], []
    for name in names:
        x = tensors[name]
        for i in range(x.shape[0]):
            entries.append((peft_key(name, i, layers), np.dtype(dtype), tuple(x.shape[1:])))
            arrays.append(np.asarray(x[i], dtype))
    write_safetensors(path / WEIGHTS, entries, iter(arrays), {"format": "pt"})
    modules = sorted({n.split("/", 1)[1].rsplit("/", 1)[0].split("/")[-1] for n in names})
    raw: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "target_modules": modules,
        "use_rslora": config.use_rslora,
        "lora_dropout": config.dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    tmp = path / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path / CONFIG)


def adapters_of(params: Any) -> dict[str, np.ndarray]:
    """A LoRA model's adapters (``.../lora_A``, ``.../lora_B``) out of its whole params
    tree (e.g. :meth:`jaxzero.Engine.gather_params`), by name: what
    :func:`write_adapter` writes."""
    return {
        path_str(p): np.asarray(x, np.float32)
        for p, x in jax.tree_util.tree_leaves_with_path(params)
        if path_str(p).rsplit("/", 1)[-1] in MARK
    }


def merged(params: dict[str, Any], config: LoraConfig) -> dict[str, Any]:
    """The params with each adapter folded into its weight, ``W + scale * B @ A`` in
    fp32 (host arrays, the nested dict of :class:`~jaxzero.models.llama.Llama`), and
    the adapters removed: what ``transformers`` loads as a plain model."""

    def fold(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: fold(v) for k, v in node.items() if k not in MARK}
        if "lora_A" in node and "lora_B" in node:
            a, b = np.asarray(node["lora_A"], np.float32), np.asarray(node["lora_B"], np.float32)
            w = np.asarray(node["weight"], np.float32)
            out["weight"] = w + np.float32(config.scale) * np.matmul(b, a)
        return out

    return fold(params)
