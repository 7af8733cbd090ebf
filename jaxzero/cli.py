"""The ``jaxzero`` command: ``train``, ``launch``, ``plot``, ``estimate``, ``report``, ``export``,
``sample``.

Each subcommand lives in its own module with a ``main(argv) -> int``; this file
only dispatches, importing just the module asked for. Most of any command's start-up
is ``import jaxzero`` itself (JAX, Flax, optax: 1.1-1.8 s, measured on 2 CPU cores);
importing every subcommand's module here would add 0.1-0.16 s to each of them.
Every ``main`` runs its body through :func:`run`, the one owner of what a command
prints and returns on a user error (:class:`jaxzero.Error`: one line, exit 2) and Ctrl-C (130).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from jaxzero.errors import Error

A = TypeVar("A")  # a command's parsed arguments


class ArgError(Error):
    """An argparse error, raised instead of printing usage and exiting."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse hook
        raise ArgError(message)


def beyond_zero_options(p: argparse.ArgumentParser, hpz: bool = False) -> None:
    """``--offload``, ``--qwz``, ``--qgz``, ``--quant-block`` (and ``--hpz``): the flags of
    offload and ZeRO++ that ``jaxzero estimate`` and ``jaxzero report`` share."""
    b = p.add_argument_group("beyond ZeRO (docs/offload.md, docs/zeropp.md)")
    b.add_argument(
        "--offload",
        choices=["optimizer"],
        default=None,
        help="the fp32 master and the optimizer state in host memory (stages 1-3)",
    )
    b.add_argument("--qwz", action="store_true", help="stage 3 gathers the weights as int8")
    b.add_argument(
        "--qgz", choices=["int8", "int4"], default=None, help="gradients reduce-scattered so"
    )
    b.add_argument("--quant-block", type=int, default=2048, help="elements per quantization scale")
    b.add_argument(
        "--ema",
        action="store_true",
        help="the state keeps an EMA of the weights (fp32, laid out as the master: 4Ψ/N)",
    )
    if hpz:
        b.add_argument(
            "--hpz",
            action="store_true",
            help="with --group-size, stage 3: the params sharded within each group, the "
            "master and optimizer state over every device",
        )


def os_reason(e: OSError) -> str:
    """``"Read-only file system: 'runs/x'"``: the OS's reason and the path it concerns."""
    if e.filename is None:
        return e.strerror or str(e)
    path = Path(e.filename)
    if e.errno in (errno.ENOTDIR, errno.EEXIST):  # a file stands where a directory should be
        blocker = next((p for p in (path, *path.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            return f"{str(blocker)!r} is a file, not a directory"
    return f"{e.strerror or e}: {str(path)!r}"


def output_problem(path: Path) -> str | None:
    """Why the file ``path`` cannot be written, or None; creates missing parent directories.

    Commands check their output paths before the work that fills them, so a
    typo costs no compilation and gives one line instead of a traceback.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return os_reason(e)
    if path.is_dir():
        return f"{str(path)!r} is a directory"
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        return f"{str(target)!r} is not writable"
    return None


def say(message: str, status: int) -> int:
    """Prints ``message`` on stderr; returns ``status``."""
    print(message, file=sys.stderr, flush=True)
    return status


def one_line(e: BaseException) -> str:
    """``e``'s message on one line: an :class:`~jaxzero.Error`'s whole (its whitespace
    collapsed), an OSError's reason and path, another's first line (JAX's run long)."""
    if isinstance(e, Error):
        return " ".join(str(e).split())
    if isinstance(e, OSError):
        return os_reason(e)
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def run(
    prog: str,
    parse: Callable[[list[str]], A],
    body: Callable[[A], int | None],
    argv: list[str] | None = None,
    *,
    also: tuple[type[Exception], ...] = (),
    leave: Callable[[str, int], int] = say,
) -> int:
    """Runs ``jaxzero PROG``: the exit status of ``body(parse(argv))`` (None: 0).

    The one contract of every command: a :class:`jaxzero.Error` (a bad argument among
    them) or one of the command's ``also`` exceptions prints one line,
    ``jaxzero PROG: error: MESSAGE``, and exits 2; Ctrl-C prints ``jaxzero PROG:
    interrupted`` and exits 130; ``--help`` exits 0. Anything else is a bug: its
    traceback is shown. ``leave(line, status)`` prints the line and returns the status
    (``jaxzero train``'s also leaves a multi-process job).
    """
    mistakes: tuple[type[Exception], ...] = (Error, *also)
    try:
        return body(parse(sys.argv[1:] if argv is None else argv)) or 0
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except KeyboardInterrupt:
        return leave(f"jaxzero {prog}: interrupted", 130)
    except mistakes as e:
        return leave(f"jaxzero {prog}: error: {one_line(e)}", 2)


COMMANDS = {
    "train": ("jaxzero.train.loop", "train a GPT on text (default: Python's own sources)"),
    "plot": ("jaxzero.train.plot", "plot loss curves of one or more run directories"),
    "estimate": (
        "jaxzero.commands.estimate",
        "ZeRO memory/communication estimator (no devices needed)",
    ),
    "report": (
        "jaxzero.commands.report",
        "compile a step and print measured vs. theoretical accounting",
    ),
    "plan": (
        "jaxzero.commands.plan",
        "will it fit? compile stage x remat x micro-batches, rank what fits",
    ),
    "export": ("jaxzero.train.export", "write a checkpoint's params as safetensors + config.json"),
    "sample": ("jaxzero.train.sample", "generate text from a run, checkpoint or export"),
    "launch": (
        "jaxzero.launch",
        "start K processes per node (multi-GPU, multi-node), watch them",
    ),
}


def _usage() -> str:
    lines = ["usage: jaxzero COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "run 'jaxzero COMMAND --help' for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxzero: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
