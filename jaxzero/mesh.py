"""The device mesh: one place that decides axis names and axis types.

jaxzero's mesh has a ``"data"`` axis that both splits the batch and shards the
ZeRO state. Hybrid sharding (shard within a node, replicate across nodes) adds a
leading ``"replica"`` axis: the batch is split over both axes, the state is
sharded over ``"data"`` only. Tensor parallelism adds a trailing ``"model"`` axis
(innermost: its devices talk every layer, so they are a node's neighbours): a layer's
weights are split over it, the batch is not (:mod:`jaxzero.tensor_parallel`). Code
that holds a mesh asks :func:`batch_axes`, :func:`num_shards` and :func:`model_shards`,
so adding an axis changes nothing for it. Code that
names the state's axis where no mesh is at hand (the layouts' ``PartitionSpec``,
the collectives and the step inside ``shard_map``) imports :data:`DATA` from here:
that name is the same on every mesh, only the batch axes vary.
"""

from __future__ import annotations

import importlib.metadata
import os
import re

import jax
from jax.sharding import AxisType, Mesh

DATA = "data"  # splits the batch and shards parameters, gradients and optimizer state
REPLICA = "replica"  # (hybrid) splits the batch, replicates the state
MODEL = "model"  # (tensor parallelism) splits each layer's weights; the batch is replicated


def accelerator_expected() -> bool:
    """Whether JAX will find a GPU/TPU, judged without starting its backend.

    Scripts use it to decide whether to simulate CPU devices, which must happen
    before the backend starts.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    pattern = re.compile(r"^(jax[-_](cuda|rocm)\d*[-_](plugin|pjrt)|libtpu.*)$", re.I)
    return any(pattern.match(d.metadata["Name"] or "") for d in importlib.metadata.distributions())


def backend_started() -> bool:
    """Whether JAX's backend exists, so that device settings (simulated CPU devices, the
    distributed runtime) would come too late. Starts nothing.

    JAX 0.10 and 0.12 have no public way to ask: ``jax.distributed.initialize`` and the
    ``jax_num_cpu_devices`` option check it inside, with a private function read here
    and nowhere else. Imported here, not at the top, so that if JAX renames it only this
    fails (tests/test_mesh.py says so first), not ``import jaxzero``.
    """
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def simulate_devices(n: int) -> None:
    """Make the CPU backend expose ``n`` devices. Call before any JAX computation.

    Scripts and the CLI use this to show real sharding on a laptop. It fails
    loudly when JAX's backend already exists, because the setting would be ignored.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate_devices needs a positive integer, got {n!r}")
    if backend_started():
        have = jax.local_device_count()  # per process: a multi-process job simulates per process
        if have == n and jax.default_backend() == "cpu":
            return
        raise RuntimeError(
            f"cannot simulate {n} devices: JAX's backend is already initialised with "
            f"{have} device(s). Call jaxzero.simulate_devices({n}) right after importing "
            "jax, before any computation, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} in the environment."
        )
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def make_mesh(num_devices: int | None = None, *, replicas: int = 1, model: int = 1) -> Mesh:
    """A mesh over the first ``num_devices`` devices (default: all).

    Args:
      num_devices: how many devices train.
      replicas: for hybrid sharding, how many groups replicate the state; the
        state is sharded over ``num_devices // (replicas * model)`` devices inside a group.
      model: tensor parallelism's degree: each layer's weights are split over groups of
        this many neighbouring devices, which see the same rows of the batch.

    Returns:
      A ``Mesh`` with axes ``("data",)``; ``("replica", "data")`` when ``replicas > 1``;
      ``"model"`` last when ``model > 1``. The batch is split over every axis but
      ``"model"``. Axis types are ``Auto``: jaxzero's step states every sharding
      explicitly through ``jit`` and ``shard_map`` specs.

    Example:
      >>> mesh = make_mesh(1)
      >>> mesh.shape["data"]
      1
    """
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    if n > len(devices):
        raise ValueError(
            f"num_devices={n} but only {len(devices)} {jax.default_backend()} device(s) are "
            "available. Use fewer devices, or on CPU simulate more with "
            f"jaxzero.simulate_devices({n}) (or XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n}) before JAX starts."
        )
    if not isinstance(model, int) or isinstance(model, bool) or model < 1 or n % model:
        raise ValueError(
            f"model={model!r} (tensor parallelism's degree) must be a positive divisor of "
            f"{n} devices"
        )
    if not isinstance(replicas, int) or replicas < 1 or (n // model) % replicas:
        raise ValueError(
            f"replicas={replicas!r} must be a positive divisor of {n // model} "
            f"(= {n} devices / model={model})"
            if model > 1
            else f"replicas={replicas!r} must be a positive divisor of {n} devices"
        )
    shape, names = [n // model // replicas], [DATA]
    if replicas > 1:
        shape, names = [replicas, *shape], [REPLICA, *names]
    if model > 1:
        shape, names = [*shape, model], [*names, MODEL]
    auto = (AxisType.Auto,) * len(names)
    return jax.make_mesh(tuple(shape), tuple(names), axis_types=auto, devices=devices[:n])


def replicas_for(group_size: int | str | None, num_devices: int, node_devices: int) -> int:
    """How many groups replicate the state when each shards it over ``group_size`` devices.

    ``None`` is one group of all devices (plain ZeRO); ``"node"`` is the devices
    of one node (``node_devices``), the usual hybrid choice across nodes.

    Example:
      >>> replicas_for("node", num_devices=16, node_devices=8)  # 2 nodes of 8 GPUs
      2
    """
    if group_size is None:
        return 1
    size = node_devices if group_size == "node" else group_size
    if not isinstance(size, int) or size < 1 or num_devices % size:
        what = f"node ({node_devices} devices per node)" if group_size == "node" else size
        raise ValueError(
            f"mesh.group_size={what} must divide the {num_devices} devices into equal groups"
        )
    return num_devices // size


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes the global batch is split over (all but ``"model"``): ``("data",)``, or
    on a hybrid mesh ``("replica", "data")``. Public as ``jaxzero.batch_axes``: the
    ``axis_name`` of a synchronised BatchNorm (:mod:`jaxzero.model_state`), bound inside
    the engine's step and evaluation, so a model takes it as an argument and never
    names the mesh's axes itself."""
    return tuple(a for a in mesh.axis_names if a != MODEL)


def model_shards(mesh: Mesh) -> int:
    """Tensor parallelism's degree: devices a layer's weights are split over (1: none)."""
    return int(mesh.shape.get(MODEL, 1))


def num_shards(mesh: Mesh) -> int:
    """N in the ZeRO formulas: devices that share one copy of the state."""
    return mesh.shape[DATA]
