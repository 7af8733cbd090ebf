"""Every test process sees 8 simulated CPU devices; meshes of 1, 2 or 8 use the first ones.

Every test belongs to exactly one tier (pyproject.toml registers the markers;
docs/contributing.md says what goes where): its module's tier in ``MODULES`` below, or the
one ``@pytest.mark.<tier>`` it is marked with. A test module missing from ``MODULES`` or a
test with two tiers fails collection.
"""

import importlib.metadata
import os
import re
import shutil
import tempfile
from pathlib import Path

import _budget
import pytest
from _procs import reap

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's version, read without importing it (XLA_FLAGS must be set
    before JAX starts its backend)."""
    parts = re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:3]
    return tuple(int(p) for p in parts)


# XLA:CPU's LLVM code generation at -O0 (JAXZERO_TESTS_XLA_OPT=default: as users run it).
# The suite's time is mostly XLA:CPU compiling tiny programs, and LLVM's optimisation is
# most of a compile: -O0 cut lane new from 891 s to 705 s (docs/dev/ci-log.md). It
# changes no HLO pass, so the optimised HLO, the buffer assignment and memory_analysis
# (what the accounting tests read) are the same at either level on both JAX lines; only
# rounding may differ in the last bits (one float32 ulp in the tiny GPT's losses), alike
# on both sides of every comparison and far inside every tolerance.
# On jaxlib 0.10 (lane py311), XLA:CPU's legacy elemental emitters for fusions, not its
# MLIR fusion emitters: a tiny Qwen3.5's and Llama's gradients compile in 1.3 s instead of
# 4.3 s here, and that lane's tests took 976 s summed instead of 1,367 (docs/dev/ci-log.md).
# The optimised HLO's fusions may differ (the MLIR emitters also wrap each unfused op in a
# fusion of its own); the collectives, the memory the accounting tests read and every
# assertion hold alike. Newer jaxlib has only the MLIR emitters (and refuses the flag).
_flags = ["--xla_force_host_platform_device_count=8"]
if os.environ.get("JAXZERO_TESTS_XLA_OPT", "o0") != "default":
    _flags.append("--xla_backend_optimization_level=0")
    if _jaxlib_version()[:2] == (0, 10):
        _flags.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _flags:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# One persistent compilation cache per test session, shared by the xdist workers and by
# the subprocesses they start (they inherit the environment): across modules the tests
# compile many identical tiny programs (the same engine at the same shapes), and XLA:CPU
# compiles, not steps, are most of the suite's time. A hit is the same executable (same
# HLO, memory analysis and results), so what the tests check does not change. A size
# limit turns on JAX's file lock, so that two processes never read a half-written entry.
# JAX caches only compiles that took a second or more by default: almost none of the
# suite's tiny programs, so every compile is cached (min time 0; issue 45 measured what
# that saves, docs/dev/ci-log.md).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxzero-tests-xla-")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

TIERS = ("unit", "equivalence", "system")

# Each test module's tier: its tests' tier unless one is marked with another.
MODULES = {
    "test_accounting": "equivalence",
    "test_api": "unit",
    "test_backend": "equivalence",
    "test_budget": "unit",
    "test_checkpoint": "equivalence",
    "test_collectives": "equivalence",
    "test_config": "unit",
    "test_data": "unit",
    "test_decode": "equivalence",
    "test_deltanet": "equivalence",
    "test_distributed": "unit",
    "test_ema": "equivalence",
    "test_docs": "system",
    "test_engine": "equivalence",
    "test_errors": "unit",
    "test_estimate": "unit",
    "test_experiments": "system",
    "test_export": "system",
    "test_finetune": "system",
    "test_flax_hooks": "equivalence",
    "test_frozen": "equivalence",
    "test_lora": "equivalence",
    "test_hf": "equivalence",
    "test_hook_check": "unit",
    "test_hpz": "equivalence",
    "test_layout": "unit",
    "test_llama": "equivalence",
    "test_llama_tp": "equivalence",
    "test_loop": "unit",
    "test_memguard": "unit",
    "test_model_state": "equivalence",
    "test_loss": "equivalence",
    "test_mesh": "unit",
    "test_models": "unit",
    "test_multiprocess": "system",
    "test_nnx": "equivalence",
    "test_offload": "equivalence",
    "test_optimizers": "equivalence",
    "test_packing": "equivalence",
    "test_partition": "unit",
    "test_plan": "equivalence",
    "test_planner": "equivalence",
    "test_procs": "unit",
    "test_quant": "unit",
    "test_run_edges": "system",
    "test_run_failures": "system",
    "test_tensor_parallel": "equivalence",
    "test_step": "equivalence",
    "test_store": "unit",
    "test_train_cli": "system",
    "test_zeropp": "equivalence",
}
_MARK = re.compile(r"\bpytest\.mark\.(" + "|".join(TIERS) + r")\b")


def _module_tiers(path: Path) -> set[str]:
    """The tiers a module's tests can be in, read from its text, without importing it."""
    return {MODULES[path.stem], *_MARK.findall(path.read_text())}


def _tiers_selected(markexpr: str) -> set[str] | None:
    """The tiers ``-m markexpr`` selects, or None when it names anything but tiers (then
    every module is imported and pytest's own ``-m`` decides)."""
    words = set(re.findall(r"\w+", markexpr))
    if not words or not re.fullmatch(r"[\w\s()]*", markexpr):
        return None
    if words - set(TIERS) - {"and", "or", "not"}:
        return None
    # Only tier names, and/or/not and parentheses: -m's grammar is Python's here. A test has
    # one tier, so the expression selects it when it is true with that tier alone true.
    return {t for t in TIERS if eval(markexpr, {"__builtins__": {}}, {n: n == t for n in TIERS})}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``-m`` on tiers alone imports only the modules that can hold a selected test:
    ``-m unit`` does not pay for an equivalence module's import-time model."""
    if collection_path.suffix != ".py" or collection_path.stem not in MODULES:
        return None  # an unknown test module is imported, and fails collection below
    selected = _tiers_selected(config.getoption("markexpr") or "")
    if selected is not None and not selected & _module_tiers(collection_path):
        return True
    return None


def _tier(item: pytest.Item) -> str:
    module = item.path.stem
    marked = [m.name for m in item.iter_markers() if m.name in TIERS]
    if module not in MODULES:
        raise pytest.Collector.CollectError(
            f"{item.nodeid} is in no tier: add {module!r} to MODULES in tests/conftest.py "
            f"with its tier ({', '.join(TIERS)}; see docs/contributing.md)"
        )
    if len(marked) > 1:
        raise pytest.Collector.CollectError(
            f"{item.nodeid} is marked with {len(marked)} tiers ({', '.join(marked)}): "
            "a test belongs to exactly one"
        )
    if marked and marked[0] not in _module_tiers(item.path):
        raise pytest.Collector.CollectError(
            f"{item.nodeid} gets tier {marked[0]} other than as @pytest.mark.{marked[0]} in "
            f"its module's text: write it so, for -m {marked[0]} to import the module"
        )
    return marked[0] if marked else MODULES[module]


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Each test gets its tier as it is made, before ``-m`` selects; a test in no tier or
    in two fails its module's collection (with xdist too)."""
    made = yield
    for item in made if isinstance(made, list) else [made]:
        if isinstance(item, pytest.Item):
            tier = _tier(item)
            if not item.get_closest_marker(tier):
                item.add_marker(getattr(pytest.mark, tier))
    return made


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's compilation cache goes with it (the xdist controller made it; its
    workers inherited it and leave it alone)."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """A process a test started (``_procs.Child``) and left running is killed with its
    group when the test ends, passed or failed: nothing it started goes on eating CPU."""
    yield
    reap()


# CI's lane timeout (.ci/run) names the tests that were running when it fired: each test
# process writes the test it is in to a file of its own in this folder while it runs.
# (xdist's controller hears of its workers' tests too: only the process running one writes.)
_RUNNING = os.environ.get("JAXZERO_TESTS_RUNNING")


def pytest_addoption(parser: pytest.Parser) -> None:
    _budget.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    global _RUNNING
    _budget.configure(config)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        _RUNNING = None


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if _RUNNING:
        Path(_RUNNING, str(os.getpid())).write_text(nodeid + "\n")


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    if _RUNNING:
        Path(_RUNNING, str(os.getpid())).unlink(missing_ok=True)
