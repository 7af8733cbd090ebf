"""Where a compiled step's time goes: kernel time by kind, from JAX's profiler.

``bench_step.py --profile`` runs each contestant's step under ``jax.profiler.trace`` (in
rounds, a fresh random order each round, as the timing does) and reads the trace back
through ``jax.profiler.ProfileData``. XLA names each kernel event after its HLO
instruction (``ynn_fusion.12``, ``all-reduce.3``, ``copy_bitcast_fusion.7``), so the
kinds below go by those names: they describe XLA's programs, not jaxzero's code. On GPUs
only the ``XLA Ops`` lines are read (the kernel lines beside them repeat the same time).

A kernel's time includes its waits: a collective's time is mostly the rendezvous with
the slowest device, so "collectives" is what the step spent in or waiting at them.
"""

from __future__ import annotations

import collections
import glob
import random
import re
import tempfile
import time
from collections.abc import Callable

import jax

KINDS = {
    "collectives": ("all-reduce", "all_reduce", "reduce-scatter", "reduce_scatter",
                    "all-gather", "all_gather", "collective-permute", "all-to-all"),
    "dots": ("ynn_fusion", "dot", "gemm", "cublas"),
    "copies/transposes": ("copy", "transpose"),
}  # fmt: skip
# An HLO instruction's name: lower case, digits, '_', '-', '.' (the profiler's own events,
# ThunkExecutor::Execute, Rendezvous, "Wait: ...", python frames, are not).
KERNEL = re.compile(r"^[a-z][a-z0-9_.\-]*$")
# Control flow whose event spans the kernels it runs (a scan's loop): not counted again.
CONTAINER = re.compile(r"^(while|conditional|call)(\.\d+)?$")


def kind(kernel: str) -> str:
    """The kind of an HLO instruction by its name; ``other`` if none of :data:`KINDS`."""
    for k, prefixes in KINDS.items():
        if kernel.startswith(prefixes):
            return k
    return "other"


def kernel_times(trace_dir: str) -> collections.Counter:
    """Nanoseconds per kernel name in the trace written under ``trace_dir``."""
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    lines = [ln for plane in jax.profiler.ProfileData.from_file(path).planes for ln in plane.lines]
    ops = [ln for ln in lines if ln.name == "XLA Ops"]
    out: collections.Counter = collections.Counter()
    for line in ops or lines:
        for ev in line.events:
            if KERNEL.match(ev.name) and not CONTAINER.match(ev.name):
                out[ev.name] += ev.duration_ns
    return out


def profile(
    steps: dict[str, Callable[[], None]], n_steps: int, rounds: int, devices: int
) -> tuple[dict[str, collections.Counter], dict[str, float]]:
    """Kernel ms per device per step by name, and wall ms per step, of each named step
    (a callable that runs one step and waits for it), ``rounds`` traces of ``n_steps``."""
    kernels = {name: collections.Counter() for name in steps}
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name in random.sample(list(steps), len(steps)):
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d):
                    t = time.perf_counter()
                    for _ in range(n_steps):
                        steps[name]()
                    walls[name].append((time.perf_counter() - t) / n_steps)
                kernels[name].update(kernel_times(d))
    per = 1e6 * n_steps * rounds * devices
    ms = {n: collections.Counter({k: v / per for k, v in c.items()}) for n, c in kernels.items()}
    return ms, {n: 1e3 * sum(w) / len(w) for n, w in walls.items()}


def table(kernels: dict[str, collections.Counter], walls: dict[str, float], top: int = 3) -> str:
    """Per contestant: wall ms per step, kernel ms per device by kind, its largest kernels."""
    kinds = [*KINDS, "other"]
    width = max(len(n) for n in kernels) + 2
    out = [f"{'':<{width}}{'step ms':>9}" + "".join(f"{k:>20}" for k in kinds) + f"{'sum':>8}"]
    for name, c in kernels.items():
        by_kind = collections.Counter()
        for kernel, v in c.items():
            by_kind[kind(kernel)] += v
        out.append(
            f"{name:<{width}}{walls[name]:>9.1f}"
            + "".join(f"{by_kind[k]:>20.1f}" for k in kinds)
            + f"{sum(by_kind.values()):>8.1f}"
        )
    out.append(f"largest kernels (ms per device per step), top {top}:")
    for name, c in kernels.items():
        out.append(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in c.most_common(top)))
    return "\n".join(out)
