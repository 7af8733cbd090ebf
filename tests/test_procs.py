"""The rule that bounds every process a test starts (tests/_procs.py), checked on the
tests' own text, and the deadline itself on a process that hangs."""

import ast
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import _procs
import pytest

TESTS = Path(__file__).parent
# What starts a process without our deadline: subprocess's and os's own entry points.
UNBOUNDED = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput"},
    "os": {"system", "popen", "spawnv", "spawnl", "execv", "fork"},
}


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name):
                yield owner.id, node.func.attr, node


def test_every_process_a_test_starts_has_a_deadline():
    """Through ``_procs.run``/``_procs.Child`` only, each with ``timeout=`` (a hung child
    then fails its test, killed with its process group, instead of hanging CI)."""
    found = []
    for path in sorted(TESTS.glob("*.py")):
        if path.name == "_procs.py":
            continue
        for owner, attr, node in _calls(path):
            where = f"{path.name}:{node.lineno}"
            if attr in UNBOUNDED.get(owner, ()):
                found.append(f"{where}: {owner}.{attr} (use _procs.run or _procs.Child)")
            if owner == "_procs" and attr in ("run", "Child"):
                if "timeout" not in {k.arg for k in node.keywords}:
                    found.append(f"{where}: _procs.{attr} without timeout=")
    assert found == [], "\n".join(found)


@pytest.mark.system
@pytest.mark.parametrize("how", ["run", "communicate"])
def test_a_hung_child_is_killed_with_its_group_at_its_deadline(how):
    marker = f"JAXZERO_TEST_{uuid.uuid4().hex}"
    hang = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); "
            "print('up', flush=True); time.sleep(300)"]  # fmt: skip
    env = {**os.environ, marker: "1"}
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        if how == "run":
            _procs.run(hang, timeout=3, env=env, capture_output=True, text=True)
        else:
            child = _procs.Child(hang, timeout=3, env=env, stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline() == "up\n"
            child.communicate()  # no timeout of its own: the deadline bounds it
    assert time.monotonic() - started < 30
    assert _procs.alive_with(marker) == []  # the grandchild `sleep` went with its group


def test_a_childs_xla_flags_keep_all_but_the_simulated_device_count(monkeypatch):
    """A child chooses its own device count and keeps the suite's other XLA flags (the
    code-generation level conftest sets): dropping all of XLA_FLAGS lost them."""
    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    )
    assert _procs.xla_flags() == "--xla_backend_optimization_level=0"
    assert _procs.xla_flags(2) == (
        "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2"
    )
    assert _procs.child_env()["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in _procs.child_env()
