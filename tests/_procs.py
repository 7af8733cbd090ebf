"""Helpers for tests that start processes: free ports, reports, and what is left of a run."""

import json
import os
import socket
from pathlib import Path


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
