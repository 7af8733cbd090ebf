"""No silent death: a run that is about to run out of memory stops itself in one line.

On CPU the simulated devices live in the host's memory, and a step that outgrows it is
not refused by XLA: the kernel reclaims page cache until the machine thrashes, then its
OOM killer ends the process with no message (issue 46: twelve minutes of thrashing, then
SIGKILL). :class:`MemoryGuard` watches from a thread, a few times a second:

- the host's room (``MemAvailable``, or a cgroup v2 limit's remaining bytes where one is
  set): below :data:`FLOOR` of the host's memory (at least :data:`MIN_FLOOR`) the run
  stops, before the kernel would;
- with ``zero.device_memory`` given, what the run's devices hold: on CPU the process's
  resident growth since the guard started (the state, the batches, the step's
  temporaries; the executables were compiled before), on a GPU the device's
  ``peak_bytes_in_use``, against the stated bytes per device.

Stopping prints one line (``jaxzero train: error: out of memory: ...``: what was held,
the limit, what to change) and leaves with exit code 1 from the guard's thread
(``os._exit``): the main thread may be inside a step, where no exception reaches it. A
checkpoint being written is not half-kept: orbax writes into a temporary directory and
renames it when complete, so the last complete checkpoint stays the latest
(``tests/test_checkpoint.py`` kills a run with SIGKILL mid-step and resumes it exactly).

The decision is a pure function of the figures (:func:`verdict`), tested with stubs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxzero.accounting.estimate import format_bytes

FLOOR = 0.05  # stop when less than this share of the host's memory is left
MIN_FLOOR = 512 << 20  # and never wait for less than this many bytes
PERIOD_S = 0.2
ADVICE = (
    "set zero.auto=true (the planner picks what fits), a smaller train.batch_size, "
    "--set model.remat=full, more --micro-batches, or LoRA (--set lora.rank=16)"
)


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """The host's figures, in bytes: what the process may use at most (``MemTotal``, or a
    smaller cgroup limit), what is still available to it, and its own resident set."""

    total: float
    available: float
    resident: float


def _kib(text: str, field: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1]) * 1024
    return None


def _cgroup() -> tuple[float, float] | None:
    """A cgroup v2 memory limit and the bytes charged against it (None: no limit)."""
    try:
        own = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].split(":", 2)[2]
        root = Path("/sys/fs/cgroup") / own.lstrip("/")
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return float(limit), float((root / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None


def host_memory() -> HostMemory | None:
    """This process's and the host's memory now (None where ``/proc`` is not Linux's)."""
    try:
        info = Path("/proc/meminfo").read_text()
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    total, avail, rss = _kib(info, "MemTotal"), _kib(info, "MemAvailable"), _kib(status, "VmRSS")
    if total is None or avail is None or rss is None:
        return None
    limited = _cgroup()
    if limited is not None and limited[0] < total:
        total, avail = limited[0], min(avail, limited[0] - limited[1])
    return HostMemory(total, avail, rss)


def floor(total: float) -> float:
    """Bytes the host must keep free: below them the kernel thrashes, then kills."""
    return max(FLOOR * total, float(MIN_FLOOR))


@dataclasses.dataclass(frozen=True)
class Limit:
    """What the run's devices may hold: ``per_device`` bytes (``zero.device_memory``) on
    each of ``devices`` local ones."""

    per_device: float
    devices: int
    host: float = 0.0  # host bytes the run may add that are not the devices' (on CPU)

    @property
    def total(self) -> float:
        return self.per_device * self.devices + self.host


def verdict(
    now: HostMemory | None,
    *,
    base: float,
    limit: Limit | None = None,
    device_peak: float | None = None,
    host_is_device: bool = True,
) -> str | None:
    """Why the run must stop now (one clause), or None.

    Args:
      now: the host's figures (None: unknown, no host check).
      base: the resident bytes when the guard started (before the state existed).
      limit: ``zero.device_memory`` per device, when given.
      device_peak: an accelerator's ``peak_bytes_in_use`` (None on CPU).
      host_is_device: the devices live in host memory (XLA:CPU).
    """
    if now is not None and host_is_device and now.available < floor(now.total):
        return (
            f"the host has {format_bytes(now.available)} of {format_bytes(now.total)} left "
            f"(this run holds {format_bytes(now.resident)}; the simulated devices live in "
            "host memory)"
        )
    if limit is None:
        return None
    if device_peak is not None and device_peak > limit.per_device:
        return (
            f"a device peaked at {format_bytes(device_peak)}, over the "
            f"{format_bytes(limit.per_device)} zero.device_memory allows"
        )
    if now is not None and host_is_device and now.resident - base > limit.total:
        return (
            f"the run's {limit.devices} CPU devices hold {format_bytes(now.resident - base)} "
            f"of host memory, over {format_bytes(limit.total)} ({limit.devices} x "
            f"{format_bytes(limit.per_device)}, zero.device_memory"
            + (
                f", and {format_bytes(limit.host)} for a checkpoint's host copy)"
                if limit.host
                else ")"
            )
        )
    return None


def out_of_memory_line(error: BaseException) -> str:
    """An accelerator's out-of-memory error (XLA's RESOURCE_EXHAUSTED) as one line."""
    first = next((ln for ln in str(error).splitlines() if "RESOURCE_EXHAUSTED" in ln), "")
    what = first.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().rstrip(".")
    what = what or "the device's allocator refused"
    return f"jaxzero train: error: out of memory: {what}. To fit: {ADVICE}"


def _leave(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    os._exit(1)


class MemoryGuard:
    """Watches the run's memory from a daemon thread; records the peak resident set.

    ``start()`` takes the baseline (call it before the state is created), ``stop()``
    ends the watch. ``figures()`` reads the host, ``device_peak()`` an accelerator;
    ``leave(line)`` stops the process (all three replaceable, for tests).
    """

    def __init__(
        self,
        limit: Limit | None,
        *,
        host_is_device: bool,
        device: Any = None,
        figures: Callable[[], HostMemory | None] = host_memory,
        leave: Callable[[str], None] = _leave,
        period: float = PERIOD_S,
    ):
        self.limit, self.host_is_device, self.device = limit, host_is_device, device
        self.figures, self.leave, self.period = figures, leave, period
        self.base = self.peak = 0.0
        self.tripped: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def device_peak(self) -> float | None:
        stats = getattr(self.device, "memory_stats", lambda: None)() if self.device else None
        return float(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None

    def check(self) -> str | None:
        """One look: the peak is recorded; a reason to stop is returned (and acted on)."""
        now = self.figures()
        if now is not None:
            self.peak = max(self.peak, now.resident)
        why = verdict(
            now, base=self.base, limit=self.limit, device_peak=self.device_peak(),
            host_is_device=self.host_is_device,
        )  # fmt: skip
        if why is not None and self.tripped is None:
            self.tripped = why
            self.leave(f"jaxzero train: error: out of memory: {why}. To fit: {ADVICE}")
        return why

    def allow_host(self, nbytes: float) -> None:
        """Room in the limit for host bytes that are not the devices' (on CPU: the copy
        of the state a checkpoint makes)."""
        if self.limit is not None:
            self.limit = dataclasses.replace(self.limit, host=nbytes)

    def start(self) -> MemoryGuard:
        now = self.figures()
        self.base = self.peak = now.resident if now is not None else 0.0
        self._thread = threading.Thread(target=self._watch, name="jaxzero-memguard", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(self.period):
            self.check()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, float]:
        """The figures a run's summary records (bytes)."""
        return {"host_resident_start": self.base, "host_resident_peak": self.peak}
