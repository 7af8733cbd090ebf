"""Tensor and sequence parallelism's collectives (jaxzero.tensor_parallel): each against its
numpy reference, and Megatron's blocks built from them (a column- then row-parallel MLP,
attention split by heads, with and without sequence parallelism, the vocabulary-parallel
cross-entropy) against the unsharded computation, forward and gradients, on 2-D meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxzero import tensor_parallel as tp
from jaxzero.accounting.comm import collectives_from_hlo

B, S, D, F, V = 4, 8, 16, 32, 24


def _mesh(model: int) -> Mesh:
    devices = np.array(jax.devices()[:8]).reshape(8 // model, model)
    return Mesh(devices, ("data", "model"))


def _sharded(f, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False))  # fmt: skip  # as jaxzero's step runs


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, S, D)).astype(np.float32)
    w1 = (rng.normal(size=(D, F)) / np.sqrt(D)).astype(np.float32)
    w2 = (rng.normal(size=(F, D)) / np.sqrt(F)).astype(np.float32)
    return x, w1, w2


def _mlp(x, w1, w2):
    return jax.nn.gelu(x @ w1) @ w2


def _close(a, b, tol=1e-5):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


# ------------------------------------------------------------ each against its reference


@pytest.mark.parametrize("model", [2, 4])
def test_each_collective_and_its_backward_equal_the_numpy_reference(model):
    mesh = _mesh(model)
    rng = np.random.default_rng(1)
    per = [rng.normal(size=(2, S, 3)).astype(np.float32) for _ in range(model)]
    stacked = np.concatenate(per, axis=0)  # device i's array is rows [2i, 2i + 2)
    spec = P("model")

    def vjp_of(f):
        def run(x, g):
            return jax.vjp(f, x)[1](g)[0]

        return _sharded(run, mesh, (spec, spec), spec)

    got = vjp_of(lambda x: tp.copy_to(x))(stacked, stacked)
    _close(np.split(np.asarray(got), model), tp.reference_copy_to_grad(per))
    gathered = _sharded(lambda x: tp.gather_seq(x, 1), mesh, (spec,), spec)(stacked)
    _close(np.split(np.asarray(gathered), model), tp.reference_gather_seq(per))
    whole = [np.concatenate([p] * model, axis=1) for p in per]  # each device's whole sequence
    scattered = _sharded(lambda x: tp.scatter_seq(x, 1), mesh, (spec,), spec)(
        np.concatenate(whole, axis=0)
    )
    _close(np.split(np.asarray(scattered), model), tp.reference_scatter_seq(whole))
    # each one's backward is the other's forward
    back = vjp_of(lambda x: tp.gather_seq(x, 1))(stacked, np.concatenate(whole, axis=0))
    _close(np.split(np.asarray(back), model), tp.reference_scatter_seq(whole))
    back = vjp_of(lambda x: tp.reduce_from(x))(stacked, stacked)
    _close(back, stacked)  # identity backward


# ------------------------------------------------------------ blocks against one device


@pytest.mark.parametrize("model", [2, 8])
@pytest.mark.parametrize("sequence", [False, True])
def test_megatron_mlp_equals_the_unsharded_block(model, sequence):
    """Column- then row-parallel over ``model``, the batch over ``data``: the output and
    the gradients of the input and both weights equal one device's (fp32, 1e-5); with
    sequence parallelism the block takes and gives each device's slice of the sequence."""
    x, w1, w2 = _data()
    mesh = _mesh(model)

    def loss(x, w1, w2):
        return jnp.sum(_mlp(x, w1, w2) ** 2)

    def block(x, w1, w2):
        if sequence:
            return tp.scatter_seq(jax.nn.gelu(tp.gather_seq(x, 1) @ w1) @ w2, 1)
        return tp.reduce_from(jax.nn.gelu(tp.copy_to(x) @ w1) @ w2)

    def sharded_grads(x, w1, w2):
        # each device differentiates its own copy of the loss of its tokens (every token's
        # with model replicas, its slice's with sequence parallelism): no collective but
        # the block's, then the weights' gradients summed over the batch's devices
        g = jax.grad(lambda *a: jnp.sum(block(*a) ** 2), argnums=(0, 1, 2))(x, w1, w2)
        return g[0], *(jax.lax.psum(w, "data") for w in g[1:])

    x_spec = P("data", "model") if sequence else P("data")
    specs = (x_spec, P(None, "model"), P("model", None))
    out = _sharded(block, mesh, specs, x_spec)(x, w1, w2)
    _close(out, _mlp(x, w1, w2))
    grads = _sharded(sharded_grads, mesh, specs, specs)(x, w1, w2)
    _close(grads, jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2))


def _attention(x, wq, wk, wv, wo, heads, kv_heads):
    b, s, _ = x.shape
    q = (x @ wq).reshape(b, s, heads, -1)
    k = (x @ wk).reshape(b, s, kv_heads, -1)
    v = (x @ wv).reshape(b, s, kv_heads, -1)
    k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)
    o = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, axis=-1), v)
    return o.reshape(b, s, -1) @ wo


@pytest.mark.parametrize("model,kv_heads", [(2, 2), (4, 4), (4, 2)])
def test_attention_split_by_heads_equals_the_unsharded_layer(model, kv_heads):
    """q by heads, k and v by key/value heads where they divide (replicated where they do
    not: GQA 4 query heads over 2 at model=4), o by rows: equal to one device, forward
    and gradients."""
    heads, hd = 4, 4
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, S, D)).astype(np.float32)
    w = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)  # noqa: E731
    wq, wk, wv, wo = w(D, heads * hd), w(D, kv_heads * hd), w(D, kv_heads * hd), w(heads * hd, D)
    split_kv = kv_heads % model == 0
    mesh = _mesh(model)

    def layer(x, wq, wk, wv, wo):
        x = tp.copy_to(x)
        local_heads = heads // model
        if split_kv:
            out = _attention(x, wq, wk, wv, wo, local_heads, kv_heads // model)
        else:  # each device keeps every k/v head and uses its query heads' ones
            i = jax.lax.axis_index("model")
            group = heads // kv_heads
            first = i * local_heads // group
            n = max(local_heads // group, 1)
            hd_ = wk.shape[1] // kv_heads
            wk = jax.lax.dynamic_slice_in_dim(wk, first * hd_, n * hd_, axis=1)
            wv = jax.lax.dynamic_slice_in_dim(wv, first * hd_, n * hd_, axis=1)
            out = _attention(x, wq, wk, wv, wo, local_heads, n)
        return tp.reduce_from(out)

    kv_spec = P(None, "model") if split_kv else P()
    specs = (P("data"), P(None, "model"), kv_spec, kv_spec, P("model", None))
    args = (x, wq, wk, wv, wo)
    ref = lambda *a: _attention(*a, heads, kv_heads)  # noqa: E731
    _close(_sharded(layer, mesh, specs, P("data"))(*args), ref(*args))

    def sharded_grads(*a):
        g = jax.grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=range(5))(*a)
        # weights split by model: their rows' sums over data; replicated k/v weights
        # (GQA heads that do not divide): each device's heads' part, summed over both
        kv = ("data",) if split_kv else ("data", "model")
        return g[0], *(
            jax.lax.psum(w, kv if j in (2, 3) else "data") for j, w in enumerate(g[1:], 1)
        )

    grads = _sharded(sharded_grads, mesh, specs, specs)(*args)
    want = jax.grad(lambda *a: jnp.sum(ref(*a) ** 2), argnums=range(5))(*args)
    _close(grads, want)


@pytest.mark.parametrize("model", [2, 8])
def test_vocab_parallel_cross_entropy_equals_the_whole_vocabulary(model):
    """Each device's slice of the vocabulary: the loss equals the numpy reference and
    optax's on the whole logits, and its gradient jax.grad's, with at most 3 all-reduces
    of B x S values forward (XLA may combine them) and none backward."""
    import optax

    rng = np.random.default_rng(3)
    logits = (3 * rng.normal(size=(B, S, V))).astype(np.float32)
    targets = rng.integers(0, V, (B, S)).astype(np.int32)
    mesh = _mesh(model)
    specs = (P("data", None, "model"), P("data"))
    loss = _sharded(tp.vocab_cross_entropy, mesh, specs, P("data"))(logits, targets)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    _close(loss, want)
    ref = tp.reference_vocab_cross_entropy(np.split(logits, model, axis=-1), targets)
    _close(loss, ref)

    def mean(z, t):  # each device's rows' share of the mean: no collective
        return jnp.sum(tp.vocab_cross_entropy(z, t)) / (B * S)

    step = _sharded(jax.grad(mean), mesh, specs, specs[0])
    grad = step(logits, targets)
    _close(grad, jax.grad(lambda z: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(z, targets)))(logits))  # fmt: skip
    ops = collectives_from_hlo(step.lower(logits, targets).compile().as_text()).collectives
    assert {op.kind for op in ops} == {"all-reduce"}  # never the logits gathered
    sizes = [sum(b.nbytes for b in op.buffers) for op in ops]
    assert len(ops) <= 3 and max(sizes) <= B // (8 // model) * S * 4, ops  # B x S values


def test_the_mlp_sends_one_all_reduce_forward_and_one_backward():
    """Megatron's count: a TP block's step holds two all-reduces of B x S x D values (the
    output's forward, the input's gradient backward) and no other collective over
    ``model``."""
    x, w1, w2 = _data()
    mesh = _mesh(4)

    def grads(x, w1, w2):
        def f(x, w1, w2):
            out = tp.reduce_from(jax.nn.gelu(tp.copy_to(x) @ w1) @ w2)
            return jnp.sum(out**2)

        return jax.grad(f, argnums=(0, 1, 2))(x, w1, w2)

    specs = (P("data"), P(None, "model"), P("model", None))
    text = _sharded(grads, mesh, specs, specs).lower(x, w1, w2).compile().as_text()
    ops = collectives_from_hlo(text).collectives
    rows = B // 2  # the data axis has 2 devices
    assert [op.kind for op in ops] == ["all-reduce"] * 2, ops
    assert [sum(b.nbytes for b in op.buffers) for op in ops] == [rows * S * D * 4] * 2
    assert {op.group_size for op in ops} == {4}  # over model
