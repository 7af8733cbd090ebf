"""A checkpoint's params as a plain model, one param at a time: what export and sample read.

Most checkpoints hold every param (:func:`jaxzero.checkpoint.param_entries` names where).
A LoRA run's hold only its adapters (:mod:`jaxzero.train.lora_run`): its plain model is
the base (read again from ``train.init_from``, refused if its fingerprint changed) with
each adapter folded in, ``W + scale * B @ A`` in fp32, as peft's ``merge_and_unload``
does. Either way one param is in host memory at a time. ``ema=True`` reads the EMA of
the weights (``--set train.ema``) where the live params are read otherwise: a LoRA run's
adapters' EMA, merged into its base.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxzero import hf
from jaxzero.checkpoint import LeafReader, param_entries, read_extra
from jaxzero.models.llama import STACKS
from jaxzero.models.llama_hf import hf_names, is_stacked
from jaxzero.models.lora import MARK
from jaxzero.partition import path_str
from jaxzero.train import lora_run
from jaxzero.train.config import ConfigError

Entry = tuple[str, tuple[int, ...]]


def lora_of(step_dir: Path) -> dict[str, Any] | None:
    """The LoRA record a checkpoint's ``extra`` holds (None: not a LoRA run's)."""
    try:
        record = read_extra(step_dir).get(lora_run.BASE)
    except Exception:  # noqa: BLE001 - a checkpoint without extra is no LoRA run's
        return None
    return record if isinstance(record, dict) else None


def base_dtype(lora: dict[str, Any] | None) -> str:
    """The dtype a run exports in by default: fp32, or a LoRA run's base's (``bf16`` for
    a bf16 base; fp32 for any other) when its base is still there to say."""
    if lora is None:
        return "fp32"
    try:
        weights = hf.Weights(Path(lora["path"]))
        first = next(iter(weights.where))
        return "bf16" if weights.dtype(first) == ml_dtypes.bfloat16 else "fp32"
    except (hf.HFError, OSError, StopIteration):
        return "fp32"


def entries(meta: dict[str, Any], lora: dict[str, Any] | None) -> list[Entry]:
    """``(name, shape)`` of the plain model's params, in the checkpoint's tree order."""
    if lora is None:
        return [(n, s) for n, _, s in param_entries(meta)]
    out = []
    for e in meta["param_tree"]:
        name = path_str([k for _, k in e["path"]])
        if name.rsplit("/", 1)[-1] not in MARK:
            out.append((name, tuple(e["shape"])))
    return out


def arrays(
    step_dir: Path,
    meta: dict[str, Any],
    lora: dict[str, Any] | None,
    dtype: np.dtype,
    ema: bool = False,
) -> Iterator[np.ndarray]:
    """Each of :func:`entries`' params as a host array of ``dtype``, one at a time
    (``ema``: the EMA of the weights)."""
    if lora is None:
        with LeafReader(step_dir) as reader:
            for _, leaf, shape in param_entries(meta, ema):
                yield reader.read(leaf, shape, dtype)
        return
    base = Path(lora["path"])
    try:
        lora_run.check_base(lora, base)
    except ConfigError as e:
        raise hf.HFError(str(e)) from None
    config = lora_run.config_of(lora)
    stored = {n: (leaf, shape) for n, leaf, shape in _stored_entries(meta, ema)}
    weights = hf.Weights(base)
    # the base's config says which layers each stack holds (Qwen3.5: two kinds)
    layers = hf.model(base).config
    with LeafReader(step_dir) as reader:
        for name, shape in entries(meta, lora):
            if name in stored:
                x = reader.read(*stored[name], np.dtype(np.float32))
            else:
                parts = [np.asarray(weights.tensor(n), np.float32) for n in hf_names(name, layers)]
                x = np.stack(parts) if is_stacked(name) else parts[0]
            module = name.rsplit("/", 1)[0]
            if name.endswith("/weight") and f"{module}/lora_A" in stored:
                a = reader.read(*stored[f"{module}/lora_A"], np.dtype(np.float32))
                b = reader.read(*stored[f"{module}/lora_B"], np.dtype(np.float32))
                x = x + np.float32(config.scale) * np.matmul(b, a)
            if x.shape != shape:
                raise hf.HFError(f"{base}: {name} is {list(x.shape)}, the run's is {list(shape)}")
            yield x.astype(dtype)


def adapters(step_dir: Path, meta: dict[str, Any], ema: bool = False) -> dict[str, np.ndarray]:
    """A LoRA checkpoint's adapters (``.../lora_A``, ``.../lora_B``), fp32 host arrays
    (``ema``: their EMA)."""
    with LeafReader(step_dir) as reader:
        return {
            name: reader.read(leaf, shape, np.dtype(np.float32))
            for name, leaf, shape in _stored_entries(meta, ema)
            if name.rsplit("/", 1)[-1] in MARK
        }


def _stored_entries(
    meta: dict[str, Any], ema: bool = False
) -> list[tuple[str, str, tuple[int, ...]]]:
    """:func:`param_entries` of the params the checkpoint holds (a LoRA run's adapters)."""
    held = [e for e in meta["param_tree"] if e.get("trainable", True)]
    return param_entries({**meta, "param_tree": held}, ema)


def stack_layers(meta: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """The model layer of each entry of the stacks (``layers``, ``linear_layers``), from
    the checkpoint's own param tree (every param's shape, trained or frozen): the stacks'
    leading dims. With no ``linear_layers`` every layer is in ``layers``, in order;
    with them the layers are Qwen3.5's groups of ``interval - 1`` linear-attention layers
    before each attention one (the one arrangement :class:`~jaxzero.models.llama.LlamaConfig`
    builds), ``interval`` the layers over the attention ones. None: sizes that fit no
    such arrangement (a tree without ``layers``)."""
    sizes: dict[str, int] = {}
    for e in meta.get("param_tree", ()):
        path = [k for _, k in e["path"]]
        if path and path[0] in STACKS and e["shape"]:
            sizes.setdefault(path[0], int(e["shape"][0]))
    full, linear = sizes.get("layers", 0), sizes.get("linear_layers", 0)
    if not linear:
        return {"layers": tuple(range(full))} if full else None
    if not full or (full + linear) % full:
        return None
    k = (full + linear) // full
    n = full + linear
    return {
        "layers": tuple(range(k - 1, n, k)),
        "linear_layers": tuple(i for i in range(n) if (i + 1) % k),
    }
