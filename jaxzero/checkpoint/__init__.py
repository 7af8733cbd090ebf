"""Checkpoints on orbax: sharded, asynchronous, crash-safe, restorable into any stage and N.

A checkpoint is one orbax step directory with three items:

* ``state``: every leaf of the :class:`~jaxzero.state.TrainState` under a readable
  name (``params/blocks/fc/kernel``, ``master/...``, ``opt_state/0/mu/...``,
  ``step``; ``ema/...`` when the engine keeps an EMA of the weights,
  ``model_state/...`` when it keeps model state such as BatchNorm statistics), written
  shard by shard by the process that owns each shard. A restore refuses, in one line, a
  checkpoint whose model state is absent, unexpected or of other shapes.
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
save: open managers finish it as the interpreter begins to exit
(:func:`jaxzero.checkpoint.hygiene.finish_saves`).

**Reading without a manager.** ``jaxzero export`` and ``jaxzero sample`` read one
checkpoint through :func:`complete_steps`, :func:`read_metadata`, :func:`read_extra`
and :class:`LeafReader` (one leaf at a time, on the host), all on orbax's public
handlers, reading none of its files by hand: this module is the one place that knows
how a checkpoint is laid out.
"""

from jaxzero.checkpoint.format import (
    FIELDS,
    FORMAT,
    ITEMS,
    CheckpointError,
    CheckpointWriteError,
    fingerprints,
    has_ema,
    host_fingerprint,
    leaf_names,
    metadata,
    nest,
)
from jaxzero.checkpoint.hygiene import host_reader_process
from jaxzero.checkpoint.manager import CheckpointManager, write_cause
from jaxzero.checkpoint.reader import (
    NO_EMA,
    LeafReader,
    complete_steps,
    is_step_dir,
    param_entries,
    read_extra,
    read_metadata,
)

__all__ = [
    "FIELDS",
    "FORMAT",
    "ITEMS",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointWriteError",
    "LeafReader",
    "NO_EMA",
    "complete_steps",
    "fingerprints",
    "has_ema",
    "host_fingerprint",
    "host_reader_process",
    "is_step_dir",
    "leaf_names",
    "metadata",
    "nest",
    "param_entries",
    "read_extra",
    "read_metadata",
    "write_cause",
]
