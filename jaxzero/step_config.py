"""A step's static choices (:class:`StepConfig`) and what its loss may be (``LossFn``).

The settings build it (:mod:`jaxzero.settings`); the step (:mod:`jaxzero.step`) and
the gradient reduction (:mod:`jaxzero.gradients`) read it; everything else a step
takes comes in as arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.sharding import PartitionSpec as P

from jaxzero.mesh import DATA

QGZ_BITS = {"int8": 8, "int4": 4}  # Engine(qgz=...): the gradients' wire format, its bits
LossFn = Callable[..., Any]  # (params, batch[, rng][, state=, train=]) -> a jaxzero.loss form


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static choices of a step; everything else comes in as arrays."""

    stage: int
    compute_dtype: Any
    reduce_dtype: Any
    mixed: bool  # separate fp32 master params (bf16 training)
    micro_batches: int
    max_grad_norm: float | None
    per_layer: bool  # the model calls use_params per layer
    batch_axes: tuple[str, ...]
    batch_devices: int  # devices the global batch is split over
    # tensor parallelism: a "model" axis splits the layers (jaxzero.tensor_parallel); the
    # gradient of a leaf not split over it is summed over it (sequence parallelism: each
    # model device's part comes from its slice of the sequence or of the heads)
    model_axis: bool = False
    # context parallelism (DeepSpeed-Ulysses): the data axis splits each sequence instead
    # of the rows (the replica axis, if any, splits the rows); the model all-to-alls its
    # attention over it. ZeRO is unchanged: its reductions over data sum the slices'.
    ulysses: bool = False
    bucket_bytes: int = 0  # pack gradient/param collectives up to this size
    whole_tree_bucket_bytes: int = 0  # the same, in a per_layer=False model's stage-3 use_params
    dot_barrier: bool = False  # collectives.dot_barrier on each micro-batch's gradients
    rng_seed: int | None = None  # loss_fn(params, batch, rng) gets its key from it
    # beyond ZeRO (docs/offload.md, docs/zeropp.md): master params and optimizer state in
    # host memory; int8 weight gathers (qwZ); gradients reduced in int8/int4 (qgZ: the
    # bits, 0 off); a secondary params copy sharded within the group (hpZ)
    offload: bool = False
    qwz: bool = False
    qgz_bits: int = 0
    hpz: bool = False
    quant_block: int = 2048  # elements a quantization scale covers (qwZ, qgZ)
    ema: bool = False  # the state keeps an EMA of the master params (jaxzero.ema)
    # the loss gets state=/train= and returns WithState (Engine(model_state=...))
    model_state: bool = False

    @property
    def extra_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.batch_axes if a != DATA)

    @property
    def batch_spec(self) -> P:
        """How a batch leaf lies on the mesh: rows over the batch axes; with Ulysses rows
        over the replica axis and the sequence (dim 1) over data."""
        if self.ulysses:
            return P(self.extra_axes or None, DATA)
        return P(self.batch_axes)
