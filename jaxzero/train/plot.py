"""``jaxzero plot``: loss curves of one or more runs, overlaid, as a PNG.

Each run directory holds ``metrics.jsonl`` and the resolved ``config.yaml``
that ``jaxzero train`` wrote; the config supplies the legend (ZeRO stage and
device count), because the question these plots answer is usually "do stage 0
and stage 3 train the same model?". Curves are drawn against steps and against
tokens, so runs with different batch sizes compare fairly too.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jaxzero import cli
from jaxzero.cli import Parser, output_problem
from jaxzero.errors import Error
from jaxzero.train.rundir import METRICS_FILE, read_jsonl

CONFIG_FILES = ("config.yaml", "config.json")


class PlotError(Error, ValueError):
    """A run directory that cannot be plotted; one-line message."""


@dataclass(frozen=True)
class Run:
    """The curves of one run and its label."""

    label: str
    steps: list[int]
    tokens: list[int]
    loss: list[float | None]
    val_steps: list[int]
    val_tokens: list[int]
    val_loss: list[float]


def read_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config as a plain dict (empty if the run has none)."""
    for name in CONFIG_FILES:
        if (run_dir / name).is_file():
            return yaml.safe_load((run_dir / name).read_text()) or {}
    return {}


def label(run_dir: Path, config: dict[str, Any]) -> str:
    """``"NAME (stage 3, 8 dev)"`` from the resolved config."""
    parallel = config.get("parallel") or {}
    name = (config.get("logging") or {}).get("name") or run_dir.name
    parts = []
    if parallel.get("stage") is not None:
        parts.append(f"stage {parallel['stage']}")
    if parallel.get("devices") is not None:
        parts.append(f"{parallel['devices']} dev")
    return f"{name} ({', '.join(parts)})" if parts else name


def load_run(run_dir: str | Path) -> Run:
    """Reads a run directory's metrics and config."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{str(run_dir)!r} is not a run directory: no {METRICS_FILE}")
    records = read_jsonl(path)
    if not records:
        raise PlotError(f"{str(path)!r} holds no records")
    vals = [r for r in records if r.get("val_loss") is not None]
    return Run(
        label=label(run_dir, read_config(run_dir)),
        steps=[r["step"] for r in records],
        tokens=[r.get("tokens", 0) for r in records],
        loss=[r.get("loss") for r in records],
        val_steps=[r["step"] for r in vals],
        val_tokens=[r.get("tokens", 0) for r in vals],
        val_loss=[r["val_loss"] for r in vals],
    )


def plot_runs(runs: list[Run], out: Path, title: str | None = None) -> Path:
    """Draws train (solid) and validation (dashed, markers) loss against steps and tokens."""
    # Here, not at the top: pyplot takes 1.5 s to import (measured beside `import jaxzero`),
    # which `jaxzero plot --help` and a bad run path need not pay, and choosing the Agg
    # backend at import would change it for any program that imports this module.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        for ax, x, vx in (
            (axes[0], run.steps, run.val_steps),
            (axes[1], run.tokens, run.val_tokens),
        ):
            ax.plot(x, run.loss, color=color, lw=1.2, label=f"{run.label} train")
            if run.val_loss:
                ax.plot(
                    vx,
                    run.val_loss,
                    color=color,
                    ls="--",
                    marker="o",
                    ms=3,
                    label=f"{run.label} val",
                )
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("tokens")
    for ax in axes:
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "jaxzero loss curves")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out


def default_output(run_dirs: list[str]) -> Path:
    """``RUN_DIR/loss.png`` for one run, ``loss.png`` here for several."""
    return Path(run_dirs[0]) / "loss.png" if len(run_dirs) == 1 else Path("loss.png")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``jaxzero plot``; returns the exit status."""
    parser = Parser(
        prog="jaxzero plot",
        description="Plot train/validation loss of runs written by "
        "'jaxzero train', overlaid and labelled by ZeRO stage and device count.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "-o",
        "--output",
        help="PNG path (default: RUN_DIR/loss.png for one run, ./loss.png for several)",
    )
    parser.add_argument("--title", help="figure title")

    def body(args: argparse.Namespace) -> None:
        runs = [load_run(d) for d in args.run_dirs]
        out = Path(args.output) if args.output else default_output(args.run_dirs)
        problem = output_problem(out)
        if problem:
            raise PlotError(f"cannot write {str(out)!r}: {problem}; choose another -o PATH")
        plot_runs(runs, out, args.title)
        print(f"wrote {out}")

    # OSError: the disk filled up, or the path changed under us
    return cli.run("plot", parser.parse_args, body, argv, also=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
