"""``Engine``: a loss function and an optimizer, trained at a ZeRO stage on a mesh.

The engine owns the static decisions (layouts, shardings, the jitted step) and
holds no arrays: state goes in and out of :meth:`Engine.step`, which donates it
(on accelerators by default, on CPUs at stage 3; ``donate=``, see :mod:`jaxzero.backend`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero import backend
from jaxzero import loss as loss_lib
from jaxzero import step as step_lib
from jaxzero.mesh import batch_axes, make_mesh, num_shards
from jaxzero.partition import LeafLayout, Rule, is_layout, layouts_for, pad, path_str, unpad
from jaxzero.state import (
    TrainState,
    master_sharded,
    master_specs,
    opt_layouts,
    params_sharded,
    state_specs,
    stored_shapes,
)

__all__ = ["Engine", "EngineLike", "gather_leaf"]

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def _dtype(name: Any, what: str) -> Any:
    if name in PRECISIONS:
        return PRECISIONS[name]
    if name in (jnp.float32, jnp.bfloat16, "float32", "bfloat16"):
        return jnp.dtype(name).type
    raise ValueError(f"unknown {what} {name!r}: use 'fp32' or 'bf16'")


class Engine:
    """Trains ``loss_fn`` with ``optimizer`` at a ZeRO ``stage`` over ``mesh``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a batch; or any
        form of :mod:`jaxzero.loss`: ``Weighted(total, weight)`` for masked or uneven
        token counts (exact over devices and micro-batches), ``(loss, aux)`` for extra
        metrics, a third ``rng`` parameter for a PRNG key (Flax's ``rngs=`` takes it).
      optimizer: any optax transformation (required: e.g. ``optax.adamw(1e-3)``).
        It sees logical shapes and runs on the sharded state in the global view, so
        elementwise ones stay local and the rest (clipping, LAMB, Adafactor, Muon) get
        the communication they need. ``max_grad_norm`` clips inside the step at no extra cost.
        ``optax.MultiSteps`` updates every k-th step (``micro_batches=k`` is the exact
        accumulation within one step); optimizers taking optax's extra arguments get
        ``value``, ``grad`` and ``value_fn`` (the loss of the step's batch, as
        :meth:`eval_loss`), so ``optax.lbfgs`` runs its line search.
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
      bucket_mb: gradients and params travel in packed collectives of at most this
        many MiB (DeepSpeed's ``reduce_bucket_size`` / ``allgather_bucket_size``):
        stages 1–2's reduce-scatter and all-gather of the whole model, and each
        ``use_params`` call's gather and reduce-scatter at stages 2–3. One rendezvous
        a bucket instead of one a leaf, for at most one bucket of extra memory. 0:
        one collective per leaf. None: the backend's default
        (:data:`jaxzero.backend.BUCKET_MB`, 64; a ``per_layer=False`` model's stage-3
        whole-tree call on CPUs one collective a leaf,
        :data:`jaxzero.backend.WHOLE_TREE_BUCKET_MB`).
      donate: whether the step donates (consumes) its input state, so the new state
        reuses its buffers. None: the backend's default for the stage
        (:data:`jaxzero.backend.DONATE`: every stage on accelerators, stage 3 on CPUs).
        Either way, use only the state a step returns.
      dot_barrier: pass each gradient through :func:`jaxzero.collectives.dot_barrier`
        before it is reduced (per-layer models: in each layer's ``use_params``
        backward, inside a scan too), so XLA:CPU keeps weight-gradient dots on its fast
        kernels. None: the backend's default (:data:`jaxzero.backend.DOT_BARRIER`,
        on for CPUs). The math is the same either way; only the dots' kernel, and so
        their rounding, differs.
      seed: the seed of the key a ``loss_fn(params, batch, rng)`` gets (dropout: a
        mask per row of the global batch, :mod:`jaxzero.loss`), and of an NNX module's
        random streams in the step (:class:`jaxzero.NNXEngine`).
      compiler_options: XLA options for the step, updating the backend's preset
        (on GPUs :data:`jaxzero.backend.GPU_OPTIONS`: the latency-hiding scheduler
        and pipelined collectives that overlap gathers with compute); a value of
        None removes that option.

    Attributes:
      mesh: the device mesh.
      batch_sharding: how a global batch lies on the mesh (its leading dim split over
        the batch axes); :meth:`shard_batch` puts a batch there.
      state_shardings: the train state's shardings (after init).
      step_fn: the pure, un-jitted step (after init), for a loop of your own:
        ``jax.jit`` it, ``lax.scan`` it, wrap it.
      donate: whether :meth:`step` donates its input state.
      compiler_options: the XLA options :meth:`step` is compiled with.

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
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
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
        bucket_mb: float | None = None,
        donate: bool | None = None,
        dot_barrier: bool | None = None,
        seed: int = 0,
        compiler_options: dict[str, Any] | None = None,
    ):
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
                f"optimizer must be an optax transformation (e.g. optax.adamw(1e-3)), "
                f"got {optimizer!r}"
            )
        self.loss_fn, self.tx = loss_fn, optimizer
        self.mesh = make_mesh() if mesh is None else mesh
        self.stage, self.precision = stage, precision
        self.compute_dtype = _dtype(precision, "precision")
        self.reduce_dtype = _dtype(reduce_dtype or precision, "reduce_dtype")
        self.micro_batches, self.max_grad_norm = micro_batches, max_grad_norm
        self.per_layer, self.rules, self.stacked = per_layer, tuple(rules), stacked
        self.min_shard_size = min_shard_size
        self.bucket_bytes, self.whole_tree_bucket_bytes = backend.bucket_bytes(bucket_mb, self.mesh)
        self.donate = backend.donate(donate, self.mesh, stage)
        self.dot_barrier = backend.dot_barrier(dot_barrier, self.mesh)
        self.compiler_options = backend.compiler_options(self.mesh, compiler_options)
        self.rng_seed = int(seed) if loss_lib.takes_rng(loss_fn) else None
        self.num_shards = num_shards(self.mesh)
        self.batch_devices = math.prod(self.mesh.shape[a] for a in batch_axes(self.mesh))
        self.batch_sharding = NamedSharding(self.mesh, P(batch_axes(self.mesh)))
        self.layouts: Any = None  # set by init
        self._state_shardings: Any = None
        self._step_fn: (
            Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]] | None
        ) = None
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
            bucket_bytes=self.bucket_bytes,
            whole_tree_bucket_bytes=self.whole_tree_bucket_bytes,
            dot_barrier=self.dot_barrier,
            rng_seed=self.rng_seed,
        )

    def _set_layouts(self, shapes: Any) -> None:
        converted = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise TypeError(
                    f"param {path_str(path)!r} has dtype {leaf.dtype}; jaxzero trains "
                    "floating-point params only (keep constants out of the params tree)"
                )
            if leaf.dtype not in (jnp.float32, self.compute_dtype):
                converted.append(f"{path_str(path)} ({jnp.dtype(leaf.dtype).name})")
        if converted:
            warnings.warn(
                f"{len(converted)} param(s) converted: {', '.join(converted[:4])}"
                f"{' ...' if len(converted) > 4 else ''}. The engine keeps fp32 master params "
                f"and computes in {jnp.dtype(self.compute_dtype).name} "
                f"(precision={self.precision!r}); pass float32 params to silence this.",
                stacklevel=3,
            )
        self.layouts = layouts_for(
            shapes,
            self.num_shards,
            rules=self.rules,
            stacked=self.stacked,
            min_shard_size=self.min_shard_size,
        )
        self.opt_layouts = opt_layouts(self.tx, self.layouts, self.min_shard_size)
        self.specs = state_specs(self.stage, self.layouts, self.opt_layouts, self.mixed)
        self._state_shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.specs, is_leaf=lambda x: isinstance(x, P)
        )
        self._build_jits()

    def _require_init(self) -> None:
        if self.layouts is None:
            raise RuntimeError("call engine.init(params) or engine.init_from(...) first")

    @property
    def state_shardings(self) -> TrainState:
        """The ``NamedSharding`` of every leaf of the train state (a ``TrainState`` of
        shardings): the state's ``in_shardings`` and ``out_shardings`` when you jit
        :attr:`step_fn` yourself. Known once the engine is initialised."""
        self._require_init()
        return self._state_shardings

    # --- state creation --------------------------------------------------------------

    def _state_from_padded(self, master32: Any, opt_state: Any = None, step: Any = 0) -> TrainState:
        """The state from fp32 master params in their stored layout (traced).

        ``opt_state`` (stored layout) defaults to a fresh ``tx.init``.
        """
        lays = self.layouts
        if master_sharded(self.stage) and not params_sharded(self.stage):
            params = jax.tree.map(lambda m, lay: unpad(m, lay), master32, lays)
        else:
            params = master32
        params = jax.tree.map(lambda x: x.astype(self.compute_dtype), params)
        if opt_state is None:
            logical = jax.tree.map(lambda m, lay: unpad(m, lay), master32, lays)
            opt_state = jax.tree.map(
                lambda lay, x: self._master_layout(x, lay),
                self.opt_layouts,
                self.tx.init(logical),
                is_leaf=is_layout,
            )
        return TrainState(
            step=jnp.asarray(step, jnp.int32),
            params=params,
            master=master32 if self.mixed else None,
            opt_state=opt_state,
        )

    def state_from(self, master32: Any, opt_state: Any, step: int) -> TrainState:
        """A state from restored parts: fp32 master params and optimizer state, each
        already in this engine's stored layout and sharding (``CheckpointManager``)."""
        self._require_init()
        build = jax.jit(self._state_from_padded, out_shardings=self.state_shardings)
        return build(master32, opt_state, step)

    def _master_layout(self, x: Any, lay) -> Any:
        return pad(x, lay) if master_sharded(self.stage) else x

    def init(self, params: Any) -> TrainState:
        """A sharded train state from an existing params pytree.

        Host (numpy) leaves are padded on the host and sent slice by slice, so a
        stage-3 model is never whole on one device.
        """
        dtype = lambda x: x.dtype if hasattr(x, "dtype") else np.result_type(x)  # float64 too
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype(x)), params)
        self._set_layouts(shapes)
        master_sh = self._master_shardings()

        def put(x, lay, sh):
            if isinstance(x, jax.Array):
                return jax.jit(
                    lambda a: self._master_layout(a.astype(jnp.float32), lay), out_shardings=sh
                )(x)
            return jax.device_put(self._master_layout(np.asarray(x, np.float32), lay), sh)

        return self._state_from_master(jax.tree.map(put, params, self.layouts, master_sh))

    def _master_shardings(self) -> Any:
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            master_specs(self.stage, self.layouts),
            is_leaf=lambda x: isinstance(x, P),
        )

    def _state_from_master(self, master32: Any) -> TrainState:
        """The state (fresh optimizer) from fp32 master params, stored and sharded."""
        # the fp32 copy becomes the master (or the stage-3 params) unless stages 1-2
        # keep none: then nothing in the state has its sharded shape to reuse it for
        temporary = not self.mixed and self.stage in (1, 2)
        build = jax.jit(
            self._state_from_padded,
            out_shardings=self.state_shardings,
            donate_argnums=() if temporary else 0,
        )
        return build(master32)

    def init_from_slices(
        self, shapes: Any, read: Callable[[LeafLayout, tuple[slice, ...]], np.ndarray]
    ) -> TrainState:
        """A state whose params are read slice by slice, straight into their shardings.

        ``shapes`` is the params' ``ShapeDtypeStruct`` tree; ``read(layout, index)``
        returns the region ``index`` (slices within ``layout.shape``) of one param, in
        any float dtype. It is called only for what this process's devices hold (each
        distinct slice once), never for the padding, so a loader holds about one
        slice at a time, not the model (:func:`jaxzero.hf.load`).
        """
        if self.layouts is None:
            self._set_layouts(shapes)
        elif jax.tree.map(lambda s: tuple(s.shape), shapes) != jax.tree.map(
            lambda lay: lay.shape, self.layouts, is_leaf=is_layout
        ):
            raise ValueError("the engine was initialised with params of other shapes")

        def leaf(lay: LeafLayout, sh: NamedSharding) -> jax.Array:
            stored = lay.padded_shape if master_sharded(self.stage) else lay.shape
            # replicas (stage 0, small leaves, hybrid meshes) ask for the same slices:
            # each distinct one is read once; together they are at most this one leaf
            cache: dict[tuple, np.ndarray] = {}

            def callback(index: tuple[slice, ...] | None) -> np.ndarray:
                assert index is not None  # JAX passes every shard's index (typed optional)
                span = tuple(s.indices(n)[:2] for s, n in zip(index, stored, strict=True))
                if span not in cache:
                    inside = tuple(
                        slice(min(a, n), min(b, n))
                        for (a, b), n in zip(span, lay.shape, strict=True)
                    )
                    out = np.zeros([b - a for a, b in span], np.float32)
                    out[tuple(slice(0, s.stop - s.start) for s in inside)] = read(lay, inside)
                    cache[span] = out
                return cache[span]

            return jax.make_array_from_callback(stored, sh, callback)

        return self._state_from_master(
            jax.tree.map(leaf, self.layouts, self._master_shardings(), is_leaf=is_layout)
        )

    def init_from(self, init_fn: Callable[..., Any], *args: Any) -> TrainState:
        """Create params with ``init_fn(*args)`` directly in their sharded layout.

        ``jax.eval_shape`` gives the shapes; the init runs under ``jit`` with the
        state's ``out_shardings``, so each device computes and keeps only its slice.
        """
        self._set_layouts(jax.eval_shape(init_fn, *args))

        def build(*a):
            p = init_fn(*a)
            p = jax.tree.map(
                lambda x, lay: self._master_layout(x.astype(jnp.float32), lay), p, self.layouts
            )
            return self._state_from_padded(p)

        return jax.jit(build, out_shardings=self.state_shardings)(*args)

    def abstract_state(self, params_shapes: Any) -> TrainState:
        """The state's shapes, dtypes and shardings, allocating nothing.

        ``params_shapes`` is a pytree of ``jax.ShapeDtypeStruct`` (e.g.
        ``jax.eval_shape(model.init, key)``); the result lowers and compiles the
        step (:meth:`compile`) for models too large to create here.
        """
        self._set_layouts(params_shapes)
        return self.state_shapes()

    def state_shapes(self) -> TrainState:
        """:meth:`abstract_state` of an initialised engine (its layouts and jits stay)."""
        self._require_init()
        master = stored_shapes(self.layouts, master_sharded(self.stage), jnp.float32)
        shapes = jax.eval_shape(self._state_from_padded, master)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self.state_shardings,
        )

    # --- the step ----------------------------------------------------------------------

    def _build_jits(self) -> None:
        cfg, lays, mesh = self._config(), self.layouts, self.mesh
        self._step_fn = step_lib.make_train_step(
            cfg, mesh, lays, self.opt_layouts, self.specs, self.loss_fn, self.tx
        )
        self._step = jax.jit(  # engine.step: the public step_fn, jitted
            self._step_fn,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, NamedSharding(mesh, P())),
            donate_argnums=0 if self.donate else (),
            compiler_options=self.compiler_options or None,
        )
        ev_sharded = step_lib.make_eval(cfg, mesh, lays, self.specs, self.loss_fn)
        self._eval = jax.jit(ev_sharded, compiler_options=self.compiler_options or None)

    @property
    def step_fn(self) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
        """The pure train step ``(state, batch) -> (new_state, metrics)``, not jitted.

        :meth:`step` is this function under ``jax.jit``; take it to build your own loop
        around it: jit it yourself, ``jax.lax.scan`` it over several batches in one
        program, or wrap it (an EMA of the params, extra metrics, a custom schedule of
        evaluations). The state and metrics are as :meth:`step`'s.

        Jit it with the engine's layouts, so each call's output is the next one's input
        without a copy: ``in_shardings=(engine.state_shardings, engine.batch_sharding)``,
        ``out_shardings=(engine.state_shardings, None)`` (the metrics are replicated
        scalars), ``donate_argnums=0`` to reuse the state's buffers as :meth:`step` does
        (:attr:`donate`), and ``compiler_options=engine.compiler_options or None`` for
        the backend's preset (:mod:`jaxzero.backend`). ``batch`` must be the *global*
        batch, laid out as :attr:`batch_sharding` (:meth:`shard_batch` places host
        arrays), its leading dim a multiple of the batch devices times
        ``micro_batches``: unlike :meth:`step`, the pure step checks nothing. Batches
        stacked for a scan lie along the same axes one dim further in:
        ``NamedSharding(engine.mesh, P(None, *engine.batch_sharding.spec))``.

        Example (four steps in one program, an EMA of the params carried beside them):
          >>> import jax, jax.numpy as jnp, optax, jaxzero
          >>> from jax.sharding import NamedSharding, PartitionSpec as P
          >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
          >>> engine = jaxzero.Engine(loss_fn, optax.sgd(0.1), mesh=jaxzero.make_mesh(1))
          >>> state = engine.init({"w": jnp.zeros((4, 2))})
          >>> def body(carry, batch):
          ...     state, ema = carry
          ...     state, metrics = engine.step_fn(state, batch)
          ...     ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, state.params)
          ...     return (state, ema), metrics
          >>> def four_steps(state, ema, batches):  # batches stacked on a leading axis
          ...     return jax.lax.scan(body, (state, ema), batches)
          >>> sh = engine.state_shardings
          >>> stacked = NamedSharding(engine.mesh, P(None, *engine.batch_sharding.spec))
          >>> run = jax.jit(four_steps, in_shardings=(sh, sh.params, stacked),
          ...               out_shardings=((sh, sh.params), None), donate_argnums=(0, 1))
          >>> x = jax.random.normal(jax.random.key(1), (4, 8, 4))
          >>> ema = jax.tree.map(jnp.copy, state.params)
          >>> (state, ema), metrics = run(state, ema, {"x": x, "y": x[..., :2]})
          >>> int(state.step), metrics["loss"].shape
          (4, (4,))
        """
        self._require_init()
        assert self._step_fn is not None  # built with the layouts (_build_jits)
        return self._step_fn

    def _check_batch(self, batch: Any) -> None:
        leaves, treedef = jax.tree.flatten(batch)
        if not leaves:
            raise ValueError("batch is empty: pass a pytree of arrays with a leading batch dim")
        if self._batch_treedef is not None and treedef != self._batch_treedef:
            raise ValueError(
                f"batch structure changed: expected {self._batch_treedef}, got {treedef}. "
                "Every step must receive the same pytree of arrays."
            )
        sizes = {
            path_str(p): (np.shape(x)[0] if np.ndim(x) else None)
            for p, x in jax.tree_util.tree_leaves_with_path(batch)
        }
        if len(set(sizes.values())) != 1 or None in sizes.values():
            raise ValueError(f"every batch leaf needs the same leading (batch) dim, got {sizes}")
        b = next(iter(sizes.values()))
        need = self.batch_devices * self.micro_batches
        if b % need:
            raise ValueError(
                f"global batch {b} is not divisible by {self.batch_devices} devices x "
                f"{self.micro_batches} micro-batches = {need}; use a multiple of {need}"
            )
        self._batch_treedef = treedef

    def shard_batch(self, batch: Any) -> Any:
        """Host arrays, or arrays on any device(s) → global arrays split over the batch axes.

        With several processes, each passes only the rows its devices hold (its
        contiguous share of the global batch, in process order).
        """
        sh = self.batch_sharding

        def one(x):
            if isinstance(x, jax.Array):
                if x.sharding.is_equivalent_to(sh, x.ndim):
                    return x
                if not x.is_fully_addressable:  # a global array laid out differently
                    return jax.jit(lambda a: a, out_shardings=sh)(x)
                if jax.process_count() == 1:  # e.g. committed to one device
                    return jax.device_put(x, sh)
            if jax.process_count() == 1:
                return jax.device_put(np.asarray(x), sh)
            return jax.make_array_from_process_local_data(sh, np.asarray(x))

        return jax.tree.map(one, batch)

    def _global_batch(self, batch: Any) -> Any:
        leaves = jax.tree.leaves(batch)
        if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            sh = self.batch_sharding
            batch = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), batch
            )
        elif jax.process_count() == 1:  # check the global batch before placing it
            self._check_batch(batch)
            return self.shard_batch(batch)
        else:  # each process holds only its rows: check the assembled global batch
            batch = self.shard_batch(batch)
        self._check_batch(batch)
        return batch

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on the global ``batch``; ``state`` is consumed (donated,
        :attr:`donate`): use only the state a step returns.

        Returns the new state and ``{"loss", "grad_norm"}`` (replicated scalars), with
        ``"tokens"`` (the global weight) for a weighted loss and ``"aux"`` when the
        loss returns aux metrics.
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
        return jax.tree.map(gather_leaf, src, self.layouts)

    def iter_params(self, state: TrainState) -> Iterator[tuple[LeafLayout, np.ndarray]]:
        """``(layout, full fp32 param)`` one leaf at a time, in tree order, so a writer
        holds one param on the host, not the model. Every process must iterate."""
        self._require_init()
        src = state.master if self.mixed else state.params
        for x, lay in zip(
            jax.tree.leaves(src), jax.tree.leaves(self.layouts, is_leaf=is_layout), strict=True
        ):
            yield lay, gather_leaf(x, lay)

    def report(self, state: TrainState, batch: Any):
        """Measured memory and communication beside the ZeRO formulas."""
        from jaxzero.accounting import measure as accounting  # 0.1 s that import jaxzero skips

        return accounting.report(self, state, batch)


def gather_leaf(x: jax.Array, lay: LeafLayout) -> np.ndarray:
    """One stored param, whole and unpadded, as fp32 on this host (all processes call)."""
    if jax.process_count() > 1 and not x.is_fully_replicated:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(unpad(np.asarray(jax.device_get(x)), lay), np.float32)


class EngineLike(Protocol):
    """What :mod:`jaxzero.checkpoint` and :mod:`jaxzero.accounting` use of an engine:
    its static decisions and the state builders a restore needs. :class:`Engine` (and so
    :class:`~jaxzero.NNXEngine`) satisfies it; nothing else of an engine is read there.

    Attributes:
      stage: the ZeRO stage, 0–3.
      precision: ``"fp32"`` or ``"bf16"``.
      mesh: the device mesh.
      num_shards: N, the devices a sharded leaf is split over.
      layouts: the params' :class:`~jaxzero.LeafLayout` tree (None before init).
      opt_layouts: the optimizer state's layout tree (set by init, as ``layouts``).
      compute_dtype: the params' and activations' dtype (bf16 runs: bfloat16).
      reduce_dtype: the dtype gradients are reduced in.
      micro_batches: gradient accumulation steps per optimizer step.
      per_layer: whether the model gathers (stage 3) and reduces per layer.
      bucket_bytes: the largest packed collective, in bytes.
      whole_tree_bucket_bytes: the same in a ``per_layer=False`` model's stage-3
        ``use_params`` call (the whole tree).
      donate: whether the step donates its input state.
    """

    stage: int
    precision: str
    mesh: Mesh
    num_shards: int
    layouts: Any
    opt_layouts: Any
    compute_dtype: Any
    reduce_dtype: Any
    micro_batches: int
    per_layer: bool
    bucket_bytes: int
    whole_tree_bucket_bytes: int
    donate: bool

    @property
    def num_params(self) -> int:
        """Ψ: logical parameter count, padding excluded."""
        ...

    def abstract_state(self, params_shapes: Any) -> TrainState:
        """Sets the layouts from the params' shapes; the state's shapes and shardings."""
        ...

    def state_shapes(self) -> TrainState:
        """The state's shapes and shardings of an initialised engine."""
        ...

    def state_from(self, master32: Any, opt_state: Any, step: int) -> TrainState:
        """A state from fp32 master params and optimizer state in the stored layout."""
        ...

    def compile(self, state: TrainState, batch: Any) -> jax.stages.Compiled:
        """The compiled step (nothing runs)."""
        ...
