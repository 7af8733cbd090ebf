"""``jaxzero launch``: start the processes of one node, watch them, never leave one hanging.

    jaxzero launch --nproc-per-node 2 --simulate-devices 2 -- jaxzero train --stage 3
    jaxzero launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        --nproc-per-node 8 -- python my_script.py

Each process gets its rank, local rank, world size and the coordinator's host and
port both as ``JAXZERO_*`` and as torchrun's variables (``MASTER_ADDR``, ``RANK``,
...), so ``jaxzero.distributed.initialize()`` (which ``jaxzero train`` calls) and
torch-minded scripts both find them. Every line a process prints is prefixed
with its rank. When one process exits non-zero the launcher stops the others
(SIGTERM, then SIGKILL after a grace period) and exits 1 naming the rank; a
signal to the launcher is forwarded to every process. Each process runs in its
own process group, which is killed as a whole, and dies with the launcher
(``PR_SET_PDEATHSIG``) even if the launcher is killed with SIGKILL.

A rank whose program ends while others run on is said within a second, whatever
its status: JAX holds its process in a shutdown barrier until every process
reaches it (so its exit status is known only then), and the job waits for the
others, as under torchrun. If they need it in a collective they stall: stop the
job with Ctrl-C. (The process says so through ``jaxzero.distributed``'s exit hook,
so this needs ``jaxzero.distributed.initialize()``.)

The command line, checked into a :class:`~jaxzero.launch_args.Plan`, and each process's
environment are :mod:`jaxzero.launch_args`'s.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

from jaxzero import cli
from jaxzero.job import LAUNCH_EVENTS
from jaxzero.launch_args import Plan, UsageError, build_parser, child_env, parse, resolve_command

__all__ = [  # the command line's names are jaxzero.launch_args', read from here too
    "Group",
    "Plan",
    "UsageError",
    "build_parser",
    "child_env",
    "describe_exit",
    "free_port",
    "main",
    "parse",
    "resolve_command",
    "run",
]


GRACE_SECONDS = 10.0  # SIGTERM -> SIGKILL
POLL_SECONDS = 0.1
ENDED_SECONDS = 1.0  # a rank's program ended this long ago and others run on: say so
EXIT_FAILED = 1

# Runs in each child before the command: die with the launcher (Linux), then exec.
_TRAMPOLINE = """import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the launcher is already gone
os.execvp(sys.argv[2], sys.argv[2:])
"""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGKILL"``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# --------------------------------------------------------------------------- running


class Group:
    """The processes of one attempt, their output pumps, and how to stop them."""

    def __init__(self, plan: Plan, command: list[str], port: int, restart: int):
        self.plan, self.procs, self.pumps = plan, [], []
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.events = Path(tempfile.mkdtemp(prefix="jaxzero-launch-"))  # see ended_early
        self._said: set[int] = set()
        for local in range(plan.nproc):
            env = child_env(plan, local, port, restart, os.environ)
            env[LAUNCH_EVENTS] = str(self.events)
            proc = subprocess.Popen(
                [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: killed as a whole
            )
            self.procs.append(proc)
            prefix = f"[rank {plan.rank(local)}] ".encode()
            for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=self._pump, args=(pipe, out, prefix), daemon=True)
                t.start()
                self.pumps.append(t)
        say(
            f"started {plan.nproc} process(es), ranks {plan.rank(0)}..{plan.rank(plan.nproc - 1)}"
            f" of {plan.world_size}, coordinator {plan.host}:{port}, pids "
            + " ".join(str(p.pid) for p in self.procs)
        )

    def _pump(self, pipe: BinaryIO, out, prefix: bytes) -> None:
        """Copies a child's lines with its rank in front; keeps draining if ``out`` breaks,
        so that a child never blocks on a full pipe."""
        for line in iter(pipe.readline, b""):
            with self._lock:
                try:
                    out.buffer.write(
                        prefix + line if line.endswith(b"\n") else prefix + line + b"\n"
                    )
                    out.flush()
                except (OSError, ValueError):  # our reader went away: discard
                    pass
        pipe.close()

    def failed(self) -> tuple[int, int] | None:
        """(local rank, exit code) of the process that most likely failed first, if any.

        Several can have exited by one poll: one killed by a signal is named before
        those that exited with an error (typically a collective failing because that
        one went away), then the lowest rank.
        """
        codes = [(local, p.poll()) for local, p in enumerate(self.procs)]
        failures = [(code > 0, local, code) for local, code in codes if code not in (None, 0)]
        return min(failures)[1:] if failures else None

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def ended_early(self) -> list[tuple[int, int]]:
        """(local rank, others still running) of each rank whose program ended at least
        ``ENDED_SECONDS`` ago while others of this node run on, once per rank.

        A process writes ``ended-RANK`` into ``self.events`` as its interpreter exits
        (``jaxzero.distributed``); ranks that end together are not reported.
        """
        ended = {}
        for path in self.events.glob("ended-*"):
            try:
                ended[int(path.name.split("-", 1)[1]) - self.plan.rank(0)] = path.stat().st_mtime
            except (ValueError, OSError):
                continue
        found = []
        for local, when in sorted(ended.items()):
            if local in self._said or not 0 <= local < len(self.procs):
                continue
            others = sum(p.poll() is None and i not in ended for i, p in enumerate(self.procs))
            if others and self.procs[local].poll() is None and time.time() - when >= ENDED_SECONDS:
                self._said.add(local)
                found.append((local, others))
        return found

    def send(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                _killpg(p.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, grace: float = GRACE_SECONDS) -> None:
        """``sig`` to every running process, SIGKILL after ``grace`` s, then reap all."""
        self.send(sig)
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        self.close()

    def close(self) -> None:
        """Kill whatever is left in every process group (children of children too)."""
        for p in self.procs:
            _killpg(p.pid, signal.SIGKILL)
            p.wait()
        for t in self.pumps:
            t.join(timeout=2.0)
        shutil.rmtree(self.events, ignore_errors=True)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def say(message: str) -> None:
    print(f"jaxzero launch: {message}", file=sys.stderr, flush=True)


def run(plan: Plan) -> int:
    """Runs the group, restarting it up to ``plan.max_restarts`` times; the exit status."""
    command = resolve_command(plan.command)
    received: list[int] = []

    def on_signal(sig, _frame):
        received.append(sig)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for restart in range(plan.max_restarts + 1):
            port = plan.port if plan.port is not None else free_port(plan.host)
            # JAXZERO_RESTART_COUNT > 0 tells the program it is a restart: `jaxzero train
            # --name N` then resumes run N from its latest checkpoint (args._restarted_run).
            group = Group(plan, command, port, restart)
            status = _watch(group, received)
            if status is None:
                say(
                    f"all {plan.nproc} process(es) exited 0 "
                    f"({time.monotonic() - group.started:.1f} s)"
                )
                return 0
            if received:
                return 128 + received[0]
            local, code = status
            if restart < plan.max_restarts:
                say(
                    f"restarting all {plan.nproc} process(es) after rank {plan.rank(local)} "
                    f"{describe_exit(code)} (restart {restart + 1} of {plan.max_restarts})"
                )
                continue
            say(f"failed: rank {plan.rank(local)} {describe_exit(code)}")
            return EXIT_FAILED
        return EXIT_FAILED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _watch(group: Group, received: list[int]) -> tuple[int, int] | None:
    """Waits for the group; on a failure or a signal stops it. None: every process exited 0."""
    forwarded = 0
    while group.running():
        if len(received) > forwarded:
            sig = received[forwarded]
            forwarded += 1
            say(f"got {signal.Signals(sig).name}: forwarding it to every process")
            group.stop(sig)
            return (-1, -sig)
        failure = group.failed()
        if failure is not None:
            local, code = failure
            others = sum(p.poll() is None for p in group.procs)
            say(
                f"rank {group.plan.rank(local)} (local rank {local}, pid "
                f"{group.procs[local].pid}) {describe_exit(code)} after "
                f"{time.monotonic() - group.started:.1f} s; stopping the other {others} "
                "process(es)"
            )
            group.stop()
            for i, p in enumerate(group.procs):
                if i != local:
                    say(f"rank {group.plan.rank(i)} (pid {p.pid}) {describe_exit(p.returncode)}")
            return failure
        for local, others in group.ended_early():
            say(
                f"rank {group.plan.rank(local)} (pid {group.procs[local].pid}) ended its program "
                f"after {time.monotonic() - group.started:.1f} s while {others} other "
                "process(es) run on; JAX holds it until every process ends (its exit status "
                "is known then). If the others wait for it in a collective they stall: stop "
                "the job with Ctrl-C"
            )
        time.sleep(POLL_SECONDS)
    group.close()
    failure = group.failed()
    if failure is not None:
        local, code = failure
        say(f"rank {group.plan.rank(local)} (pid {group.procs[local].pid}) {describe_exit(code)}")
    return failure


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``jaxzero launch``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        build_parser().print_help()
        return 0
    return cli.run("launch", parse, run, argv)


if __name__ == "__main__":
    sys.exit(main())
