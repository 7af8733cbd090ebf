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


_BEYOND = ("beyond ZeRO", "host/dev", "host link")  # columns when a candidate goes beyond


def _cells(
    rank: str, r: Row, budget: float, beyond: bool = False, split: bool = False
) -> list[str]:
    c = r.candidate
    cells = [
        rank,
        str(c.stage),
        c.remat,
        str(c.micro_batches),
        *([str(c.model)] if split else []),
        format_bytes(r.persistent),
        format_bytes(r.peak),
        format_bytes(budget - r.peak),
        f"{format_bytes(r.intra)} / {format_bytes(r.inter)}",
        f"{r.flops:.3g}",
        _time(r.predicted_s),
        "" if r.max_batch is None else f"{r.max_batch:,}",
    ]
    if beyond:
        link = f"{format_bytes(r.host_moved)} x2, {_time(r.host_s)}" if r.host_moved else "-"
        cells += [c.beyond() or "-", format_bytes(r.host) if r.host else "-", link]
    return cells


def _head(beyond: bool, split: bool = False) -> list[str]:
    head = list(_HEAD[:4]) + (["model"] if split else []) + list(_HEAD[4:])
    return head + (list(_BEYOND) if beyond else [])


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
    lines.append(budget)
    offload = any(r.candidate.offload for r in s.rows)
    if offload or s.host_budget is not None:
        host = (
            f"host     {format_bytes(s.host_budget)} per device for offloaded state ({s.host_note})"
            if s.host_budget is not None
            else f"host     the devices' own memory ({s.host_note})"
        )
        if s.host_budget is not None and s.headroom:
            host += f"; held to {format_bytes(s.host_held or 0)}"
        lines.append(host)
    tp = any(r.model_s for r in s.rows)  # a model axis' collectives in some step
    link = (
        f", moves offloaded state over a {format_bytes(hw.host_link)}/s host link each way"
        if offload and hw.host_link
        else ""
    )
    lines += [
        f"roofline {hw.name}: {hw.flops:.3g} FLOP/s per device, sends {format_bytes(hw.intra)}/s "
        f"within a group of {s.group}, {format_bytes(hw.inter)}/s across{link}; step time = "
        "max(compute, communication" + (", host transfers)" if link else ")")
        + (" + the model axis' collectives (not overlapped)" if tp else ""),
        "",
    ]  # fmt: skip
    fit = s.fitting()
    beyond = any(r.candidate.beyond() for r in s.rows if r.status in ("fits", "over"))
    split = any(r.candidate.model is not None for r in s.rows)  # model axes surveyed
    head = _head(beyond, split)
    if fit:
        lines += _grid(
            [head] + [_cells(str(i + 1), r, s.held, beyond, split) for i, r in enumerate(fit)]
        )
    else:
        lines.append("nothing fits")
    over = [r for r in s.rows if r.status == "over"]
    if over:
        lines += ["", "compiled, over the budget:"]
        lines += _grid([head] + [_cells("-", r, s.held, beyond, split) for r in over])
        lines += [f"  {r.candidate.describe()}: {r.why}" for r in over if "host" in r.why]
    pruned: dict[tuple[int, str, int | None], str] = {}
    for r in (r for r in s.rows if r.status == "pruned"):  # the formulas judge a stage
        c = r.candidate
        pruned.setdefault((c.stage, c.beyond(), c.model), r.why)
    for (stage, extra, model), why in pruned.items():
        with_ = f" with {extra}" if extra else ""
        axis = f", model axis {model}" if model is not None else ""
        lines.append(
            f"not compiled: stage {stage}{with_}{axis}, any remat and micro-batches: {why}"
        )
    for r in (r for r in s.rows if r.status == "failed"):
        lines.append(f"failed to compile: {r.candidate.describe()}: {r.why}")
    skipped = [r for r in s.rows if r.status == "skipped"]
    more = [r for r in skipped if not r.why.endswith("without offload")]
    if more:
        lines.append(
            f"{len(more)} candidate(s) with more micro-batches than needed not compiled "
            "(--all compiles them)"
        )
    if len(more) < len(skipped):
        lines.append(
            f"{len(skipped) - len(more)} offloaded candidate(s) not compiled: they fit without "
            "offload, which moves nothing over the host link (--all compiles them)"
        )
    lines += s.notes
    best = s.best()
    if best is not None:
        lines += ["", f"first choice: {best.candidate.describe()}: {best.candidate.flags()}"]
    return "\n".join(lines)
