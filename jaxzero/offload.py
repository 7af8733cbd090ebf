"""ZeRO-Offload: the fp32 master params and the optimizer state in host memory.

``Engine(offload="optimizer")`` stores the state's ``master`` and ``opt_state`` in the
``pinned_host`` memory of each device (JAX memory kinds), sharded exactly as without
offload; the working params stay on the device. The schedule is MaxText's
(``optimizer_memory_host_offload``), not DeepSpeed's host Adam: the step moves each
leaf of the master and the state to the device for the update and each new leaf back
(:func:`to_device`, :func:`to_host`, one transfer a leaf each way), so the arithmetic
is the device's own and a step with offload computes the same numbers as one without.
Each leaf's transfers and its update depend on that leaf alone, so XLA's scheduler
may overlap one leaf's copies with another's update and keep only a few leaves
resident at once; the forward and backward passes run with none of it on the device.
``docs/offload.md`` says what this saves and costs, and where it cannot help.

In fp32 training the working params are the master, so only the optimizer state moves
(and the EMA of the weights, ``Engine(ema=...)``, which lives in host memory either way
and comes to the device for its update as the master does).

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxzero
  >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  >>> engine = jaxzero.Engine(loss_fn, optax.adam(1e-2), mesh=jaxzero.make_mesh(1),
  ...                         stage=1, offload="optimizer")
  >>> state = engine.init({"w": jnp.ones((4, 2))})
  >>> jax.tree.leaves(state.opt_state)[1].sharding.memory_kind
  'pinned_host'
  >>> state, _ = engine.step(state, {"x": jnp.ones((8, 4))})
  >>> state.params["w"].sharding.memory_kind
  'device'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jaxzero.state import TrainState

HOST = "pinned_host"  # where offloaded leaves live: page-locked, so copies are DMA
DEVICE = "device"


def check_available(mesh: Mesh) -> None:
    """Refuse in one line a backend whose devices have no pinned host memory."""
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST not in kinds:
        raise ValueError(
            f"offload='optimizer' needs {HOST!r} memory; {device.platform} devices here have "
            f"{sorted(kinds)} (drop offload, or use a GPU/TPU/CPU backend that has it)"
        )


def _kind(tree: Any, kind: str) -> Any:
    return jax.tree.map(lambda sh: sh.with_memory_kind(kind), tree)


def host_shardings(shardings: TrainState, mixed: bool) -> TrainState:
    """The state's shardings with the master (bf16 training), the optimizer state and the
    EMA (:mod:`jaxzero.ema`, in fp32 training too) in host memory; the step, params and
    frozen params stay on the device."""
    return dataclasses.replace(
        shardings,
        master=_kind(shardings.master, HOST) if mixed else shardings.master,
        opt_state=_kind(shardings.opt_state, HOST),
        ema=_kind(shardings.ema, HOST),
    )


def device_shardings(shardings: Any) -> Any:
    """A tree of shardings, each on the device's own memory."""
    return _kind(shardings, DEVICE)


def _put(tree: Any, shardings: Any, kind: str) -> Any:
    return jax.tree.map(
        lambda x, sh: jax.device_put(x, sh.with_memory_kind(kind)),
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )


def to_device(tree: Any, shardings: Any) -> Any:
    """Inside ``jit``: each leaf of ``tree`` (laid out as ``shardings``) copied to the
    device's memory, one transfer a leaf."""
    return _put(tree, shardings, DEVICE)


def to_host(tree: Any, shardings: Any) -> Any:
    """Inside ``jit``: each leaf copied back to pinned host memory, one transfer a leaf."""
    return _put(tree, shardings, HOST)


def offloaded(state: TrainState, mixed: bool) -> list[jax.Array]:
    """The state's arrays that offload keeps on the host (for the accounting)."""
    master = jax.tree.leaves(state.master) if mixed else []
    return [*master, *jax.tree.leaves(state.opt_state), *jax.tree.leaves(state.ema)]


def is_host(sharding: Any) -> bool:
    """Whether an array with this sharding lives in host memory."""
    return isinstance(sharding, NamedSharding) and sharding.memory_kind in (HOST, "unpinned_host")
