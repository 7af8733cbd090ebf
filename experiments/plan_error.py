"""How far off is the planner? Its compiled peak against what a whole run really holds.

For candidates of two models, each a real ``jaxzero train`` run in a fresh process on 8
simulated CPU devices (the pre-flight on; 3 steps, an evaluation and a checkpoint):

- the default GPT (0.8M params, fp32, global batch 32 x 64): every stage x remat, two
  micro-batch counts, bf16;
- a fine-tune of SmolLM2-135M's shape (random bf16 weights written by ``transformers``:
  ``experiments/smollm_checkpoint.py``; 400 prompt/completion lines, global batch 32 x
  256, bf16): stages x remats that fit this 24 GB host, micro-batches, fp32, and LoRA.

Each row compares what the run held with what the planner counted for it:
**measured** is the process's resident-set growth from just before the state is created
or loaded to its peak (the run's memory guard samples it: summary.json's
``host_resident_start`` and ``host_resident_peak``): loading, init, steps, evaluation,
checkpoint; **planned** is the compiled peak per device (summary.json's
``planned_peak_bytes_per_device``, the larger of the step's and the evaluation's) on the 8
devices that live in that memory, plus a checkpoint's host copy of the state
(``state_bytes``), as the CPU budget counts them. XLA:CPU reports no
``memory_stats()``; on a GPU the comparison is ``peak_bytes_in_use`` (gpu_check).

    python -m experiments.plan_error --smollm /tmp/smollm   # about 25 minutes on 2 cores
    python -m experiments.plan_error                        # the GPT rows only
    python -m experiments.plan_error --table                # the CSV as docs/planning.md shows it
    python -m experiments.plan_error --smollm /tmp/smollm --keep  # only the rows not in the CSV

Writes ``experiments/results/plan_error.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.results_io import environment, write_csv

RESULTS = Path(__file__).parent / "results" / "plan_error.csv"
# the planned peak itself is measured here, not the margin: no headroom refuses a row
COMMON = ["--steps", "3", "--devices", "8", "--set", "logging.sample_tokens=0",
          "--set", "logging.eval_every=3", "--set", "logging.eval_batches=1",
          "--set", "logging.progress=none", "--set", "zero.headroom=0"]  # fmt: skip

# (label, stage, remat, micro-batches, extra flags)
GPT = [
    *[("fp32", s, r, 1, []) for s in (0, 1, 2, 3) for r in ("none", "dots", "full")],
    ("fp32", 1, "none", 2, []),
    ("fp32", 3, "dots", 2, []),
    ("bf16", 0, "none", 1, ["--precision", "bf16"]),
    ("bf16", 3, "none", 1, ["--precision", "bf16"]),
]
SMOLLM = [  # what fits this 24 GB host (jaxzero plan: stage 0 and remat none do not)
    ("bf16", 3, "dots", 1, []),  # zero.auto's choice here
    ("bf16", 3, "full", 1, []),
    ("bf16", 2, "full", 1, []),
    ("bf16", 1, "full", 1, []),
    ("bf16", 3, "none", 2, []),
    ("fp32", 3, "full", 1, ["--precision", "fp32"]),
    ("LoRA r16 bf16", 3, "dots", 1, ["--set", "lora.rank=16"]),  # a LoRA run's activations
    ("LoRA r16 bf16", 3, "full", 1, ["--set", "lora.rank=16"]),  # are a full run's
]


def run(model: str, label: str, stage: int, remat: str, mb: int, extra: list[str],
        smollm: Path | None) -> dict:  # fmt: skip
    """One ``jaxzero train`` in a fresh process; its summary's memory figures."""
    with tempfile.TemporaryDirectory() as root:
        argv = [sys.executable, "-m", "jaxzero.cli", "train", *COMMON, "--stage", str(stage),
                "--micro-batches", str(mb), "--set", f"model.remat={remat}",
                "--set", f"logging.root={root}", "--name", "r", *extra]  # fmt: skip
        if model == "smollm":
            assert smollm is not None
            argv += ["--init-from", f"hf:{smollm / 'model'}", "--data",
                     str(smollm / "chat.jsonl"), "--set", "model.seq_len=256"]  # fmt: skip
            if "--precision" not in extra:  # the fine-tune's bf16 unless the row says
                argv += ["--precision", "bf16"]
        else:
            argv += ["--set", "data.max_bytes=400000"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}\n{done.stderr[-2000:]}")
        s = json.loads((Path(root) / "r" / "summary.json").read_text())
    planned = 8 * s["planned_peak_bytes_per_device"] + s["state_bytes"]
    grown = s["host_resident_peak"] - s["host_resident_start"]
    return {
        "model": model,
        "run": label,
        "stage": stage,
        "remat": remat,
        "micro_batches": mb,
        "params": s["params"],
        "planned_peak_per_device": s["planned_peak_bytes_per_device"],
        "state_bytes": s["state_bytes"],
        "planned_total": planned,
        "rss_growth": grown,
        "measured_over_planned": round(grown / planned, 3),
    }


def _key(r: dict) -> tuple[str, ...]:
    return tuple(str(r[k]) for k in ("model", "run", "stage", "remat", "micro_batches"))


def table(path: Path = RESULTS) -> str:
    """docs/planning.md's table of the CSV (a test keeps the page equal to it)."""
    from jaxzero.accounting.estimate import format_bytes

    head = (
        "| model | run: stage, remat, micro-batches | planned: peak/dev × 8 + host copy "
        "| host RSS growth | measured / planned |\n| --- | --- | --- | --- | --- |"
    )
    lines = [head]
    with path.open() as f:
        for r in csv.DictReader(f):
            name = "SmolLM2-135M shape" if r["model"] == "smollm" else "GPT 0.8M"
            lines.append(
                f"| {name} | {r['run']}: {r['stage']}, {r['remat']}, {r['micro_batches']} "
                f"| {format_bytes(float(r['planned_peak_per_device']))} × 8 + "
                f"{format_bytes(float(r['state_bytes']))} = "
                f"{format_bytes(float(r['planned_total']))} "
                f"| {format_bytes(float(r['rss_growth']))} "
                f"| {float(r['measured_over_planned']):.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", action="store_true", help="print docs/planning.md's table")
    p.add_argument("--smollm", type=Path, metavar="DIR",
                   help="experiments/smollm_checkpoint.py's directory: its rows too")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the CSV's rows; run the others")
    args = p.parse_args()
    if args.table:
        print(table())
        return
    runs = [("gpt", *row) for row in GPT]
    if args.smollm is not None:
        runs += [("smollm", *row) for row in SMOLLM]
    kept = {}
    if args.keep and RESULTS.exists():
        with RESULTS.open() as f:
            kept = {_key(r): r for r in csv.DictReader(f)}
    rows = []
    RESULTS.parent.mkdir(exist_ok=True)
    for model, label, stage, remat, mb, extra in runs:
        key = _key(dict(model=model, run=label, stage=stage, remat=remat, micro_batches=mb))
        if key in kept:
            rows.append(kept[key])
            continue
        rows.append(run(model, label, stage, remat, mb, extra, args.smollm) | environment())
        print({k: rows[-1][k] for k in list(rows[-1])[:11]}, flush=True)
        write_csv(RESULTS, rows)  # each row as it comes: a later failure keeps them
    write_csv(RESULTS, rows)
    worst = max(rows, key=lambda r: float(r["measured_over_planned"]))
    print(
        f"wrote {RESULTS}; worst measured/planned {float(worst['measured_over_planned']):.2f} "
        f"({worst['model']} {worst['run']}, stage {worst['stage']}, {worst['remat']})"
    )


if __name__ == "__main__":
    main()
