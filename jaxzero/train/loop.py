"""``jaxzero train``: train a GPT on text with ZeRO sharding, from a laptop CPU upwards.

With no arguments it trains a small byte-level GPT on this Python's standard
library sources at stage 3 over 8 simulated CPU devices, so the first thing a
researcher runs already shards parameters, gradients and optimizer state.
Everything else is a config field (:mod:`jaxzero.train.config`); this module turns a
config into an engine, a loader and a loop, and reports what happened.

Order matters: arguments are parsed and the config validated before JAX does
any computation, because simulated CPU devices can only be requested before
the backend starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxzero import distributed
from jaxzero.checkpoint import CheckpointError, CheckpointManager, CheckpointWriteError
from jaxzero.cli import ArgError
from jaxzero.engine import PRECISIONS
from jaxzero.mesh import accelerator_expected, make_mesh, replicas_for, simulate_devices
from jaxzero.models import from_fields
from jaxzero.models.common import cudnn_refusal
from jaxzero.train import config as config_lib
from jaxzero.train import data as data_lib
from jaxzero.train import finetune
from jaxzero.train import metrics as metrics_lib
from jaxzero.train import resume as resume_lib
from jaxzero.train.args import RESOLVED_CONFIG, build_parser, config_from_args
from jaxzero.train.config import Config, ConfigError
from jaxzero.train.data import DataError
from jaxzero.train.optimizer import make_optimizer

DEFAULT_SIMULATED_DEVICES = 8
MAX_ROLLBACKS = 3  # checkpoint.on_nan=rollback: then stop, the run is not recovering


class Diverged(RuntimeError):
    """The loss or gradient norm stopped being finite."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(
            f"loss is {loss} (grad norm {grad_norm}) at step {step}: training stopped; "
            f"step {step - 1} was the last with finite values. Lower optimizer.lr or "
            "set optimizer.max_grad_norm."
        )


# --------------------------------------------------------------------------- devices


def _configured_cpu_devices() -> int:
    """CPU devices already requested through XLA_FLAGS or jax.config (1 if none)."""
    match = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    # jax < 0.12 declares its config flags at run time only: mypy sees no such attribute
    cpu_devices = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined,unused-ignore]
    return max(int(match.group(1)) if match else 1, cpu_devices)


def devices_to_simulate(parallel: config_lib.ParallelConfig) -> int | None:
    """How many CPU devices to simulate (None: leave the backend alone)."""
    if parallel.simulate_devices is not None:
        return parallel.simulate_devices
    if accelerator_expected() or _configured_cpu_devices() > 1:
        return None
    return parallel.devices or DEFAULT_SIMULATED_DEVICES


def setup_devices(
    parallel: config_lib.ParallelConfig, job: Any = None, group_size: int | str | None = None
) -> tuple[Any, int | None]:
    """Simulates CPU devices if asked (before any computation) and builds the mesh.

    In a multi-process ``job`` the devices were set up by ``distributed.initialize``
    (``simulate_devices`` counts per process) and the mesh spans every process.
    """
    multi = job is not None and job.multi
    simulated = devices_to_simulate(parallel) if not multi else None
    try:
        if simulated is not None:
            simulate_devices(simulated)
        if multi:
            simulated = job.simulate_devices if jax.default_backend() == "cpu" else None
            if parallel.devices not in (None, jax.device_count()):
                raise ConfigError(
                    f"parallel.devices={parallel.devices}: a multi-process run trains on all "
                    f"{jax.device_count()} devices of its {job.world_size} processes; leave it "
                    "unset"
                )
        n = parallel.devices or jax.device_count()
        node = jax.local_device_count() * (job.local_world_size if multi else 1)
        return make_mesh(n, replicas=replicas_for(group_size, n, node)), simulated
    except (RuntimeError, ValueError) as e:
        raise ConfigError(" ".join(str(e).split())) from None


# --------------------------------------------------------------------------- run directory


def resolve_run(cfg: Config, num_devices: int, simulated: int | None, vocab: int | None) -> Config:
    """The config with every ``None`` the run decided filled in (name, devices, vocab)."""
    name = cfg.logging.name or (
        f"stage{cfg.parallel.stage}-{num_devices}dev-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=vocab),
        parallel=dataclasses.replace(cfg.parallel, devices=num_devices, simulate_devices=simulated),
        logging=dataclasses.replace(cfg.logging, name=name),
    )


def printable_config(cfg: Config) -> str:
    """``--print-config``: the config as a run resolves it, without reading the data.

    Devices, simulated devices, the name and (for byte data) the vocab are filled
    in as ``train`` would; what only the data decides is said in a YAML comment.
    """
    mesh, simulated = setup_devices(cfg.parallel)
    if finetune.source(cfg) is not None:
        cfg, _ = finetune.resolve(cfg)
    vocab = cfg.model.vocab_size
    if vocab is None and data_lib.data_kind(cfg.data) == "bytes":
        vocab = data_lib.BYTE_VOCAB
    text = config_lib.dump_yaml(resolve_run(cfg, mesh.size, simulated, vocab))
    if finetune.source(cfg) is not None:
        text += finetune.defaults_note(cfg)
    if cfg.logging.name is None:
        text += "# logging.name: from the stage, devices and start time; --name fixes it\n"
    if vocab is None:
        text += "# model.vocab_size: set at start-up from the data (largest token + 1)\n"
    return text


# --------------------------------------------------------------------------- the loop


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Raises :class:`Diverged` naming ``step``. A checkpoint manager restores from here."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise Diverged(step, loss, grad_norm)


def evaluate(engine: Any, state: Any, batches: list[Any]) -> float:
    """Mean loss over the fixed validation batches (already sharded)."""
    return sum(float(engine.eval_loss(state, b)) for b in batches) / len(batches)


def build(cfg: Config, mesh: Any, hf_raw: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """The model, its engine (every parallel/precision option reaches it here), the LR
    schedule. ``hf_raw``: a fine-tune's architecture (:func:`finetune.pin_architecture`)."""
    refused = cudnn_refusal(cfg.model.attention, PRECISIONS[cfg.precision.compute])
    if refused is not None:
        raise ConfigError(f"model.{refused}")
    model = from_fields(dataclasses.asdict(cfg.model), hf_raw)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    engine = model.engine(
        tx,
        mesh=mesh,
        stage=cfg.parallel.stage,
        precision=cfg.precision.compute,
        reduce_dtype=cfg.precision.reduce_dtype,
        micro_batches=cfg.parallel.micro_batches,
        max_grad_norm=cfg.optimizer.max_grad_norm,
    )
    return model, engine, schedule


def train(
    cfg: Config,
    started: float | None = None,
    resume: list[str] | None = None,
    init_timeout: float | None = None,
) -> dict[str, Any]:
    """Runs the whole training job described by ``cfg`` and returns its summary.

    SIGINT/SIGTERM before the first step is done abort at once and undo what the run
    created (its new run directory, checkpoints it set aside); later they stop it
    between steps with a checkpoint (:class:`~jaxzero.train.resume.StopSignals`).

    Args:
      cfg: the validated config.
      started: ``time.perf_counter()`` when the command started, so the reported
        wall time includes start-up (default: now).
      resume: continue the run in ``cfg``'s run directory from its latest
        checkpoint; the list names the config changes (said at start-up).
      init_timeout: seconds a multi-process run waits for all processes to connect.
    """
    undo: list[Callable[[], Any]] = []  # what start-up created, in order

    def abort(signum: int) -> None:
        for step in reversed(undo):
            try:
                step()
            except OSError:
                pass
        print(
            f"jaxzero train: interrupted by {signal.Signals(signum).name} during start-up; "
            "stopped at once" + (", nothing kept" if undo else ""),
            file=sys.stderr,
            flush=True,
        )

    with resume_lib.StopSignals(abort) as stop:
        return _train(cfg, started, resume, init_timeout, stop, undo)


def _train(
    cfg: Config,
    started: float | None,
    resume: list[str] | None,
    init_timeout: float | None,
    stop: resume_lib.StopSignals,
    undo: list[Callable[[], Any]],
) -> dict[str, Any]:
    watch = metrics_lib.Stopwatch(started)
    if resume is not None:
        run = Path(cfg.logging.root) / str(cfg.logging.name)
        if resume_lib.finished(run, cfg.train.steps) is not None:
            print(
                f"jaxzero train: {run} finished at step {cfg.train.steps}; nothing to resume "
                "(give --steps N to train it further)"
            )
            return json.loads((run / metrics_lib.SUMMARY_FILE).read_text())
    # Joins the job when launched as one of several processes (a no-op otherwise): first,
    # so that a wrong RANK or an absent coordinator fails before any data is read.
    job = distributed.initialize(
        simulate_devices=cfg.parallel.simulate_devices, init_timeout=init_timeout
    )
    pretrained = None
    if resume is None and finetune.source(cfg) is not None:
        cfg, pretrained = finetune.resolve(cfg)  # its model fields and tokenizer
    mesh, simulated = setup_devices(cfg.parallel, job, cfg.mesh.group_size)
    n_dev = mesh.size
    need = n_dev * cfg.parallel.micro_batches
    if cfg.train.batch_size % need:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} must be a multiple of "
            f"{n_dev} devices x {cfg.parallel.micro_batches} micro-batches = {need}"
        )
    cfg = resolve_run(cfg, n_dev, simulated, cfg.model.vocab_size)  # the name, said first
    is_main = jax.process_index() == 0
    shown = cfg.logging.progress if is_main else "none"
    if shown != "none":
        print(metrics_lib.run_line(cfg), flush=True)
    corpus = data_lib.load_corpus(cfg.data, cfg.model.vocab_size, shown)
    seq = cfg.model.seq_len
    if corpus.train_docs is None:  # packed windows need seq_len + 1 tokens
        data_lib.check_length(corpus.train, seq, "training")
        data_lib.check_length(corpus.val, seq, "validation")
    else:  # packing off: say how many documents a row cuts
        cut = data_lib.truncated(corpus.train_docs, seq)
        corpus = dataclasses.replace(
            corpus,
            source=f"{corpus.source}, packing off: {cut:,} of "
            f"{len(corpus.train_docs):,} train documents cut at "
            f"{seq + 1} tokens",
        )
    vocab = cfg.model.vocab_size or corpus.vocab_size
    if vocab < corpus.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the data's {corpus.vocab_size}"
        )
    cfg = resolve_run(cfg, n_dev, simulated, vocab)
    if is_main and cfg.checkpoint.dir:  # before the run directory, and any compiling
        resume_lib.check_writable(Path(cfg.checkpoint.dir))
    fresh = is_main and resume is None  # this process creates the run's directory
    before = resume_lib.entries(Path(cfg.logging.root) / str(cfg.logging.name)) if fresh else None
    run_dir = metrics_lib.prepare_run_dir(cfg, is_main, resume=resume is not None)
    if fresh:
        undo.append(lambda: resume_lib.remove_new(run_dir, before))
    ckpt_dir = resume_lib.checkpoint_dir(cfg, run_dir)
    if fresh:  # a fresh run never inherits checkpoints it did not write
        if cfg.checkpoint.dir is None:
            aside = resume_lib.set_aside(ckpt_dir)
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
    ckpt = CheckpointManager(ckpt_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every)
    hf_raw = None
    if pretrained is not None:
        cfg, hf_raw = finetune.pin_architecture(cfg, pretrained, run_dir, is_main)
    model, engine, schedule = build(cfg, mesh, hf_raw)
    extra: dict[str, Any] = {}
    if resume is not None:
        state, extra = ckpt.restore(engine)  # CheckpointError: nothing (readable) to resume
        if is_main:
            resume_lib.drop_records_after(run_dir / metrics_lib.METRICS_FILE, int(state.step))
    writer = metrics_lib.MetricsWriter(run_dir if is_main else None, cfg.logging.tensorboard)
    progress = metrics_lib.Progress(cfg.train.steps, cfg.logging.progress, is_main)
    try:
        try:
            if is_main:
                (run_dir / RESOLVED_CONFIG).write_text(config_lib.dump_yaml(cfg))
                writer.text("config", config_lib.dump_yaml(cfg))
            if pretrained is not None:
                state = finetune.load(cfg, engine)  # each device reads its slices
            elif resume is None:
                state = engine.init_from(model.init, jax.random.key(cfg.train.seed))
            per_run = None if job.multi else simulated  # multi-process: the mesh line says it
            progress.print(
                metrics_lib.banner(cfg, corpus, engine.num_params, per_run)
                + "\n  mesh   "
                + _mesh_line(job, mesh)
            )
            if resume is not None:
                progress.print(
                    f"  resume from {ckpt.directory / str(int(state.step))} (step "
                    f"{int(state.step)})" + "".join(f"\n  changed {c}" for c in resume)
                )
            summary = _loop(
                cfg,
                engine,
                state,
                model,
                corpus,
                schedule,
                writer,
                progress,
                watch,
                ckpt,
                extra.get("loader"),
                run_dir,
                stop,
            )
            if is_main:
                metrics_lib.write_json(run_dir / metrics_lib.SUMMARY_FILE, summary)
            return summary
        finally:
            _close(progress, writer, ckpt)
    except CheckpointWriteError as e:
        raise resume_lib.WriteFailed(str(e), e.latest is not None, run_dir) from None
    except OSError as e:  # metrics, TensorBoard, the summary: the disk is full or gone
        raise resume_lib.WriteFailed(
            f"cannot write {e.filename!r}: {e.strerror or e}"
            if e.filename
            else f"a write failed: {e.strerror or e}",
            _has_checkpoint(ckpt),
            run_dir,
        ) from None


def _close(*things: Any) -> None:
    """Closes each; a failure to close is raised only when nothing else is (else it
    would hide the error that stopped the run, of which it is an echo)."""
    failing = sys.exc_info()[1] is not None
    for thing in things:
        try:
            thing.close()
        except (OSError, CheckpointError):
            if not failing:
                raise


def _has_checkpoint(ckpt: CheckpointManager) -> bool:
    try:
        return ckpt.latest_step() is not None
    except Exception:  # noqa: BLE001 - the directory may be gone with the disk
        return False


def _mesh_line(job: Any, mesh: Any) -> str:
    """Processes x local devices and the mesh's axes, for the banner."""
    procs = distributed.describe_processes(job, jax.local_device_count(), jax.device_count())
    return f"{procs}, {distributed.describe_mesh(mesh)}"


def _loop(
    cfg: Config,
    engine,
    state,
    model,
    corpus,
    schedule,
    writer,
    progress,
    watch,
    ckpt: CheckpointManager,
    position: dict | None,
    run_dir,
    stop: resume_lib.StopSignals,
) -> dict:
    b, seq, steps, lg = cfg.train.batch_size, cfg.model.seq_len, cfg.train.steps, cfg.logging
    rows = engine.process_rows(b)
    loader = data_lib.Loader(
        corpus.train, seq, b, cfg.train.seed, rows, corpus.train_mask, corpus.eos, corpus.train_docs
    )
    first = int(state.step) + 1
    loader.load_state_dict(position or {"step": first - 1, "seed": cfg.train.seed})

    def save(state, force=False):
        extra = {"config": config_lib.to_dict(cfg), "loader": loader.state_dict()}
        begin = time.perf_counter()
        ckpt.save(engine, state, extra=extra, force=force)
        step = int(state.step)
        progress.print(
            f"checkpoint step {step} -> {ckpt.directory / str(step)} "
            f"({time.perf_counter() - begin:.1f}s to the host; written in the "
            "background)"
        )

    val = [
        engine.shard_batch(x)
        for x in data_lib.eval_batches(
            corpus.val, seq, b, lg.eval_batches, rows, corpus.val_mask, corpus.eos, corpus.val_docs
        )
    ]
    state, loss, val_loss = _steps(
        cfg,
        engine,
        state,
        loader,
        val,
        schedule,
        writer,
        progress,
        watch,
        first,
        save,
        stop,
        ckpt,
        run_dir,
    )
    every = cfg.checkpoint.every
    if (every and steps % every) or (not every and cfg.checkpoint.final):
        save(state)  # the end (a multiple of every was saved in the loop)
    ckpt.wait()
    summary = metrics_lib.summarize(cfg, engine, model, watch, loss, val_loss)
    sample = _sample(cfg, engine, state, model, corpus)
    if sample is not None:
        summary["sample"] = sample
        writer.text("sample", sample)
    progress.close()
    progress.print(metrics_lib.format_summary(summary))
    return summary


def _steps(
    cfg: Config,
    engine,
    state,
    loader,
    val,
    schedule,
    writer,
    progress,
    watch,
    first,
    save,
    stop,
    ckpt,
    run_dir,
):
    """The training steps ``first..steps``: step, check, log, evaluate, checkpoint.

    A non-finite loss stops training, or with ``checkpoint.on_nan=rollback`` restores
    the latest checkpoint and skips the offending batch (at most ``MAX_ROLLBACKS`` times).
    """
    b, seq, steps, lg = cfg.train.batch_size, cfg.model.seq_len, cfg.train.steps, cfg.logging
    window = metrics_lib.Stopwatch()
    loss = val_loss = float("nan")
    step, skip, rollbacks = first - 1, set(), 0
    while step < steps:
        if stop.signum is not None:  # between steps, after the last one was logged
            save(state, force=True)
            ckpt.wait()
            raise resume_lib.Stopped(stop.signum, step, ckpt.directory / str(step), run_dir)
        step += 1
        while loader.step in skip:  # batches that made the loss non-finite
            loader.step += 1
        t0 = time.perf_counter()
        state, out = engine.step(state, engine.shard_batch(next(loader)))
        loss, grad_norm = float(out["loss"]), float(out["grad_norm"])
        seconds = time.perf_counter() - t0
        stop.training()  # a signal from now on saves, then stops
        try:
            check_finite(step, loss, grad_norm)
        except Diverged:
            if cfg.checkpoint.on_nan != "rollback" or rollbacks == MAX_ROLLBACKS:
                raise
            ckpt.wait()  # the latest save may still be in flight
            if ckpt.latest_step() is None:
                raise
            rollbacks += 1
            skip.add(loader.step - 1)
            state, extra = ckpt.restore(engine)
            loader.load_state_dict(extra["loader"])
            if jax.process_index() == 0:
                resume_lib.drop_records_after(run_dir / metrics_lib.METRICS_FILE, int(state.step))
            progress.print(
                f"step {step}: loss {loss}, grad norm {grad_norm}: rolled back to "
                f"step {int(state.step)}, skipping batch {max(skip)}"
            )
            step = int(state.step)
            continue
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            save(state)
        if step > first:  # the first step pays for compilation
            watch.add(seconds, b * seq)
            window.add(seconds, b * seq)
        progress.update(step, loss, watch.tokens_per_s)
        evaluate_now = step % lg.eval_every == 0 or step == steps
        if step % lg.log_every and not evaluate_now:
            continue
        record = {
            "step": step,
            "tokens": step * b * seq,
            "loss": loss,
            "lr": float(schedule(step - 1)),
            "grad_norm": grad_norm,
            "tokens_per_s": window.tokens_per_s or None,
            "step_time": window.seconds / window.steps if window.steps else seconds,
            "elapsed_s": watch.wall,
        }
        if evaluate_now:
            val_loss = record["val_loss"] = evaluate(engine, state, val)
        if watch.tokens_per_s:
            record["eta_s"] = (steps - step) * b * seq / watch.tokens_per_s
        writer.write(record)
        progress.log(record)
        window = metrics_lib.Stopwatch()
    return state, loss, val_loss


def _sample(cfg: Config, engine, state, model, corpus) -> str | None:
    """Text generated by the trained model after ``logging.sample_prompt`` (None: the
    validation data's first prompt, :func:`~jaxzero.train.data.val_prompt`)."""
    if cfg.logging.sample_tokens == 0:
        return None
    params = engine.gather_params(state)  # every process: it may need a collective
    if cfg.logging.sample_prompt is None:
        prompt = data_lib.val_prompt(corpus)
    else:
        prompt = data_lib.encode(cfg.logging.sample_prompt, corpus.kind, corpus.tokenizer)
    if prompt.size == 0:
        prompt = np.asarray(corpus.val[:1], np.int32)
    prompt = prompt[-cfg.model.seq_len :]
    tokens = model.generate(
        params,
        prompt[None],
        cfg.logging.sample_tokens,
        jax.random.key(cfg.train.seed + 1),
        temperature=cfg.logging.sample_temperature,
        eos=corpus.eos,  # the data's end of document: where a reply ends
    )
    return data_lib.decode(tokens[0], corpus.kind, corpus.tokenizer)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``jaxzero train``; returns the exit status."""
    started = time.perf_counter()
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        cfg = config_from_args(args)
        if args.print_config:
            print(printable_config(cfg), end="")
            return 0
        train(
            cfg,
            started,
            getattr(args, "resume_changes", None) if args.resume else None,
            args.init_timeout,
        )
    except (ArgError, ConfigError, DataError, CheckpointError, distributed.DistributedError) as e:
        return _leave(f"jaxzero train: error: {e}", 2)
    except resume_lib.Stopped as e:
        return _leave(f"jaxzero train: {e}", 128 + e.signum)
    except resume_lib.WriteFailed as e:
        return _leave(f"jaxzero train: error: {e}", 1)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except Diverged as e:
        return _leave(f"jaxzero train: {e}", 1)
    except KeyboardInterrupt:
        return _leave("jaxzero train: interrupted", 130)
    distributed.shutdown()  # every process leaves together
    return 0


def _leave(message: str, status: int) -> int:
    """Prints ``message``; a process of a multi-process job then leaves it at once.

    See :func:`jaxzero.distributed.leave`: waiting for peers that wait for us would
    hang. (Uncaught exceptions leave through the hook ``initialize`` installs.)
    """
    print(message, file=sys.stderr, flush=True)
    distributed.leave(status, sys.exc_info()[1])
    return status


if __name__ == "__main__":
    sys.exit(main())
