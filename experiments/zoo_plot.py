"""The zoo's results as docs/performance.md shows them: a narrow table and a plot.

Reads what ``bench_step.py --table`` prints for a ``--zoo`` CSV (that script owns the
ratios and the targets), prints the table's first columns and draws jaxzero's step over
the faster plain-jit step per model and stage (median, range over invocations, target):

    python -m experiments.zoo_plot                        # prints the table, writes the plot
    python -m experiments.zoo_plot --table-only
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
CSV = HERE / "results" / "bench_step_zoo.csv"
PNG = HERE.parent / "docs" / "img" / "zoo.png"
COLUMNS = ("model", "stage", "jaxzero ms", "vs plain jit", "target")


def wide_table(csv: pathlib.Path) -> str:
    """``bench_step.py --table csv``, run as a reader runs it."""
    cmd = [sys.executable, "-m", "experiments.bench_step", "--table", str(csv)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=True, timeout=120, cwd=HERE.parent
    )
    return done.stdout.split("\n\ntargets:")[0].strip("\n")


def rows(table: str) -> list[dict[str, str]]:
    """A markdown table's body rows as dicts keyed by its header."""
    lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()]
    return [dict(zip(lines[0], cells, strict=True)) for cells in lines[2:]]


def narrow_table(table: str) -> str:
    """The docs' table: :data:`COLUMNS` of the wide one."""
    out = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    out += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows(table)]
    return "\n".join(out)


def plot(table: str, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rows(table)
    models = list(dict.fromkeys(r["model"] for r in data))
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    for i, r in enumerate(data):
        med, lo, hi = map(float, re.findall(r"\d+\.\d+", r["vs plain jit"]))
        x = models.index(r["model"]) * 5 + int(r["stage"])
        ax.errorbar(x, med, yerr=[[med - lo], [hi - med]], fmt="o", color=f"C{r['stage']}",
                    label=f"stage {r['stage']}" if i < 4 else None)  # fmt: skip
        ax.hlines(float(r["target"].split()[0]), x - 0.4, x + 0.4, color="grey", lw=1)
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xticks([m * 5 + 1.5 for m in range(len(models))], models)
    ax.set_ylabel("step / plain jit step")
    ax.set_title("jaxzero's step over plain jax.jit (grey: target), XLA:CPU", fontsize=10)
    ax.set_ylim(top=1.38)
    ax.legend(ncol=4, fontsize=8, loc="upper left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", type=pathlib.Path, default=CSV)
    p.add_argument("--png", type=pathlib.Path, default=PNG)
    p.add_argument("--table-only", action="store_true", help="print the table, draw nothing")
    args = p.parse_args(argv)
    table = wide_table(args.csv)
    print(narrow_table(table))
    if not args.table_only:
        plot(table, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
