"""``train.init_from: hf:PATH``: a run that starts from a Hugging Face checkpoint.

The checkpoint decides the model: its ``config.json`` sets the model fields (an
override that contradicts it is refused, naming the field) and is copied into the
run directory, which ``model.hf_config`` then names, so export, sample and
``--resume`` rebuild exactly this architecture without the source. Its
``tokenizer.json``, when it has one, is the data's tokenizer unless one is given.

A fine-tune also starts from other defaults than a pre-training run (:func:`defaults`):
the command line layers the config file, the flags and ``--set`` over them, so every
value a user gives wins.

A damaged checkpoint (a missing, truncated or wrong-shaped tensor, a missing shard, an
unreadable index, non-finite values) stops the run with one line, as ``jaxzero sample``
does: the tensors are checked before anything is created or compiled, their values as
they load. The checkpoint's ``config.json`` is read once at start-up, by
:func:`resolve`: the :class:`~jaxzero.models.Llama` it returns (its ``config``, the
``config.json`` as read, the directory) is what the run builds its engine from and
loads the weights into. Every process computes it from the checkpoint itself; none
reads back the copy process 0 writes (a second process would race it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jaxzero import hf
from jaxzero.modeldir import TOKENIZER_FILE as TOKENIZER
from jaxzero.models import Llama
from jaxzero.models.llama_hf import CONFIG, hf_config, llama_config, read_json
from jaxzero.train import lora_run
from jaxzero.train.config import Config, ConfigError, ModelConfig
from jaxzero.train.data import data_kind

HF_CONFIG = "hf_config.json"

# Fine-tuning defaults, where a fine-tune differs from the byte GPT's pre-training ones.
# Full fine-tuning (every weight trains) as TRL's SFTTrainer does it: its SFTConfig defaults
# to learning_rate 2e-5 and max_length 1024, over transformers' TrainingArguments (weight
# decay 0); Stanford Alpaca's published full fine-tune: 2e-5, weight decay 0, warmup_ratio
# 0.03, cosine. (2e-4, common in axolotl configs, is for LoRA adapters.) 1024 tokens hold
# most chat turns, and a longer window costs more per token (attention grows with it),
# which a CPU feels; a model with a shorter context keeps its own.
SEQ_LEN_CAP = 1024
LR = 2e-5
LORA_LR = 2e-4  # LoRA adapters (lora.rank): axolotl's and peft's examples' common rate
WEIGHT_DECAY = 0.0
WARMUP_FRACTION = 0.03


def source(cfg: Config) -> Path | None:
    """The checkpoint directory of ``train.init_from`` (None: a run from scratch)."""
    spec = cfg.train.init_from
    if spec is None:
        return None
    if not spec.startswith("hf:") or len(spec) == 3:
        raise ConfigError(f"train.init_from={spec!r}: use hf:PATH (a Hugging Face model directory)")
    return Path(spec[3:]).expanduser()


def defaults(cfg: Config) -> Config:
    """The defaults of a fine-tune of ``cfg``'s checkpoint: the model's context (at most
    ``SEQ_LEN_CAP`` tokens), lr ``LR``, no weight decay, ``WARMUP_FRACTION`` of the
    schedule's steps warming up, all of the data (no ``data.max_bytes``: the byte cap is
    for the built-in corpus), and a sample prompt from the validation data.

    Everything else is :class:`Config`'s default. ``cfg`` (what the user asked for)
    gives the checkpoint and the length of the schedule only: the caller lays the
    user's own settings over the result, so they always win.
    """
    path = source(cfg)
    if path is None:
        raise ConfigError("finetune.defaults needs train.init_from=hf:PATH")
    try:
        context = llama_config(read_json(path / CONFIG)).max_position_embeddings
    except hf.HFError as e:
        raise ConfigError(f"train.init_from: {e}") from None
    horizon = cfg.optimizer.decay_steps or cfg.train.steps
    base = Config()
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, seq_len=min(context, SEQ_LEN_CAP)),
        optimizer=dataclasses.replace(
            base.optimizer,
            lr=LORA_LR if lora_run.enabled(cfg) else LR,
            weight_decay=WEIGHT_DECAY,
            warmup_steps=math.ceil(WARMUP_FRACTION * horizon),
        ),
        data=dataclasses.replace(base.data, max_bytes=None),  # the user's data, all of it
        logging=dataclasses.replace(base.logging, sample_prompt=None),
    )


def defaults_note(cfg: Config) -> str:
    """``--print-config``'s comment: which of ``cfg``'s values are fine-tuning defaults."""
    ours = defaults(cfg)
    why = {
        "model.seq_len": f"the checkpoint's context, at most {SEQ_LEN_CAP}",
        "optimizer.warmup_steps": f"{WARMUP_FRACTION:.0%} of the steps",
        "logging.sample_prompt": "null: the first validation document's prompt",
        "data.max_bytes": "null: all of the data",
    }
    kept = []
    for key in ("model.seq_len", "optimizer.lr", "optimizer.weight_decay",
                "optimizer.warmup_steps", "data.max_bytes", "logging.sample_prompt"):  # fmt: skip
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value == getattr(getattr(ours, section), name):
            kept.append(f"{key} ({why[key]})" if key in why else key)
    if not kept:
        return ""
    return f"# fine-tuning defaults (train.init_from; a value you set wins): {', '.join(kept)}\n"


def pretrained(cfg: Config) -> Llama:
    """The model of ``train.init_from``'s checkpoint, with the run's LoRA adapters,
    sequence length, remat and attention; its files checked (a bad one: ConfigError)."""
    path = source(cfg)
    if path is None:
        raise ConfigError("a fine-tune's model needs train.init_from=hf:PATH")
    try:
        return hf.check(
            path,
            hf.model(
                path,
                lora=lora_run.adapters(cfg)[0],
                seq_len=cfg.model.seq_len,
                remat=cfg.model.remat,
                attention=cfg.model.attention,
            ),
        )
    except (hf.HFError, hf.SafetensorsError) as e:
        raise ConfigError(f"train.init_from: {e}") from None


def resolve(cfg: Config) -> tuple[Config, Llama]:
    """The config with the checkpoint's model fields (and tokenizer), and its model: the
    one reading of its ``config.json`` the run makes (:func:`pin_architecture`,
    ``train.loop.build`` and :func:`load` take the model)."""
    path, model = source(cfg), pretrained(cfg)
    assert path is not None
    c = model.config
    theirs: dict[str, Any] = {
        "arch": "llama",
        "vocab_size": c.vocab_size,
        "d_model": c.hidden_size,
        "n_layers": c.num_hidden_layers,
        "n_heads": c.num_attention_heads,
        "n_kv_heads": c.kv_heads,
        "head_dim": c.head_size,
        "d_ff": c.intermediate_size,
        "tie_embeddings": c.tie_word_embeddings,
        "rope_theta": c.rope_theta,
    }
    default = ModelConfig()
    for key, value in theirs.items():
        mine = getattr(cfg.model, key)
        if key != "arch" and mine != getattr(default, key) and mine != value:
            raise ConfigError(
                f"model.{key}={mine} contradicts the checkpoint's {value} "
                f"(train.init_from={cfg.train.init_from}): drop the override"
            )
    data = cfg.data
    if data.tokenizer is None:
        if not (path / TOKENIZER).is_file() and data_kind(data) == "bytes":
            raise ConfigError(
                f"train.init_from: {path} has no tokenizer (no {TOKENIZER}) to read the "
                "text data with: pass --tokenizer PATH (a tokenizer.json or a model "
                "directory holding one)"
            )
        if (path / TOKENIZER).is_file():
            data = dataclasses.replace(data, tokenizer=str(path))
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, **theirs), data=data
    ), model


def pin_architecture(
    cfg: Config, model: Llama, run_dir: Path, is_main: bool
) -> tuple[Config, dict[str, Any]]:
    """The config naming the run's copy of the checkpoint's effective ``config.json``
    (``model.hf_config``, which process 0 writes), and that config itself.

    The copy is for later commands (``--resume``, sample, export); this run trains
    ``model``, which every process computed from the checkpoint itself, never from the
    file: another process may not have written it yet.
    """
    out = run_dir / HF_CONFIG
    raw = hf_config(model.config, "float32", model.hf_config)
    if is_main:
        out.write_text(json.dumps(raw, indent=2) + "\n")
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, hf_config=str(out.absolute()))
    ), raw


def load(cfg: Config, engine: Any, model: Llama) -> Any:
    """The train state with the checkpoint's weights (:func:`jaxzero.hf.load`) into
    ``engine``, built from ``model`` (:func:`resolve`'s); a file that fails as it is
    read, or a non-finite value, is one line (ConfigError)."""
    path = source(cfg)
    assert path is not None  # a fine-tune's config
    try:
        return hf.load(path, engine, model, lora_run.adapters(cfg)[1], cfg.train.seed)
    except (hf.HFError, hf.SafetensorsError) as e:
        raise ConfigError(f"train.init_from: {e}") from None
