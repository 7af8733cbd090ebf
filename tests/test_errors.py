"""One base class for user errors, one runner for every command (issue 34, item 5)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import jaxzero
from jaxzero import cli

# Exceptions that end a command on purpose, not mistakes of the user (exit 2 would say
# the command was given something wrong; it was not): each docstring says why.
CONTROL_FLOW = {
    "Stopped": "a signal stopped training after a checkpoint: exit 128 + the signal",
    "WriteFailed": "the machine failed under a valid run (disk full): exit 1",
    "Diverged": "a valid run's loss stopped being finite: exit 1",
}


def _modules():
    for info in pkgutil.walk_packages(jaxzero.__path__, "jaxzero."):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            yield importlib.import_module(info.name)


def _exception_classes():
    for module in _modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            # A Warning is issued, never raised to end a command: not this test's concern.
            if (
                issubclass(cls, BaseException)
                and not issubclass(cls, Warning)
                and cls.__module__ == module.__name__
            ):
                yield cls


def test_every_exception_class_is_an_error_or_documented_control_flow():
    found = {f"{c.__module__}.{c.__qualname__}": c for c in _exception_classes()}
    strays = [
        name
        for name, cls in found.items()
        if not issubclass(cls, jaxzero.Error) and cls.__qualname__ not in CONTROL_FLOW
    ]
    assert not strays, f"derive these from jaxzero.Error or list them in CONTROL_FLOW: {strays}"
    for name, cls in found.items():
        if cls.__qualname__ in CONTROL_FLOW:
            assert not issubclass(cls, jaxzero.Error), name
            assert "jaxzero.Error" in (cls.__doc__ or ""), f"{name}: say why it is no Error"
    names = {cls.__qualname__ for cls in found.values()}
    assert names >= {"ArgError", "CheckpointError", "ConfigError", *CONTROL_FLOW}, names


def test_errors_keep_the_builtin_base_callers_catch():
    from jaxzero.train.config import ConfigError

    assert issubclass(jaxzero.CheckpointError, ValueError)
    assert issubclass(ConfigError, jaxzero.Error) and issubclass(ConfigError, ValueError)
    assert issubclass(cli.ArgError, jaxzero.Error)


def _run(capsys, body, argv=(), **kw):
    parser = cli.Parser(prog="jaxzero demo")
    parser.add_argument("--n", type=int, default=0)
    status = cli.run("demo", parser.parse_args, body, list(argv), **kw)
    out, err = capsys.readouterr()
    return status, out, err


def test_an_error_is_one_line_and_exit_2(capsys):
    def body(args):
        raise jaxzero.CheckpointError("no checkpoint in 'runs/x';\n  train first")

    status, out, err = _run(capsys, body)
    assert status == 2 and out == ""
    assert err == "jaxzero demo: error: no checkpoint in 'runs/x'; train first\n"


def test_a_bad_argument_is_one_line_and_exit_2(capsys):
    status, out, err = _run(capsys, lambda args: 0, ["--n", "x"])
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("jaxzero demo: error: argument --n: invalid int value")


def test_ctrl_c_is_130(capsys):
    def body(args):
        raise KeyboardInterrupt

    assert _run(capsys, body) == (130, "", "jaxzero demo: interrupted\n")


def test_the_body_gives_the_status_and_help_exits_0(capsys):
    assert _run(capsys, lambda args: args.n, ["--n", "3"])[0] == 3
    assert _run(capsys, lambda args: None)[0] == 0
    status, out, _ = _run(capsys, lambda args: 1, ["--help"])
    assert status == 0 and "usage: jaxzero demo" in out


def test_a_commands_own_expected_errors_are_one_line(capsys):
    def os_error(args):
        raise FileNotFoundError(2, "No such file or directory", "runs/x")

    def long_error(args):
        raise RuntimeError("XLA cannot fit the step\nwith a long\ndump")

    also = (OSError, RuntimeError)
    assert _run(capsys, os_error, also=also)[2] == (
        "jaxzero demo: error: No such file or directory: 'runs/x'\n"
    )
    assert _run(capsys, long_error, also=also)[2] == (
        "jaxzero demo: error: XLA cannot fit the step\n"
    )


def test_anything_else_is_a_bug_and_keeps_its_traceback(capsys):
    def body(args):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        _run(capsys, body)


def test_leave_prints_the_line_and_gives_the_status(capsys):
    left = []

    def leave(line, status):
        left.append((line, status))
        return status

    def body(args):
        raise jaxzero.Error("bad")

    assert _run(capsys, body, leave=leave) == (2, "", "")
    assert left == [("jaxzero demo: error: bad", 2)]


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_runs_through_the_runner(name, monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "run", lambda prog, *a, **kw: calls.append(prog) or 0)
    module = importlib.import_module(cli.COMMANDS[name][0])
    assert module.main(["--", "true"]) == 0
    assert calls == [name]
