"""ZeRO++'s quantized collectives against exact ones: the validation loss of a default run.

The default ``jaxzero train`` (a byte-level GPT, 4 layers x 128, on Python's standard
library, stage 3 on 8 simulated CPU devices, fp32, AdamW) trained ``--steps`` steps
four ways, each in a fresh process with the same seed and data: exact collectives,
qwZ + qgZ int8 (``--set zero.qwz=true --set zero.qgz=int8``), qwZ + qgZ int4 at the
default block of 2048 and at 256 (``--set zero.quant_block=256``). Printed
and written (``experiments/results/zeropp_loss.csv`` row by row, ``zeropp_loss.md``): the
final train and validation loss of each, the validation loss's gap to the exact run's,
and the training time (the machine is shared: a ratio, not a speed claim).

    python -m experiments.zeropp_loss                # 300 steps each: ~4 minutes, 2 cores
    python -m experiments.zeropp_loss --steps 20 --out /tmp/z   # a quick look
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxzero.mesh import simulate_devices

simulate_devices(8)  # so the rows' environment columns record the runs' 8 devices

from experiments.results_io import write_csv  # noqa: E402

RESULTS = Path(__file__).parent / "results"

VARIANTS = {  # name: (run directory, settings)
    "exact": ("exact", []),
    "qwZ + qgZ int8": ("q8", ["zero.qwz=true", "zero.qgz=int8"]),
    "qwZ + qgZ int4": ("q4", ["zero.qwz=true", "zero.qgz=int4"]),
    "qwZ + qgZ int4, blocks of 256": (
        "q4b256",
        ["zero.qwz=true", "zero.qgz=int4", "zero.quant_block=256"],
    ),
}


def run(name: str, settings: list[str], steps: int, root: Path) -> dict:
    """One ``jaxzero train`` in a fresh process; its summary.json."""
    label = VARIANTS[name][0]
    cmd = [sys.executable, "-m", "jaxzero.train", "--steps", str(steps)]
    cmd += ["--set", f"logging.root={root}", "--set", f"logging.name={label}"]
    cmd += ["--set", "logging.sample_tokens=0", "--set", "logging.progress=none"]
    cmd += ["--set", "checkpoint.final=false"]
    for s in settings:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: jaxzero train failed:\n{proc.stderr[-2000:]}")
    return json.loads((root / label / "summary.json").read_text())


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=RESULTS, help="where the CSV and table go")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "zeropp_loss.csv"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            s = run(name, VARIANTS[name][1], args.steps, Path(tmp))
            exact = rows[0]["val_loss"] if rows else s["final_val_loss"]
            row = {
                "variant": name,
                "steps": args.steps,
                "train_loss": round(s["final_loss"], 4),
                "val_loss": round(s["final_val_loss"], 4),
                "val_gap": round((s["final_val_loss"] - exact) / exact, 5),
                "train_s": round(s["train_s"], 1),
            }
            rows.append(row)
            write_csv(csv_path, rows)  # after each run: a crash keeps what was measured
            print(row, flush=True)
    lines = [
        "| collectives | train loss | val loss | val gap to exact | training s (x exact) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | "
            f"{100 * r['val_gap']:+.2f}% | {r['train_s']:.1f} "
            f"({r['train_s'] / rows[0]['train_s']:.2f}) |"
        )
    table = "\n".join(lines)
    print(table)
    (args.out / "zeropp_loss.md").write_text(
        f"Default `jaxzero train`, {args.steps} steps, stage 3 on 8 simulated CPU devices "
        "(`python -m experiments.zeropp_loss`):\n\n" + table + "\n"
    )
    return rows


if __name__ == "__main__":
    main()
