"""Checkpoints in ``jaxzero train``: where they go, resuming a run, stopping on a signal.

* ``--set checkpoint.every=K`` saves every K steps and at the end (asynchronously,
  into ``RUN/checkpoints`` unless ``checkpoint.dir`` says otherwise).
* ``--resume RUN_DIR`` (or ``--resume --name NAME``) continues a run from its latest
  complete checkpoint with the run's saved config. Parallel layout and precision
  may change (said at start-up); the model may not.
* SIGTERM / SIGINT before the first step is done abort at once (within a second, even
  while compiling) and leave no run directory behind; later, the current step
  finishes, a checkpoint is written, the command says where and how to resume, and
  exits with 128 + the signal number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxzero.train import config as config_lib
from jaxzero.train.config import Config, ConfigError
from jaxzero.train.rundir import prepare_run_dir

CHECKPOINTS = "checkpoints"
# fields a resumed run may change; anything under model.* may not
CHANGEABLE = (
    "parallel.",
    "mesh.",  # checkpoints hold global arrays: any stage, group size or model axis reads them
    "zero.",
    "precision.",
    "logging.",
    "checkpoint.",
    "train.steps",
    "train.peak_flops_per_device",
    "train.ema",  # on: the EMA starts at the restored params; off: the saved one is dropped
)


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
            "written by jaxzero train?)"
        )
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
                "(--name) to change it."
            )
    return [f"{k}: {old!r} -> {new!r}" for k, (old, new) in diff.items()]


def resumed_config(run: Path, apply: Any) -> tuple[Config, list[str]]:
    """The run's saved config with this command's overrides (``apply(cfg) -> cfg``).

    More ``--steps`` extend the run but not its learning-rate horizon
    (``optimizer.decay_steps``, recorded here), so the rate never jumps back up at the
    resume step; the added steps go on from the rate the horizon ended at down to the
    floor (:func:`jaxzero.train.optimizer.lr_schedule`), the same however often the run
    is extended.

    The saved ``parallel.devices`` is the count the run resolved on its devices: a
    command that changes ``parallel.simulate_devices`` without choosing
    ``parallel.devices`` trains on all the devices it asked for (the checkpoint
    reshards), not on the old count.
    """
    # absolute already since paths are stored so; an older run's relative ones are read
    # against this directory, as they always were
    saved = config_lib.absolute_paths(config_lib.load_file(run / "config.yaml"))
    saved = dataclasses.replace(
        saved, logging=dataclasses.replace(saved.logging, root=str(run.parent), name=run.name)
    )
    new = apply(saved)
    unpinned = dataclasses.replace(saved.parallel, devices=None)
    chosen = apply(dataclasses.replace(saved, parallel=unpinned)).parallel.devices
    if new.parallel.simulate_devices != saved.parallel.simulate_devices and chosen is None:
        new = dataclasses.replace(new, parallel=dataclasses.replace(new.parallel, devices=None))
    said = check_changes(changes(saved, new))
    if new.parallel.devices is None and saved.parallel.devices is not None:
        said = [
            c + " (all devices: parallel.simulate_devices changed; --devices N to choose)"
            if c.startswith("parallel.devices:")
            else c
            for c in said
        ]
    if new.train.steps != saved.train.steps and saved.optimizer.decay_steps is None:
        new = dataclasses.replace(
            new, optimizer=dataclasses.replace(new.optimizer, decay_steps=saved.train.steps)
        )
        said.append(
            f"optimizer.decay_steps: None -> {saved.train.steps} (the learning-rate "
            "schedule keeps its horizon, then decays from where it ended to the floor "
            f"by step {2 * saved.train.steps}; --set optimizer.decay_steps=N to change it)"
        )
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
        raise ConfigError(
            f"cannot write checkpoints to {str(directory)!r}: "
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


def entries(directory: Path) -> set[str] | None:
    """The names in ``directory``, or None when it does not exist (see :func:`remove_new`)."""
    return set(os.listdir(directory)) if directory.is_dir() else None


def remove_new(directory: Path, before: set[str] | None) -> None:
    """Undoes a start-up that was interrupted: removes ``directory`` if it is new
    (``before`` is None), else only the entries it did not hold before."""
    if before is None:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for name in set(os.listdir(directory)) - before:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def directories(
    cfg: Config, resume: list[str] | None, undo: list[Callable[[], Any]]
) -> tuple[Path, Path]:
    """The run directory, prepared, and the checkpoint directory; what a fresh run creates goes on
    ``undo``, and it never inherits checkpoints it did not write."""
    is_main = jax.process_index() == 0
    if is_main and cfg.checkpoint.dir:  # before the run directory, and any compiling
        check_writable(Path(cfg.checkpoint.dir))
    fresh = is_main and resume is None  # this process creates the run's directory
    before = entries(Path(cfg.logging.root) / str(cfg.logging.name)) if fresh else None
    run_dir = prepare_run_dir(cfg, is_main, resume=resume is not None)
    if fresh:
        undo.append(lambda: remove_new(run_dir, before))
    ckpt_dir = checkpoint_dir(cfg, run_dir)
    if fresh:
        if cfg.checkpoint.dir is None:
            aside = set_aside(ckpt_dir)
            if aside is not None:
                undo.append(lambda: aside.rename(ckpt_dir))
                print(
                    f"jaxzero train: {ckpt_dir} held another run's checkpoints (an aborted "
                    f"or overwritten run); moved them to {aside}"
                )
        elif ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
            raise ConfigError(
                f"checkpoint.dir {str(ckpt_dir)!r} already holds checkpoints of "
                "another run: give an empty directory, or --resume that run"
            )
    return run_dir, ckpt_dir


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
    """Training stopped on a signal after saving a checkpoint.

    Not a :class:`jaxzero.Error`: nothing was wrong; ``jaxzero train`` exits 128 + the
    signal's number, as a process the signal ended would."""

    def __init__(self, signum: int, step: int, where: Path, run_dir: Path):
        self.signum, self.step, self.where, self.run_dir = signum, step, where, run_dir
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} after step {step}; checkpoint saved in {where}. "
            f"Resume with: jaxzero train --resume {run_dir}"
        )


class WriteFailed(Exception):
    """Training stopped because it could not write (disk full, permission lost); says
    what to do, and how to resume when a checkpoint is left.

    Not a :class:`jaxzero.Error` (exit 2: the command was given something wrong): the
    command was right and ran, the machine failed under it, so ``jaxzero train`` exits 1."""

    def __init__(self, what: str, resumable: bool, run_dir: Path):
        then = (
            f"once fixed, resume with: jaxzero train --resume {run_dir}"
            if resumable
            else "once fixed, start the run again"
        )
        super().__init__(f"{what}; {then}")


class StopSignals:
    """SIGTERM and SIGINT: before training starts they abort at once; after, they stop
    the run between steps.

    **Before** :meth:`training` (called once the first step is done) a signal ends the
    command within a second, even in the middle of compiling: Python runs signal
    handlers only between bytecodes, so a compile of minutes would hold the signal
    until it returned, then train a step and save it. A watcher thread, woken through
    ``signal.set_wakeup_fd`` (compilation releases the GIL), calls ``abort(signum)``,
    which removes what the run created, and leaves with ``os._exit(128 + signum)``.

    **After**, the current step finishes and the loop saves and stops. A second signal
    of the same kind while the checkpoint is written is ignored for SIGTERM
    (schedulers resend it) and aborts for SIGINT (a user insisting).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, abort: Callable[[int], None] | None = None):
        self.signum: int | None = None
        self._old: dict[int, Any] = {}
        self._abort = abort
        self._starting = abort is not None
        self._lock = threading.Lock()
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None

    def _handle(self, signum, frame):
        if self._starting:  # the watcher aborts
            self.signum = signum
            return
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: the caller handles them
        self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        if self._abort is not None:
            read, write = socket.socketpair()
            write.setblocking(False)
            previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
            self._wakeup = (read, write, previous)
            threading.Thread(
                target=self._watch, args=(read,), daemon=True, name="jaxzero-start-up-signals"
            ).start()
        return self

    def _watch(self, read: socket.socket) -> None:
        assert self._abort is not None  # __enter__ starts the watcher only with an abort
        with read:  # closed here, once __exit__ shut it down: never under a blocked recv
            while data := read.recv(64):  # one byte per signal; b"" once shut down
                for signum in data:
                    if signum in self.SIGNALS:
                        with self._lock:
                            if self._starting:
                                try:
                                    self._abort(signum)
                                finally:
                                    os._exit(128 + signum)

    def training(self) -> None:
        """The first step is done: from now on a signal stops the run between steps."""
        with self._lock:
            self._starting = False

    def __exit__(self, *exc) -> None:
        self.training()
        for s, old in self._old.items():
            signal.signal(s, old)
        if self._wakeup is not None:
            read, write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            read.shutdown(socket.SHUT_RDWR)  # ends the watcher, which closes it
            write.close()
