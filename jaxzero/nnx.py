"""Flax NNX models in the engine: a module and a loss over it, no splitting by hand.

The engine trains a pytree of params with a pure ``loss_fn(params, batch)``. An NNX
model is a stateful object, so :class:`NNXEngine` does the split once (the graph
definition and the ``nnx.Param`` variables, as a plain nested dict) and, inside the
step, merges each traced params tree back into a module for the user's
``loss_fn(model, batch)``. Per-layer gathering works as for any model: the module
passes a layer through :func:`use` (the NNX spelling of :func:`jaxzero.use_params`)
right where it calls it.

The module's random streams (an ``nnx.Rngs`` it keeps, each ``nnx.Dropout``'s) are fed
from the engine's key each step (:func:`feed_streams`), so Flax's dropout works as
written, a mask per row, exactly as on one device; :meth:`Engine.eval_loss` runs the
module in ``eval()`` mode (no dropout). Batch statistics (``nnx.BatchStat``, an
``nnx.BatchNorm``'s running mean and variance) are the engine's model state
(:mod:`jaxzero.model_state`): kept in :attr:`TrainState.model_state`, bound into the
module for each forward pass and read back after it, and used as stored (``eval()``
mode) by :meth:`Engine.eval_loss`; a synchronised ``nnx.BatchNorm`` takes
``axis_name=jaxzero.batch_axes(mesh)``. Other variables are held constant: the step is
a pure function of the params, the batch and the model state, so a module that changes
one stops the step naming it.

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxzero
  >>> from flax import nnx
  >>> class MLP(nnx.Module):
  ...     def __init__(self, rngs):
  ...         self.l1, self.l2 = nnx.Linear(4, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)
  ...     def __call__(self, x):  # each layer through use: stage 3 gathers it there
  ...         return jaxzero.nnx.use(self.l2)(jaxzero.nnx.use(self.l1)(x))
  >>> def loss_fn(model, batch):
  ...     return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
  >>> engine = jaxzero.NNXEngine(MLP(nnx.Rngs(0)), loss_fn, optax.adam(1e-2),
  ...                            mesh=jaxzero.make_mesh(1), stage=3, per_layer=True)
  >>> state = engine.init()
  >>> x = jnp.ones((8, 4))
  >>> state, metrics = engine.step(state, {"x": x, "y": x[:, :1]})
  >>> trained = engine.module(state)  # an MLP again, with the trained params
  >>> trained(x).shape
  (8, 1)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import optax
from flax import nnx

from jaxzero import plan as plan_lib
from jaxzero.engine import Engine
from jaxzero.hooks import use_params
from jaxzero.loss import WithState, check_rng_contract
from jaxzero.partition import path_str
from jaxzero.state import TrainState
from jaxzero.types import Batch, Params

__all__ = ["NNXEngine", "use"]

M = TypeVar("M", bound=nnx.Module)


def split(module: M) -> tuple[nnx.GraphDef[M], Params, nnx.State]:
    """``(graphdef, params, rest)``: the module's ``nnx.Param`` values as a plain nested
    dict (what the engine shards) and every other variable as an ``nnx.State`` (batch
    statistics too: :func:`batch_stats` reads them as the engine's model state)."""
    # flax types split's result as variadic: two filters give exactly two states
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
    return graphdef, nnx.to_pure_dict(params), rest


def batch_stats(module: nnx.Module) -> dict[str, Any] | None:
    """The module's ``nnx.BatchStat`` values as a plain nested dict (the engine's model
    state, :mod:`jaxzero.model_state`); None when it keeps none."""
    stats = nnx.state(module, nnx.BatchStat)
    return nnx.to_pure_dict(stats) if nnx.to_flat_state(stats) else None


def _set_stats(module: nnx.Module, template: nnx.State, stats: dict[str, Any]) -> None:
    """Give ``module``'s ``nnx.BatchStat`` variables the values of ``stats`` (a nested
    dict like :func:`batch_stats`'); ``template``: a ``BatchStat`` state of its structure."""
    state = jax.tree.map(lambda v: v, template)  # a fresh copy to fill in
    nnx.replace_by_pure_dict(state, stats)
    nnx.update(module, state)


def feed_streams(rest: nnx.State, rng: jax.Array | None) -> nnx.State:
    """A fresh copy of ``rest`` whose random streams (``nnx.Rngs``, each ``nnx.Dropout``'s)
    draw from the step's key: stream ``i``'s key is ``fold_in(rng, i)``, its count 0.

    The key is the loss's (:func:`jaxzero.loss.batch_key`), so a dropout mask is drawn row
    by row over the global batch: the same at every stage and device count. Without
    ``rng`` (evaluation) the streams keep their values; the copy's variables belong to
    the trace that calls this, so a stream may advance its count there.
    """
    streams = itertools.count()

    def feed(v: nnx.Variable) -> nnx.Variable:
        if rng is not None and isinstance(v, nnx.RngKey):
            return v.replace(jax.random.fold_in(rng, next(streams)))
        if rng is not None and isinstance(v, nnx.RngCount):
            count = v.get_value()  # a ShapeDtypeStruct in an abstract module
            return v.replace(jax.numpy.zeros(count.shape, count.dtype))
        return v.replace(v.get_value())

    return jax.tree.map(feed, rest, is_leaf=lambda x: isinstance(x, nnx.Variable))


# the variables a step holds constant: neither params, random streams nor batch statistics
_HELD = nnx.Not(nnx.Any(nnx.Param, nnx.RngState, nnx.BatchStat))


def _held(state: nnx.State) -> dict[str, Any]:
    """Path -> value of ``state``'s held-constant variables."""
    return {
        path_str(k): v.get_value() for k, v in nnx.to_flat_state(nnx.filter_state(state, _HELD))
    }


def bind(graphdef: nnx.GraphDef[M], template: nnx.State, params: Params, rest: nnx.State) -> M:
    """A module from ``graphdef`` with ``params`` (a nested dict like :func:`split`'s)
    as its ``nnx.Param`` values; ``template`` is a ``Param`` state of the same structure."""
    state = jax.tree.map(lambda v: v, template)  # a fresh copy to fill in
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state, rest)


def use(module: M) -> M:
    """The module with its params ready to compute with: :func:`jaxzero.use_params` for NNX.

    Call it on each layer right where the layer runs (``use(self.block)(x)``), once per
    layer: stage 3 gathers the layer's params there and its backward pass reduce-scatters
    their gradient. Identity (a module with the same values) outside the engine.
    """
    # flax types split's result as variadic: two filters give exactly two states
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
    return nnx.merge(graphdef, use_params(params), rest)


class NNXEngine(Engine):
    """An :class:`jaxzero.Engine` for an ``nnx.Module`` and ``loss_fn(model, batch)``.

    Args:
      model: the module; only its structure and (for :meth:`init`) its params are
        used. An abstract one (``nnx.eval_shape(lambda: Model(...))``) with
        :meth:`init_from` never allocates the whole model.
      loss_fn: ``loss_fn(model, batch) -> scalar``, the mean loss of a batch (or any
        form of :mod:`jaxzero.loss`); ``loss_fn(model, batch, rng)`` with
        ``loss_takes_rng=True``. The module's own random streams are fed either way,
        and its batch statistics (``nnx.BatchStat``) kept as the engine's model state:
        the loss returns its form alone, the engine reads the new statistics from the
        module (no ``WithState``).
      optimizer: as for :class:`jaxzero.Engine` (required, e.g. ``optax.adamw(1e-3)``).
      **kwargs: as for :class:`jaxzero.Engine` (``stage``, ``per_layer``,
        ``stacked``, ...). Param paths (for ``rules`` and ``stacked``) are the
        module's attribute names joined by ``/``, e.g. ``blocks/0/linear/kernel``.
    """

    def __init__(
        self,
        model: nnx.Module,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        loss_takes_rng: bool = False,
        **kwargs: Any,
    ):
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if "model_state" in kwargs:
            raise TypeError(
                "NNXEngine takes the model state from the module's nnx.BatchStat variables; "
                "do not pass model_state="
            )
        self.graphdef, self._params, self.rest = split(model)
        self._template = nnx.state(model, nnx.Param)
        self._stats_template = nnx.state(model, nnx.BatchStat)
        self.model_loss_fn = loss_fn

        check_rng_contract(loss_fn, loss_takes_rng)
        with_rng = loss_takes_rng

        def params_loss(
            params: Params,
            batch: Batch,
            rng: jax.Array | None,
            state: dict[str, Any] | None = None,
            train: bool = True,
        ) -> Any:
            # always given rng (None in eval_loss): it feeds the module's streams
            rest = feed_streams(self.rest, rng)
            held = _held(rest)
            model = bind(self.graphdef, self._template, params, rest)
            if state is not None:
                _set_stats(model, self._stats_template, state)
            if rng is None or not train:
                model.eval()  # Dropout off, BatchNorm's stored statistics: as eval_loss promises
            out = loss_fn(model, batch, rng) if with_rng else loss_fn(model, batch)
            changed = [k for k, v in _held(nnx.state(model, _HELD)).items() if v is not held[k]]
            if changed:
                raise ValueError(
                    f"the module changed {', '.join(changed[:3])} in the step: only its "
                    "nnx.Param values train and its random streams are fed; other "
                    "variables are held constant, so the change would be lost"
                )
            if state is None:
                return out
            return WithState(out, batch_stats(model))

        # the step always passes the key (None in eval_loss): it feeds the module's streams
        super().__init__(
            params_loss,
            optimizer,
            loss_takes_rng=True,
            model_state=batch_stats(model),
            **kwargs,
        )

    def init(self, params: Params = None) -> TrainState:
        """The sharded state from the module's own params (or ``params``, a nested dict)."""
        params = self._params if params is None else params
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            raise ValueError(
                "the module is abstract (nnx.eval_shape): create the state with "
                "engine.init_from(lambda: Model(...)) instead"
            )
        return super().init(params)

    def init_from(self, create: Callable[..., nnx.Module], *args: Any) -> TrainState:
        """The state from ``create(*args) -> nnx.Module``, run sharded from birth: each
        device computes and keeps only its slice, so the model is never whole anywhere.
        Its batch statistics (replicated, a few floats a channel) come from the same call."""
        init_fn = lambda *a: split(create(*a))[1]
        if self.initial_model_state is None:
            return super().init_from(init_fn, *args)
        plan = self.plan_for(jax.eval_shape(init_fn, *args))
        stats = jax.jit(lambda *a: batch_stats(create(*a)))(*args)
        return plan_lib.state_from_init(plan, init_fn, *args, model_state=stats)

    def module(self, state: TrainState) -> nnx.Module:
        """The trained model: a module with the state's full fp32 params (on the host)
        and its batch statistics."""
        params = jax.tree.map(jax.numpy.asarray, self.gather_params(state))
        model = bind(self.graphdef, self._template, params, self.rest)
        if state.model_state is not None:
            stats = jax.tree.map(jax.numpy.asarray, jax.device_get(state.model_state))
            _set_stats(model, self._stats_template, stats)
        return model
