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

**Reading without a manager.** ``jaxzero export`` and ``jaxzero sample`` read one
checkpoint through :func:`complete_steps`, :func:`read_metadata`, :func:`read_extra`
and :class:`LeafReader` (one leaf at a time, on the host), all on orbax's public
handlers, reading none of its files by hand: this module is the one place that knows
how a checkpoint is laid out.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook first: see _finish_saves
import ctypes
import functools
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.errors import Error
from jaxzero.partition import is_layout, path_str
from jaxzero.state import TrainState, master_sharded, master_specs
from jaxzero.version import __version__

if TYPE_CHECKING:
    from jaxzero.engine import EngineLike

# orbax.checkpoint is imported where it is used: 0.45-0.6 s that `import jaxzero` and
# `jaxzero --help` skip (measured on 2 cores)
FORMAT = 1
FIELDS = ("step", "params", "master", "opt_state")


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
    return [s for s in complete_steps(directory) if s != step] or "none"


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


def metadata(engine: EngineLike, state: TrainState) -> dict[str, Any]:
    """What a checkpoint says about itself: enough to rebuild shapes and check a target."""
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
                self.directory, options=self._options, item_names=ITEMS
            )
            # orbax removes interrupted saves in the background: let it finish first
            cleanup = getattr(self._manager, "_cleanup_tmp_directory_future", None)
            if cleanup is not None:
                cleanup.result()
        return self._manager

    # --- saving -------------------------------------------------------------------------

    def save(
        self,
        engine: EngineLike,
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
        """The ``meta`` JSON of a checkpoint (latest by default): :func:`read_metadata`."""
        return read_metadata(self.directory / str(self._step(step)))

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

    def restore(self, engine: EngineLike, step: int | None = None) -> tuple[TrainState, dict]:
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

        src = _fp32_field(saved)
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


# --- reading one checkpoint without a manager -------------------------------------------
#
# ``jaxzero export`` and ``jaxzero sample`` only read; a manager also removes interrupted
# saves when it opens. These functions read through orbax's public handlers instead, so
# that what a checkpoint looks like on disk is known here and to orbax, nowhere else.

ITEMS = ("state", "meta", "extra")  # the orbax items of every step, as CheckpointManager saves


def complete_steps(directory: str | Path) -> list[int]:
    """Steps of the complete checkpoints in ``directory``, oldest first (none when it is
    missing), by orbax's own step naming, which never lists an interrupted save. Reads only."""
    import orbax.checkpoint as ocp

    return sorted(m.step for m in ocp.path.step.standard_name_format().find_all(Path(directory)))


def is_step_dir(path: str | Path) -> bool:
    """Whether ``path`` is one checkpoint (a step directory) rather than a directory of them."""
    return any((Path(path) / item).is_dir() for item in ITEMS)


def _restore_items(step_dir: Path, **items: Any) -> dict[str, Any]:
    """orbax's composite restore of some of a step's items; one handler, closed after."""
    import orbax.checkpoint as ocp

    handler = ocp.CompositeCheckpointHandler()
    try:
        return dict(handler.restore(step_dir, ocp.args.Composite(**items)))
    finally:
        handler.close()


def read_metadata(step_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta`` item (:func:`metadata`: stage, N, precision, every leaf's
    shapes, dtype and fingerprint), read without opening a manager."""
    import orbax.checkpoint as ocp

    step_dir = Path(step_dir).absolute()
    try:
        meta = _restore_items(step_dir, meta=ocp.args.JsonRestore())["meta"]
        meta["param_tree"], meta["leaves"]  # noqa: B018 - both must be there
        return meta
    except Exception as e:  # noqa: BLE001 - missing, unreadable or not JSON: all one answer
        raise CheckpointError(
            f"checkpoint {step_dir} has no readable metadata ({type(e).__name__}); "
            "it is damaged or not a jaxzero checkpoint"
        ) from None


def read_extra(step_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's ``extra`` item: what the saver added (the data loader's position,
    the run's resolved config), read without opening a manager."""
    import orbax.checkpoint as ocp

    step_dir = Path(step_dir).absolute()
    try:
        extra = _restore_items(step_dir, extra=ocp.args.JsonRestore())["extra"]
    except Exception as e:  # noqa: BLE001 - missing, unreadable or not JSON: all one answer
        raise CheckpointError(
            f"checkpoint {step_dir} has no readable extra item ({type(e).__name__}); "
            "it is damaged or not a jaxzero checkpoint"
        ) from None
    return dict(extra or {})


def _fp32_field(saved: Any) -> str:
    """The stored field holding the fp32 truth of the params, given the stored leaf
    names: the master when the run kept one (bf16 runs), else the (fp32) params."""
    return "master" if any(n.startswith("master/") for n in saved) else "params"


def param_entries(meta: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(param name, stored leaf name, logical shape)`` of each param of a checkpoint's
    ``meta``, in tree order, naming its fp32 truth (the master of a bf16 run)."""
    source = _fp32_field(meta["leaves"])
    out = []
    for entry in meta["param_tree"]:
        name = path_str([k for _, k in entry["path"]])
        leaf = f"{source}/{name}"
        if leaf not in meta["leaves"]:
            raise CheckpointError(f"checkpoint metadata lists param {name!r} but no {leaf!r}")
        out.append((name, leaf, tuple(entry["shape"])))
    return out


class LeafReader:
    """A checkpoint's stored leaves read one at a time onto the host, each verified.

    Each :meth:`read` is one partial restore of one leaf as a numpy array through
    orbax's public API (``PyTreeRestore(partial_restore=True)``, ``restore_type=
    np.ndarray``): a read holds a few leaf-sized buffers at most (orbax's and
    tensorstore's, the unpadded copy), never the model, and makes no JAX array. The
    leaf is checked against the fingerprint ``meta`` recorded for it at save time, as
    :meth:`CheckpointManager.restore` checks every leaf it restores.

    orbax asks JAX for the process index, which starts JAX's backend, and tensorstore
    allocates each leaf on one of its many threads, where glibc keeps freed leaf-sized
    blocks in per-thread arenas for reuse: a long streaming read may hold about one leaf
    per arena. A process that only streams checkpoints calls :func:`host_reader_process`
    first (``jaxzero export`` does).
    """

    def __init__(self, step_dir: str | Path):
        import orbax.checkpoint as ocp

        self.dir = Path(step_dir).absolute()
        self._sums = {
            name: entry.get("fingerprint")
            for name, entry in read_metadata(self.dir)["leaves"].items()
        }
        self._ocp = ocp
        _Echoes.install()  # a damaged file fails one of orbax's concurrent reads: no echoes
        self._handler = ocp.CompositeCheckpointHandler()

    def read(self, leaf: str, shape: tuple[int, ...], dtype: np.dtype | None = None) -> np.ndarray:
        """The ``shape`` corner of stored ``leaf`` (its logical region: the saving
        layout's zero padding dropped) as a C-contiguous array, verified; cast to
        ``dtype`` when given (rounding to nearest even, as numpy/JAX ``astype``).

        The padding is read with the leaf and dropped on the host; only a leaf padded
        in a dimension other than its first needs a copy (one more leaf, briefly).
        """
        ocp = self._ocp
        shape = tuple(shape)
        try:
            restored = self._handler.restore(
                self.dir,
                ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        nest({leaf: 0}),  # the value is unused: restore_args says what to make
                        restore_args=nest({leaf: ocp.RestoreArgs(restore_type=np.ndarray)}),
                        partial_restore=True,
                    )
                ),
            )["state"]
            stored = _flatten(restored).pop(leaf)
            del restored
            if stored.ndim != len(shape) or any(
                a < b for a, b in zip(stored.shape, shape, strict=True)
            ):
                raise ValueError(f"stored shape {stored.shape} cannot hold {shape}")
            raw = np.asarray(stored[tuple(slice(0, n) for n in shape)], order="C")  # 0-d too
            del stored
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
            msg = (str(e).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(
                f"checkpoint {self.dir} could not be read at {leaf} "
                f"({type(e).__name__}: {msg}); it is damaged or incomplete. Older "
                f"checkpoints: {older_steps(self.dir.parent, _step_of(self.dir))}"
            ) from None
        want = self._sums.get(leaf)
        if want is not None and host_fingerprint(raw) != want:
            raise CheckpointError(
                f"checkpoint {self.dir} is damaged: {leaf} no longer matches the "
                "fingerprint written when it was saved. Older checkpoints: "
                f"{older_steps(self.dir.parent, _step_of(self.dir))}"
            )
        return raw if dtype is None or raw.dtype == dtype else raw.astype(dtype)

    def close(self) -> None:
        """Release orbax's handler."""
        self._handler.close()

    def __enter__(self) -> LeafReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def host_reader_process() -> None:
    """Set up a process that streams checkpoints on the host (``jaxzero export``).

    * JAX on the CPU, unless ``JAX_PLATFORMS`` says otherwise: orbax starts JAX's
      backend (for the process index), and a GPU backend would take most of the GPU's
      memory, perhaps from the run that wrote the checkpoint.
    * glibc's malloc limited to one arena: tensorstore allocates each leaf on one of
      its threads, and each thread's arena kept its freed leaves, so memory grew to
      about a leaf per arena (measured: 6 of 12 16-MiB leaves held after an export on
      two cores; glibc allows 8 arenas a core) instead of staying at a few leaves.

    Call it first: a backend already started stays, and threads that already have an
    arena keep it. Elsewhere than glibc the second part does nothing.
    """
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    try:
        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX (malloc.h)
    except (AttributeError, OSError):
        pass


def _step_of(step_dir: Path) -> int:
    return int(step_dir.name) if step_dir.name.isdigit() else -1


def _is_spec(x: Any) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _master_specs(engine: EngineLike) -> Any:
    return master_specs(engine.stage, engine.layouts)


def _check_same_params(engine: EngineLike, meta: dict[str, Any]) -> None:
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
