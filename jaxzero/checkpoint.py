"""Checkpoints on orbax: sharded, asynchronous, crash-safe, restorable into any stage and N.

A checkpoint is one orbax step directory with three items:

* ``state``: every leaf of the :class:`~jaxzero.state.TrainState` under a readable
  name (``params/blocks/fc/kernel``, ``master/...``, ``opt_state/0/mu/...``,
  ``step``), written shard by shard by the process that owns each shard.
* ``meta``: JSON: jaxzero version, stage, N, precision, and every leaf's logical
  shape, stored shape and dtype.
* ``extra``: JSON the caller adds (the data-loader position, the resolved config).

**Stored form.** Leaves are written as the engine stores them: sharded leaves keep
the zero padding of the saving layout (the step keeps padding exactly zero, so
it carries no information), and ``meta`` records the logical shape. A restore
reads each leaf straight into the target engine's sharding and stored shape,
zero-filling or dropping the padding difference (orbax's ``global_shape`` with
``strict=False``), so a leaf padded for N=8 restores for N=3 or N=1 and no leaf
is ever whole on one device when the target shards it.

**Safety.** orbax writes into a temporary directory and renames it when every
process has finished; an interrupted save is never listed and is removed the
next time a manager opens the directory. Saves are asynchronous (the arrays are
copied to host memory, then written in the background) and at most one is in
flight. A script that ends without ``wait()`` or ``close()`` still gets its last
save: open managers finish it as the interpreter begins to exit (:func:`_finish_saves`).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook first: see _finish_saves
import functools
import json
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.partition import is_layout, path_str
from jaxzero.state import TrainState, master_sharded

FORMAT = 1
FIELDS = ("step", "params", "master", "opt_state")


class CheckpointError(ValueError):
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


# managers with a save that may be in flight, held so that one dropped right after
# save() (``CheckpointManager(d).save(...)``) still completes it
_SAVING: set = set()


def _finish_saves() -> None:
    """Complete the saves still in flight, as the interpreter begins to exit.

    orbax writes in a background thread through ``concurrent.futures`` pools, which
    refuse new work once the interpreter starts shutting down; a script that saved
    and ended without ``wait()`` then lost its checkpoint amid "cannot schedule new
    futures after shutdown" / "Event loop is closed" tracebacks. This runs before the
    pools stop: Python's ``threading`` calls its exit hooks in reverse order of
    registration, and ``concurrent.futures`` registers its own on import, before ours.
    """
    for manager in list(_SAVING):
        try:
            manager.close()
        except Exception as e:  # noqa: BLE001 - at exit: say it in one line, go on
            print(
                f"jaxzero: the checkpoint save in flight in {manager.directory} did not "
                f"finish: {type(e).__name__}: {e}",
                file=sys.stderr,
            )


# threading's exit hooks run in reverse order of registration, so ours runs before the
# pools' own (registered when concurrent.futures.thread is first imported, just above);
# atexit's hooks would run only after the pools stopped
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_finish_saves)


class _Echoes(logging.Filter):
    """Keeps orbax's echoes of a failure jaxzero already reports off the console.

    orbax reads and writes leaves concurrently on a private event loop and closes it
    as soon as one operation fails; the operations still in flight finish moments
    later on tensorstore's threads and report to the closed loop ("Event loop is
    closed", "Task/Future exception was never retrieved"). A save that fails in the
    background is also logged, with its traceback, by each of orbax's threads before
    the next ``wait``/``save`` raises it, which :class:`CheckpointManager` turns into
    one :class:`CheckpointWriteError`. Installed once, when the first manager opens;
    every other message passes through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return "exception was never retrieved" not in record.getMessage()  # Task, Future
        # orbax's own report of a save in flight failing: the next wait() raises it
        return not (_SAVING and record.levelno >= logging.ERROR and "orbax" in record.pathname)

    @classmethod
    def install(cls) -> None:
        if getattr(sys.unraisablehook, "_jaxzero", False):
            return
        previous = sys.unraisablehook

        def hook(u):
            if not (
                isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value)
            ):
                previous(u)

        hook._jaxzero = True  # type: ignore[attr-defined]
        sys.unraisablehook = hook
        echoes = cls()
        for name in ("asyncio", "absl"):
            logging.getLogger(name).addFilter(echoes)


def write_cause(error: BaseException) -> str:
    """The operating system's reason behind a failed write ("No space left on device"),
    found in the exception chain or in tensorstore's ``[os_error_code='28']``; else
    the error's first line."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno) + (f": {seen.filename!r}" if seen.filename else "")
        code = re.search(r"os_error_code='?(\d+)", str(seen))
        if code:
            return os.strerror(int(code.group(1)))
        seen = seen.__cause__ or seen.__context__
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"


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


def _flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in nested.items():
        name = f"{prefix}/{k}" if prefix else k
        out.update(_flatten(v, name) if isinstance(v, dict) else {name: v})
    return out


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _fingerprint(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """An order-sensitive 32-bit hash of a leaf's logical elements, whatever its layout.

    orbax's files carry no checksum, so a flipped byte would restore silently; this
    hash is written into ``meta`` at save time and checked on restore.
    """
    x = x[tuple(slice(0, n) for n in shape)]
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


def older_steps(directory: Path, step: int) -> list[int] | str:
    """The other complete checkpoints beside ``step`` (for a damaged one's message)."""
    return (
        sorted(
            int(p.name)
            for p in directory.iterdir()
            if p.is_dir() and p.name.isdigit() and int(p.name) != step
        )
        or "none"
    )


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

    def key(k):
        if hasattr(k, "idx"):
            return ["i", int(k.idx)]
        return ["k", str(getattr(k, "key", getattr(k, "name", k)))]

    return [[key(k) for k in path] for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _params_from_meta(meta: dict[str, Any]) -> Any:
    """The params tree (dicts and lists) of ``ShapeDtypeStruct`` recorded in ``meta``."""
    root: dict[str, Any] = {}
    for entry in meta["param_tree"]:
        node, path = root, entry["path"]
        for i, (_, k) in enumerate(path):
            last = i == len(path) - 1
            leaf = jax.ShapeDtypeStruct(tuple(entry["shape"]), jnp.dtype(entry["dtype"]))
            node = node.setdefault(k, leaf if last else {})

    def listify(node):
        if not isinstance(node, dict):
            return node
        kids = {k: listify(v) for k, v in node.items()}
        if kids and all(isinstance(k, int) for k in kids):
            return [kids[i] for i in sorted(kids)]
        return kids

    return listify(root)


def metadata(engine: Any, state: TrainState) -> dict[str, Any]:
    """What a checkpoint says about itself: enough to rebuild shapes and check a target."""
    from jaxzero import __version__

    lays = leaf_names(TrainState(None, engine.layouts, None, engine.opt_layouts))
    leaves: dict[str, dict[str, Any]] = {}
    for name, x in leaf_names(state).items():
        field, _, rest = name.partition("/")
        lay = lays.get(f"params/{rest}" if field == "master" else name)
        leaves[name] = {
            "stored_shape": list(x.shape),
            "dtype": str(x.dtype),
            "shape": list(lay.shape) if lay is not None else list(x.shape),
        }
    param_tree = [
        {"path": p, "shape": list(lay.shape), "dtype": "float32"}
        for p, lay in zip(
            _param_paths(engine.layouts),
            jax.tree.leaves(engine.layouts, is_leaf=is_layout),
            strict=True,
        )
    ]
    sums = fingerprints(leaf_names(state), {n: v["shape"] for n, v in leaves.items()})
    for name, value in sums.items():
        leaves[name]["fingerprint"] = value
    return {
        "format": FORMAT,
        "jaxzero_version": __version__,
        "step": int(jax.device_get(state.step)),
        "stage": engine.stage,
        "num_shards": engine.num_shards,
        "devices": int(engine.mesh.devices.size),
        "processes": jax.process_count(),
        "precision": engine.precision,
        "num_params": int(engine.num_params),
        "param_tree": param_tree,
        "leaves": leaves,
    }


class CheckpointManager:
    """Save and restore train states under ``directory`` (one sub-directory per step).

    Args:
      directory: where checkpoints live (created on the first save).
      keep_last: how many recent checkpoints to keep (None: all).
      keep_every: also keep every checkpoint whose step is a multiple of this.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, jaxzero
      >>> engine = jaxzero.Engine(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
      ...                         optax.adam(1e-2), mesh=jaxzero.make_mesh(1))
      >>> state = engine.init({"w": jnp.ones((4, 2))})
      >>> ckpt = jaxzero.CheckpointManager(tempfile.mkdtemp())
      >>> ckpt.save(engine, state, extra={"note": "first"})
      >>> ckpt.wait(); ckpt.latest_step()
      0
      >>> state, extra = ckpt.restore(jaxzero.Engine(engine.loss_fn, optax.adam(1e-2),
      ...                                            mesh=jaxzero.make_mesh(1)))
      >>> extra["note"]
      'first'
    """

    def __init__(
        self, directory: str | Path, keep_last: int | None = 3, keep_every: int | None = None
    ):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} is a file")
        for name, v in (("keep_last", keep_last), ("keep_every", keep_every)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise CheckpointError(f"{name} must be a positive integer or None, got {v!r}")
        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last,
            keep_period=keep_every,
            create=False,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=True,
        )
        self._options = options
        self._manager: Any = None  # orbax's CheckpointManager, once the directory exists
        self._in_flight: int | None = None  # the step of the save not yet known complete
        if self.directory.is_dir():
            self._open()

    def _open(self):
        if self._manager is None:
            _Echoes.install()
            self.directory.mkdir(parents=True, exist_ok=True)
            self._manager = self._ocp.CheckpointManager(
                self.directory, options=self._options, item_names=("state", "meta", "extra")
            )
            # orbax removes interrupted saves in the background: let it finish first
            cleanup = getattr(self._manager, "_cleanup_tmp_directory_future", None)
            if cleanup is not None:
                cleanup.result()
        return self._manager

    # --- saving -------------------------------------------------------------------------

    def save(
        self,
        engine: Any,
        state: TrainState,
        extra: dict[str, Any] | None = None,
        force: bool = False,
    ) -> None:
        """Start writing ``state`` at its step; returns once the arrays are on the host.

        The state may be donated to the next ``engine.step`` right away. Waits
        for a save still in flight first, so at most one is.
        """
        ocp = self._ocp
        meta = metadata(engine, state)
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(nest(leaf_names(state))),
            meta=ocp.args.JsonSave(meta),
            extra=ocp.args.JsonSave(extra or {}),
        )
        self._finish()  # the previous save's failure is reported as that step's
        _SAVING.add(self)  # from here orbax's error logs are this save's (see _Echoes)
        try:
            self._open().save(meta["step"], args=args, force=force)
        except Exception as e:  # noqa: BLE001 - creating its directory failed
            _SAVING.discard(self)
            raise self._write_failed(meta["step"], e) from None
        self._in_flight = meta["step"]

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete on disk.

        Raises:
          CheckpointWriteError: it could not be written (disk full, permission
            lost); the error names the latest complete checkpoint.
        """
        self._finish()

    def close(self) -> None:
        """Finish the save in flight and release orbax's threads (also a context exit)."""
        try:
            self._finish()
        finally:
            if self._manager is not None:
                self._manager.close()
                self._manager = None

    def _finish(self) -> None:
        step, self._in_flight = self._in_flight, None
        try:
            if self._manager is not None and step is not None:
                self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
            assert step is not None  # only the wait for a save in flight raises
            raise self._write_failed(step, e) from None
        finally:
            _SAVING.discard(self)  # after the wait: orbax logs the failure during it

    def _write_failed(self, step: int, error: BaseException) -> CheckpointWriteError:
        try:
            steps = [s for s in self.all_steps() if s != step]
        except Exception:  # noqa: BLE001 - the directory itself may be gone
            steps = []
        return CheckpointWriteError(
            step, self.directory / str(step), write_cause(error), steps[-1] if steps else None
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- reading ------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        if self._manager is None:
            return []
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The ``meta`` JSON of a checkpoint (latest by default)."""
        step = self._step(step)
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} has no readable metadata ({e}); "
                "it is not a jaxzero checkpoint or it is damaged"
            ) from None

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"no complete checkpoint in {self.directory}"
                + ("" if self.directory.is_dir() else " (the directory does not exist)")
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint of step {step} in {self.directory}; there are {steps}"
            )
        return step

    def restore(self, engine: Any, step: int | None = None) -> tuple[TrainState, dict]:
        """The state of checkpoint ``step`` (latest by default) in ``engine``'s layout.

        ``engine`` may be uninitialised: its param shapes then come from the
        checkpoint. Its stage, mesh, N and precision may differ from the saving
        run's; its model and optimizer may not.

        Returns:
          ``(state, extra)``.
        """
        ocp = self._ocp
        step = self._step(step)
        meta = self.metadata(step)
        saved = meta["leaves"]
        if engine.layouts is None:
            target = engine.abstract_state(_params_from_meta(meta))
        else:
            _check_same_params(engine, meta)
            target = engine.state_shapes()  # no new layouts: the step stays compiled

        # fp32 truth: the master when the run kept one, else the (fp32) params
        src = "master" if any(n.startswith("master/") for n in saved) else "params"
        sharded = master_sharded(engine.stage)
        master_sh = jax.tree.map(
            lambda s: jax.sharding.NamedSharding(engine.mesh, s),
            _master_specs(engine),
            is_leaf=_is_spec,
        )
        want: dict[str, tuple[tuple[int, ...], Any, Any]] = {}
        for name, lay, sh in zip(
            leaf_names(TrainState(None, engine.layouts, None, None)),
            jax.tree.leaves(engine.layouts, is_leaf=is_layout),
            jax.tree.leaves(master_sh),
            strict=True,
        ):
            shape = lay.padded_shape if sharded else lay.shape
            want[src + name[len("params") :]] = (shape, jnp.float32, sh)
        for name, x in leaf_names(TrainState(target.step, None, None, target.opt_state)).items():
            want[name] = (x.shape, x.dtype, x.sharding)
        missing = [n for n in want if n not in saved]
        unknown = [n for n in saved if n.startswith("opt_state") and n not in want]
        if missing or unknown:
            what = (
                f"does not hold {missing[:3]}"
                if missing
                else f"holds optimizer state {unknown[:3]} this optimizer does not have"
            )
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} {what}: it was saved with a "
                "different optimizer or model"
            )
        item = nest({n: jax.ShapeDtypeStruct(s, d, sharding=sh) for n, (s, d, sh) in want.items()})
        restore_args = nest(
            {
                n: ocp.ArrayRestoreArgs(sharding=sh, global_shape=tuple(s), dtype=d, strict=False)
                for n, (s, d, sh) in want.items()
            }
        )
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item, restore_args=restore_args, partial_restore=True
                    ),
                    extra=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} could not be read "
                f"({type(e).__name__}: {first}); it is damaged or incomplete. Older "
                f"checkpoints: {[s for s in self.all_steps() if s != step] or 'none'}"
            ) from None
        flat = _flatten(out["state"])
        sums = fingerprints(flat, {n: saved[n]["shape"] for n in flat})
        bad = [n for n, v in sums.items() if saved[n].get("fingerprint", v) != v]
        if bad:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} is damaged: {bad[:3]} no longer "
                "match the fingerprints written when it was saved. Older checkpoints: "
                f"{[s for s in self.all_steps() if s != step] or 'none'}"
            )
        master = jax.tree.unflatten(
            jax.tree.structure(engine.layouts, is_leaf=is_layout),
            [
                flat[src + n[len("params") :]]
                for n in leaf_names(TrainState(None, engine.layouts, None, None))
            ],
        )
        opt_leaves = [flat[n] for n in leaf_names(TrainState(None, None, None, target.opt_state))]
        opt_state = jax.tree.unflatten(jax.tree.structure(target.opt_state), opt_leaves)
        state = engine.state_from(master, opt_state, int(np.asarray(flat["step"])))
        return state, dict(out["extra"] or {})


def _is_spec(x: Any) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _master_specs(engine: Any) -> Any:
    from jaxzero.state import master_specs

    return master_specs(engine.stage, engine.layouts)


def _check_same_params(engine: Any, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model, naming the first leaf that differs."""
    mine = {
        path_str([k for _, k in p]): lay.shape
        for p, lay in zip(
            _param_paths(engine.layouts),
            jax.tree.leaves(engine.layouts, is_leaf=is_layout),
            strict=True,
        )
    }
    theirs = {path_str([k for _, k in e["path"]]): tuple(e["shape"]) for e in meta["param_tree"]}
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise CheckpointError(
                f"the checkpoint is of a different model: param {name!r} is "
                f"{theirs.get(name, 'absent')} there and {mine.get(name, 'absent')} here"
            )
