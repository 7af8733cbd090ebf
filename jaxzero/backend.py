"""How the step is compiled on each backend: donation, the dot barrier, XLA's overlap passes.

Three choices depend on the hardware, not on the model:

* **Donation.** Donating the train state lets XLA write the new state into the
  old buffers, so a step needs one copy of the state, not two. That is the point
  on accelerators, where the state is what fills the device, and there every
  stage donates. On XLA:CPU a donating step is slower wherever the params are whole
  (stages 0-2) and costs nothing at stage 3, so there only stage 3 donates by
  default (:data:`DONATE`); ``Engine(donate=...)`` is the switch.
* **Overlap (GPU).** ZeRO-3 pays only if layer i+1's all-gather runs while layer
  i computes, and stage 2–3's reduce-scatters while the backward goes on. XLA's
  GPU compiler does exactly this (FSDP's prefetch, done by the scheduler) when
  its latency-hiding scheduler and collective pipelining are on; they are off by
  default because they lengthen compilation. :data:`GPU_OPTIONS` turns them on
  for the step only (per-``jit`` ``compiler_options``, not a process-wide
  ``XLA_FLAGS``), spelled as the installed XLA spells them (:data:`OLDER_SPELLINGS`),
  and ``Engine(compiler_options=...)`` overrides any of them.
* **Weight-gradient dots (CPU).** A collective written right after autodiff lets
  XLA fold a weight gradient's transpose into its dot, which XLA:CPU then runs
  with Eigen instead of YNNPACK (:func:`jaxzero.collectives.dot_barrier`). That
  was 6–7% of a step on the plain-pytree GPT; :data:`DOT_BARRIER` puts a barrier
  there on CPUs only, on the gradients that may be a dot's
  (:func:`jaxzero.collectives.dot_gradients`: not an embedding's scatter-add), and
  ``Engine(dot_barrier=...)`` is the switch.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import TypeAlias

import jax
from jax.sharding import Mesh, SingleDeviceSharding

# The stages whose step donates its state by default, per platform (others: every
# stage). Measured on XLA:CPU across the benchmark zoo (python -m experiments.bench_step --zoo
# --both-donations, docs/dev/performance-log.md), jaxzero's donating step over its non-donating
# one: stages 0-2, where the whole params are an input and an output, 0.91-1.39x,
# geometric mean 1.06x (six models, three invocations at stage 0, one at stages 1-2);
# stage 3, whose params are stored sharded, 0.93-1.05x (1.32x once, in a run the machine
# shared with a compile job). So on CPUs speed decides
# below stage 3 and memory (one copy of the state, not two) at stage 3, the stage a
# user picks for memory; accelerators always donate.
DONATE: dict[str, tuple[int, ...]] = {"cpu": (3,), "gpu": (0, 1, 2, 3), "tpu": (0, 1, 2, 3)}

# Engine(bucket_mb=None): the largest packed collective, in MiB: stages 1-2's reduce-scatter
# and all-gather of the whole model, and each per-layer use_params call's at stages 2-3.
BUCKET_MB = 64

# Engine(bucket_mb=None): the bucket of a per_layer=False model's stage-3 use_params call
# (the whole tree gathered before the forward pass and reduce-scattered after the
# backward), per platform (others: BUCKET_MB). On XLA:CPU packing the whole tree there
# costs what packing a layer saves: interleaved in one process, issue 22's user_gpt ran
# at 1.30x plain jit packed and 0.96x one collective a leaf (packing the gather alone
# 1.12x, the reduce-scatter alone 1.06x), the plain GPT 1.13x and 1.11x; per layer, the
# scanned Llama ran at 1.04x packed and 1.21x a leaf. Stage 2's whole-tree reduce-scatter
# packs (BUCKET_MB), as stage 1's does: one a leaf measured 1.10x against 1.07x packed
# (user_gpt), 1.12x / 1.06x (plain), 1.05x / 0.98x (convnet); only embed, whose 16 MiB
# table the packing copies, was faster a leaf (0.77x / 0.94x) (docs/dev/performance-log.md).
WHOLE_TREE_BUCKET_MB: dict[str, float] = {"cpu": 0}

# Whether gradients pass collectives.dot_barrier before reduction, per platform (others:
# False). On XLA:CPU the hand-written shard_map step of the plain-pytree GPT went
# from 1.07x to 1.01x plain jit with it; GPUs and TPUs take transposed dots as they
# are, so there it would only add a transpose per 2-D leaf.
DOT_BARRIER: dict[str, bool] = {"cpu": True}

MiB = 1 << 20

# An XLA option's value: the kinds XLA's option overrides take.
OptionValue: TypeAlias = str | bool | int | float

# XLA's collective pipelining modes (xla.proto's CollectivePipeliningMode): ON pipelines
# every collective that can be, what the older boolean flags' true did.
PIPELINE_ON = "COLLECTIVE_PIPELINING_MODE_ON"

# XLA:GPU options for the train step (the same passes XLA's -O1 enables, plus
# combine thresholds sized for layer-sized collectives), spelled as the newest XLA
# spells them; :data:`OLDER_SPELLINGS` says what older builds call them.
GPU_OPTIONS: dict[str, OptionValue] = {
    # schedule async collectives to overlap with independent compute
    "xla_gpu_enable_latency_hiding_scheduler": True,
    # move the next iteration's all-gather / this iteration's reduce-scatter and
    # all-reduce across the while-loop boundary of scanned layers (prefetch)
    "xla_gpu_pipeline_all_gather": PIPELINE_ON,
    "xla_gpu_pipeline_reduce_scatter": PIPELINE_ON,
    "xla_gpu_pipeline_all_reduce": PIPELINE_ON,
    # unroll loops by two so a gather can be in flight across iterations
    "xla_gpu_enable_while_loop_double_buffering": True,
    # combine small collectives (norm scales, biases) up to these sizes; a whole
    # layer's packed gather is one collective already
    "xla_gpu_all_gather_combine_threshold_bytes": 256 * MiB,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 256 * MiB,
    "xla_gpu_all_reduce_combine_threshold_bytes": 256 * MiB,
}

# Options XLA renamed, newest spelling -> (older spelling, {newer value: older value}).
# In 2026 (XLA PR 45836; jaxlib 0.12 has only the new names, 0.10 only the old) the
# booleans xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce} became the
# modes xla_gpu_pipeline_*, whose DEFAULT follows the optimization level.
OLDER_SPELLINGS: dict[str, tuple[str, dict[OptionValue, OptionValue]]] = {
    f"xla_gpu_pipeline_{c}": (
        f"xla_gpu_enable_pipelined_{c}",
        {PIPELINE_ON: True, "COLLECTIVE_PIPELINING_MODE_OFF": False},
    )
    for c in ("all_gather", "reduce_scatter", "all_reduce")
}

PRESETS: dict[str, dict[str, OptionValue]] = {"gpu": GPU_OPTIONS}


def platform(mesh: Mesh) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: where the mesh's devices are."""
    p = mesh.devices.flat[0].platform
    return "gpu" if p in ("cuda", "rocm") else p


def _switch(
    name: str, choice: bool | None, defaults: Mapping[str, bool], other: bool, mesh: Mesh
) -> bool:
    if choice is None:
        return defaults.get(platform(mesh), other)
    if not isinstance(choice, bool):
        raise TypeError(
            f"{name} must be True, False or None (the backend's default), got {choice!r}"
        )
    return choice


def donate(choice: bool | None, mesh: Mesh, stage: int) -> bool:
    """``choice``, or the platform's default for ``stage`` (:data:`DONATE`) when it is
    None."""
    defaults = {p: stage in stages for p, stages in DONATE.items()}
    return _switch("donate", choice, defaults, True, mesh)


def bucket_bytes(choice: float | None, mesh: Mesh) -> tuple[int, int]:
    """The largest packed collective, in bytes, of a layer (and of stages 1-2's end of
    step) and of a stage-3 whole-tree ``use_params`` call: ``choice`` MiB for both, or
    :data:`BUCKET_MB` and the platform's :data:`WHOLE_TREE_BUCKET_MB` when it is None."""
    if choice is None:
        whole = WHOLE_TREE_BUCKET_MB.get(platform(mesh), BUCKET_MB)
        return int(BUCKET_MB * 2**20), int(whole * 2**20)
    if isinstance(choice, bool) or not isinstance(choice, (int, float)) or choice < 0:
        raise ValueError(f"bucket_mb must be a non-negative number of MiB, got {choice!r}")
    return int(choice * 2**20), int(choice * 2**20)


def dot_barrier(choice: bool | None, mesh: Mesh) -> bool:
    """``choice``, or the platform's default (:data:`DOT_BARRIER`) when it is None."""
    return _switch("dot_barrier", choice, DOT_BARRIER, False, mesh)


@functools.cache
def _known(backend: str, name: str, value: OptionValue) -> bool:
    """Whether this XLA build takes option ``name`` (flags come and go between versions).

    Compiles an identity once per option; a wrongly typed value raises here too.
    """
    device = jax.local_devices(backend=backend)[0]
    x = jax.ShapeDtypeStruct((), "float32", sharding=SingleDeviceSharding(device))
    try:
        jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(x).compile()
    except Exception as e:  # noqa: BLE001 - XLA raises a generic runtime error
        if "No such compile option" in str(e):
            return False
        reason = str(e).strip().splitlines()[0]
        raise ValueError(f"XLA cannot compile with option {name}={value!r}: {reason}") from None
    return True


def _spellings(name: str, value: OptionValue) -> list[tuple[str, OptionValue]]:
    """``(name, value)``, then the same option as the other XLA line spells it, if any."""
    for new, (old, values) in OLDER_SPELLINGS.items():
        if name == new and value in values:
            return [(name, value), (old, values[value])]
        newer = {v: k for k, v in values.items()}
        if name == old and value in newer:
            return [(name, value), (new, newer[value])]
    return [(name, value)]


def _aliases(name: str) -> set[str]:
    return next(
        ({new, old} for new, (old, _) in OLDER_SPELLINGS.items() if name in (new, old)), {name}
    )


def spelled(plat: str, name: str, value: OptionValue) -> tuple[str, OptionValue] | None:
    """``(name, value)`` as this XLA build spells the option, or None if it has none."""
    return next(((n, v) for n, v in _spellings(name, value) if _known(plat, n, v)), None)


def compiler_options(
    mesh: Mesh, overrides: Mapping[str, OptionValue | None] | None = None
) -> dict[str, OptionValue]:
    """The step's XLA options: the platform's preset, updated by ``overrides``.

    An override of ``None`` drops that option from the preset; ``{}`` keeps the
    preset; pass ``{name: None for name in GPU_OPTIONS}`` for XLA's own defaults.
    Options are passed as this XLA build spells them (a renamed option in either
    spelling, :data:`OLDER_SPELLINGS`). Preset options this build does not know are
    dropped with a warning, so a newer or older jaxlib never fails to compile the
    step because of the preset.
    """
    plat = platform(mesh)
    preset: dict[str, OptionValue] = {}
    unknown: list[str] = []
    for k, v in PRESETS.get(plat, {}).items():
        found = spelled(plat, k, v)
        if found is None:
            unknown.append(k)
        else:
            preset[found[0]] = found[1]
    if unknown:
        warnings.warn(
            f"this XLA build does not know {', '.join(unknown)}; the step is compiled without them",
            stacklevel=3,
        )
    for k, override in (overrides or {}).items():
        for n in _aliases(k):
            preset.pop(n, None)
        if override is None:
            continue
        found = spelled(plat, k, override)
        if found is None:
            raise ValueError(
                f"compiler_options: {k!r} is not an option of this XLA build ({plat}); "
                "see the XLA flags of your jaxlib version (XLA_FLAGS=--help)"
            )
        preset[found[0]] = found[1]
    return preset
