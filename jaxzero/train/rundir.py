"""A run's directory: ``runs/NAME/``, who may reuse it, and its JSON files.

``runs/NAME/`` holds ``config.yaml`` (resolved), ``metrics.jsonl`` (one record per
logged step; the source of truth that ``jaxzero plot`` reads), TensorBoard event
files with the same scalars, and ``summary.json``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxzero.cli import os_reason
from jaxzero.train.config import Config, ConfigError

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def jsonable(value: Any) -> Any:
    """``value``, or None for a non-finite float (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file, skipping blank lines."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented JSON, non-finite floats as null (``summary.json``)."""
    path.write_text(json.dumps({k: jsonable(v) for k, v in data.items()}, indent=2) + "\n")


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run's results: a logged record or a summary.

    A run stopped before its first record leaves only a config, an empty
    ``metrics.jsonl`` and event files; that is no run to protect, so its name
    can be used again.
    """
    metrics = run_dir / METRICS_FILE
    if (run_dir / SUMMARY_FILE).exists():
        return True
    if not metrics.is_file():  # event files without metrics are not ours to delete
        return run_dir.is_dir() and any(run_dir.glob("events.out.tfevents.*"))
    with open(metrics) as f:
        return any(line.strip() for line in f)


def prepare_run_dir(cfg: Config, is_main: bool, resume: bool = False) -> Path:
    """``ROOT/NAME``, created (with its parents) on process 0; refuses to mix two runs' metrics.

    ``resume``: the directory holds this very run, which continues.

    Raises:
      ConfigError: the directory already holds a run (and ``logging.overwrite`` is
        off), or it cannot be created or written.
    """
    run_dir = Path(cfg.logging.root) / str(cfg.logging.name)
    if not is_main or resume:
        return run_dir
    if holds_run(run_dir) and not cfg.logging.overwrite:
        raise ConfigError(
            f"run directory {str(run_dir)!r} already holds a run: choose "
            "another --name, or --set logging.overwrite=true"
        )
    try:
        old = [run_dir / METRICS_FILE, run_dir / SUMMARY_FILE]
        old += list(run_dir.glob("events.out.tfevents.*")) if run_dir.is_dir() else []
        for p in old:  # an overwritten run, or one stopped before its first record
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / METRICS_FILE
        probe.touch()
    except OSError as e:
        raise ConfigError(
            f"cannot write run directory {str(run_dir)!r}: {os_reason(e)}; "
            "set logging.root to a writable directory (--set logging.root=PATH)"
        ) from None
    return run_dir
