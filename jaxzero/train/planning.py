"""A run's candidates for the planner: ``jaxzero plan``, the pre-flight, ``zero.auto``.

A candidate (:class:`~jaxzero.accounting.planner.Candidate`) is the run's config with
another stage, remat policy, micro-batch count or global batch; :class:`Candidates`
builds each as the run would (:func:`build`: the same model, optimizer and engine
options), with the params' shapes (``jax.eval_shape``, nothing allocated) and the
run's own batch structure. An engine built for a candidate is kept: the run that
picks it trains with that engine, whose step is then already compiled.

The budget a step is held to (:func:`budget`): ``zero.device_memory`` (``--device-memory``)
when given, else the device's own limit (``memory_stats()["bytes_limit"]``), else on CPU
the host's available memory (``/proc/meminfo`` MemAvailable) less a checkpoint's host
copy of the state, shared by the simulated devices, which live in that memory. A step
is held to that budget less a headroom (:func:`headroom`, ``zero.headroom``): the share
kept free for what its compiled ``memory_analysis`` does not count (the runtime's own
buffers, the allocator's slack, host buffers while a checkpoint loads); the pre-flight,
``zero.auto`` and ``jaxzero plan`` hold every candidate to the same rule
(:func:`~jaxzero.accounting.planner.held_to`).

Offload (``zero.offload``, and offloaded candidates): the master and the optimizer state
live in host memory, held to a host budget per device (:func:`host_budget`:
``zero.host_memory`` when given, else ``--hardware``'s host, else on a GPU machine the
host's available memory shared by its devices). On CPU the simulated devices *are* the
host's memory: there is no separate host budget, offload moves nothing out of the
devices' memory, and an offloaded step's host bytes count against the device budget
beside its device peak (so no offloaded candidate is offered there unless a host budget
is given). The compiled ``memory_analysis`` on CPU counts host-resident arguments and
outputs as the device's; the pre-flight takes them out of the device peak and holds them
to the host budget instead (:func:`jaxzero.accounting.measure.compiled_memory`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import time
from typing import Any

import jax
import numpy as np

from jaxzero import hf
from jaxzero.accounting.estimate import format_bytes, parse_bytes, precision_bytes
from jaxzero.accounting.measure import compiled_memory
from jaxzero.accounting.planner import (
    HARDWARE,
    Built,
    Candidate,
    Hardware,
    Planner,
    Survey,
    candidates,
    held_to,
    param_split,
    shard_bytes,
    survey,
)
from jaxzero.engine import PRECISIONS
from jaxzero.mesh import MODEL, REPLICA, make_mesh
from jaxzero.models import Llama, Model, from_fields
from jaxzero.models.common import cudnn_refusal
from jaxzero.models.lora import trainable as lora_trainable
from jaxzero.train import config as config_lib
from jaxzero.train import data as data_lib
from jaxzero.train import lora_run, memguard
from jaxzero.train.config import Config, ConfigError
from jaxzero.train.optimizer import make_optimizer


def build(cfg: Config, mesh: Any, model: Model | None = None) -> tuple[Model, Any, Any]:
    """The model, its engine (every parallel/precision option reaches it here), the LR
    schedule. ``model``: a fine-tune's (:func:`finetune.resolve`), already read from
    its checkpoint; None: built from ``cfg.model``."""
    refused = cudnn_refusal(cfg.model.attention, PRECISIONS[cfg.precision.compute])
    if refused is not None:
        raise ConfigError(f"model.{refused}")
    model = from_fields(cfg.model, lora=lora_run.adapters(cfg)[0]) if model is None else model
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    try:
        engine = _engine(cfg, mesh, model, tx)
    except ValueError as e:  # a setting the model or the engine refuses, said in one line
        raise ConfigError(str(e)) from None
    return model, engine, schedule


def _engine(cfg: Config, mesh: Any, model: Model, tx: Any) -> Any:
    return model.engine(
        tx,
        mesh=mesh,
        stage=cfg.parallel.stage,
        precision=cfg.precision.compute,
        reduce_dtype=cfg.precision.reduce_dtype,
        micro_batches=cfg.parallel.micro_batches,
        max_grad_norm=cfg.optimizer.max_grad_norm,
        offload=cfg.zero.offload,
        qwz=cfg.zero.qwz,
        qgz=cfg.zero.qgz,
        hpz=cfg.zero.hpz,
        quant_block=cfg.zero.quant_block,
        ema=cfg.train.ema,
        ulysses=cfg.mesh.ulysses,
    )


def with_candidate(cfg: Config, c: Candidate) -> Config:
    """``cfg`` trained as candidate ``c`` (its offload and quantization too)."""
    cfg = config_lib.override(cfg, "parallel.stage", c.stage)  # each value checked
    cfg = config_lib.override(cfg, "parallel.micro_batches", c.micro_batches)
    cfg = config_lib.override(cfg, "model.remat", c.remat)
    cfg = config_lib.override(cfg, "zero.offload", "optimizer" if c.offload else None)
    cfg = config_lib.override(cfg, "zero.qwz", c.qwz)
    cfg = config_lib.override(cfg, "zero.qgz", c.qgz)
    if c.model is not None:
        cfg = config_lib.override(cfg, "mesh.model", c.model)
    return config_lib.override(cfg, "train.batch_size", c.batch)


def candidate_of(cfg: Config) -> Candidate:
    """The candidate ``cfg`` trains as."""
    p, z = cfg.parallel, cfg.zero
    return Candidate(
        p.stage, cfg.model.remat, p.micro_batches, cfg.train.batch_size,
        offload=z.offload == "optimizer", qwz=z.qwz, qgz=z.qgz,
    )  # fmt: skip


def first_batch(cfg: Config, corpus: Any) -> dict[str, np.ndarray]:
    """One row of the run's first batch, read as its loader reads it (its keys, dtypes
    and row shape: a loss mask and segment ids where the data has them)."""
    c = corpus
    loader = data_lib.Loader(
        c.train, cfg.model.seq_len, cfg.train.batch_size, cfg.train.seed, slice(0, 1),
        c.train_mask, c.eos, c.train_docs,
    )  # fmt: skip
    return loader.batch(1)


def batch_like(sample: dict[str, np.ndarray], batch_size: int) -> dict[str, Any]:
    """A global batch's shapes with ``sample``'s keys, dtypes and row shape."""
    return {
        k: jax.ShapeDtypeStruct((batch_size, *np.shape(v)[1:]), np.asarray(v).dtype)
        for k, v in sample.items()
    }


class Candidates:
    """Builds a run's candidates (:class:`~jaxzero.accounting.planner.Built`), each with
    its own model and engine, kept for the run that picks it.

    Args:
      cfg: the run's config (vocab and devices resolved).
      mesh: the run's mesh.
      sample: one batch of the run's data (its keys, dtypes and row shape).
      pretrained: a fine-tune's model (its Hugging Face architecture); None: ``cfg.model``.
    """

    def __init__(self, cfg: Config, mesh: Any, sample: dict[str, np.ndarray], pretrained=None):
        self.cfg, self.mesh, self.sample, self.pretrained = cfg, mesh, sample, pretrained
        self.built: dict[Candidate, tuple[Model, Any]] = {}
        self._shapes: Any = None
        self._meshes = {int(dict(mesh.shape).get(MODEL, 1)): mesh}

    def mesh_for(self, model: int | None) -> Any:
        """The mesh of a candidate that splits each layer over ``model`` devices: the
        run's devices and replica groups (None: the run's own mesh)."""
        if model is None:
            return self.mesh
        if model not in self._meshes:
            replicas = int(dict(self.mesh.shape).get(REPLICA, 1))
            self._meshes[model] = make_mesh(
                int(self.mesh.devices.size), replicas=replicas, model=model
            )
        return self._meshes[model]

    def model(self, cfg: Config) -> Model:
        lora = lora_run.adapters(cfg)[0]  # a LoRA run's every candidate has its adapters
        if self.pretrained is None:
            return from_fields(cfg.model, lora=lora)
        model = from_fields(cfg.model, hf_raw=self.pretrained.hf_config, lora=lora)
        model.hf_dir = self.pretrained.hf_dir  # type: ignore[attr-defined]  # where it came from
        return model

    def shapes(self, model: Model) -> Any:
        """The params' shapes and dtypes as the run stores them (a fine-tune's from its
        checkpoint's headers: a LoRA base in bf16 in a bf16 run); one reading: remat does
        not change them."""
        if self._shapes is None:
            if self.pretrained is not None and isinstance(model, Llama) and model.hf_dir:
                compute = PRECISIONS[self.cfg.precision.compute]
                self._shapes = hf.param_shapes(model.hf_dir, model, compute)
            else:
                self._shapes = jax.eval_shape(model.init, jax.random.key(0))
        return self._shapes

    def adopt(self, c: Candidate, model: Model, engine: Any) -> None:
        """Use the run's own model and engine for ``c`` (its step compiles once)."""
        self.built[c] = (model, engine)

    def __call__(self, c: Candidate) -> Built:
        if c not in self.built:
            cfg = with_candidate(self.cfg, c)
            model, engine, _ = build(cfg, self.mesh_for(c.model), self.model(cfg))
            self.built[c] = (model, engine)
        model, engine = self.built[c]
        shapes = self.shapes(model)
        state = engine.abstract_state(shapes)  # the plan: which params are frozen
        seq = self.cfg.model.seq_len
        flops = model.flops_per_token(model.num_params(shapes), engine.num_frozen) * c.batch * seq
        if c.remat == "full":  # the forward runs again in the backward pass
            flops *= 4 / 3
        batch = batch_like(self.sample, c.batch)
        return Built(engine, state, batch, flops)

    def release(self, keep: Candidate) -> None:
        """Drop every candidate's model and engine but ``keep``'s (with them their traced
        and compiled programs) and give the freed memory back to the system."""
        self.built = {c: b for c, b in self.built.items() if c == keep}
        gc.collect()
        try:  # glibc keeps freed pages in its arenas; the next run's buffers need them
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    def num_params(self) -> tuple[float, float]:
        """``(Ψ, frozen bytes)``: the trainable params' count and the frozen ones' bytes
        as stored (a LoRA run's base), as the planner's formulas take them."""
        trainable = lora_trainable if lora_run.enabled(self.cfg) else None
        return param_split(self.shapes(self.model(self.cfg)), trainable)


# --------------------------------------------------------------------------- the target

# The share of the budget kept free by default (docs/planning.md, "How far off it is"):
# on CPU whole runs (load, init, steps, evaluation, checkpoint) of a 135M model held up to
# 1.14x what was planned (experiments/plan_error.py), so a plan held to 80% uses at most
# 92% of the budget; on a GPU, XLA's bytes_limit less fragmentation: 10%, not yet measured.
HEADROOM = {"cpu": 0.20, "gpu": 0.10}


def headroom(configured: float | None, hw: Hardware) -> float:
    """``zero.headroom`` when set, else the target's default (:data:`HEADROOM`): the
    target is ``hw`` (``jaxzero plan --hardware h100`` on a laptop plans for a GPU)."""
    if configured is not None:
        return float(configured)
    on_gpu = hw.memory is not None or jax.default_backend() != "cpu"
    return HEADROOM["gpu" if on_gpu else "cpu"]


def hardware(name: str | None = None, device: Any = None) -> Hardware:
    """The roofline: ``name`` (a :data:`~jaxzero.accounting.planner.HARDWARE` key), else
    the device's kind when it is a known one, else the CPU's nominal figures."""
    if name is not None:
        if name not in HARDWARE:
            raise ConfigError(f"unknown hardware {name!r}: one of {', '.join(HARDWARE)}")
        return HARDWARE[name]
    kind = getattr(device or jax.local_devices()[0], "device_kind", "").lower()
    known = (hw for key, hw in HARDWARE.items() if key != "cpu" and key in kind)
    return next(known, HARDWARE["cpu"])


def mem_available() -> float | None:
    """The host's available bytes (``MemAvailable``, or a cgroup v2 limit's room, as the
    memory guard reads them; None where there is no ``/proc/meminfo``)."""
    now = memguard.host_memory()
    return now.available if now is not None else None


def budget(
    configured: str | float | None,
    local_devices: int,
    host_copy: float = 0.0,
    hw: Hardware | None = None,
) -> tuple[float, str]:
    """Bytes per device a step may peak at, and where the figure comes from.

    ``host_copy``: bytes of the host's copy of the state a checkpoint makes (counted
    against CPU devices, which live in the host's memory)."""
    if configured is not None:
        return parse_bytes(configured), "as given"
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"the limit {dev.device_kind} reports"
    if hw is not None and hw.memory is not None:
        return hw.memory, hw.name
    avail = mem_available()
    if avail is None:
        raise ConfigError("this machine reports no memory limit: give the device memory")
    share = (avail - host_copy) / local_devices
    return share, (
        f"the host's MemAvailable {format_bytes(avail)}, less {format_bytes(host_copy)} for a "
        f"checkpoint's host copy, shared by {local_devices} CPU devices"
    )


def host_budget(
    configured: str | float | None,
    local_devices: int,
    host_copy: float = 0.0,
    hw: Hardware | None = None,
) -> tuple[float | None, str]:
    """Host bytes per device that offloaded state may use, and where the figure comes
    from; None when the devices' memory is the host's (simulated CPU devices, or a
    machine that reports no memory): then host bytes count against the device budget.

    ``configured``: ``zero.host_memory`` (``jaxzero plan --host-memory``); ``hw``: a target
    whose data sheet gives its host memory (``--hardware``); ``host_copy``: a checkpoint's
    host copy of the state, which shares the host's memory on any machine."""
    if configured is not None:
        return parse_bytes(configured), "as given"
    if hw is not None and hw.host_memory is not None:
        return hw.host_memory, f"{hw.name}'s host, per device: data sheet"
    if jax.default_backend() == "cpu":
        return None, "simulated CPU devices live in it: offload moves nothing out of it"
    avail = mem_available()
    if avail is None:
        return None, "this machine reports no host memory: counted with the device's"
    share = (avail - host_copy) / local_devices
    return share, (
        f"the host's MemAvailable {format_bytes(avail)}, less {format_bytes(host_copy)} for a "
        f"checkpoint's host copy, shared by {local_devices} devices"
    )


def beyond_options(mesh: Any, host: float | None) -> dict[str, Any]:
    """Which of issue 47's options the candidates include (:func:`~jaxzero.accounting.
    planner.candidates`' keywords): offload where a host budget apart from the devices'
    is known; quantized collectives where the mesh has a slow axis (a hybrid mesh,
    replicas across groups: its groups span nodes)."""
    return {"offload": host is not None, "quantized": int(dict(mesh.shape).get(REPLICA, 1)) > 1}


def keep_choices(cfg: Config, cands: list[Candidate]) -> list[Candidate]:
    """``cands`` with the run's own offload and ZeRO++ settings kept: the planner chooses
    the stage, remat and micro-batches, never drops what the user asked for. A stage that
    cannot take them is left out (offload and qgZ need 1-3; qwZ and hpZ need 3)."""
    z = cfg.zero
    if not (z.offload or z.qwz or z.qgz or z.hpz):
        return cands
    lowest = 3 if (z.qwz or z.hpz) else 1
    kept = [
        dataclasses.replace(
            c,
            offload=c.offload or z.offload == "optimizer",
            qwz=c.qwz or z.qwz,
            qgz=z.qgz or c.qgz,
        )
        for c in cands
        if c.stage >= lowest
    ]
    return list(dict.fromkeys(kept))


def unique_bytes(state: Any) -> float:
    """Bytes of one copy of every leaf of an abstract state (what a checkpoint saves)."""
    return float(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)))


def plan_run(
    cfg: Config,
    cands: Candidates,
    budget_bytes: float,
    note: str,
    hw: Hardware,
    *,
    which: list[Candidate] | None = None,
    max_batch: int = 1,
    exhaustive: bool = False,
    host: tuple[float | None, str] | None = None,
) -> Survey:
    """Survey a run's candidates (default: every stage, remat and micro-batch count at its
    global batch, with offload and quantization where :func:`beyond_options` offers them)
    against ``budget_bytes`` per device less the run's headroom.

    ``host``: the host budget per device and its note (:func:`host_budget`; default:
    ``zero.host_memory``, else the machine's)."""
    n = int(cands.mesh.devices.size)
    group = n // int(dict(cands.mesh.shape).get(REPLICA, 1))
    rows = row_devices(cfg, cands.mesh)
    if host is None:
        host = host_budget(cfg.zero.host_memory, jax.local_device_count())
    cands_ = which or candidates(cfg.train.batch_size, rows, **beyond_options(cands.mesh, host[0]))
    cands_ = keep_choices(cfg, cands_)
    prec = precision_bytes("mixed" if cfg.precision.compute == "bf16" else "fp32", "adamw")
    psi, frozen = cands.num_params()
    held = f" (+{format_bytes(frozen)} frozen)" if frozen else ""
    split = ""
    if cfg.mesh.model > 1:
        split = f", each layer split over {cfg.mesh.model} (mesh.model)"
    elif cfg.mesh.ulysses:
        split = f", each row over {group} (mesh.ulysses)"
    title = (
        f"{cfg.model.arch} {psi / 1e6:,.1f}M params{held}, global batch {cfg.train.batch_size} x "
        f"{cfg.model.seq_len} tokens, {n} devices (groups of {group}{split}), "
        f"{cfg.precision.compute}, AdamW"
    )
    return survey(
        cands, cands_, budget_bytes, hw, devices=n, group=group, num_params=psi,
        frozen_bytes=frozen, precision=prec, max_batch=max_batch, exhaustive=exhaustive,
        budget_note=note, title=title, headroom=headroom(cfg.zero.headroom, hw),
        host_budget=host[0], host_note=host[1], batch_devices=rows, model=cfg.mesh.model,
    )  # fmt: skip


def row_devices(cfg: Config, mesh: Any) -> int:
    """The devices a global batch's rows are split over: all but the model axis' (a
    model group shares its rows); with Ulysses the replica groups (each splits its rows'
    sequences over its devices)."""
    shape = dict(mesh.shape)
    if cfg.mesh.ulysses:
        return int(shape.get(REPLICA, 1))
    return int(mesh.devices.size) // int(shape.get(MODEL, 1))


# --------------------------------------------------------------------------- pre-flight


@dataclasses.dataclass(frozen=True)
class Checked:
    """The pre-flight's outcome: the config and model/engine the run trains with."""

    cfg: Config
    model: Model
    engine: Any
    line: str  # what to print
    peak: int = 0  # bytes per device the step (or its evaluation) peaks at, compiled
    state_bytes: float = 0.0  # one copy of every leaf of the state: a checkpoint's host copy


def preflight(
    cfg: Config, mesh: Any, model: Model, engine: Any, sample: dict, pretrained=None
) -> Checked:
    """Compile the run's step (and evaluation) before the first step; refuse a run whose
    peak exceeds the budget less its headroom in one line naming the peak, the limit and
    what fits; with ``zero.auto`` train the planner's first choice instead."""
    began = time.perf_counter()
    cands = Candidates(cfg, mesh, sample, pretrained)
    own = candidate_of(cfg)
    cands.adopt(own, model, engine)
    built = cands(own)
    hw = hardware()
    whole = unique_bytes(built.state)
    host = whole if jax.default_backend() == "cpu" else 0.0
    limit, note = budget(cfg.zero.device_memory, jax.local_device_count(), host)
    hosted = host_budget(cfg.zero.host_memory, jax.local_device_count(), whole - host)
    share = headroom(cfg.zero.headroom, hw)
    held, said = held_to(limit, share), _limit_note(limit, note, share)
    if cfg.zero.auto:
        return _auto(cfg, cands, limit, note, hw, began, hosted)
    planner = Planner(
        cands, limit, hw, int(mesh.devices.size), headroom=share, host_budget=hosted[0]
    )
    row = planner.row(own)
    if row.status == "failed":
        raise ConfigError(f"the step does not compile: {row.why}")
    # offload: the device peak leaves the host-resident state out; where the host is the
    # devices' own memory (CPU) that state counts here too, else against the host budget
    shared = row.host if hosted[0] is None else 0
    need = max(row.peak, _eval_need(built, row.persistent)) + shared
    hosting = planner.host_held is not None and row.host > planner.host_held
    if need > held or hosting:
        found = plan_run(cfg, cands, limit, note, hw, max_batch=0, host=hosted)
        what = (
            f"the step holds {format_bytes(row.host)} of host memory per device (offload) and "
            f"the host's limit is {format_bytes(planner.host_held or 0)} ({hosted[1]})"
            if hosting
            else f"the step needs {format_bytes(need)} per device at its peak"
            + (
                f" ({format_bytes(shared)} of it offloaded to the host, its memory)"
                if shared
                else ""
            )
            + f" ({own.describe()}, global batch {own.batch}; compiled) and the limit is "
            f"{format_bytes(held)} ({said})"
        )
        raise ConfigError(
            f"will not fit: {what}. What fits: {found.suggestions()}; set them "
            "(--stage, --micro-batches, --set model.remat=...) or --set zero.auto=true, "
            "or a smaller train.batch_size"
        )
    line = (
        f"fits: peak {format_bytes(need)} of {format_bytes(held)} per device ({said}; "
        f"compiled in {time.perf_counter() - began:.1f}s)"
    )
    if row.host and not shared:
        line += (
            f"; offload: {format_bytes(row.host)} of host memory per device, of "
            f"{format_bytes(planner.host_held or 0)} ({hosted[1]})"
        )
    return Checked(cfg, model, engine, line, need, whole)


def _limit_note(limit: float, note: str, share: float) -> str:
    """Where the held bytes come from: the budget and its source, less the headroom."""
    if not share:
        return note
    return f"{format_bytes(limit)} per device: {note}; less {share:.0%} headroom, zero.headroom"


def _eval_need(built: Built, persistent: int) -> int:
    """Bytes an evaluation needs on the device: the state's device part (``persistent``)
    stays while it runs (an offloaded part stays in host memory)."""
    compiled = built.engine.compile_eval(built.state, built.batch)
    params = shard_bytes(built.state.params)
    return persistent - params + compiled_memory(compiled).device_peak


def _resident() -> float | None:
    now = memguard.host_memory()
    return now.resident if now is not None else None


def _auto(
    cfg: Config,
    cands: Candidates,
    limit: float,
    note: str,
    hw: Hardware,
    began: float,
    host: tuple[float | None, str] | None = None,
):
    """The fastest candidate whose step and evaluation fit with the headroom; the others'
    programs are released before the run allocates anything."""
    before = _resident()
    found = plan_run(cfg, cands, limit, note, hw, max_batch=0, host=host)
    held = found.held
    best, need, said = None, 0, _limit_note(limit, note, found.headroom)
    for row in found.fitting():  # fastest first: the first whose evaluation fits too
        shared = row.host if found.host_budget is None else 0  # the host is the devices'
        need = max(row.peak, _eval_need(cands(row.candidate), row.persistent)) + shared
        if need <= held:
            best = row
            break
        row.status, row.why = "over", f"its evaluation needs {format_bytes(need)}"
    if best is None:
        raise ConfigError(
            f"zero.auto: nothing fits in {format_bytes(held)} per device ({said}) at global "
            f"batch {cfg.train.batch_size}: more devices, or a smaller train.batch_size"
        )
    chosen = with_candidate(cfg, best.candidate)
    model, engine = cands.built[best.candidate]
    planned = _resident()
    cands.release(best.candidate)
    after = _resident()
    compiled = sum(1 for r in found.rows if r.status in ("fits", "over"))
    line = (
        f"zero.auto: {best.candidate.describe()} (peak {format_bytes(best.peak)} of "
        f"{format_bytes(held)} per device, {said}; first of {len(found.fitting())} "
        f"that fit, {compiled} compiled in {time.perf_counter() - began:.1f}s"
    )
    if before is not None and planned is not None and after is not None:
        line += (
            f"; the planner held {format_bytes(max(planned - before, 0))} of host memory, "
            f"{format_bytes(max(planned - after, 0))} released"
        )
    whole = unique_bytes(cands(best.candidate).state)
    return Checked(chosen, model, engine, line + ")", need, whole)
