"""Which params train, and the two trees a state keeps them in.

A frozen param gets no gradient, so no gradient collective, no fp32 master and no
optimizer state: the state stores it once, in the dtype it was given (a bf16 base
stays bf16), in a tree of its own (``TrainState.frozen``). The trainable tree and the
frozen tree both keep the user's structure; each holds ``optax.MaskedNode()`` (an empty
node, so every ``jax.tree`` function skips it, and optax's own optimizers keep it as it
is) where the other tree has the leaf. :func:`merge` puts them back together, so a loss
function always sees the whole params tree.

``trainable`` (``Engine(trainable=...)``) is a predicate on a leaf's path
(``"layers/self_attn/q_proj/lora_A"``, :func:`jaxzero.partition.path_str`) or a pytree of
bools with the params' structure; None trains everything.

Example:
  >>> import jax.numpy as jnp
  >>> params = {"w": jnp.ones((4, 4)), "lora": {"a": jnp.zeros(2)}}
  >>> mask = mask_of(lambda path: "lora" in path, params)
  >>> train, frozen = split(params, mask)
  >>> [x.shape for x in jax.tree.leaves(train)]
  [(2,)]
  >>> merge(mask, train, frozen)["w"].shape
  (4, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from optax import MaskedNode

from jaxzero.partition import path_str
from jaxzero.types import Params

__all__ = ["MaskedNode", "Trainable", "has_frozen", "is_masked", "mask_of", "merge", "split"]

Trainable = Callable[[str], bool] | Params | None


def is_masked(x: object) -> bool:
    """Whether ``x`` is the placeholder of a leaf the other tree holds."""
    return isinstance(x, MaskedNode)


def mask_of(trainable: Trainable, params: Params) -> Params:
    """A bool per leaf of ``params``: True where it trains.

    Raises ``ValueError`` (one line) for a bool tree of another structure, a predicate
    that returns a non-bool, or a mask that trains nothing.
    """
    paths = jax.tree_util.tree_leaves_with_path(params)
    treedef = jax.tree.structure(params)
    if trainable is None:
        mask = [True] * len(paths)
    elif callable(trainable):
        mask = []
        for path, _ in paths:
            on = trainable(path_str(path))
            if not isinstance(on, bool):
                raise ValueError(
                    f"trainable({path_str(path)!r}) returned {on!r}: the predicate must "
                    "return True (trains) or False (frozen)"
                )
            mask.append(on)
    else:
        theirs = jax.tree.structure(trainable)
        if str(theirs) != str(treedef):
            raise ValueError(
                "trainable must be a predicate on leaf paths or a tree of bools with the "
                f"params' structure; the params are {treedef}, trainable is {theirs}"
            )
        mask = [bool(x) for x in jax.tree.leaves(trainable)]
    if paths and not any(mask):
        raise ValueError(
            f"trainable freezes all {len(paths)} params: nothing would train "
            f"(first leaves: {', '.join(path_str(p) for p, _ in paths[:3])})"
        )
    return jax.tree.unflatten(treedef, mask)


def split(tree: Any, mask: Params) -> tuple[Any, Any]:
    """``(trainable, frozen)``: ``tree`` twice, each with ``MaskedNode`` where the other
    holds the leaf. ``mask``'s structure is a prefix of ``tree``'s (bools per leaf)."""
    pick = lambda want: jax.tree.map(lambda on, x: x if on == want else MaskedNode(), mask, tree)
    return pick(True), pick(False)


def merge(mask: Params, trainable: Any, frozen: Any) -> Any:
    """The whole tree again: each leaf from whichever of the two holds it. The leaves
    may be any pytrees (the engine's ``Stored`` views): ``mask`` says where each is."""
    if frozen is None:
        return trainable
    return jax.tree.map(lambda on, a, b: a if on else b, mask, trainable, frozen)


def has_frozen(mask: Params) -> bool:
    """Whether any leaf of a :func:`mask_of` mask is frozen."""
    return not all(jax.tree.leaves(mask))
