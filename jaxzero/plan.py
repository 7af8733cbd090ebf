"""The plan: every decision an engine makes from the params' shapes, as one frozen value.

:func:`make_plan` is a pure function of the params' shapes and the engine's
:class:`Settings`: each leaf's layout (sharded dim, padding), the optimizer state's
layouts, the state's specs and shardings, and the pure train step and evaluation.
:class:`~jaxzero.Engine` builds it once, at its first init, and refuses other shapes
afterwards; checkpoints and the accounting read what they need from it. The state
builders here (:func:`fresh_state`, :func:`state_from_params`, :func:`read_state`,
:func:`state_shapes`, ...) are pure functions of a plan too.

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxzero
  >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  >>> engine = jaxzero.Engine(loss_fn, optax.sgd(0.1), mesh=jaxzero.make_mesh(1))
  >>> state = engine.init({"w": jnp.zeros((4, 2)), "b": jnp.zeros(3)})
  >>> print(engine.plan)
  plan: stage 3, N=1 of 1 devices, fp32, micro_batches=1, donate=True, 11 params
  params:
    b  (3,)  replicated
    w  (4, 2)  replicated
  optimizer state (0 leaves):
  >>> other = jaxzero.Engine(loss_fn, optax.sgd(0.5), mesh=jaxzero.make_mesh(1))
  >>> _ = other.abstract_state(jax.eval_shape(lambda: {"w": jnp.zeros((4, 2)), "b": jnp.zeros(3)}))
  >>> other.plan == engine.plan  # the same step compiles (the learning rate is not compared)
  True
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero import frozen as frozen_lib
from jaxzero import offload
from jaxzero import step as step_lib
from jaxzero.partition import LeafLayout, is_layout, layouts_for, pad, path_str, unpad
from jaxzero.settings import Settings
from jaxzero.state import (
    TrainState,
    master_sharded,
    master_specs,
    opt_layouts,
    params_sharded,
    state_specs,
    stored_shapes,
)
from jaxzero.types import Batch, Layouts, Metrics, OptState, Params, Shardings

__all__ = ["Plan"]

StepFn = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
EvalFn = Callable[..., jax.Array]  # (params, batch, frozen=None, model_state=None) -> loss
Read = Callable[[LeafLayout, tuple[slice, ...]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an engine decided from the params' shapes; built by :func:`make_plan`.

    ``str(plan)`` (:meth:`describe`) lists each leaf's layout. Two plans are equal when
    two engines would compile the same step: the same settings (mesh, stage, dtypes,
    micro-batches, buckets, donation, compiler options, layout rules) and the same
    layouts and specs of the params and optimizer state. The loss function and the
    optax transformation are not compared (functions have no useful equality): two
    engines with different losses or learning rates but the same shapes and settings
    have equal plans; the optimizer's state structure is compared, through
    ``opt_layouts``. A plan holds trees of dicts, so it is not hashable.

    Attributes:
      settings: the engine's :class:`Settings`.
      layouts: the params' :class:`~jaxzero.LeafLayout` tree.
      opt_layouts: the optimizer state's layout tree (:func:`jaxzero.state.opt_layouts`).
      specs: the train state's ``PartitionSpec`` tree (a :class:`TrainState`).
      state_shardings: the same as ``NamedSharding`` on the mesh (not compared: derived).
      master_shardings: the fp32 master params' shardings (not compared: derived).
      step_fn: the pure train step ``(state, batch) -> (state, metrics)`` (not compared).
      eval_fn: the pure evaluation ``(params, batch, frozen=None) -> loss`` (not compared).
      tx: the optax transformation the state builders initialise (not compared).
      mask: a bool per param, True where it trains (``Engine(trainable=...)``); None
        when every param trains.
      frozen_layouts: the frozen params' layouts (``MaskedNode`` where a param trains,
        :mod:`jaxzero.frozen`); None when every param trains. ``layouts`` then holds
        the trainable ones, with ``MaskedNode`` where a param is frozen.
      frozen_dtypes: the frozen params' stored dtypes (names), the same structure.
      model_state: the model state's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves,
        :mod:`jaxzero.model_state`); None when the engine keeps none.
    """

    settings: Settings
    layouts: Layouts
    opt_layouts: OptState
    specs: TrainState
    state_shardings: TrainState = dataclasses.field(compare=False, repr=False)
    master_shardings: Shardings = dataclasses.field(compare=False, repr=False)
    step_fn: StepFn = dataclasses.field(compare=False, repr=False)
    eval_fn: EvalFn = dataclasses.field(compare=False, repr=False)
    tx: optax.GradientTransformation = dataclasses.field(compare=False, repr=False)
    mask: Params = None
    frozen_layouts: Layouts = None
    frozen_dtypes: Params = None
    model_state: Any = None
    # the jitted state builders, made once a plan (a memo, not part of the value)
    memo: dict[str, Callable[..., Any]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    __hash__ = None  # type: ignore[assignment]  # trees of dicts: unhashable

    # --- what the rest of jaxzero reads, typed ------------------------------------------

    @property
    def stage(self) -> int:
        return self.settings.step.stage

    @property
    def mesh(self) -> Mesh:
        return self.settings.mesh

    @property
    def mixed(self) -> bool:
        """Whether the state keeps separate fp32 master params (bf16 training)."""
        return self.settings.step.mixed

    @property
    def num_shards(self) -> int:
        return self.settings.num_shards

    @property
    def has_ema(self) -> bool:
        """Whether the state keeps an EMA of the weights (``Engine(ema=...)``)."""
        return self.settings.step.ema

    @property
    def has_model_state(self) -> bool:
        """Whether the state keeps model state (``Engine(model_state=...)``)."""
        return self.model_state is not None

    @property
    def num_params(self) -> int:
        """Ψ: the trainable params' logical count, padding excluded (every param when
        none is frozen): what the ZeRO formulas' 16Ψ counts."""
        return sum(lay.size for lay in self.leaves())

    @property
    def num_frozen(self) -> int:
        """The frozen params' logical count (0 when every param trains)."""
        return sum(lay.size for lay in self.frozen_leaves())

    def frozen_leaves(self) -> list[LeafLayout]:
        """The frozen params' layouts in tree order (none when every param trains)."""
        return list(jax.tree.leaves(self.frozen_layouts, is_leaf=is_layout))

    def all_layouts(self) -> Layouts:
        """Every param's layout, trainable and frozen, in the params' structure."""
        return frozen_lib.merge(self.mask, self.layouts, self.frozen_layouts)

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.settings.batch_sharding

    def leaves(self) -> list[LeafLayout]:
        """The params' layouts in tree order."""
        return list(jax.tree.leaves(self.layouts, is_leaf=is_layout))

    def shapes(self) -> Params:
        """The params' logical shapes, as the engine was given them: a tree of tuples."""
        return jax.tree.map(lambda lay: lay.shape, self.all_layouts(), is_leaf=is_layout)

    def describe(self) -> str:
        """Every leaf's layout: shape, sharded dim, padding, stored shape."""
        s = self.settings
        frozen = f" (+{self.num_frozen:,} frozen)" if self.mask is not None else ""
        head = (
            f"plan: stage {self.stage}, N={self.num_shards} of {s.mesh.devices.size} devices, "
            f"{s.precision}, micro_batches={s.step.micro_batches}, "
            f"donate={s.donate}, {self.num_params:,} params{frozen}"
        )
        lines = [head, "params:"]
        params = jax.tree_util.tree_leaves_with_path(self.layouts, is_leaf=is_layout)
        lines += [_describe(path, lay, params_sharded(self.stage)) for path, lay in params]
        if self.mask is not None:
            lines.append("frozen params:")
            held = jax.tree_util.tree_leaves_with_path(self.frozen_layouts, is_leaf=is_layout)
            lines += [_describe(path, lay, params_sharded(self.stage)) for path, lay in held]
        opt = jax.tree_util.tree_leaves_with_path(self.opt_layouts, is_leaf=is_layout)
        lines.append(f"optimizer state ({len(opt)} leaves):")
        lines += [_describe(path, lay, master_sharded(self.stage)) for path, lay in opt]
        if self.has_ema:
            decay = self.settings.ema
            said = f"{decay:g}" if isinstance(decay, float) else "a function of the step"
            lines.append(f"ema: fp32, laid out as the master params (decay {said})")
        if self.has_model_state:
            held = jax.tree_util.tree_leaves_with_path(self.model_state)
            lines.append(f"model state ({len(held)} leaves, replicated):")
            lines += [f"  {path_str(p)}  {tuple(s.shape)}  {s.dtype}" for p, s in held]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _describe(path: Any, lay: LeafLayout, sharded: bool) -> str:
    """One leaf's line: its name, shape, sharded dim and padding, stored shape."""
    name = path_str(path) or "(root)"
    model = "" if lay.model_dim is None else f"  model dim {lay.model_dim}"
    if lay.dim is None or not sharded:
        return f"  {name}  {lay.shape}  replicated{model}"
    extra = lay.padded_shape[lay.dim] - lay.shape[lay.dim]
    return f"  {name}  {lay.shape}  dim {lay.dim}  pad {extra}  stored {lay.padded_shape}{model}"


def check_dtypes(shapes: Params, compute_dtype: Any, precision: str, mask: Params = None) -> None:
    """Refuse non-float params; warn (once, listing a few) about those converted.
    Frozen params (False in ``mask``) are stored as they are: any dtype, no warning."""
    if mask is not None:
        shapes = frozen_lib.split(shapes, mask)[0]
    converted = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"param {path_str(path)!r} has dtype {leaf.dtype}; jaxzero trains "
                "floating-point params only (keep constants out of the params tree)"
            )
        if leaf.dtype not in (jnp.float32, compute_dtype):
            converted.append(f"{path_str(path)} ({jnp.dtype(leaf.dtype).name})")
    if converted:
        warnings.warn(
            f"{len(converted)} param(s) converted: {', '.join(converted[:4])}"
            f"{' ...' if len(converted) > 4 else ''}. The engine keeps fp32 master params "
            f"and computes in {jnp.dtype(compute_dtype).name} "
            f"(precision={precision!r}); pass float32 params to silence this.",
            stacklevel=4,  # check_dtypes < Engine.plan_for < Engine.init < its caller
        )


def make_plan(
    shapes: Params,
    settings: Settings,
    loss_fn: step_lib.LossFn,
    tx: optax.GradientTransformation,
    mask: Params = None,
    model_state: Any = None,
) -> Plan:
    """The plan for params of ``shapes`` (a tree of ``jax.ShapeDtypeStruct``; their
    dtypes are checked by :func:`check_dtypes`, at every init). ``mask``: a bool per
    param, False where it is frozen (:func:`jaxzero.frozen.mask_of`; None: all train).
    ``model_state``: the model state's shapes (None: none, :mod:`jaxzero.model_state`)."""
    cfg, mesh = settings.step, settings.mesh
    layouts = layouts_for(
        shapes,
        settings.state_shards,
        rules=settings.rules,
        stacked=settings.stacked,
        min_shard_size=settings.min_shard_size,
        model_shards=settings.model_shards,
    )
    held = dtypes = None
    if mask is not None and frozen_lib.has_frozen(mask):
        layouts, held = frozen_lib.split(layouts, mask)
        dtypes = frozen_lib.split(jax.tree.map(lambda s: jnp.dtype(s.dtype).name, shapes), mask)[1]
    else:
        mask = None
    fz = None if held is None else step_lib.Frozen(held, mask)
    opt_lays = opt_layouts(tx, layouts, settings.min_shard_size)
    specs = state_specs(
        cfg.stage, layouts, opt_lays, cfg.mixed, held, cfg.hpz, cfg.ema, model_state
    )
    named = lambda tree: jax.tree.map(
        lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, P)
    )
    state_shardings = named(specs)
    if cfg.offload:
        offload.check_available(mesh)
        state_shardings = offload.host_shardings(state_shardings, cfg.mixed)
    return Plan(
        settings=settings,
        layouts=layouts,
        opt_layouts=opt_lays,
        specs=specs,
        state_shardings=state_shardings,
        master_shardings=named(master_specs(cfg.stage, layouts, cfg.hpz)),
        step_fn=step_lib.make_train_step(
            cfg, mesh, layouts, opt_lays, specs, loss_fn, tx, fz, settings.ema
        ),
        eval_fn=step_lib.make_eval(cfg, mesh, layouts, specs, loss_fn, fz),
        tx=tx,
        mask=mask,
        frozen_layouts=held,
        frozen_dtypes=dtypes,
        model_state=model_state,
    )


def shapes_of(params: Params) -> Params:
    """``ShapeDtypeStruct`` of each leaf of a params tree (numpy leaves, float64 too)."""
    dtype = lambda x: x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype(x)), params)


def shape_mismatch(plan: Plan, shapes: Params) -> str | None:
    """None when ``shapes`` are the plan's params' shapes; else a one-line refusal."""
    theirs = jax.tree.map(lambda s: tuple(s.shape), shapes)
    if theirs == plan.shapes():
        return None
    return (
        f"the engine was built for params of shapes {plan.shapes()}, not {theirs}; "
        "make a new Engine for other shapes"
    )


# --- the state, from a plan ---------------------------------------------------------------


def jitted_step(plan: Plan) -> Any:
    """:attr:`Plan.step_fn` under ``jax.jit`` with the plan's shardings, donation and
    compiler options (made once a plan)."""
    if "step" not in plan.memo:
        s = plan.settings
        plan.memo["step"] = jax.jit(
            plan.step_fn,
            in_shardings=(plan.state_shardings, s.batch_sharding),
            out_shardings=(plan.state_shardings, NamedSharding(s.mesh, P())),
            donate_argnums=0 if s.donate else (),
            compiler_options=dict(s.compiler_options) or None,
        )
    return plan.memo["step"]


def jitted_eval(plan: Plan, ema: bool = False) -> Any:
    """:attr:`Plan.eval_fn` under ``jax.jit`` (made once a plan). ``ema``: the evaluation
    at the EMA's weights, ``(ema, batch, frozen, model_state) -> loss``: the EMA (stored
    as the master, on the device or the host) made working params as the step makes the new master's
    (cast to the compute dtype; gathered at stages 1-2), then the same evaluation."""
    key = "eval_ema" if ema else "eval"
    if key not in plan.memo:
        options = dict(plan.settings.compiler_options) or None
        fn = plan.eval_fn
        if ema:
            s = plan.settings
            working = step_lib.make_working(s.step, s.mesh, plan.layouts, plan.specs)
            on_device = offload.device_shardings(plan.master_shardings)

            def fn(
                average: Params, batch: Batch, frozen: Params = None, model_state: Any = None
            ) -> jax.Array:
                params = working(offload.to_device(average, on_device))
                return plan.eval_fn(params, batch, frozen, model_state)

        plan.memo[key] = jax.jit(fn, compiler_options=options)
    return plan.memo[key]


def to_master(plan: Plan, x: Any, lay: LeafLayout) -> Any:
    """A logical fp32 leaf in the master's stored layout (padded when sharded)."""
    return pad(x, lay) if master_sharded(plan.stage) else x


def fresh_state(
    plan: Plan,
    master32: Params,
    opt_state: OptState = None,
    step: Any = 0,
    frozen: Params = None,
    ema: Params = None,
    model_state: Any = None,
) -> TrainState:
    """The state from fp32 master params in their stored layout (traced).

    ``opt_state`` (stored layout) defaults to a fresh ``tx.init``; ``frozen`` (the frozen
    params, stored) is kept as it is; ``ema`` (stored as the master) defaults to the
    master params themselves when the plan keeps an EMA (:mod:`jaxzero.ema`);
    ``model_state`` is kept as it is (the builders place it apart, :func:`place_model_state`).
    """
    lays, cfg = plan.layouts, plan.settings.step
    if master_sharded(plan.stage) and not params_sharded(plan.stage):
        params = jax.tree.map(lambda m, lay: unpad(m, lay), master32, lays)
    else:
        params = master32
    params = jax.tree.map(lambda x: x.astype(cfg.compute_dtype), params)
    if opt_state is None:
        logical = jax.tree.map(lambda m, lay: unpad(m, lay), master32, lays)
        opt_state = jax.tree.map(
            lambda lay, x: to_master(plan, x, lay),
            plan.opt_layouts,
            plan.tx.init(logical),
            is_leaf=is_layout,
        )
    if cfg.ema and ema is None:
        ema = master32
    return TrainState(
        step=jnp.asarray(step, jnp.int32),
        params=params,
        master=master32 if cfg.mixed else None,
        opt_state=opt_state,
        frozen=frozen,
        ema=ema if cfg.ema else None,
        model_state=model_state,
    )


def _trained_shardings(plan: Plan) -> TrainState:
    """The state's shardings without the frozen params and the model state (the builders
    add those apart, already placed, so no builder copies them)."""
    return dataclasses.replace(plan.state_shardings, frozen=None, model_state=None)


def _with_frozen(state: TrainState, frozen: Params) -> TrainState:
    return state if frozen is None else dataclasses.replace(state, frozen=frozen)


MODEL_STATE_NEEDED = (
    "the engine keeps model state (model_state=...): pass its initial value "
    "(Engine(..., model_state=...) holds one; a restore reads it from the checkpoint)"
)


def place_model_state(plan: Plan, model_state: Any) -> Any:
    """The model state replicated on the mesh in its planned dtypes (None without one),
    refused in one line when its structure or shapes are not the plan's."""
    if plan.model_state is None:
        return None
    if model_state is None:
        raise ValueError(MODEL_STATE_NEEDED)
    theirs = jax.tree.map(lambda x: tuple(np.shape(x)), model_state)
    mine = jax.tree.map(lambda s: tuple(s.shape), plan.model_state)
    if theirs != mine:
        raise ValueError(f"model state of shapes {theirs}; the engine was built for {mine}")
    # through the host (a few floats a channel): a fresh buffer, so a donating step never
    # consumes the value the engine or the caller holds
    return jax.tree.map(
        lambda x, s, sh: jax.device_put(np.array(x, s.dtype), sh),
        model_state,
        plan.model_state,
        plan.state_shardings.model_state,
    )


def _with_model_state(plan: Plan, state: TrainState, model_state: Any) -> TrainState:
    if plan.model_state is None:
        return state
    return dataclasses.replace(state, model_state=place_model_state(plan, model_state))


def state_from_parts(
    plan: Plan,
    master32: Params,
    opt_state: OptState,
    step: int,
    frozen: Params = None,
    ema: Params = None,
    model_state: Any = None,
) -> TrainState:
    """A state from restored parts: fp32 master params, optimizer state and EMA, each
    already in the plan's stored layout and the master's sharding
    (:class:`~jaxzero.CheckpointManager`; ``ema`` None: the master params, when the plan
    keeps one), the frozen params as stored (:func:`place_frozen`) and the model state."""
    if "parts" not in plan.memo:
        build = lambda m, o, s, e: fresh_state(plan, m, o, s, ema=e)
        plan.memo["parts"] = jax.jit(build, out_shardings=_trained_shardings(plan))
    state = _with_frozen(plan.memo["parts"](master32, opt_state, step, ema), frozen)
    return _with_model_state(plan, state, model_state)


def state_from_master(
    plan: Plan, master32: Params, frozen: Params = None, model_state: Any = None
) -> TrainState:
    """The state (fresh optimizer) from fp32 master params, stored and sharded, the
    frozen params as stored (:func:`place_frozen`; None when every param trains) and the
    model state (:func:`place_model_state`; None when the plan keeps none)."""
    # the fp32 copy becomes the master (or the stage-3 params) unless stages 1-2
    # keep none: then nothing in the state has its sharded shape to reuse it for
    # or when offload keeps the master on the host (a device buffer cannot become it)
    on_host = plan.mixed and plan.settings.step.offload
    temporary = (not plan.mixed and plan.stage in (1, 2)) or on_host
    if "master" not in plan.memo:
        plan.memo["master"] = jax.jit(
            lambda m: fresh_state(plan, m),
            out_shardings=_trained_shardings(plan),
            donate_argnums=() if temporary else 0,
        )
    state = _with_frozen(plan.memo["master"](master32), frozen)
    return _with_model_state(plan, state, model_state)


def to_frozen(plan: Plan, x: Any, lay: LeafLayout, dtype: str) -> Any:
    """A logical frozen leaf as stored: its plan dtype, padded when params are sharded."""
    x = x.astype(dtype)
    return pad(x, lay) if params_sharded(plan.stage) else x


def place_frozen(plan: Plan, frozen: Params) -> Params:
    """The frozen params (``MaskedNode`` where a param trains, :func:`jaxzero.frozen.split`)
    stored and sharded, host leaves sent slice by slice; None when every param trains."""
    if plan.mask is None:
        return None

    def put(lay: LeafLayout, dtype: str, x: Any, sh: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array):
            return jax.jit(lambda a: to_frozen(plan, a, lay, dtype), out_shardings=sh)(x)
        return jax.device_put(to_frozen(plan, np.asarray(x), lay, dtype), sh)

    return jax.tree.map(
        put,
        plan.frozen_layouts,
        plan.frozen_dtypes,
        frozen,
        plan.state_shardings.frozen,
        is_leaf=is_layout,
    )


def _split(plan: Plan, params: Params) -> tuple[Params, Params]:
    """``(trainable, frozen)`` of a whole params tree (frozen None when all train)."""
    if plan.mask is None:
        return params, None
    return frozen_lib.split(params, plan.mask)


def state_from_params(plan: Plan, params: Params, model_state: Any = None) -> TrainState:
    """The state from a params pytree (and the initial model state, when the plan keeps
    one). Host (numpy) leaves are padded on the host and sent slice by slice, so a
    stage-3 model is never whole on one device."""

    def put(x: Any, lay: LeafLayout, sh: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array):
            return jax.jit(lambda a: to_master(plan, a.astype(jnp.float32), lay), out_shardings=sh)(
                x
            )
        return jax.device_put(to_master(plan, np.asarray(x, np.float32), lay), sh)

    trained, frozen = _split(plan, params)
    master = jax.tree.map(put, trained, plan.layouts, plan.master_shardings)
    return state_from_master(plan, master, place_frozen(plan, frozen), model_state)


def state_from_init(
    plan: Plan, init_fn: Callable[..., Params], *args: Any, model_state: Any = None
) -> TrainState:
    """The state of ``init_fn(*args)``'s params, created under ``jit`` in its shardings
    (and the initial model state, when the plan keeps one)."""

    def build(*a: Any) -> TrainState:
        trained, frozen = _split(plan, init_fn(*a))
        p = jax.tree.map(
            lambda x, lay: to_master(plan, x.astype(jnp.float32), lay), trained, plan.layouts
        )
        if frozen is not None:
            frozen = jax.tree.map(
                lambda lay, dtype, x: to_frozen(plan, x, lay, dtype),
                plan.frozen_layouts,
                plan.frozen_dtypes,
                frozen,
                is_leaf=is_layout,
            )
        return fresh_state(plan, p, frozen=frozen)

    shardings = dataclasses.replace(plan.state_shardings, model_state=None)
    built = jax.jit(build, out_shardings=shardings)(*args)
    return _with_model_state(plan, built, model_state)


def frozen_shapes(plan: Plan) -> Params:
    """The frozen params' stored shapes and dtypes (None when every param trains)."""
    if plan.mask is None:
        return None
    sharded = params_sharded(plan.stage)
    return jax.tree.map(
        lambda lay, dtype: jax.ShapeDtypeStruct(lay.padded_shape if sharded else lay.shape, dtype),
        plan.frozen_layouts,
        plan.frozen_dtypes,
        is_leaf=is_layout,
    )


def state_shapes(plan: Plan) -> TrainState:
    """The state's shapes, dtypes and shardings, allocating nothing."""
    master = stored_shapes(plan.layouts, master_sharded(plan.stage), jnp.float32)
    build = lambda m, f, s: fresh_state(plan, m, frozen=f, model_state=s)
    shapes = jax.eval_shape(build, master, frozen_shapes(plan), plan.model_state)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        plan.state_shardings,
    )


def read_state(plan: Plan, read: Read, model_state: Any = None) -> TrainState:
    """A state whose params are read slice by slice, straight into their shardings.

    ``read(layout, index)`` returns the region ``index`` (slices within ``layout.shape``)
    of one param, in any float dtype; it is called only for what this process's devices
    hold (each distinct slice once), never for the padding. Frozen params are read the
    same way, into their stored dtype and layout.
    """

    def leaf(
        lay: LeafLayout, sh: NamedSharding, dtype: Any = np.float32, sharded: bool | None = None
    ) -> jax.Array:
        sharded = master_sharded(plan.stage) if sharded is None else sharded
        stored = lay.padded_shape if sharded else lay.shape
        # replicas (stage 0, small leaves, hybrid meshes) ask for the same slices:
        # each distinct one is read once; together they are at most this one leaf
        cache: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

        def callback(index: tuple[slice, ...] | None) -> np.ndarray:
            assert index is not None  # JAX passes every shard's index (typed optional)
            span = tuple(s.indices(n)[:2] for s, n in zip(index, stored, strict=True))
            if span not in cache:
                inside = tuple(
                    slice(min(a, n), min(b, n)) for (a, b), n in zip(span, lay.shape, strict=True)
                )
                out = np.zeros([b - a for a, b in span], dtype)
                out[tuple(slice(0, s.stop - s.start) for s in inside)] = read(lay, inside)
                cache[span] = out
            return cache[span]

        return jax.make_array_from_callback(stored, sh, callback)

    master = jax.tree.map(leaf, plan.layouts, plan.master_shardings, is_leaf=is_layout)
    frozen = None
    if plan.mask is not None:
        frozen = jax.tree.map(
            lambda lay, sh, dtype: leaf(lay, sh, jnp.dtype(dtype), params_sharded(plan.stage)),
            plan.frozen_layouts,
            plan.state_shardings.frozen,
            plan.frozen_dtypes,
            is_leaf=is_layout,
        )
    return state_from_master(plan, master, frozen, model_state)
