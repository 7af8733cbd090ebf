"""``jaxzero train``: train a GPT on text with ZeRO sharding, from a laptop CPU upwards.

With no arguments it trains a small byte-level GPT on this Python's standard
library sources at stage 3 over 8 simulated CPU devices, so the first thing a
researcher runs already shards parameters, gradients and optimizer state.
Everything else is a config field (:mod:`jaxzero.train.config`); this module turns a
config into a run (:class:`~jaxzero.train.steps.Run`: the engine, the data, the writers,
the checkpoints) in four phases, set-up, restore-or-init, the steps
(:mod:`jaxzero.train.steps`) and the finish, and reports what happened.

Order matters: arguments are parsed and the config validated before JAX does
any computation, because simulated CPU devices can only be requested before
the backend starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxzero import cli, distributed
from jaxzero.accounting.estimate import format_bytes, parse_bytes
from jaxzero.accounting.planner import shard_bytes
from jaxzero.checkpoint import CheckpointError, CheckpointManager, CheckpointWriteError
from jaxzero.ema import EMAWarning
from jaxzero.mesh import num_shards
from jaxzero.train import config as config_lib
from jaxzero.train import data as data_lib
from jaxzero.train import finetune, lora_run, memguard, planning, rundir
from jaxzero.train import metrics as metrics_lib
from jaxzero.train import resume as resume_lib
from jaxzero.train.args import RESOLVED_CONFIG, build_parser, config_from_args
from jaxzero.train.config import Config, ConfigError
from jaxzero.train.devices import printable_config, resolve_run, setup_devices
from jaxzero.train.planning import build
from jaxzero.train.steps import Diverged, Run, Steps, base_frozen


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
    """Set-up, restore-or-init, the loop, the finish; a failed write says what was kept."""
    watch = metrics_lib.Stopwatch(started)
    if resume is not None:
        run_dir = Path(cfg.logging.root) / str(cfg.logging.name)
        if resume_lib.finished(run_dir, cfg.train.steps) is not None:
            print(
                f"jaxzero train: {run_dir} finished at step {cfg.train.steps}; nothing to "
                "resume (give --steps N to train it further)"
            )
            return json.loads((run_dir / rundir.SUMMARY_FILE).read_text())
    run = _set_up(cfg, resume, init_timeout, stop, undo, watch)
    guard = _guard(run)  # from here on the run allocates: the state, the batches, the steps
    try:
        return _run(run, resume, guard)
    finally:
        if guard is not None:
            guard.stop()


def _run(run: Run, resume: list[str] | None, guard: memguard.MemoryGuard | None) -> dict:
    restored = _restore(run) if resume is not None else None
    run.writer = metrics_lib.MetricsWriter(
        run.directory if run.is_main else None, run.cfg.logging.tensorboard
    )
    run.progress = metrics_lib.Progress(run.cfg.train.steps, run.cfg.logging.progress, run.is_main)
    try:
        try:
            state, position = _restore_or_init(run, restored)
            if guard is not None and guard.limit is not None and guard.host_is_device:
                # a checkpoint's host copy of the state is not the devices' memory
                guard.allow_host(planning.unique_bytes(run.engine.state_shapes()))
            summary = _loop(run, state, position)
            summary["planned_peak_bytes_per_device"] = run.planned_peak
            summary["state_bytes"] = run.state_bytes
            if guard is not None:
                summary.update(guard.summary())
            if run.is_main:
                rundir.write_json(run.directory / rundir.SUMMARY_FILE, summary)
            return summary
        finally:
            _close(run.progress, run.writer, run.ckpt)
    except CheckpointWriteError as e:
        raise resume_lib.WriteFailed(str(e), e.latest is not None, run.directory) from None
    except OSError as e:  # metrics, TensorBoard, the summary: the disk is full or gone
        raise resume_lib.WriteFailed(
            f"cannot write {e.filename!r}: {e.strerror or e}"
            if e.filename
            else f"a write failed: {e.strerror or e}",
            _has_checkpoint(run.ckpt),
            run.directory,
        ) from None


# --------------------------------------------------------------------------- set-up


def _set_up(
    cfg: Config,
    resume: list[str] | None,
    init_timeout: float | None,
    stop: resume_lib.StopSignals,
    undo: list[Callable[[], Any]],
    watch: metrics_lib.Stopwatch,
) -> Run:
    """Joins the job, builds the mesh, reads the data, prepares the run and checkpoint
    directories and builds the model: everything before the first state."""
    # Joins the job when launched as one of several processes (a no-op otherwise): first,
    # so that a wrong RANK or an absent coordinator fails before any data is read.
    job = distributed.initialize(
        simulate_devices=cfg.parallel.simulate_devices, init_timeout=init_timeout
    )
    pretrained = None
    if resume is None and finetune.source(cfg) is not None:
        cfg, pretrained = finetune.resolve(cfg)  # its model fields and tokenizer
    mesh, simulated = setup_devices(cfg.parallel, job, cfg.mesh.group_size, cfg.mesh.model)
    _check_batch(cfg, mesh)
    cfg = resolve_run(cfg, mesh.size, simulated, cfg.model.vocab_size)  # the name, said first
    cfg, corpus = _load_data(cfg, mesh.size, simulated)
    model, engine, schedule = build(cfg, mesh, pretrained)
    planned = state_bytes = None
    if cfg.zero.preflight or cfg.zero.auto:  # before anything is written: a refusal leaves none
        checked = planning.preflight(
            cfg, mesh, model, engine, planning.first_batch(cfg, corpus), pretrained
        )
        cfg, model, engine = checked.cfg, checked.model, checked.engine
        planned, state_bytes = checked.peak, checked.state_bytes
        if cfg.logging.progress != "none" and _is_main():
            print(checked.line, flush=True)
    run_dir, ckpt_dir = resume_lib.directories(cfg, resume, undo)
    ckpt = CheckpointManager(  # a LoRA run's base is read again from its source
        ckpt_dir,
        cfg.checkpoint.keep_last,
        cfg.checkpoint.keep_every,
        save_frozen=not lora_run.enabled(cfg),
    )
    if pretrained is not None:
        cfg, _ = finetune.pin_architecture(cfg, pretrained, run_dir, _is_main())
    return Run(
        cfg, job, mesh, simulated, corpus, run_dir, ckpt, stop, watch, resume, pretrained,
        model, engine, schedule, planned, state_bytes,
    )  # fmt: skip


def _guard(run: Run) -> memguard.MemoryGuard | None:
    """The run's memory guard (``zero.memory_guard``), started: on CPU the host's memory
    is the devices'. A given ``zero.device_memory`` is held at run time too: on a GPU by
    the allocator's peak; on CPU, where only the process's resident growth tells (the
    runtime's and the compiler's own bytes with the devices'), when no pre-flight held
    the compiled step to it (``zero.preflight=false``), with room for a checkpoint's host
    copy of the state."""
    cfg = run.cfg
    if not cfg.zero.memory_guard:
        return None
    device = jax.local_devices()[0]
    on_cpu = device.platform == "cpu"
    checked = cfg.zero.preflight or cfg.zero.auto
    limit = None
    if cfg.zero.device_memory is not None and not (on_cpu and checked):
        mine = [d for d in run.mesh.devices.flat if d.process_index == jax.process_index()]
        limit = memguard.Limit(parse_bytes(cfg.zero.device_memory), len(mine))
    return memguard.MemoryGuard(limit, host_is_device=on_cpu, device=device).start()


def _is_main() -> bool:
    return jax.process_index() == 0


def _check_batch(cfg: Config, mesh: Any) -> None:
    """The global batch's rows divide over the devices with rows of their own (a model
    group shares its rows; with Ulysses the state's shards share them, each a slice of
    the sequence), times the micro-batches."""
    shards = num_shards(mesh)
    rows = mesh.size // cfg.mesh.model // (shards if cfg.mesh.ulysses else 1)
    need = rows * cfg.parallel.micro_batches
    if cfg.train.batch_size % need:
        per = f" (of {mesh.size} / mesh.model={cfg.mesh.model})" if cfg.mesh.model > 1 else ""
        if cfg.mesh.ulysses:
            per = f" (mesh.ulysses: each row split over {shards})"
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} must be a multiple of "
            f"{rows} data devices{per} x {cfg.parallel.micro_batches} micro-batches = {need}"
        )
    if cfg.mesh.ulysses and cfg.model.seq_len % shards:
        raise ConfigError(
            f"mesh.ulysses splits each sequence over {shards} devices: model.seq_len="
            f"{cfg.model.seq_len} does not divide; use a multiple of {shards}"
        )


def _load_data(cfg: Config, n_dev: int, simulated: int | None) -> tuple[Config, Any]:
    """The corpus, checked against ``seq_len``, and the config with its vocab filled in."""
    shown = cfg.logging.progress if _is_main() else "none"
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
    return resolve_run(cfg, n_dev, simulated, vocab), corpus


# --------------------------------------------------------------------------- restore or init


def _restore(run: Run) -> tuple[Any, dict[str, Any], list[str]]:
    """A resumed run's latest checkpoint (CheckpointError: nothing readable to resume) and
    what its restore said (an EMA started or dropped: ``train.ema`` changed); records
    logged after it are dropped, to be logged again. A LoRA run's frozen base is read
    again from ``train.init_from`` and must be the one its adapters were trained on."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", EMAWarning)
        state, extra = run.ckpt.restore(run.engine, frozen=base_frozen(run))
    notes = [str(w.message) for w in said if issubclass(w.category, EMAWarning)]
    for w in said:  # anything else, as it would have been shown
        if not issubclass(w.category, EMAWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if lora_run.enabled(run.cfg):
        source = finetune.source(run.cfg)
        assert source is not None  # lora_run.adapters refuses LoRA without it
        lora_run.check_base(extra.get(lora_run.BASE), source)
    if run.is_main:
        resume_lib.drop_records_after(run.directory / rundir.METRICS_FILE, int(state.step))
    return state, extra, notes


def _restore_or_init(
    run: Run, restored: tuple[Any, dict[str, Any], list[str]] | None
) -> tuple[Any, dict[str, Any] | None]:
    """The first state (restored, fine-tuned from, or initialized) and the loader's
    position, after writing the resolved config and printing the banner."""
    cfg = run.cfg
    if run.is_main:
        (run.directory / RESOLVED_CONFIG).write_text(config_lib.dump_yaml(cfg))
        run.writer.text("config", config_lib.dump_yaml(cfg))
    notes: list[str] = []
    if restored is not None:
        state, extra, notes = restored
    elif run.pretrained is not None:
        state, extra = finetune.load(cfg, run.engine, run.pretrained), {}  # each: its slices
    else:
        state, extra = run.engine.init_from(run.model.init, jax.random.key(cfg.train.seed)), {}
    per_run = None if run.job.multi else run.simulated  # multi-process: the mesh line says it
    run.progress.print(
        metrics_lib.banner(cfg, run.corpus, run.engine.num_params, per_run, _lora_line(run))
        + "\n  mesh   "
        + _mesh_line(run.job, run.mesh, run.cfg.mesh.ulysses)
    )
    if run.resume is not None:
        run.progress.print(
            f"  resume from {run.ckpt.directory / str(int(state.step))} (step "
            f"{int(state.step)})"
            + "".join(f"\n  changed {c}" for c in run.resume)
            + "".join(f"\n  note   {n}" for n in notes)
        )
    return state, extra.get("loader")


def _lora_line(run: Run) -> str:
    """A LoRA run's banner line: what trains and what is frozen, counts and bytes per
    device (from the state's shapes: its master, optimizer state and frozen base)."""
    e = run.engine
    if not e.num_frozen:
        return ""
    shapes = e.state_shapes()
    frozen = shard_bytes(shapes.frozen)
    trained = shard_bytes(shapes) - frozen
    lora = run.cfg.lora
    return (
        f"rank {run.model.lora.rank}, alpha {run.model.lora.alpha:g} on {lora.targets}: "
        f"{e.num_params:,} params train ({format_bytes(trained)} per device with their "
        f"optimizer state), {e.num_frozen:,} frozen ({format_bytes(frozen)} per device)"
    )


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


def _mesh_line(job: Any, mesh: Any, ulysses: bool = False) -> str:
    """Processes x local devices and the mesh's axes, for the banner."""
    procs = distributed.describe_processes(job, jax.local_device_count(), jax.device_count())
    line = f"{procs}, {distributed.describe_mesh(mesh)}"
    if ulysses:
        line += f", each sequence split over {num_shards(mesh)} (Ulysses, mesh.ulysses)"
    return line


# --------------------------------------------------------------------------- loop, finish


def _loop(run: Run, state: Any, position: dict[str, Any] | None) -> dict[str, Any]:
    """Trains from ``state`` to ``train.steps``, saves the end, and finishes."""
    steps = Steps.start(run, state, position)
    state = steps.train(state)
    every = run.cfg.checkpoint.every
    if (every and run.cfg.train.steps % every) or (not every and run.cfg.checkpoint.final):
        steps.save(state)  # the end (a multiple of every was saved in the loop)
    return _finish(run, state, steps.loss, steps.val_loss)


def _finish(run: Run, state: Any, loss: float, val_loss: float) -> dict[str, Any]:
    """Waits for the last checkpoint, then the summary and a sample, printed."""
    run.ckpt.wait()
    summary = metrics_lib.summarize(run.cfg, run.engine, run.model, run.watch, loss, val_loss)
    sample = _sample(run.cfg, run.engine, state, run.model, run.corpus)
    if sample is not None:
        summary["sample"] = sample
        run.writer.text("sample", sample)
    run.progress.close()
    run.progress.print(metrics_lib.format_summary(summary))
    return summary


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

    def body(args: argparse.Namespace) -> int:
        cfg = config_from_args(args)
        if args.print_config:
            print(printable_config(cfg), end="")
            return 0
        try:
            train(
                cfg,
                started,
                getattr(args, "resume_changes", None) if args.resume else None,
                args.init_timeout,
            )
        except resume_lib.Stopped as e:  # a signal, after saving: not an error
            return _leave(f"jaxzero train: {e}", 128 + e.signum)
        except resume_lib.WriteFailed as e:
            return _leave(f"jaxzero train: error: {e}", 1)
        except Diverged as e:
            return _leave(f"jaxzero train: {e}", 1)
        except jax.errors.JaxRuntimeError as e:  # an accelerator's allocator refused
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return _leave(memguard.out_of_memory_line(e), 1)
        distributed.shutdown()  # every process leaves together
        return 0

    return cli.run("train", build_parser().parse_args, body, argv, leave=_leave)


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
