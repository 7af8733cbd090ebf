"""A run keeps what it trained and uses no one else's weights: a final checkpoint by
default, a message per save, a finished run left alone on --resume, a schedule that keeps
its horizon when extended, checkpoints of an earlier run under the same name set aside, and
an interrupt during start-up that stops at once and keeps nothing."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import _procs
import pytest

from jaxzero import cli
from jaxzero.train import rundir

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _train_argv(root: Path, name: str, *extra: str) -> list[str]:
    return [
        "--config", TINY, "--name", name, "--devices", "2", "--set", f"logging.root={root}",
        "--set", "logging.eval_every=100", "--set", "logging.sample_tokens=0",
        "--set", "logging.log_every=1", "--set", "logging.tensorboard=false",
        "--set", "data.max_bytes=60000", "--set", "model.d_model=32",
        "--set", "model.seq_len=32", *extra,
    ]  # fmt: skip


def _train(root: Path, name: str, *extra: str) -> int:
    return cli.main(["train", *_train_argv(root, name, *extra)])


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in rundir.read_jsonl(run / rundir.METRICS_FILE)}


def test_a_default_run_keeps_an_exportable_checkpoint(tmp_path, capsys):
    assert _train(tmp_path, "plain", "--steps", "3") == 0
    out = capsys.readouterr().out
    assert f"checkpoint step 3 -> {tmp_path / 'plain' / 'checkpoints' / '3'}" in out
    assert cli.main(["export", str(tmp_path / "plain"), "--out", str(tmp_path / "x")]) == 0


def test_resume_leaves_a_finished_run_alone_and_extends_without_a_jump(tmp_path, capsys):
    run = tmp_path / "done"
    assert _train(tmp_path, "done", "--steps", "6", "--set", "optimizer.warmup_steps=2") == 0
    summary = (run / "summary.json").read_bytes()
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run)]) == 0
    assert "finished at step 6; nothing to resume" in capsys.readouterr().out
    assert (run / "summary.json").read_bytes() == summary
    assert cli.main(["train", "--resume", str(run), "--steps", "9"]) == 0
    assert "optimizer.decay_steps: None -> 6" in capsys.readouterr().out
    lr = {s: r["lr"] for s, r in _records(run).items()}
    assert sorted(lr) == list(range(1, 10))
    assert lr[7] <= lr[6] and lr[7] == pytest.approx(lr[9])  # the floor, no jump back up


def test_a_fresh_run_never_inherits_checkpoints_under_its_name(tmp_path, capsys):
    old = tmp_path / "reused" / "checkpoints" / "1"  # an aborted run's step-1 checkpoint
    old.mkdir(parents=True)
    (old / "marker").write_text("not this run's")
    assert _train(tmp_path, "reused", "--steps", "2") == 0
    out = capsys.readouterr().out
    assert "held another run's checkpoints" in out and "moved them to" in out
    steps = sorted(p.name for p in (tmp_path / "reused" / "checkpoints").iterdir())
    assert steps == ["2"]
    aside = [p for p in (tmp_path / "reused").iterdir() if ".replaced-" in p.name]
    assert len(aside) == 1 and (aside[0] / "1" / "marker").is_file()  # kept, not deleted


def test_a_checkpoint_dir_holding_another_run_is_refused_before_compiling(tmp_path, capsys):
    shared = tmp_path / "shared"
    (shared / "5").mkdir(parents=True)
    rc = _train(tmp_path, "other", "--steps", "2", "--set", f"checkpoint.dir={shared}")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "already holds checkpoints of another run" in err
    assert not (tmp_path / "other" / rundir.SUMMARY_FILE).exists()


def test_export_and_sample_name_the_step_and_warn_of_a_stale_checkpoint(tmp_path, capsys):
    run = tmp_path / "stale"
    assert _train(tmp_path, "stale", "--steps", "2") == 0
    capsys.readouterr()
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x")]) == 0
    err = capsys.readouterr().err
    assert f"from the checkpoint of step 2 ({run / 'checkpoints' / '2'})" in err
    assert "warning" not in err
    with open(run / rundir.METRICS_FILE, "a") as f:  # trained on, stopped before a save
        f.write('{"step": 5, "loss": 1.0}\n')
    assert cli.main(["sample", str(run), "--tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "warning: the run logged step 5, after its latest checkpoint" in err


# Root writes through permission bits by CAP_DAC_OVERRIDE (CI runs as root): the run then
# goes without it (setpriv drops it from the capability bounding set), and obeys them.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is None,
    reason="as root this needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE",
)
def test_unwritable_outputs_are_refused_in_one_line_before_compiling(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    as_user = NO_DAC if os.geteuid() == 0 else []
    argv = [sys.executable, "-m", "jaxzero.cli", "train", *_train_argv(tmp_path, "ro")]
    try:
        done = _procs.run(
            [*as_user, *argv, "--steps", "2", "--set", f"checkpoint.dir={locked / 'c'}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
        assert "cannot write checkpoints to" in done.stderr and "Permission denied" in done.stderr
        assert not (tmp_path / "ro").exists()  # no half-made run directory
        assert not (locked / "c").exists()
    finally:
        locked.chmod(0o700)


def test_checkpoint_dir_and_export_out_fail_in_one_line(tmp_path, capsys):
    """As root too: a path under a file cannot be created."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = _train(tmp_path, "under", "--steps", "2", "--set", f"checkpoint.dir={blocker / 'c'}")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot write checkpoints to" in err
    assert not (tmp_path / "under").exists()
    assert _train(tmp_path, "ok", "--steps", "2") == 0
    capsys.readouterr()
    rc = cli.main(["export", str(tmp_path / "ok"), "--out", str(blocker / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot create --out" in err


@pytest.mark.parametrize("name", ["../escaped", "a/b", ".."])
def test_a_run_name_stays_inside_the_root(tmp_path, capsys, name):
    assert _train(tmp_path / "root", name, "--steps", "1") == 2
    assert "a run name is one directory name inside logging.root" in capsys.readouterr().err
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize("reused", [False, True])
def test_ctrl_c_during_start_up_stops_at_once_and_keeps_nothing(tmp_path, reused):
    """The signal lands while the first step compiles: no step, no checkpoint, no run
    directory (and an earlier run's checkpoints set aside go back where they were)."""
    run = tmp_path / "runs" / "early"
    if reused:
        (run / "checkpoints" / "4").mkdir(parents=True)
    proc = _procs.Child(
        [
            sys.executable,
            "-m",
            "jaxzero.cli",
            "train",
            "--config",
            TINY,
            "--name",
            "early",
            "--devices",
            "2",
            "--set",
            f"logging.root={tmp_path / 'runs'}",
            "--set",
            "logging.overwrite=true",
            "--set",
            "data.max_bytes=60000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=300,
    )
    for line in proc.stdout:
        if line.startswith("  mesh "):  # the banner's last line: the first step compiles next
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert time.monotonic() - sent < 1.0
    assert "interrupted by SIGINT during start-up; stopped at once" in err
    assert "step" not in out and "checkpoint" not in out
    if reused:
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]
        assert (run / "checkpoints" / "4").is_dir()
    else:
        assert not run.exists()


@pytest.mark.unit
def test_a_resumed_longer_run_decays_from_where_its_horizon_ended():
    """A 4-step run whose warmup (30) filled its horizon, resumed with --steps 8: steps 1-4
    as trained, then a decay from the peak to the floor at step 8 (not the peak again at
    step 5, then the floor); a horizon that decayed to the floor stays there."""
    from jaxzero.train import optimizer
    from jaxzero.train.config import OptimizerConfig

    opt = OptimizerConfig(lr=4e-3, warmup_steps=30, min_lr_ratio=0.1)
    trained = [float(optimizer.lr_schedule(opt, 4)(c)) for c in range(4)]
    assert trained == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])
    _, resumed = optimizer.make_optimizer(dataclasses.replace(opt, decay_steps=4), 8)
    lr = [float(resumed(c)) for c in range(8)]
    assert lr[:4] == pytest.approx(trained)
    assert all(a > b for a, b in zip(lr[3:], lr[4:], strict=False))  # no step at the peak again
    assert lr[-1] == pytest.approx(4e-4)
    _, again = optimizer.make_optimizer(dataclasses.replace(opt, decay_steps=4), 12)
    twice = [float(again(c)) for c in range(12)]  # extended again: no trained rate changes
    assert twice[:8] == pytest.approx(lr) and twice[8:] == pytest.approx([4e-4] * 4)
    decayed = dataclasses.replace(opt, warmup_steps=2, decay_steps=6)
    lr = [float(optimizer.make_optimizer(decayed, 9)[1](c)) for c in range(9)]
    fresh = optimizer.lr_schedule(dataclasses.replace(decayed, decay_steps=None), 6)
    assert lr[:6] == pytest.approx([float(fresh(c)) for c in range(6)])
    assert lr[5:] == pytest.approx([4e-4] * 4)


@pytest.mark.unit
def test_resume_with_other_simulated_devices_trains_on_all_of_them(tmp_path):
    """A run trained on 1 simulated device, resumed with --simulate-devices 8: the saved
    device count (resolved from the old setup) no longer pins the run to 1 of the 8."""
    from jaxzero.train import args as args_lib
    from jaxzero.train import config as config_lib

    run = tmp_path / "one"
    run.mkdir()
    cfg = config_lib.Config()
    saved = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, devices=1, simulate_devices=1)
    )
    (run / "config.yaml").write_text(config_lib.dump_yaml(saved))

    def resume(*argv: str) -> tuple[config_lib.Config, list[str]]:
        args = args_lib.build_parser().parse_args(["--resume", str(run), *argv])
        return args_lib.config_from_args(args), args.resume_changes

    cfg, said = resume("--stage", "3", "--simulate-devices", "8")
    assert (cfg.parallel.devices, cfg.parallel.simulate_devices) == (None, 8)
    assert "parallel.devices: 1 -> None (all devices: parallel.simulate_devices changed" in (
        " ".join(said)
    )
    cfg, _ = resume("--simulate-devices", "8", "--devices", "1")  # chosen: kept
    assert (cfg.parallel.devices, cfg.parallel.simulate_devices) == (1, 8)
    cfg, said = resume("--stage", "1")  # the same devices: the saved count stands
    assert cfg.parallel.devices == 1 and said == ["parallel.stage: 3 -> 1"]
