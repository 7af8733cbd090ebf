"""The ``jaxzero launch`` command line: its options, checked into a :class:`Plan`, and the
environment each process gets from it (rank, world size, the coordinator; ``JAXZERO_*``
and torchrun's variables). Pure rules: starting and watching the processes is
:mod:`jaxzero.launch`'s, where these names are read from too.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxzero.cli import ArgError, Parser
from jaxzero.errors import Error


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
