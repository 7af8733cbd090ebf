"""Runs tests in a loop and counts how often they fail: the soak for flaky multi-process tests.

A flaky test is a bug; finding its cause needs it to fail often enough to study. This runs
the given pytest selection ``--runs`` times in a fresh pytest process each time (a fresh
interpreter, as in CI), records each run's outcome and, for a failure, the lines that say
why (``terminate called``, a signal, the assertion), and prints a summary::

    python -m experiments.mp_soak --runs 50 \\
        tests/test_multiprocess.py::test_two_processes_match_one_device

Run two at once (one per JAX line, or two of one) to soak under load, as issue 45 asks.
Each run's full output is kept under ``--keep`` when it fails.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

# What a failed run printed that names its cause, most specific first.
SIGNATURES = (
    ("terminate", re.compile(r"terminate called[^\n]*")),
    ("signal", re.compile(r"(?:killed by|died with|signal) SIG\w+")),
    ("timeout", re.compile(r"Timeout \(\d+|TimeoutExpired")),
    ("assert", re.compile(r"^E\s+\w*Error[^\n]*", re.M)),
)


def signature(output: str) -> str:
    """The first line of ``output`` that names why the run failed ("other" if none does)."""
    for name, pattern in SIGNATURES:
        found = pattern.search(output)
        if found:
            return f"{name}: {found.group(0).strip()[:120]}"
    return "other"


def soak(tests: list[str], runs: int, keep: Path | None, python: str) -> Counter:
    """Runs ``pytest tests`` ``runs`` times; a Counter of outcomes ("passed" or a signature)."""
    outcomes: Counter = Counter()
    started = time.monotonic()
    for i in range(runs):
        t0 = time.monotonic()
        done = subprocess.run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
            capture_output=True,
            text=True,
        )
        output = done.stdout + done.stderr
        outcome = "passed" if done.returncode == 0 else signature(output)
        outcomes[outcome] += 1
        if outcome != "passed" and keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"run{i:03d}.log").write_text(output)
        print(
            f"run {i + 1}/{runs}: {outcome} ({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
    took = time.monotonic() - started
    failed = runs - outcomes["passed"]
    print(f"soak: {runs} runs, {failed} failed, {took:.0f} s ({python})")
    for outcome, n in outcomes.most_common():
        print(f"  {n:4d}  {outcome}")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tests", nargs="+", help="pytest node ids or paths")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--keep", type=Path, default=None, help="folder for failed runs' output")
    p.add_argument("--python", default=sys.executable, help="the interpreter to run pytest")
    args = p.parse_args(argv)
    outcomes = soak(args.tests, args.runs, args.keep, args.python)
    return 0 if outcomes["passed"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
