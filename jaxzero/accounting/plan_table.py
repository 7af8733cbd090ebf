"""The planner's table (:class:`~jaxzero.accounting.planner.Survey`), as text."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxzero.accounting.estimate import format_bytes

if TYPE_CHECKING:
    from jaxzero.accounting.planner import Row, Survey

_HEAD = (
    "rank", "stage", "remat", "mb", "state/dev", "peak/dev", "margin", "sent in/across group",
    "FLOP/dev", "roofline", "largest batch",
)  # fmt: skip


def _time(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _cells(rank: str, r: Row, budget: float) -> list[str]:
    c = r.candidate
    return [
        rank,
        str(c.stage),
        c.remat,
        str(c.micro_batches),
        format_bytes(r.persistent),
        format_bytes(r.peak),
        format_bytes(budget - r.peak),
        f"{format_bytes(r.intra)} / {format_bytes(r.inter)}",
        f"{r.flops:.3g}",
        _time(r.predicted_s),
        "" if r.max_batch is None else f"{r.max_batch:,}",
    ]


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]


def format_survey(s: Survey) -> str:
    """The ranked table of what fits, then what did not and why, then the first choice."""
    hw = s.hardware
    lines = [s.title] if s.title else []
    budget = f"budget   {format_bytes(s.budget)} per device"
    budget += f" ({s.budget_note})" if s.budget_note else ""
    if s.headroom:
        budget += (
            f"; a step is held to {format_bytes(s.held)}, {s.headroom:.0%} kept free "
            "(zero.headroom)"
        )
    lines += [
        budget,
        f"roofline {hw.name}: {hw.flops:.3g} FLOP/s per device, sends {format_bytes(hw.intra)}/s "
        f"within a group of {s.group}, {format_bytes(hw.inter)}/s across; step time = "
        "max(compute, communication)",
        "",
    ]  # fmt: skip
    fit = s.fitting()
    if fit:
        lines += _grid([list(_HEAD)] + [_cells(str(i + 1), r, s.held) for i, r in enumerate(fit)])
    else:
        lines.append("nothing fits")
    over = [r for r in s.rows if r.status == "over"]
    if over:
        lines += ["", "compiled, over the budget:"]
        lines += _grid([list(_HEAD)] + [_cells("-", r, s.held) for r in over])
    pruned: dict[int, str] = {}
    for r in (r for r in s.rows if r.status == "pruned"):  # the formulas judge a stage
        pruned.setdefault(r.candidate.stage, r.why)
    for stage, why in pruned.items():
        lines.append(f"not compiled: stage {stage}, any remat and micro-batches: {why}")
    for r in (r for r in s.rows if r.status == "failed"):
        lines.append(f"failed to compile: {r.candidate.describe()}: {r.why}")
    skipped = [r for r in s.rows if r.status == "skipped"]
    if skipped:
        lines.append(
            f"{len(skipped)} candidate(s) with more micro-batches than needed not compiled "
            "(--all compiles them)"
        )
    lines += s.notes
    best = s.best()
    if best is not None:
        lines += ["", f"first choice: {best.candidate.describe()}: {best.candidate.flags()}"]
    return "\n".join(lines)
