"""Checkpoints in ``jaxzero train``: where they go, resuming a run, stopping on a signal.

* ``--set checkpoint.every=K`` saves every K steps and at the end (asynchronously,
  into ``RUN/checkpoints`` unless ``checkpoint.dir`` says otherwise).
* ``--resume RUN_DIR`` (or ``--resume --name NAME``) continues a run from its latest
  complete checkpoint with the run's saved config. Parallel layout and precision
  may change (said at start-up); the model may not.
* SIGTERM / SIGINT: the current step finishes, a checkpoint is written, the command
  says where and how to resume, and exits with 128 + the signal number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from jaxzero.train import config as config_lib
from jaxzero.train.config import Config, ConfigError

CHECKPOINTS = "checkpoints"
# fields a resumed run may change; anything under model.* may not
CHANGEABLE = ("parallel.", "precision.", "logging.", "checkpoint.", "train.steps",
              "train.peak_flops_per_device")


def checkpoint_dir(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / CHECKPOINTS


def run_dir_to_resume(resume: str | bool, cfg: Config) -> Path:
    """``--resume RUN_DIR``, or ``--resume`` with ``--name`` (``runs/NAME``)."""
    if isinstance(resume, str):
        run = Path(resume)
    elif cfg.logging.name:
        run = Path(cfg.logging.root) / cfg.logging.name
    else:
        raise ConfigError("--resume needs a run directory (--resume runs/NAME) or --name NAME")
    if not (run / "config.yaml").is_file():
        raise ConfigError(
            f"nothing to resume in {str(run)!r}: no config.yaml there (is it a run directory "
            "written by jaxzero train?)")
    return run


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def changes(saved: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Fields that differ between two configs: ``{key: (saved, new)}``."""
    a, b = _flat(config_lib.to_dict(saved)), _flat(config_lib.to_dict(new))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def check_changes(diff: dict[str, tuple[Any, Any]]) -> list[str]:
    """Refuse changes a checkpoint cannot follow; describe the allowed ones."""
    for key, (old, new) in diff.items():
        if not key.startswith(CHANGEABLE):
            raise ConfigError(
                f"cannot resume with {key}={new!r}: the run was trained with {old!r}, and a "
                f"checkpoint continues only the same {key.split('.')[0]}. Start a new run "
                "(--name) to change it.")
    return [f"{k}: {old!r} -> {new!r}" for k, (old, new) in diff.items()]


def resumed_config(run: Path, apply: Any) -> tuple[Config, list[str]]:
    """The run's saved config with this command's overrides (``apply(cfg) -> cfg``).

    More ``--steps`` extend the run but not its learning-rate schedule: the cosine keeps
    the horizon it was trained with (``optimizer.decay_steps``, recorded here), so the
    rate never jumps back up at the resume step.
    """
    saved = config_lib.load_file(run / "config.yaml")
    saved = dataclasses.replace(saved, logging=dataclasses.replace(
        saved.logging, root=str(run.parent), name=run.name))
    new = apply(saved)
    said = check_changes(changes(saved, new))
    if new.train.steps != saved.train.steps and saved.optimizer.decay_steps is None:
        new = dataclasses.replace(new, optimizer=dataclasses.replace(
            new.optimizer, decay_steps=saved.train.steps))
        said.append(f"optimizer.decay_steps: None -> {saved.train.steps} (the learning-rate "
                    "schedule keeps its horizon; --set optimizer.decay_steps=N to change it)")
    return new, said


def finished(run: Path, steps: int) -> int | None:
    """``steps`` when the run already ended there (its summary says so), else None."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return steps if isinstance(summary, dict) and summary.get("steps") == steps else None


def check_writable(directory: Path) -> None:
    """Creates ``directory`` and proves a file can be written there, or says why not in
    one line (ConfigError), before a run spends anything on compiling and training."""
    probe = directory / f".write-test-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write checkpoints to {str(directory)!r}: "
                          f"{e.strerror or e}; set checkpoint.dir to a writable directory"
                          ) from None


def set_aside(directory: Path) -> Path | None:
    """Moves the checkpoints a fresh run finds in its directory (an aborted or
    overwritten run's) aside, so it never resumes or exports them; returns where."""
    if not directory.is_dir() or not any(p.name.isdigit() for p in directory.iterdir()):
        return None
    aside = directory.with_name(f"{directory.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    directory.rename(aside)
    return aside


def drop_records_after(metrics_file: Path, step: int) -> int:
    """Remove records of steps after ``step`` (logged before a crash, trained again now)."""
    if not metrics_file.is_file():
        return 0
    keep, dropped = [], 0
    for line in metrics_file.read_text().splitlines():
        try:
            late = json.loads(line).get("step", 0) > step
        except ValueError:
            late = True  # a line cut short by the crash
        dropped += late
        if not late:
            keep.append(line)
    metrics_file.write_text("".join(x + "\n" for x in keep))
    return dropped


class Stopped(Exception):
    """Training stopped on a signal after saving a checkpoint."""

    def __init__(self, signum: int, step: int, where: Path, run_dir: Path):
        self.signum, self.step, self.where, self.run_dir = signum, step, where, run_dir
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} after step {step}; checkpoint saved in {where}. "
            f"Resume with: jaxzero train --resume {run_dir}")


class WriteFailed(Exception):
    """Training stopped because it could not write (disk full, permission lost, its
    directory deleted); says what to do, and how to resume when a checkpoint is left."""

    def __init__(self, what: str, resumable: bool, run_dir: Path):
        then = (f"once fixed, resume with: jaxzero train --resume {run_dir}" if resumable
                else "once fixed, start the run again")
        super().__init__(f"{what}; {then}")


class StopSignals:
    """Turns SIGTERM and SIGINT into a request the loop honours between steps.

    A second signal of the same kind while the checkpoint is written is ignored
    for SIGTERM (schedulers resend it) and aborts for SIGINT (a user insisting).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
