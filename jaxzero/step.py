"""The training step: explicit collectives per device, the optimizer in the global view.

Every gradient and parameter collective is written here or in ``hooks.py``,
inside ``shard_map``; nothing of ZeRO is left to the compiler's sharding
propagation. Per stage, one step does:

* stage 0: local gradients → ``psum`` (all-reduce) → replicated update.
* stage 1: local gradients → ``psum_scatter`` → update of each device's slice of the
  master params and optimizer state → ``all_gather`` of the new working params.
* stage 2: as stage 1, but each layer's gradient is reduce-scattered during the
  backward pass (``hooks.use_params``), so the full gradient never exists at once.
* stage 3: params stay sharded; each layer all-gathers its params before use,
  again in the backward pass (remat policy), and reduce-scatters its gradient.

The optimizer update sits between the two ``shard_map`` calls, on the sharded
arrays in the global view (:mod:`jaxzero.update`); the whole gradient tree's
reduction (stages 0–1), norm and clipping are :mod:`jaxzero.gradients`'.

With ``k`` micro-batches, stages 0–1 accumulate full local gradients and
communicate once per step; stages 2–3 reduce-scatter (and stage 3 gathers) once
per micro-batch, accumulating only this device's gradient slice.

Every ``shard_map`` here and in ``Engine`` passes ``check_vma=False``: inside, a value
is just this device's array and the only cross-device operations are the collectives
written here and in ``hooks.py``. The step relies on two properties of that mode
(``tests/test_step.py`` checks both, and that JAX still behaves so):

* autodiff is per device: the gradient w.r.t. a ``P()`` input (the params at stages
  0–1, the whole params ``use_params`` hands out at stage 2) is this device's own, so
  the explicit reduction is the only one. ``check_vma=True`` types ``P()`` inputs as
  invariant and sums their gradients itself (the transpose of the cast to varying it
  inserts where they meet the batch): the explicit ``psum`` then gives N times the
  gradient at stage 0, and stages 1–3 fail to trace (measured on both JAX lines).
* ``out_specs=P()`` is a promise, not a check: each device's result becomes its copy
  of the "replicated" array. Every such output here is a ``psum``, ``pmean`` or
  ``all_gather`` result, the same on every device by construction.

``check_vma=True`` with explicit ``pcast``/invariant gathers was tried and kept out:
it puts the loss, which is user code, under JAX's varying/invariant types, so plain
JAX that runs under ``jit`` (a ``scan`` whose carry starts at ``jnp.zeros`` and adds
batch terms, a ``cond`` with a constant branch) stops tracing; accumulating a loss's
aux terms needs each value's variance, which neither JAX line exposes publicly; and
it changed the compiled reference GPT step (extra copies, on jax 0.10.2).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero import collectives, offload
from jaxzero import ema as ema_lib
from jaxzero import frozen as frozen_lib
from jaxzero import loss as loss_lib
from jaxzero import model_state as model_state_lib
from jaxzero.gradients import clip, global_norm, reduce_gradients
from jaxzero.hook_check import check_uses
from jaxzero.hooks import Stored, UseOp, use_params
from jaxzero.mesh import MODEL
from jaxzero.partition import LeafLayout, is_layout, local_layouts
from jaxzero.state import TrainState, master_sharded, master_specs
from jaxzero.step_config import LossFn, StepConfig
from jaxzero.types import Batch, Layouts, Metrics, OptState, Params
from jaxzero.update import optimizer_update, to_logical, to_stored, value_fn_of


def _map(f: Callable[..., Any], layouts: Layouts, *trees: Any) -> Any:
    return jax.tree.map(lambda lay, *xs: f(lay, *xs), layouts, *trees, is_leaf=is_layout)


@dataclasses.dataclass(frozen=True)
class Frozen:
    """Where the frozen params go (:mod:`jaxzero.frozen`): their layouts and the mask
    that merges them with the trainable ones into the tree the loss sees."""

    layouts: Layouts
    mask: Params


def frozen_view(cfg: StepConfig, fz: Frozen, values: Params) -> Params:
    """The frozen params as the loss gets them, cast up to the compute dtype (a bf16 base
    in an fp32 run computes in fp32, as its trainable params do): at stage 3 gathered by
    ``use_params`` (per layer, or here for the whole tree) and cast once whole; at stages
    0–2 whole already, cast in each layer's ``use_params`` (a per-layer model) or here.
    No gradient slot: their gathers never meet autodiff, so no weight gradient is
    computed."""
    compute = jnp.dtype(cfg.compute_dtype)
    # only up (a bf16 base in an fp32 run): a wider frozen leaf (QLoRA's fp32 scales in a
    # bf16 run) is used as stored, the model casting where it computes
    cast = lambda x: (
        compute.name
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < compute.itemsize
        else None
    )
    if cfg.stage < 3 and not cfg.per_layer:
        return jax.tree.map(lambda x: x if cast(x) is None else x.astype(compute), values)
    if cfg.stage < 3 and all(cast(x) is None for x in jax.tree.leaves(values)):
        return values

    def wrap(lay: LeafLayout, value: jax.Array) -> Stored:
        bucket = cfg.bucket_bytes if cfg.per_layer else cfg.whole_tree_bucket_bytes
        gather = cfg.stage == 3
        op = UseOp(lay, gather, "float32", cfg.extra_axes, bucket_bytes=bucket, reduce=False)
        qwz = cfg.quant_block if cfg.qwz and gather else 0  # ZeRO++ qwZ (floats only)
        op = dataclasses.replace(op, frozen=True, cast=cast(value), qwz_block=qwz)
        return Stored(value, None, op)

    stored = _map(wrap, fz.layouts, values)
    return stored if cfg.per_layer else use_params(stored)


def whole_view(cfg: StepConfig, fz: Frozen | None, view: Params, frozen: Params) -> Params:
    """The tree the loss sees: the trainable view with the frozen params merged in."""
    if fz is None:
        return view
    return frozen_lib.merge(fz.mask, view, frozen_view(cfg, fz, frozen))


def model_view(
    cfg: StepConfig,
    layouts: Layouts,
    params: Params,
    slots: Params = None,
    barriers: Any = None,
) -> Params:
    """What ``loss_fn`` receives: plain arrays (stages 0–1) or gathered/hooked leaves.

    A per-layer model at stages 0–1 with the dot barrier gets hooked leaves too, whose
    backward only applies the barrier inside each layer (in a scan over layers, where
    the step's own barrier after the backward pass comes too late). ``barriers``: which
    leaves take it (:func:`dot_barriers`; None: every leaf, if ``cfg.dot_barrier``).
    """
    reduce = cfg.stage >= 2
    if not reduce and not (cfg.per_layer and cfg.dot_barrier):
        return params
    if barriers is None:
        barriers = _map(lambda lay: cfg.dot_barrier, layouts)

    def wrap(lay: LeafLayout, barrier: bool, value: jax.Array, slot: Any = None) -> Stored:
        op = UseOp(
            lay,
            cfg.stage == 3,
            jnp.dtype(cfg.reduce_dtype).name,
            cfg.extra_axes,
            bucket_bytes=(
                cfg.whole_tree_bucket_bytes
                if cfg.stage == 3 and not cfg.per_layer
                else cfg.bucket_bytes
            ),
            dot_barrier=barrier,
            reduce=reduce,
            # ZeRO++: int8 weight gathers (stage 3), int8/int4 gradient reduce-scatters
            qwz_block=cfg.quant_block if cfg.qwz and cfg.stage == 3 else 0,
            qgz_bits=cfg.qgz_bits if reduce else 0,
            scatter_extra=cfg.hpz,
            quant_block=cfg.quant_block,
        )
        return Stored(value, slot, op)

    trees = (barriers, params, slots) if reduce else (barriers, params)
    stored = _map(wrap, layouts, *trees)
    return stored if cfg.per_layer else use_params(stored)


def dot_barriers(
    cfg: StepConfig,
    layouts: Layouts,
    loss_fn: LossFn,
    params: Params,
    batch: Batch,
    fz: Frozen | None = None,
    frozen: Params = None,
    state: Any = None,
) -> Any:
    """Which leaves' gradients pass :func:`collectives.dot_barrier` (all False when the
    barrier is off): those that may be a dot's, from a trace of the plain model's
    gradient (whole params, no hooks; ``use_params`` is the identity on them).
    ``batch``: a micro-batch's shapes (``jax.ShapeDtypeStruct``); ``state``: the model
    state (:mod:`jaxzero.model_state`), None without."""
    if not cfg.dot_barrier:
        return _map(lambda lay: False, layouts)
    whole_of = lambda lays, tree: _map(
        lambda lay, x: jax.ShapeDtypeStruct(lay.shape, x.dtype), lays, tree
    )
    whole = whole_of(layouts, params)
    held = None if fz is None else whole_of(fz.layouts, frozen)
    rows = jax.tree.leaves(batch)[0].shape[0]

    def grad(p: Params, b: Batch, f: Params, s: Any) -> Params:
        rng = None if cfg.rng_seed is None else loss_lib.batch_key(cfg.rng_seed, 0, 0, rows)
        full = lambda p: p if fz is None else frozen_lib.merge(fz.mask, p, f)
        value = lambda p: loss_lib.unpack(_loss(cfg, loss_fn, full(p), b, rng, False, s)[0])[0]
        return jax.grad(value)(p)

    return collectives.dot_gradients(grad, whole, batch, held, state)


def _loss(
    cfg: StepConfig,
    loss_fn: LossFn,
    view: Params,
    batch: Batch,
    rng: jax.Array | None = None,
    check: bool = True,
    state: Any = None,
    train: bool = True,
) -> tuple[Any, Any]:
    """``(out, new_state)`` of ``loss_fn(view, batch[, rng][, state=state, train=train])``:
    its loss form and, with model state (``cfg.model_state``), the new state in the stored
    dtypes (else None); per-layer models are first checked to use ``use_params``."""
    args = () if cfg.rng_seed is None else (rng,)
    kwargs = {"state": state, "train": train} if cfg.model_state else {}
    fn: Callable[[Params, Batch], Any] = lambda v, b: loss_fn(v, b, *args, **kwargs)
    if check and cfg.per_layer and cfg.stage >= 2:
        check_uses(fn, view, batch)
    out, new = loss_lib.split_state(fn(view, batch), cfg.model_state)
    if new is not None:
        new = model_state_lib.check_like(new, model_state_lib.shapes_of(state))
    return out, new


def _first_row(cfg: StepConfig, rows: int) -> jax.Array:
    """This device's first row of the global batch (its batch axes, major to minor)."""
    return jax.lax.axis_index(cfg.batch_axes) * rows


def _slots(layouts: Layouts, sharded: bool) -> Params:
    """Zero gradient slots shaped like this device's slice of each leaf."""
    return _map(
        lambda lay: jnp.zeros(lay.shard_shape if sharded else lay.shape, jnp.float32), layouts
    )


def local_gradients(
    cfg: StepConfig,
    layouts: Layouts,
    loss_fn: LossFn,
    params: Params,
    batch: Batch,
    step: Any = 0,
    fz: Frozen | None = None,
    frozen: Params = None,
    state: Any = None,
) -> tuple[jax.Array, jax.Array, Any, Params, bool, Any]:
    """This device's loss terms and gradients, summed over micro-batches.

    Returns ``(total, weight, aux, grads, weighted, new_state)``. Scalar-mean losses
    (``weighted`` False): ``total`` is the mean over micro-batches and the gradient is
    that of this device's share of the global mean (the 1/N rides the backward pass).
    :class:`jaxzero.loss.Weighted` losses: the sums and the gradient of the sum, to be
    divided by the global weight once it is known (:func:`gradient_step`).
    Stages 0–1 return full, unreduced gradients w.r.t. the working params; stages
    2–3 this device's slice of the already reduced gradient. Frozen params (``fz``,
    ``frozen``) are merged into the tree the loss sees and get no gradient. Model state
    (``state``; None without) is threaded through the micro-batches: micro-batch ``j + 1``
    sees what ``j`` returned; ``new_state`` is this device's after the last.
    """
    hooked = cfg.stage >= 2
    diff0 = _slots(layouts, True) if hooked else params
    share = 1.0 / cfg.batch_devices
    k = cfg.micro_batches
    rows = jax.tree.leaves(batch)[0].shape[0]
    first = _first_row(cfg, rows)
    form: dict[str, bool] = {}  # set while tracing: which form the loss returned
    mb0 = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows // k, *x.shape[1:]), x.dtype), batch)
    barriers = dot_barriers(cfg, layouts, loss_fn, params, mb0, fz, frozen, state)

    def loss_of(diff: Params, mb: Batch, j: Any, state: Any) -> tuple[jax.Array, Any]:
        if hooked:
            view = model_view(cfg, layouts, params, diff, barriers)
        else:
            view = model_view(cfg, layouts, diff, barriers=barriers)
        view = whole_view(cfg, fz, view, frozen)
        rng = None
        if cfg.rng_seed is not None:
            rng = loss_lib.batch_key(cfg.rng_seed, step, first + j * (rows // k), rows // k)
        out, new = _loss(cfg, loss_fn, view, mb, rng, state=state)
        total, weight, aux = loss_lib.unpack(out)
        form["weighted"] = weight is not None
        if weight is None:
            # differentiate this device's share of the global mean: the 1/N rides the
            # backward pass instead of costing a multiply per gradient leaf
            return total * share, (total, jnp.ones((), jnp.float32), aux, new)
        return total, (total, weight, aux, new)

    value_and_grad = jax.value_and_grad(loss_of, has_aux=True)

    def grad_fn(diff: Params, mb: Batch, j: Any, state: Any) -> tuple[Any, Params, Any]:
        (_, (*terms, new)), grads = value_and_grad(diff, mb, j, state)
        if not hooked and not cfg.per_layer:  # else in use_params
            grads = jax.tree.map(
                lambda g, on: collectives.dot_barrier(g) if on else g, grads, barriers
            )
        return tuple(terms), grads, new

    if k == 1:
        (total, weight, aux), grads, new = grad_fn(diff0, batch, 0, state)
        return total, weight, aux, grads, form["weighted"], new

    mbs = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
    f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)

    def body(carry: Any, xs: Any) -> tuple[Any, None]:
        sums, state = carry  # the state flows from one micro-batch to the next
        mb, j = xs
        terms, g, new = grad_fn(diff0, mb, j, state)
        return (jax.tree.map(lambda a, b: a + b, sums, (f32(terms), f32(g))), new), None

    mb_0 = jax.tree.map(lambda x: x[0], mbs)
    terms0, _, _ = jax.eval_shape(grad_fn, diff0, mb_0, 0, state)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (terms0, diff0))
    (((total, weight, aux), acc), new), _ = jax.lax.scan(body, (zeros, state), (mbs, jnp.arange(k)))
    if form["weighted"]:
        return total, weight, aux, acc, True, new
    mean = lambda t: jax.tree.map(lambda a: a / k, t)
    return total / k, weight, mean(aux), mean(acc), False, new


def gradient_step(
    cfg: StepConfig,
    layouts: Layouts,
    loss_fn: LossFn,
    params: Params,
    batch: Batch,
    step: Any = 0,
    fz: Frozen | None = None,
    frozen: Params = None,
    state: Any = None,
) -> tuple[jax.Array, Params, jax.Array, Metrics, Any]:
    """Per device: the global loss, reduced (and clipped) gradients, their global norm,
    the metrics of the loss's form (``tokens`` when weighted, ``aux``) and the new model
    state (None without), one value on every device (:func:`model_state.average`).

    The gradients come out as the master params are stored: whole in stage 0,
    this device's padded slice from stage 1. Frozen params have none.
    """
    total, weight, aux, grads, weighted, new = local_gradients(
        cfg, layouts, loss_fn, params, batch, step, fz, frozen, state
    )
    if new is not None:
        new = model_state_lib.average(new, cfg.batch_axes)
    if cfg.stage <= 1:
        grads = reduce_gradients(cfg, layouts, grads)
    if cfg.model_axis:  # sequence parallelism: a shared leaf's parts, one a model device
        grads = _map(
            lambda lay, g: g if lay.tensor_parallel else jax.lax.psum(g, MODEL), layouts, grads
        )
    metrics = {}
    if weighted:  # sums over every device and micro-batch, over the global weight
        tokens = jax.lax.psum(weight, cfg.batch_axes)
        per = _nonzero(tokens)  # a batch with nothing to learn from: zero, not NaN
        grads = jax.tree.map(lambda g: g / per, grads)
        loss = jax.lax.psum(total, cfg.batch_axes) / per
        aux = jax.tree.map(lambda a: jax.lax.psum(a, cfg.batch_axes) / per, aux)
        metrics["tokens"] = tokens
    else:
        loss = jax.lax.pmean(total, cfg.batch_axes)
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, cfg.batch_axes), aux)
    if aux is not None:
        metrics["aux"] = aux
    norm = global_norm(cfg, layouts, grads)
    grads = clip(grads, norm, cfg.max_grad_norm)
    return loss, grads, norm, metrics, new


def gather_params(cfg: StepConfig, layouts: Layouts, params: Params) -> Params:
    """Per device: all-gather the updated working params (stages 1–2), in buckets."""
    values, treedef = jax.tree.flatten(params)
    lays = jax.tree.leaves(layouts, is_leaf=is_layout)
    return jax.tree.unflatten(treedef, collectives.gather_buckets(values, lays, cfg.bucket_bytes))


def gather_groups(cfg: StepConfig, layouts: Layouts, params: Params) -> Params:
    """Per device (hpZ): all-gather each sharded leaf's slice across the groups, so every
    group holds the params sharded within it (one cross-group gather a step)."""
    return _map(
        lambda lay, x: (
            x
            if lay.dim is None
            else jax.lax.all_gather(x, cfg.extra_axes, axis=lay.dim, tiled=True)
        ),
        layouts,
        params,
    )


def _sharded_gradient_step(
    cfg: StepConfig,
    mesh: Mesh,
    layouts: Layouts,
    specs: TrainState,
    loss_fn: LossFn,
    fz: Frozen | None = None,
) -> Callable:
    """:func:`gradient_step` over the mesh: ``(params, batch, step, frozen, model_state)
    -> (loss, grads, norm, metrics, new_model_state)``, the gradients laid out as the
    master params are stored."""

    # check_vma=False (module docstring): the loss's gradient is per device, so the
    # reductions in reduce_gradients and hooks are the only ones; loss, norm and metrics
    # (P()) come from psum/pmean results, stage 0's gradients (P()) from an all-reduce,
    # the model state (P()) from model_state.average's pmean. Inside, each leaf is its
    # model device's slice (local layouts): ZeRO works on it as on a whole leaf.
    local, fz_local = _local(layouts, fz)

    def per_device(params: Params, batch: Batch, step: Any, frozen: Params, state: Any) -> Any:
        return gradient_step(cfg, local, loss_fn, params, batch, step, fz_local, frozen, state)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(specs.params, cfg.batch_spec, P(), specs.frozen, specs.model_state),
        out_specs=(P(), master_specs(cfg.stage, layouts, cfg.hpz), P(), P(), specs.model_state),
        check_vma=False,
    )


def _local(layouts: Layouts, fz: Frozen | None) -> tuple[Layouts, Frozen | None]:
    """The layouts of each model device's slices (tensor parallelism; else the same)."""
    if fz is None:
        return local_layouts(layouts), None
    return local_layouts(layouts), Frozen(local_layouts(fz.layouts), fz.mask)


def make_train_step(
    cfg: StepConfig,
    mesh: Mesh,
    layouts: Layouts,
    opt_lays: OptState,
    specs: TrainState,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    fz: Frozen | None = None,
    ema: ema_lib.Decay | None = None,
) -> Callable:
    """The global train step: explicit collectives in ``shard_map``, the update around them.

    ``train_step(state, batch) -> (state, {"loss", "grad_norm"})``, to be jitted with
    the state's shardings. Gradients are reduced (and stage 3 params gathered) by
    :func:`gradient_step` inside ``shard_map``; the optimizer updates the sharded
    master in the global view (:func:`optimizer_update`); stages 1–2 all-gather the
    new working params inside ``shard_map`` again. ``ema``: the decay of the state's
    EMA (:mod:`jaxzero.ema`), updated from the new master on each device's shard. The
    model state (:mod:`jaxzero.model_state`) comes out of the forward passes.
    """
    sharded = master_sharded(cfg.stage)
    grad_specs = master_specs(cfg.stage, layouts, cfg.hpz)
    grads_of = _sharded_gradient_step(cfg, mesh, layouts, specs, loss_fn, fz)
    working = make_working(cfg, mesh, layouts, specs)
    place = lambda tree: jax.tree.map(
        lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)),
        tree,
        grad_specs,
    )

    # a line search's loss and gradient at other params: the step's own, unclipped
    unclipped_cfg = dataclasses.replace(cfg, max_grad_norm=None)
    unclipped = _sharded_gradient_step(unclipped_cfg, mesh, layouts, specs, loss_fn, fz)

    def loss_and_grads(
        logical: Params, batch: Batch, step: Any, frozen: Params, state: Any
    ) -> tuple[jax.Array, Params]:
        master = place(to_stored(layouts, logical, sharded))
        loss, grads, _, _, _ = unclipped(working(master), batch, step, frozen, state)
        return loss, to_logical(layouts, grads)

    # offload (jaxzero.offload): the master (bf16 training) and the optimizer state come
    # from host memory for the update and go back after it, one transfer a leaf each way
    named = lambda tree: jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), tree, is_leaf=lambda x: isinstance(x, P)
    )
    held = (named(grad_specs), named(specs.opt_state)) if cfg.offload else None

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        loss, grads, norm, extra, model_state = grads_of(
            state.params, batch, state.step, state.frozen, state.model_state
        )
        master = state.master if cfg.mixed else state.params
        opt_state = state.opt_state
        if held is not None:
            master = offload.to_device(master, held[0]) if cfg.mixed else master
            opt_state = offload.to_device(opt_state, held[1])
        value_fn = value_fn_of(
            lambda logical: loss_and_grads(
                logical, batch, state.step, state.frozen, state.model_state
            )
        )
        master, opt_state = optimizer_update(
            tx, layouts, opt_lays, sharded, grads, opt_state, master, loss, value_fn
        )
        master = place(master)
        params = working(master)
        average = state.ema
        if ema is not None:  # elementwise on shards laid out alike: no collective
            if held is not None:
                average = offload.to_device(average, held[0])
            d = ema_lib.decay_at(ema, state.step)
            average = place(ema_lib.update(average, master, d))
            if held is not None:
                average = offload.to_host(average, held[0])
        if held is not None:
            master = offload.to_host(master, held[0]) if cfg.mixed else master
            opt_state = offload.to_host(opt_state, held[1])
        new = TrainState(
            step=state.step + 1,
            params=params,
            master=master if cfg.mixed else None,
            opt_state=opt_state,
            frozen=state.frozen,
            ema=average,
            model_state=model_state,
        )
        return new, {"loss": loss, "grad_norm": norm, **extra}

    return train_step


def make_working(
    cfg: StepConfig, mesh: Mesh, layouts: Layouts, specs: TrainState
) -> Callable[[Params], Params]:
    """``working(master)``: the working params (compute dtype, the stage's layout) of
    params stored as the master is (the new master in the step; the EMA for an
    evaluation at its weights): stages 1-2 all-gather them, hpZ across the groups."""
    # check_vma=False: the new params' P() (stages 1-2) holds because an all_gather gives
    # every device the same array; check_vma=True cannot infer that and refuses to trace.
    # hpZ: the new params, split over every device as the master is, are gathered across
    # the groups once a step into each group's copy (split within the group)
    gather = jax.shard_map(
        functools.partial(gather_groups if cfg.hpz else gather_params, cfg, local_layouts(layouts)),
        mesh=mesh,
        in_specs=(master_specs(cfg.stage, layouts, cfg.hpz),),
        out_specs=specs.params,
        check_vma=False,
    )

    def working(master: Params) -> Params:
        params = jax.tree.map(lambda m: m.astype(cfg.compute_dtype), master)
        return gather(params) if cfg.stage in (1, 2) or cfg.hpz else params

    return working


def eval_loss(
    cfg: StepConfig,
    layouts: Layouts,
    loss_fn: LossFn,
    params: Params,
    batch: Batch,
    fz: Frozen | None = None,
    frozen: Params = None,
    state: Any = None,
) -> jax.Array:
    """Forward-only loss over the global batch, combined as the step combines it; a loss
    that takes ``rng`` gets None (no dropout), one with model state the stored ``state``
    and ``train=False`` (the state it returns is dropped)."""
    view = params
    if cfg.stage >= 2:
        view = model_view(cfg, layouts, params, _slots(layouts, cfg.stage == 3))
    view = whole_view(cfg, fz, view, frozen)
    out, _ = _loss(cfg, loss_fn, view, batch, None, state=state, train=False)
    total, weight, _ = loss_lib.unpack(out)
    if weight is None:
        return jax.lax.pmean(total, cfg.batch_axes)
    return jax.lax.psum(total, cfg.batch_axes) / _nonzero(jax.lax.psum(weight, cfg.batch_axes))


def make_eval(
    cfg: StepConfig,
    mesh: Mesh,
    layouts: Layouts,
    specs: TrainState,
    loss_fn: LossFn,
    fz: Frozen | None = None,
) -> Callable[..., jax.Array]:
    """``evaluate(params, batch, frozen=None, model_state=None)``: :func:`eval_loss` over
    the mesh, in the global view (``frozen``: the state's frozen params, when some are;
    ``model_state``: its model state, when it keeps one)."""

    local, fz_local = _local(layouts, fz)

    def per_device(params: Params, batch: Batch, frozen: Params, state: Any) -> jax.Array:
        return eval_loss(cfg, local, loss_fn, params, batch, fz_local, frozen, state)

    # check_vma=False as for the step (the module docstring says why): the loss runs as
    # plain per-device JAX; P() holds because eval_loss ends in a pmean or psum.
    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(specs.params, cfg.batch_spec, specs.frozen, specs.model_state),
        out_specs=P(),
        check_vma=False,
    )
    return lambda params, batch, frozen=None, model_state=None: sharded(
        params, batch, frozen, model_state
    )


def _nonzero(weight: jax.Array) -> jax.Array:
    return jnp.where(weight == 0, jnp.ones_like(weight), weight)
