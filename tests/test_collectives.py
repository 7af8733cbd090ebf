"""Each collective inside shard_map equals its plain numpy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import eigen_dots
from jax.sharding import PartitionSpec as P

import jaxzero
from jaxzero import collectives
from jaxzero.partition import leaf_layout

N = 8


def _per_device(fn, x_per_device, spec_in, spec_out):
    """Run ``fn`` on N devices; inputs and outputs stacked along a leading device dim."""
    mesh = jaxzero.make_mesh(N)
    f = jax.shard_map(
        lambda x: fn(x[0])[None],
        mesh=mesh,
        in_specs=P("data", *spec_in),
        out_specs=P("data", *spec_out),
        check_vma=False,
    )
    return list(np.asarray(jax.jit(f)(np.stack(x_per_device))))


@pytest.mark.parametrize("shape", [(16, 8), (37, 53), (13,)])
def test_gather_and_reduce_scatter_match_references(shape):
    lay = leaf_layout("w", shape, N, min_shard_size=1)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(N)]

    scattered = _per_device(lambda g: collectives.reduce_scatter(g, lay), grads, (), ())
    want = collectives.reference_reduce_scatter(grads, lay)
    for got, ref in zip(scattered, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

    gathered = _per_device(lambda s: collectives.gather(s, lay), want, (), ())
    for got, ref in zip(gathered, collectives.reference_gather(want, lay), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_one_layer_of_a_stacked_leaf_pads_and_unpads_its_own_dims():
    """``offset=1``: the scan has indexed the layer dim away; the sharded dim moves left."""
    lay = leaf_layout("w", (3, 13, 5), N, stacked="w", min_shard_size=1)
    one = dataclasses.replace(lay, shape=lay.shape[1:], dim=lay.dim - 1)  # a layer's own layout
    assert lay.dim == 1 and lay.padded_shape == (3, 16, 5)
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(one.shape).astype(np.float32) for _ in range(N)]
    scattered = _per_device(lambda g: collectives.reduce_scatter(g, lay, offset=1), grads, (), ())
    want = collectives.reference_reduce_scatter(grads, one)
    for got, ref in zip(scattered, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    gathered = _per_device(lambda s: collectives.gather(s, lay, offset=1), want, (), ())
    for got, ref in zip(gathered, collectives.reference_gather(want, one), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_all_reduce():
    lay = leaf_layout("w", (37, 53), N)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(lay.shape).astype(np.float32) for _ in range(N)]
    summed = _per_device(collectives.all_reduce, grads, (), ())
    for got, ref in zip(summed, collectives.reference_all_reduce(grads), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", ["all_reduce", "reduce_scatter"])
def test_dot_barrier_keeps_the_weight_gradient_dot_fused(reduce):
    """The gradient of ``x @ w`` (tokens x features) handed straight to a collective: XLA
    folds autodiff's transpose into the dot and XLA:CPU runs it with Eigen, left outside
    any fusion; through :func:`collectives.dot_barrier` it stays a fused kernel."""
    mesh = jaxzero.make_mesh(2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 8, 32)).astype(np.float32)  # B x S x D
    w = rng.standard_normal((32, 48)).astype(np.float32)
    lay = leaf_layout("w", w.shape, 2)
    red = {
        "all_reduce": collectives.all_reduce,
        "reduce_scatter": lambda g: collectives.reduce_scatter(g, lay),
    }[reduce]
    out_spec = P() if reduce == "all_reduce" else P("data")

    def step(barrier):
        def local(x, w):
            g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
            return red(collectives.dot_barrier(g) if barrier else g)

        return jax.jit(
            jax.shard_map(
                local, mesh=mesh, in_specs=(P("data"), P()), out_specs=out_spec, check_vma=False
            )
        )

    texts = {b: step(b).lower(x, w).compile().as_text() for b in (True, False)}
    assert (eigen_dots(texts[True]), eigen_dots(texts[False])) == (0, 1)
    np.testing.assert_allclose(step(True)(x, w), step(False)(x, w), rtol=1e-5, atol=1e-5)
    for shape in [(5,), (3, 4, 5)]:  # only 2-D leaves are touched
        y = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
        assert collectives.dot_barrier(y) is y


@pytest.mark.unit
def test_dot_gradients_finds_the_weight_gradients():
    """The barrier goes where a gradient may be a dot's transpose: a weight (also through a
    bf16 cast, tied to an embedding, or inside a scan, which is not looked into), not an
    embedding's scatter-add, a bias, or a leaf the loss does not use."""

    def loss(p, t):
        h = p["emb"][t].astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16) + p["b"]
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h + p["tied"][t], p["stack"])
        return jnp.sum(h @ p["tied"].T)

    p = {
        "emb": jnp.ones((10, 4)),
        "w": jnp.ones((4, 6)),
        "b": jnp.ones((6,)),
        "stack": jnp.ones((2, 6, 6)),
        "tied": jnp.ones((10, 6)),
        "unused": jnp.ones((3, 3)),
    }
    tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    got = collectives.dot_gradients(jax.grad(loss), p, tokens)
    want = dict(emb=False, w=True, b=False, stack=True, tied=True, unused=False)
    assert got == want


def test_packed_collectives_match_per_leaf():
    """One all-gather / reduce-scatter for a layer equals one per leaf."""
    lays = [
        leaf_layout("a", (37, 53), N),
        leaf_layout("b", (16,), N, min_shard_size=1),
        leaf_layout("c", (5, 7, 9), N, min_shard_size=1),
    ]
    rng = np.random.default_rng(2)
    grads = [[rng.standard_normal(lay.shape).astype(np.float32) for lay in lays] for _ in range(N)]
    mesh = jaxzero.make_mesh(N)

    def run(fn, per_device, specs_in, specs_out):
        f = jax.shard_map(
            lambda *xs: [y[None] for y in fn([x[0] for x in xs])],
            mesh=mesh,
            in_specs=tuple(P("data") for _ in specs_in),
            out_specs=[P("data") for _ in specs_out],
            check_vma=False,
        )
        stacked = [np.stack([d[i] for d in per_device]) for i in range(len(specs_in))]
        return [np.asarray(o) for o in jax.jit(f)(*stacked)]

    packed = run(lambda gs: collectives.reduce_scatter_packed(gs, lays, [0] * 3), grads, lays, lays)
    for i, lay in enumerate(lays):
        want = collectives.reference_reduce_scatter([g[i] for g in grads], lay)
        np.testing.assert_allclose(packed[i], np.stack(want), rtol=1e-5, atol=1e-5)
    shards = [[packed[i][d] for i in range(3)] for d in range(N)]
    gathered = run(lambda vs: collectives.gather_packed(vs, lays, [0] * 3), shards, lays, lays)
    for i, lay in enumerate(lays):
        want = collectives.reference_gather([s[i] for s in shards], lay)
        np.testing.assert_allclose(gathered[i], np.stack(want), rtol=1e-6)


@pytest.mark.parametrize("bucket_bytes, n_buckets", [(0, 3), (8448, 2), (1 << 30, 1)])
def test_bucketed_collectives_match_references(bucket_bytes, n_buckets):
    """Stages 1-2 pack a tree into buckets: same values, one collective per bucket.

    Three f32 sharded leaves (1,280, 7,168 and 768 bytes padded; the last sharded on
    dim 1), one bf16 leaf (its own
    dtype, its own collective) and one replicated leaf (all-reduced, never packed).
    """
    mesh = jaxzero.make_mesh(N)
    shapes = [(25, 10), (56, 32), (3, 64), (64, 3), (3,)]
    dtypes = [np.float32, np.float32, np.float32, jnp.bfloat16, np.float32]
    lays = [leaf_layout(str(i), s, N, min_shard_size=16) for i, s in enumerate(shapes)]
    assert [lay.dim for lay in lays] == [0, 0, 1, 0, None]
    rng = np.random.default_rng(3)
    grads = [
        [rng.standard_normal(s).astype(dt) for s, dt in zip(shapes, dtypes, strict=True)]
        for _ in range(N)
    ]

    def run(fn, per_device):
        f = jax.jit(
            jax.shard_map(
                lambda *xs: [y[None] for y in fn([x[0] for x in xs])],
                mesh=mesh,
                in_specs=tuple(P("data") for _ in lays),
                out_specs=[P("data") for _ in lays],
                check_vma=False,
            )
        )
        stacked = [np.stack([d[i] for d in per_device]) for i in range(len(lays))]
        return [np.asarray(o, np.float32) for o in f(*stacked)], f.lower(*stacked).compile()

    scattered, rs = run(
        lambda gs: collectives.reduce_scatter_buckets(gs, lays, bucket_bytes), grads
    )
    for i, lay in enumerate(lays):
        want = collectives.reference_reduce_scatter(
            [np.asarray(g[i], np.float32) for g in grads], lay
        )
        np.testing.assert_allclose(
            scattered[i],
            np.stack(want),
            rtol=2e-2 if i == 3 else 1e-5,
            atol=0.1 if i == 3 else 1e-5,
        )
    shards = [[scattered[i][d].astype(dtypes[i]) for i in range(len(lays))] for d in range(N)]
    gathered, ag = run(lambda vs: collectives.gather_buckets(vs, lays, bucket_bytes), shards)
    for i, lay in enumerate(lays):
        want = collectives.reference_gather([np.asarray(s[i], np.float32) for s in shards], lay)
        np.testing.assert_array_equal(gathered[i], np.stack(want))

    # the f32 leaves in n_buckets collectives, the bf16 leaf in one more
    count = lambda compiled, op: sum(
        f" {op}(" in line or f" {op}-start(" in line for line in compiled.as_text().splitlines()
    )
    assert count(rs, "reduce-scatter") == n_buckets + 1
    assert count(ag, "all-gather") == n_buckets + 1
    assert count(rs, "all-reduce") == 1
