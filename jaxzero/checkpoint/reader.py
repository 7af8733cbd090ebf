"""Reading one checkpoint without a manager: its steps, metadata, extra item, leaves.

``jaxzero export`` and ``jaxzero sample`` only read; a manager also removes interrupted
saves when it opens. These functions read through orbax's public handlers, so that what
a checkpoint looks like on disk is known to :mod:`jaxzero.checkpoint` and to orbax,
nowhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxzero.checkpoint.format import (
    ITEMS,
    CheckpointError,
    flatten,
    fp32_field,
    has_ema,
    host_fingerprint,
    nest,
    step_of,
)
from jaxzero.checkpoint.hygiene import Echoes
from jaxzero.partition import path_str


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


NO_EMA = "this run has no EMA: train with --set train.ema=0.999"


def param_entries(
    meta: dict[str, Any], ema: bool = False
) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(param name, stored leaf name, logical shape)`` of each param of a checkpoint's
    ``meta``, in tree order, naming its fp32 truth (the master of a bf16 run; a frozen
    param's one stored copy); ``ema``: the EMA of the weights instead (frozen params
    have none: their one copy), refused in one line when the checkpoint holds none."""
    if ema and not has_ema(meta["leaves"]):
        raise CheckpointError(NO_EMA)
    source = "ema" if ema else fp32_field(meta["leaves"])
    out = []
    for entry in meta["param_tree"]:
        name = path_str([k for _, k in entry["path"]])
        leaf = f"{source if entry.get('trainable', True) else 'frozen'}/{name}"
        if leaf not in meta["leaves"] and not meta.get("frozen_saved", True):
            raise CheckpointError(
                f"the checkpoint holds no frozen params (saved without them, as a LoRA "
                f"run saves only what trains): {name!r} must come from the base model"
            )
        if leaf not in meta["leaves"]:
            raise CheckpointError(f"checkpoint metadata lists param {name!r} but no {leaf!r}")
        out.append((name, leaf, tuple(entry["shape"])))
    return out


def older_steps(directory: Path, step: int) -> list[int] | str:
    """The other complete checkpoints beside ``step`` (for a damaged one's message)."""
    return [s for s in complete_steps(directory) if s != step] or "none"


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
        Echoes.install()  # a damaged file fails one of orbax's concurrent reads: no echoes
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
            stored = flatten(restored).pop(leaf)
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
                f"checkpoints: {older_steps(self.dir.parent, step_of(self.dir))}"
            ) from None
        want = self._sums.get(leaf)
        if want is not None and host_fingerprint(raw) != want:
            raise CheckpointError(
                f"checkpoint {self.dir} is damaged: {leaf} no longer matches the "
                "fingerprint written when it was saved. Older checkpoints: "
                f"{older_steps(self.dir.parent, step_of(self.dir))}"
            )
        return raw if dtype is None or raw.dtype == dtype else raw.astype(dtype)

    def close(self) -> None:
        """Release orbax's handler."""
        self._handler.close()

    def __enter__(self) -> LeafReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
