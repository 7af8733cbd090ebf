"""Stage 3's step over plain jit as the batch grows: what is fixed per step, what scales.

``user_gpt`` (the zoo's pytree GPT, 2 simulated devices, fp32 AdamW) at 4, 8, 16, 32 and
64 rows per device (global batch 8 to 128 x 128 tokens): each batch in its own process of
``bench_step.py`` (contestants interleaved step by step), and once more under the
profiler for each stage's kernel time by kind. A fixed cost per step shows as a ratio
that falls as the batch grows; one that scales stays flat.

    python -m experiments.stage3_curve              # about 10 minutes on 2 cores
    python -m experiments.stage3_curve --rows 4 8 --no-profile

Writes ``experiments/results/stage3_curve.csv`` and ``stage3_curve.png``.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

from experiments.results_io import read_csv, write_csv

HERE = pathlib.Path(__file__).parent
CSV = HERE / "results" / "stage3_curve.csv"
PNG = HERE / "results" / "stage3_curve.png"
DEVICES = 2
KINDS = ("collectives", "dots", "copies/transposes", "other")


def _bench(extra: list[str], timeout: int = 1800) -> str:
    cmd = [sys.executable, "-m", "experiments.bench_step", "--model", "user_gpt", *extra]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent, check=True
    )
    return done.stdout


def timed(rows: int, stages: list[int], runs: int, steps: int) -> list[dict]:
    """Per stage: jaxzero's median step over the faster plain-jit step, over ``runs``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "runs.csv"
        _bench([
            "--devices", str(DEVICES), "--batch", str(rows * DEVICES), "--runs", str(runs),
            "--steps", str(steps), "--stages", *map(str, stages), "--csv", str(out),
        ])  # fmt: skip
        got = read_csv(out)
    result = []
    for s in stages:
        mine = [r for r in got if r["stage"] == s]
        jit = [min(r["jit_donate_ms"], r["jit_no_donate_ms"]) for r in mine]
        ratio = [r["jaxzero_ms"] / j for r, j in zip(mine, jit, strict=True)]
        result.append(
            {
                "rows_per_device": rows,
                "global_batch": rows * DEVICES,
                "stage": s,
                "jaxzero_ms": round(statistics.median(r["jaxzero_ms"] for r in mine), 1),
                "plain_jit_ms": round(statistics.median(jit), 1),
                "ratio": round(statistics.median(ratio), 3),
            }
        )
    return result


def profiled(rows: int, stages: list[int]) -> dict[str, dict[str, float]]:
    """Kernel ms per device per step by kind, per contestant (``bench_step --profile``)."""
    text = _bench([
        "--devices", str(DEVICES), "--batch", str(rows * DEVICES), "--runs", "2",
        "--steps", "3", "--stages", *map(str, stages), "--profile",
    ])  # fmt: skip
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(plain jit, donate=\w+|jaxzero \d)\s+([\d.]+)\s+" + r"\s+".join(
            [r"([\d.]+)"] * (len(KINDS) + 1)) + r"\s*$", line)  # fmt: skip
        if m:
            vals = [float(v) for v in m.groups()[1:]]
            out[m.group(1)] = {"wall": vals[0], **dict(zip(KINDS, vals[1:], strict=False))}
    return out


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for s in sorted({r["stage"] for r in rows}):
        mine = [r for r in rows if r["stage"] == s]
        ax.plot([r["rows_per_device"] for r in mine], [r["ratio"] for r in mine], "o-",
                label=f"stage {s}")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.15, color="red", lw=0.8, ls="--", label="stage 3 target 1.15")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per device (2 devices, 128 tokens a row)")
    ax.set_ylabel("jaxzero step / plain jit")
    ax.set_title("user_gpt on XLA:CPU: jaxzero over plain jit by batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for n in args.rows:
        got = timed(n, args.stages, args.runs, args.steps)
        kinds = {} if args.no_profile else profiled(n, args.stages)
        for r in got:
            for kind, ms in kinds.get(f"jaxzero {r['stage']}", {}).items():
                r[f"{kind}_ms"] = ms
            print(r, flush=True)
        rows += got
    write_csv(CSV, rows)
    plot(rows)
    print(f"wrote {CSV} and {PNG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
