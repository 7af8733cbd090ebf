"""Who is who in a job (pure rules), and `jaxzero launch` on plain commands (no devices, fast)."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import _procs
import pytest
from _procs import alive_with

from jaxzero import launch
from jaxzero.job import DistributedError, detect_cluster, resolve
from jaxzero.mesh import replicas_for

TORCH = {
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}
SLURM = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "2",
}


def test_nothing_set_is_a_single_process():
    job = resolve({})
    assert not job.multi and (job.rank, job.world_size) == (0, 1)
    assert not resolve({"WORLD_SIZE": "1", "RANK": "0"}).multi  # torchrun with one process


def test_torchrun_variables():
    job = resolve(TORCH)
    assert job.mode == "explicit" and job.coordinator == "10.0.0.1:29500"
    assert (job.rank, job.world_size, job.local_rank, job.local_world_size) == (1, 4, 1, 2)
    assert job.named("rank", "world_size") == "RANK=1, WORLD_SIZE=4"


def test_arguments_beat_jaxzero_variables_beat_torchrun():
    env = {**TORCH, "JAXZERO_RANK": "2", "JAXZERO_HOST": "head", "JAXZERO_PORT": "1234"}
    job = resolve(env)
    assert (job.rank, job.coordinator) == (2, "head:1234")
    assert job.world_size == 4  # fields not given as JAXZERO_* still come from torchrun
    job = resolve(env, rank=3, host="other:99")
    assert (job.rank, job.coordinator) == (3, "other:99")
    assert "(argument)" in job.named("rank")


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "RANK=2 must be below WORLD_SIZE=2: ranks run from 0 to 1",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2"},
            "the coordinator's host and port are not: set MASTER_ADDR and MASTER_PORT",
        ),
        (
            {"JAXZERO_RANK": "1", "JAXZERO_WORLD_SIZE": "2", "JAXZERO_HOST": "h"},
            "port are not: set JAXZERO_PORT",
        ),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but the rank is not: set RANK (0 to 1)"),
        ({"RANK": "0"}, "RANK=0 is set but the world size is not: set WORLD_SIZE"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK=one is not an integer >= 0"),
        (
            {**TORCH, "MASTER_PORT": "70000"},
            "MASTER_PORT=70000 is not an integer >= 1 and <= 65535",
        ),
        ({**TORCH, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be below LOCAL_WORLD_SIZE=2"),
        ({**TORCH, "JAXZERO_INIT_TIMEOUT": "-1"}, "JAXZERO_INIT_TIMEOUT=-1 is not a positive"),
        ({"JAXZERO_HOST": "h:"}, "JAXZERO_HOST=h: gives no port after the ':'"),
    ],
)
def test_wrong_settings_name_the_variable_and_value(env, message):
    with pytest.raises(DistributedError) as err:
        resolve(env)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cluster_detection_is_left_to_jax_only_with_several_processes():
    assert detect_cluster(SLURM) == "slurm"
    assert detect_cluster({**SLURM, "SLURM_NTASKS": "1"}) is None  # a one-task job
    assert detect_cluster({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}) == "ompi"
    job = resolve(SLURM)
    assert job.mode == "slurm" and (job.local_rank, job.local_world_size) == (1, 2)
    job = resolve({**SLURM, "MASTER_ADDR": "node01", "MASTER_PORT": "4000"})
    assert job.coordinator == "node01:4000"  # a coordinator given by hand still wins
    assert resolve({**SLURM, **TORCH}).mode == "explicit"  # torchrun variables come first


def test_timeouts_defaults_and_overrides():
    assert resolve(TORCH).init_timeout == 60 and resolve(TORCH).heartbeat_timeout == 30
    assert resolve(TORCH, accelerator=True).init_timeout == 300
    job = resolve({**TORCH, "JAXZERO_INIT_TIMEOUT": "5", "JAXZERO_SIMULATE_DEVICES": "2"})
    assert (job.init_timeout, job.simulate_devices) == (5.0, 2)
    assert resolve(TORCH, init_timeout=7).init_timeout == 7.0


def test_group_size_to_replicas():
    assert replicas_for(None, 8, 4) == 1
    assert replicas_for(4, 8, 2) == 2
    assert replicas_for("node", 16, 8) == 2
    with pytest.raises(ValueError, match="mesh.group_size=3 must divide the 8 devices"):
        replicas_for(3, 8, 8)
    with pytest.raises(ValueError, match=r"node \(3 devices per node\)"):
        replicas_for("node", 8, 3)


# --------------------------------------------------------------------------- jaxzero launch


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node", "0", "--", "true"], "--nproc-per-node must be at least 1, got 0"),
        (["--nproc-per-node", "2", "true"], "give the command after '--'"),
        (["--nproc-per-node", "2", "--"], "no command after '--'"),
        (["--nnodes", "2", "--", "true"], "--master-addr is required with --nnodes > 1"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--", "true"],
            "--node-rank must be in 0..1",
        ),
        (["--nproc-per-node", "two", "--", "true"], "invalid int value: 'two'"),
        (["--", "no-such-command-jaxzero"], "command not found: 'no-such-command-jaxzero'"),
    ],
)
def test_launch_usage_errors_are_one_line_exit_2(argv, message, capsys):
    started = time.monotonic()
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxzero launch: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and time.monotonic() - started < 5


def test_child_env_sets_both_families():
    plan = launch.parse(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "head",
            "--nproc-per-node",
            "4",
            "--simulate-devices",
            "2",
            "--",
            "x",
        ]
    )
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env = launch.child_env(plan, 3, 29500, 0, flags)
    assert env["RANK"] == env["JAXZERO_RANK"] == "7"
    assert env["WORLD_SIZE"] == env["JAXZERO_WORLD_SIZE"] == "8"
    assert env["LOCAL_RANK"] == env["JAXZERO_LOCAL_RANK"] == "3"
    assert env["LOCAL_WORLD_SIZE"] == "4" and env["GROUP_RANK"] == "1"
    assert (env["MASTER_ADDR"], env["JAXZERO_PORT"]) == ("head", "29500")
    assert env["JAXZERO_SIMULATE_DEVICES"] == "2" and "XLA_FLAGS" not in env
    job = resolve(env)  # what a launched process decides from it
    assert (job.rank, job.world_size, job.local_rank, job.coordinator) == (7, 8, 3, "head:29500")


def _launch(*argv, env=None, timeout=60):
    return _procs.run(
        [sys.executable, "-m", "jaxzero.cli", "launch", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.system
def test_output_is_prefixed_by_rank():
    out = _launch(
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        'echo "out $RANK of $WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT"; echo err >&2',
    )
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    assert lines[0].startswith("[rank 0] out 0 of 2 at 127.0.0.1:")
    assert lines[1].startswith("[rank 1] out 1 of 2 at 127.0.0.1:")
    assert "[rank 0] err" in out.stderr and "[rank 1] err" in out.stderr


@pytest.mark.system
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_failing_process_stops_the_others_and_leaves_nothing():
    marker = f"JAXZERO_TEST_{uuid.uuid4().hex}"
    env = {**os.environ, marker: "1"}
    script = 'sleep 300 & if [ "$RANK" = 1 ]; then sleep 1; exit 3; fi; wait'
    started = time.monotonic()
    out = _launch("--nproc-per-node", "2", "--", "sh", "-c", script, env=env)
    assert out.returncode == 1 and time.monotonic() - started < 30
    assert "rank 1 (local rank 1, pid" in out.stderr and "exited with code 3" in out.stderr
    assert "failed: rank 1 exited with code 3" in out.stderr
    assert "rank 0 (pid" in out.stderr and "killed by SIGTERM" in out.stderr
    assert alive_with(marker) == []  # the background sleeps of both ranks are gone too


@pytest.mark.system
def test_restarts_the_group_then_succeeds():
    out = _launch(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        '[ "$JAXZERO_RESTART_COUNT" -ge 1 ] || exit 5',
    )
    assert out.returncode == 0, out.stderr
    # Both ranks exit 5 at once. Which one the launcher names depends on the poll that first
    # sees a failure (rank 0 when both had exited by then, see the test below), but it is
    # always a rank that exited 5, and the restart line names the rank it reported failed.
    restart = re.search(
        r"restarting all 2 process\(es\) after rank ([01]) exited with code 5 "
        r"\(restart 1 of 2\)",
        out.stderr,
    )
    assert restart, out.stderr
    named = restart.group(1)
    failure = re.search(
        rf"jaxzero launch: rank {named} \((local rank {named}, )?pid \d+\) exited with code 5",
        out.stderr,
    )
    assert failure and failure.start() < restart.start(), out.stderr
    # the other rank, when the launcher had to stop it, either exited 5 itself or was stopped
    other = 1 - int(named)
    for fate in re.findall(rf"jaxzero launch: rank {other} \(pid \d+\) (.*)", out.stderr):
        assert fate in ("exited with code 5", "was killed by SIGTERM"), out.stderr
    # then one attempt more, which succeeds: two starts, no third
    assert out.stderr.count("started 2 process(es)") == 2, out.stderr
    assert "all 2 process(es) exited 0" in out.stderr, out.stderr
    out = _launch("--nproc-per-node", "1", "--max-restarts", "1", "--", "sh", "-c", "exit 4")
    assert out.returncode == 1 and out.stderr.count("started 1 process(es)") == 2


def test_the_failure_named_is_a_killed_process_then_the_lowest_rank():
    """Processes that exited by the same poll: one killed by a signal is the likely cause
    (the others then fail in a collective), else the lowest rank."""

    class Proc:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    group = object.__new__(launch.Group)
    for codes, named in [
        ([None, 0], None),
        ([1, -9], (1, -9)),
        ([5, 5], (0, 5)),
        ([None, 3], (1, 3)),
        ([-15, -9], (0, -15)),
        ([0, 0], None),
    ]:
        group.procs = [Proc(c) for c in codes]
        assert group.failed() == named, codes


@pytest.mark.system
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_are_forwarded_to_every_process(sig):
    child = (
        "import signal, sys, time\n"
        "def got(s, f):\n"
        "    print('got', s, flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGINT, got)\n"
        "signal.signal(signal.SIGTERM, got)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = _procs.Child(
        [
            sys.executable,
            "-m",
            "jaxzero.cli",
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            sys.executable,
            "-c",
            child,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        ready += line.endswith("ready\n")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    assert f"[rank 0] got {int(sig)}" in out and f"[rank 1] got {int(sig)}" in out
    assert f"got {signal.Signals(sig).name}: forwarding it to every process" in err


def test_train_builds_the_hybrid_mesh_from_group_size():
    from jaxzero.train import config as C
    from jaxzero.train import loop as train

    mesh, _ = train.setup_devices(C.ParallelConfig(devices=8), None, 4)
    assert dict(mesh.shape) == {"replica": 2, "data": 4}
    mesh, _ = train.setup_devices(C.ParallelConfig(devices=8), None, "node")  # one node here
    assert dict(mesh.shape) == {"data": 8}
    with pytest.raises(C.ConfigError, match="mesh.group_size=3 must divide the 8 devices"):
        train.setup_devices(C.ParallelConfig(devices=8), None, 3)


def test_the_banner_says_over_how_many_devices_the_state_is_sharded():
    from jaxzero.distributed import describe_mesh
    from jaxzero.mesh import make_mesh

    assert describe_mesh(make_mesh(8)) == "mesh (data=8): state sharded over 8 device(s)"
    assert describe_mesh(make_mesh(8, replicas=2)) == (
        "mesh (replica=2, data=4): state sharded over 4 device(s), replicated over 2 groups "
        "(hybrid)"
    )
    assert describe_mesh(make_mesh(8, model=2)) == (
        "mesh (data=4, model=2): state sharded over 4 device(s), each layer split over 2 "
        "(tensor and sequence parallel)"
    )


def test_under_torchrun_the_coordinator_moves_off_the_stores_port():
    """torchrun (TORCHELASTIC_RUN_ID set) already listens on MASTER_PORT: JAX's coordinator
    takes the next port; JAXZERO_PORT, when set, wins as it is."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "none",
    }
    job = resolve(env)
    assert job.coordinator == "127.0.0.1:29501" and str(job.port) == "MASTER_PORT+1=29501"
    assert resolve({**env, "JAXZERO_PORT": "31000"}).coordinator == "127.0.0.1:31000"
    del env["TORCHELASTIC_RUN_ID"]
    assert resolve(env).coordinator == "127.0.0.1:29500"  # not torchrun: its port as it is


def test_a_taken_coordinator_port_is_one_line_not_a_crash():
    import socket

    from jaxzero.distributed import check_port_free

    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        job = resolve(
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"}
        )
        with pytest.raises(
            DistributedError,
            match=rf"port {port} \(MASTER_PORT={port}\) "
            r"cannot be bound.*Set JAXZERO_PORT",
        ):
            check_port_free(job.port)
