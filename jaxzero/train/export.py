"""``jaxzero export``: consolidated weights out of a sharded checkpoint, as safetensors.

Export never materialises the model. Each param is read alone through
:class:`jaxzero.checkpoint.LeafReader` (orbax's public restore of that one leaf, on
the host; the checkpoint's format is known in :mod:`jaxzero.checkpoint` only), cut
to its logical region (the saving layout's zero padding dropped), verified,
converted, appended to the safetensors file and dropped, so host memory stays at a
few leaves however large the model. The safetensors header is computed from the
checkpoint's metadata first, which is what makes writing leaf by leaf possible
(the format is an 8-byte little-endian header length, a JSON header of
dtype/shape/offsets, then the raw bytes in order). The command sets its process up
for that first (:func:`jaxzero.checkpoint.host_reader_process`: JAX on the CPU, one
malloc arena).

bf16 runs export their fp32 master params (``master/...``), the truth the
optimizer updates, not the rounded working copy; ``--dtype bf16`` rounds that
once, as ``astype`` does. ``--ema`` exports the EMA of the weights (``--set train.ema``)
instead of the live params, in every format. ``jaxzero sample``
(:mod:`jaxzero.train.sample`) reads through here.

What ``--out`` may replace, the tokenizer files it gets, and building it beside and moving
it into place whole are :mod:`jaxzero.modeldir`'s rules (``jaxzero.hf.save``'s too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import yaml

from jaxzero import cli, hf, modeldir
from jaxzero.checkpoint import (
    NO_EMA,
    CheckpointError,
    complete_steps,
    has_ema,
    host_reader_process,
    is_step_dir,
    read_extra,
    read_metadata,
)
from jaxzero.cli import Parser
from jaxzero.errors import Error
from jaxzero.hf import safetensors
from jaxzero.hf.peft import write_adapter
from jaxzero.models import Llama, from_fields
from jaxzero.models.fields import EXPORTED
from jaxzero.train import merged
from jaxzero.train.args import RESOLVED_CONFIG as RUN_CONFIG
from jaxzero.train.config import DataConfig
from jaxzero.train.data import data_kind
from jaxzero.train.lora_run import config_of

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
MODEL_FIELDS = EXPORTED  # the run's model fields an export carries (jaxzero.models.fields)
FORMATS = ("jaxzero", "hf", "peft")
DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}


class ExportError(Error, ValueError):
    """A path that is not a run, checkpoint or export; its message is one line."""


# --------------------------------------------------------------------------- locating


def _run_checkpoints(run: Path) -> Path:
    """``RUN/checkpoints`` or the run's own ``checkpoint.dir``."""
    default = run / "checkpoints"
    if default.is_dir():
        return default
    configured = (_run_config(run).get("checkpoint") or {}).get("dir")
    if configured and (run / configured).is_dir():
        return run / configured
    raise ExportError(f"run {run} has no checkpoints (train it with --set checkpoint.every=K)")


def _run_config(run: Path) -> dict[str, Any]:
    try:
        return yaml.safe_load((run / RUN_CONFIG).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ExportError(f"{run / RUN_CONFIG} is unreadable ({type(e).__name__})") from None


def find_step_dir(path: str | Path, step: int | None = None) -> Path:
    """The step directory meant by a run dir, a checkpoints dir or a step dir."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise ExportError(f"{path} is a file, not a run, checkpoint or export directory")
    if is_step_dir(path):
        if step is not None and path.name != str(step):
            raise ExportError(f"{path} is the checkpoint of step {path.name}, not {step}")
        return path
    if (path / WEIGHTS).is_file():
        raise ExportError(f"{path} is an export, not a run or checkpoint")
    ckpts = _run_checkpoints(path) if (path / RUN_CONFIG).is_file() else path
    steps = complete_steps(ckpts)
    if not steps:
        raise ExportError(
            f"{path} is not a jaxzero run, checkpoint or export directory "
            f"(no {RUN_CONFIG}, checkpoint steps, meta/ or {WEIGHTS} in it)"
        )
    if step is None:
        return ckpts / str(steps[-1])
    if step not in steps:
        raise ExportError(f"no checkpoint of step {step} in {ckpts}; there are {steps}")
    return ckpts / str(step)


def run_config(step_dir: Path) -> dict[str, Any]:
    """The run's resolved config: the checkpoint's ``extra.config``, else ``RUN/config.yaml``."""
    try:
        config = read_extra(step_dir).get("config")
    except CheckpointError:
        config = None
    run = step_dir.parent.parent
    if not isinstance(config, dict) and (run / RUN_CONFIG).is_file():
        config = _run_config(run)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ExportError(
            f"checkpoint {step_dir} records no model config (extra.config.model) "
            f"and has no run {RUN_CONFIG} beside it"
        )
    return config


def token_kind(config: dict[str, Any]) -> str:
    """``bytes``, ``uint16`` or ``tokenizer``: how the run read its data
    (:func:`jaxzero.train.data.data_kind`, the one rule, on the run's data section)."""
    data = config.get("data") or {}
    if data.get("tokenizer"):
        return "tokenizer"
    known = {f.name for f in dataclasses.fields(DataConfig)}
    return data_kind(DataConfig(**{k: v for k, v in data.items() if k in known}))


def model_fields(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The model fields of a run config (:data:`MODEL_FIELDS`); a ``vocab_size`` taken
    from the data comes from the embedding's shape."""
    model = {k: config["model"][k] for k in MODEL_FIELDS if k in config["model"]}
    if model.get("vocab_size") is None:
        embedding = ["embed_tokens", "weight"] if model.get("arch") == "llama" else ["wte"]
        model["vocab_size"] = next(
            (e["shape"][0] for e in meta["param_tree"] if [k for _, k in e["path"]] == embedding),
            None,
        )
    return model


# --------------------------------------------------------------------------- export


def export_params(
    step_dir: Path, out_file: Path, dtype: str = "fp32", ema: bool = False
) -> dict[str, Any]:
    """Writes the checkpoint's logical params (``ema``: their EMA) to ``out_file``, one
    leaf in memory at a time."""
    meta = read_metadata(step_dir)
    lora = merged.lora_of(step_dir)
    entries = merged.entries(meta, lora)
    dt = DTYPES[dtype]
    header = {"format": "jaxzero", "step": str(meta.get("step"))}
    try:
        size = safetensors.write(
            out_file,
            [(n, dt, s) for n, s in entries],
            merged.arrays(step_dir, meta, lora, dt, ema),
            {**header, "ema": "true"} if ema else header,
        )
    except hf.HFError as e:  # a LoRA run's base, changed or gone
        raise ExportError(str(e)) from None
    return {
        "step": meta.get("step"),
        "params": len(entries),
        "bytes": size,
        "largest_leaf_bytes": max(math.prod(s) * dt.itemsize for _, s in entries),
    }


def _base_model(run: dict[str, Any]) -> Path | None:
    """The Hugging Face directory the run was fine-tuned from (``train.init_from``)."""
    spec = (run.get("train") or {}).get("init_from")
    return Path(spec[3:]).expanduser() if isinstance(spec, str) and spec[:3] == "hf:" else None


def _tokenizer(run: dict[str, Any]) -> Path | None:
    name = (run.get("data") or {}).get("tokenizer")
    return Path(name).expanduser() if name else None


def protected(step_dir: Path, run: dict[str, Any]) -> dict[str, Path | None]:
    """What an export reads from and so never replaces, even with ``--overwrite``."""
    tok = _tokenizer(run)
    data = (run.get("data") or {}).get("path")
    run_dir = step_dir.parent.parent
    if not (run_dir / RUN_CONFIG).is_file():
        run_dir = step_dir.parent  # a checkpoints directory of its own
    return {
        "the checkpoint exported": step_dir,
        "the run exported": run_dir,
        "the run's base model": _base_model(run),
        "the run's tokenizer": tok if tok is None or tok.is_dir() else tok.parent,
        "the run's data": Path(data).expanduser() if data else None,
    }


def export_hf(
    step_dir: Path,
    run: dict[str, Any],
    meta: dict[str, Any],
    out: Path,
    dtype: str,
    overwrite: bool,
    ema: bool = False,
) -> Path:
    """A Hugging Face model directory (``transformers`` loads it) from a Llama run
    (``ema``: the EMA of its weights)."""
    fields = model_fields(run, meta)
    if fields.get("arch") != "llama":
        raise ExportError(
            f"--format hf needs a model.arch=llama run; {step_dir} trained "
            f"{fields.get('arch') or 'gpt'} (export it with --format jaxzero)"
        )
    model = from_fields(fields)
    assert isinstance(model, Llama)  # arch: llama
    base = _base_model(run)
    if base is not None and base.is_dir():
        model.hf_dir = base  # its generation_config.json, as hf.save copies it
    lora = merged.lora_of(step_dir)  # a LoRA run: its base with the adapters merged in
    try:
        return hf.write_model(
            out,
            model,
            merged.entries(meta, lora),
            merged.arrays(step_dir, meta, lora, DTYPES["fp32"], ema),
            {"fp32": "float32", "bf16": "bfloat16"}[dtype],
            overwrite=overwrite,
            tokenizer=_tokenizer(run),
            protected=protected(step_dir, run),
        )
    except hf.HFError as e:
        raise ExportError(str(e)) from None


def export_peft(
    step_dir: Path, meta: dict[str, Any], out: Path, dtype: str, ema: bool = False
) -> Path:
    """A PEFT adapter directory (``PeftModel.from_pretrained(base, out)`` loads it over
    the run's base) from a LoRA run's checkpoint (``ema``: the adapters' EMA)."""
    lora = merged.lora_of(step_dir)
    if lora is None:
        raise ExportError(
            f"--format peft needs a LoRA run (lora.rank); {step_dir} trained every weight "
            "(export it with --format hf)"
        )
    # which model layer each stacked entry is (Qwen3.5's two stacks): the checkpoint's
    # own param tree says (the stacks' sizes, frozen ones included), whether or not the
    # base is still there; never the stack's index, which misnumbers the attention layers
    layers = merged.stack_layers(meta)
    if layers is None:
        raise ExportError(
            f"--format peft: {step_dir}'s metadata does not say which model layer each "
            "adapter is (its layers/ and linear_layers/ stacks' sizes fit no arrangement "
            "jaxzero builds): its meta/metadata is damaged or not a jaxzero Llama run's"
        )
    tensors = merged.adapters(step_dir, meta, ema)
    try:
        with modeldir.staged(out, "jaxzero") as tmp:
            write_adapter(tmp, config_of(lora), tensors, lora["path"], DTYPES[dtype], layers)
    except OSError as e:
        raise ExportError(f"cannot write --out {out}: {e.strerror or e}") from None
    return out


def export(
    path: str | Path,
    out: str | Path,
    dtype: str | None = None,
    step: int | None = None,
    format: str = "jaxzero",
    overwrite: bool = False,
    ema: bool = False,
) -> Path:
    """``out/model.safetensors`` + ``out/config.json`` + the run's tokenizer files from a
    run, checkpoints dir or step; ``format="hf"``: a Hugging Face directory (Llama runs).
    ``ema``: the EMA of the weights (a run trained with ``--set train.ema``) instead of
    the live params; a run without one is refused in one line.

    ``out`` is built beside itself and moved into place whole; it may be new, empty or
    an earlier export (:mod:`jaxzero.modeldir`); ``overwrite`` replaces anything else
    whole, but never the run, its checkpoints, base model, tokenizer or data."""
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}: use one of {FORMATS}")
    step_dir = find_step_dir(path, step)
    meta = read_metadata(step_dir)
    if ema and not has_ema(meta["leaves"]):
        raise ExportError(NO_EMA)
    run = run_config(step_dir)
    out = Path(out)
    if dtype is None:  # fp32; a LoRA run's merged model and adapter: its base's dtype
        dtype = merged.base_dtype(merged.lora_of(step_dir))
    try:
        modeldir.check_target(out, overwrite, protected(step_dir, run), "--overwrite")
        tok_files = modeldir.tokenizer_files(_tokenizer(run), required=True)
    except modeldir.ModelDirError as e:
        raise ExportError(str(e)) from None
    if format == "hf":
        return export_hf(step_dir, run, meta, out, dtype, True, ema)  # overwrite: checked above
    if format == "peft":
        return export_peft(step_dir, meta, out, dtype, ema)
    fields = model_fields(run, meta)
    try:
        with modeldir.staged(out, "jaxzero") as tmp:
            info = export_params(step_dir, tmp / WEIGHTS, dtype, ema)
            config = {
                **fields,
                "model_type": f"jaxzero-{fields.get('arch') or 'gpt'}",
                "dtype": DTYPES[dtype].name,
                "tokens": token_kind(run),
                "source": {
                    "checkpoint": str(step_dir.absolute()),
                    "step": info["step"],
                    "stage": meta.get("stage"),
                    "num_shards": meta.get("num_shards"),
                    "precision": meta.get("precision"),
                    "ema": ema,
                },
            }
            (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            modeldir.copy_tokenizer(tok_files, tmp)
    except OSError as e:
        what = "create" if not out.parent.is_dir() else "write"
        raise ExportError(f"cannot {what} --out {out}: {e.strerror or e}") from None
    return out


def describe_source(path: str | Path, step: int | None = None) -> str:
    """Which checkpoint step a command used, and a warning when the run trained (and
    logged) further than its latest checkpoint."""
    step_dir = find_step_dir(path, step)
    line = f"from the checkpoint of step {step_dir.name} ({step_dir})"
    metrics = step_dir.parent.parent / "metrics.jsonl"
    if step is None and metrics.is_file():
        try:
            logged = max(
                (
                    json.loads(x).get("step", 0)
                    for x in metrics.read_text().splitlines()
                    if x.strip()
                ),
                default=0,
            )
        except ValueError:
            logged = 0
        if step_dir.name.isdigit() and logged > int(step_dir.name):
            line += (
                f"; warning: the run logged step {logged}, after its latest checkpoint "
                "(it was stopped before saving; resume it to save the rest)"
            )
    return line


# --------------------------------------------------------------------------- CLI


def _export_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxzero export",
        description="Write a checkpoint's consolidated params "
        f"as {WEIGHTS} + {CONFIG}, streaming one leaf at a time.",
    )
    p.add_argument(
        "path", metavar="RUN_OR_CHECKPOINT", help="run dir, its checkpoints dir, or one step dir"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="new, empty or an earlier export")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="default fp32 (a LoRA run: its base's, bf16 for a bf16 base)",
    )
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="jaxzero",
        help="jaxzero: one safetensors file + config.json (default); hf: a Hugging "
        "Face model directory transformers loads (model.arch=llama runs; a LoRA run's "
        "adapters merged into its base); peft: a LoRA run's adapter, as peft saves it",
    )
    p.add_argument(
        "--ema",
        action="store_true",
        help="export the EMA of the weights (a run trained with --set train.ema=0.999) "
        "instead of the live params",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out whole even when it holds files jaxzero did not write (deleting "
        "them); an earlier export is replaced without it; the run's own directories, base "
        "model, tokenizer and data never are",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """``jaxzero export``."""

    def body(args: argparse.Namespace) -> None:
        host_reader_process()
        foreign = modeldir.foreign_entries(Path(args.out)) if args.overwrite else []
        out = export(
            args.path, args.out, args.dtype, args.step, args.format, args.overwrite, args.ema
        )
        if foreign:
            print(f"jaxzero export: {modeldir.describe_replaced(out, foreign)}", file=sys.stderr)
        print(
            f"exported {out} (Hugging Face format)"
            if args.format == "hf"
            else f"exported {out} (a PEFT LoRA adapter)"
            if args.format == "peft"
            else f"exported {out / WEIGHTS} and {out / CONFIG}"
        )
        print(describe_source(args.path, args.step), file=sys.stderr)

    return cli.run("export", _export_parser().parse_args, body, argv)
