"""The training step as one device sees it, run inside ``shard_map``.

Every collective is written here or in ``hooks.py``; nothing is left to the
compiler's sharding propagation. Per stage, one step does:

* stage 0: local gradients → ``psum`` (all-reduce) → replicated update.
* stage 1: local gradients → ``psum_scatter`` → update of this device's slice of the
  master params and optimizer state → ``all_gather`` of the new working params.
* stage 2: as stage 1, but each layer's gradient is reduce-scattered during the
  backward pass (``hooks.use_params``), so the full gradient never exists at once.
* stage 3: params stay sharded; each layer all-gathers its params before use,
  again in the backward pass (remat policy), and reduce-scatters its gradient.

With ``k`` micro-batches, stages 0–1 accumulate full local gradients and
communicate once per step; stages 2–3 reduce-scatter (and stage 3 gathers) once
per micro-batch, accumulating only this device's gradient slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxzero import collectives
from jaxzero.hooks import Stored, UseOp, use_params
from jaxzero.mesh import DATA
from jaxzero.partition import LeafLayout, is_layout
from jaxzero.state import TrainState

LossFn = Callable[[Any, Any], jax.Array]


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

    @property
    def extra_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.batch_axes if a != DATA)


def _map(f, layouts, *trees):
    return jax.tree.map(lambda lay, *xs: f(lay, *xs), layouts, *trees, is_leaf=is_layout)


def model_view(cfg: StepConfig, layouts: Any, params: Any, slots: Any) -> Any:
    """What ``loss_fn`` receives: plain arrays (stages 0–1) or gathered/hooked leaves."""
    if cfg.stage <= 1:
        return params

    def wrap(lay: LeafLayout, value, slot):
        op = UseOp(lay, cfg.stage == 3, jnp.dtype(cfg.reduce_dtype).name,
                   1.0 / cfg.batch_devices, cfg.extra_axes)
        return Stored(value, slot, op)

    stored = _map(wrap, layouts, params, slots)
    return stored if cfg.per_layer else use_params(stored)


def _slots(layouts: Any, sharded: bool) -> Any:
    """Zero gradient slots shaped like this device's slice of each leaf."""
    return _map(lambda lay: jnp.zeros(lay.shard_shape if sharded else lay.shape, jnp.float32),
                layouts)


def local_gradients(cfg: StepConfig, layouts: Any, loss_fn: LossFn, params: Any, batch: Any):
    """Mean loss and gradients of this device's batch, summed over micro-batches.

    Stages 0–1 return full, unreduced gradients w.r.t. the working params; stages
    2–3 return this device's slice of the already reduced (global-mean) gradient.
    """
    hooked = cfg.stage >= 2
    diff0 = _slots(layouts, True) if hooked else params

    def loss_of(diff, mb):
        view = model_view(cfg, layouts, params, diff) if hooked else diff
        loss = loss_fn(view, mb)
        if jnp.shape(loss) != ():
            raise TypeError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}")
        return loss.astype(jnp.float32)

    grad_fn = jax.value_and_grad(loss_of)
    k = cfg.micro_batches
    if k == 1:
        return grad_fn(diff0, batch)

    mbs = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

    def body(carry, mb):
        loss_sum, acc = carry
        loss, g = grad_fn(diff0, mb)
        return (loss_sum + loss, jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), diff0)
    (loss_sum, acc), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), mbs)
    return loss_sum / k, jax.tree.map(lambda a: a / k, acc)


def reduce_gradients(cfg: StepConfig, layouts: Any, grads: Any) -> Any:
    """Stage 0: all-reduce; stage 1: reduce-scatter. Returns fp32 global-mean gradients."""
    rd, scale = cfg.reduce_dtype, 1.0 / cfg.batch_devices

    def one(lay: LeafLayout, g):
        g = g.astype(rd) * jnp.asarray(scale, rd)
        if cfg.stage == 0:
            g = collectives.all_reduce(g, cfg.extra_axes)
        else:
            g = collectives.reduce_scatter(g, lay, cfg.extra_axes)
        return g.astype(jnp.float32)

    return _map(one, layouts, grads)


def global_norm(cfg: StepConfig, layouts: Any, grads: Any) -> jax.Array:
    """The true L2 norm of the whole gradient, however it is sharded."""
    sharded = jnp.zeros((), jnp.float32)
    whole = jnp.zeros((), jnp.float32)
    for lay, g in zip(jax.tree.leaves(layouts, is_leaf=is_layout), jax.tree.leaves(grads),
                      strict=True):
        sq = jnp.sum(jnp.square(g.astype(jnp.float32)))
        if cfg.stage >= 1 and lay.sharded:
            sharded = sharded + sq
        else:
            whole = whole + sq
    if cfg.stage >= 1:
        sharded = jax.lax.psum(sharded, DATA)
    return jnp.sqrt(sharded + whole)


def clip(grads: Any, norm: jax.Array, max_norm: float | None) -> Any:
    """``optax.clip_by_global_norm`` with a norm computed across shards."""
    if max_norm is None:
        return grads
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g * (max_norm / norm)), grads)


def master_view(cfg: StepConfig, layouts: Any, state: TrainState) -> Any:
    """The fp32 params this device updates: its slice from stage 1, all of them in 0."""
    if cfg.mixed:
        return state.master
    if cfg.stage in (1, 2):
        return _map(lambda lay, p: collectives.local_slice(p, lay), layouts, state.params)
    return state.params


def working_params(cfg: StepConfig, layouts: Any, master: Any) -> Any:
    """New working params from the updated master: all-gathered in stages 1–2."""
    cast = lambda m: m.astype(cfg.compute_dtype)
    if cfg.stage in (1, 2):
        return _map(lambda lay, m: collectives.gather(cast(m), lay), layouts, master)
    return jax.tree.map(cast, master)


def train_step(cfg: StepConfig, layouts: Any, loss_fn: LossFn, tx: optax.GradientTransformation,
               state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on this device's part of the global batch."""
    loss, grads = local_gradients(cfg, layouts, loss_fn, state.params, batch)
    if cfg.stage <= 1:
        grads = reduce_gradients(cfg, layouts, grads)
    norm = global_norm(cfg, layouts, grads)
    grads = clip(grads, norm, cfg.max_grad_norm)
    master = master_view(cfg, layouts, state)
    updates, opt_state = tx.update(grads, state.opt_state, master)
    master = optax.apply_updates(master, updates)
    new = TrainState(
        step=state.step + 1,
        params=working_params(cfg, layouts, master),
        master=master if cfg.mixed else None,
        opt_state=opt_state,
    )
    loss = jax.lax.pmean(loss, cfg.batch_axes)
    return new, {"loss": loss, "grad_norm": norm}


def eval_loss(cfg: StepConfig, layouts: Any, loss_fn: LossFn, params: Any, batch: Any):
    """Forward-only mean loss over the global batch."""
    view = params
    if cfg.stage >= 2:
        view = model_view(cfg, layouts, params, _slots(layouts, cfg.stage == 3))
    return jax.lax.pmean(loss_fn(view, batch).astype(jnp.float32), cfg.batch_axes)
