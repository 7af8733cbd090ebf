"""``jaxzero sample``: text from a run, checkpoint, export or Hugging Face directory.

The params come either from an export (``model.safetensors`` + ``config.json``)
or straight from a checkpoint through the same leaf-by-leaf reader as
``jaxzero export``; either way they are upcast to fp32 and the model runs on one
device, since sampling one sequence needs no sharding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxzero import cli, hf
from jaxzero.checkpoint import nest, read_metadata
from jaxzero.cli import ArgError, Parser
from jaxzero.data.tokenizer import Tokenizer, TokenizerError, unk_share, unk_warning
from jaxzero.hf import safetensors
from jaxzero.models import Model, from_fields
from jaxzero.models.llama_hf import GENERATION_CONFIG
from jaxzero.partition import path_str
from jaxzero.train import merged
from jaxzero.train.data import decode
from jaxzero.train.export import (
    CONFIG,
    DTYPES,
    MODEL_FIELDS,
    WEIGHTS,
    ExportError,
    describe_source,
    find_step_dir,
    model_fields,
    run_config,
    token_kind,
)


def load_model(path: str | Path, step: int | None = None) -> tuple[Model, dict[str, Any], str]:
    """``(model, fp32 params, token kind)`` from a Hugging Face model directory (token
    ids in and out), an export dir or any checkpoint location."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG).is_file() and "architectures" in _json(path / CONFIG):
        try:
            llama = hf.model(path)
            return llama, hf.read_params(path, llama), "ids"
        except (hf.HFError, hf.SafetensorsError) as e:
            raise ExportError(str(e)) from None
    if path.is_dir() and (path / WEIGHTS).is_file():
        try:
            config = json.loads((path / CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise ExportError(
                f"export {path} has no readable {CONFIG} ({type(e).__name__})"
            ) from None
        flat = {k: v.astype(np.float32) for k, v in safetensors.read_all(path / WEIGHTS).items()}
        source = str(path / CONFIG)
    else:
        step_dir = find_step_dir(path, step)
        run, meta = run_config(step_dir), read_metadata(step_dir)
        config = {**model_fields(run, meta), "tokens": token_kind(run)}
        lora = merged.lora_of(step_dir)  # a LoRA run: its base with the adapters merged in
        try:
            flat = {
                name: x
                for (name, _), x in zip(
                    merged.entries(meta, lora),
                    merged.arrays(step_dir, meta, lora, DTYPES["fp32"]),
                    strict=True,
                )
            }
        except hf.HFError as e:
            raise ExportError(str(e)) from None
        source = str(step_dir)
    fields = {k: config[k] for k in MODEL_FIELDS if config.get(k) is not None}
    try:
        model = from_fields(fields)
    except (TypeError, ValueError) as e:
        raise ExportError(f"{source}: model config is invalid ({e})") from None
    _check_shapes(model, flat, source)
    kind = config.get("tokens", "bytes")
    if kind not in ("bytes", "uint16", "tokenizer"):  # ("ids": Hugging Face dirs, above)
        raise ExportError(f"{source}: tokens must be bytes or uint16, not {kind!r}")
    return model, nest(flat), kind


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _check_shapes(model: Model, flat: dict[str, np.ndarray], source: str) -> None:
    """Refuse params that the config's model would not build, naming the first mismatch."""
    want = {
        path_str(p): tuple(x.shape)
        for p, x in jax.tree_util.tree_leaves_with_path(
            jax.eval_shape(model.init, jax.random.key(0))
        )
    }
    for name in sorted(set(want) | set(flat)):
        got = tuple(flat[name].shape) if name in flat else "absent"
        if want.get(name, "absent") != got:
            raise ExportError(
                f"{source}: param {name!r} is {got} but the model config "
                f"implies {want.get(name, 'absent')}"
            )


def prompt_ids(prompt: str, kind: str, tok: Tokenizer | None) -> tuple[np.ndarray, list[str]]:
    """The prompt's token ids, and a warning line for each way its text was lost: a
    prompt the tokenizer drops entirely, or mostly unknown tokens."""
    if tok is None:
        return encode_prompt(prompt, kind), []
    ids = np.asarray(tok.encode(prompt), np.int32)
    warnings = []
    if prompt and ids.size == 0:
        warnings.append(
            f"warning: the prompt {prompt!r} encodes to no tokens with "
            f"{tok.source or 'the tokenizer'}: sampling starts from token 0"
        )
    lost = unk_warning(tok, unk_share(tok, ids), "the prompt")
    return ids, warnings + ([lost] if lost else [])


def encode_prompt(prompt: str, kind: str) -> np.ndarray:
    """Byte tokens, or whitespace-separated ids for token-file and Hugging Face models
    (no tokenizer yet)."""
    if kind == "bytes":
        return np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int32)
    try:
        return np.asarray([int(t) for t in prompt.split()], np.int32)
    except ValueError:
        raise ExportError(
            "this model reads token ids: give --prompt as ids, e.g. '12 7 40'"
        ) from None


def find_tokenizer(path: str | Path, step: int | None = None) -> Path | None:
    """The tokenizer a model was trained with: ``tokenizer.json`` beside the weights (a
    Hugging Face directory, an export), else the run config's ``data.tokenizer``."""
    path = Path(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if path.is_dir() and ((path / WEIGHTS).is_file() or (path / CONFIG).is_file()):
        return None
    name = (run_config(find_step_dir(path, step)).get("data") or {}).get("tokenizer")
    return Path(name).expanduser() if name else None


def eos_ids(path: str | Path, model: Model, tok: Tokenizer | None) -> set[int]:
    """The tokens that end a reply: the tokenizer's EOS and the ``eos_token_id`` (an id or
    a list) of the model's ``config.json`` and of a ``generation_config.json`` beside the
    weights, where ``transformers``' ``generate`` reads it. Byte and bare-id models: none."""
    ids = set() if tok is None else {tok.eos_id}
    path = Path(path)
    configs = [getattr(model, "hf_config", None) or {}]
    if path.is_dir():
        configs.append(_json(path / GENERATION_CONFIG))
    for config in configs:
        value = config.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool):
                ids.add(i)
    return ids


def sample(
    path: str | Path,
    prompt: str = "def ",
    tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    step: int | None = None,
    tokenizer: str | Path | None = None,
    ignore_eos: bool = False,
) -> tuple[np.ndarray, str]:
    """``(generated token ids, prompt + generated text)``; deterministic given ``seed``.

    Text goes through ``tokenizer`` (default: the model's own, :func:`find_tokenizer`);
    without one, byte models read bytes and token models ids. Sampling stops after an
    end-of-text token (:func:`eos_ids`, kept in the output) unless ``ignore_eos``.
    """
    model, params, kind = load_model(path, step)
    tokenizer = tokenizer or find_tokenizer(path, step)
    if tokenizer is None and kind == "tokenizer":
        raise ExportError(
            f"{path} was trained with a tokenizer that is not recorded: give --tokenizer"
        )
    try:
        tok = Tokenizer.load(tokenizer) if tokenizer is not None else None
    except TokenizerError as e:
        raise ExportError(str(e)) from None
    ids, warnings = prompt_ids(prompt, kind, tok)
    for warning in warnings:
        print(warning, file=sys.stderr)
    if ids.size and int(ids.max()) >= model.config.vocab_size:
        raise ExportError(
            f"prompt token {int(ids.max())} is outside the model's vocabulary "
            f"of {model.config.vocab_size}"
        )
    if top_k is not None and not 1 <= top_k <= model.config.vocab_size:
        raise ExportError(f"--top-k must be in 1..{model.config.vocab_size}, got {top_k}")
    eos = set() if ignore_eos else eos_ids(path, model, tok)
    device = jax.devices()[0]  # one device: sampling needs no sharding
    params = jax.device_put(params, device)
    with jax.default_device(device):
        out = model.generate(
            params, ids[None], tokens, jax.random.key(seed), temperature, top_k, eos
        )[0]
    new = out[max(ids.size, 1) :]  # an empty prompt starts from token 0
    return new, decode(out if ids.size else new, kind, tok)


# --------------------------------------------------------------------------- CLI


def _sample_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxzero sample",
        description="Generate text with a run's model (GPT or "
        "Llama) from a run, checkpoint, export or Hugging Face model directory "
        "(text through its tokenizer, else bytes or token ids), on one device.",
    )
    p.add_argument(
        "path", metavar="RUN_OR_EXPORT", help="run, checkpoint, export or Hugging Face model dir"
    )
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens only")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="go on past the end-of-text token (default: stop after it, as transformers does)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json or a directory holding "
        "one (default: the model's own; without one, bytes or token ids)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """``jaxzero sample``: prints the prompt and the generated text."""

    def body(args: argparse.Namespace) -> None:
        if args.tokens < 0 or args.temperature < 0:
            raise ArgError("--tokens and --temperature must be >= 0")
        new, text = sample(
            args.path,
            args.prompt,
            args.tokens,
            args.temperature,
            args.top_k,
            args.seed,
            args.step,
            args.tokenizer,
            args.ignore_eos,
        )
        print(text)
        if len(new) < args.tokens:  # only an end-of-text token stops it early
            print(
                f"stopped at the end-of-text token {int(new[-1])} after {len(new)} of "
                f"{args.tokens} tokens (--ignore-eos goes on)",
                file=sys.stderr,
            )
        path = Path(args.path)
        if not (path / CONFIG).is_file():  # a run or checkpoint, not an export or HF dir
            print(describe_source(path, args.step), file=sys.stderr)

    return cli.run("sample", _sample_parser().parse_args, body, argv)
