"""Named aliases for the pytrees the core passes around.

A pytree's type cannot say its structure (that is the model's), so each is ``Any`` to
the checker, as optax's ``Params`` and chex's ``ArrayTree`` are; the names say which
tree a function takes and returns, and ``grep`` finds them.
"""

from __future__ import annotations

from typing import Any, TypeAlias

Params: TypeAlias = Any
"""The model's params: a pytree of arrays (or ``jax.ShapeDtypeStruct`` for shapes)."""

Layouts: TypeAlias = Any
"""A pytree of :class:`~jaxzero.LeafLayout` with the params' structure."""

OptState: TypeAlias = Any
"""An optax optimizer state (or its layout tree, with the same structure)."""

Batch: TypeAlias = Any
"""A batch: a pytree of arrays whose leading dim is the batch (global or this process's rows)."""

Specs: TypeAlias = Any
"""A pytree of ``PartitionSpec`` (for the params, or a ``TrainState`` of them)."""

Shardings: TypeAlias = Any
"""A pytree of ``NamedSharding`` (for the params, or a ``TrainState`` of them)."""

Metrics: TypeAlias = dict[str, Any]
"""A step's metrics: ``{"loss", "grad_norm"}`` and, as the loss gives them, ``"tokens"`` and
``"aux"``."""
