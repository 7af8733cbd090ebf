"""Run configuration: typed, frozen dataclasses, loaded from YAML/JSON and ``--set`` overrides.

The dataclasses, one a section and their defaults, are :mod:`jaxzero.train.sections`'s
(read from here too); this module reads a :class:`Config`: files, ``--set`` overrides,
the checks between fields, the paths made absolute and the YAML written back.

Strictness is the point: an unknown key or a value of the wrong type is an
error that names the dotted key (``optimizer.lr``), because a silently ignored
typo in a sweep costs a day of compute.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxzero.accounting.estimate import parse_bytes
from jaxzero.errors import Error
from jaxzero.models.fields import ModelConfig  # the model section's schema, defined there
from jaxzero.settings import beyond_zero
from jaxzero.train.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LoraSection,
    MeshConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    ZeroConfig,
)

__all__ = [  # the sections are defined in jaxzero.train.sections and read from here
    "PATHS_NOTE",
    "PATH_FIELDS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoraSection",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "TrainConfig",
    "ZeroConfig",
    "absolute_paths",
    "apply_overrides",
    "dump_yaml",
    "from_dict",
    "load_file",
    "override",
    "parse_assignment",
    "resolve",
    "to_dict",
    "validate",
]


class ConfigError(Error, ValueError):
    """A configuration mistake; its message is one line that names the key."""


# --------------------------------------------------------------------------- typing


def _check_value(key: str, value: Any, annotation: Any) -> Any:
    """Returns ``value`` coerced to ``annotation`` or raises a ConfigError naming ``key``.

    Only lossless coercions happen (int to float); a string is never parsed here,
    so ``lr: "3e-4"`` in YAML is an error rather than a guess.
    """
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if any(value == c and type(value) is type(c) for c in choices):  # 3.0 is not 3
            return value
        raise ConfigError(f"{key}: expected one of {list(choices)}, got {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported annotation {annotation!r} for {key}")
    raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {value!r}")


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is Literal:
        return "one of " + str(list(typing.get_args(annotation)))
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# --------------------------------------------------------------------------- building


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``3e-4`` as a float (YAML 1.2), not a string (YAML 1.1)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def from_dict(data: dict[str, Any], cls: type = Config, prefix: str = "", base: Any = None) -> Any:
    """Builds ``cls`` from nested dicts, rejecting unknown keys and ill-typed values.

    Args:
      data: nested mapping, e.g. parsed YAML. Missing keys keep their defaults.
      cls: the dataclass to build.
      prefix: dotted path of ``data`` inside the whole config, for error messages.
      base: an instance of ``cls`` whose values are the defaults (None: the class's own;
        a fine-tune's defaults differ, see :func:`jaxzero.train.finetune.defaults`).

    Returns:
      An instance of ``cls``.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(hints.get(name)) and value is None:
            value = {}  # "model:" with nothing under it in YAML
        if name not in hints:
            raise ConfigError(f"unknown config key {key!r}")
        annotation = hints[name]
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            inner = None if base is None else getattr(base, name)
            kwargs[name] = from_dict(value, annotation, f"{key}.", inner)
        else:
            kwargs[name] = _check_value(key, value, annotation)
    return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    """Nested plain dict of a config (the inverse of :func:`from_dict`)."""
    return dataclasses.asdict(config)


def load_file(path: str | Path, base: Config | None = None) -> Config:
    """Reads a YAML or JSON config file (YAML parses JSON too); what it leaves out keeps
    ``base``'s value (default: :class:`Config`'s)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML/JSON{_yaml_where(e)}"
        ) from None
    return from_dict({} if data is None else data, base=base)


def _yaml_where(e: yaml.YAMLError) -> str:
    """``" at line 3, column 7: mapping values are not allowed here"`` (1-based, like editors)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{where}: {problem}"


def parse_assignment(text: str) -> tuple[str, Any]:
    """Splits ``"optimizer.lr=3e-4"`` into the key and its YAML-parsed value.

    YAML parsing makes ``3e-4`` a float, ``true`` a bool, ``null`` None and
    ``{a: 1}`` a mapping, so overrides are typed exactly like config files.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r}") from e
    return key, value


def override(config: Any, key: str, value: Any) -> Any:
    """Returns ``config`` with the dotted ``key`` replaced by a type-checked ``value``.

    A mapping assigned to a section (``--set 'model={d_model: 64}'``) updates
    only the fields it names.
    """
    return _override(config, key.split("."), value, key)


def _override(node: Any, parts: list[str], value: Any, key: str) -> Any:
    head, rest = parts[0], parts[1:]
    hints = _hints(type(node))
    if head not in hints:
        raise ConfigError(f"unknown config key {key!r}")
    annotation = hints[head]
    if dataclasses.is_dataclass(annotation):
        if rest:
            new = _override(getattr(node, head), rest, value, key)
        elif isinstance(value, dict):
            new = getattr(node, head)
            for name, item in value.items():
                new = _override(new, [str(name)], item, f"{key}.{name}")
        else:
            raise ConfigError(f"{key}: is a section; set a field, e.g. {key}.FIELD=VALUE")
    elif rest:
        raise ConfigError(f"unknown config key {key!r}")
    else:
        new = _check_value(key, value, annotation)
    return dataclasses.replace(node, **{head: new})


def apply_overrides(config: Config, assignments: list[str]) -> Config:
    """Applies ``--set KEY=VALUE`` strings in order."""
    for text in assignments:
        config = override(config, *parse_assignment(text))
    return config


def validate(config: Config) -> Config:
    """Checks relations between fields that types alone cannot express."""
    m, o, t, p, lg = config.model, config.optimizer, config.train, config.parallel, config.logging
    positive = {
        "model.seq_len": m.seq_len,
        "model.d_model": m.d_model,
        "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads,
        "train.steps": t.steps,
        "train.batch_size": t.batch_size,
        "parallel.micro_batches": p.micro_batches,
        "mesh.model": config.mesh.model,
        "logging.log_every": lg.log_every,
        "logging.eval_every": lg.eval_every,
        "logging.eval_batches": lg.eval_batches,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    optional_positive = {
        "model.vocab_size": m.vocab_size,
        "model.d_ff": m.d_ff,
        "parallel.devices": p.devices,
        "parallel.simulate_devices": p.simulate_devices,
        "mesh.group_size": config.mesh.group_size if config.mesh.group_size != "node" else None,
        "train.peak_flops_per_device": t.peak_flops_per_device,
        "optimizer.max_grad_norm": o.max_grad_norm,
        "data.max_bytes": config.data.max_bytes,
    }
    for key, limit in optional_positive.items():
        if limit is not None and limit <= 0:
            raise ConfigError(f"{key}: must be positive or null, got {limit}")
    fine_tune = config.train.init_from is not None or m.hf_config is not None
    if config.mesh.model > 1 and m.arch != "llama" and not fine_tune:
        raise ConfigError(
            f"mesh.model={config.mesh.model} splits Llama-family layers (model.arch: llama, "
            "or a fine-tune); the GPT has no tensor-parallel layout: use mesh.model=1"
        )
    if config.mesh.ulysses and m.arch != "llama" and not fine_tune:
        raise ConfigError(
            "mesh.ulysses splits Llama-family attention by heads (model.arch: llama, or a "
            "fine-tune); the GPT has no Ulysses attention: drop mesh.ulysses"
        )
    for key in ("n_kv_heads", "head_dim"):
        if getattr(m, key) is not None and m.arch != "llama":
            raise ConfigError(f"model.{key} applies to model.arch=llama only")
        if getattr(m, key) is not None and getattr(m, key) < 1:
            raise ConfigError(f"model.{key}: must be positive or null, got {getattr(m, key)}")
    if m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}"
        )
    if m.rope_theta <= 0:
        raise ConfigError(f"model.rope_theta: must be positive, got {m.rope_theta}")
    if m.d_model % m.n_heads and not (m.arch == "llama" and m.head_dim):
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}"
        )
    if not config.data.packing and config.data.tokenizer is None and config.train.init_from is None:
        raise ConfigError(
            "data.packing=false needs documents: give data.tokenizer (or train.init_from)"
        )
    if t.ema is not None and not 0.0 < t.ema < 1.0:
        raise ConfigError(f"train.ema={t.ema}: the EMA's decay must lie in (0, 1), e.g. 0.999")
    if not 0.0 < config.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {config.data.val_fraction}")
    if o.lr <= 0 or not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"optimizer.lr must be > 0 and min_lr_ratio in [0, 1], got {o.lr}, {o.min_lr_ratio}"
        )
    if o.warmup_steps < 0 or o.weight_decay < 0:
        raise ConfigError("optimizer.warmup_steps and optimizer.weight_decay must be >= 0")
    if t.batch_size % p.micro_batches:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by "
            f"parallel.micro_batches={p.micro_batches}"
        )
    if lg.name is not None and (lg.name in ("", ".", "..") or "/" in lg.name or "\\" in lg.name):
        raise ConfigError(
            f"logging.name={lg.name!r}: a run name is one directory name inside "
            "logging.root (no '/' or '..'); set logging.root for another place"
        )
    if lg.sample_tokens < 0 or config.checkpoint.every < 0:
        raise ConfigError("logging.sample_tokens and checkpoint.every must be >= 0")
    for name in ("device_memory", "host_memory"):
        if getattr(config.zero, name) is not None:
            try:
                parse_bytes(getattr(config.zero, name))
            except ValueError as e:
                raise ConfigError(f"zero.{name}: {e}") from None
    if config.zero.headroom is not None and not 0 <= config.zero.headroom < 1:
        raise ConfigError(
            f"zero.headroom={config.zero.headroom}: a share of the budget, from 0 to below 1 "
            "(0.2 keeps 20% free)"
        )
    z = config.zero
    try:  # the engine's rules, checked before any device exists
        beyond_zero(p.stage, config.mesh.group_size is not None, z.offload, z.qwz, z.qgz,
                    z.hpz, z.quant_block)  # fmt: skip
    except (TypeError, ValueError) as e:
        raise ConfigError(f"zero settings: {e}") from None
    ck = config.checkpoint
    if ck.keep_last < 1 or (ck.keep_every is not None and ck.keep_every < 1):
        raise ConfigError(
            "checkpoint.keep_last must be >= 1 and checkpoint.keep_every >= 1 or null"
        )
    return config


# the fields that name files, made absolute when a run resolves its config, so that the
# saved config works from any directory (--resume, sample, export); logging.root stays as
# given: --resume finds the run where it is
PATH_FIELDS = (
    "data.path",
    "data.tokenizer",
    "train.init_from",
    "checkpoint.dir",
    "model.hf_config",
    "lora.adapter",
)
PATHS_NOTE = (
    f"# paths ({', '.join(PATH_FIELDS)})\n"
    "# are absolute: resolved against the directory the run was started from\n"
)


def _absolute(key: str, value: str) -> str:
    prefix = "hf:" if key == "train.init_from" else ""
    if not value.startswith(prefix) or len(value) == len(prefix):
        return value  # not a path: finetune.source refuses it, naming the form
    return prefix + os.path.abspath(os.path.expanduser(value[len(prefix) :]))


def absolute_paths(config: Config) -> Config:
    """``config`` with every :data:`PATH_FIELDS` path absolute (against the current
    directory), so the run it describes can be resumed, sampled and exported from any
    other; ``train.init_from: hf:PATH`` keeps its prefix."""
    for key in PATH_FIELDS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value:
            config = override(config, key, _absolute(key, value))
    return config


def resolve(config_file: str | None, assignments: list[str]) -> Config:
    """Defaults, then ``config_file``, then ``--set`` assignments; validated."""
    config = load_file(config_file) if config_file else Config()
    return validate(apply_overrides(config, assignments))


def dump_yaml(config: Config) -> str:
    """The resolved config as YAML, in field order, readable by :func:`load_file`; a
    comment first says that its paths are absolute (:func:`absolute_paths`)."""
    return PATHS_NOTE + yaml.safe_dump(to_dict(config), sort_keys=False)
