"""Writes that fail during a run, for real: a full disk and a file system turned read-only
under a running `jaxzero train` end it in one line naming the path and the cause, with the
previous checkpoint intact and resumable; the metrics and TensorBoard files keep every
logged step even when the process is killed."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import _procs
import pytest

from jaxzero.train import metrics, rundir

# orbax's write errors and exit paths differ between the JAX lines: CI runs these on both
pytestmark = pytest.mark.every_lane

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
TRAIN = (
    f"{sys.executable} -m jaxzero.cli train --config {TINY} --devices 2 "
    "--set logging.sample_tokens=0 --set logging.tensorboard=true --set logging.log_every=1 "
    "--set logging.eval_every=1000 --set data.max_bytes=60000 --set model.d_model=32 "
    "--set model.seq_len=32"
)


def _namespaces() -> bool:
    """A user and mount namespace of our own, where a small tmpfs is a real full disk."""
    if shutil.which("unshare") is None:
        return False
    probe = _procs.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
        capture_output=True,
        timeout=120,
    )
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(
    not _namespaces(),
    reason="needs unshare -rm and tmpfs mounts (user namespaces) to make a small real disk",
)


def _in_namespace(script: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = _procs.run(
        ["unshare", "-rm", "sh", "-ec", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@needs_tmpfs
def test_a_full_disk_ends_in_one_line_and_the_previous_checkpoint_is_intact(tmp_path):
    disk = tmp_path / "disk"  # two checkpoints (~0.53 MiB each) fit on 1.5 MiB
    disk.mkdir()
    _in_namespace(
        f"""
        mount -t tmpfs -o size=1536k tmpfs {disk}
        {TRAIN} --name full --set logging.root={tmp_path} --set checkpoint.dir={disk}/ck \
            --set checkpoint.every=2 --steps 12 >out1 2>err1 || echo $? >rc1
        {sys.executable} -m jaxzero.cli export {tmp_path}/full --out {tmp_path}/x >out2 2>err2 \
            || echo $? >rc2
    """,
        tmp_path,
    )
    err = (tmp_path / "err1").read_text()
    assert (tmp_path / "rc1").read_text().strip() == "1", err
    assert err.count("\n") == 1, err  # one line: no orbax, asyncio or absl echoes
    assert "No space left on device; the latest complete checkpoint is step" in err
    assert f"resume with: jaxzero train --resume {tmp_path / 'full'}" in err
    latest = int(err.split("the latest complete checkpoint is step ")[1].split()[0])
    # that checkpoint is complete and intact (export verifies every leaf's fingerprint)
    assert not (tmp_path / "rc2").exists(), (tmp_path / "err2").read_text()
    assert (
        f"checkpoint of step {latest} ({disk / 'ck' / str(latest)})"
        in (tmp_path / "err2").read_text()
    )


@needs_tmpfs
def test_a_disk_filled_under_a_running_run_ends_it_in_one_line(tmp_path):
    """Another process fills the run directory's disk mid-run: the next metrics or
    TensorBoard write fails, and says which file and why."""
    disk = tmp_path / "disk"
    disk.mkdir()
    _in_namespace(
        f"""
        mount -t tmpfs -o size=8m tmpfs {disk}
        {TRAIN} --name filled --set logging.root={disk} --steps 3000 >out 2>err &
        pid=$!
        until grep -q "step  *5/" out 2>/dev/null; do sleep 0.05; done
        dd if=/dev/zero of={disk}/filler bs=64k 2>/dev/null || true
        wait $pid || echo $? >rc
    """,
        tmp_path,
    )
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1", err
    assert err.count("\n") == 1, err
    assert f"cannot write '{disk / 'filled'}/" in err and "No space left on device" in err
    assert "once fixed, start the run again" in err  # no checkpoint was written yet


def test_a_run_past_its_device_memory_stops_in_one_line(tmp_path):
    """zero.device_memory held at run time (issue 46): with no pre-flight to refuse it, a
    run whose devices outgrow 1 MB each stops at its first steps, in one line, exit 1."""
    done = _procs.run(
        f"{TRAIN} --name over --set logging.root={tmp_path} --steps 50 "
        "--set zero.preflight=false --set zero.device_memory=1MB".split(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("jaxzero train: error: out of memory: the run's 2 CPU devices")
    assert "over 2 MB (2 x 1 MB, zero.device_memory" in done.stderr
    assert "To fit: set zero.auto=true" in done.stderr
    assert "step 50/50" not in done.stdout


def test_a_write_that_fails_names_its_file(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    writer = metrics.MetricsWriter(tmp_path, tensorboard=False)
    writer._file.close()
    writer._file = open("/dev/full", "ab", buffering=0)  # noqa: SIM115 - closed below
    with pytest.raises(OSError, match="No space left on device") as e:
        writer.write({"step": 1, "loss": 1.0})
    assert e.value.filename == str(tmp_path / rundir.METRICS_FILE)
    writer.close()  # nothing was left buffered to fail again


def test_metrics_and_tensorboard_keep_every_step_when_killed(tmp_path):
    """Each record is on disk when write() returns: SIGKILL loses nothing logged."""
    script = (
        f"from pathlib import Path\nfrom jaxzero.train import metrics\n"
        f"w = metrics.MetricsWriter(Path({str(tmp_path)!r}))\n"
        "for step in range(1, 51):\n"
        "    w.write({'step': step, 'loss': 1.0 / step})\n"
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert len(rundir.read_jsonl(tmp_path / rundir.METRICS_FILE)) == 50
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    (events,) = tmp_path.glob("events.out.tfevents.*")
    data, steps = events.read_bytes(), []
    while data:  # TFRecord: length (8), its crc (4), the Event, its crc (4), as TensorBoard reads
        n = int.from_bytes(data[:8], "little")
        assert int.from_bytes(data[8:12], "little") == masked_crc32c(data[:8])
        assert int.from_bytes(data[12 + n : 16 + n], "little") == masked_crc32c(data[12 : 12 + n])
        event = Event.FromString(data[12 : 12 + n])
        data = data[16 + n :]
        steps += [event.step for v in event.summary.value if v.tag == "loss"]
    assert steps == list(range(1, 51))
