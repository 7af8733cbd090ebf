"""The test-time budget (tests/_budget.py, .ci/budget.toml): read, judged, and enforced."""

import os
import sys
from pathlib import Path

import _budget
import _procs
import pytest

HERE = Path(__file__).parent


def test_every_ci_lane_has_a_ceiling():
    """.ci/run passes --budget with each lane's name: each has a positive ceiling."""
    lanes = _budget.ceilings()
    run = (HERE.parent / ".ci" / "run").read_text()
    for lane in ("new", "py311"):
        assert lanes[lane] > 0
    assert '--budget "$name"' in run  # checks() runs each lane under its own name


def test_verdict_within_and_past_the_ceiling():
    ok, line = _budget.verdict("new", 900.4, 1000, 12)
    assert ok and line == (
        "test-time budget, lane new: 900 s in 12 tests (sum of durations), 1000 s allowed "
        "(90% used)"
    )
    ok, line = _budget.verdict("py311", 1100, 1000, 12)
    assert not ok and "passes the 1000 s allowed" in line and "by 100 s" in line
    assert "raise the ceiling in a commit that says why" in line


@pytest.mark.system
def test_a_lane_past_its_ceiling_fails_and_says_so(tmp_path):
    """A passing run whose durations add up past the ceiling exits 1, naming the file."""
    budget = tmp_path / "budget.toml"
    budget.write_text("[lanes]\ntiny = 0.0001\n")
    env = dict(os.environ, JAXZERO_TEST_BUDGET_FILE=str(budget))
    done = _procs.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         "--budget", "tiny", str(HERE / "test_layout.py")],
        env=env, capture_output=True, text=True, timeout=240, cwd=HERE.parent,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    assert "passed" in done.stdout and f"allowed by {budget}" in done.stdout
