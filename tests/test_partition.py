"""Layouts: any leaf shape gets a dim to shard, padding, or replication; rules override."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxzero.partition import balance, layouts_for, leaf_layout, pad, unpad


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize(
    "shape", [(), (3,), (37, 53), (64, 32), (5, 7, 9), (1000, 3), (8, 1), (129,)]
)
def test_every_shape_gets_a_valid_layout(shape, n):
    lay = leaf_layout("x", shape, n, min_shard_size=1)
    if lay.dim is None:
        assert lay.padded_shape == shape and int(np.prod(shape)) < n or shape == ()
        return
    assert lay.padded_shape[lay.dim] % n == 0
    assert lay.shard_shape[lay.dim] * n == lay.padded_shape[lay.dim]
    # the chosen dim wastes no more padding than any other dim would
    for d in range(len(shape)):
        padded = -(-shape[d] // n) * n
        assert lay.padded_size <= int(np.prod(shape)) // shape[d] * padded


def test_divisible_dim_is_preferred_and_no_padding():
    lay = leaf_layout("w", (37, 64), 8)
    assert lay.dim == 1 and lay.padded_shape == (37, 64)


def test_ties_go_to_the_first_dim_for_contiguous_slices():
    assert leaf_layout("w", (64, 128), 8).dim == 0
    assert leaf_layout("w", (16, 64, 128), 8, stacked=r"^w").dim == 1


def test_small_leaves_are_replicated():
    assert leaf_layout("b", (11,), 8).dim is None
    assert leaf_layout("s", (), 8).dim is None
    assert leaf_layout("b", (128,), 8).dim == 0


def test_stacked_leading_dim_is_never_sharded():
    lay = leaf_layout("blocks/w", (64, 8, 8), 8, stacked=r"^blocks/")
    assert lay.dim != 0
    assert leaf_layout("blocks/w", (64,), 8, stacked=r"^blocks/").dim is None


def test_rules_override_the_default():
    rules = [(r"emb", P(None, "data")), (r"norm", "replicate"), (r"head", 0)]
    assert leaf_layout("emb", (64, 32), 8, rules=rules).dim == 1
    assert leaf_layout("final_norm/scale", (4096,), 8, rules=rules).dim is None
    assert leaf_layout("head", (64, 32), 8, rules=rules).dim == 0
    with pytest.raises(ValueError, match="out of range"):
        leaf_layout("head", (64,), 8, rules=[("head", 3)])
    with pytest.raises(ValueError, match="exactly once"):
        leaf_layout("head", (64,), 8, rules=[("head", P(None))])


def test_pad_unpad_round_trip():
    lay = leaf_layout("w", (37, 53), 8)
    x = np.arange(37 * 53, dtype=np.float32).reshape(37, 53)
    assert pad(x, lay).shape == lay.padded_shape
    np.testing.assert_array_equal(unpad(pad(x, lay), lay), x)


def test_layouts_follow_the_tree_and_paths():
    tree = {"a": {"kernel": np.zeros((16, 16))}, "b": [np.zeros(3)]}
    lays = layouts_for(tree, 8)
    assert lays["a"]["kernel"].path == "a/kernel" and lays["b"][0].path == "b/0"
    assert balance(lays) == 1.0  # 16 rows over 8 devices, and 3 replicated elements each
    # 53 columns padded to 56: seven devices hold 7 x 37 real elements, the last 4 x 37; with
    # the 3 replicated ones each, the largest (262) over the mean ((37 * 53 + 8 * 3) / 8)
    padded = layouts_for({"w": np.zeros((37, 53)), "b": [np.zeros(3)]}, 8)
    assert padded["w"].dim == 1
    assert balance(padded) == pytest.approx((7 * 37 + 3) / ((37 * 53 + 8 * 3) / 8), rel=1e-12)
