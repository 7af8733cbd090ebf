"""The training loop against a stub engine: no compiling, only the order of what the loop
does. It dispatches step N+1 before it reads step N's metrics (the host never waits for
the devices in steady state), and reading one step late never lets a checkpoint hold, or
an evaluation see, a state whose step diverged."""

import signal
import types
from pathlib import Path

import pytest

from jaxzero.train import config as C
from jaxzero.train import loop, rundir
from jaxzero.train import resume as resume_lib


class _Metric:
    """A step's loss or grad norm, still on the "device": records when the host reads it."""

    def __init__(self, events, step, value):
        self.events, self.step, self.value = events, step, value

    def __float__(self):
        self.events.append(("read", self.step))
        return self.value


class _State:
    def __init__(self, step):
        self.step = step


class _Engine:
    """The public methods the loop calls; a step's loss is ``loss(step, batch)``."""

    num_params = 10
    num_frozen = 0

    def __init__(self, mesh, events, loss, on_step):
        self.mesh, self.events, self.loss, self.on_step = mesh, events, loss, on_step
        self.batches = {}  # step -> the loader's batch it trained on

    def init_from(self, init, key):
        return _State(0)

    def process_rows(self, global_batch_size):  # one process: every row
        return slice(0, global_batch_size)

    def shard_batch(self, batch):
        return batch

    def step(self, state, batch):
        step = state.step + 1
        self.events.append(("dispatch", step))
        self.on_step(step)
        value = self.loss(step)
        out = {
            "loss": _Metric(self.events, step, value),
            "grad_norm": _Metric(self.events, step, 1.0),
        }
        return _State(step), out

    def eval_loss(self, state, batch):
        self.events.append(("eval", state.step))
        return 1.0


class _Checkpoints:
    """CheckpointManager's calls the loop makes, in memory."""

    def __init__(self, events, directory, *args, **kwargs):
        self.events, self.directory, self.saved = events, Path(directory), {}

    def save(self, engine, state, extra=None, force=False):
        self.events.append(("save", state.step))
        self.saved[state.step] = (state, extra)

    def latest_step(self):
        return max(self.saved, default=None)

    def restore(self, engine, frozen=None):
        return self.saved[self.latest_step()]

    def wait(self):
        pass

    def close(self):
        pass


def _run(
    monkeypatch, tmp_path, *sets, loss=lambda step: 1.0 / step, on_step=lambda step, made: None
):
    """Trains with the stub engine; returns (summary or the exception, the events, and the
    engine, checkpoints and stop signals it made)."""
    events, made = [], {}
    model = types.SimpleNamespace(
        init=None,
        flops_per_token=lambda n, frozen=0: 6 * n,
        config=types.SimpleNamespace(n_layers=1, d_model=8),
    )

    def build(cfg, mesh, hf_raw=None):
        made["engine"] = _Engine(mesh, events, loss, lambda step: on_step(step, made))
        return model, made["engine"], lambda step: 1e-3

    def checkpoints(*args, **kwargs):
        made["ckpt"] = _Checkpoints(events, *args, **kwargs)
        return made["ckpt"]

    class Signals(resume_lib.StopSignals):
        def __enter__(self):
            made["stop"] = self
            return super().__enter__()

    monkeypatch.setattr(loop, "build", build)
    monkeypatch.setattr(loop, "CheckpointManager", checkpoints)
    monkeypatch.setattr(resume_lib, "StopSignals", Signals)
    cfg = C.Config()
    for key, value in {
        "logging.root": str(tmp_path), "logging.name": "r", "logging.progress": "none",
        "logging.tensorboard": False, "logging.sample_tokens": 0, "logging.log_every": 1,
        "logging.eval_every": 1000, "logging.eval_batches": 1, "data.max_bytes": 50_000,
        "model.seq_len": 16, "train.steps": 8, "train.batch_size": 8, "parallel.devices": 1,
        "checkpoint.every": 0, "checkpoint.final": False,
        "zero.preflight": False,  # the stub engine compiles nothing
        **dict(sets),
    }.items():  # fmt: skip
        cfg = C.override(cfg, key, value)
    try:
        result = loop.train(cfg)
    except (loop.Diverged, resume_lib.Stopped) as e:
        result = e
    return result, events, made


def _first(events, event):
    return events.index(event)


def _steps_logged(tmp_path):
    return [r["step"] for r in rundir.read_jsonl(tmp_path / "r" / rundir.METRICS_FILE)]


def _read_before(events, event, upto):
    """Every step up to ``upto`` had its metrics read before ``event`` happened."""
    at = _first(events, event)
    return all(("read", s) in events[:at] for s in range(1, upto + 1))


def test_step_n_plus_1_is_dispatched_before_step_n_is_read(monkeypatch, tmp_path):
    summary, events, _ = _run(monkeypatch, tmp_path)
    for n in range(1, 8):  # steady state: never waits for the step just dispatched
        assert _first(events, ("dispatch", n + 1)) < _first(events, ("read", n)), events
    # the last step is read (and evaluated) before the run finishes, with its own numbers
    assert ("read", 8) in events and _first(events, ("read", 8)) < _first(events, ("eval", 8))
    assert summary["final_loss"] == pytest.approx(1.0 / 8)
    assert _steps_logged(tmp_path) == list(range(1, 9))


def test_a_checkpoint_waits_for_the_metrics_of_its_steps(monkeypatch, tmp_path):
    nan_at_5 = lambda step: float("nan") if step == 5 else 1.0  # noqa: E731
    err, events, made = _run(
        monkeypatch, tmp_path, ("checkpoint.every", 2), ("logging.eval_every", 3), loss=nan_at_5
    )
    assert isinstance(err, loop.Diverged) and err.step == 5
    assert sorted(made["ckpt"].saved) == [2, 4]  # never the diverged step 5, nor step 6
    for step in (2, 4):
        assert _read_before(events, ("save", step), step)
    assert _read_before(events, ("eval", 3), 3)
    assert _steps_logged(tmp_path) == [1, 2, 3, 4]  # nothing non-finite was logged


def test_rollback_restores_the_checkpoint_before_the_late_read(monkeypatch, tmp_path):
    seen = []

    def nan_once_at_5(step):
        seen.append(step)
        return float("nan") if step == 5 and seen.count(5) == 1 else 1.0

    summary, events, made = _run(
        monkeypatch, tmp_path, ("checkpoint.every", 2), ("checkpoint.on_nan", "rollback"),
        loss=nan_once_at_5,
    )  # fmt: skip
    assert isinstance(summary, dict), summary
    assert sorted(made["ckpt"].saved) == [2, 4, 6, 8]
    for step in (2, 4, 6, 8):
        assert _read_before(events, ("save", step), step)
    assert _steps_logged(tmp_path) == list(range(1, 9))  # each step logged once
    # step 5's batch (index 4) was skipped: the loader ends one batch further on
    _, extra = made["ckpt"].saved[8]
    assert extra["loader"]["step"] == 9


def test_a_signal_saves_the_step_read_last(monkeypatch, tmp_path):
    def on_step(step, made):
        if step == 4:  # arrives while step 4 runs: the loop finishes it, saves, stops
            made["stop"].signum = signal.SIGTERM

    err, events, made = _run(monkeypatch, tmp_path, on_step=on_step)
    assert isinstance(err, resume_lib.Stopped) and err.step == 4
    assert sorted(made["ckpt"].saved) == [4]
    assert _read_before(events, ("save", 4), 4)
    assert _steps_logged(tmp_path) == [1, 2, 3, 4]
