"""``train.init_from: hf:PATH``: a run that starts from a Hugging Face checkpoint.

The checkpoint decides the model: its ``config.json`` sets the model fields (an
override that contradicts it is refused, naming the field) and is copied into the
run directory, which ``model.hf_config`` then names, so export, sample and
``--resume`` rebuild exactly this architecture without the source. Its
``tokenizer.json``, when it has one, is the data's tokenizer unless one is given.

A damaged checkpoint (a missing, truncated or wrong-shaped tensor, a missing shard, an
unreadable index, non-finite values) stops the run with one line, as ``jaxzero sample``
does: the tensors are checked before anything is created or compiled, their values as
they load. Every process computes the architecture it trains from the checkpoint
itself; none reads back the copy process 0 writes (a second process would race it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxzero import hf
from jaxzero.hf.config import hf_config
from jaxzero.train.config import Config, ConfigError, ModelConfig
from jaxzero.train.data import data_kind

HF_CONFIG = "hf_config.json"
TOKENIZER = "tokenizer.json"


def source(cfg: Config) -> Path | None:
    """The checkpoint directory of ``train.init_from`` (None: a run from scratch)."""
    spec = cfg.train.init_from
    if spec is None:
        return None
    if not spec.startswith("hf:") or len(spec) == 3:
        raise ConfigError(f"train.init_from={spec!r}: use hf:PATH (a Hugging Face model directory)")
    return Path(spec[3:]).expanduser()


def resolve(cfg: Config) -> tuple[Config, Any]:
    """The config with the checkpoint's model fields (and tokenizer), and its model."""
    path = source(cfg)
    if path is None:
        raise ConfigError("finetune.resolve needs train.init_from=hf:PATH")
    try:
        model = hf.check(
            path,
            hf.model(
                path,
                seq_len=cfg.model.seq_len,
                remat=cfg.model.remat,
                attention=cfg.model.attention,
            ),
        )
    except (hf.HFError, hf.SafetensorsError) as e:
        raise ConfigError(f"train.init_from: {e}") from None
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
    cfg: Config, model: Any, run_dir: Path, is_main: bool
) -> tuple[Config, dict[str, Any]]:
    """The config naming the run's copy of the checkpoint's effective ``config.json``
    (``model.hf_config``, which process 0 writes), and that config itself.

    Every process builds its model from the returned dict, computed here from the
    checkpoint it already read, never from the file: another process may not have
    written it yet.
    """
    out = run_dir / HF_CONFIG
    raw = hf_config(model.config, "float32", model.hf_config)
    if is_main:
        out.write_text(json.dumps(raw, indent=2) + "\n")
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, hf_config=str(out.absolute()))
    ), raw


def load(cfg: Config, engine: Any) -> Any:
    """The train state with the checkpoint's weights (:func:`jaxzero.hf.load`); a file
    that fails as it is read, or a non-finite value, is one line (ConfigError)."""
    path = source(cfg)
    assert path is not None  # a fine-tune's config
    try:
        return hf.load(path, engine)
    except (hf.HFError, hf.SafetensorsError) as e:
        raise ConfigError(f"train.init_from: {e}") from None
