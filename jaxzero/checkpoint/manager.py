"""``CheckpointManager``: save train states asynchronously, restore them into any stage and N.

Leaves are written as the engine stores them (sharded leaves keep the saving layout's zero
padding; ``meta`` records the logical shape); a restore reads each leaf straight into the
target plan's sharding and stored shape, zero-filling or dropping the padding difference
(orbax's ``global_shape`` with ``strict=False``), so a leaf padded for N=8 restores for
N=3 or N=1 and no leaf is ever whole on one device when the target shards it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero import plan as plan_lib
from jaxzero.checkpoint.format import (
    ITEMS,
    CheckpointError,
    CheckpointWriteError,
    check_same_params,
    fingerprints,
    flatten,
    fp32_field,
    has_ema,
    leaf_names,
    metadata,
    model_state_shapes,
    nest,
    params_from_meta,
)
from jaxzero.checkpoint.hygiene import SAVING, Echoes
from jaxzero.checkpoint.reader import read_metadata
from jaxzero.ema import EMAWarning
from jaxzero.partition import is_layout
from jaxzero.plan import Plan
from jaxzero.state import TrainState, master_sharded
from jaxzero.types import Params

if TYPE_CHECKING:
    from jaxzero.engine import Engine

Want = dict[str, tuple[tuple[int, ...], Any, Any]]  # leaf name -> (shape, dtype, sharding)


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


class CheckpointManager:
    """Save and restore train states under ``directory`` (one sub-directory per step).

    Args:
      directory: where checkpoints live (created on the first save).
      keep_last: how many recent checkpoints to keep (None: all).
      keep_every: also keep every checkpoint whose step is a multiple of this.
      save_frozen: whether a checkpoint holds the frozen params
        (``Engine(trainable=...)``). False: it holds what trains (and its optimizer
        state) and records the frozen params' shapes only; :meth:`restore` then takes
        them from its ``frozen`` argument (a LoRA run reloads its base from the source).

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
        self,
        directory: str | Path,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        save_frozen: bool = True,
    ):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} is a file")
        for name, v in (("keep_last", keep_last), ("keep_every", keep_every)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise CheckpointError(f"{name} must be a positive integer or None, got {v!r}")
        self._ocp = ocp
        self.save_frozen = save_frozen
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

    def _open(self) -> Any:
        if self._manager is None:
            Echoes.install()
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
        engine: Engine,
        state: TrainState,
        extra: dict[str, Any] | None = None,
        force: bool = False,
    ) -> None:
        """Start writing ``state`` at its step; returns once the arrays are on the host.

        The state may be donated to the next ``engine.step`` right away. Waits
        for a save still in flight first, so at most one is.
        """
        ocp = self._ocp
        if not self.save_frozen:
            state = dataclasses.replace(state, frozen=None)
        meta = metadata(engine.plan, state)
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(nest(leaf_names(state))),
            meta=ocp.args.JsonSave(meta),
            extra=ocp.args.JsonSave(extra or {}),
        )
        self._finish()  # the previous save's failure is reported as that step's
        SAVING.add(self)  # from here orbax's error logs are this save's (see _Echoes)
        try:
            self._open().save(meta["step"], args=args, force=force)
        except Exception as e:  # noqa: BLE001 - creating its directory failed
            SAVING.discard(self)
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
            SAVING.discard(self)  # after the wait: orbax logs the failure during it

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

    def restore(
        self, engine: Engine, step: int | None = None, frozen: Params = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """The state of checkpoint ``step`` (latest by default) in ``engine``'s layout.

        ``engine`` may be uninitialised: its plan is then built from the param shapes
        the checkpoint records. Its stage, mesh, N and precision may differ from the
        saving run's; its model, optimizer and which params train may not. Of the engine
        only its plan (:attr:`~jaxzero.Engine.plan`, :meth:`~jaxzero.Engine.plan_for`)
        is read. ``frozen``: the frozen params as ``engine`` stores them (a state's
        ``frozen``), for a checkpoint saved without them (``save_frozen=False``).

        Returns:
          ``(state, extra)``.
        """
        step = self._step(step)
        meta = self.metadata(step)
        if engine.has_plan:
            plan = engine.plan
            check_same_params(plan, meta)  # no new plan: the step stays compiled
        else:
            plan = engine.plan_for(params_from_meta(meta))
            check_same_params(plan, meta)  # the shapes agree; whether each trains may not
        target = plan_lib.state_shapes(plan)
        src = fp32_field(meta["leaves"])
        ema = _ema_source(plan, meta, self.directory / str(step))
        held = plan.mask is not None and meta.get("frozen_saved", True)
        if plan.mask is not None and not held and frozen is None:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} holds no frozen params (saved "
                "with save_frozen=False): pass restore(..., frozen=state.frozen) of the "
                "base they came from"
            )
        _check_model_state(plan, target, meta, self.directory / str(step))
        want = _wanted(plan, target, (src, ema) if ema else (src,), held)
        self._check_holds(step, want, meta["leaves"])
        out = self._read(step, want)
        flat = flatten(out["state"])
        sums = fingerprints(flat, {n: meta["leaves"][n]["shape"] for n in flat})
        bad = [n for n, v in sums.items() if meta["leaves"][n].get("fingerprint", v) != v]
        if bad:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} is damaged: {bad[:3]} no longer "
                "match the fingerprints written when it was saved. Older checkpoints: "
                f"{self._others(step)}"
            )
        master = _params_of(plan, flat, src)
        average = _params_of(plan, flat, ema) if ema else None
        opt_names = leaf_names(TrainState(None, None, None, target.opt_state))
        opt_state = jax.tree.unflatten(
            jax.tree.structure(target.opt_state), [flat[n] for n in opt_names]
        )
        if held:
            names = leaf_names(TrainState(None, None, None, None, target.frozen))
            frozen = jax.tree.unflatten(jax.tree.structure(target.frozen), [flat[n] for n in names])
        model_state = None
        if plan.has_model_state:
            names = leaf_names(TrainState(None, None, None, None, model_state=target.model_state))
            model_state = jax.tree.unflatten(
                jax.tree.structure(target.model_state), [flat[n] for n in names]
            )
        step_no = int(np.asarray(flat["step"]))
        state = plan_lib.state_from_parts(
            plan, master, opt_state, step_no, frozen, average, model_state
        )
        return state, dict(out["extra"] or {})

    def _others(self, step: int) -> list[int] | str:
        return [s for s in self.all_steps() if s != step] or "none"

    def _check_holds(self, step: int, want: Want, saved: dict[str, Any]) -> None:
        """Refuse a checkpoint missing a leaf, or holding optimizer state this one lacks."""
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

    def _read(self, step: int, want: Want) -> dict[str, Any]:
        """orbax's restore of the wanted leaves (and ``extra``) into their shardings."""
        ocp = self._ocp
        item = nest({n: jax.ShapeDtypeStruct(s, d, sharding=sh) for n, (s, d, sh) in want.items()})
        restore_args = nest(
            {
                n: ocp.ArrayRestoreArgs(sharding=sh, global_shape=tuple(s), dtype=d, strict=False)
                for n, (s, d, sh) in want.items()
            }
        )
        args = ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True),
            extra=ocp.args.JsonRestore(),
        )
        try:
            return dict(self._manager.restore(step, args=args))
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} could not be read "
                f"({type(e).__name__}: {first}); it is damaged or incomplete. Older "
                f"checkpoints: {self._others(step)}"
            ) from None


def _param_names(plan: Plan) -> list[str]:
    """``params/...`` names of the plan's params, in tree order."""
    return list(leaf_names(TrainState(None, plan.layouts, None, None)))


def _params_of(plan: Plan, flat: dict[str, Any], field: str) -> Params:
    """The restored leaves of ``field`` (``master``, ``params`` or ``ema``), a params tree."""
    return jax.tree.unflatten(
        jax.tree.structure(plan.layouts, is_leaf=is_layout),
        [flat[field + n[len("params") :]] for n in _param_names(plan)],
    )


def _ema_source(plan: Plan, meta: dict[str, Any], where: Path) -> str | None:
    """``"ema"`` when the plan keeps an EMA and the checkpoint holds one; else None, with
    a one-line warning when they disagree: the EMA starts at the restored params, or the
    checkpoint's is dropped."""
    saved = has_ema(meta["leaves"])
    if plan.has_ema and not saved:
        warnings.warn(
            f"checkpoint {where} holds no EMA of the weights: the EMA starts at its params",
            EMAWarning,
            stacklevel=3,
        )
    elif saved and not plan.has_ema:
        warnings.warn(
            f"checkpoint {where} holds an EMA of the weights; this engine keeps none "
            "(ema=None): it is dropped",
            EMAWarning,
            stacklevel=3,
        )
    return "ema" if saved and plan.has_ema else None


def _check_model_state(plan: Plan, target: TrainState, meta: dict[str, Any], where: Path) -> None:
    """Refuse, in one line, a checkpoint whose model state (BatchNorm statistics) is not
    the one the engine keeps: absent, present where the engine keeps none, or of other
    names or shapes."""
    saved = model_state_shapes(meta["leaves"])
    mine = {
        n: tuple(x.shape)
        for n, x in leaf_names(
            TrainState(None, None, None, None, model_state=target.model_state)
        ).items()
    }
    if saved == mine:
        return
    if not saved:
        raise CheckpointError(
            f"checkpoint {where} holds no model state, but this engine keeps one "
            f"({sorted(mine)[:3]}): it was saved by an engine without model_state="
        )
    if not mine:
        raise CheckpointError(
            f"checkpoint {where} holds model state ({sorted(saved)[:3]}): build the engine "
            "with model_state= (the model's BatchNorm statistics) to restore it"
        )
    first = next(n for n in sorted(set(saved) | set(mine)) if saved.get(n) != mine.get(n))
    raise CheckpointError(
        f"checkpoint {where} holds model state {first!r} of shape {saved.get(first, 'absent')}; "
        f"this engine keeps {mine.get(first, 'none')}: a different model"
    )


def _wanted(plan: Plan, target: TrainState, srcs: tuple[str, ...], frozen: bool) -> Want:
    """Each leaf to read: the fp32 params of each field of ``srcs`` (the params or the
    master of a bf16 run, and the EMA) in the plan's master layout, then the step and
    optimizer state as ``target`` holds them, and the frozen params when the checkpoint
    holds them (``frozen``)."""
    sharded = master_sharded(plan.stage)
    want: Want = {}
    for src in srcs:  # orbax zero-fills or drops the padding difference of each
        for name, lay, sh in zip(
            _param_names(plan), plan.leaves(), jax.tree.leaves(plan.master_shardings), strict=True
        ):
            shape = lay.padded_shape if sharded else lay.shape
            want[src + name[len("params") :]] = (shape, jnp.float32, sh)
    rest = TrainState(
        target.step,
        None,
        None,
        target.opt_state,
        target.frozen if frozen else None,
        model_state=target.model_state,
    )
    for name, x in leaf_names(rest).items():
        want[name] = (x.shape, x.dtype, x.sharding)
    return want
