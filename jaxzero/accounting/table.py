"""The Report value: one measured step beside its predictions, as a dict, JSON or a table.

:func:`jaxzero.accounting.measure.report` measures and builds it; this module only
holds the figures (and :class:`CompiledMemory`, what a compiled step says of its
memory) and formats them (ratios, the hybrid split by scope, the printed table of
``jaxzero report``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from jaxzero.accounting.comm import Collective, Traffic
from jaxzero.accounting.expected import LayoutExpectation, Theory
from jaxzero.accounting.hlo import Buffer, HostTransfers


@dataclass
class CompiledMemory:
    """``compiled.memory_analysis()`` per device, in bytes.

    ``host_*``: the arguments, outputs, temporaries and aliases in host memory (offload),
    as the backend reports them or, where it reports none (CPU), as the compiled text
    declares them (``S(5)`` layouts). ``counted_host``: of the device figures, the bytes
    that are really the host's (the CPU backend counts host arguments and outputs as
    ordinary ones), taken out of :attr:`device_peak`.
    """

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int
    host_argument: int = 0
    host_output: int = 0
    host_temp: int = 0
    host_alias: int = 0
    counted_host: int = 0

    @property
    def peak(self) -> int:
        """Argument + output + temp − alias: what the step needs at once (as reported)."""
        return self.argument + self.output + self.temp - self.alias

    @property
    def device_peak(self) -> int:
        """:attr:`peak` without host-resident buffers: what the device itself needs."""
        return self.peak - self.counted_host

    @property
    def host_peak(self) -> int:
        """Host memory the step's host-resident buffers take at once (0 without offload)."""
        return self.host_argument + self.host_output + self.host_temp - self.host_alias


@dataclass
class Report:
    """Measured accounting of one compiled step beside the theory (bytes per device).

    Attributes:
      config: stage, N, precision, dtypes, micro-batches, Ψ (logical and padded).
      persistent: measured bytes of device 0 per category (params, master,
        optimizer, frozen: the params that do not train, other) and their total.
      theory: the formulas' figures for Ψ (no padding, everything sharded).
      expected: the same counted leaf by leaf over the engine's layouts (padding,
        replicated small leaves), which explains any gap to ``theory``.
      compiled: the step's compiled memory (peak = argument + output + temp − alias).
      traffic: measured bytes on the wire.
      collectives: every collective found, with runs per step.
      notes: anything counted with less certainty, and how padding explains excess.
      host_transfers: the compiled program's host-resident parameters and outputs and
        the transfers between host and device memory (offload).
      model_axis: with a ``model`` mesh axis, the bytes the formula says a device sends
        along it a step (:func:`jaxzero.accounting.formulas.tensor_parallel_bytes`);
        ``traffic`` is then split by model group (``by_scope``: ``"intra"`` along the
        model axis, ``"inter"`` across groups, ZeRO's, which ``theory`` counts).
      ulysses: with Ulysses (``Engine(ulysses=True)``), the bytes of its all-to-alls the
        formula says a device sends a step (:func:`jaxzero.accounting.formulas.ulysses_bytes`);
        the measured all-to-alls are then told from ZeRO's traffic by their kind.
    """

    config: dict[str, Any]
    persistent: dict[str, int]
    theory: Theory
    expected: LayoutExpectation
    compiled: CompiledMemory
    traffic: Traffic
    collectives: list[Collective]
    notes: list[str] = field(default_factory=list)
    host_transfers: HostTransfers = field(default_factory=HostTransfers)
    model_axis: float = 0.0
    ulysses: float = 0.0

    @property
    def split(self) -> bool:
        """Whether a ``model`` axis splits each layer (tensor and sequence parallelism)."""
        return int(self.config.get("model_shards", 1)) > 1

    def zero_traffic(self, logical: bool = False) -> float:
        """Measured bytes of what ``theory.comm`` counts: every gradient and param
        collective, or with a model axis those across model groups (ZeRO's, over data)."""
        if self.split:
            by_scope = self.traffic.by_scope_logical if logical else self.traffic.by_scope
            return by_scope.get("inter", 0.0)
        every = self.traffic.grad_param_logical if logical else self.traffic.grad_param
        return every - self.sequence_traffic(logical)

    def sequence_traffic(self, logical: bool = False) -> float:
        """Measured bytes of Ulysses' all-to-alls (0 without ``ulysses``)."""
        if not self.config.get("ulysses"):
            return 0.0
        kinds = self.traffic.by_kind_logical if logical else self.traffic.by_kind
        return kinds.get("all-to-all", 0.0)

    @property
    def offloaded(self) -> bool:
        """Whether some of the state lives in host memory (``Engine(offload=...)``)."""
        return bool(self.config.get("offload")) or bool(self.persistent.get("host", 0))

    @property
    def persistent_ratio(self) -> float:
        """Measured persistent bytes / theory (params + master + optimizer state)."""
        return self.persistent["total"] / self.theory.persistent

    @property
    def comm_ratio(self) -> float:
        """Measured gradient/param traffic (as compiled) / theory; nan when theory is 0."""
        return self.zero_traffic() / self.theory.comm if self.theory.comm else math.nan

    @property
    def comm_ratio_logical(self) -> float:
        """As :attr:`comm_ratio`, at the element types the program asked for.

        Differs from ``comm_ratio`` only where the backend widened a collective
        (the CPU backend runs bf16 collectives in f32).
        """
        t = self.theory.comm
        return self.zero_traffic(logical=True) / t if t else math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compiled"]["peak"] = self.compiled.peak
        d["compiled"]["device_peak"] = self.compiled.device_peak
        d["compiled"]["host_peak"] = self.compiled.host_peak
        nan_none = lambda x: None if math.isnan(x) else x
        d["ratios"] = {
            "persistent": self.persistent_ratio,
            "persistent_vs_layouts": self.persistent["total"] / self.expected.persistent,
            "comm": nan_none(self.comm_ratio),
            "comm_logical": nan_none(self.comm_ratio_logical),
            "comm_logical_vs_layouts": (
                self.zero_traffic(logical=True) / self.expected.comm if self.expected.comm else None
            ),
        }
        for label, got, formula, _ in _scope_rows(self):
            key = "comm_intra" if label.startswith("within") else "comm_inter"
            if label.startswith("model axis"):
                key = "model_axis"
            if formula:
                d["ratios"][key] = got / formula
        if self.ulysses:
            d["ratios"]["ulysses"] = self.sequence_traffic() / self.ulysses
        d["collectives"] = [
            {
                "name": c.name,
                "kind": c.kind,
                "opcode": c.opcode,
                "computation": c.computation,
                "buffers": [_fmt_buffer(b) for b in c.buffers],
                "logical_buffers": [_fmt_buffer(b) for b in c.logical_buffers],
                "group_size": c.group_size,
                "num_groups": len(c.replica_groups),
                "runs": c.runs,
                "bytes_per_run": c.bytes_per_run,
                "bytes_per_step": c.bytes_per_step,
            }
            for c in self.collectives
        ]
        return d

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _scope_lines(self, mb, ratio) -> list[str]:
        lines = []
        for label, got, formula, layouts in _scope_rows(self):
            line = f"{('' if self.split else '  ') + label:<30}{mb(got)}"
            if formula is not None:
                line += f"{mb(formula)}{ratio(got, formula)}"
                if layouts is not None:
                    line += f"{mb(layouts)}{ratio(got, layouts)}"
            lines.append(line)
        return lines

    @property
    def has_frozen(self) -> bool:
        """Whether some params do not train (``Engine(trainable=...)``)."""
        return bool(self.config.get("num_frozen", 0))

    def _psi(self) -> int:
        """The Ψ the formulas take: a model device's share with a model axis."""
        return int(self.config.get("params_a_model_device", self.config["num_params"]))

    def _model_head(self) -> list[str]:
        """With a model axis: what it splits, and which Ψ the formulas then count; with
        Ulysses, what it exchanges."""
        c = self.config
        if c.get("ulysses"):
            return [
                f"each row's sequence split over the N = {c['num_shards']} data devices "
                "(Ulysses): its attention exchanges sequence slices for head slices "
                "(all-to-alls, apart from ZeRO's collectives below)"
            ]
        if not self.split:
            return []
        return [
            f"each layer split over a model axis of {c['model_shards']} devices (tensor and "
            f"sequence parallel): {c['num_params']:,} params in all, the formulas count a "
            "model device's (its slices of the split params, the others whole) over the N "
            "data devices"
        ]

    def _frozen_head(self) -> str:
        c, e = self.config, self.expected
        return (
            f"; Ψf = {c['num_frozen']:,} frozen (stored {e.padded_frozen:,}), once in "
            "their dtype: no gradient, master or optimizer state"
        )

    def _memory_split_rows(self, mb, ratio) -> list[str]:
        """Offload: the persistent total split into the device's memory and host memory, each
        beside its formula (the host: the master and the optimizer state, KΨ/N)."""
        if not self.offloaded:
            return []
        p, t, e = self.persistent, self.theory, self.expected
        return [
            f"{'  on the device':<30}{mb(p['device'])}{mb(t.device)}{ratio(p['device'], t.device)}"
            f"{mb(e.device)}{ratio(p['device'], e.device)}",
            f"{'  in host memory':<30}{mb(p['host'])}{mb(t.host)}{ratio(p['host'], t.host)}"
            f"{mb(e.host)}{ratio(p['host'], e.host)}",
        ]

    def _compiled_host_rows(self, mb) -> list[str]:
        """Offload: the compiled step's device peak without the host-resident state, the host's
        peak, and the host parameters, outputs and transfers its HLO declares."""
        h, c = self.host_transfers, self.compiled
        if not (self.offloaded or h.parameters or h.outputs or h.to_device or h.to_host):
            return []
        split = "reported apart by the backend" if not c.counted_host else (
            "the backend counts them as arguments and outputs (CPU): taken out"
        )  # fmt: skip
        return [
            f"{'  device peak':<30}{'':>48}{mb(c.device_peak)}",
            f"{'  host peak':<30}{'':>48}{mb(c.host_peak)}  ({split})",
            f"host memory in the compiled step: {h.parameters} entry parameters and {h.outputs} "
            f"outputs in S(5) ({mb(h.parameter_bytes).strip()} / {mb(h.output_bytes).strip()} MB, "
            f"{mb(h.alias_bytes).strip()} MB aliased); {h.to_device} copies to the device "
            f"({mb(h.to_device_bytes).strip()} MB a step), {h.to_host} back "
            f"({mb(h.to_host_bytes).strip()} MB), {h.copy_done} copy-done"
            + self._no_transfers_why(),
        ]

    def _no_transfers_why(self) -> str:
        h = self.host_transfers
        if h.to_device or h.to_host:
            return ""
        if self.compiled.counted_host:
            return " (XLA:CPU moves nothing: its host and device memory are one)"
        return " (none found in the compiled text)"

    def _ema_row(
        self, mb: Callable[[float], str], ratio: Callable[[float, float], str]
    ) -> list[str]:
        """The EMA of the weights (fp32, stored as the master) against its 4Ψ/N; none
        without one."""
        held, t, e = self.persistent.get("ema", 0), self.theory, self.expected
        if not (held or t.ema):
            return []
        return [
            f"{'EMA of the weights':<30}{mb(held)}{mb(t.ema)}{ratio(held, t.ema)}"
            f"{mb(e.ema)}{ratio(held, e.ema)}"
        ]

    def table(self) -> str:
        """Measured vs. theory, MB = 1e6 bytes."""
        c, t, p, e = self.config, self.theory, self.persistent, self.expected
        mb = lambda x: f"{x / 1e6:12.4f}"
        ratio = lambda a, b: f"{a / b:8.3f}" if b else "       -"
        held = p.get("frozen", 0)
        frozen_row = (
            [
                f"{'frozen params':<30}{mb(held)}{mb(t.frozen)}{ratio(held, t.frozen)}"
                f"{mb(e.frozen)}{ratio(held, e.frozen)}"
            ]
            if self.has_frozen
            else []
        )
        head = f"{'':<30}{'measured':>12}{'formula':>12}{'ratio':>8}{'layouts':>12}{'ratio':>8}"
        lines = [
            f"stage {c['stage']}, N = {c['num_shards']}, {c['precision']} "
            f"(compute {c['compute_dtype']}, gradient reduce {c['reduce_dtype']}), "
            f"{c['micro_batches']} micro-batch(es)"
            + (
                f"; hybrid: {c['replicas']} groups of {c['num_shards']} devices, "
                + (
                    "the params within a group, the master and optimizer state over every "
                    "device (hpZ)"
                    if c.get("hpz")
                    else "the state replicated across groups"
                )
                if c.get("replicas", 1) > 1
                else ""
            ),
            *self._model_head(),
            f"Ψ = {self._psi():,} (stored {e.padded_params:,} with padding; "
            f"{e.replicated_params:,} in replicated small leaves); optimizer state "
            f"{t.optimizer_per_param:.2f} bytes per param"
            + (self._frozen_head() if self.has_frozen else ""),
            "",
            "persistent memory per device (MB)",
            head,
            f"{'working params':<30}{mb(p['params'])}{mb(t.params)}{ratio(p['params'], t.params)}",
            f"{'fp32 master':<30}{mb(p['master'])}{mb(t.master)}{ratio(p['master'], t.master)}",
            f"{'optimizer state':<30}{mb(p['optimizer'])}{mb(t.optimizer)}"
            f"{ratio(p['optimizer'], t.optimizer)}",
            *frozen_row,
            *self._ema_row(mb, ratio),
            f"{'other (step, stats)':<30}{mb(p['other'])}",
            f"{'total':<30}{mb(p['total'])}{mb(t.persistent)}{ratio(p['total'], t.persistent)}"
            f"{mb(e.persistent)}{ratio(p['total'], e.persistent)}",
            *self._memory_split_rows(mb, ratio),
            f"{'+ gradients (formula)':<30}{'':>12}{mb(t.model_states)}",
            "",
            "compiled step per device (MB)",
            f"{'':<30}{'argument':>12}{'output':>12}{'temp':>12}{'alias':>12}{'peak':>12}",
            f"{'':<30}{mb(self.compiled.argument)}{mb(self.compiled.output)}"
            f"{mb(self.compiled.temp)}{mb(self.compiled.alias)}{mb(self.compiled.peak)}",
            *self._compiled_host_rows(mb),
            "",
            "communication per device per step (MB on the wire, ring)",
            head,
            f"{'gradients + params' + (' (data)' if self.split or self.ulysses else ''):<30}"
            f"{mb(self.zero_traffic())}{mb(t.comm)}{ratio(self.zero_traffic(), t.comm)}",
        ]
        logical = self.zero_traffic(logical=True)
        if logical != self.zero_traffic():
            lines.append(
                f"{'  at the program dtypes':<30}{mb(logical)}{mb(t.comm)}"
                f"{ratio(logical, t.comm)}{mb(e.comm)}{ratio(logical, e.comm)}"
            )
        else:
            lines[-1] += f"{mb(e.comm)}{ratio(logical, e.comm)}"
        lines += self._scope_lines(mb, ratio) if self.split else []
        if self.config.get("ulysses"):
            got = self.sequence_traffic()
            lines.append(
                f"{'Ulysses all-to-alls (data)':<30}{mb(got)}{mb(self.ulysses)}"
                f"{ratio(got, self.ulysses)}"
            )
        for kind, b in sorted(self.traffic.by_kind.items()):
            lines.append(f"{'  ' + kind + (' (both axes)' if self.split else ''):<30}{mb(b)}")
        if self.has_frozen and (t.comm_frozen or e.comm_frozen):
            # the HLO does not say whose params a gather moves: formulas only
            lines.append(
                f"{'  of which frozen gathers':<30}{'':>12}{mb(t.comm_frozen)}{'':>8}"
                f"{mb(e.comm_frozen)}"
            )
        lines += [] if self.split else self._scope_lines(mb, ratio)
        lines.append(f"{'scalars (loss, norms)':<30}{mb(self.traffic.scalars)}")
        lines += ["", f"collectives: {self.traffic.ops} ops, {self.traffic.runs} runs per step"]
        for col in self.collectives:
            shapes = " ".join(_fmt_buffer(b) for b in col.buffers)
            lines.append(
                f"  {col.kind:<18} x{col.runs:<4} N={col.group_size:<3} {shapes[:48]:<48}"
                f"{mb(col.bytes_per_step)}"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _scope_rows(report: Report) -> list[tuple[str, float, float | None, float | None]]:
    """Hybrid meshes: (label, measured, formula, layouts) for traffic inside / across groups;
    with a model axis, along it (tensor and sequence parallelism) and across both."""
    c, t, e = report.config, report.theory, report.expected
    got = report.traffic.by_scope_logical or report.traffic.by_scope
    if report.split:
        return [
            (f"model axis (m = {c['model_shards']})", got.get("intra", 0.0), report.model_axis,
             None),
            ("spanning both", got.get("both", 0.0), None, None),
        ]  # fmt: skip
    if c.get("replicas", 1) <= 1:
        return []
    return [
        (
            f"within a group (N = {c['num_shards']})",
            got.get("intra", 0.0),
            t.comm_intra,
            e.comm - e.comm_inter if c["stage"] > 0 else None,
        ),
        (f"across groups (R = {c['replicas']})", got.get("inter", 0.0), t.comm_inter, e.comm_inter),
        ("spanning both", got.get("both", 0.0), None, None),
    ]


def _fmt_buffer(b: Buffer) -> str:
    return f"{b.dtype}[{','.join(map(str, b.shape))}]"
