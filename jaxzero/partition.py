"""How each parameter leaf is stored: which dimension is sharded, and how it is padded.

ZeRO shards every model state over the ``data`` axis. A leaf is sharded along one
dimension; when no dimension divides by N it is padded (zeros that gradients and
AdamW leave at zero) so every device holds an equal slice, and leaves too small to
be worth a collective are replicated. The same :class:`LeafLayout` serves the
working params, the fp32 master copy, the gradients and every param-shaped leaf of
the optimizer state, so one function decides the whole policy.

With tensor parallelism a leaf may also be split over the ``model`` axis along its
``model_dim`` (a column- or row-parallel weight, :mod:`jaxzero.tensor_parallel`), a
split the model asks for by a rule naming ``"model"``. ZeRO then shards each device's
tensor-parallel slice: :meth:`LeafLayout.local` is that slice's layout, the one the
step's per-device code (collectives, hooks) works on; the global layout is what the
optimizer, the checkpoints and the specs see.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxzero.mesh import DATA, MODEL  # the axes' names, where no mesh is at hand
from jaxzero.types import Layouts, Params

REPLICATE = "replicate"
Rule = tuple[str, "int | P | str"]  # (regex on the leaf path, dim | spec | "replicate")
Leaf = TypeVar("Leaf", np.ndarray, jax.Array)  # pad and unpad give back what they take


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Storage of one leaf: logical ``shape``, sharded ``dim`` (None: replicated), padding."""

    path: str
    shape: tuple[int, ...]
    dim: int | None
    num_shards: int
    model_dim: int | None = None  # split over the model axis (tensor parallelism), unpadded
    model_shards: int = 1

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    @property
    def padded_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        s = list(self.shape)
        s[self.dim] = -(-s[self.dim] // self.num_shards) * self.num_shards
        return tuple(s)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Shape of the slice one device holds."""
        s = list(self.padded_shape)
        if self.dim is not None:
            s[self.dim] //= self.num_shards
        if self.model_dim is not None:
            s[self.model_dim] //= self.model_shards
        return tuple(s)

    @property
    def tensor_parallel(self) -> bool:
        """Whether the leaf is split over the model axis (else every model device holds
        the same copy, and its gradient is summed over the axis: the step's rule)."""
        return self.model_dim is not None

    def local(self) -> LeafLayout:
        """The layout of one model device's slice (itself without tensor parallelism):
        what the per-device step gathers, reduces and pads."""
        if self.model_dim is None or self.model_shards == 1:
            return self
        s = list(self.shape)
        s[self.model_dim] //= self.model_shards
        return dataclasses.replace(self, shape=tuple(s), model_shards=1)

    def working_spec(self) -> P:
        """PartitionSpec of the leaf whole over ``data`` (stages 0-2's working params):
        split over ``model`` alone, or replicated."""
        if self.model_dim is None:
            return P()
        return P(*([None] * self.model_dim), MODEL)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def padded_size(self) -> int:
        return math.prod(self.padded_shape)

    @property
    def elements_per_device(self) -> int:
        return math.prod(self.shard_shape)

    def spec(self, axes: str | tuple[str, ...] = DATA) -> P:
        """PartitionSpec of the stored (padded) array, its dim split over ``axes`` (hpZ's
        master: ``(DATA, REPLICA)``, every device) and its ``model_dim`` over ``model``
        (the same dim: ``model`` major, each model device's slice split over ``axes``)."""
        if self.dim is None:
            return self.working_spec()
        entries: list[Any] = [None] * len(self.shape)
        entries[self.dim] = axes
        if self.model_dim is not None:
            named = (axes,) if isinstance(axes, str) else tuple(axes)
            entries[self.model_dim] = (MODEL, *named) if self.model_dim == self.dim else MODEL
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)


def path_str(path: Sequence[object]) -> str:
    """A leaf's name: its key path joined by ``/`` (``blocks/0/attn/kernel``).

    The one naming of leaves: layouts, rules, messages, checkpoint leaves and the
    exported safetensors all use it, so a name read in one place finds the leaf in
    another. ``path`` holds JAX key entries (``DictKey``, ``SequenceKey``,
    ``GetAttrKey``, ...) or plain keys (``"blocks"``, ``0``), as a checkpoint's
    metadata and ``nnx`` flat states record them.

    Example:
      >>> path_str(["blocks", 0, "kernel"])
      'blocks/0/kernel'
    """
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def default_dim(shape: Sequence[int], n: int, skip_leading: int = 0) -> int:
    """The dimension to shard: least padding, then the first.

    The first (outermost) dim makes each device's slice one contiguous block, so
    gathers and reduce-scatters move whole rows and packing needs no transpose
    (measured 2-6% faster per step than sharding the last dim on XLA:CPU).
    ``skip_leading`` excludes stacked layer dimensions, which a scan slices away.
    """
    candidates = range(skip_leading, len(shape))

    def cost(d: int) -> tuple[int, int]:
        padded = -(-shape[d] // n) * n
        return (math.prod(shape) // shape[d] * padded, d)

    return min(candidates, key=cost)


def _named(rule: P, axis: str) -> list[int]:
    return [i for i, a in enumerate(rule) if a == axis or (isinstance(a, tuple) and axis in a)]


def _model_dim(rule: int | P | str, path: str, ndim: int) -> int | None:
    """The dim a rule splits over the model axis (None: none)."""
    if not isinstance(rule, P):
        return None
    dims = _named(rule, MODEL)
    if len(dims) > 1:
        raise ValueError(f"rule for {path!r}: spec {rule} names {MODEL!r} more than once")
    if dims and dims[0] >= ndim:
        raise ValueError(f"rule for {path!r}: spec {rule} is longer than the {ndim}-d leaf")
    return dims[0] if dims else None


def _rule_dim(rule: int | P | str, path: str, ndim: int) -> int | None:
    if rule == REPLICATE or rule is None:
        return None
    if isinstance(rule, P):
        dims = _named(rule, DATA)
        if len(dims) != 1:
            raise ValueError(f"rule for {path!r}: spec {rule} must name {DATA!r} exactly once")
        dim = dims[0]
    elif isinstance(rule, int) and not isinstance(rule, bool):
        dim = rule
    else:
        raise TypeError(
            f"rule for {path!r} must be a dim, a PartitionSpec or 'replicate', got {rule!r}"
        )
    if not -ndim <= dim < ndim:
        raise ValueError(f"rule for {path!r}: dim {dim} out of range for a {ndim}-d leaf")
    return dim % ndim


def leaf_layout(
    path: str,
    shape: Sequence[int],
    num_shards: int,
    *,
    rules: Sequence[Rule] = (),
    stacked: str | None = None,
    min_shard_size: int = 64,
    model_shards: int = 1,
) -> LeafLayout:
    """Layout of one leaf: user rules first, then the default policy.

    Args:
      path: the leaf's ``a/b/c`` path, matched with ``re.search`` against rules.
      shape: the logical shape.
      num_shards: N, the size of the ``data`` axis.
      rules: ``(regex, dim | PartitionSpec | "replicate")``; the first match wins. A
        spec naming ``"model"`` splits that dim over the model axis (tensor
        parallelism; ignored when ``model_shards`` is 1); one naming ``"model"`` but not
        ``"data"`` leaves the ZeRO dim to the default policy.
      stacked: regex of paths whose leading dim stacks layers (never sharded).
      min_shard_size: smaller leaves are replicated: a collective costs more than
        the bytes saved.
      model_shards: the size of the ``model`` axis (1: no tensor parallelism).

    Example:
      >>> leaf_layout("w", (37, 53), 8).padded_shape
      (37, 56)
      >>> split = leaf_layout("w", (64, 48), 4, rules=[("w", P(None, "model"))], model_shards=2)
      >>> tuple(split.spec())  # rows sharded over data, columns split over model
      ('data', 'model')
    """
    shape = tuple(int(s) for s in shape)
    skip = 1 if stacked is not None and re.search(stacked, path) and shape else 0
    for pattern, rule in rules:
        if not re.search(pattern, path):
            continue
        mdim = _model_dim(rule, path, len(shape)) if model_shards > 1 else None
        if mdim is None:
            if isinstance(rule, P) and _named(rule, MODEL) and not _named(rule, DATA):
                # a model-only rule on a mesh without a model axis: the default policy
                return _default(path, shape, num_shards, skip, min_shard_size)
            return LeafLayout(path, shape, _rule_dim(rule, path, len(shape)), num_shards)
        if shape[mdim] % model_shards:
            raise ValueError(
                f"param {path!r} of shape {shape} is split over the model axis along dim "
                f"{mdim} ({shape[mdim]}), which {model_shards} devices do not divide: use a "
                "model axis that divides it (make_mesh(..., model=m))"
            )
        if isinstance(rule, P) and _named(rule, DATA):
            dim = _rule_dim(rule, path, len(shape))
        else:
            local = list(shape)
            local[mdim] //= model_shards
            dim = _default(path, tuple(local), num_shards, skip, min_shard_size).dim
        if dim == mdim and (shape[mdim] // model_shards) % num_shards:
            dim = None  # would pad inside each model slice: whole over data instead
        return LeafLayout(path, shape, dim, num_shards, mdim, model_shards)
    return _default(path, shape, num_shards, skip, min_shard_size)


def _default(
    path: str, shape: tuple[int, ...], num_shards: int, skip: int, min_shard_size: int
) -> LeafLayout:
    """The default policy: replicated when small, else the least padded dim."""
    if math.prod(shape) < max(min_shard_size, num_shards) or len(shape) == skip:
        return LeafLayout(path, shape, None, num_shards)
    return LeafLayout(path, shape, default_dim(shape, num_shards, skip), num_shards)


def layouts_for(
    params: Params,
    num_shards: int,
    *,
    rules: Sequence[Rule] = (),
    stacked: str | None = None,
    min_shard_size: int = 64,
    model_shards: int = 1,
) -> Layouts:
    """A pytree of :class:`LeafLayout` with the structure of ``params``."""

    # leaf: an array or a jax.ShapeDtypeStruct, anything np.shape reads
    def one(path: jax.tree_util.KeyPath, leaf: Any) -> LeafLayout:
        return leaf_layout(
            path_str(path),
            np.shape(leaf),
            num_shards,
            rules=rules,
            stacked=stacked,
            min_shard_size=min_shard_size,
            model_shards=model_shards,
        )

    return jax.tree_util.tree_map_with_path(one, params)


def local_layouts(layouts: Layouts) -> Layouts:
    """Each leaf's :meth:`LeafLayout.local`: the tree the per-device step works with."""
    return jax.tree.map(lambda lay: lay.local(), layouts, is_leaf=is_layout)


def is_layout(x: object) -> bool:
    return isinstance(x, LeafLayout)


def pad(x: Leaf, layout: LeafLayout, offset: int = 0) -> Leaf:
    """Zero-pad a logical leaf to its stored shape (numpy stays numpy, jax stays jax).

    The one padding of leaves: the engine, the step and the collectives all pad here.
    ``offset`` counts leading dims already indexed away (a scan over stacked layers):
    ``x`` is then ``layout.shape[offset:]``.
    """
    if layout.padded_shape == layout.shape:
        return x
    widths = [
        (0, p - s) for s, p in zip(layout.shape[offset:], layout.padded_shape[offset:], strict=True)
    ]
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def unpad(x: Leaf, layout: LeafLayout, offset: int = 0) -> Leaf:
    """The logical leaf inside a stored (padded) one; ``offset`` as in :func:`pad`."""
    if layout.padded_shape == layout.shape:
        return x
    return x[tuple(slice(0, s) for s in layout.shape[offset:])]


def balance(layouts: Layouts) -> float:
    """Largest per-device element count over the mean (1.0 = perfectly balanced).

    Sharded leaves put ``elements_per_device`` on every device; a padded leaf's last
    device holds padding, which is where imbalance comes from.
    """
    per_device = None
    for lay in jax.tree.leaves(layouts, is_leaf=is_layout):
        counts = np.full(lay.num_shards, lay.size if lay.dim is None else 0, dtype=np.int64)
        if lay.dim is not None:
            rest = lay.size // lay.shape[lay.dim]
            chunk = lay.padded_shape[lay.dim] // lay.num_shards
            for i in range(lay.num_shards):
                real = min(max(lay.shape[lay.dim] - i * chunk, 0), chunk)
                counts[i] = real * rest
        per_device = counts if per_device is None else per_device + counts
    if per_device is None:
        raise ValueError("balance needs at least one leaf layout, got none")
    return float(per_device.max() / per_device.mean())
