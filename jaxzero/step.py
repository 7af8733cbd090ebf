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
arrays in the global view (:func:`optimizer_update`). An elementwise optimizer
compiles to purely local code there; one that looks across elements (a global
norm, factored statistics, Newton–Schulz) gets exactly the communication it
needs from XLA, so no optimizer can silently compute something else on a slice.

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

from jaxzero import collectives
from jaxzero import loss as loss_lib
from jaxzero.hook_check import check_uses
from jaxzero.hooks import Stored, UseOp, use_params
from jaxzero.mesh import DATA  # the state's axis, named where no mesh is at hand
from jaxzero.partition import LeafLayout, is_layout, pad, unpad
from jaxzero.state import TrainState, master_sharded, master_specs
from jaxzero.types import Batch, Layouts, Metrics, OptState, Params

LossFn = Callable[..., Any]  # (params, batch[, rng]) -> a scalar or a jaxzero.loss form


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
    bucket_bytes: int = 0  # pack gradient/param collectives up to this size
    whole_tree_bucket_bytes: int = 0  # the same, in a per_layer=False model's stage-3 use_params
    dot_barrier: bool = False  # collectives.dot_barrier on each micro-batch's gradients
    rng_seed: int | None = None  # loss_fn(params, batch, rng) gets its key from it

    @property
    def extra_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.batch_axes if a != DATA)


def _map(f: Callable[..., Any], layouts: Layouts, *trees: Any) -> Any:
    return jax.tree.map(lambda lay, *xs: f(lay, *xs), layouts, *trees, is_leaf=is_layout)


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
        )
        return Stored(value, slot, op)

    trees = (barriers, params, slots) if reduce else (barriers, params)
    stored = _map(wrap, layouts, *trees)
    return stored if cfg.per_layer else use_params(stored)


def dot_barriers(
    cfg: StepConfig, layouts: Layouts, loss_fn: LossFn, params: Params, batch: Batch
) -> Any:
    """Which leaves' gradients pass :func:`collectives.dot_barrier` (all False when the
    barrier is off): those that may be a dot's, from a trace of the plain model's
    gradient (whole params, no hooks; ``use_params`` is the identity on them).
    ``batch``: a micro-batch's shapes (``jax.ShapeDtypeStruct``)."""
    if not cfg.dot_barrier:
        return _map(lambda lay: False, layouts)
    whole = _map(lambda lay, x: jax.ShapeDtypeStruct(lay.shape, x.dtype), layouts, params)
    rows = jax.tree.leaves(batch)[0].shape[0]

    def grad(p: Params, b: Batch) -> Params:
        rng = None if cfg.rng_seed is None else loss_lib.batch_key(cfg.rng_seed, 0, 0, rows)
        return jax.grad(lambda p: loss_lib.unpack(_loss(cfg, loss_fn, p, b, rng, False))[0])(p)

    return collectives.dot_gradients(grad, whole, batch)


def _loss(
    cfg: StepConfig,
    loss_fn: LossFn,
    view: Params,
    batch: Batch,
    rng: jax.Array | None = None,
    check: bool = True,
) -> Any:
    """``loss_fn(view, batch[, rng])``; per-layer models are first checked to use
    ``use_params``."""
    fn = loss_fn if cfg.rng_seed is None else (lambda v, b, k=rng: loss_fn(v, b, k))
    if check and cfg.per_layer and cfg.stage >= 2:
        check_uses(fn, view, batch)
    return fn(view, batch)


def _first_row(cfg: StepConfig, rows: int) -> jax.Array:
    """This device's first row of the global batch (its batch axes, major to minor)."""
    return jax.lax.axis_index(cfg.batch_axes) * rows


def _slots(layouts: Layouts, sharded: bool) -> Params:
    """Zero gradient slots shaped like this device's slice of each leaf."""
    return _map(
        lambda lay: jnp.zeros(lay.shard_shape if sharded else lay.shape, jnp.float32), layouts
    )


def local_gradients(
    cfg: StepConfig, layouts: Layouts, loss_fn: LossFn, params: Params, batch: Batch, step: Any = 0
) -> tuple[jax.Array, jax.Array, Any, Params, bool]:
    """This device's loss terms and gradients, summed over micro-batches.

    Returns ``(total, weight, aux, grads, weighted)``. Scalar-mean losses
    (``weighted`` False): ``total`` is the mean over micro-batches and the gradient is
    that of this device's share of the global mean (the 1/N rides the backward pass).
    :class:`jaxzero.loss.Weighted` losses: the sums and the gradient of the sum, to be
    divided by the global weight once it is known (:func:`gradient_step`).
    Stages 0–1 return full, unreduced gradients w.r.t. the working params; stages
    2–3 this device's slice of the already reduced gradient.
    """
    hooked = cfg.stage >= 2
    diff0 = _slots(layouts, True) if hooked else params
    share = 1.0 / cfg.batch_devices
    k = cfg.micro_batches
    rows = jax.tree.leaves(batch)[0].shape[0]
    first = _first_row(cfg, rows)
    form: dict[str, bool] = {}  # set while tracing: which form the loss returned
    mb0 = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows // k, *x.shape[1:]), x.dtype), batch)
    barriers = dot_barriers(cfg, layouts, loss_fn, params, mb0)

    def loss_of(diff: Params, mb: Batch, j: Any) -> tuple[jax.Array, Any]:
        if hooked:
            view = model_view(cfg, layouts, params, diff, barriers)
        else:
            view = model_view(cfg, layouts, diff, barriers=barriers)
        rng = None
        if cfg.rng_seed is not None:
            rng = loss_lib.batch_key(cfg.rng_seed, step, first + j * (rows // k), rows // k)
        total, weight, aux = loss_lib.unpack(_loss(cfg, loss_fn, view, mb, rng))
        form["weighted"] = weight is not None
        if weight is None:
            # differentiate this device's share of the global mean: the 1/N rides the
            # backward pass instead of costing a multiply per gradient leaf
            return total * share, (total, jnp.ones((), jnp.float32), aux)
        return total, (total, weight, aux)

    value_and_grad = jax.value_and_grad(loss_of, has_aux=True)

    def grad_fn(diff: Params, mb: Batch, j: Any) -> tuple[Any, Params]:
        (_, terms), grads = value_and_grad(diff, mb, j)
        if not hooked and not cfg.per_layer:  # else in use_params
            grads = jax.tree.map(
                lambda g, on: collectives.dot_barrier(g) if on else g, grads, barriers
            )
        return terms, grads

    if k == 1:
        (total, weight, aux), grads = grad_fn(diff0, batch, 0)
        return total, weight, aux, grads, form["weighted"]

    mbs = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
    f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)

    def body(carry: Any, xs: Any) -> tuple[Any, None]:
        mb, j = xs
        terms, g = grad_fn(diff0, mb, j)
        return jax.tree.map(lambda a, b: a + b, carry, (f32(terms), f32(g))), None

    terms0, _ = jax.eval_shape(grad_fn, diff0, jax.tree.map(lambda x: x[0], mbs), 0)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (terms0, diff0))
    ((total, weight, aux), acc), _ = jax.lax.scan(body, zeros, (mbs, jnp.arange(k)))
    if form["weighted"]:
        return total, weight, aux, acc, True
    mean = lambda t: jax.tree.map(lambda a: a / k, t)
    return total / k, weight, mean(aux), mean(acc), False


def reduce_gradients(cfg: StepConfig, layouts: Layouts, grads: Params) -> Params:
    """Stage 0: all-reduce; stage 1: reduce-scatter. Returns fp32 global-mean gradients."""
    lays = jax.tree.leaves(layouts, is_leaf=is_layout)
    gs, treedef = jax.tree.flatten(grads)
    gs = [g.astype(cfg.reduce_dtype) for g in gs]
    if cfg.stage == 0:  # XLA combines these all-reduces itself
        gs = [collectives.all_reduce(g, cfg.extra_axes) for g in gs]
    else:
        gs = collectives.reduce_scatter_buckets(gs, lays, cfg.bucket_bytes, cfg.extra_axes)
    return jax.tree.unflatten(treedef, [g.astype(jnp.float32) for g in gs])


# A whole (replicated) gradient leaf at least this large (elements) has its squares
# summed by each device over its 1/N only, then psum'd (global_norm).
SPLIT_NORM_MIN = 1 << 15


def global_norm(cfg: StepConfig, layouts: Layouts, grads: Params) -> jax.Array:
    """The true L2 norm of the whole gradient, however it is sharded.

    Each device sums the squares of its own part: a sharded leaf's shard, and 1/N of a
    large whole leaf (every leaf at stage 0), then one psum. Summing every whole
    leaf on every device wrote out the square of each and read it back: on the zoo's
    ``embed`` (a 16 MiB gradient a device at 8 devices) that was 1.19-1.26x plain jit's
    step against 1.04x without the norm. Small whole leaves are summed where they are.
    """
    n = jax.lax.axis_size(DATA)
    parts = jnp.zeros((), jnp.float32)
    whole = jnp.zeros((), jnp.float32)
    split = False
    for lay, g in zip(
        jax.tree.leaves(layouts, is_leaf=is_layout), jax.tree.leaves(grads), strict=True
    ):
        if cfg.stage >= 1 and lay.sharded:
            parts, split = parts + _sum_sq(g), True
        elif n > 1 and g.size >= SPLIT_NORM_MIN:
            parts, split = parts + _sum_sq_of_own_part(g, n), True
        else:
            whole = whole + _sum_sq(g)
    if split:
        parts = jax.lax.psum(parts, DATA)
    return jnp.sqrt(parts + whole)


def _sum_sq(g: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(g.astype(jnp.float32)))


def _sum_sq_of_own_part(g: jax.Array, n: int) -> jax.Array:
    """This device's share of ``sum(g**2)`` for a ``g`` every device holds whole: its
    1/n of the flat elements, the first device also the remainder."""
    flat = g.reshape(-1)
    size = flat.size // n
    i = jax.lax.axis_index(DATA)
    own = _sum_sq(jax.lax.dynamic_slice_in_dim(flat, i * size, size))
    rest = flat[n * size :]
    if rest.size:
        own = own + jnp.where(i == 0, _sum_sq(rest), 0.0)
    return own


def clip(grads: Params, norm: jax.Array, max_norm: float | None) -> Params:
    """``optax.clip_by_global_norm`` with a norm computed across shards."""
    if max_norm is None:
        return grads
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g * (max_norm / norm)), grads)


def gradient_step(
    cfg: StepConfig, layouts: Layouts, loss_fn: LossFn, params: Params, batch: Batch, step: Any = 0
) -> tuple[jax.Array, Params, jax.Array, Metrics]:
    """Per device: the global loss, reduced (and clipped) gradients, their global norm
    and the metrics of the loss's form (``tokens`` when weighted, ``aux``).

    The gradients come out as the master params are stored: whole in stage 0,
    this device's padded slice from stage 1.
    """
    total, weight, aux, grads, weighted = local_gradients(
        cfg, layouts, loss_fn, params, batch, step
    )
    if cfg.stage <= 1:
        grads = reduce_gradients(cfg, layouts, grads)
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
    return loss, grads, norm, metrics


def gather_params(cfg: StepConfig, layouts: Layouts, params: Params) -> Params:
    """Per device: all-gather the updated working params (stages 1–2), in buckets."""
    values, treedef = jax.tree.flatten(params)
    lays = jax.tree.leaves(layouts, is_leaf=is_layout)
    return jax.tree.unflatten(treedef, collectives.gather_buckets(values, lays, cfg.bucket_bytes))


def _logical(layouts: Layouts, tree: Any) -> Any:
    return _map(lambda lay, x: unpad(x, lay) if x.shape != lay.shape else x, layouts, tree)


def _stored(layouts: Layouts, tree: Any, sharded: bool) -> Any:
    return _map(lambda lay, x: pad(x, lay) if sharded else x, layouts, tree)


def optimizer_update(
    tx: optax.GradientTransformation,
    layouts: Layouts,
    opt_lays: OptState,
    sharded: bool,
    grads: Params,
    opt_state: OptState,
    master: Params,
    value: jax.Array | None = None,
    value_fn: Callable[[Params], jax.Array] | None = None,
) -> tuple[Params, OptState]:
    """``tx.update`` in the global view, on logical shapes; returns stored master and state.

    This runs outside ``shard_map`` on sharded global arrays, so XLA's partitioner
    adds exactly the communication the optimizer needs: none for an elementwise
    one (AdamW, Lion, SGD, masks), a scalar all-reduce for a global norm, whatever
    a factored or matrix optimizer (Adafactor, Muon) reads across a leaf. Padding
    is stripped first, so it never enters a norm, a mean or a shape-dependent rule.

    An optimizer that takes optax's extra arguments (``optax.lbfgs``'s line search,
    ``reduce_on_plateau``) gets ``value`` (the step's loss), ``grad`` (the gradient it
    updates with) and ``value_fn`` (the loss of the same batch at given logical params).
    """
    g, s, m = _logical(layouts, grads), _logical(opt_lays, opt_state), _logical(layouts, master)
    if isinstance(tx, optax.GradientTransformationExtraArgs) and value is not None:
        updates, s = tx.update(g, s, m, value=value, grad=g, value_fn=value_fn)
    else:
        updates, s = tx.update(g, s, m)
    m = optax.apply_updates(m, updates)
    return _stored(layouts, m, sharded), _stored(opt_lays, s, sharded)


def _value_fn(
    loss_and_grads: Callable[[Params], tuple[jax.Array, Params]],
) -> Callable[[Params], jax.Array]:
    """``value_fn(params) -> loss`` for optax's line searches, which differentiate it:
    its gradient is the step's own (reduced over devices), not autodiff of the sharded
    forward pass."""

    @jax.custom_vjp
    def value_fn(params: Params) -> jax.Array:
        return loss_and_grads(params)[0]

    def fwd(params: Params) -> tuple[jax.Array, Params]:
        return loss_and_grads(params)

    def bwd(grads: Params, ct: jax.Array) -> tuple[Params]:
        return (jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads),)

    value_fn.defvjp(fwd, bwd)
    return value_fn


def make_train_step(
    cfg: StepConfig,
    mesh: Mesh,
    layouts: Layouts,
    opt_lays: OptState,
    specs: TrainState,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
) -> Callable:
    """The global train step: explicit collectives in ``shard_map``, the update around them.

    ``train_step(state, batch) -> (state, {"loss", "grad_norm"})``, to be jitted with
    the state's shardings. Gradients are reduced (and stage 3 params gathered) by
    :func:`gradient_step` inside ``shard_map``; the optimizer updates the sharded
    master in the global view (:func:`optimizer_update`); stages 1–2 all-gather the
    new working params inside ``shard_map`` again.
    """
    sharded = master_sharded(cfg.stage)
    grad_specs = master_specs(cfg.stage, layouts)
    # check_vma=False (module docstring): the loss's gradient is per device, so the
    # reductions in reduce_gradients and hooks are the only ones; loss, norm and metrics
    # (P()) come from psum/pmean results, stage 0's gradients (P()) from an all-reduce.
    grads_of = jax.shard_map(
        functools.partial(gradient_step, cfg, layouts, loss_fn),
        mesh=mesh,
        in_specs=(specs.params, P(cfg.batch_axes), P()),
        out_specs=(P(), grad_specs, P(), P()),
        check_vma=False,
    )
    # check_vma=False: the new params' P() (stages 1-2) holds because an all_gather gives
    # every device the same array; check_vma=True cannot infer that and refuses to trace.
    gather = jax.shard_map(
        functools.partial(gather_params, cfg, layouts),
        mesh=mesh,
        in_specs=(grad_specs,),
        out_specs=specs.params,
        check_vma=False,
    )
    place = lambda tree: jax.tree.map(
        lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)),
        tree,
        grad_specs,
    )

    # a line search's loss and gradient at other params: the step's own, unclipped
    unclipped = jax.shard_map(
        functools.partial(
            gradient_step, dataclasses.replace(cfg, max_grad_norm=None), layouts, loss_fn
        ),
        mesh=mesh,
        in_specs=(specs.params, P(cfg.batch_axes), P()),
        out_specs=(P(), grad_specs, P(), P()),
        check_vma=False,
    )

    def loss_and_grads(logical: Params, batch: Batch, step: Any) -> tuple[jax.Array, Params]:
        master = place(_stored(layouts, logical, sharded))
        loss, grads, _, _ = unclipped(working(master), batch, step)
        return loss, _logical(layouts, grads)

    def working(master: Params) -> Params:
        """The working params (compute dtype, the stage's layout) of stored master params."""
        params = jax.tree.map(lambda m: m.astype(cfg.compute_dtype), master)
        return gather(params) if cfg.stage in (1, 2) else params

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        loss, grads, norm, extra = grads_of(state.params, batch, state.step)
        master = state.master if cfg.mixed else state.params
        value_fn = _value_fn(lambda logical: loss_and_grads(logical, batch, state.step))
        master, opt_state = optimizer_update(
            tx, layouts, opt_lays, sharded, grads, state.opt_state, master, loss, value_fn
        )
        master = place(master)
        new = TrainState(
            step=state.step + 1,
            params=working(master),
            master=master if cfg.mixed else None,
            opt_state=opt_state,
        )
        return new, {"loss": loss, "grad_norm": norm, **extra}

    return train_step


def eval_loss(
    cfg: StepConfig, layouts: Layouts, loss_fn: LossFn, params: Params, batch: Batch
) -> jax.Array:
    """Forward-only loss over the global batch, combined as the step combines it; a loss
    that takes ``rng`` gets None (no dropout)."""
    view = params
    if cfg.stage >= 2:
        view = model_view(cfg, layouts, params, _slots(layouts, cfg.stage == 3))
    total, weight, _ = loss_lib.unpack(_loss(cfg, loss_fn, view, batch, None))
    if weight is None:
        return jax.lax.pmean(total, cfg.batch_axes)
    return jax.lax.psum(total, cfg.batch_axes) / _nonzero(jax.lax.psum(weight, cfg.batch_axes))


def make_eval(
    cfg: StepConfig, mesh: Mesh, layouts: Layouts, specs: TrainState, loss_fn: LossFn
) -> Callable[[Params, Batch], jax.Array]:
    """``evaluate(params, batch)``: :func:`eval_loss` over the mesh, in the global view."""
    # check_vma=False as for the step (the module docstring says why): the loss runs as
    # plain per-device JAX; P() holds because eval_loss ends in a pmean or psum.
    return jax.shard_map(
        functools.partial(eval_loss, cfg, layouts, loss_fn),
        mesh=mesh,
        in_specs=(specs.params, P(cfg.batch_axes)),
        out_specs=P(),
        check_vma=False,
    )


def _nonzero(weight: jax.Array) -> jax.Array:
    return jnp.where(weight == 0, jnp.ones_like(weight), weight)
