"""The ``jaxzero`` command: ``train``, ``plot``, ``estimate``, ``report``, ``launch``.

Each subcommand lives in its own module with a ``main(argv) -> int``; this file
only dispatches, so ``jaxzero estimate`` never pays for importing the trainer.
"""

from __future__ import annotations

import argparse
import importlib
import sys


class ArgError(Exception):
    """An argparse error, raised instead of printing usage and exiting."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse hook
        raise ArgError(message)


COMMANDS = {
    "train": ("jaxzero.train", "train a GPT on text (default: Python's own sources)"),
    "plot": ("jaxzero.plot", "plot loss curves of one or more run directories"),
    "estimate": ("jaxzero.estimate", "ZeRO memory/communication estimator (no devices needed)"),
    "report": ("jaxzero.report", "compile a step and print measured vs. theoretical accounting"),
    "launch": ("jaxzero.launch", "start K processes per node (multi-GPU, multi-node), watch them"),
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
