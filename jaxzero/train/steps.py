"""The training steps of ``jaxzero train``: the run they belong to, and a loop that never
waits for the devices in steady state.

Each step's loss and gradient norm are read one step late, after the next step is
dispatched (as nanodo does), so a non-finite loss is found one step after it happened;
no state is checkpointed or evaluated before the metrics of its own step, and of every
step before it, were read and found finite.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import jax

from jaxzero.checkpoint import CheckpointManager
from jaxzero.train import config as config_lib
from jaxzero.train import data as data_lib
from jaxzero.train import finetune, lora_run, rundir
from jaxzero.train import metrics as metrics_lib
from jaxzero.train import resume as resume_lib
from jaxzero.train.config import Config

MAX_ROLLBACKS = 3  # checkpoint.on_nan=rollback: then stop, the run is not recovering


class Diverged(RuntimeError):
    """The loss or gradient norm stopped being finite.

    Not a :class:`jaxzero.Error` (exit 2: the command was given something wrong): the
    run was valid and trained; its outcome is a failure, exit 1, with the advice."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(
            f"loss is {loss} (grad norm {grad_norm}) at step {step}: training stopped; "
            f"step {step - 1} was the last with finite values. Lower optimizer.lr or "
            "set optimizer.max_grad_norm."
        )


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Raises :class:`Diverged` naming ``step``. A checkpoint manager restores from here."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise Diverged(step, loss, grad_norm)


def evaluate(engine: Any, state: Any, batches: list[Any]) -> float:
    """Mean loss over the fixed validation batches (already sharded)."""
    return sum(float(engine.eval_loss(state, b)) for b in batches) / len(batches)


@dataclasses.dataclass
class Run:
    """One training run as set-up leaves it: what restore-or-init, the loop and the finish
    read, instead of a dozen parameters each. ``writer`` and ``progress`` are opened once a
    resumed run's checkpoint is restored (a failed resume writes nothing)."""

    cfg: Config
    job: Any  # jaxzero.distributed's job: one process, or one of several
    mesh: Any
    simulated: int | None  # CPU devices this process simulates
    corpus: data_lib.Corpus
    directory: Path  # runs/NAME
    ckpt: CheckpointManager
    stop: resume_lib.StopSignals
    watch: metrics_lib.Stopwatch
    resume: list[str] | None  # resuming: the config changes said at start-up
    pretrained: Any  # a fine-tune's model, read from its checkpoint (finetune.resolve), else None
    model: Any
    engine: Any
    schedule: Callable[[int], Any]
    planned_peak: int | None = None  # the pre-flight's compiled peak per device
    state_bytes: float | None = None  # the pre-flight's: one copy of the state's leaves
    writer: metrics_lib.MetricsWriter = dataclasses.field(init=False)
    progress: metrics_lib.Progress = dataclasses.field(init=False)

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes and prints."""
        return jax.process_index() == 0


@dataclasses.dataclass(frozen=True)
class _Sent:
    """A step dispatched to the devices whose metrics are not read yet."""

    step: int
    batch: int  # the loader's batch index: skipped if this step diverges
    out: Any  # the step's metrics, still on the devices
    sent: float  # time.perf_counter() at dispatch


def base_frozen(run: Run) -> Any:
    """A LoRA run's frozen base, read again from ``train.init_from`` (its checkpoints do
    not hold it); None for any other run."""
    if not lora_run.enabled(run.cfg):
        return None
    return finetune.load(run.cfg, run.engine, run.model).frozen


class Steps:
    """The training steps ``first..train.steps``: step, check, log, evaluate, checkpoint.

    Step N's metrics are read after step N+1 is dispatched, so the host never waits for
    the devices in steady state, and a non-finite loss is found one step late. A step
    whose state is used (a checkpoint, an evaluation, the last step, a signal's stop)
    has its metrics read first, and so have all steps before it (they are read in
    order): no state is saved or evaluated before every step up to it was finite.

    A non-finite loss stops training, or with ``checkpoint.on_nan=rollback`` restores
    the latest checkpoint and skips the offending batch (at most ``MAX_ROLLBACKS`` times).
    """

    def __init__(self, run: Run, loader: data_lib.Loader, val: list[Any], first: int):
        self.run, self.loader, self.val, self.first = run, loader, val, first
        self.skip: set[int] = set()  # batches that made the loss non-finite
        self.rollbacks = 0
        self.window = metrics_lib.Stopwatch()
        self.loss = self.val_loss = float("nan")
        self.read_at = 0.0  # when the latest metrics reached the host

    @classmethod
    def start(cls, run: Run, state: Any, position: dict[str, Any] | None) -> Steps:
        """The steps after ``state``: its loader at ``position`` (a checkpoint's; None:
        after ``state``'s step) and the fixed validation batches, sharded."""
        cfg, engine, c = run.cfg, run.engine, run.corpus
        b, seq, seed = cfg.train.batch_size, cfg.model.seq_len, cfg.train.seed
        rows = engine.process_rows(b)
        loader = data_lib.Loader(c.train, seq, b, seed, rows, c.train_mask, c.eos, c.train_docs)
        first = int(state.step) + 1
        loader.load_state_dict(position or {"step": first - 1, "seed": seed})
        n = cfg.logging.eval_batches
        val = data_lib.eval_batches(c.val, seq, b, n, rows, c.val_mask, c.eos, c.val_docs)
        return cls(run, loader, [engine.shard_batch(x) for x in val], first)

    def train(self, state: Any) -> Any:
        """The state after the last step; raises Diverged, or Stopped on a signal."""
        step, pending = self.first - 1, None
        while step < self.run.cfg.train.steps:
            if self.run.stop.signum is not None:  # between steps, once the last is logged
                back = None if pending is None else self._read(pending, None)
                pending = None
                if back is None:
                    self._stop(state, step)
                state, step = back
                continue
            step += 1
            state, sent = self._dispatch(state, step)
            back = None if pending is None else self._read(pending, None)
            pending = sent
            if back is None and self._uses_state(step):
                back, pending = self._read(sent, state), None
            if back is not None:  # rolled back: what was in flight is dropped
                (state, step), pending = back, None
        return state

    def save(self, state: Any, force: bool = False) -> None:
        """Checkpoints ``state`` with the loader's position (written in the background)."""
        run = self.run
        extra = {"config": config_lib.to_dict(run.cfg), "loader": self.loader.state_dict()}
        source = finetune.source(run.cfg)
        if lora_run.enabled(run.cfg) and source is not None:
            extra[lora_run.BASE] = lora_run.record(source, run.model.lora)
        begin = time.perf_counter()
        run.ckpt.save(run.engine, state, extra=extra, force=force)
        step = int(state.step)
        run.progress.print(
            f"checkpoint step {step} -> {run.ckpt.directory / str(step)} "
            f"({time.perf_counter() - begin:.1f}s to the host; written in the "
            "background)"
        )

    def _dispatch(self, state: Any, step: int) -> tuple[Any, _Sent]:
        while self.loader.step in self.skip:
            self.loader.step += 1
        batch, sent = self.loader.step, time.perf_counter()
        engine = self.run.engine
        state, out = engine.step(state, engine.shard_batch(next(self.loader)))
        return state, _Sent(step, batch, out, sent)

    def _uses_state(self, step: int) -> bool:
        """Whether step ``step``'s state is saved or evaluated (read its metrics now)."""
        cfg = self.run.cfg
        every, eval_every = cfg.checkpoint.every, cfg.logging.eval_every
        saved = bool(every) and step % every == 0
        return saved or step % eval_every == 0 or step == cfg.train.steps

    def _read(self, sent: _Sent, state: Any) -> tuple[Any, int] | None:
        """Reads ``sent``'s metrics (waiting for the devices), checks, saves and logs;
        ``state`` is the state after it when it is used, else None. Returns the restored
        state and its step if it rolled back."""
        loss, grad_norm = float(sent.out["loss"]), float(sent.out["grad_norm"])
        now = time.perf_counter()
        seconds, self.read_at = now - max(self.read_at, sent.sent), now
        self.loss = loss
        self.run.stop.training()  # a signal from now on saves, then stops
        try:
            check_finite(sent.step, loss, grad_norm)
        except Diverged:
            if not self._can_roll_back():
                raise
            return self._roll_back(sent, loss, grad_norm)
        every = self.run.cfg.checkpoint.every
        if state is not None and every and sent.step % every == 0:
            self.save(state)
        self._log(sent.step, loss, grad_norm, seconds, state)
        return None

    def _can_roll_back(self) -> bool:
        ckpt = self.run.ckpt
        if self.run.cfg.checkpoint.on_nan != "rollback" or self.rollbacks == MAX_ROLLBACKS:
            return False
        ckpt.wait()  # the latest save may still be in flight
        return ckpt.latest_step() is not None

    def _roll_back(self, sent: _Sent, loss: float, grad_norm: float) -> tuple[Any, int]:
        run = self.run
        self.rollbacks += 1
        self.skip.add(sent.batch)
        state, extra = run.ckpt.restore(run.engine, frozen=base_frozen(run))
        self.loader.load_state_dict(extra["loader"])
        if run.is_main:
            resume_lib.drop_records_after(run.directory / rundir.METRICS_FILE, int(state.step))
        run.progress.print(
            f"step {sent.step}: loss {loss}, grad norm {grad_norm}: rolled back to "
            f"step {int(state.step)}, skipping batch {max(self.skip)}"
        )
        return state, int(state.step)

    def _stop(self, state: Any, step: int) -> NoReturn:
        run = self.run
        assert run.stop.signum is not None
        self.save(state, force=True)
        run.ckpt.wait()
        raise resume_lib.Stopped(
            run.stop.signum, step, run.ckpt.directory / str(step), run.directory
        )

    def _log(self, step: int, loss: float, grad_norm: float, seconds: float, state: Any) -> None:
        """Throughput, the progress bar, and at log and eval steps a metrics record."""
        run = self.run
        b, seq, steps, lg = (
            run.cfg.train.batch_size,
            run.cfg.model.seq_len,
            run.cfg.train.steps,
            run.cfg.logging,
        )
        if step > self.first:  # the first step pays for compilation
            run.watch.add(seconds, b * seq)
            self.window.add(seconds, b * seq)
        run.progress.update(step, loss, run.watch.tokens_per_s)
        evaluate_now = step % lg.eval_every == 0 or step == steps
        if step % lg.log_every and not evaluate_now:
            return
        window = self.window
        record = {
            "step": step,
            "tokens": step * b * seq,
            "loss": loss,
            "lr": float(run.schedule(step - 1)),
            "grad_norm": grad_norm,
            "tokens_per_s": window.tokens_per_s or None,
            "step_time": window.seconds / window.steps if window.steps else seconds,
            "elapsed_s": run.watch.wall,
        }
        if evaluate_now:
            self.val_loss = record["val_loss"] = evaluate(run.engine, state, self.val)
        if run.watch.tokens_per_s:
            record["eta_s"] = (steps - step) * b * seq / run.watch.tokens_per_s
        run.writer.write(record)
        run.progress.log(record)
        self.window = metrics_lib.Stopwatch()
