"""A global batch on the mesh: which rows each process feeds, checks, and placement.

The one owner of the rule "process ``p`` feeds rows ``process_rows(...)[p]`` of the
global batch": :meth:`jaxzero.Engine.process_rows` asks it, and so does the training
app's data loader, so a script and ``jaxzero train`` split a batch alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxzero.partition import path_str
from jaxzero.types import Batch


def process_rows(device_rows: Mapping[Any, Any], batch_size: int) -> dict[int, slice]:
    """Which contiguous rows of the global batch each process must supply.

    Args:
      device_rows: ``sharding.devices_indices_map((batch_size, ...))``: for each device
        (anything with ``process_index``), its index tuple.
      batch_size: global rows.

    Returns:
      ``{process_index: slice}``. Raises if a process's rows are not contiguous,
      which ``jax.make_array_from_process_local_data`` needs.
    """
    held: dict[int, set[int]] = {}
    for device, index in device_rows.items():
        span = range(*index[0].indices(batch_size))
        held.setdefault(device.process_index, set()).update(span)
    out = {}
    for proc, rows in sorted(held.items()):
        lo, hi = min(rows), max(rows) + 1
        if len(rows) != hi - lo:
            raise ValueError(f"process {proc} holds non-contiguous batch rows {sorted(rows)}")
        out[proc] = slice(lo, hi)
    return out


def rows_of(sharding: NamedSharding, batch_size: int, divisor: int, divisor_note: str) -> slice:
    """The rows of a global batch of ``batch_size`` this process feeds, for a batch laid
    out as ``sharding``; ``divisor`` (``divisor_note`` names it): what it must divide."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"global batch size must be a positive integer, got {batch_size!r}")
    if batch_size % divisor:
        raise ValueError(
            f"global batch {batch_size} is not divisible by {divisor_note} = {divisor}; "
            f"use a multiple of {divisor}"
        )
    # a batch of the sharding's rank (Ulysses splits dim 1 too): each later dim the size
    # of the axes splitting it, so only the rows decide
    later = [
        math.prod(sharding.mesh.shape[a] for a in ((e,) if isinstance(e, str) else e or ()))
        for e in tuple(sharding.spec)[1:]
    ]
    by_process = process_rows(sharding.devices_indices_map((batch_size, *later)), batch_size)
    return by_process[jax.process_index()]


def check(batch: Batch, divisor: int, divisor_note: str, treedef: Any = None) -> Any:
    """Refuse an empty or ragged batch, or one whose rows do not divide; returns its
    structure (``treedef``: the structure every step must keep)."""
    leaves, found = jax.tree.flatten(batch)
    if not leaves:
        raise ValueError("batch is empty: pass a pytree of arrays with a leading batch dim")
    if treedef is not None and found != treedef:
        raise ValueError(
            f"batch structure changed: expected {treedef}, got {found}. "
            "Every step must receive the same pytree of arrays."
        )
    sizes = {
        path_str(p): (np.shape(x)[0] if np.ndim(x) else None)
        for p, x in jax.tree_util.tree_leaves_with_path(batch)
    }
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"every batch leaf needs the same leading (batch) dim, got {sizes}")
    b = next(iter(sizes.values()))
    assert b is not None  # refused above
    if b % divisor:
        raise ValueError(
            f"global batch {b} is not divisible by {divisor_note} = {divisor}; "
            f"use a multiple of {divisor}"
        )
    return found


def check_sequence(batch: Batch, devices: int) -> None:
    """Ulysses: every leaf's dim 1 (the sequence) divides over the ``devices``."""
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        if np.ndim(x) < 2 or np.shape(x)[1] % devices:
            raise ValueError(
                f"ulysses=True splits each sequence over the {devices} data devices: batch "
                f"leaf {path_str(path)!r} of shape {np.shape(x)} has no dim 1 that "
                f"{devices} divide; use a sequence length that is a multiple of {devices}"
            )


def place(batch: Batch, sh: NamedSharding) -> Batch:
    """Host arrays, or arrays on any device(s) -> global arrays laid out as ``sh``. With
    several processes each passes its rows (:func:`rows_of`) and gets the global batch."""

    def one(x: Any) -> jax.Array:
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(sh, x.ndim):
                return x
            if not x.is_fully_addressable:  # a global array laid out differently
                return jax.jit(lambda a: a, out_shardings=sh)(x)
            if jax.process_count() == 1:  # e.g. committed to one device
                return jax.device_put(x, sh)
        if jax.process_count() == 1:
            return jax.device_put(np.asarray(x), sh)
        return jax.make_array_from_process_local_data(sh, np.asarray(x))

    return jax.tree.map(one, batch)


def to_global(batch: Batch, sh: NamedSharding, check_batch: Callable[[Batch], Any]) -> Batch:
    """What a step is given, as the global batch it runs on: ``jax.ShapeDtypeStruct``
    trees laid out as ``sh`` (to lower with), arrays placed (:func:`place`). Each is
    checked by ``check_batch`` as the global batch: before placing with one process,
    after with several (each passes only its rows)."""
    leaves = jax.tree.leaves(batch)
    if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), batch)
    elif jax.process_count() == 1:  # check the global batch before placing it
        check_batch(batch)
        return place(batch, sh)
    else:  # each process holds only its rows: check the assembled global batch
        batch = place(batch, sh)
    check_batch(batch)
    return batch


class Intake:
    """The batches one engine takes: laid out as ``sharding``, their rows a multiple of
    the batch devices times the micro-batches, the first one's structure every step;
    with ``seq_devices`` > 1 (Ulysses) each leaf's dim 1, the sequence, split over them."""

    def __init__(
        self, sharding: NamedSharding, devices: int, micro_batches: int, seq_devices: int = 1
    ):
        self.sharding = sharding
        self.divisor = devices * micro_batches
        self.note = f"{devices} devices x {micro_batches} micro-batches"
        self.seq_devices = seq_devices
        self.treedef: Any = None

    def rows(self, batch_size: int) -> slice:
        """This process's rows of a global batch of ``batch_size`` (:func:`rows_of`)."""
        if self.seq_devices > 1 and jax.process_count() > 1:
            raise ValueError(
                "ulysses=True splits each row over devices of several processes, which "
                "jaxzero cannot feed yet: run Ulysses in one process"
            )
        return rows_of(self.sharding, batch_size, self.divisor, self.note)

    def check(self, batch: Batch) -> None:
        """:func:`check` ``batch`` against the structure of the first one checked."""
        self.treedef = check(batch, self.divisor, self.note, self.treedef)
        if self.seq_devices > 1:
            check_sequence(batch, self.seq_devices)

    def to_global(self, batch: Batch) -> Batch:
        """:func:`to_global`, each batch checked by :meth:`check`."""
        return to_global(batch, self.sharding, self.check)
