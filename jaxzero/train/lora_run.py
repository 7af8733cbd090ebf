"""A LoRA run (``--set lora.rank=8``): its adapters' config, the base's identity.

The base of a LoRA fine-tune is frozen, so its checkpoints hold only what trains (the
adapters and their optimizer state, :class:`~jaxzero.CheckpointManager`'s
``save_frozen=False``): megabytes, not the model. The base is read again from
``train.init_from`` on ``--resume``, ``export`` and ``sample``, and its
:func:`fingerprint` (the files' bytes) is recorded at every save and checked on
resume, so a base that changed since is refused, not trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path
from typing import Any

from jaxzero.hf.peft import Adapter, read_adapter
from jaxzero.models.llama import LlamaConfig
from jaxzero.models.llama_hf import CONFIG, HFError, llama_config, read_json
from jaxzero.models.lora import ALL_LINEAR, LoraConfig
from jaxzero.train.config import Config, ConfigError

BASE = "lora_base"  # a LoRA checkpoint's extra: its base's path and fingerprint
_NAMES = re.compile(r"[\w.]+(,[\w.]+)*")  # q_proj,v_proj: a list of module names


def enabled(cfg: Config) -> bool:
    """Whether the run trains LoRA adapters (``lora.rank`` or ``lora.adapter`` set)."""
    return bool(cfg.lora.rank or cfg.lora.adapter)


def adapters(cfg: Config) -> tuple[LoraConfig | None, Adapter | None]:
    """The run's :class:`LoraConfig` and the PEFT adapter it starts from (each None
    when not set); a bad setting is one line (ConfigError)."""
    section = cfg.lora
    if not enabled(cfg):
        return None, None
    if cfg.train.init_from is None:
        raise ConfigError(
            "lora.rank/lora.adapter need train.init_from=hf:PATH: LoRA adapts a "
            "pretrained Llama-family model"
        )
    if section.adapter:
        try:
            adapter = read_adapter(Path(section.adapter).expanduser(), base_config(cfg))
        except (HFError, OSError, ValueError) as e:
            raise ConfigError(f"lora.adapter: {e}") from None
        if section.rank and section.rank != adapter.config.rank:
            raise ConfigError(
                f"lora.rank={section.rank} contradicts the adapter's r={adapter.config.rank} "
                f"({section.adapter}): drop lora.rank"
            )
        try:
            config = dataclasses.replace(
                adapter.config, base_dtype=section.base_dtype, dropout=section.dropout
            )
            return config, adapter
        except ValueError as e:
            raise ConfigError(str(e)) from None
    t = section.targets
    targets: str | tuple[str, ...] = t
    if t != ALL_LINEAR and _NAMES.fullmatch(t):
        targets = tuple(t.split(","))
    try:
        config = LoraConfig(
            section.rank,
            section.alpha,
            targets,
            section.use_rslora,
            section.base_dtype,
            section.dropout,
        )
        return config, None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def base_config(cfg: Config) -> LlamaConfig | None:
    """The config of the run's base (``train.init_from=hf:PATH``), which says which of
    its layers each stack holds (Qwen3.5's two kinds); None where it cannot be read (the
    run's own load then says why)."""
    spec = cfg.train.init_from
    if not spec or not spec.startswith("hf:"):
        return None
    try:
        return llama_config(read_json(Path(spec[3:]).expanduser() / CONFIG))
    except HFError:
        return None


def fingerprint(path: Path) -> str:
    """A digest of a model directory's ``config.json`` and weights (every byte of every
    ``*.safetensors`` and its index), to recognise the base a run was trained on."""
    h = hashlib.blake2b(digest_size=16)
    files = sorted(
        p
        for p in path.iterdir()
        if p.suffix == ".safetensors" or p.name in ("config.json", "model.safetensors.index.json")
    )
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


_RECORDS: dict[tuple[str, tuple[tuple[str, int, int], ...]], dict[str, Any]] = {}


def base_record(path: Path) -> dict[str, Any]:
    """What a LoRA checkpoint's ``extra`` says of its base (its files read once while
    their sizes and times stay the same, not at every save)."""
    stats = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir()))
    key = (str(path), stats)
    if key not in _RECORDS:
        _RECORDS[key] = {"path": str(path), "fingerprint": fingerprint(path)}
    return _RECORDS[key]


def record(path: Path, config: LoraConfig) -> dict[str, Any]:
    """What a LoRA checkpoint's ``extra`` records: its base (path, fingerprint) and the
    adapters' settings, so export and sample merge them without the run's config."""
    targets = config.targets if isinstance(config.targets, str) else list(config.targets)
    return {
        **base_record(path),
        "rank": config.rank,
        "alpha": config.alpha,
        "targets": targets,
        "use_rslora": config.use_rslora,
    }


def config_of(record: dict[str, Any]) -> LoraConfig:
    """The :class:`LoraConfig` a checkpoint's :func:`record` describes."""
    t = record["targets"]
    targets = t if isinstance(t, str) else tuple(t)
    return LoraConfig(int(record["rank"]), float(record["alpha"]), targets, record["use_rslora"])


def check_base(saved: dict[str, Any] | None, path: Path) -> None:
    """Refuse (one line) to resume on a base other than the one the checkpoint's
    adapters were trained on."""
    if not saved:
        return
    now = fingerprint(path)
    if now != saved.get("fingerprint"):
        raise ConfigError(
            f"train.init_from: the base model at {path} changed since the checkpoint was "
            f"saved (fingerprint {now}, was {saved.get('fingerprint')} of "
            f"{saved.get('path')}): its adapters were trained on another base; restore "
            "that base or start a new run"
        )
