"""A checkpoint's on-disk format: leaf names, fingerprints, and the metadata it keeps.

A checkpoint is one orbax step directory with three items (:data:`ITEMS`): ``state``
(every leaf of the :class:`~jaxzero.state.TrainState` under a readable name,
:func:`leaf_names`), ``meta`` (:func:`metadata`: stage, N, precision, every leaf's
logical shape, stored shape, dtype and fingerprint) and ``extra`` (the caller's JSON).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.errors import Error
from jaxzero.frozen import merge
from jaxzero.partition import LeafLayout, is_layout, path_str
from jaxzero.plan import Plan
from jaxzero.state import TrainState
from jaxzero.version import __version__

FORMAT = 1
FIELDS = ("step", "params", "master", "opt_state", "frozen", "ema", "model_state")
PARAM_COPIES = ("master", "ema")  # fields laid out and named as the (trainable) params
ITEMS = ("state", "meta", "extra")  # the orbax items of every step, as CheckpointManager saves


class CheckpointError(Error, ValueError):
    """A checkpoint is missing, incomplete, corrupt, or of another model."""


class CheckpointWriteError(CheckpointError):
    """A save failed (disk full, permission lost); ``latest`` is the
    newest complete checkpoint, untouched by the failure (None if there is none)."""

    def __init__(self, step: int, path: Path, cause: str, latest: int | None):
        self.step, self.path, self.cause, self.latest = step, path, cause, latest
        where = (
            f"the latest complete checkpoint is step {latest} ({path.parent / str(latest)})"
            if latest is not None
            else "no earlier checkpoint is complete"
        )
        super().__init__(f"checkpoint step {step} could not be written to {path}: {cause}; {where}")


def leaf_names(state: TrainState) -> dict[str, Any]:
    """``{"params/a/b": leaf, ...}`` for every leaf of a train state (any leaf type)."""
    out = {}
    for field in FIELDS:
        for path, x in jax.tree_util.tree_leaves_with_path(getattr(state, field)):
            out["/".join(p for p in (field, path_str(path)) if p)] = x
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` → ``{"a": {"b": x}}`` (orbax names files by the nesting)."""
    out: dict[str, Any] = {}
    for name, x in flat.items():
        *parents, last = name.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = x
    return out


def flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in nested.items():
        name = f"{prefix}/{k}" if prefix else k
        out.update(flatten(v, name) if isinstance(v, dict) else {name: v})
    return out


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _fingerprint(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """An order-sensitive 32-bit hash of a leaf's logical elements, whatever its layout.

    orbax's files carry no checksum, so a flipped byte would restore silently; this
    hash is written into ``meta`` at save time and checked on restore.
    """
    # an offloaded leaf (jaxzero.offload) is hashed on the device, one leaf's copy at a time
    x = jax.device_put(x, jax.memory.Space.Device)[tuple(slice(0, n) for n in shape)]
    bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):  # the flat logical index of every element
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride)
        stride = stride * shape[d] % 2**32
    h = (bits + idx * jnp.uint32(0x9E3779B9)) * jnp.uint32(0x85EBCA6B)
    return jnp.sum(h ^ (h >> 15), dtype=jnp.uint32)


def host_fingerprint(x: np.ndarray, chunk: int = 1 << 18) -> int:
    """:func:`_fingerprint` of a host array holding exactly the logical region, in numpy
    and in chunks (a reader that streams leaves checks them without JAX or a copy)."""
    flat = np.ascontiguousarray(x).reshape(-1).view(np.dtype(f"u{x.dtype.itemsize}"))
    total = np.uint32(0)
    with np.errstate(over="ignore"):
        for start in range(0, flat.size, chunk):
            bits = flat[start : start + chunk].astype(np.uint32)
            idx = (np.arange(start, start + len(bits), dtype=np.uint64) % 2**32).astype(np.uint32)
            h = (bits + idx * np.uint32(0x9E3779B9)) * np.uint32(0x85EBCA6B)
            total = total + np.sum(h ^ (h >> np.uint32(15)), dtype=np.uint32)
    return int(total)


@functools.partial(jax.jit, static_argnums=1)
def _fingerprints(arrays: tuple, shapes: tuple) -> tuple:
    return tuple(_fingerprint(x, s) for x, s in zip(arrays, shapes, strict=True))


def fingerprints(leaves: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, int]:
    """:func:`_fingerprint` of every numeric leaf, by name (one compiled program)."""
    names = [
        n
        for n, x in leaves.items()
        if x.dtype.itemsize in _UINT and jnp.issubdtype(x.dtype, jnp.number)
    ]
    out = _fingerprints(tuple(leaves[n] for n in names), tuple(tuple(shapes[n]) for n in names))
    return {n: int(v) for n, v in zip(names, jax.device_get(out), strict=True)}


def _param_paths(tree: Any) -> list[list[Any]]:
    """Each param's key path as JSON: ``[["k", "blocks"], ["i", 0], ...]``."""

    def key(k: Any) -> list[Any]:
        if hasattr(k, "idx"):
            return ["i", int(k.idx)]
        return ["k", str(getattr(k, "key", getattr(k, "name", k)))]

    return [[key(k) for k in path] for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def params_from_meta(meta: dict[str, Any]) -> Any:
    """The params tree (dicts and lists) of ``ShapeDtypeStruct`` recorded in ``meta``."""
    root: dict[str, Any] = {}
    for entry in meta["param_tree"]:
        node, path = root, entry["path"]
        for i, (_, k) in enumerate(path):
            last = i == len(path) - 1
            leaf = jax.ShapeDtypeStruct(tuple(entry["shape"]), jnp.dtype(entry["dtype"]))
            node = node.setdefault(k, leaf if last else {})

    def listify(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        kids = {k: listify(v) for k, v in node.items()}
        if kids and all(isinstance(k, int) for k in kids):
            return [kids[i] for i in sorted(kids)]
        return kids

    return listify(root)


def metadata(plan: Plan, state: TrainState) -> dict[str, Any]:
    """What a checkpoint says about itself: enough to rebuild shapes and check a target."""

    lays = leaf_names(TrainState(None, plan.layouts, None, plan.opt_layouts, plan.frozen_layouts))
    leaves: dict[str, dict[str, Any]] = {}
    for name, x in leaf_names(state).items():
        field, _, rest = name.partition("/")
        lay = lays.get(f"params/{rest}" if field in PARAM_COPIES else name)
        leaves[name] = {
            "stored_shape": list(x.shape),
            "dtype": str(x.dtype),
            "shape": list(lay.shape) if lay is not None else list(x.shape),
        }
    param_tree = [
        {"path": p, "shape": list(lay.shape), "dtype": dtype, "trainable": on}
        for p, lay, dtype, on in zip(
            _param_paths(plan.all_layouts()), *_all_params(plan), strict=True
        )
    ]
    sums = fingerprints(leaf_names(state), {n: v["shape"] for n, v in leaves.items()})
    for name, value in sums.items():
        leaves[name]["fingerprint"] = value
    return {
        "format": FORMAT,
        "jaxzero_version": __version__,
        "step": int(jax.device_get(state.step)),
        "stage": plan.stage,
        "num_shards": plan.num_shards,
        "devices": int(plan.mesh.devices.size),
        "processes": jax.process_count(),
        "precision": plan.settings.precision,
        "num_params": int(plan.num_params),
        "num_frozen": int(plan.num_frozen),
        "frozen_saved": state.frozen is not None,
        "param_tree": param_tree,
        "leaves": leaves,
    }


def step_of(step_dir: Path) -> int:
    return int(step_dir.name) if step_dir.name.isdigit() else -1


def _all_params(plan: Plan) -> tuple[list[LeafLayout], list[str], list[bool]]:
    """Every param's layout, stored dtype name and whether it trains, in tree order."""
    lays = jax.tree.leaves(plan.all_layouts(), is_leaf=is_layout)
    if plan.mask is None:
        return lays, ["float32"] * len(lays), [True] * len(lays)
    trained = jax.tree.map(lambda lay: "float32", plan.layouts, is_leaf=is_layout)
    dtypes = jax.tree.leaves(merge(plan.mask, trained, plan.frozen_dtypes))
    return lays, dtypes, [bool(x) for x in jax.tree.leaves(plan.mask)]


def check_same_params(plan: Plan, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model, naming the first leaf that differs (its
    shape, or whether it trains)."""
    lays, _, trains = _all_params(plan)
    paths = _param_paths(plan.all_layouts())
    mine = {
        path_str([k for _, k in p]): (lay.shape, on)
        for p, lay, on in zip(paths, lays, trains, strict=True)
    }
    theirs = {
        path_str([k for _, k in e["path"]]): (tuple(e["shape"]), e.get("trainable", True))
        for e in meta["param_tree"]
    }
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            say = lambda v: "absent" if v is None else f"{v[0]}{'' if v[1] else ' frozen'}"
            raise CheckpointError(
                f"the checkpoint is of a different model: param {name!r} is "
                f"{say(theirs.get(name))} there and {say(mine.get(name))} here"
            )


def has_ema(saved: Any) -> bool:
    """Whether a checkpoint holds an EMA of the weights, given its stored leaf names."""
    return any(n.startswith("ema/") for n in saved)


def model_state_shapes(saved: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{"model_state/...": shape}`` of a checkpoint's model state (BatchNorm statistics,
    :mod:`jaxzero.model_state`), given its stored leaves (``meta["leaves"]``); empty when
    it holds none."""
    return {n: tuple(v["shape"]) for n, v in saved.items() if n.startswith("model_state/")}


def fp32_field(saved: Any) -> str:
    """The stored field holding the fp32 truth of the params, given the stored leaf
    names: the master when the run kept one (bf16 runs), else the (fp32) params."""
    return "master" if any(n.startswith("master/") for n in saved) else "params"
