"""The memory guard (jaxzero.train.memguard): its decision on stubbed host figures, and
the guard acting on it once, in one line (issue 46: no run ends without a message)."""

from __future__ import annotations

import threading

import pytest

from jaxzero.train import memguard as mg

GB = 1e9
HOST = 24 * GB  # this machine's size: the floor is 5% of it, 1.2 GB


def _host(available: float, resident: float = 10 * GB) -> mg.HostMemory:
    return mg.HostMemory(total=HOST, available=available, resident=resident)


def test_the_host_floor_stops_a_run_before_the_kernel_would():
    assert mg.floor(HOST) == pytest.approx(1.2 * GB)
    assert mg.floor(4 * GB) == 512 << 20  # a small host keeps at least 512 MiB
    assert mg.verdict(_host(1.3 * GB), base=1 * GB) is None
    why = mg.verdict(_host(1.1 * GB, 21 * GB), base=1 * GB)
    assert why is not None and "the host has 1.1 GB of 24 GB left" in why and "21 GB" in why
    # on a GPU the host's memory is not the devices': its room is not the guard's business
    assert mg.verdict(_host(0.1 * GB), base=1 * GB, host_is_device=False) is None
    assert mg.verdict(None, base=0) is None  # no /proc: nothing to judge


def test_a_given_device_memory_is_held_at_run_time():
    limit = mg.Limit(per_device=100e6, devices=8, host=50e6)  # 850 MB in all
    base = 2 * GB
    assert mg.verdict(_host(20 * GB, base + 850e6), base=base, limit=limit) is None
    why = mg.verdict(_host(20 * GB, base + 900e6), base=base, limit=limit)
    assert why is not None and "8 CPU devices hold 900 MB of host memory, over 850 MB" in why
    assert "8 x 100 MB, zero.device_memory, and 50 MB for a checkpoint's host copy" in why
    # an accelerator: its allocator's peak against the bytes per device
    gpu = dict(base=0, limit=mg.Limit(80 * GB, 1), host_is_device=False)
    assert mg.verdict(_host(1 * GB), device_peak=79 * GB, **gpu) is None
    why = mg.verdict(_host(1 * GB), device_peak=81 * GB, **gpu)
    assert why is not None and "a device peaked at 81 GB, over the 80 GB" in why


def test_the_guard_says_one_line_once_and_records_the_peak():
    figures = iter([_host(20 * GB, 3 * GB), _host(10 * GB, 12 * GB), _host(1 * GB, 22 * GB)])
    said: list[str] = []
    guard = mg.MemoryGuard(None, host_is_device=True, figures=lambda: next(figures),
                           leave=said.append)  # fmt: skip
    guard.base = 3 * GB
    assert guard.check() is None and guard.check() is None and not said
    assert guard.check() is not None
    assert guard.summary() == {"host_resident_start": 3 * GB, "host_resident_peak": 22 * GB}
    (line,) = said
    assert "\n" not in line and line.startswith("jaxzero train: error: out of memory: the host")
    assert "To fit: set zero.auto=true" in line and "model.remat=full" in line


def test_the_guard_watches_from_its_thread_until_stopped():
    looks = 0
    tripped = threading.Event()

    def figures() -> mg.HostMemory:
        nonlocal looks
        looks += 1
        return _host(20 * GB if looks < 5 else 0.5 * GB)

    guard = mg.MemoryGuard(
        None, host_is_device=True, figures=figures, leave=lambda _: tripped.set(), period=0.01
    ).start()
    assert tripped.wait(10), "the guard never looked again"
    guard.stop()
    assert guard.tripped is not None and not guard._thread.is_alive()


def test_an_accelerators_out_of_memory_error_is_one_line():
    error = RuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 bytes.\n"
        "BufferAssignment OOM Debugging.\nBufferAssignment stats: ...\n"
    )
    line = mg.out_of_memory_line(error)
    assert line == (
        "jaxzero train: error: out of memory: Out of memory while trying to allocate "
        f"2147483648 bytes. To fit: {mg.ADVICE}"
    )
