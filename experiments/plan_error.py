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

CANDIDATES = [(0, "none"), (3, "none"), (3, "full"), (1, "dots")]
RESULTS = Path(__file__).parent / "results" / "plan_error.csv"


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(stage: int, remat: str) -> dict:
    """Plan, then run, one candidate in this process (8 simulated devices)."""
    from jaxzero.mesh import simulate_devices

    simulate_devices(8)
    import jax

    from jaxzero.accounting.planner import HARDWARE, Candidate, Planner
    from jaxzero.mesh import make_mesh
    from jaxzero.train import config as C
    from jaxzero.train import data as data_lib
    from jaxzero.train import planning

    cfg = C.override(C.override(C.Config(), "model.vocab_size", 256), "data.max_bytes", 400_000)
    corpus = data_lib.load_corpus(cfg.data, 256, "none")
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
    for _ in range(12):
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
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", nargs=2, metavar=("STAGE", "REMAT"))
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1])))
        return
    rows = []
    for stage, remat in CANDIDATES:
        cmd = [sys.executable, "-m", "experiments.plan_error", "--one", str(stage), remat]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
