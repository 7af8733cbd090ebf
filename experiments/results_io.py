"""CSV in and out for the experiment scripts (``--replot`` redraws from the CSV).

Every row written records what it was measured with (:func:`environment`: the library
versions, the backend and its devices, the machine), so a figure quoted later can be
traced to the software and hardware that produced it.
"""

from __future__ import annotations

import csv
import functools
import os
import pathlib
import platform
from importlib import metadata

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | str:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return "unknown"


@functools.cache
def environment() -> dict[str, str | int | float]:
    """The columns each result row ends with: Python and library versions, the backend,
    its device kind and count (starting JAX's backend if no experiment did), the host's
    CPU, core count and memory."""
    import jax

    env: dict[str, str | int | float] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "absent"
    devices = jax.devices()
    env.update(
        backend=devices[0].platform,
        device_kind=devices[0].device_kind,
        device_count=len(devices),
        cpu=_cpu_model(),
        cores=os.cpu_count() or 0,
        memory_gib=_memory_gib(),
        os=f"{platform.system()} {platform.release()}",
        recorded="measured",
    )
    return env


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    """Rows with possibly different keys: the header is their union, gaps are 0. Each row
    ends with :func:`environment`'s columns, unless it has them already (rows read back
    from a sub-process's CSV keep the environment they were measured in)."""
    if rows and any(k not in r for r in rows for k in ("jax", "recorded")):
        env = environment()
        rows = [r | {k: v for k, v in env.items() if k not in r} for r in rows]
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval=0)
        w.writeheader()
        w.writerows(rows)


def read_csv(path: pathlib.Path) -> list[dict]:
    """Rows written by :func:`write_csv`, numbers as numbers."""

    def num(v: str):
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v

    with path.open() as f:
        return [{k: num(v) for k, v in row.items()} for row in csv.DictReader(f)]


if __name__ == "__main__":  # print the environment a result row would record
    for key, value in environment().items():
        print(f"{key}: {value}")
