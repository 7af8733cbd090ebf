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
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from jaxzero import cli
from jaxzero.cli import ArgError, Parser
from jaxzero.errors import Error
from jaxzero.job import LAUNCH_EVENTS

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


class UsageError(Error, ValueError):
    """A bad command line; printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxzero launch",
        usage="jaxzero launch [OPTIONS] -- COMMAND [ARGS...]",
        description="Start --nproc-per-node processes of COMMAND on this node (e.g. 'jaxzero "
        "train ...' or 'python my_script.py ...') with rank, local rank, world size and the "
        "coordinator's host and port set (JAXZERO_* and torchrun variables).",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="K",
        help="processes on this node: one per GPU, or 1 owning all of them",
    )
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes in the job")
    p.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node, 0..M-1")
    p.add_argument(
        "--master-addr",
        default=None,
        metavar="HOST",
        help="the host: address of node 0, where rank 0 runs the coordinator "
        "(default 127.0.0.1 on one node)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the coordinator's port (default: a free one on one node, else 29500)",
    )
    p.add_argument(
        "--simulate-devices",
        type=int,
        default=None,
        metavar="D",
        help="CPU: devices each process simulates (JAXZERO_SIMULATE_DEVICES)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart the whole group up to R times after a failure",
    )
    p.add_argument(
        "--init-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long processes wait for each other to connect (CPU default 60)",
    )
    return p


@dataclass(frozen=True)
class Plan:
    """The validated command line."""

    nproc: int
    nnodes: int
    node_rank: int
    host: str
    port: int | None  # None: pick a free port before each start (one node only)
    simulate_devices: int | None
    max_restarts: int
    init_timeout: float | None
    command: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank


def parse(argv: Sequence[str]) -> Plan:
    """Options before ``--``, the command after; raises UsageError with one line."""
    argv = list(argv)
    if "--" not in argv:
        raise UsageError(
            "give the command after '--', e.g. jaxzero launch --nproc-per-node 2 -- jaxzero train"
        )
    cut = argv.index("--")
    try:
        args = build_parser().parse_args(argv[:cut])
    except ArgError as e:
        raise UsageError(str(e)) from None
    command = tuple(argv[cut + 1 :])
    checks = [
        (
            args.nproc_per_node >= 1,
            f"--nproc-per-node must be at least 1, got {args.nproc_per_node}",
        ),
        (args.nnodes >= 1, f"--nnodes must be at least 1, got {args.nnodes}"),
        (
            0 <= args.node_rank < max(args.nnodes, 1),
            f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got "
            f"{args.node_rank}",
        ),
        (
            args.master_port is None or 1 <= args.master_port <= 65535,
            f"--master-port must be in 1..65535, got {args.master_port}",
        ),
        (
            args.nnodes == 1 or args.master_addr,
            "--master-addr is required with --nnodes > 1: "
            "the address of node 0, reachable from every node",
        ),
        (
            args.simulate_devices is None or args.simulate_devices >= 1,
            f"--simulate-devices must be at least 1, got {args.simulate_devices}",
        ),
        (args.max_restarts >= 0, f"--max-restarts must be >= 0, got {args.max_restarts}"),
        (
            args.init_timeout is None or args.init_timeout > 0,
            f"--init-timeout must be positive, got {args.init_timeout}",
        ),
        (bool(command), "no command after '--'"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    port = args.master_port if args.master_port or args.nnodes == 1 else 29500
    return Plan(
        args.nproc_per_node,
        args.nnodes,
        args.node_rank,
        args.master_addr or "127.0.0.1",
        port,
        args.simulate_devices,
        args.max_restarts,
        args.init_timeout,
        command,
    )


def resolve_command(command: Sequence[str]) -> list[str]:
    """``jaxzero ...`` runs with this interpreter; anything else is looked up on PATH."""
    if command[0] == "jaxzero":
        return [sys.executable, "-m", "jaxzero.cli", *command[1:]]
    if shutil.which(command[0]) is None:
        raise UsageError(f"command not found: {command[0]!r}")
    return list(command)


def child_env(
    plan: Plan, local_rank: int, port: int, restart: int, base: Mapping[str, str]
) -> dict[str, str]:
    """The environment of one process: both variable families, and the CPU settings."""
    rank = plan.rank(local_rank)
    env = dict(base)
    shared = {
        "ADDR": plan.host,
        "PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(plan.nproc),
    }
    for key, value in shared.items():
        ours = {"ADDR": "JAXZERO_HOST", "PORT": "JAXZERO_PORT"}.get(key, "JAXZERO_" + key)
        env[ours] = value
        env[{"ADDR": "MASTER_ADDR", "PORT": "MASTER_PORT"}.get(key, key)] = value
    env.update(
        GROUP_RANK=str(plan.node_rank),
        JAXZERO_NODE_RANK=str(plan.node_rank),
        JAXZERO_RESTART_COUNT=str(restart),
        TORCHELASTIC_RESTART_COUNT=str(restart),
        JAXZERO_MAX_RESTARTS=str(plan.max_restarts),
        PYTHONUNBUFFERED="1",
    )
    if plan.simulate_devices is not None:
        env["JAXZERO_SIMULATE_DEVICES"] = str(plan.simulate_devices)
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")
        ).strip()
        if flags:
            env["XLA_FLAGS"] = flags
        else:
            env.pop("XLA_FLAGS", None)  # the explicit --simulate-devices wins
    if plan.init_timeout is not None:
        env["JAXZERO_INIT_TIMEOUT"] = f"{plan.init_timeout:g}"
    return env


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
