"""Two processes x two CPU devices (jax.distributed over gloo) train like one device."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import _procs
import numpy as np
import optax
import pytest
from _models import mlp_batches, mlp_loss, mlp_params, rel_diff, train_engine, train_reference
from _procs import REPORT, alive_with, free_port, read_report

# jax.distributed, gloo and the coordination service differ between the JAX lines: CI runs
# these on both
pytestmark = pytest.mark.every_lane

HERE = Path(__file__).parent


@pytest.mark.parametrize("stage", ["0", "3", "3-offload"])
def test_two_processes_match_one_device(stage, tmp_path):
    port, out, report = free_port(), tmp_path / "final.npz", tmp_path / "report.json"
    env = _procs.child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env[REPORT] = str(report)
    procs = [
        _procs.Child(
            [sys.executable, str(HERE / "_mp_worker.py"), str(i), str(port), str(stage), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    report = read_report(report)
    losses = report["losses"]
    assert report["lost"] == []  # distributed.lost_ranks asked JAX's coordination service
    assert report["threads_left"] == 0  # and returned only once its thread was done
    ref_losses, ref_params = train_reference(
        mlp_loss, mlp_params(), mlp_batches(5), optax.adamw(1e-3)
    )
    final = dict(np.load(out))
    assert rel_diff(np.array(losses), ref_losses) <= 1e-5
    assert rel_diff(final, ref_params) <= 1e-5


# --------------------------------------------------------------------------- jaxzero.distributed

TINY = str(HERE.parent / "configs" / "tiny.yaml")


def _env(**extra: str) -> dict[str, str]:
    """This environment without the 8 simulated devices of conftest, plus ``extra``."""
    env = _procs.child_env()
    env.update(
        JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    )
    env.update(extra)
    return env


def _torchrun_env(rank: int, port: int, world: int = 2, **extra: str) -> dict[str, str]:
    return _env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        **extra,
    )


def _two_torchrun_processes(worker: str, report: Path) -> list[tuple[str, str]]:
    """Runs ``worker`` as 2 processes x 2 CPU devices with torchrun's variables only;
    both must succeed. Returns each process's (stdout, stderr)."""
    port = free_port()
    procs = [
        _procs.Child(
            [sys.executable, str(HERE / worker)],
            env=_torchrun_env(
                i,
                port,
                XLA_FLAGS=_procs.xla_flags(2),
                **{REPORT: str(report)},
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    return results


def test_torchrun_variables_alone_stage3_and_hybrid_match_one_process_of_4(tmp_path):
    """2 processes x 2 devices, set up by jaxzero.distributed.initialize() with no arguments."""
    import jaxzero

    report = tmp_path / "report.json"
    results = _two_torchrun_processes("_mp_env_worker.py", report)
    got = read_report(report)
    assert (got["rank"], got["world_size"], got["local_rank"]) == (0, 2, 0)
    assert "rank 1 of 2 | local rank 1 of 2" in results[1][1]
    assert "2 process(es) x 2 local device(s) = 4 devices" in results[0][1]  # rank 0's summary
    assert got["hybrid_groups"] == [[0, 0], [1, 1]]  # a group is one process's devices
    engine = jaxzero.Engine(mlp_loss, optax.adamw(1e-3), mesh=jaxzero.make_mesh(4), stage=3)
    ref_losses, ref_params, _ = train_engine(engine, mlp_params(), mlp_batches(5))
    for name in ("stage3", "hybrid"):
        assert rel_diff(np.array(got[name]), ref_losses) <= 1e-5, name
        params = {k: np.array(v, np.float32) for k, v in got[name + "_params"].items()}
        assert rel_diff(params, ref_params) <= 1e-5, name


def test_each_process_feeds_the_rows_the_engine_names(tmp_path):
    """``engine.process_rows(B)``: 2 processes x 2 devices, each passes only its rows; the
    global batch assembles in process order and trains like one process of 4 devices."""
    import jaxzero

    report = tmp_path / "report.json"
    _two_torchrun_processes("_mp_rows_worker.py", report)
    got = read_report(report)
    assert got["rows"] == [[0, 8], [8, 16]]  # contiguous, in process order
    assert got["assembled"]
    assert "global batch 12 is not divisible by 4 devices x 2 micro-batches = 8" in got["refused"]
    engine = jaxzero.Engine(
        mlp_loss, optax.adamw(1e-3), mesh=jaxzero.make_mesh(4), stage=3, micro_batches=2
    )
    ref_losses, _, _ = train_engine(engine, mlp_params(), mlp_batches(5))
    assert rel_diff(np.array(got["losses"]), ref_losses) <= 1e-5


def _train_args(root: Path, name: str, *extra: str) -> list[str]:
    return [
        "--config", TINY, "--name", name, "--set", f"logging.root={root}",
        "--set", "logging.log_every=1", "--set", "logging.eval_batches=1",
        "--set", "logging.sample_tokens=0", "--set", "logging.tensorboard=false",
        "--set", "data.max_bytes=100000", "--set", "model.d_model=32",
        "--set", "model.seq_len=16", "--set", "model.n_layers=1", *extra,
    ]  # fmt: skip


def _launch(*argv: str, env: dict[str, str]) -> _procs.Child:
    return _procs.Child(
        [sys.executable, "-m", "jaxzero.cli", "launch", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("stage", [0, 3])
def test_launch_train_matches_one_process(stage, tmp_path, capsys):
    from jaxzero.train import loop as train
    from jaxzero.train import rundir

    args = _train_args(tmp_path, f"launched{stage}", "--stage", str(stage), "--steps", "3")
    proc = _launch(
        "--nproc-per-node",
        "2",
        "--simulate-devices",
        "2",
        "--",
        "jaxzero",
        "train",
        *args,
        env=_env(),
    )
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    assert "[rank 0]   mesh   2 process(es) x 2 local device(s) = 4 devices, mesh (data=4)" in out
    assert "[rank 0] step 3/3" in out and "[rank 1] step" not in out  # rank 0 reports alone
    assert "rank 1 of 2 | local rank 1 of 2" in err
    ref = _train_args(
        tmp_path, f"single{stage}", "--stage", str(stage), "--steps", "3", "--devices", "4"
    )
    assert train.main(ref) == 0  # one process, 4 of the 8 simulated devices
    capsys.readouterr()
    launched, single = (
        np.array(
            [
                r["loss"]
                for r in rundir.read_jsonl(tmp_path / f"{name}{stage}" / rundir.METRICS_FILE)
            ]
        )
        for name in ("launched", "single")
    )
    assert len(launched) == 3
    np.testing.assert_allclose(launched, single, rtol=1e-5, atol=0)


def test_killing_a_training_process_ends_the_run_naming_it(tmp_path):
    marker = f"JAXZERO_RUN_{uuid.uuid4().hex}"
    args = _train_args(tmp_path, "killed", "--stage", "3", "--steps", "100000")
    proc = _launch(
        "--nproc-per-node",
        "2",
        "--simulate-devices",
        "2",
        "--",
        "jaxzero",
        "train",
        *args,
        env=_env(**{marker: "1"}),
    )
    pids = None
    for line in proc.stderr:
        if "pids" in line:
            pids = [int(x) for x in line.split("pids")[1].split()]
            break
    assert pids is not None and len(pids) == 2
    for line in proc.stdout:  # training is under way: both processes are in collectives
        if re.match(r"\[rank 0\] step +2/", line):
            break
    else:
        pytest.fail(f"the run ended before step 2: {proc.stderr.read()[-2000:]}")
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=90)
    took = time.monotonic() - killed
    assert proc.returncode != 0 and took < 60, (took, err[-2000:])
    assert f"rank 1 (local rank 1, pid {pids[1]}) was killed by SIGKILL" in err
    assert "failed: rank 1 was killed by SIGKILL" in err
    survivor = [
        line
        for line in err.splitlines()
        if line.startswith(f"jaxzero launch: rank 0 (pid {pids[0]})")
    ]
    assert survivor and "exited with code 0" not in survivor[0]  # non-zero or by a signal
    assert alive_with(marker) == []
    print(f"failure test: launcher exited {took:.1f} s after the SIGKILL")


@pytest.mark.parametrize("case", ["rank_too_big", "nobody_listens"])
def test_misconfiguration_is_one_clear_line_within_the_timeout(case, tmp_path):
    port = free_port()
    env = _torchrun_env(2 if case == "rank_too_big" else 1, port)
    started = time.monotonic()
    proc = _procs.run(
        [
            sys.executable,
            "-m",
            "jaxzero.cli",
            "train",
            "--init-timeout",
            "3",
            *_train_args(tmp_path, case),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    if case == "rank_too_big":
        assert "RANK=2 must be below WORLD_SIZE=2" in proc.stderr
    else:
        assert (
            f"nobody listens at the coordinator 127.0.0.1:{port} (MASTER_ADDR=127.0.0.1, "
            f"MASTER_PORT={port})" in proc.stderr
        )
        assert took >= 3
    assert took < 3 + 30  # the timeout, plus starting Python and importing JAX


def test_world_size_that_disagrees_with_the_processes_fails_within_the_timeout():
    """WORLD_SIZE=3 but only ranks 0 and 1 start: both stop after the init timeout."""
    port = free_port()
    code = "import jaxzero.distributed as d; d.initialize(init_timeout=4); print('joined')"
    started = time.monotonic()
    procs = [
        _procs.Child(
            [sys.executable, "-c", code],
            env=_torchrun_env(i, port, world=3),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert time.monotonic() - started < 4 + 30
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 2 and "joined" not in out
        assert (
            "waited 4 s (init timeout) for WORLD_SIZE=3 processes to connect to the "
            f"coordinator at 127.0.0.1:{port}" in err
        ), err[-2000:]


def test_without_a_launcher_the_survivor_stops_and_names_the_lost_rank():
    """JAX's heartbeats (JAXZERO_HEARTBEAT_TIMEOUT) end a survivor blocked in a collective."""
    port = free_port()
    env = dict(XLA_FLAGS=_procs.xla_flags(2), JAXZERO_HEARTBEAT_TIMEOUT="10")
    procs = [
        _procs.Child(
            [sys.executable, str(HERE / "_mp_loop_worker.py")],
            env=_torchrun_env(i, port, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
        for i in range(2)
    ]
    for line in procs[0].stdout:
        if line.startswith("step 3 "):
            break
    else:
        pytest.fail(procs[0].stderr.read()[-2000:])
    procs[1].kill()
    killed = time.monotonic()
    _, err = procs[0].communicate(timeout=90)
    procs[1].communicate()
    assert procs[0].returncode != 0 and time.monotonic() - killed < 60
    # JAX's coordination service names the silent task, or jaxzero does after a failed collective
    assert re.search(r"stopped sending heartbeats\):\s*1\b|lost rank\(s\) 1 of 2", err), err[-3000:]


def test_world_sizes_that_differ_between_processes_are_refused():
    port = free_port()
    code = "import jaxzero.distributed as d; d.initialize(init_timeout=10); print('joined')"
    beat = {"JAXZERO_HEARTBEAT_TIMEOUT": "5"}
    procs = [
        _procs.Child(
            [sys.executable, "-c", code],
            env=_torchrun_env(i, port, world=2 + i, **beat),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    out, err = results[1]
    assert procs[1].returncode != 0 and "joined" not in out
    assert (
        f"WORLD_SIZE=3 but the coordinator at 127.0.0.1:{port} runs a job of 2 processes" in err
    ), err[-2000:]


def test_a_store_holding_master_port_does_not_stop_a_torchrun_job(tmp_path):
    """As under torchrun, whose rendezvous store listens on MASTER_PORT on rank 0's host:
    with TORCHELASTIC_RUN_ID set the coordinator takes the next port and the job trains."""
    import socket

    for _ in range(20):  # a port whose successor is free too
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("", port + 1))
                break
            except OSError:
                holder.close()
    holder.listen()
    try:
        procs = [
            _procs.Child(
                [sys.executable, str(HERE / "_mp_env_worker.py")],
                env=_torchrun_env(
                    i,
                    port,
                    TORCHELASTIC_RUN_ID="test",
                    XLA_FLAGS=_procs.xla_flags(2),
                    **{REPORT: str(tmp_path / "report.json")},
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                timeout=300,
            )
            for i in range(2)
        ]
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        holder.close()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert f"127.0.0.1:{port + 1}" in results[0][1] or "MASTER_PORT+1" in results[0][1]


_EARLY = """import os, sys, time
import jaxzero.distributed
job = jaxzero.distributed.initialize()
how = os.environ["HOW"]
if how == "exit" and job.rank > 0:
    print("leaving", flush=True)
    sys.exit(job.rank - 1)  # rank 1: status 0, rank 2: status 1
if how == "raise" and job.rank == 2:
    print("leaving", flush=True)
    raise RuntimeError("boom")
time.sleep(float(os.environ["SURVIVOR_SECONDS"]))
print("done", flush=True)
"""


def _timed_launch(how: str, survivor: str) -> tuple[int, str, dict[str, float]]:
    """Runs _EARLY on 3 ranks; (exit status, output, when each marker line first came)."""
    proc = _launch(
        "--nproc-per-node",
        "3",
        "--simulate-devices",
        "1",
        "--",
        sys.executable,
        "-c",
        _EARLY,
        env=_env(HOW=how, SURVIVOR_SECONDS=survivor),
    )
    seen: dict[str, float] = {}
    lines: list[str] = []

    def watch(stream):
        for line in stream:
            lines.append(line)
            for key in (
                "[rank 1] leaving",
                "[rank 2] leaving",
                "rank 1 (pid",
                "rank 2 (pid",
                "stopping the other",
                "[rank 0] done",
            ):
                if key in line:
                    seen.setdefault(key, time.monotonic())

    readers = [threading.Thread(target=watch, args=(s,)) for s in (proc.stdout, proc.stderr)]
    for t in readers:
        t.start()
    proc.wait(timeout=120)
    for t in readers:
        t.join()
    return proc.returncode, "".join(lines), seen


def test_launch_notices_ranks_whose_program_ends_first():
    """sys.exit(0) on rank 1 and sys.exit(1) on rank 2 are each said within a second or
    two (JAX holds their processes until every process ends); the job then ends with the
    failing rank named."""
    status, text, seen = _timed_launch("exit", survivor="3")
    for rank in (1, 2):
        said = f"rank {rank} (pid"
        assert seen[said] - seen[f"[rank {rank}] leaving"] < 2, text
        assert seen[said] < seen["[rank 0] done"], text
    assert "ended its program" in text
    assert status == 1 and "failed: rank 2 exited with code 1" in text, text


def test_launch_stops_the_survivors_of_a_failure_at_once():
    """JAX's preemption notifier no longer swallows the launcher's SIGTERM: survivors stop
    at once, not by SIGKILL after the grace period."""
    status, text, seen = _timed_launch("raise", survivor="60")
    assert status == 1 and "[rank 0] done" not in seen, text
    # one rank fails (two failing at once raced: the first one's failure could stop the
    # second before it printed, so what the test waited for never came)
    assert "[rank 2] leaving" in seen, text
    assert seen["stopping the other"] - seen["[rank 2] leaving"] < 2, text
    for survivor in (0, 1):  # both stopped by the launcher's SIGTERM, neither by SIGKILL
        assert re.search(rf"rank {survivor} \(pid \d+\) was killed by SIGTERM", text), text
    assert "SIGKILL" not in text, text


def _torchrun() -> str | None:
    """torchrun on PATH, or the one JAXZERO_TORCHRUN names (torch need not be in this venv:
    torchrun only starts the processes)."""
    import shutil

    return os.environ.get("JAXZERO_TORCHRUN") or shutil.which("torchrun")


@pytest.mark.skipif(
    _torchrun() is None,
    reason="torchrun not found (install torch, or set JAXZERO_TORCHRUN to a torchrun executable)",
)
def test_under_the_real_torchrun_train_matches_one_process(tmp_path, capsys):
    """torchrun's store holds MASTER_PORT: the coordinator moves to MASTER_PORT+1."""
    from jaxzero.train import loop as train
    from jaxzero.train import rundir

    args = _train_args(tmp_path, "torchrun", "--stage", "3", "--steps", "3")
    done = _procs.run(
        [
            _torchrun(),
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            "--no-python",
            sys.executable,
            "-m",
            "jaxzero.cli",
            "train",
            *args,
        ],
        env=_env(JAXZERO_SIMULATE_DEVICES="2"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MASTER_PORT+1" in done.stderr
    assert (
        train.main(
            _train_args(tmp_path, "single", "--stage", "3", "--steps", "3", "--devices", "4")
        )
        == 0
    )
    capsys.readouterr()
    torchrun, single = (
        np.array([r["loss"] for r in rundir.read_jsonl(tmp_path / name / rundir.METRICS_FILE)])
        for name in ("torchrun", "single")
    )
    assert len(torchrun) == 3
    np.testing.assert_allclose(torchrun, single, rtol=1e-5, atol=0)
