"""How far off is the planner? Its compiled peak and roofline time against what runs.

For candidates of the default ``jaxzero train`` GPT (8 simulated CPU devices, global
batch 32 x 64, fp32 AdamW), each in a fresh process: the planner's peak per device
(the compiled step's ``memory_analysis``), what the backend reports after running
(``memory_stats()``: XLA:CPU reports nothing), and the host's resident-set growth while
the state is created and five steps run (``VmHWM`` after ``clear_refs``, against the
planner's peak summed over the 8 devices that live in that memory); then the step time
measured (median of 10) against the roofline's prediction with the CPU's nominal figures.

    python -m experiments.plan_error          # about 2 minutes on 2 cores
    python -m experiments.plan_error --one 3 none   # one candidate (what each process runs)
    python -m experiments.plan_error --table        # the CSV as docs/planning.md shows it

Writes ``experiments/results/plan_error.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.results_io import environment, write_csv

CANDIDATES = [(0, "none"), (3, "none"), (3, "full"), (1, "dots")]
RESULTS = Path(__file__).parent / "results" / "plan_error.csv"


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


# SmolLM2-135M's shapes (a Llama: 30 layers of 576, 9 heads, 3 key/value heads, tied
# 49,152-token vocabulary) at 8 x 256 tokens in bf16: the model of issue 35's OOM
SMOLLM = [
    "model.arch=llama", "model.d_model=576", "model.n_layers=30", "model.n_heads=9",
    "model.n_kv_heads=3", "model.d_ff=1536", "model.vocab_size=49152", "model.seq_len=256",
    "precision.compute=bf16", "train.batch_size=8",
]  # fmt: skip


def one(stage: int, remat: str, sets: list[str] = (), steps: int = 12) -> dict:
    """Plan, then run, one candidate in this process (8 simulated devices)."""
    from jaxzero.mesh import simulate_devices

    simulate_devices(8)
    import jax

    from jaxzero.accounting.planner import HARDWARE, Candidate, Planner
    from jaxzero.mesh import make_mesh
    from jaxzero.train import config as C
    from jaxzero.train import data as data_lib
    from jaxzero.train import planning

    cfg = C.apply_overrides(C.Config(), ["model.vocab_size=256", "data.max_bytes=400000", *sets])
    corpus = data_lib.load_corpus(cfg.data, cfg.model.vocab_size, "none")
    mesh = make_mesh(8)
    cands = planning.Candidates(cfg, mesh, planning.first_batch(cfg, corpus))
    c = Candidate(stage, remat, 1, cfg.train.batch_size)
    hw = HARDWARE["cpu"]
    row = Planner(cands, 1e12, hw, 8).row(c)
    model, engine = cands.built[c]
    loader = data_lib.Loader(corpus.train, cfg.model.seq_len, c.batch, 0)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again here
    base = _vm("VmRSS")
    state = engine.init_from(model.init, jax.random.key(0))
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        state, metrics = engine.step(state, next(loader))
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - begin)
    grown = _vm("VmHWM") - base
    stats = jax.local_devices()[0].memory_stats()
    return {
        "stage": stage,
        "remat": remat,
        "planned_peak_per_device": row.peak,
        "planned_peak_x8": 8 * row.peak,
        "backend_peak_bytes_in_use": (stats or {}).get("peak_bytes_in_use"),
        "rss_growth": grown,
        "rss_growth_over_planned_x8": round(grown / (8 * row.peak), 2),
        "predicted_ms": round(row.predicted_s * 1e3, 1),
        "measured_ms": round(statistics.median(times[2:]) * 1e3, 1),
        "measured_over_predicted": round(statistics.median(times[2:]) / row.predicted_s, 2),
        "model": "smollm2-135m-shapes" if sets else "default-gpt",
    }


def _ms(x: float) -> str:
    return f"{x:.1f} ms" if x < 1000 else f"{x / 1000:.1f} s"


def table(path: Path = RESULTS) -> str:
    """docs/planning.md's table of the CSV (a test keeps the page equal to it)."""
    from jaxzero.accounting.estimate import format_bytes

    head = (
        "| model: stage, remat | planned peak × 8 | host RSS growth | ratio | roofline "
        "| measured step | ratio |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [head]
    with path.open() as f:
        for r in csv.DictReader(f):
            name = "SmolLM2-135M's shapes" if r["model"].startswith("smollm") else "GPT 0.8M"
            lines.append(
                f"| {name}: {r['stage']}, {r['remat']} "
                f"| {format_bytes(float(r['planned_peak_x8']))} "
                f"| {format_bytes(float(r['rss_growth']))} "
                f"| {float(r['rss_growth_over_planned_x8']):.2f} "
                f"| {_ms(float(r['predicted_ms']))} | {_ms(float(r['measured_ms']))} "
                f"| {float(r['measured_over_predicted']):.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", action="store_true", help="print docs/planning.md's table")
    p.add_argument("--one", nargs=2, metavar=("STAGE", "REMAT"))
    p.add_argument("--smollm", action="store_true", help="SmolLM2-135M's shapes, 3 steps")
    args = p.parse_args()
    if args.table:
        print(table())
        return
    if args.one:
        sets, steps = (SMOLLM, 3) if args.smollm else ([], 12)
        # the row records the environment it was measured in (this process's devices)
        print(json.dumps(one(int(args.one[0]), args.one[1], sets, steps) | environment()))
        return
    rows = []
    runs = [(s, r, []) for s, r in CANDIDATES] + [(3, "full", ["--smollm"])]
    for stage, remat, extra in runs:
        cmd = [sys.executable, "-m", "experiments.plan_error", "--one", str(stage), remat, *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    write_csv(RESULTS, rows)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
