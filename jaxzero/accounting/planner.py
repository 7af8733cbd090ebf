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

Beyond ZeRO (issue 47): a candidate may keep its optimizer state in host memory
(``offload``: the fp32 master and the moments, ZeRO-Offload) or quantize its collectives
(``qwz``, ``qgz``: ZeRO++). An offloaded candidate is held to two budgets: its device
peak (the compiled peak less the host-resident state, :func:`compiled_memory`) to the
device's, its host bytes to the host's (``host_budget``; None: the host is the devices'
own memory, as simulated CPU devices' is, and both count against the device budget);
its step moves the host-resident state to the device and back over the host link
(:attr:`Hardware.host_link`, a third term of the roofline). It is compiled only where
the same candidate without offload does not fit: with the same FLOPs and collectives and
a host transfer added, it is never faster. Quantized candidates are offered where the
mesh has a slow axis (a hybrid mesh: its groups span nodes): stages 1-3 reduce-scatter
the gradients in int8 (qgZ), stage 3 also gathers its weights in int8 (qwZ).

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
from jaxzero.accounting.hlo import host_transfers
from jaxzero.accounting.measure import compiled_memory
from jaxzero.accounting.plan_table import format_survey
from jaxzero.frozen import Trainable, mask_of
from jaxzero.mesh import MODEL

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
    """One configuration: ZeRO stage, remat policy, micro-batches, global batch (rows);
    and beyond ZeRO: the optimizer state in host memory (``offload``), stage 3's weights
    gathered in int8 (``qwz``), the gradients reduced in int8/int4 (``qgz``); each layer
    split over a model axis of ``model`` devices (tensor parallelism; None: the run's
    own mesh, whatever it splits)."""

    stage: int
    remat: str
    micro_batches: int
    batch: int
    offload: bool = False
    qwz: bool = False
    qgz: str | None = None
    model: int | None = None

    def describe(self) -> str:
        k = self.micro_batches
        out = f"stage {self.stage}, remat {self.remat}, {k} micro-batch{'es' if k > 1 else ''}"
        out += f", model axis {self.model}" if self.model is not None else ""
        beyond = self.beyond()
        return f"{out}, {beyond}" if beyond else out

    def beyond(self) -> str:
        """``'offload'``, ``'qwZ + qgZ int8'``, ...: what it adds to ZeRO ('' for nothing)."""
        parts = ["offload"] if self.offload else []
        parts += ["qwZ"] if self.qwz else []
        parts += [f"qgZ {self.qgz}"] if self.qgz else []
        return " + ".join(parts)

    def flags(self) -> str:
        """The ``jaxzero train`` flags that select it."""
        out = (
            f"--stage {self.stage} --micro-batches {self.micro_batches} "
            f"--set model.remat={self.remat}"
        )
        out += " --set zero.offload=optimizer" if self.offload else ""
        out += " --set zero.qwz=true" if self.qwz else ""
        out += f" --set zero.qgz={self.qgz}" if self.qgz else ""
        out += f" --set mesh.model={self.model}" if self.model is not None else ""
        return out

    @property
    def plain(self) -> Candidate:
        """The same candidate without offload (what an offloaded one is compared with)."""
        return replace(self, offload=False)


@dataclass(frozen=True)
class Hardware:
    """The roofline a prediction divides by: per device FLOP/s, bytes and link speeds.

    ``intra``/``inter``: bytes per second one device sends within its group (NVLink)
    and across groups (InfiniBand), one direction, as the ring formulas count bytes.
    ``host_link``: bytes per second between the device and host memory, each way (PCIe,
    or NVLink-C2C on a Grace Hopper), what offload's transfers divide by (0: none known).
    ``host_memory``: host memory per device (the node's, shared by its devices), what
    offloaded state is held to (None: not known; the machine's own is read).
    """

    name: str
    flops: float
    memory: float | None
    intra: float
    inter: float
    host_link: float = 0.0
    host_memory: float | None = None


# Nominal data-sheet figures: dense bf16 FLOP/s, HBM, NVLink per direction, one
# 400 Gb/s (H100/H200) or 200 Gb/s (A100) InfiniBand port per GPU; the host link each way
# and the host memory of the vendor's 8-GPU server, per GPU. The host links: PCIe Gen5 x16
# is 128 GB/s both ways together on the H100/H200 data sheets (64 GB/s each way, about 55
# after the protocol's overhead), PCIe Gen4 x16 64 GB/s on the A100's (32 each way, about
# 25); the GH200's NVLink-C2C 900 GB/s both ways (450 each way) on its data sheet. Host
# memory: DGX H100, DGX H200 and DGX A100 640GB data sheets, 2 TB for 8 GPUs (256 GB
# each); GH200: 480 GB of LPDDR5X beside its one GPU (the 96 GB HBM3 version).
# gh200 comes before h200: a device kind names its key ("NVIDIA GH200 480GB" holds "h200").
HARDWARE = {
    "h100": Hardware("H100 SXM", 989e12, 80 * GB, 450 * GB, 50 * GB, 55 * GB, 256 * GB),
    "gh200": Hardware("GH200 96GB", 989e12, 96 * GB, 450 * GB, 50 * GB, 450 * GB, 480 * GB),
    "h200": Hardware("H200 SXM", 989e12, 141 * GB, 450 * GB, 50 * GB, 55 * GB, 256 * GB),
    "a100": Hardware("A100 SXM 80GB", 312e12, 80 * GB, 300 * GB, 25 * GB, 25 * GB, 256 * GB),
    # simulated CPU devices share the host's cores and memory: a nominal figure to rank
    # with, not a peak (experiments/plan_error.py measures how far off it is); their host
    # memory is their own, so offload moves nothing out of it
    "cpu": Hardware("CPU, simulated devices (nominal)", 1e10, None, 4 * GB, 4 * GB, 4 * GB),
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
    persistent: int = 0  # the train state's bytes on one device, in its own memory
    peak: int = 0  # the compiled step's argument + output + temp - alias, on the device
    intra: float = 0.0  # bytes sent per step within the group
    inter: float = 0.0  # across groups
    flops: float = 0.0  # per device per step
    compute_s: float = 0.0
    comm_s: float = 0.0
    max_batch: int | None = None  # the largest global batch that fits (None: not searched)
    host: int = 0  # offload: host memory the step holds for this device (its host peak)
    host_moved: float = 0.0  # bytes moved over the host link per step, each way
    host_s: float = 0.0  # host_moved / the host link's bandwidth
    model_s: float = 0.0  # the model axis' collectives (in ``intra``) / the group's link

    @property
    def predicted_s(self) -> float:
        """The roofline's step time: compute, communication and host transfers fully
        overlapped (each a bound; the two directions of the host link overlap too); a
        model axis' collectives added on top: each sits between the matmuls that need
        its result (tensor and sequence parallelism), so nothing hides it."""
        return max(self.compute_s, self.comm_s, self.host_s) + self.model_s


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
    host_budget: float | None = None  # host bytes per device offload may use (None: shared)
    host_note: str = ""  # where ``host_budget`` comes from, or why there is none

    @property
    def held(self) -> float:
        """Bytes per device a candidate's peak may reach: the budget less the headroom."""
        return held_to(self.budget, self.headroom)

    @property
    def host_held(self) -> float | None:
        """Host bytes per device an offloaded candidate may hold (the same headroom kept)."""
        return None if self.host_budget is None else held_to(self.host_budget, self.headroom)

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
            "host_budget_bytes": self.host_budget,
            "host_budget": self.host_note,
            "host_held_bytes": self.host_held,
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
            host_bytes=r.host,
            host_moved_bytes=r.host_moved,
            host_s=r.host_s,
            model_s=r.model_s,
        )
    return out


def held_to(budget: float, headroom: float) -> float:
    """The bytes a step may peak at in ``budget`` keeping ``headroom`` of it free: the one
    rule the pre-flight, ``zero.auto`` and ``jaxzero plan`` hold candidates to."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom {headroom} must be in [0, 1): a share of the budget")
    return budget * (1 - headroom)


def _in_host(x: Any) -> bool:
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind in ("pinned_host", "unpinned_host")


def shard_bytes(tree: Any, memory: str | None = None) -> int:
    """Bytes one device holds of a tree of ``ShapeDtypeStruct`` with shardings (the
    first device's shard of each leaf; nothing is allocated). ``memory``: ``"host"``
    only the leaves in host memory (``pinned_host``: offload), ``"device"`` the others,
    None all."""
    total = 0
    for x in jax.tree.leaves(tree):
        if memory is not None and (memory == "host") != _in_host(x):
            continue
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def measure(built: Built, candidate: Candidate, hw: Hardware, group: int) -> Row:
    """Compile ``built``'s step (nothing runs) and read its peak, state and traffic.

    With offload the peak is the device's (the host-resident state taken out where the
    backend counts it, :func:`~jaxzero.accounting.measure.compiled_memory`), ``host`` the
    host memory the step holds, and the state's host part crosses the host link each way.
    """
    compiled = built.engine.compile(built.state, built.batch)
    text = compiled.as_text()
    mem = compiled_memory(compiled, host_transfers(text))
    hlo = collectives_from_hlo(text)
    tr = traffic(hlo.collectives, group_size=group)
    devices = int(built.engine.mesh.devices.size)
    intra, inter = tr.by_scope_logical.get("intra", 0.0), tr.by_scope_logical.get("inter", 0.0)
    m = int(dict(built.engine.mesh.shape).get(MODEL, 1))
    along = 0.0  # the model axis' bytes: within a model group of m neighbouring devices
    if m > 1:
        along = traffic(hlo.collectives, group_size=m).by_scope_logical.get("intra", 0.0)
    flops = built.flops / devices
    moved = float(shard_bytes(built.state, "host"))  # to the device and back, each step
    return Row(
        candidate,
        "fits",
        persistent=shard_bytes(built.state, "device"),
        peak=mem.device_peak,
        intra=intra,
        inter=inter,
        flops=flops,
        compute_s=flops / hw.flops,
        comm_s=(intra - along) / hw.intra + inter / hw.inter,
        model_s=along / hw.intra,
        host=mem.host_peak,
        host_moved=moved,
        host_s=moved / hw.host_link if moved and hw.host_link else 0.0,
    )


def candidates(
    batch: int,
    batch_devices: int,
    stages: Sequence[int] = (0, 1, 2, 3),
    remats: Sequence[str] = REMATS,
    micro_batches: Sequence[int] | None = None,
    offload: bool = False,
    quantized: bool = False,
    model_axes: Sequence[int] = (),
) -> list[Candidate]:
    """Stages x remats x micro-batches at global ``batch``: by default every divisor of
    the per-device rows (so each micro-batch has whole rows on every device).

    ``offload``: each candidate of stages 1-3 also with the optimizer state in host
    memory (compiled only where it does not fit without: :meth:`Planner.survey`).
    ``quantized``: each of stages 1-3 also with ZeRO++'s quantized collectives (qgZ
    int8; at stage 3 with qwZ too): for a mesh whose groups span a slow link.
    ``model_axes``: each of them with each layer split over that many of the
    ``batch_devices`` (tensor parallelism), the rows over the rest (none: the mesh's)."""
    out = []
    axes: list[int | None] = list(model_axes) or [None]
    for m in axes:
        for k in _micro_batch_counts(batch, batch_devices // (m or 1), micro_batches):
            for s in stages:
                for r in remats:
                    out.append(Candidate(s, r, k, batch, model=m))
                    if offload and s >= 1:
                        out.append(Candidate(s, r, k, batch, offload=True, model=m))
                    if quantized and s >= 1:
                        out.append(Candidate(s, r, k, batch, qwz=s == 3, qgz="int8", model=m))
    return sorted(out, key=lambda c: (c.model or 0, c.stage, REMATS.index(c.remat)))


def _micro_batch_counts(batch: int, devices: int, asked: Sequence[int] | None) -> list[int]:
    """The micro-batch counts ``asked`` (default: every divisor of the rows a device
    holds) of ``batch`` rows over ``devices``; a count that does not divide them refused."""
    if batch % devices:
        raise ValueError(f"global batch {batch} is not divisible by {devices} devices")
    rows = batch // devices
    ks = asked or [k for k in range(1, rows + 1) if rows % k == 0]
    bad = [k for k in ks if rows % k]
    if bad:
        raise ValueError(
            f"{bad[0]} micro-batches do not divide the {rows} rows per device of a global "
            f"batch of {batch} on {devices} devices"
        )
    return sorted(ks)


class Planner:
    """Compiles candidates once each (a memo by candidate) and holds them to a budget.

    Args:
      build: makes a candidate concrete (:class:`Built`); it may raise ValueError.
      budget: bytes per device a step may peak at.
      hardware: the roofline.
      group: devices that shard the state (the rest replicate it).
      formula_states: model-state bytes per device of a stage by the formulas (for
        pruning); None: no pruning. With offload it is called ``(stage, True)`` and
        gives the device's part (:func:`formula_states` makes such a function).
      headroom: the share of ``budget`` kept free (:func:`held_to`): a peak within it of
        the budget is over.
      host_budget: host bytes per device an offloaded candidate may hold (less the same
        headroom); None: the host is the devices' own memory (simulated CPU devices),
        and a candidate's host bytes count against ``budget`` beside its device peak.
    """

    def __init__(
        self,
        build: Callable[[Candidate], Built],
        budget: float,
        hardware: Hardware,
        group: int,
        formula_states: Callable[..., float] | None = None,
        headroom: float = 0.0,
        host_budget: float | None = None,
    ):
        self.build, self.budget, self.hw, self.group = build, budget, hardware, group
        self.held = held_to(budget, headroom)
        self.headroom = headroom
        self.formula_states = formula_states
        self.host_budget = host_budget
        self.host_held = None if host_budget is None else held_to(host_budget, headroom)
        self.memo: dict[Candidate, Row] = {}

    def _states(self, c: Candidate) -> float:
        if self.formula_states is None:
            return 0.0
        split = {} if c.model is None else {"model": c.model}  # else the mesh's own
        if c.offload:
            return self.formula_states(c.stage, True, **split)
        return self.formula_states(c.stage, **split)

    def row(self, c: Candidate) -> Row:
        """``c``'s outcome: pruned by the formulas, or compiled (memoized)."""
        if c in self.memo:
            return self.memo[c]
        states = self._states(c)
        if states > self.held:
            where = "on the device " if c.offload else ""
            why = f"model states {where}{format_bytes(states)} > {self._limit()} (formulas)"
            row = Row(c, "pruned", why)
        else:
            try:
                row = measure(self.build(c), c, self.hw, self.group)
                self._hold(row)
            except (ValueError, RuntimeError) as e:  # a refused shape, XLA refusing the step
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                row = Row(c, "failed", f"{type(e).__name__}: {first}")
        self.memo[c] = row
        return row

    def _hold(self, row: Row) -> None:
        """Mark ``row`` over when its device peak, or its host bytes, exceed their budget."""
        if self.host_held is None and row.host:  # one memory: the host's bytes count too
            if row.peak + row.host > self.held:
                row.status = "over"
                row.why = (
                    f"peak {format_bytes(row.peak)} + {format_bytes(row.host)} in host memory "
                    f"> {self._limit()} (the host is the devices' memory)"
                )
            return
        if row.peak > self.held:
            row.status = "over"
            row.why = f"peak {format_bytes(row.peak)} > {self._limit()}"
        elif self.host_held is not None and row.host > self.host_held:
            row.status = "over"
            row.why = f"host memory {format_bytes(row.host)} > {self._limit(host=True)}"

    def _limit(self, host: bool = False) -> str:
        budget, held = (self.host_budget, self.host_held) if host else (self.budget, self.held)
        assert budget is not None and held is not None
        where = " of host memory" if host else ""
        if not self.headroom:
            return format_bytes(held) + where
        return (
            f"{format_bytes(held)}{where} ({format_bytes(budget)} less "
            f"{self.headroom:.0%} headroom)"
        )

    def fits(self, c: Candidate) -> bool:
        return self.row(c).status == "fits"

    def survey(self, cands: Iterable[Candidate], exhaustive: bool = False) -> list[Row]:
        """Each candidate's row. Unless ``exhaustive``, a (stage, remat) pair whose fewer
        micro-batches fit skips the rest: same FLOPs, as many bytes or more to send; and
        an offloaded candidate whose twin without offload fits is skipped: the same step
        with a host transfer added."""
        rows: list[Row] = []
        fitted: set[tuple] = set()
        for c in sorted(cands, key=_order):
            key = _pair(c)
            if key in fitted and not exhaustive:
                fits = (r for r in rows if _pair(r.candidate) == key and r.status == "fits")
                fewer = min(r.candidate.micro_batches for r in fits)
                rows.append(Row(c, "skipped", f"{fewer} micro-batch(es) fit"))
                continue
            if c.offload and not exhaustive and _pair(c.plain) in fitted:
                rows.append(Row(c, "skipped", "fits without offload"))
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
    """Fastest on the roofline; among equals, less to send, less to move to and from the
    host, less recomputed, fewer passes, nothing quantized, the narrower model axis, then
    the smaller peak."""
    c = r.candidate
    quantized = int(c.qwz) + int(bool(c.qgz))
    return (
        r.predicted_s, r.comm_s, r.host_s, REMATS.index(c.remat), c.micro_batches, quantized,
        c.model or 1, r.peak,
    )  # fmt: skip


def _pair(c: Candidate) -> tuple:
    """What a micro-batch count varies within: the rest of the candidate."""
    return (c.stage, c.remat, c.offload, c.qwz, c.qgz, c.model)


def _order(c: Candidate) -> tuple:
    """Surveyed in this order: fewer micro-batches first, and a candidate before its
    offloaded twin (which is skipped when the first fits)."""
    return (
        c.model or 0, c.stage, REMATS.index(c.remat), c.qwz, c.qgz or "", c.micro_batches,
        c.offload,
    )  # fmt: skip


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
    num_params: float,
    group: int,
    precision: Precision,
    frozen_bytes: float = 0.0,
    model: int = 1,
) -> Callable[..., float]:
    """A stage's persistent model-state bytes per device by the formulas (the
    :class:`Planner`'s ``formula_states``): ``num_params`` trainable params at
    ``precision``, ``frozen_bytes`` of frozen ones (whole, / N at stage 3). A lower
    bound of what the state holds: padding and replicated small leaves only add.
    ``states(stage, True)``: with offload, the device's part alone. ``model``: a model
    axis of that many devices in the ``group``: a model device holds at least Ψ/model
    (the params it does not split whole), sharded over the group's data devices;
    ``states(stage, model=m)``: a candidate's own axis instead."""
    held = (frozen_bytes, 1.0)  # (count, bytes each) as the formulas take them
    mesh_model = model

    def states(stage: int, offload: bool = False, model: int | None = None) -> float:
        m = mesh_model if model is None else model  # a candidate's own model axis
        ms = model_state_bytes(num_params / m, group // m, stage, precision, *held,
                               offload=offload)  # fmt: skip
        return ms.device

    return states


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
    host_budget: float | None = None,
    host_note: str = "",
    batch_devices: int | None = None,
    model: int = 1,
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
      host_budget: host bytes per device for offloaded candidates (None: the devices'
        own memory, counted in ``budget``); ``host_note`` says where it comes from.
      batch_devices: the devices a batch's rows are split over (default ``devices``;
        a model group shares its rows, a Ulysses group splits each row's sequence): the
        largest batch is a multiple of them.
      model: the mesh's model axis (tensor parallelism), for the formulas' bound.
    """
    group = group or devices
    states = None
    if num_params is not None and precision is not None:
        states = formula_states(num_params, group, precision, frozen_bytes, model)
    planner = Planner(build, budget, hardware, group, states, headroom, host_budget)
    rows = planner.survey(cands, exhaustive)
    out = Survey(
        rows, budget, budget_note, hardware, devices, group, title, headroom=headroom,
        host_budget=host_budget, host_note=host_note,
    )  # fmt: skip
    for r in out.fitting()[:max_batch]:
        m = r.candidate.model
        rows_over = devices // m if m is not None else batch_devices or devices
        granule = rows_over * r.candidate.micro_batches
        r.max_batch = planner.max_batch(r.candidate, granule)
    return out
