"""The test-time budget (hooks called by conftest.py): ``--budget LANE`` fails the run when
the sum of the tests' durations passes the lane's ceiling in ``.ci/budget.toml``.

CI's wall time grows a test at a time, and no single change looks guilty; a ceiling on the
sum of every test's setup, call and teardown (what ``--durations`` reports, added up over
the xdist workers) makes the change that passes it say so, and raise it on purpose, in a
commit that says why. The sum is counted by the process that reports (xdist's controller,
or the one process with ``-n 0``) from every test report it hears of.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

# JAXZERO_TEST_BUDGET_FILE: another file (the budget's own test)
BUDGET = Path(
    os.environ.get("JAXZERO_TEST_BUDGET_FILE", Path(__file__).parent.parent / ".ci" / "budget.toml")
)


def ceilings(path: Path = BUDGET) -> dict[str, float]:
    """Each lane's ceiling in seconds, from ``[lanes]`` of the budget file."""
    with path.open("rb") as f:
        lanes = tomllib.load(f)["lanes"]
    return {name: float(seconds) for name, seconds in lanes.items()}


def verdict(lane: str, spent: float, ceiling: float, tests: int) -> tuple[bool, str]:
    """(within the budget, the line that says so)."""
    ok = spent <= ceiling
    head = f"test-time budget, lane {lane}: {spent:.0f} s in {tests} tests (sum of durations)"
    if ok:
        return ok, f"{head}, {ceiling:.0f} s allowed ({100 * spent / ceiling:.0f}% used)"
    return ok, (
        f"{head} passes the {ceiling:.0f} s allowed by {BUDGET} "
        f"by {spent - ceiling:.0f} s: make the new tests cheaper (shared engines, tiny "
        "models, one lane for what cannot differ: docs/contributing.md), or raise the "
        "ceiling in a commit that says why"
    )


def addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--budget",
        metavar="LANE",
        default=None,
        help=f"fail if the tests' summed durations pass LANE's ceiling in {BUDGET}",
    )


class _Tally:
    def __init__(self, lane: str, ceiling: float):
        self.lane, self.ceiling = lane, ceiling
        self.seconds = 0.0
        self.tests: set[str] = set()
        self.line: str | None = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds += report.duration
        self.tests.add(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        ok, self.line = verdict(self.lane, self.seconds, self.ceiling, len(self.tests))
        if not ok and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.line:
            terminalreporter.write_line(self.line)


def configure(config: pytest.Config) -> None:
    """Counts this session's durations if ``--budget`` names a lane (conftest calls it)."""
    lane = config.getoption("budget")
    if lane is None or hasattr(config, "workerinput"):  # xdist's workers: the controller counts
        return
    known = ceilings()
    if lane not in known:
        raise pytest.UsageError(
            f"--budget {lane}: no such lane in {BUDGET} (it has {', '.join(sorted(known))})"
        )
    config.pluginmanager.register(_Tally(lane, known[lane]), "jaxzero-budget")
