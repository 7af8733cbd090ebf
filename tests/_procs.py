"""Helpers for tests that start processes: free ports, and finding what is left of a run."""

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
