"""``Engine``: a loss function and an optimizer, trained at a ZeRO stage on a mesh.

The engine validates its settings, builds its :class:`~jaxzero.plan.Plan` (layouts,
shardings, the pure step) once from the params' shapes at the first init, and holds
no arrays: state goes in and out of :meth:`Engine.step`, which donates it (on
accelerators by default, on CPUs at stage 3; ``donate=``, see :mod:`jaxzero.backend`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from jaxzero import batch as batch_lib
from jaxzero import frozen as frozen_lib
from jaxzero import model_state as model_state_lib
from jaxzero import plan as plan_lib
from jaxzero import readback
from jaxzero import settings as settings_lib
from jaxzero.mesh import batch_axes, make_mesh
from jaxzero.partition import Rule
from jaxzero.plan import Plan
from jaxzero.readback import gather_leaf
from jaxzero.settings import PRECISIONS  # noqa: F401 - the app reads it here
from jaxzero.state import TrainState
from jaxzero.types import Batch, Metrics, Params

__all__ = ["Engine", "gather_leaf"]

NOT_INITIALISED = "call engine.init(params) or engine.init_from(...) first"


def _setting(name: str, doc: str) -> Any:
    """A read-only attribute of the engine: its settings' step config field ``name``."""
    return property(lambda self: getattr(self.settings.step, name), doc=doc)


def _planned(name: str, doc: str) -> Any:
    """A read-only attribute of the engine: its plan's field ``name`` (after init)."""
    return property(lambda self: getattr(self.plan, name), doc=doc)


class Engine:
    """Trains ``loss_fn`` with ``optimizer`` at a ZeRO ``stage`` over ``mesh``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a batch; or any
        form of :mod:`jaxzero.loss`: ``Weighted(total, weight)`` for masked or uneven
        token counts (exact over devices and micro-batches), ``(loss, aux)`` for extra
        metrics. With ``loss_takes_rng=True`` it is ``loss_fn(params, batch, rng)``.
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
      loss_takes_rng: call ``loss_fn(params, batch, rng)`` with a PRNG key for its rows
        (dropout: a mask per row of the global batch, :mod:`jaxzero.loss`; Flax's
        ``rngs=`` takes it as it is), ``rng=None`` in :meth:`eval_loss`. Off (the
        default), the loss gets two arguments; a loss whose third positional parameter
        has no default is then refused in one line, so a key never arrives unasked
        (``def loss_fn(params, batch, deterministic=False)`` keeps its default).
      seed: the seed of the key a ``loss_fn(params, batch, rng)`` gets (dropout: a
        mask per row of the global batch, :mod:`jaxzero.loss`), and of an NNX module's
        random streams in the step (:class:`jaxzero.NNXEngine`).
      compiler_options: XLA options for the step, updating the backend's preset
        (on GPUs :data:`jaxzero.backend.GPU_OPTIONS`: the latency-hiding scheduler
        and pipelined collectives that overlap gathers with compute); a value of
        None removes that option.
      trainable: which params train: a predicate on a leaf's path
        (``lambda path: "lora_" in path``) or a tree of bools with the params'
        structure; None (the default) trains all. A frozen param gets no gradient (so no
        gradient collective), no fp32 master and no optimizer state: it is stored once
        in the dtype it is given, replicated at stages 0–2 and sharded (gathered per
        layer with the others) at stage 3, in :attr:`TrainState.frozen`
        (:mod:`jaxzero.frozen`). The optimizer sees the trainable params only.
      offload: ``"optimizer"`` keeps the fp32 master params and the optimizer state in
        host memory (``pinned_host``), moved to the device for the update only
        (ZeRO-Offload; stages 1-3; ``docs/offload.md``). None: all on the device.
      qwz: stage 3 gathers weights as int8 with a scale per ``quant_block`` elements
        (ZeRO++ qwZ); the fp32 master stays exact (``docs/zeropp.md``).
      qgz: ``"int8"`` or ``"int4"``: gradients are reduce-scattered in that format with
        a scale per block, through an all-to-all and an fp32 sum (ZeRO++ qgZ; stages 1-3).
      hpz: on a hybrid mesh (``make_mesh(n, replicas=R)``) at stage 3, the working
        params are sharded within each group only, while the master and optimizer
        state are sharded over every device (ZeRO++ hpZ).
      quant_block: elements that share one scale in qwZ and qgZ.
      ema: keep an exponential moving average of the weights in the state
        (:attr:`TrainState.ema`, :mod:`jaxzero.ema`): a decay in (0, 1) such as
        ``0.999``, or a function of the step, ``ema(step) -> decay``, evaluated inside the
        step on the traced step counter (a warmup:
        ``lambda step: jnp.minimum(0.999, (1 + step) / (10 + step))``). After each update
        ``ema = d * ema + (1 - d) * master`` on each device's shard: fp32, laid out as the
        master (4Ψ/N bytes a device from stage 1, in host memory with ``offload``), no
        communication. It starts at the initial params; frozen params have none.
        :meth:`eval_loss`, :meth:`gather_params`, :func:`jaxzero.hf.save` and checkpoints
        take it (``ema=True``). None: no EMA.
      model_state: the initial state the model changes without training it (a pytree
        of arrays: BatchNorm's running statistics, Flax Linen's ``{"batch_stats": ...}``,
        :func:`jaxzero.split_variables`). The loss is then called as
        ``loss_fn(params, batch[, rng], state=state, train=True)`` and returns
        ``jaxzero.WithState(loss, new_state)``; :meth:`eval_loss` passes the stored state
        and ``train=False``. Kept in :attr:`TrainState.model_state`, replicated, averaged
        over the batch axes after each step and threaded through the micro-batches
        (:mod:`jaxzero.model_state`); a synchronised BatchNorm takes
        ``axis_name=jaxzero.batch_axes(mesh)`` (:attr:`batch_axes`). None: no model state.
      ulysses: context parallelism (DeepSpeed-Ulysses): the ``data`` axis splits each
        sequence (a batch leaf's dim 1) instead of the rows, which only the ``replica``
        axis of a hybrid mesh splits; the loss is computed per device on its slice of the
        sequence and its attention all-to-alls over ``data`` (heads scattered, sequence
        gathered: :meth:`jaxzero.models.Llama.ulysses_loss`). ZeRO is unchanged, its
        reductions over ``data`` summing the slices' gradients; ``docs/tensor-parallel.md``.

    An engine is built for one set of param shapes: its first init (:meth:`init`,
    :meth:`init_from`, :meth:`abstract_state`, a restore) makes :attr:`plan`, every
    decision taken from those shapes; a later init with the same shapes reuses it (the
    step stays compiled), one with other shapes is refused: make a new engine.

    Attributes:
      plan: the :class:`~jaxzero.plan.Plan` (after the first init): layouts, specs,
        shardings, the pure step; ``print(engine.plan)`` shows every leaf's layout.
      mesh: the device mesh.
      batch_sharding: how a global batch lies on the mesh (its leading dim split over
        the batch axes); :meth:`shard_batch` puts a batch there.
      state_shardings: the train state's shardings (after init).
      step_fn: the pure, un-jitted step (after init), for a loop of your own:
        ``jax.jit`` it, ``lax.scan`` it, wrap it.
      donate: whether :meth:`step` donates its input state.
      compiler_options: the XLA options :meth:`step` is compiled with.
      batch_axes: the mesh axes the batch is split over: a synchronised BatchNorm's
        ``axis_name``.
      initial_model_state: the ``model_state`` given (None: none), where each init starts.

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
        loss_takes_rng: bool = False,
        seed: int = 0,
        compiler_options: dict[str, Any] | None = None,
        trainable: frozen_lib.Trainable = None,
        offload: str | None = None,
        qwz: bool = False,
        qgz: str | None = None,
        hpz: bool = False,
        quant_block: int = 2048,
        ema: Any = None,
        model_state: Any = None,
        ulysses: bool = False,
    ):
        self.loss_fn = loss_fn
        self.trainable = trainable
        self.initial_model_state = model_state
        self._model_state_shapes = (
            None if model_state is None else model_state_lib.shapes_of(model_state)
        )
        self.tx, self.settings = settings_lib.make_settings(
            loss_fn,
            optimizer,
            mesh=make_mesh() if mesh is None else mesh,
            stage=stage,
            precision=precision,
            reduce_dtype=reduce_dtype,
            micro_batches=micro_batches,
            max_grad_norm=max_grad_norm,
            per_layer=per_layer,
            rules=rules,
            stacked=stacked,
            min_shard_size=min_shard_size,
            bucket_mb=bucket_mb,
            donate=donate,
            dot_barrier=dot_barrier,
            loss_takes_rng=loss_takes_rng,
            seed=seed,
            compiler_options=compiler_options,
            offload=offload,
            qwz=qwz,
            qgz=qgz,
            hpz=hpz,
            quant_block=quant_block,
            ema=ema,
            model_state=model_state is not None,
            ulysses=ulysses,
        )
        self._plan: Plan | None = None
        s = self.settings
        rows = self.batch_devices // (s.num_shards if ulysses else 1)  # Ulysses: over replicas
        seq = s.num_shards if ulysses else 1
        self._batches = batch_lib.Intake(s.batch_sharding, rows, self.micro_batches, seq)

    # --- settings (known from the start) -----------------------------------------------

    stage = _setting("stage", "The ZeRO stage, 0-3.")
    compute_dtype = _setting("compute_dtype", "The params' and activations' dtype.")
    reduce_dtype = _setting("reduce_dtype", "The dtype gradients are reduced in.")
    mixed = _setting("mixed", "Whether the state keeps fp32 master params (bf16 training).")
    micro_batches = _setting("micro_batches", "Gradient accumulation steps per step.")
    max_grad_norm = _setting("max_grad_norm", "The clipping norm (None: no clipping).")
    per_layer = _setting("per_layer", "Whether the model calls use_params per layer.")
    batch_devices = _setting("batch_devices", "The devices the global batch is split over.")
    bucket_bytes = _setting("bucket_bytes", "The largest packed collective, in bytes.")
    whole_tree_bucket_bytes = _setting(
        "whole_tree_bucket_bytes", "The same in a per_layer=False stage-3 use_params call."
    )
    dot_barrier = _setting("dot_barrier", "Whether gradients pass collectives.dot_barrier.")
    rng_seed = _setting("rng_seed", "The loss's key seed (None: the loss takes no rng).")

    @property
    def ema(self) -> Any:
        """The EMA's decay: a float, a function of the step, or None (no EMA)."""
        return self.settings.ema

    @property
    def mesh(self) -> Mesh:
        """The device mesh."""
        return self.settings.mesh

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the global batch is split over (``jaxzero.batch_axes(mesh)``):
        a synchronised BatchNorm's ``axis_name``, bound inside the step."""
        return batch_axes(self.mesh)

    @property
    def precision(self) -> str:
        return self.settings.precision

    @property
    def donate(self) -> bool:
        """Whether :meth:`step` donates its input state."""
        return self.settings.donate

    @property
    def compiler_options(self) -> dict[str, Any]:
        """The XLA options :meth:`step` is compiled with."""
        return dict(self.settings.compiler_options)

    @property
    def num_shards(self) -> int:
        """N: the devices a sharded leaf is split over."""
        return self.settings.num_shards

    @property
    def batch_sharding(self) -> NamedSharding:
        """How a global batch lies on the mesh: its leading dim over the batch axes."""
        return self.settings.batch_sharding

    # --- the plan (after the first init) -------------------------------------------------

    @property
    def plan(self) -> Plan:
        """Every decision taken from the params' shapes (:class:`~jaxzero.plan.Plan`)."""
        if self._plan is None:
            raise RuntimeError(NOT_INITIALISED)
        return self._plan

    @property
    def has_plan(self) -> bool:
        """Whether an init has built :attr:`plan` yet."""
        return self._plan is not None

    def plan_for(self, shapes: Params) -> Plan:
        """The plan for params of ``shapes`` (``jax.ShapeDtypeStruct`` leaves): built at
        the first call, the same one after; other shapes are refused in one line."""
        mask = frozen_lib.mask_of(self.trainable, shapes)
        plan_lib.check_dtypes(shapes, self.compute_dtype, self.precision, mask)  # each init's
        if self._plan is None:
            self._plan = plan_lib.make_plan(
                shapes, self.settings, self.loss_fn, self.tx, mask, self._model_state_shapes
            )
        else:
            wrong = plan_lib.shape_mismatch(self._plan, shapes)
            if wrong:
                raise ValueError(wrong)
        return self._plan

    layouts = _planned("layouts", "The params' LeafLayout tree.")
    opt_layouts = _planned("opt_layouts", "The optimizer state's layout tree.")
    specs = _planned("specs", "The train state's PartitionSpec tree.")
    state_shardings = _planned(
        "state_shardings",
        "The ``NamedSharding`` of every leaf of the train state (a ``TrainState`` of "
        "shardings): the state's ``in_shardings`` and ``out_shardings`` when you jit "
        ":attr:`step_fn` yourself.",
    )
    num_params = _planned("num_params", "Ψ: the trainable params' logical count, padding excluded.")
    num_frozen = _planned("num_frozen", "The frozen params' logical count (0: all train).")

    # --- state creation --------------------------------------------------------------

    def init(self, params: Params) -> TrainState:
        """A sharded train state from an existing params pytree.

        Host (numpy) leaves are padded on the host and sent slice by slice, so a
        stage-3 model is never whole on one device.
        """
        plan = self.plan_for(plan_lib.shapes_of(params))
        return plan_lib.state_from_params(plan, params, self.initial_model_state)

    def _init_from_slices(self, shapes: Params, read: plan_lib.Read) -> TrainState:
        """A state whose params are read slice by slice, straight into their shardings
        (:func:`jaxzero.plan.read_state`; :func:`jaxzero.hf.load`'s loader)."""
        return plan_lib.read_state(self.plan_for(shapes), read, self.initial_model_state)

    def init_from(self, init_fn: Callable[..., Params], *args: Any) -> TrainState:
        """Create params with ``init_fn(*args)`` directly in their sharded layout.

        ``jax.eval_shape`` gives the shapes; the init runs under ``jit`` with the
        state's ``out_shardings``, so each device computes and keeps only its slice.
        """
        plan = self.plan_for(jax.eval_shape(init_fn, *args))
        return plan_lib.state_from_init(plan, init_fn, *args, model_state=self.initial_model_state)

    def abstract_state(self, params_shapes: Params) -> TrainState:
        """The state's shapes, dtypes and shardings, allocating nothing.

        ``params_shapes`` is a pytree of ``jax.ShapeDtypeStruct`` (e.g.
        ``jax.eval_shape(model.init, key)``); the result lowers and compiles the
        step (:meth:`compile`) for models too large to create here.
        """
        return plan_lib.state_shapes(self.plan_for(params_shapes))

    def state_shapes(self) -> TrainState:
        """:meth:`abstract_state` of an initialised engine (its plan and jits stay)."""
        return plan_lib.state_shapes(self.plan)

    # --- the step ----------------------------------------------------------------------

    @property
    def step_fn(self) -> plan_lib.StepFn:
        """The pure train step ``(state, batch) -> (new_state, metrics)``, not jitted.

        :meth:`step` is this function under ``jax.jit``; take it to build your own loop
        around it: jit it yourself, ``jax.lax.scan`` it over several batches in one
        program, or wrap it (extra metrics, a custom schedule of evaluations; an EMA of
        the params is the engine's own, ``Engine(ema=...)``). The state and metrics are
        as :meth:`step`'s.

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

        ``docs/stages.md`` ("Your own loop: the pure step") scans ten steps in one
        program with an EMA of the params carried beside them; ``tests/test_engine.py``
        checks that it trains as the same calls of :meth:`step`.
        """
        return self.plan.step_fn

    def process_rows(self, global_batch_size: int) -> slice:
        """The rows of a global batch of ``global_batch_size`` that this process feeds.

        In the spirit of ``jax.make_array_from_process_local_data``: with several
        processes, each passes :meth:`shard_batch` (or :meth:`step`) only these rows of
        the global batch, and the engine assembles the global array. One process: all
        rows. The rows are contiguous and in process order; the size must be a multiple
        of the batch devices times ``micro_batches``.

        Example:
          >>> import jax.numpy as jnp, optax, jaxzero
          >>> engine = jaxzero.Engine(lambda p, b: jnp.mean(b["x"] @ p["w"]),
          ...                         optax.sgd(0.1), mesh=jaxzero.make_mesh(1))
          >>> engine.process_rows(8)
          slice(0, 8, None)
        """
        return self._batches.rows(global_batch_size)

    def shard_batch(self, batch: Batch) -> Batch:
        """Host arrays, or arrays on any device(s) → global arrays split over the batch axes.

        With several processes, each passes only its rows of the global batch
        (:meth:`process_rows`); the result is the global batch.
        """
        return batch_lib.place(batch, self.batch_sharding)

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        """One optimizer step on the global ``batch``; ``state`` is consumed (donated,
        :attr:`donate`): use only the state a step returns.

        Returns the new state and ``{"loss", "grad_norm"}`` (replicated scalars), with
        ``"tokens"`` (the global weight) for a weighted loss and ``"aux"`` when the
        loss returns aux metrics.
        """
        step = plan_lib.jitted_step(self.plan)
        result: tuple[TrainState, Metrics] = step(state, self._batches.to_global(batch))
        return result

    def eval_loss(self, state: TrainState, batch: Batch, ema: bool = False) -> jax.Array:
        """Mean loss of ``batch`` at the current params, without a gradient; ``ema=True``:
        at the EMA's weights (``Engine(ema=...)``; cast to the compute dtype and, at
        stages 1-2, gathered for the evaluation, as the step does the new master). With
        model state, the loss gets the stored state and ``train=False`` (BatchNorm uses its
        running statistics); the state is not changed."""
        evaluate = plan_lib.jitted_eval(self.plan, ema)
        if ema:
            readback.check_ema(state)
        params = state.ema if ema else state.params
        loss: jax.Array = evaluate(
            params, self._batches.to_global(batch), state.frozen, state.model_state
        )
        return loss

    def compile(self, state: TrainState, batch: Batch) -> jax.stages.Compiled:
        """The compiled step, for its HLO and ``memory_analysis()`` (nothing runs).

        ``state`` and ``batch`` may be arrays or ``jax.ShapeDtypeStruct`` trees
        (:meth:`abstract_state`).
        """
        step = plan_lib.jitted_step(self.plan)
        compiled: jax.stages.Compiled = step.lower(state, self._batches.to_global(batch)).compile()
        return compiled

    def compile_eval(self, state: TrainState, batch: Batch) -> jax.stages.Compiled:
        """The compiled evaluation (:meth:`eval_loss`), as :meth:`compile` the step: what
        a pre-flight adds to the state that stays while it runs."""
        evaluate = plan_lib.jitted_eval(self.plan)
        compiled: jax.stages.Compiled = evaluate.lower(
            state.params, self._batches.to_global(batch), state.frozen, state.model_state
        ).compile()
        return compiled

    # --- reading back ------------------------------------------------------------------

    def gather_params(self, state: TrainState, ema: bool = False) -> Params:
        """Full fp32 params on the host, with the structure ``init`` was given;
        ``ema=True``: the EMA of the weights (``Engine(ema=...)``; frozen params as they are)."""
        return readback.gather_params(self.plan, state, ema)
