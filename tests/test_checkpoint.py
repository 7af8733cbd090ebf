"""Checkpoints: restore into any stage, N and precision; crash safety; bad input; CLI resume."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import _procs
import jax
import numpy as np
import optax
import pytest
from _models import mlp_batches, mlp_loss, mlp_params

import jaxzero
from jaxzero.checkpoint import (
    LeafReader,
    complete_steps,
    is_step_dir,
    leaf_names,
    param_entries,
    read_extra,
    read_metadata,
)
from jaxzero.train import args as train_args
from jaxzero.train import loop as train
from jaxzero.train import rundir
from jaxzero.train import steps as train_steps

TX = optax.adamw(1e-2, weight_decay=0.1)
ROOT = Path(__file__).parent.parent


def _host(x):
    if not x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    return np.asarray(x)


def _logical(engine, state):
    """Params (fp32 master) and optimizer leaves by name, unpadded, on the host."""
    params = engine.gather_params(state)
    opt = {}
    lays = leaf_names(jaxzero.TrainState(None, None, None, engine.opt_layouts))
    for name, x in leaf_names(jaxzero.TrainState(None, None, None, state.opt_state)).items():
        lay = lays[name]
        opt[name] = _host(x)[tuple(slice(0, s) for s in lay.shape)]
    return params, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A stage-3, 8-device run saved after 2 steps, and its next step's loss."""
    d = tmp_path_factory.mktemp("ckpt")
    batches = mlp_batches(3, batch=24)
    engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=3)
    state = engine.init(mlp_params())
    for b in batches[:2]:
        state, _ = engine.step(state, b)
    ckpt = jaxzero.CheckpointManager(d)
    ckpt.save(engine, state, extra={"loader": {"step": 2}})
    params, opt = _logical(engine, state)
    _, m = engine.step(state, batches[2])  # the state may be donated right after save()
    ckpt.wait()
    return d, params, opt, float(m["loss"]), batches[2]


@pytest.mark.parametrize("stage, n", [(1, 4), (0, 1), (3, 3), (2, 8)])
def test_restore_into_another_stage_and_world_size(saved, stage, n):
    d, params, opt, next_loss, batch = saved
    engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(n), stage=stage)
    state, extra = jaxzero.CheckpointManager(d).restore(engine)  # engine not initialised
    assert extra == {"loader": {"step": 2}} and int(state.step) == 2
    got_params, got_opt = _logical(engine, state)
    for k in params:
        np.testing.assert_array_equal(got_params[k], params[k])
    assert got_opt.keys() == opt.keys()
    for k in opt:
        np.testing.assert_array_equal(got_opt[k], opt[k])
    if stage == 3:  # sharded straight into the target layout, padding for N=3
        w1 = state.params["w1"]
        assert not w1.is_fully_replicated and w1.shape == engine.layouts["w1"].padded_shape
    _, m = engine.step(state, batch)
    np.testing.assert_allclose(float(m["loss"]), next_loss, rtol=1e-6)


def test_precision_change_fp32_to_bf16_and_back(saved, tmp_path):
    d, params, _, next_loss, batch = saved
    bf16 = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=3, precision="bf16")
    state, _ = jaxzero.CheckpointManager(d).restore(bf16)
    for k in params:  # the fp32 master is exact; working params are its bf16 cast
        np.testing.assert_array_equal(bf16.gather_params(state)[k], params[k])
    _, m = bf16.step(state, batch)
    np.testing.assert_allclose(float(m["loss"]), next_loss, rtol=2e-2)
    ckpt = jaxzero.CheckpointManager(tmp_path)
    state, _ = jaxzero.CheckpointManager(d).restore(bf16)
    ckpt.save(bf16, state)
    ckpt.wait()
    fp32 = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(2), stage=1)
    back, _ = ckpt.restore(fp32)  # the master (not the bf16 params) comes back
    for k in params:
        np.testing.assert_array_equal(fp32.gather_params(back)[k], params[k])


def test_keep_last_and_metadata(tmp_path):
    engine = jaxzero.Engine(mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(8), stage=3)
    state = engine.init(mlp_params())
    ckpt = jaxzero.CheckpointManager(tmp_path, keep_last=2, keep_every=2)
    assert ckpt.latest_step() is None
    for b in mlp_batches(5):
        state, _ = engine.step(state, b)
        ckpt.save(engine, state)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4, 5]  # the last two, and every second one
    meta = ckpt.metadata()
    assert (meta["stage"], meta["num_shards"], meta["precision"], meta["step"]) == (3, 8, "fp32", 5)
    w1 = meta["leaves"]["params/w1"]
    assert (w1["shape"], w1["stored_shape"], w1["dtype"]) == ([37, 53], [37, 56], "float32")
    assert isinstance(w1["fingerprint"], int)


@pytest.mark.parametrize("stage, precision", [(0, "bf16"), (1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_every_saved_leaf_reads_back_alone(tmp_path, stage, precision):
    """The format contract between the writer (CheckpointManager) and the reader of export
    and sample (LeafReader, orbax's public restore of one leaf): every leaf the metadata
    lists reads back alone, at its logical shape and stored dtype, bit for bit the state
    that was saved; the params export reads are the fp32 truth, gather_params' values."""
    engine = jaxzero.Engine(
        mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=stage, precision=precision
    )
    state, _ = engine.step(engine.init(mlp_params()), mlp_batches(1, batch=24)[0])
    with jaxzero.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(engine, state, extra={"loader": {"step": 1}})
    step_dir = tmp_path / "1"
    assert complete_steps(tmp_path) == [1] and complete_steps(tmp_path / "none") == []
    assert is_step_dir(step_dir) and not is_step_dir(tmp_path)
    assert read_extra(step_dir) == {"loader": {"step": 1}}
    meta = read_metadata(step_dir)
    saved = leaf_names(state)
    assert sorted(meta["leaves"]) == sorted(saved)
    padded = 0
    with LeafReader(step_dir) as reader:
        for name, entry in meta["leaves"].items():
            shape = tuple(entry["shape"])
            want = _host(saved[name])
            padded += want.shape != shape
            want = np.asarray(want[tuple(slice(0, n) for n in shape)], order="C")
            got = reader.read(name, shape)
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            assert got.tobytes() == want.tobytes(), name
        params = engine.gather_params(state)
        entries = param_entries(meta)
        assert {leaf.split("/")[0] for _, leaf, _ in entries} == {
            "master" if precision == "bf16" else "params"
        }
        assert sorted(n for n, *_ in entries) == sorted(params)
        for name, leaf, shape in entries:
            np.testing.assert_array_equal(
                reader.read(leaf, shape, np.dtype(np.float32)), params[name]
            )
    assert padded or stage == 0  # sharded leaves were stored padded: the reader dropped it


# a damaged file fails one of orbax's concurrent reads; the others must not echo it
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_bad_checkpoints_are_named(saved, tmp_path):
    d, *_ = saved
    engine = lambda: jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=3)
    with pytest.raises(jaxzero.CheckpointError, match="no complete checkpoint in .*does not"):
        jaxzero.CheckpointManager(tmp_path / "missing").restore(engine())
    assert not (tmp_path / "missing").exists()  # looking created nothing
    other = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=3)
    p = mlp_params()
    p["w1"] = p["w1"][:, :50]
    other.init(p)
    with pytest.raises(
        jaxzero.CheckpointError,
        match=r"different model: param 'w1' is "
        r"\(37, 53\) there and \(37, 50\) here",
    ):
        jaxzero.CheckpointManager(d).restore(other)
    with pytest.raises(jaxzero.CheckpointError, match="different optimizer or model"):
        jaxzero.CheckpointManager(d).restore(
            jaxzero.Engine(mlp_loss, optax.lion(1e-3), mesh=jaxzero.make_mesh(8))
        )
    # flipped bytes anywhere in the data: a one-line error naming the path, never a silent
    # different state (orbax stores no checksum; the metadata holds a fingerprint per leaf)
    import shutil

    e = engine()
    want = _logical(e, jaxzero.CheckpointManager(d).restore(e)[0])
    files = sorted(f for f in (d / "2" / "state").rglob("d/*") if f.is_file())
    assert files
    for i, frac in enumerate((0.1, 0.3, 0.5, 0.7, 0.9, 0.97)):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(d, bad)
        f = bad / files[i % len(files)].relative_to(d)
        data = bytearray(f.read_bytes())
        at = int(len(data) * frac)
        data[at : at + 4] = bytes(x ^ 0x5A for x in data[at : at + 4])
        f.write_bytes(bytes(data))
        before = sorted(str(p) for p in bad.rglob("*"))
        try:
            e = engine()
            got = _logical(e, jaxzero.CheckpointManager(bad).restore(e)[0])
        except jaxzero.CheckpointError as err:
            assert f"checkpoint {bad}/2" in str(err) and "\n" not in str(err)
        else:  # the flip hit bytes that do not matter (e.g. unused): the state is intact
            for k in want[0]:
                np.testing.assert_array_equal(got[0][k], want[0][k])
            for k in want[1]:
                np.testing.assert_array_equal(got[1][k], want[1][k])
        assert sorted(str(p) for p in bad.rglob("*")) == before  # nothing deleted


CRASH = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import jax, numpy as np, optax, jaxzero
    from _models import mlp_loss
    params = {{"w": np.ones((2048, 2048), np.float32), "v": np.ones((4096, 1024), np.float32)}}
    engine = jaxzero.Engine(lambda p, b: 0.0, optax.adam(1e-3),
                            mesh=jaxzero.make_mesh(8), stage=3)
    state = engine.init(params)
    ckpt = jaxzero.CheckpointManager({d!r})
    ckpt.save(engine, state); ckpt.wait()
    state = jaxzero.TrainState(state.step + 1, state.params, state.master, state.opt_state)
    ckpt.save(engine, state)  # returns with the write still in flight
    # the partial directory may appear after save() returns: kill once it is there
    # (the 400 MB write takes seconds; killed before it began, nothing would be tested)
    while not any("tmp" in name for name in os.listdir({d!r})):
        if "1" in os.listdir({d!r}):
            sys.exit("the save finished before it could be cut short")
        time.sleep(0.005)
    print("saving", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.every_lane
@pytest.mark.system
def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path):
    d = tmp_path / "ck"
    script = CRASH.format(tests=str(Path(__file__).parent), d=str(d))
    proc = _procs.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL and "saving" in proc.stdout, proc.stderr[-2000:]
    assert any("tmp" in p.name for p in d.iterdir())  # the save was cut short mid-write
    ckpt = jaxzero.CheckpointManager(d)  # opening cleans the partial one up
    assert ckpt.all_steps() == [0]
    assert not any("tmp" in p.name for p in d.iterdir())
    engine = jaxzero.Engine(lambda p, b: 0.0, optax.adam(1e-3), mesh=jaxzero.make_mesh(8), stage=3)
    state, _ = ckpt.restore(engine)
    assert int(state.step) == 0 and float(np.asarray(_host(state.params["w"])).mean()) == 1.0


ENDS_WITHOUT_WAIT = textwrap.dedent("""
    import numpy as np, optax, jaxzero
    engine = jaxzero.Engine(lambda p, b: 0.0, optax.adam(1e-3), mesh=jaxzero.make_mesh(8),
                            stage=3)
    state = engine.init({{"w": np.full((1024, 1024), 0.5, np.float32)}})
    jaxzero.CheckpointManager({d!r}).save(engine, state)  # no wait(), no close()
    print("saved", flush=True)
""")


@pytest.mark.every_lane
@pytest.mark.system
def test_a_script_that_ends_without_wait_keeps_its_checkpoint_and_prints_nothing(tmp_path):
    """The save in flight completes as the interpreter exits, without orbax's
    "cannot schedule new futures" / "Event loop is closed" tracebacks."""
    d = tmp_path / "ck"
    proc = _procs.run(
        [sys.executable, "-c", ENDS_WITHOUT_WAIT.format(d=str(d))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout == "saved\n", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Event loop" not in proc.stderr, proc.stderr
    with jaxzero.CheckpointManager(d) as ckpt:
        assert ckpt.all_steps() == [0]
        engine = jaxzero.Engine(lambda p, b: 0.0, optax.adam(1e-3), mesh=jaxzero.make_mesh(2))
        state, _ = ckpt.restore(engine)
    assert float(np.asarray(_host(state.params["w"])).mean()) == 0.5


# --- the CLI: checkpoint.every, --resume, SIGKILL and SIGTERM -----------------------------

TINY = str(ROOT / "configs" / "tiny.yaml")


def _cmd(root: Path, name: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "jaxzero.train", "--config", TINY, "--steps", "8",
        "--name", name, "--simulate-devices", "4", "--set", f"logging.root={root}",
        "--set", "logging.log_every=1", "--set", "logging.eval_every=100",
        "--set", "logging.eval_batches=1", "--set", "logging.sample_tokens=0",
        "--set", "logging.tensorboard=false", "--set", "data.max_bytes=100000",
        "--set", "model.d_model=32", "--set", "model.seq_len=32", *extra,
    ]  # fmt: skip


def _records(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rundir.read_jsonl(run / rundir.METRICS_FILE)}


def _ema_leaves(run: Path, step: int) -> dict[str, np.ndarray]:
    """The EMA of the weights (``ema/...``) in a run's checkpoint of ``step``."""
    step_dir = run / "checkpoints" / str(step)
    leaves = read_metadata(step_dir)["leaves"]
    with LeafReader(step_dir) as reader:
        return {n: reader.read(n, v["shape"]) for n, v in leaves.items() if n.startswith("ema/")}


def _run_until(
    cmd: list[str], run: Path, step: int, sig: int, saved: int | None = None
) -> tuple[_procs.Child, str]:
    """Start ``cmd``; once ``step`` is logged (and checkpoint ``saved`` committed), send
    ``sig``; return the finished process and its stderr."""
    proc = _procs.Child(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        ready = saved is None or (run / "checkpoints" / str(saved)).is_dir()
        if ready and (run / rundir.METRICS_FILE).is_file() and step in _records(run):
            proc.send_signal(sig)
            break
        time.sleep(0.01)
    _, err = proc.communicate(timeout=300)
    return proc, err


@pytest.mark.timeout(600)  # five training processes one after the other
@pytest.mark.every_lane
@pytest.mark.system
def test_resume_after_sigkill_and_sigterm_is_exact(tmp_path):
    """30 steps: a tiny step takes milliseconds on a quiet machine, and the signals must
    land before the run ends (with 8, a SIGTERM after step 3 came after step 8). The runs
    keep an EMA of the weights (train.ema): resumed, it is bit-identical too."""
    env = {**os.environ}
    steps = ["--steps", "30", "--set", "train.ema=0.9"]
    full = _procs.run(
        _cmd(tmp_path, "full", *steps), capture_output=True, text=True, env=env, timeout=300
    )
    assert full.returncode == 0, full.stderr[-2000:]
    want = _records(tmp_path / "full")

    # killed outright after step 6; the checkpoint of step 4 is the latest complete one
    run = tmp_path / "killed"
    proc, _ = _run_until(
        _cmd(tmp_path, "killed", *steps, "--set", "checkpoint.every=4"),
        run,
        6,
        signal.SIGKILL,
        saved=4,
    )
    assert proc.returncode == -signal.SIGKILL
    assert max(_records(run)) < 30  # killed before the end
    again = _procs.run(
        _cmd(tmp_path, "x")[:3] + ["--resume", str(run)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resume from" in again.stdout and "(step 4)" in again.stdout
    got = _records(run)
    assert sorted(got) == list(range(1, 31))  # steps 5-6 logged before the kill: replaced
    assert [got[s] for s in range(5, 31)] == [want[s] for s in range(5, 31)]  # bit-identical
    ema, full_ema = _ema_leaves(run, 30), _ema_leaves(tmp_path / "full", 30)
    assert ema and sorted(ema) == sorted(full_ema)
    for name, value in full_ema.items():
        np.testing.assert_array_equal(ema[name], value, err_msg=name)

    # SIGTERM: the step finishes, a checkpoint is written, the command says how to resume
    run = tmp_path / "term"
    proc, err = _run_until(_cmd(tmp_path, "term", *steps), run, 3, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    err = err.strip().splitlines()[-1]
    assert "stopped by SIGTERM after step" in err and f"--resume {run}" in err
    stopped = max(_records(run))
    assert jaxzero.CheckpointManager(run / "checkpoints").latest_step() == stopped
    again = _procs.run(
        _cmd(tmp_path, "x")[:3]
        + ["--resume", "--name", "term", "--set", f"logging.root={tmp_path}", "--stage", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "changed parallel.stage: 3 -> 1" in again.stdout
    got = _records(run)
    assert sorted(got) == list(range(1, 31))
    np.testing.assert_allclose(
        [got[s] for s in range(1, 31)], [want[s] for s in range(1, 31)], rtol=1e-5
    )  # another stage: equal to fp32 rounding
    ema = _ema_leaves(run, 30)  # resharded from stage 3 to 1 with the master
    for name, value in full_ema.items():
        np.testing.assert_allclose(ema[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.system
@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--resume"], "--resume needs a run directory"),
        (["--resume", "nowhere"], "nothing to resume in 'nowhere'"),
    ],
)
def test_resume_errors_are_one_line(tmp_path, capsys, extra, expected):
    assert train.main(extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


@pytest.mark.system
def test_resume_refuses_a_model_change_and_an_empty_run(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    from jaxzero.train import config as C

    cfg = C.override(C.override(C.Config(), "logging.name", "r"), "logging.root", str(tmp_path))
    cfg = C.override(cfg, "data.max_bytes", 100000)
    (run / "config.yaml").write_text(C.dump_yaml(cfg))
    assert train.main(["--resume", str(run), "--set", "model.d_model=64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot resume with model.d_model=64: the run was trained with 128" in err
    assert train.main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no complete checkpoint in" in err
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # nothing written


@pytest.mark.timeout(600)  # trains, diverges, restores and trains on
@pytest.mark.system
def test_nan_rollback_restores_and_skips_the_batch(tmp_path, monkeypatch, capsys):
    """A non-finite loss at step 6 (faked once) rolls back to step 4 and skips its batch."""
    seen, real = [], train_steps.check_finite

    def flaky(step, loss, grad_norm):
        seen.append(step)
        if step == 6 and seen.count(6) == 1:
            loss = float("nan")
        real(step, loss, grad_norm)

    monkeypatch.setattr(train_steps, "check_finite", flaky)
    argv = _cmd(
        tmp_path,
        "nan",
        "--set",
        "checkpoint.every=4",
        "--set",
        "checkpoint.on_nan=rollback",
        "--devices",
        "8",
    )[3:]
    argv.remove("--simulate-devices"), argv.remove("4")
    assert train.main(argv) == 0
    assert seen == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    out = capsys.readouterr().out
    assert "step 6: loss" in out and "rolled back to step 4, skipping batch 5" in out
    assert sorted(_records(tmp_path / "nan")) == list(range(1, 9))  # each step logged once
    ckpt = jaxzero.CheckpointManager(tmp_path / "nan" / "checkpoints")
    assert ckpt.all_steps() == [4, 8]
    # the replayed step 5 read the same batch, the new step 6 the one after the bad one
    extra = read_extra(ckpt.directory / "8")
    assert extra["loader"]["step"] == 9 and extra["config"]["checkpoint"]["on_nan"] == "rollback"


@pytest.mark.system
def test_a_launch_restart_resumes_the_named_run(tmp_path, monkeypatch):
    """`jaxzero launch --max-restarts` reruns the same command: it continues the run."""
    from jaxzero.train import config as C

    argv = ["--name", "r", "--set", f"logging.root={tmp_path}", "--stage", "1"]
    run = tmp_path / "r"
    run.mkdir()
    cfg = C.override(C.override(C.Config(), "logging.name", "r"), "logging.root", str(tmp_path))
    (run / "config.yaml").write_text(C.dump_yaml(cfg))
    monkeypatch.setenv("JAXZERO_RESTART_COUNT", "1")
    args = train_args.build_parser().parse_args(argv)
    train_args.config_from_args(args)
    assert not args.resume  # no checkpoint yet: the command starts the run again
    (run / "checkpoints" / "4").mkdir(parents=True)
    args = train_args.build_parser().parse_args(argv)
    cfg = train_args.config_from_args(args)
    assert args.resume == str(run) and args.resume_changes == ["parallel.stage: 3 -> 1"]
    monkeypatch.setenv("JAXZERO_RESTART_COUNT", "0")
    args = train_args.build_parser().parse_args(argv)
    train_args.config_from_args(args)
    assert not args.resume  # a first start never resumes by itself
