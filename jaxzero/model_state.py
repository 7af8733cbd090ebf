"""Model state that changes without being trained: BatchNorm's running statistics.

``Engine(loss_fn, optimizer, model_state=state)`` keeps ``state`` (any pytree of arrays:
Flax Linen's ``{"batch_stats": ...}``, :func:`split_variables`; an
:class:`~jaxzero.NNXEngine` finds its module's ``nnx.BatchStat`` itself) in
:attr:`TrainState.model_state`. The step calls ``loss_fn(params, batch[, rng],
state=state, train=True)``, which returns ``jaxzero.WithState(loss, new_state)``
(:mod:`jaxzero.loss`); :meth:`~jaxzero.Engine.eval_loss` calls it with ``train=False``
and drops the state it returns, so evaluation uses the stored statistics and changes
nothing.

How the new state is combined (:func:`average`):

* **Over devices.** The stored state is one replicated value (statistics are tiny: a
  few floats per channel, so every device keeps all of them). A synchronised BatchNorm
  (``nn.BatchNorm(axis_name=jaxzero.batch_axes(mesh))``, ``nnx.BatchNorm(...,
  axis_name=...)``) averages its batch mean and variance over the engine's batch axes
  inside the forward pass, so every device computes the same new state and stages
  0-3 on N devices equal one device on the global batch. A model that does not
  synchronise normalises by each device's own rows; the step then averages the float
  leaves of the new state over the batch axes (a mean of per-device running averages,
  which is not the running average of the global batch's statistics). Other leaves (an
  int counter) are taken as each device has them: they must agree.
* **Over micro-batches.** The state is threaded through the micro-batch loop: micro-batch
  ``j + 1`` sees the state micro-batch ``j`` returned, as ``k`` forward passes under
  gradient accumulation in PyTorch do, so ``k`` micro-batches update a running average
  ``k`` times a step. Global micro-batch ``j`` is every device's ``j``-th slice of its
  rows (rows ``d * B/N + j * B/(N k)`` onwards on device ``d``).

The state takes no gradient, no optimizer and no EMA (:mod:`jaxzero.ema` averages the
params only); it is stored in the dtype it was given, checkpointed and restored exactly
with the rest of the state (into any stage or device count), and stays on the device
with ``offload``.

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxzero
  >>> from flax import linen as nn
  >>> class Net(nn.Module):
  ...     axis_name: tuple[str, ...] | None = None
  ...     @nn.compact
  ...     def __call__(self, x, train):
  ...         x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
  ...         return nn.Dense(1)(x)
  >>> mesh = jaxzero.make_mesh(1)
  >>> net = Net(axis_name=jaxzero.batch_axes(mesh))  # synchronised over the batch axes
  >>> x = jax.random.normal(jax.random.key(0), (8, 3))
  >>> params, stats = jaxzero.split_variables(Net().init(jax.random.key(1), x, False))
  >>> def loss_fn(params, batch, state, train):
  ...     pred, new = net.apply({"params": params, **state}, batch["x"], train,
  ...                           mutable=["batch_stats"])
  ...     return jaxzero.WithState(jnp.mean((pred - batch["y"]) ** 2), new)
  >>> engine = jaxzero.Engine(loss_fn, optax.sgd(0.1), mesh=mesh, model_state=stats)
  >>> state = engine.init(params)
  >>> state, metrics = engine.step(state, {"x": x, "y": x[:, :1]})
  >>> bn = state.model_state["batch_stats"]
  >>> moved = bn["BatchNorm_0"]  # the running mean moved 1% of the way: momentum 0.99
  >>> bool(jnp.allclose(moved["mean"], 0.01 * jnp.mean(x, axis=0), atol=1e-6))
  True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.partition import path_str
from jaxzero.types import Params

__all__ = ["split_variables"]

ModelState = Any  # a pytree of arrays (None: the engine keeps no model state)


def split_variables(variables: dict[str, Any]) -> tuple[Params, ModelState]:
    """``(params, state)`` of a Flax Linen ``variables`` dict: ``variables["params"]`` and
    every other collection (``{"batch_stats": ...}``), the engine's ``model_state``; the
    loss merges them back as ``model.apply({"params": params, **state}, ...)``."""
    if "params" not in variables:
        raise ValueError(
            f"variables holds no 'params' collection (it has {sorted(variables)}): pass "
            "what model.init returns"
        )
    state = {k: v for k, v in variables.items() if k != "params"}
    return variables["params"], state


def shapes_of(state: ModelState) -> ModelState:
    """``ShapeDtypeStruct`` of each leaf of a model state (host, device or abstract)."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
        return jax.ShapeDtypeStruct(np.shape(x), dtype)

    return jax.tree.map(one, state)


def check_like(new: ModelState, shapes: ModelState) -> ModelState:
    """``new`` (what the loss returned) in the stored dtypes, refused in one line when its
    structure or a leaf's shape is not the stored state's (``shapes``)."""
    want: Any = jax.tree.structure(shapes)
    got: Any = jax.tree.structure(new)
    if want != got:
        raise ValueError(
            f"loss_fn returned a model state of structure {got}; the engine keeps {want}: "
            "return the whole state (model.apply's mutable collections) as it was given"
        )
    for path, x, s in zip(
        (path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)),
        jax.tree.leaves(new),
        jax.tree.leaves(shapes),
        strict=True,
    ):
        if tuple(jnp.shape(x)) != tuple(s.shape):
            raise ValueError(
                f"loss_fn returned model state {path!r} of shape {tuple(jnp.shape(x))}; it "
                f"is stored as {tuple(s.shape)}"
            )
    return jax.tree.map(lambda x, s: jnp.asarray(x).astype(s.dtype), new, shapes)


def average(state: ModelState, axes: tuple[str, ...]) -> ModelState:
    """Per device: the new state as the one replicated value the train state stores, its
    float leaves averaged over the batch ``axes`` (a synchronised BatchNorm's are equal
    already), other leaves as this device has them."""
    return jax.tree.map(
        lambda x: jax.lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        state,
    )
