"""Helpers for tests that start processes: free ports, reports, what is left of a run, and
``run``/``Child``, the only way a test starts a process (every one under a deadline)."""

import json
import os
import re
import signal
import socket
import subprocess
import time
import weakref
from pathlib import Path
from typing import Any

_DEVICES = re.compile(r"\s*--xla_force_host_platform_device_count=\d+")


def xla_flags(devices: int | None = None) -> str:
    """This process's XLA_FLAGS less conftest's 8 simulated devices (the other flags, such
    as the suite's code-generation level, are kept), with ``devices`` of them if given."""
    flags = _DEVICES.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    return f"{flags} --xla_force_host_platform_device_count={devices}".strip() if devices else flags


_CODEGEN = re.compile(r"\s*--xla_(backend_optimization_level|cpu_use_fusion_emitters)=\w+")


def optimized_env() -> dict[str, str]:
    """This environment without the suite's code-generation flags (conftest.py: -O0, and
    jaxlib 0.10's legacy fusion emitters), compiling as users' programs do: for a child
    that runs one program hundreds of times, where -O0's slower code costs more than the
    compile time it saves (a 300-step ``jaxzero train``: 0.57 s a step at -O0, 0.17 s at
    XLA's default, on this machine), or one whose claim is about the program users get."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = _CODEGEN.sub("", env.get("XLA_FLAGS", "")).strip()
    return env


def child_env() -> dict[str, str]:
    """This environment for a process that chooses its own device count."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (one test's descendants)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                environ = (d / "environ").read_bytes()
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in environ and state != "Z":
                found.append(int(d.name))
    return found


REPORT = "JAXZERO_TEST_REPORT"  # where a worker process writes its result as JSON


def write_report(obj: object) -> None:
    """A worker's result, written to the file its test named (never stdout, where gloo's
    C++ logging can land mid-line at any moment)."""
    path = Path(os.environ[REPORT])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def read_report(path: Path) -> dict:
    return json.loads(Path(path).read_text())


class Child(subprocess.Popen):
    """A process a test starts: in a process group of its own, with a deadline from its
    start that every ``wait``/``communicate`` keeps to, and killed with its whole group
    (the launcher's workers, a worker's helpers) when the deadline passes. A hung
    collective in a child then fails its test in minutes instead of eating CI's budget.
    ``timeout`` is required: a test says how long its process may take."""

    def __init__(self, args: Any, *, timeout: float, **kwargs: Any) -> None:
        kwargs.setdefault("start_new_session", True)
        super().__init__(args, **kwargs)
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.killed = False
        _LIVE.add(self)

    def _bounded(self, timeout: float | None) -> float | None:
        if self.killed:
            return timeout
        left = max(self.deadline - time.monotonic(), 0.0)
        return left if timeout is None else min(timeout, left)

    def wait(self, timeout: float | None = None) -> int:
        try:
            return super().wait(self._bounded(timeout))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= self.deadline:
                self.kill_group()
            raise

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        try:
            return super().communicate(input, self._bounded(timeout))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= self.deadline:
                self.kill_group()
                super().communicate()  # drain the pipes of the dead group
            raise

    def kill_group(self) -> None:
        """SIGKILL to the child's process group (its own, from ``start_new_session``)."""
        self.killed = True
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        subprocess.Popen.wait(self)


_LIVE: "weakref.WeakSet[Child]" = weakref.WeakSet()


def reap() -> list[str]:
    """Kill what a test left running (its children's groups); the commands killed."""
    left = [c for c in list(_LIVE) if c.poll() is None]
    for c in left:
        c.kill_group()
    _LIVE.clear()
    return [" ".join(map(str, c.args))[:200] for c in left]


def run(args: Any, *, timeout: float, capture_output: bool = False, **kwargs: Any):
    """``subprocess.run`` for tests: a ``Child`` (own process group, killed whole on
    expiry, ``subprocess.TimeoutExpired`` raised)."""
    stdin = kwargs.pop("input", None)
    if stdin is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with Child(args, timeout=timeout, **kwargs) as proc:
        out, err = proc.communicate(stdin)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
