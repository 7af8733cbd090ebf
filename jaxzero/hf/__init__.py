"""Hugging Face checkpoints in and out: Llama, Qwen2, Qwen3, Mistral, SmolLM3, Gemma 2,
Gemma 3 (text) and Qwen3.5 (text), any stage, any mesh.

    model = jaxzero.hf.model("path/to/Llama-3.2-1B")               # reads config.json
    engine = model.engine(optax.adamw(1e-5), stage=3)
    state = jaxzero.hf.load("path/to/Llama-3.2-1B", engine, model)  # each device: its slice
    ...                                                             # train
    jaxzero.hf.save("out/", model, engine, state)                   # transformers loads it

``load`` reads the safetensors files memory-mapped, one param at a time and only the
slices this process's devices hold, converting bf16/fp16/fp32 on disk into the
engine's fp32 master; ``save`` streams one param at a time into shards that
``AutoModelForCausalLM.from_pretrained`` loads unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from jaxzero import modeldir
from jaxzero.ema import NO_EMA
from jaxzero.hf import peft as peft_lib
from jaxzero.hf.peft import Adapter
from jaxzero.hf.safetensors import SafetensorsError, SafetensorsFile
from jaxzero.hf.safetensors import write as write_safetensors
from jaxzero.models import lora as lora_lib
from jaxzero.models.llama import Llama
from jaxzero.models.llama_hf import (
    CONFIG,
    GENERATION_CONFIG,
    HFError,
    hf_config,
    hf_names,
    is_stacked,
    llama_config,
    read_json,
)
from jaxzero.models.lora import QUANTIZED, LoraConfig
from jaxzero.models.quant import BLOCK, quantize
from jaxzero.partition import LeafLayout, is_layout, layouts_for, path_str
from jaxzero.readback import iter_params
from jaxzero.state import TrainState

__all__ = ["HFError", "SafetensorsError", "check", "load", "model", "read_params", "save"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": None, "float16": np.dtype(np.float16)}


def model(path: str | Path, lora: LoraConfig | None = None, **overrides: Any) -> Llama:
    """The :class:`Llama` a Hugging Face directory's ``config.json`` describes.

    ``overrides`` set jaxzero's own fields (``seq_len``, ``remat``, ``attention``);
    ``lora`` adds adapters (:mod:`jaxzero.models.lora`; the base then trains frozen).
    The result remembers the directory and its config, so :func:`save` writes the
    same architecture and copies the tokenizer.
    """
    path = Path(path)
    if not path.is_dir():
        raise HFError(
            f"{path} is not a directory (a Hugging Face model directory holds "
            f"{CONFIG} and safetensors weights)"
        )
    raw = read_json(path / CONFIG)
    cfg = llama_config(raw, **overrides)
    if cfg.tie_word_embeddings and _separate_head(path):
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    m = Llama(cfg, lora)
    m.hf_dir, m.hf_config = path, raw
    return m


def _separate_head(path: Path) -> bool:
    """A checkpoint declaring tied embeddings that ships an ``lm_head.weight`` of other
    values: ``transformers`` then keeps the two apart, and so does jaxzero."""
    weights = Weights(path)
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if head not in weights.where or embed not in weights.where:
        return False
    a, b = weights.tensor(head), weights.tensor(embed)
    return a.shape != b.shape or not np.array_equal(a, b)


class Weights:
    """The tensors of a checkpoint directory: ``model.safetensors``, or the shards an
    ``model.safetensors.index.json`` maps names to. Files open lazily and stay mapped."""

    def __init__(self, path: Path):
        self.path = path
        self._files: dict[Path, SafetensorsFile] = {}
        if (path / INDEX).is_file():
            weight_map = read_json(path / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFError(f"{path / INDEX} has no weight_map")
            self.where = {name: path / file for name, file in weight_map.items()}
        elif (path / SINGLE).is_file():
            self.where = {name: path / SINGLE for name in self._file(path / SINGLE).names()}
        else:
            found = sorted(p.name for p in path.glob("*.safetensors"))[:3]
            other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pth"))[:3]
            raise HFError(
                f"{path} has neither {SINGLE} nor {INDEX}"
                + (
                    f" (found {', '.join(found)})"
                    if found
                    else ": no safetensors weights"
                    + (f" (found {', '.join(other)})" if other else "")
                    + "; jaxzero reads safetensors only: save the model with transformers' "
                    "save_pretrained, which writes them"
                )
            )

    def _file(self, file: Path) -> SafetensorsFile:
        if file not in self._files:
            if not file.is_file():
                raise HFError(f"{file} is missing (listed in {INDEX})")
            self._files[file] = SafetensorsFile(file)
        return self._files[file]

    def _holder(self, name: str) -> SafetensorsFile:
        if name not in self.where:
            raise HFError(f"tensor {name} is missing from {self.path}")
        f = self._file(self.where[name])
        if name not in f.header:
            raise HFError(f"tensor {name} is missing from {f.path} (the index lists it there)")
        return f

    def shape(self, name: str) -> tuple[int, ...]:
        return self._holder(name).shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self._holder(name).dtype(name)

    def tensor(self, name: str) -> np.ndarray:
        """A memory-mapped view: only what is indexed out of it is read."""
        return self._holder(name).tensor(name)


def _sources(m: Llama, weights: Weights, layouts: list[LeafLayout]) -> dict[str, list[str]]:
    """Every param's checkpoint tensors, checked for presence and shape before any read."""
    cfg = m.config
    out = {}
    for lay in layouts:
        names = hf_names(lay.path, cfg)
        want = lay.shape[1:] if is_stacked(lay.path) else lay.shape
        for name in names:
            shape = weights.shape(name)
            if shape != want:
                raise HFError(
                    f"tensor {name} has shape {list(shape)}; the config needs {list(want)}"
                )
        out[lay.path] = names
    return out


def _reader(path: Path, m: Llama, adapter: Adapter | None = None, seed: int = 0) -> tuple[Any, Any]:
    """The params' shapes and ``read(layout, index) -> fp32 slice`` over the checkpoint,
    every tensor checked for presence and shape first.

    A LoRA model (``m.lora``) reads its base from the checkpoint, each frozen weight
    keeping the checkpoint's dtype, and its adapters from ``adapter`` (a PEFT adapter,
    checked against the base's shapes) or fresh as peft makes them (A drawn from ``seed``
    and the param's name, B zero). A QLoRA base (``m.lora.base_dtype``) is quantized as
    it is read, whole rows at a time (:mod:`jaxzero.models.quant`)."""
    weights = Weights(path)
    # the key made inside the trace: this starts no JAX backend, so a run can check a
    # checkpoint before it sets up (simulated) devices
    shapes = jax.eval_shape(lambda: m.init(jax.random.key(0)))
    lays = jax.tree.leaves(layouts_for(shapes, 1), is_leaf=is_layout)
    lora = {lay.path: lay.shape for lay in lays if lora_lib.trainable(lay.path)}
    quant = {lay.path: _dequantized(lay, shapes) for lay in lays if _is_quantized(lay.path)}
    plain = [lay for lay in lays if lay.path not in lora and lay.path not in quant]
    names = _sources(m, weights, plain + list({w.path: w for w in quant.values()}.values()))
    if adapter is not None:
        if m.lora is None:
            raise HFError(f"{path}: an adapter needs a model with LoRA (model(..., lora=...))")
        peft_lib.check_adapter(adapter, lora, "the PEFT adapter")
    fresh: dict[str, np.ndarray] = {}
    kind = (m.lora.base_dtype if m.lora is not None else None) or ""

    def adapted(lay: LeafLayout) -> np.ndarray:
        if adapter is not None:
            return adapter.tensors[lay.path]
        if lay.path not in fresh:
            rng = np.random.default_rng([seed, zlib.crc32(lay.path.encode())])
            a = lay.path.endswith("lora_A")
            fresh[lay.path] = (
                lora_lib.init_a(rng, lay.shape) if a else np.zeros(lay.shape, np.float32)
            )
        return fresh[lay.path]

    def read(lay: LeafLayout, index: tuple[slice, ...]) -> np.ndarray:
        if lay.path in lora:
            return adapted(lay)[index]
        if lay.path in quant:  # whole rows of the weight, quantized, then this region's part
            whole = quant[lay.path]
            rows = read(whole, (*index[:-1], slice(0, whole.shape[-1])))
            part = "codes" if lay.path.endswith("_codes") else "scale"
            return quantize(rows, kind)[part][..., index[-1]]
        srcs = names[lay.path]
        stacked = is_stacked(lay.path)
        parts = srcs[index[0]] if stacked else srcs[:1]
        try:
            out = [weights.tensor(n)[index[1:] if stacked else index] for n in parts]
            out = [_finite(x.astype(np.float32), n, path) for x, n in zip(out, parts, strict=True)]
        except OSError as e:  # a file that shrank or vanished after its header was read
            raise HFError(f"{path}: reading {srcs[0]} failed ({e})") from None
        return np.stack(out) if stacked else out[0]

    if m.lora is not None:  # the frozen base is stored in the checkpoint's dtype
        dtypes = {p: weights.dtype(srcs[0]) for p, srcs in names.items() if p not in quant}
        shapes = jax.tree.map(
            lambda lay, s: jax.ShapeDtypeStruct(s.shape, dtypes.get(lay.path, s.dtype)),
            layouts_for(shapes, 1),
            shapes,
            is_leaf=is_layout,
        )
    return shapes, read


def _is_quantized(path: str) -> bool:
    return re.search(QUANTIZED, path) is not None


def _dequantized(lay: LeafLayout, shapes: Any) -> LeafLayout:
    """The layout of the weight a QLoRA ``.../weight_codes`` or ``weight_scale`` quantizes
    (its last dim from the scale's blocks)."""
    module = lay.path.rsplit("/", 1)[0]
    node = shapes
    for k in module.split("/"):
        node = node[k]
    shape = (*node["weight_scale"].shape[:-1], node["weight_scale"].shape[-1] * BLOCK)
    return LeafLayout(f"{module}/weight", tuple(shape), None, 1)


def _finite(x: np.ndarray, name: str, path: Path) -> np.ndarray:
    """``x``, or an error naming the tensor: a NaN or inf in the weights would otherwise
    surface as a non-finite loss at step 1, which reads as a learning-rate problem."""
    if not np.isfinite(x).all():
        bad = np.count_nonzero(~np.isfinite(x))
        kind = "NaN" if np.isnan(x).any() else "inf"
        raise HFError(
            f"{path}: tensor {name} holds {kind} ({bad:,} non-finite value(s) in the part "
            "read): the checkpoint is damaged; re-download or re-export it"
        )
    return x


def check(path: str | Path, m: Llama | None = None) -> Llama:
    """``m`` (default: :func:`model` of ``path``) once every tensor it needs is found in
    ``path`` with its shape and a dtype jaxzero reads: what :func:`load` refuses, refused
    before anything is built or compiled. Values (non-finite ones) are checked as they load.
    """
    path = Path(path)
    m = model(path) if m is None else m
    _reader(path, m)
    return m


def load(
    path: str | Path,
    engine: Any,
    m: Llama | None = None,
    adapter: Adapter | None = None,
    seed: int = 0,
) -> TrainState:
    """A train state (step 0, fresh optimizer) with the checkpoint's params, written
    straight into ``engine``'s shardings.

    Each param is read memory-mapped, only over the slices this process's devices
    hold, and converted to fp32 (the master precision), so host memory grows by about
    one param, not the model. ``engine`` comes from ``m.engine(...)`` and need not be
    initialised; ``m`` is the :class:`Llama` it was built from (default: the
    checkpoint's, :func:`model` of ``path``: pass it when you have it, so that
    ``config.json`` is read once). With LoRA (``m.lora``, ``model(path, lora=...)``) the
    base is frozen in the checkpoint's dtype and the adapters come from ``adapter``
    (:func:`jaxzero.hf.peft.read_adapter`) or fresh from ``seed``.
    """
    path = Path(path)
    m = model(path) if m is None else m
    shapes, read = _reader(path, m, adapter, seed)
    return engine._init_from_slices(_stored(shapes, m, engine.compute_dtype), read)


def param_shapes(path: str | Path, m: Llama, compute_dtype: Any) -> Any:
    """The params' shapes and dtypes as :func:`load` stores them in an engine computing
    in ``compute_dtype`` (a LoRA base in its dtype, no wider than the compute dtype; a
    QLoRA base as codes and scales), reading only the files' headers: what a planner
    compiles the run's step with."""
    return _stored(_reader(Path(path), m)[0], m, compute_dtype)


def _stored(shapes: Any, m: Llama, compute_dtype: Any) -> Any:
    """A LoRA model's frozen base no wider than the run computes in (a bf16 run keeps
    it bf16, an fp32 run the checkpoint's dtype); other models' shapes as they are."""
    if m.lora is None:
        return shapes
    compute = np.dtype(compute_dtype)

    def narrow(path: Any, s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        name = path_str(path)
        base = not lora_lib.trainable(name) and not _is_quantized(name)
        wide = jnp.issubdtype(s.dtype, jnp.floating) and s.dtype.itemsize > compute.itemsize
        return jax.ShapeDtypeStruct(s.shape, compute) if base and wide else s

    return jax.tree_util.tree_map_with_path(narrow, shapes)


def read_params(path: str | Path, m: Llama | None = None) -> dict[str, Any]:
    """The checkpoint's params as host fp32 arrays (whole: for one-device use such as
    sampling; training loads with :func:`load`)."""
    path = Path(path)
    m = model(path) if m is None else m
    shapes, read = _reader(path, m)
    layouts = layouts_for(shapes, 1)
    return jax.tree.map(
        lambda lay: read(lay, tuple(slice(0, n) for n in lay.shape)), layouts, is_leaf=is_layout
    )


# --------------------------------------------------------------------------- save


def _plan(
    entries: list[tuple[str, np.dtype, tuple[int, ...]]], max_bytes: int
) -> list[list[tuple[str, np.dtype, tuple[int, ...]]]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor alone), as
    ``transformers`` shards."""
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        n = int(np.prod(e[2])) * e[1].itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return shards


def write_model(
    path: str | Path,
    m: Llama,
    leaves: list[tuple[str, tuple[int, ...]]],
    arrays: Iterator[np.ndarray],
    dtype: str = "bfloat16",
    max_shard_size: int = 5 * 2**30,
    overwrite: bool = False,
    writer: bool = True,
    tokenizer: Path | None = None,
    protected: dict[str, Path | None] | None = None,
) -> Path:
    """Write a Hugging Face model directory from params given one at a time.

    ``leaves`` are ``(jaxzero param path, logical shape)`` in the order ``arrays``
    yields them (fp32 or any float; stacked ``layers/...`` and ``linear_layers/...``
    params whole). The tokenizer
    files come from ``tokenizer`` (default: the model's source directory, ``m.hf_dir``).
    What ``path`` may replace, and how it is built beside it and moved into place
    whole, is :mod:`jaxzero.modeldir`'s rule; the source directory and ``protected``
    are never replaced. ``writer=False`` consumes ``arrays`` (collective gathers on
    other processes) and writes nothing.
    """
    if dtype not in SAVE_DTYPES:
        raise HFError(f"dtype {dtype!r}: use one of {sorted(SAVE_DTYPES)}")
    np_dtype = SAVE_DTYPES[dtype] or np.dtype(ml_dtypes.bfloat16)
    path = Path(path)
    source = getattr(m, "hf_dir", None)
    try:  # on every process: all refuse together, before any collective gather
        modeldir.check_target(
            path, overwrite, {"the model's source directory": source, **(protected or {})}
        )
        tok_files = modeldir.tokenizer_files(source if tokenizer is None else tokenizer)
    except modeldir.ModelDirError as e:
        raise HFError(str(e)) from None
    entries = []
    for leaf, shape in leaves:
        stacked = is_stacked(leaf)
        for name in hf_names(leaf, m.config):
            entries.append((name, np_dtype, tuple(shape[1:] if stacked else shape)))

    def tensors() -> Iterator[np.ndarray]:
        for (leaf, _), x in zip(leaves, arrays, strict=True):
            for part in x if is_stacked(leaf) else [x]:
                yield np.asarray(part).astype(np_dtype)

    shards = _plan(entries, max_shard_size)
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    stream = tensors()
    if not writer:
        for _ in stream:  # the gathers are collective: take part, write nothing
            pass
        return path
    try:
        with modeldir.staged(path, "hf") as tmp:
            for file, group in zip(files, shards, strict=True):
                part = (x for _, x in zip(group, stream, strict=False))
                write_safetensors(tmp / file, group, part, {"format": "pt"})
            _write_side_files(tmp, m, dtype, files, shards)
            modeldir.copy_tokenizer(tok_files, tmp)
    except OSError as e:
        raise HFError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def save(
    path: str | Path,
    m: Llama,
    engine: Any,
    state: TrainState,
    dtype: str = "bfloat16",
    max_shard_size: int = 5 * 2**30,
    overwrite: bool = False,
    ema: bool = False,
) -> Path:
    """Write ``state``'s params (of the Llama ``m``, trained by ``engine``) as a Hugging
    Face model directory; ``ema=True``: the EMA of the weights (``Engine(ema=...)``)
    instead of the live params, refused in one line for a state without one.

    ``config.json`` (the source's, when the model came from :func:`model`),
    ``generation_config.json``, safetensors of ``dtype`` with ``{"format": "pt"}``
    metadata in shards of at most ``max_shard_size`` bytes (with
    ``model.safetensors.index.json`` when there are several), the tokenizer and
    chat-template files of the source directory (:data:`jaxzero.modeldir.TOKENIZER_FILES`)
    and a ``jaxzero-export.json`` manifest; ``transformers`` loads it with
    ``AutoModelForCausalLM.from_pretrained(path)``. bf16 runs write their fp32 master
    params, rounded once. One param is on the host at a time. ``path`` may be new, empty
    or an earlier jaxzero output; anything else needs ``overwrite=True`` (which
    replaces it whole), and the model's source directory is never replaced. Every
    process must call; process 0 writes.
    """
    if not isinstance(m, Llama):
        raise HFError(
            f"hf.save writes a Llama (jaxzero.hf.model(path), or model.arch=llama), "
            f"not a {type(m).__name__}"
        )
    leaves = [(lay.path, lay.shape) for lay in engine.plan.leaves()]
    if leaves != _leaves(m):
        raise HFError(
            "hf.save: the engine's params are not this model's (pass the Llama the engine "
            "was built from)"
        )
    if ema and state.ema is None:
        raise HFError(NO_EMA)
    arrays = (x for _, x in iter_params(engine.plan, state, ema))
    out = write_model(
        path, m, leaves, arrays, dtype, max_shard_size, overwrite, writer=jax.process_index() == 0
    )
    if jax.process_count() > 1:  # the others return once the directory is in place
        multihost_utils.sync_global_devices(f"jaxzero.hf.save {out}")
    return out


def _leaves(m: Llama) -> list[tuple[str, tuple[int, ...]]]:
    """``(param path, shape)`` of ``m``'s params in tree order, nothing allocated."""
    shapes = jax.eval_shape(lambda: m.init(jax.random.key(0)))
    return [
        (lay.path, lay.shape) for lay in jax.tree.leaves(layouts_for(shapes, 1), is_leaf=is_layout)
    ]


def _write_side_files(out: Path, m: Llama, dtype: str, files: list[str], shards: list) -> None:
    source = getattr(m, "hf_config", None)
    (out / CONFIG).write_text(json.dumps(hf_config(m.config, dtype, source), indent=2) + "\n")
    src_dir = getattr(m, "hf_dir", None)
    if src_dir is not None and (Path(src_dir) / GENERATION_CONFIG).is_file():
        shutil.copyfile(Path(src_dir) / GENERATION_CONFIG, out / GENERATION_CONFIG)
    else:
        gen = {k: (source or {}).get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (out / GENERATION_CONFIG).write_text(
            json.dumps(
                {"_from_model_config": True, **{k: v for k, v in gen.items() if v is not None}},
                indent=2,
            )
            + "\n"
        )
    if len(files) > 1:
        total = sum(int(np.prod(s)) * d.itemsize for g in shards for _, d, s in g)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: f for f, g in zip(files, shards, strict=True) for name, _, _ in g},
        }
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
