"""The ``jaxzero`` command: ``train``, ``launch``, ``plot``, ``estimate``, ``report``, ``export``,
``sample``.

Each subcommand lives in its own module with a ``main(argv) -> int``; this file
only dispatches, importing just the module asked for. Most of any command's start-up
is ``import jaxzero`` itself (JAX, Flax, optax: 1.1-1.8 s, measured on 2 CPU cores);
importing every subcommand's module here would add 0.1-0.16 s to each of them.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from pathlib import Path


class ArgError(Exception):
    """An argparse error, raised instead of printing usage and exiting."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse hook
        raise ArgError(message)


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
