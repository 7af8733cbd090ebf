"""``Engine``: a loss function and an optimizer, trained at a ZeRO stage on a mesh.

The engine owns the static decisions (layouts, shardings, the jitted step) and
holds no arrays: state goes in and out of :meth:`Engine.step`, which donates it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero import step as step_lib
from jaxzero.mesh import batch_axes, make_mesh, num_shards
from jaxzero.partition import Rule, is_layout, layouts_for, pad, unpad
from jaxzero.state import (
    TrainState,
    master_sharded,
    master_specs,
    params_sharded,
    state_specs,
    stored_shapes,
)

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def _dtype(name: Any, what: str) -> Any:
    if name in PRECISIONS:
        return PRECISIONS[name]
    if name in (jnp.float32, jnp.bfloat16, "float32", "bfloat16"):
        return jnp.dtype(name).type
    raise ValueError(f"unknown {what} {name!r}: use 'fp32' or 'bf16'")


def check_elementwise(tx: optax.GradientTransformation) -> bool:
    """Whether ``tx`` updates each element independently (two steps on halves == whole).

    Stages 1–3 run the optimizer on each device's slice; a transformation that
    looks across elements (``clip_by_global_norm``, LAMB, factored Adafactor)
    would silently compute something else.
    """
    rng = np.random.default_rng(0)
    whole = {"a": rng.standard_normal(16).astype(np.float32)}
    grads = [{"a": rng.standard_normal(16).astype(np.float32)} for _ in range(2)]

    def run(sl):
        p = {"a": jnp.asarray(whole["a"][sl])}
        s = tx.init(p)
        for g in grads:
            u, s = tx.update({"a": jnp.asarray(g["a"][sl])}, s, p)
            p = optax.apply_updates(p, u)
        return np.asarray(p["a"])

    try:
        halves = np.concatenate([run(slice(0, 8)), run(slice(8, 16))])
        return bool(np.allclose(run(slice(None)), halves, rtol=1e-5, atol=1e-6))
    except Exception:  # an optimizer that cannot even run on a slice is not elementwise
        return False


class Engine:
    """Trains ``loss_fn`` with ``optimizer`` at a ZeRO ``stage`` over ``mesh``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a batch.
      optimizer: any elementwise optax transformation (AdamW, SGD, Lion, schedules,
        masks); use ``max_grad_norm`` for clipping, which needs the global norm.
      mesh: from :func:`jaxzero.make_mesh` (default: all devices).
      stage: 0 (data parallel), 1, 2 or 3.
      precision: ``"fp32"``, or ``"bf16"`` (bf16 params, activations and gradient
        communication; fp32 master params and optimizer state).
      reduce_dtype: dtype of gradient reduction (default: the compute dtype).
      micro_batches: gradient accumulation steps per optimizer step.
      max_grad_norm: clip gradients to this global L2 norm (None: no clipping).
      per_layer: the model calls :func:`jaxzero.use_params` on each layer's params,
        so stages 2–3 reduce (and stage 3 gathers) per layer. Without it, stage 3
        gathers the whole tree once per micro-batch: correct but coarse.
      rules: ``(regex, dim | PartitionSpec | "replicate")`` overrides per leaf path.
      stacked: regex of leaf paths whose leading dim stacks scanned layers.
      min_shard_size: leaves with fewer elements are replicated.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxzero
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> engine = jaxzero.Engine(loss_fn, optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=3)
      >>> state = engine.init({"w": jax.random.normal(jax.random.key(0), (4, 2))})
      >>> x = jax.random.normal(jax.random.key(1), (8, 4))
      >>> batch = {"x": x, "y": x[:, :2]}
      >>> losses = []
      >>> for _ in range(5):
      ...     state, metrics = engine.step(state, batch)
      ...     losses.append(float(metrics["loss"]))
      >>> all(b < a for a, b in zip(losses, losses[1:]))  # every step lowers the loss
      True
      >>> losses[-1] < losses[0] / 2
      True
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        optimizer: optax.GradientTransformation | None = None,
        *,
        mesh: Mesh | None = None,
        stage: int = 3,
        precision: str = "fp32",
        reduce_dtype: str | None = None,
        micro_batches: int = 1,
        max_grad_norm: float | None = None,
        per_layer: bool = False,
        rules: Sequence[Rule] = (),
        stacked: str | None = None,
        min_shard_size: int = 64,
        check_optimizer: bool = True,
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        optimizer = optax.adamw(1e-3) if optimizer is None else optimizer
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got {optimizer!r}")
        self.loss_fn, self.tx = loss_fn, optimizer
        self.mesh = make_mesh() if mesh is None else mesh
        self.stage, self.precision = stage, precision
        self.compute_dtype = _dtype(precision, "precision")
        self.reduce_dtype = _dtype(reduce_dtype or precision, "reduce_dtype")
        self.micro_batches, self.max_grad_norm = micro_batches, max_grad_norm
        self.per_layer, self.rules, self.stacked = per_layer, tuple(rules), stacked
        self.min_shard_size = min_shard_size
        self.num_shards = num_shards(self.mesh)
        self.batch_devices = math.prod(self.mesh.shape[a] for a in batch_axes(self.mesh))
        self.batch_sharding = NamedSharding(self.mesh, P(batch_axes(self.mesh)))
        if check_optimizer and stage >= 1 and self.num_shards > 1 and not check_elementwise(
            optimizer
        ):
            raise ValueError(
                f"stage {stage} runs the optimizer on each device's slice, but this optimizer "
                "is not elementwise (e.g. it contains clip_by_global_norm or LAMB). Remove "
                "the cross-element part and use Engine(max_grad_norm=...) for clipping, use "
                "stage=0, or pass check_optimizer=False if you know better."
            )
        self.layouts: Any = None  # set by init
        self._batch_treedef = None

    # --- static structure ------------------------------------------------------------

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != jnp.float32

    @property
    def num_params(self) -> int:
        """Ψ: logical parameter count, padding excluded."""
        return sum(lay.size for lay in jax.tree.leaves(self.layouts, is_leaf=is_layout))

    def _config(self) -> step_lib.StepConfig:
        return step_lib.StepConfig(
            stage=self.stage,
            compute_dtype=self.compute_dtype,
            reduce_dtype=self.reduce_dtype,
            mixed=self.mixed,
            micro_batches=self.micro_batches,
            max_grad_norm=self.max_grad_norm,
            per_layer=self.per_layer,
            batch_axes=batch_axes(self.mesh),
            batch_devices=self.batch_devices,
        )

    def _set_layouts(self, shapes: Any) -> None:
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise TypeError(
                    f"param {jax.tree_util.keystr(path)} has dtype {leaf.dtype}; jaxzero trains "
                    "floating-point params only (keep constants out of the params tree)"
                )
        self.layouts = layouts_for(
            shapes, self.num_shards, rules=self.rules, stacked=self.stacked,
            min_shard_size=self.min_shard_size,
        )
        self.specs = state_specs(self.stage, self.layouts, self.tx, self.mixed)
        self.state_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs,
                                            is_leaf=lambda x: isinstance(x, P))
        self._build_jits()

    def _require_init(self) -> None:
        if self.layouts is None:
            raise RuntimeError("call engine.init(params) or engine.init_from(...) first")

    # --- state creation --------------------------------------------------------------

    def _state_from_padded(self, master32: Any) -> TrainState:
        """Build the state from fp32 master params in their stored layout (traced)."""
        lays = self.layouts
        if master_sharded(self.stage) and not params_sharded(self.stage):
            params = jax.tree.map(lambda m, lay: unpad(m, lay), master32, lays)
        else:
            params = master32
        params = jax.tree.map(lambda x: x.astype(self.compute_dtype), params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            master=master32 if self.mixed else None,
            opt_state=self.tx.init(master32),
        )

    def _master_layout(self, x: Any, lay) -> Any:
        return pad(x, lay) if master_sharded(self.stage) else x

    def init(self, params: Any) -> TrainState:
        """A sharded train state from an existing params pytree.

        Host (numpy) leaves are padded on the host and sent slice by slice, so a
        stage-3 model is never whole on one device.
        """
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                              params)
        self._set_layouts(shapes)
        master_sh = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec),
                                 master_specs(self.stage, self.layouts),
                                 is_leaf=lambda x: isinstance(x, P))

        def put(x, lay, sh):
            if isinstance(x, jax.Array):
                return jax.jit(lambda a: self._master_layout(a.astype(jnp.float32), lay),
                               out_shardings=sh)(x)
            return jax.device_put(self._master_layout(np.asarray(x, np.float32), lay), sh)

        master32 = jax.tree.map(put, params, self.layouts, master_sh)
        build = jax.jit(self._state_from_padded, out_shardings=self.state_shardings,
                        donate_argnums=0)
        return build(master32)

    def init_from(self, init_fn: Callable[..., Any], *args: Any) -> TrainState:
        """Create params with ``init_fn(*args)`` directly in their sharded layout.

        ``jax.eval_shape`` gives the shapes; the init runs under ``jit`` with the
        state's ``out_shardings``, so each device computes and keeps only its slice.
        """
        self._set_layouts(jax.eval_shape(init_fn, *args))

        def build(*a):
            p = init_fn(*a)
            p = jax.tree.map(lambda x, lay: self._master_layout(x.astype(jnp.float32), lay),
                             p, self.layouts)
            return self._state_from_padded(p)

        return jax.jit(build, out_shardings=self.state_shardings)(*args)

    def abstract_state(self, params_shapes: Any) -> TrainState:
        """The state's shapes, dtypes and shardings, allocating nothing.

        ``params_shapes`` is a pytree of ``jax.ShapeDtypeStruct`` (e.g.
        ``jax.eval_shape(model.init, key)``); the result lowers and compiles the
        step (:meth:`compile`) for models too large to create here.
        """
        self._set_layouts(params_shapes)
        master = stored_shapes(self.layouts, master_sharded(self.stage), jnp.float32)
        shapes = jax.eval_shape(self._state_from_padded, master)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    # --- the step ----------------------------------------------------------------------

    def _build_jits(self) -> None:
        cfg, lays, mesh = self._config(), self.layouts, self.mesh
        bspec = P(batch_axes(mesh))
        body = functools.partial(step_lib.train_step, cfg, lays, self.loss_fn, self.tx)
        sharded = jax.shard_map(body, mesh=mesh, in_specs=(self.specs, bspec),
                                out_specs=(self.specs, P()), check_vma=False)
        self._step = jax.jit(sharded, in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=(self.state_shardings,
                                            NamedSharding(mesh, P())),
                             donate_argnums=0)
        ev = functools.partial(step_lib.eval_loss, cfg, lays, self.loss_fn)
        ev_sharded = jax.shard_map(ev, mesh=mesh, in_specs=(self.specs.params, bspec),
                                   out_specs=P(), check_vma=False)
        self._eval = jax.jit(ev_sharded)

    def _check_batch(self, batch: Any) -> None:
        leaves, treedef = jax.tree.flatten(batch)
        if not leaves:
            raise ValueError("batch is empty: pass a pytree of arrays with a leading batch dim")
        if self._batch_treedef is not None and treedef != self._batch_treedef:
            raise ValueError(
                f"batch structure changed: expected {self._batch_treedef}, got {treedef}. "
                "Every step must receive the same pytree of arrays."
            )
        sizes = {jax.tree_util.keystr(p): (x.shape[0] if len(x.shape) else None)
                 for p, x in jax.tree_util.tree_leaves_with_path(batch)}
        if len(set(sizes.values())) != 1 or None in sizes.values():
            raise ValueError(
                f"every batch leaf needs the same leading (batch) dim, got {sizes}"
            )
        b = next(iter(sizes.values()))
        need = self.batch_devices * self.micro_batches
        if b % need:
            raise ValueError(
                f"global batch {b} is not divisible by {self.batch_devices} devices x "
                f"{self.micro_batches} micro-batches = {need}; use a multiple of {need}"
            )
        self._batch_treedef = treedef

    def shard_batch(self, batch: Any) -> Any:
        """Host arrays → global arrays split over the batch axes.

        With several processes, each passes only the rows its devices hold (its
        contiguous share of the global batch, in process order).
        """
        def one(x):
            if isinstance(x, jax.Array) and not jax.process_count() > 1:
                return jax.device_put(x, self.batch_sharding)
            if jax.process_count() == 1:
                return jax.device_put(np.asarray(x), self.batch_sharding)
            return jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x))

        return jax.tree.map(one, batch)

    def _global_batch(self, batch: Any) -> Any:
        leaves = jax.tree.leaves(batch)
        if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            sh = self.batch_sharding
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                 batch)
        elif not all(isinstance(x, jax.Array) for x in leaves):
            batch = self.shard_batch(batch)
        self._check_batch(batch)
        return batch

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on the global ``batch``; ``state`` is donated (consumed).

        Returns the new state and ``{"loss", "grad_norm"}`` (replicated scalars).
        """
        self._require_init()
        return self._step(state, self._global_batch(batch))

    def eval_loss(self, state: TrainState, batch: Any) -> jax.Array:
        """Mean loss of ``batch`` at the current params, without a gradient."""
        self._require_init()
        return self._eval(state.params, self._global_batch(batch))

    def compile(self, state: TrainState, batch: Any) -> jax.stages.Compiled:
        """The compiled step, for its HLO and ``memory_analysis()`` (nothing runs).

        ``state`` and ``batch`` may be arrays or ``jax.ShapeDtypeStruct`` trees
        (:meth:`abstract_state`).
        """
        self._require_init()
        return self._step.lower(state, self._global_batch(batch)).compile()

    # --- reading back ------------------------------------------------------------------

    def gather_params(self, state: TrainState) -> Any:
        """Full fp32 params on the host, with the structure ``init`` was given."""
        self._require_init()
        src = state.master if self.mixed else state.params

        def host(x, lay):
            if jax.process_count() > 1 and not x.is_fully_replicated:
                from jax.experimental import multihost_utils

                x = multihost_utils.process_allgather(x, tiled=True)
            return np.asarray(unpad(np.asarray(jax.device_get(x)), lay), np.float32)

        return jax.tree.map(host, src, self.layouts)

    def report(self, state: TrainState, batch: Any):
        """Measured memory and communication beside the ZeRO formulas."""
        from jaxzero import accounting

        return accounting.report(self, state, batch)
