"""The runnable examples in the public docstrings, README.md and docs/ stay true; the docs
site builds without a warning."""

import csv
import doctest
import importlib
import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import _procs
import numpy as np
import pytest

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
PAGES = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
DEV = {p.name: p.read_text() for p in sorted((ROOT / "docs" / "dev").glob("*.md"))}
MODULES = ["jaxzero.engine", "jaxzero.partition", "jaxzero.hooks", "jaxzero.mesh",
           "jaxzero.collectives", "jaxzero.models.gpt", "jaxzero.job", "jaxzero.checkpoint.manager",
           "jaxzero.train.loader", "jaxzero.accounting.estimate", "jaxzero.nnx",
           "jaxzero.accounting.activations",
           "jaxzero.models.llama", "jaxzero.models.llama_hf", "jaxzero.plan",
           "jaxzero.accounting.formulas", "jaxzero.frozen", "jaxzero.models.lora",
           "jaxzero.hf.peft", "jaxzero.offload", "jaxzero.zeropp",
           "jaxzero.model_state"]  # fmt: skip


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def _section(heading: str) -> str:
    """README text from the ``## heading...`` line to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading)}.*?(?=^## )", README, re.S | re.M)
    assert match, f"README has no section '## {heading}'"
    return match.group(0)


def _blocks(text: str, lang: str) -> list[str]:
    """Fenced code blocks of ``text`` in language ``lang`` ("" for plain output)."""
    blocks, current, open_lang = [], [], None
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if open_lang is None:
                open_lang, current = line[3:].strip(), []
            else:
                if open_lang == lang:
                    blocks.append("".join(current))
                open_lang = None
        elif open_lang is not None:
            current.append(line)
    return blocks


def _losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", text)]


def test_readme_library_example_trains_then_the_gpt_snippet_steps(capsys):
    """The library section's two snippets, run in order as a reader pastes them."""
    section = _section("The library in")
    example, gpt = _blocks(section, "python")
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    losses = _losses(capsys.readouterr().out)
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2]  # it trains
    assert losses[-1] < losses[0] / 4
    quoted = _losses(_blocks(section, "")[0])  # the output README shows is the output
    np.testing.assert_allclose(losses, quoted, atol=0.01)
    assert namespace["full"]["w1"].shape == (37, 53)

    exec(compile(gpt, "README.md", "exec"), namespace)
    assert set(namespace["batch"]) == {"inputs", "targets"}
    loss = float(namespace["metrics"]["loss"])
    assert math.isfinite(loss) and abs(loss - math.log(256)) < 0.1  # an untrained model


@pytest.mark.unit
def test_readme_install_extras_exist_and_tensorboard_is_one():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    named = set(re.findall(r"pip install -e '\.\[([\w,-]+)\]'", README))
    assert "tensorboard" in named  # the README says how to get the viewer it suggests
    for group in named:
        assert set(group.split(",")) <= set(extras), group
    assert any(r.startswith("tensorboard") for r in extras["tensorboard"])
    assert not any(r.startswith("tensorboard") for r in extras["test"])  # CI stays lean


@pytest.mark.unit
def test_readme_plot_commands_write_under_runs():
    """runs/ is ignored by git; a plot written in the repository root would not be."""
    commands = re.findall(r"^\s*jaxzero plot [^\n#]*", "\n".join([README, *PAGES.values()]), re.M)
    assert commands
    for command in commands:
        assert re.search(r"-o runs/\S+\.png", command), command
    assert "runs/" in (ROOT / ".gitignore").read_text().split()


@pytest.mark.unit
def test_every_jaxzero_command_the_docs_name_exists():
    """`jaxzero config` was named where `jaxzero train --print-config` is meant."""
    from jaxzero import cli

    named = set()
    for text in [README, *PAGES.values()]:
        named |= set(re.findall(r"(?:`|^    )(?:\.venv/bin/)?jaxzero ([a-z][\w-]*)", text, re.M))
    assert "train" in named and named <= set(cli.COMMANDS), named - set(cli.COMMANDS)


@pytest.mark.unit
def test_the_training_page_exports_checkpoints_its_own_runs_save():
    """Its runs (no checkpoint.every: a checkpoint at the end only) save their last step."""
    page = PAGES["training.md"]
    saved = {int(n) for n in re.findall(r"^\s*jaxzero train [^\n]*--steps (\d+)", page, re.M)}
    used = [int(n) for n in re.findall(r"jaxzero (?:export|sample) runs/\S+/(\d+)\b", page)]
    assert saved and used
    assert set(used) <= saved, f"the page's runs save steps {saved}, it uses {used}"


def _md_rows(text: str) -> list[list[str]]:
    """The cells of a markdown table's body rows (header and rule skipped)."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|")
    ]
    return [r for r in rows if not set(r[0]) <= {"-", " "}][1:]


@pytest.mark.unit
def test_beyond_zero_pages_quote_the_experiment_results():
    """docs/zeropp.md's and docs/offload.md's measured rows are copied from what
    experiments/zero_beyond.py and zeropp_loss.py wrote, not typed."""
    results = ROOT / "experiments" / "results"
    written = (results / "zero_beyond.md").read_text() + (results / "zeropp_loss.md").read_text()
    rows = {"|".join(c.strip() for c in r) for r in _md_rows(written)}
    quoted = _md_rows(PAGES["zeropp.md"][PAGES["zeropp.md"].index("## Measured") :])
    assert len(quoted) >= 16
    for r in quoted:
        assert "|".join(c.strip() for c in r) in rows, r


@pytest.mark.unit
def test_tensor_parallel_page_quotes_the_experiment_results():
    """docs/tensor-parallel.md's measured rows are experiments/tp_traffic.py's, not typed."""
    written = (ROOT / "experiments" / "results" / "tp_traffic.md").read_text()
    rows = {"|".join(c.strip() for c in r) for r in _md_rows(written)}
    page = PAGES["tensor-parallel.md"]
    quoted = _md_rows(page[page.index("## Traffic and activations") :])
    assert len(quoted) >= 12
    for r in quoted:
        assert "|".join(c.strip() for c in r) in rows, r


def test_accounting_tables_quote_the_experiment_results():
    """README's and the accounting page's stage tables are copied from what
    experiments/zero_*.py wrote, not typed."""
    results = ROOT / "experiments" / "results"
    comm = {
        (int(r[0]), r[1], int(r[2])): r[3] for r in _md_rows((results / "zero_comm.md").read_text())
    }
    memory = {}
    for r in _md_rows((results / "zero_memory.md").read_text()):
        if len(r) == 7 and r[0].isdigit() and r[1] == "8":
            memory[int(r[0])] = r
    for where, text in (("README.md", README), ("docs/accounting.md", PAGES["accounting.md"])):
        table = re.search(r"^\| stage \| persistent MB.*?\n\n", text, re.S | re.M)
        assert table, f"{where} lost its measured-vs-theory table"
        _check_stage_table(_md_rows(table.group(0)), memory, comm)


def test_performance_page_stage3_curve_quotes_its_results():
    """The small-batch table of the performance log is experiments/stage3_curve.py's CSV."""
    with (ROOT / "experiments" / "results" / "stage3_curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    for n in sorted({int(r["rows_per_device"]) for r in rows}):
        by = {r["stage"]: r for r in rows if int(r["rows_per_device"]) == n}
        zero, three = by["0"], by["3"]
        line = (
            f"| {n} | {float(zero['ratio']):.3f} | {float(three['ratio']):.3f} "
            f"| {float(zero['plain_jit_ms']):.1f} "
            f"| {float(zero['collectives_ms']):.1f} / {float(three['collectives_ms']):.1f} |"
        )
        assert line in DEV["performance-log.md"], line


def test_planning_page_quotes_the_planner_error_results():
    """docs/planning.md's error table is what ``experiments/plan_error.py --table`` prints
    of its CSV (run as a reader runs it)."""
    done = _procs.run(
        [sys.executable, "-m", "experiments.plan_error", "--table"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in PAGES["planning.md"]


def _check_stage_table(rows, memory, comm):
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    for stage, persistent, comm1, comm4, peak in rows:
        s = int(stage)
        assert persistent == f"{memory[s][2]} / {memory[s][3]}"
        assert comm1.split(" / ")[0] == comm[s, "fp32", 1]
        assert comm4.split(" / ")[0] == comm[s, "fp32", 4]
        assert peak == f"{float(memory[s][5]):.1f}"


def _bench_table(model: str) -> str:
    """What ``python -m experiments.bench_step --table`` prints for the results CSV of ``model``
    (the script's own command, run as a reader would: no import of the script here)."""

    csv = ROOT / "experiments" / "results" / f"bench_step_{model}.csv"
    done = _procs.run(
        [sys.executable, "-m", "experiments.bench_step", "--table", str(csv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.rstrip("\n")


@pytest.mark.parametrize("model", ["plain", "gpt"])
def test_performance_log_speed_tables_quote_the_benchmark_results(model):
    """The speed tables are what python -m experiments.bench_step --csv wrote, not typed."""
    table = _bench_table(model)
    assert table.startswith("| stage | jaxzero ms |"), table
    log = DEV["performance-log.md"]
    assert table in log, f"{model}: the log's table differs from the CSV:\n{table}"


def test_performance_page_zoo_tables_quote_the_benchmark_results(tmp_path):
    """The log's full zoo table and the page's narrow one (what experiments/zoo_plot.py
    prints, the columns it keeps of the full one) are the CSV's, not typed."""
    table = _bench_table("zoo").split("\n\ntargets:")[0]
    assert table.startswith("| model | stage | jaxzero ms |"), table
    assert table in DEV["performance-log.md"], f"the zoo table differs from the CSV:\n{table}"
    done = _procs.run(
        [sys.executable, "-m", "experiments.zoo_plot", "--png", tmp_path / "z.png"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    narrow = done.stdout.rstrip("\n")
    assert narrow.startswith("| model | stage | jaxzero ms | vs plain jit | target |"), narrow
    assert narrow in PAGES["performance.md"], f"the zoo table differs from the CSV:\n{narrow}"
    assert (tmp_path / "z.png").read_bytes()[:4] == b"\x89PNG"  # it draws, too
    assert (ROOT / "docs" / "img" / "zoo.png").is_file()  # python -m experiments.zoo_plot


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.unit
def test_every_image_the_docs_show_is_where_the_site_serves_it():
    """An image in docs/ is a file under docs/ (the site cannot reach experiments/), and a
    copy of an experiment's figure is that figure: rerun the experiment, copy it again
    (cp experiments/results/NAME.png docs/img/)."""
    shown = 0
    for name, text in [*PAGES.items(), *(("dev/" + k, v) for k, v in DEV.items())]:
        for target in IMAGE.findall(text):
            assert "://" not in target, f"docs/{name}: {target} is not served by the site"
            path = (ROOT / "docs" / name).parent / target
            assert path.resolve().is_relative_to(ROOT / "docs"), f"docs/{name}: {target}"
            assert path.is_file(), f"docs/{name} shows {target}, which is not there"
            shown += 1
    for target in IMAGE.findall(README):
        assert (ROOT / target).is_file(), f"README.md shows {target}, which is not there"
    assert shown
    for copy in (ROOT / "docs" / "img").glob("*.png"):
        figure = ROOT / "experiments" / "results" / copy.name
        if figure.exists():
            assert copy.read_bytes() == figure.read_bytes(), f"cp {figure} {copy}"


@pytest.mark.unit
def test_the_performance_page_is_a_guide_and_the_log_is_out_of_the_navigation():
    """Users read the defaults and the current numbers; how they were found is docs/dev/."""
    page = PAGES["performance.md"]
    assert len(page.splitlines()) <= 120, "move investigations to docs/dev/performance-log.md"
    assert not re.search(r"^#+ .*\d{4}-\d\d-\d\d|\bissue \d+", page, re.M | re.I)
    assert "dev/performance-log.md" in page
    config = (ROOT / "mkdocs.yml").read_text()
    nav = re.search(r"^nav:\n(?:[ -].*\n)+", config, re.M)
    assert nav and "performance.md" in nav.group(0) and "dev/" not in nav.group(0)
    assert re.search(r"^not_in_nav: \|\n\s+/dev/$", config, re.M)


@pytest.mark.unit
def test_no_page_prints_a_figure_instead_of_showing_it():
    for name, text in PAGES.items():
        assert "(Figure:" not in text, f"docs/{name}: show the figure, ![what](img/NAME.png)"


def test_models_page_speed_table_quotes_the_benchmark_results():
    table = _bench_table("llama")
    assert table.startswith("| stage | jaxzero ms |"), table
    assert table in (ROOT / "docs" / "models.md").read_text(), table


@pytest.mark.unit
def test_lora_page_quotes_the_memory_and_speed_results():
    """docs/lora.md's tables are experiments/results/lora_memory.md's and qlora_loss.md's
    (the scripts' runs)."""
    results = (ROOT / "experiments" / "results" / "lora_memory.md").read_text().strip()
    qlora = (ROOT / "experiments" / "results" / "qlora_loss.md").read_text().strip()
    page = (ROOT / "docs" / "lora.md").read_text()
    for table in [*results.split("\n\n"), qlora]:
        assert table.startswith("| ") and table in page, table[:80]


# pages whose python blocks run in order in one fresh Python, and what they must print
FRESH = {
    "models.md": ["(16, 1)", "loss "],
    "lora.md": ["params train, ", "loss ", "4 layers/"],
    "planning.md": ["first choice: stage 3", "stage=3"],
    "runs.md": ["restored step 0 first"],
}
# every python block of these runs in a test below; on any other page each block says on
# the line above it that a named test of this module runs it, or why nothing does
EXECUTED = {"README.md", "getting-started.md", *FRESH}


def _as_a_reader(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python started in the repository root on a CPU-only machine:
    one CPU device, nothing simulated (this process's XLA_FLAGS simulate 8)."""
    env = _procs.child_env()
    env["JAX_PLATFORMS"] = "cpu"
    return _procs.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


NOT_RUN = re.compile(r"^<!-- not run: \S.* -->$")
RUN_BY = re.compile(r"^<!-- run by tests/test_docs.py::(\w+) -->$")


def _python_block_marks(text: str) -> list[str]:
    """The line above each python block of ``text``."""
    lines = text.splitlines()
    return [lines[i - 1].strip() if i else "" for i, x in enumerate(lines) if x == "```python"]


@pytest.mark.unit
def test_every_python_block_in_the_docs_runs_in_a_test_or_says_why_not():
    for name, text in [("README.md", README), *PAGES.items()]:
        for mark in _python_block_marks(text):
            marked = NOT_RUN.match(mark) or RUN_BY.match(mark)
            if name in EXECUTED:
                assert not marked, f"{name}: a test runs all its blocks; drop the mark {mark!r}"
            else:
                assert marked, (
                    f"{name} has a python block no test runs: run it in tests/test_docs.py "
                    "and say so above it (<!-- run by tests/test_docs.py::TEST -->), or "
                    "mark it <!-- not run: why -->"
                )
            run_by = RUN_BY.match(mark)
            if run_by:
                assert callable(globals().get(run_by.group(1))), f"{name}: no test {mark!r}"
    # README's runner executes the library section: no python block may sit elsewhere
    assert len(_blocks(_section("The library in"), "python")) == len(_blocks(README, "python"))


def test_getting_started_runs_in_a_fresh_python():
    """The page's blocks, pasted in order into a fresh Python (it simulates its own 4 CPU
    devices), print what the page shows."""
    page = PAGES["getting-started.md"]
    proc = _as_a_reader("\n".join(_blocks(page, "python")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = "".join(_blocks(page, ""))
    printed = proc.stdout
    for line in shown.splitlines():  # every line shown but the losses, as printed
        if "loss" not in line:
            assert line in printed.splitlines(), f"{line!r} not in:\n{printed}"
    assert _losses(shown) and len(_losses(printed)) == len(_losses(shown))
    np.testing.assert_allclose(_losses(printed), _losses(shown), rtol=0.05, atol=5e-4)


@pytest.mark.parametrize("page", sorted(FRESH))
def test_docs_pages_code_runs_in_a_fresh_python(page):
    """Every python block of a docs/ page, pasted in order into one fresh Python (one
    process a page, not a block), from the repo root: a page that needs devices this
    test process simulates, and the reader's would not, fails here."""
    blocks = _blocks((ROOT / "docs" / page).read_text(), "python")
    assert blocks, f"docs/{page} has no python blocks"
    proc = _as_a_reader("\n".join(blocks))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(p in proc.stdout for p in FRESH[page]), proc.stdout


def test_stages_page_own_loop_example_trains(capsys):
    """The pure-step example of docs/stages.md (the page's other blocks are fragments)."""
    section = re.search(r"^## Your own loop.*?(?=^## |\Z)", PAGES["stages.md"], re.S | re.M)
    assert section, "docs/stages.md has no section '## Your own loop'"
    (example,) = _blocks(section.group(0), "python")
    namespace: dict = {}
    exec(compile(example, "docs/stages.md", "exec"), namespace)
    out = capsys.readouterr().out
    losses = _losses(out)
    assert len(losses) == 2 and losses[1] < losses[0] and "step 20 loss" in out
    assert namespace["ema"]["w1"].shape == (37, 53)


def test_stages_page_ema_example_runs(capsys):
    """The EMA example of docs/stages.md: a warmup schedule, evaluated and read back."""
    section = re.search(r"^## An EMA of the weights.*?(?=^## |\Z)", PAGES["stages.md"], re.S | re.M)
    assert section, "docs/stages.md has no section '## An EMA of the weights'"
    (example,) = _blocks(section.group(0), "python")
    namespace: dict = {}
    exec(compile(example, "docs/stages.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert re.fullmatch(r"live \d\.\d{3}, EMA \d\.\d{3}\n", out), out
    assert namespace["ema"]["w"].shape == (16, 4)


def test_data_page_model_state_example_runs(capsys):
    """The state-form loss of docs/data.md: a synchronised BatchNorm convnet at stage 3 on
    this process's 8 devices, evaluated with its running statistics."""
    section = re.search(r"^## The loss contract.*?(?=^## |\Z)", PAGES["data.md"], re.S | re.M)
    assert section, "docs/data.md has no section '## The loss contract'"
    (example,) = _blocks(section.group(0), "python")
    namespace: dict = {}
    exec(compile(example, "docs/data.md", "exec"), namespace)
    out = capsys.readouterr().out
    match = re.fullmatch(
        r"train loss (\d\.\d{3}), eval loss (\d\.\d{3}), running mean \(8,\)\n", out
    )
    assert match, out
    assert match.group(1) != match.group(2)  # eval uses the running statistics
    assert namespace["engine"].batch_axes == ("data",)


def test_readme_library_example_runs_as_written_on_one_cpu_device():
    """Pasted into a fresh Python on a CPU-only machine (one device, nothing simulated), the
    example runs and prints the losses README shows."""
    section = _section("The library in")
    example = _blocks(section, "python")[0]
    printed = _blocks(section, "")[0]
    proc = _as_a_reader(example, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _losses(proc.stdout) == _losses(printed)


@pytest.mark.unit
def test_docs_links_point_at_pages_that_exist():
    """README's links into docs/, and the pages' links to each other."""
    dev = [("dev/" + k, v) for k, v in DEV.items()]
    for name, text in [("README.md", README), *PAGES.items(), *dev]:
        base = ROOT if name == "README.md" else (ROOT / "docs" / name).parent
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (base / target).is_file(), f"{name} links to {target}"


def test_the_docs_site_builds_strictly(tmp_path):
    """mkdocs (the docs extra) builds every page and the API reference without a warning:
    a broken link or a docstring mkdocstrings cannot read fails here."""
    import shutil

    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    if not Path(mkdocs).exists():
        pytest.skip("mkdocs not installed: pip install -e '.[docs]'")
    done = _procs.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()
