"""Will it fit, and how fast? Candidate configurations compiled ahead of time, ranked.

For one model and one target (devices, bytes per device, a roofline), each candidate
(ZeRO stage x activation checkpointing x micro-batches, at a global batch) is built
with abstract shapes and compiled, allocating nothing: the compiled program's
``memory_analysis`` gives its peak bytes per device, its HLO the bytes each device
sends per step. A candidate fits when its peak is at most the budget less a headroom
(``headroom``: the share kept free for what the compiled step does not count: the
runtime, the allocator's slack, host buffers; ``zero.headroom``, measured in
docs/planning.md). Candidates whose persistent model states alone exceed that by
the ZeRO formulas (:func:`~jaxzero.accounting.estimate.model_state_bytes`, a lower
bound of the real bytes: padding and replicated small leaves only add) are pruned
before compiling. Frozen params (a LoRA run's base) count at their stored bytes, not
as trainable ones (:func:`param_split`): a frozen base counted at 16 bytes a param
would prune runs that fit. Those that fit are ranked by a stated roofline,
``max(FLOPs / device FLOP/s, bytes sent / link bandwidth)``, and the best few get
the largest global batch that fits, found on compiled peaks.

What builds a candidate is the caller's (:func:`survey`'s ``build``):
``jaxzero plan`` and the pre-flight of ``jaxzero train`` build them from a run's config
(:mod:`jaxzero.train.planning`); a script may build them from its own model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from jaxzero.accounting.comm import collectives_from_hlo, traffic
from jaxzero.accounting.estimate import GB, Precision, format_bytes, model_state_bytes
from jaxzero.accounting.measure import compiled_memory
from jaxzero.accounting.plan_table import format_survey
from jaxzero.frozen import Trainable, mask_of

__all__ = [
    "HARDWARE",
    "Built",
    "Candidate",
    "Hardware",
    "Planner",
    "Row",
    "Survey",
    "candidates",
    "formula_states",
    "held_to",
    "param_split",
    "survey",
]

REMATS = ("none", "dots", "full")  # cheapest first: remat full recomputes the forward
MAX_BATCH_ROWS = 1 << 20  # the largest-batch search stops here


@dataclass(frozen=True)
class Candidate:
    """One configuration: ZeRO stage, remat policy, micro-batches, global batch (rows)."""

    stage: int
    remat: str
    micro_batches: int
    batch: int

    def describe(self) -> str:
        k = self.micro_batches
        return f"stage {self.stage}, remat {self.remat}, {k} micro-batch{'es' if k > 1 else ''}"

    def flags(self) -> str:
        """The ``jaxzero train`` flags that select it."""
        return (
            f"--stage {self.stage} --micro-batches {self.micro_batches} "
            f"--set model.remat={self.remat}"
        )


@dataclass(frozen=True)
class Hardware:
    """The roofline a prediction divides by: per device FLOP/s, bytes and link speeds.

    ``intra``/``inter``: bytes per second one device sends within its group (NVLink)
    and across groups (InfiniBand), one direction, as the ring formulas count bytes.
    """

    name: str
    flops: float
    memory: float | None
    intra: float
    inter: float


# Nominal data-sheet figures: dense bf16 FLOP/s, HBM, NVLink per direction, and one
# 400 Gb/s (H100/H200) or 200 Gb/s (A100) InfiniBand port per GPU.
HARDWARE = {
    "h100": Hardware("H100 SXM", 989e12, 80 * GB, 450 * GB, 50 * GB),
    "h200": Hardware("H200 SXM", 989e12, 141 * GB, 450 * GB, 50 * GB),
    "a100": Hardware("A100 SXM 80GB", 312e12, 80 * GB, 300 * GB, 25 * GB),
    # simulated CPU devices share the host's cores and memory: a nominal figure to rank
    # with, not a peak (experiments/plan_error.py measures how far off it is)
    "cpu": Hardware("CPU, simulated devices (nominal)", 1e10, None, 4 * GB, 4 * GB),
}


@dataclass(frozen=True)
class Built:
    """A candidate made concrete by a builder: its engine, the train state's and a global
    batch's ``jax.ShapeDtypeStruct`` trees, and the step's FLOPs over all devices."""

    engine: Any
    state: Any
    batch: Any
    flops: float


@dataclass
class Row:
    """One candidate's outcome, per device.

    ``status``: ``fits``; ``over`` (compiled, its peak exceeds the budget); ``pruned``
    (its model states exceed it by the formulas: not compiled); ``skipped`` (fewer
    micro-batches already fit: more only add passes); ``failed`` (``why`` says why).
    """

    candidate: Candidate
    status: str
    why: str = ""
    persistent: int = 0  # the train state's bytes on one device
    peak: int = 0  # the compiled step's argument + output + temp - alias
    intra: float = 0.0  # bytes sent per step within the group
    inter: float = 0.0  # across groups
    flops: float = 0.0  # per device per step
    compute_s: float = 0.0
    comm_s: float = 0.0
    max_batch: int | None = None  # the largest global batch that fits (None: not searched)

    @property
    def predicted_s(self) -> float:
        """The roofline's step time: compute and communication fully overlapped."""
        return max(self.compute_s, self.comm_s)


@dataclass
class Survey:
    """Every candidate's :class:`Row`, the budget they were held to, and the roofline."""

    rows: list[Row]
    budget: float
    budget_note: str
    hardware: Hardware
    devices: int
    group: int
    title: str = ""
    notes: list[str] = field(default_factory=list)
    headroom: float = 0.0  # the share of ``budget`` kept free: a step is held to ``held``

    @property
    def held(self) -> float:
        """Bytes per device a candidate's peak may reach: the budget less the headroom."""
        return held_to(self.budget, self.headroom)

    def fitting(self) -> list[Row]:
        """The candidates that fit, fastest first (then the smallest peak)."""
        fit = [r for r in self.rows if r.status == "fits"]
        return sorted(fit, key=_rank_key)

    def best(self) -> Row | None:
        fit = self.fitting()
        return fit[0] if fit else None

    def suggestions(self, n: int = 3) -> str:
        """The best ``n`` that fit, one clause each (for a one-line error)."""
        fit = self.fitting()[:n]
        if not fit:
            return "nothing fits: fewer params per device (more devices), or a smaller batch"
        return "; ".join(f"{r.candidate.describe()} (peak {format_bytes(r.peak)})" for r in fit)

    def to_dict(self) -> dict[str, Any]:
        rank = {id(r): i + 1 for i, r in enumerate(self.fitting())}
        return {
            "title": self.title,
            "budget_bytes": self.budget,
            "budget": self.budget_note,
            "headroom": self.headroom,
            "held_bytes": self.held,
            "devices": self.devices,
            "group_size": self.group,
            "hardware": vars(self.hardware),
            "rows": [_row_dict(r, rank.get(id(r))) for r in self.rows],
            "notes": self.notes,
        }

    def table(self) -> str:
        return format_survey(self)


def _row_dict(r: Row, rank: int | None) -> dict[str, Any]:
    out = {"rank": rank, **vars(r.candidate), "status": r.status, "why": r.why}
    if r.status in ("fits", "over"):
        out.update(
            persistent_bytes=r.persistent,
            peak_bytes=r.peak,
            traffic_intra_bytes=r.intra,
            traffic_inter_bytes=r.inter,
            flops_per_device=r.flops,
            compute_s=r.compute_s,
            comm_s=r.comm_s,
            predicted_s=r.predicted_s,
            max_batch=r.max_batch,
        )
    return out


def held_to(budget: float, headroom: float) -> float:
    """The bytes a step may peak at in ``budget`` keeping ``headroom`` of it free: the one
    rule the pre-flight, ``zero.auto`` and ``jaxzero plan`` hold candidates to."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom {headroom} must be in [0, 1): a share of the budget")
    return budget * (1 - headroom)


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of ``ShapeDtypeStruct`` with shardings (the
    first device's shard of each leaf; nothing is allocated)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def measure(built: Built, candidate: Candidate, hw: Hardware, group: int) -> Row:
    """Compile ``built``'s step (nothing runs) and read its peak, state and traffic."""
    compiled = built.engine.compile(built.state, built.batch)
    mem = compiled_memory(compiled)
    hlo = collectives_from_hlo(compiled.as_text())
    tr = traffic(hlo.collectives, group_size=group)
    devices = int(built.engine.mesh.devices.size)
    intra, inter = tr.by_scope_logical.get("intra", 0.0), tr.by_scope_logical.get("inter", 0.0)
    flops = built.flops / devices
    return Row(
        candidate,
        "fits",
        persistent=shard_bytes(built.state),
        peak=mem.peak,
        intra=intra,
        inter=inter,
        flops=flops,
        compute_s=flops / hw.flops,
        comm_s=intra / hw.intra + inter / hw.inter,
    )


def candidates(
    batch: int,
    batch_devices: int,
    stages: Sequence[int] = (0, 1, 2, 3),
    remats: Sequence[str] = REMATS,
    micro_batches: Sequence[int] | None = None,
) -> list[Candidate]:
    """Stages x remats x micro-batches at global ``batch``: by default every divisor of
    the per-device rows (so each micro-batch has whole rows on every device)."""
    if batch % batch_devices:
        raise ValueError(f"global batch {batch} is not divisible by {batch_devices} devices")
    rows = batch // batch_devices
    ks = micro_batches or [k for k in range(1, rows + 1) if rows % k == 0]
    bad = [k for k in ks if rows % k]
    if bad:
        raise ValueError(
            f"{bad[0]} micro-batches do not divide the {rows} rows per device of a global "
            f"batch of {batch} on {batch_devices} devices"
        )
    return [Candidate(s, r, k, batch) for s in stages for r in remats for k in sorted(ks)]


class Planner:
    """Compiles candidates once each (a memo by candidate) and holds them to a budget.

    Args:
      build: makes a candidate concrete (:class:`Built`); it may raise ValueError.
      budget: bytes per device a step may peak at.
      hardware: the roofline.
      group: devices that shard the state (the rest replicate it).
      formula_states: model-state bytes per device of a stage by the formulas (for
        pruning); None: no pruning.
      headroom: the share of ``budget`` kept free (:func:`held_to`): a peak within it of
        the budget is over.
    """

    def __init__(
        self,
        build: Callable[[Candidate], Built],
        budget: float,
        hardware: Hardware,
        group: int,
        formula_states: Callable[[int], float] | None = None,
        headroom: float = 0.0,
    ):
        self.build, self.budget, self.hw, self.group = build, budget, hardware, group
        self.held = held_to(budget, headroom)
        self.headroom = headroom
        self.formula_states = formula_states
        self.memo: dict[Candidate, Row] = {}

    def row(self, c: Candidate) -> Row:
        """``c``'s outcome: pruned by the formulas, or compiled (memoized)."""
        if c in self.memo:
            return self.memo[c]
        states = self.formula_states(c.stage) if self.formula_states else 0.0
        if states > self.held:
            why = f"model states {format_bytes(states)} > {self._limit()} (formulas)"
            row = Row(c, "pruned", why)
        else:
            try:
                row = measure(self.build(c), c, self.hw, self.group)
                if row.peak > self.held:
                    row.status = "over"
                    row.why = f"peak {format_bytes(row.peak)} > {self._limit()}"
            except (ValueError, RuntimeError) as e:  # a refused shape, XLA refusing the step
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                row = Row(c, "failed", f"{type(e).__name__}: {first}")
        self.memo[c] = row
        return row

    def _limit(self) -> str:
        if not self.headroom:
            return format_bytes(self.held)
        return (
            f"{format_bytes(self.held)} ({format_bytes(self.budget)} less "
            f"{self.headroom:.0%} headroom)"
        )

    def fits(self, c: Candidate) -> bool:
        return self.row(c).status == "fits"

    def survey(self, cands: Iterable[Candidate], exhaustive: bool = False) -> list[Row]:
        """Each candidate's row. Unless ``exhaustive``, a (stage, remat) pair whose fewer
        micro-batches fit skips the rest: same FLOPs, as many bytes or more to send."""
        rows: list[Row] = []
        fitted: set[tuple[int, str]] = set()
        for c in sorted(cands, key=lambda c: (c.stage, REMATS.index(c.remat), c.micro_batches)):
            key = (c.stage, c.remat)
            if key in fitted and not exhaustive:
                fits = (r for r in rows if _pair(r) == key and r.status == "fits")
                fewer = min(r.candidate.micro_batches for r in fits)
                rows.append(Row(c, "skipped", f"{fewer} micro-batch(es) fit"))
                continue
            row = self.row(c)
            rows.append(row)
            if row.status == "fits":
                fitted.add(key)
        return rows

    def max_batch(self, c: Candidate, granule: int) -> int:
        """The largest global batch (a multiple of ``granule``: devices x micro-batches)
        that fits with ``c``'s stage, remat and micro-batches, found on compiled peaks.

        The peak grows about linearly with the rows, so each guess is where the line
        through the nearest sizes known to fit and not to fit meets the budget (the
        secant method); it ends when two adjacent sizes are known, one fitting and one
        not: about four compiles where bisection takes a dozen."""
        at = lambda u: replace(c, batch=u * granule)  # noqa: E731
        cap = max(MAX_BATCH_ROWS // granule, c.batch // granule)
        lo, hi = c.batch // granule, None  # lo fits (the caller's row)
        probe = 2 * lo
        while hi is None:  # find a size that does not fit: past the budget by the line
            probe = min(probe, cap)
            if probe <= lo:
                return lo * granule  # the cap
            if not self.fits(at(probe)):
                hi = probe
                break
            slope = max(self.row(at(probe)).peak - self.row(at(lo)).peak, 1) / (probe - lo)
            lo, left = probe, self.held - self.row(at(probe)).peak
            probe = lo + max(int(left // slope) + 1, 1)
        while hi - lo > 1:
            p_lo, p_hi = self.row(at(lo)).peak, self.row(at(hi)).peak
            slope = max(p_hi - p_lo, 1) / (hi - lo)
            guess = min(max(lo + int((self.held - p_lo) // slope), lo + 1), hi - 1)
            lo, hi = (guess, hi) if self.fits(at(guess)) else (lo, guess)
        return lo * granule


def _rank_key(r: Row) -> tuple[float, ...]:
    """Fastest on the roofline; among equals, less to send, less recomputed, fewer
    passes, then the smaller peak."""
    c = r.candidate
    return (r.predicted_s, r.comm_s, REMATS.index(c.remat), c.micro_batches, r.peak)


def _pair(r: Row) -> tuple[int, str]:
    return (r.candidate.stage, r.candidate.remat)


def param_split(shapes: Any, trainable: Trainable = None) -> tuple[float, float]:
    """``(Ψ, frozen bytes)`` of a params tree: the trainable params' count, and the
    frozen ones' bytes in their own dtypes (Σ elements × itemsize: 2Ψf for a bf16 base),
    as :func:`survey` takes them (``num_params``, ``frozen_bytes``).

    ``shapes``: the params or their ``jax.ShapeDtypeStruct`` (``jax.eval_shape`` of an
    init); ``trainable``: the engine's ``trainable=`` (a predicate on leaf paths, a tree
    of bools, None: all train), e.g. ``engine.trainable``.
    """
    mask = jax.tree.leaves(mask_of(trainable, shapes))
    psi = held = 0.0
    for on, x in zip(mask, jax.tree.leaves(shapes), strict=True):
        size = float(np.prod(x.shape, dtype=np.int64))
        if on:
            psi += size
        else:
            held += size * np.dtype(x.dtype).itemsize
    return psi, held


def formula_states(
    num_params: float, group: int, precision: Precision, frozen_bytes: float = 0.0
) -> Callable[[int], float]:
    """A stage's persistent model-state bytes per device by the formulas (the
    :class:`Planner`'s ``formula_states``): ``num_params`` trainable params at
    ``precision``, ``frozen_bytes`` of frozen ones (whole, / N at stage 3). A lower
    bound of what the state holds: padding and replicated small leaves only add."""
    held = (frozen_bytes, 1.0)  # (count, bytes each) as the formulas take them
    return lambda stage: model_state_bytes(num_params, group, stage, precision, *held).persistent


def survey(
    build: Callable[[Candidate], Built],
    cands: Sequence[Candidate],
    budget: float,
    hardware: Hardware,
    *,
    devices: int,
    group: int | None = None,
    num_params: float | None = None,
    precision: Precision | None = None,
    max_batch: int = 1,
    exhaustive: bool = False,
    budget_note: str = "",
    title: str = "",
    frozen_bytes: float = 0.0,
    headroom: float = 0.0,
) -> Survey:
    """Compile ``cands``, hold them to ``budget`` bytes per device, rank those that fit.

    Args:
      build: a candidate -> :class:`Built` (its engine, abstract state and batch, FLOPs).
      cands: the candidates (:func:`candidates`).
      budget: bytes per device.
      hardware: the roofline (:data:`HARDWARE`).
      devices: devices in the mesh.
      group: devices sharding the state (default all).
      num_params: the trainable Ψ, to prune by the formulas before compiling (None:
        compile every candidate). A frozen param must not be in it (:func:`param_split`):
        the formulas count 12-16 bytes for a trainable param, the state holds a frozen
        one at its stored bytes only.
      precision: the bytes per param the formulas count (with ``num_params``).
      frozen_bytes: the frozen params' bytes in their own dtypes (:func:`param_split`),
        counted whole at stages 0-2 and / N at stage 3, as the state holds them.
      max_batch: search the largest global batch for this many of the best (0: none;
        each search compiles about three more programs).
      exhaustive: compile every micro-batch count, not only the fewest that fit.
      headroom: the share of ``budget`` kept free (:func:`held_to`); a candidate fits
        when its peak is at most the rest.
    """
    group = group or devices
    states = None
    if num_params is not None and precision is not None:
        states = formula_states(num_params, group, precision, frozen_bytes)
    planner = Planner(build, budget, hardware, group, states, headroom)
    rows = planner.survey(cands, exhaustive)
    out = Survey(rows, budget, budget_note, hardware, devices, group, title, headroom=headroom)
    for r in out.fitting()[:max_batch]:
        granule = devices * r.candidate.micro_batches
        r.max_batch = planner.max_batch(r.candidate, granule)
    return out
