"""An engine's settings: its arguments validated, and every default decided, once.

:func:`make_settings` turns :class:`~jaxzero.Engine`'s arguments into a frozen
:class:`Settings` (backend defaults resolved: donation, buckets, the dot barrier, the
compiler preset); with the params' shapes it is all a :class:`~jaxzero.plan.Plan` needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from jaxzero import backend
from jaxzero import ema as ema_lib
from jaxzero import loss as loss_lib
from jaxzero.mesh import REPLICA, batch_axes, model_shards, num_shards
from jaxzero.partition import Rule
from jaxzero.step_config import QGZ_BITS, StepConfig

__all__ = ["Settings"]

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def _dtype(name: Any, what: str) -> Any:
    if name in PRECISIONS:
        return PRECISIONS[name]
    if name in (jnp.float32, jnp.bfloat16, "float32", "bfloat16"):
        return jnp.dtype(name).type
    raise ValueError(f"unknown {what} {name!r}: use 'fp32' or 'bf16'")


@dataclasses.dataclass(frozen=True)
class Settings:
    """An engine's validated choices: everything a plan depends on but the shapes.

    Attributes:
      step: the step's static choices (stage, dtypes, micro-batches, buckets, ...).
      mesh: the device mesh.
      precision: ``"fp32"`` or ``"bf16"``, as the engine was given it.
      rules, stacked, min_shard_size: how leaves are laid out (:func:`layouts_for`).
      donate: whether the jitted step donates its input state.
      compiler_options: the XLA options the step is compiled with.
      ema: the EMA's decay, a float or ``step -> decay`` (:mod:`jaxzero.ema`); None: no
        EMA. Not compared, as the optimizer's learning rate is not: ``step.ema`` says
        whether the state has one.
    """

    step: StepConfig
    mesh: Mesh
    precision: str
    rules: tuple[Rule, ...]
    stacked: str | None
    min_shard_size: int
    donate: bool
    compiler_options: Mapping[str, Any]
    ema: ema_lib.Decay | None = dataclasses.field(default=None, compare=False)

    @property
    def num_shards(self) -> int:
        """N: the devices a sharded leaf is split over (the working params' with hpZ)."""
        return num_shards(self.mesh)

    @property
    def model_shards(self) -> int:
        """Tensor parallelism's degree: the ``model`` axis' size (1: none)."""
        return model_shards(self.mesh)

    @property
    def state_shards(self) -> int:
        """The devices the master and optimizer state are split over: N, or with hpZ every
        device (the leaves are padded to a multiple of it)."""
        return self.mesh.size if self.step.hpz else self.num_shards  # hpZ: no model axis

    @property
    def batch_sharding(self) -> NamedSharding:
        """A global batch's layout: its leading dim split over the batch axes (Ulysses:
        over the replica axis, and dim 1, the sequence, over data)."""
        return NamedSharding(self.mesh, self.step.batch_spec)


OFFLOADS = ("optimizer",)  # Engine(offload=...): what lives in host memory


def _check_ulysses(ulysses: bool, mesh: Mesh, loss_takes_rng: bool, hpz: bool) -> None:
    """Ulysses' refusals, each in one line naming what to change."""
    if not isinstance(ulysses, bool):
        raise TypeError(f"ulysses must be True or False, got {ulysses!r}")
    if not ulysses:
        return
    what = None
    if model_shards(mesh) > 1:
        what = "a model axis (tensor parallelism)"
    elif loss_takes_rng:
        what = "loss_takes_rng (its keys are drawn a row, and a device holds part of a row)"
    elif hpz:
        what = "hpz"
    if what is not None:
        raise ValueError(f"ulysses=True with {what} is not supported yet: drop one of them")


def beyond_zero(
    stage: int,
    hybrid: bool,
    offload: str | None,
    qwz: bool,
    qgz: str | None,
    hpz: bool,
    quant_block: int,
) -> dict[str, Any]:
    """The :class:`StepConfig` fields of offload and ZeRO++ (qwZ, qgZ, hpZ), each
    combination that makes no sense refused in one line naming the option. ``hybrid``:
    whether the mesh replicates the state over groups (a ``replica`` axis); the run's
    config checks the same rules before any device exists (:mod:`jaxzero.train.config`)."""
    if offload not in (None, *OFFLOADS):
        raise ValueError(f"offload={offload!r}: use None or 'optimizer'")
    if offload and stage == 0:
        raise ValueError(
            "offload='optimizer' needs stage 1, 2 or 3: at stage 0 every device holds the "
            "whole state, so offloading it saves nothing a sharded stage would not"
        )
    for name, flag in (("qwz", qwz), ("hpz", hpz)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if qwz and stage != 3:
        raise ValueError(
            f"qwz=True quantizes stage 3's weight all-gathers; stage {stage} gathers no "
            "weights in the forward pass (use stage=3, or drop qwz)"
        )
    if qgz not in (None, False, *QGZ_BITS):
        raise ValueError(f"qgz={qgz!r}: use None, 'int8' or 'int4'")
    if qgz and stage == 0:
        raise ValueError(
            f"qgz={qgz!r} reduce-scatters gradients in {qgz}; stage 0 all-reduces them "
            "whole (use stage 1, 2 or 3, or drop qgz)"
        )
    if hpz and not hybrid:
        raise ValueError(
            "hpz=True keeps a params copy sharded within each group of a hybrid mesh; this "
            "mesh has one group (make_mesh(n, replicas=R), or mesh.group_size in a run)"
        )
    if hpz and stage != 3:
        raise ValueError(f"hpz=True is stage 3's secondary params partition; got stage {stage}")
    if isinstance(quant_block, bool) or not isinstance(quant_block, int) or quant_block < 1:
        raise ValueError(f"quant_block must be a positive number of elements, got {quant_block!r}")
    if qgz == "int4" and quant_block % 2:
        raise ValueError(
            f"qgz='int4' packs two values a byte: quant_block={quant_block} must be even"
        )
    return {
        "offload": offload == "optimizer",
        "qwz": qwz,
        "qgz_bits": QGZ_BITS.get(qgz or "", 0),
        "hpz": hpz,
        "quant_block": quant_block,
    }


def make_settings(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    stage: int,
    precision: str,
    reduce_dtype: str | None,
    micro_batches: int,
    max_grad_norm: float | None,
    per_layer: bool,
    rules: Sequence[Rule],
    stacked: str | None,
    min_shard_size: int,
    bucket_mb: float | None,
    donate: bool | None,
    dot_barrier: bool | None,
    loss_takes_rng: bool,
    seed: int,
    compiler_options: dict[str, Any] | None,
    offload: str | None = None,
    qwz: bool = False,
    qgz: str | None = None,
    hpz: bool = False,
    quant_block: int = 2048,
    ema: Any = None,
    model_state: bool = False,
    ulysses: bool = False,
) -> tuple[optax.GradientTransformation, Settings]:
    """``(optimizer, settings)`` from :class:`~jaxzero.Engine`'s arguments (documented
    there); each bad one is refused in one line. ``optax.MultiSteps`` is unwrapped."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
    if optimizer is None:
        raise TypeError(
            "optimizer is required: pass an optax transformation, e.g. optax.adamw(1e-3)"
        )
    if isinstance(optimizer, optax.MultiSteps):  # accumulates over calls of step
        optimizer = optimizer.gradient_transformation()
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax transformation (e.g. optax.adamw(1e-3)), got {optimizer!r}"
        )
    loss_lib.check_rng_contract(loss_fn, loss_takes_rng, model_state)
    decay = ema_lib.check(ema)
    hybrid = REPLICA in mesh.axis_names
    _check_ulysses(ulysses, mesh, loss_takes_rng, hpz)
    if hpz and model_shards(mesh) > 1:
        raise ValueError(
            "hpz=True with a model axis is not supported yet: hpZ's params copy is laid out "
            "over the replica and data axes only (drop hpz, or use model=1)"
        )
    beyond = beyond_zero(stage, hybrid, offload, qwz, qgz, hpz, quant_block)
    compute_dtype = _dtype(precision, "precision")
    bucket, whole_tree_bucket = backend.bucket_bytes(bucket_mb, mesh)
    axes = batch_axes(mesh)
    settings = Settings(
        step=StepConfig(
            stage=stage,
            compute_dtype=compute_dtype,
            reduce_dtype=_dtype(reduce_dtype or precision, "reduce_dtype"),
            # hpZ keeps fp32 working params apart from the master even in fp32 training
            mixed=compute_dtype != jnp.float32 or hpz,
            micro_batches=micro_batches,
            max_grad_norm=max_grad_norm,
            per_layer=per_layer,
            batch_axes=axes,
            batch_devices=math.prod(mesh.shape[a] for a in axes),
            model_axis=model_shards(mesh) > 1,
            ulysses=ulysses,
            bucket_bytes=bucket,
            whole_tree_bucket_bytes=whole_tree_bucket,
            dot_barrier=backend.dot_barrier(dot_barrier, mesh),
            rng_seed=int(seed) if loss_takes_rng else None,
            ema=decay is not None,
            model_state=model_state,
            **beyond,
        ),
        mesh=mesh,
        precision=precision,
        rules=tuple(rules),
        stacked=stacked,
        min_shard_size=min_shard_size,
        donate=backend.donate(donate, mesh, stage),
        compiler_options=backend.compiler_options(mesh, compiler_options),
        ema=decay,
    )
    return optimizer, settings
