"""Gated DeltaNet (jaxzero.models.deltanet): the chunked gated delta rule equals the
token-by-token recurrence (outputs, final states and gradients; chunks that divide the
sequence and chunks that do not; grouped key heads; an initial state), packed documents
equal each document run alone, the causal conv1d equals a numpy loop and its cached
step the full conv, and everything equals transformers' pure-torch Qwen3.5 path
(tests/fixtures/deltanet/reference.npz, made by experiments/deltanet_reference.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.models import deltanet as dn

REFERENCE = Path(__file__).parent / "fixtures" / "deltanet" / "reference.npz"
TOL = {"rtol": 1e-5, "atol": 1e-5}
B, S, G, H, K, V = 2, 37, 2, 4, 8, 6  # 37: no chunk below divides it; G < H: grouped
# jitted once here: eager dispatch of every small op is most of the time otherwise
chunked = jax.jit(dn.gated_delta_rule, static_argnames="chunk")
recurrent = jax.jit(dn.recurrent_gated_delta_rule)


def _inputs(seed: int = 0, b: int = B, s: int = S) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    f = np.float32
    a = rng.normal(size=(b, s, H)).astype(f)
    g = dn.decay(jnp.asarray(a), jnp.log(jnp.linspace(0.5, 4.0, H)), jnp.full(H, 0.3))
    return {
        "q": jnp.asarray(rng.normal(size=(b, s, G, K)).astype(f)),
        "k": jnp.asarray(rng.normal(size=(b, s, G, K)).astype(f)),
        "v": jnp.asarray(rng.normal(size=(b, s, H, V)).astype(f)),
        "g": g,
        "beta": dn.beta_gate(jnp.asarray(rng.normal(size=(b, s, H)).astype(f))),
        "state": jnp.asarray(0.5 * rng.normal(size=(b, H, K, V)).astype(f)),
    }


def _args(x: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


@pytest.fixture(scope="module")
def data() -> dict[str, jax.Array]:
    return _inputs()


@pytest.fixture(scope="module")
def recurrence(data: dict[str, jax.Array]) -> tuple[np.ndarray, np.ndarray]:
    o, state = recurrent(*_args(data), data["state"])
    return np.asarray(o), np.asarray(state)


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_chunked_equals_recurrence(data, recurrence, chunk: int) -> None:
    """Chunks of 8 and 16 (37 = 4x8 + 5 = 2x16 + 5: the last one padded) and 64 (one
    chunk, no more than the sequence): outputs and final state to 1e-5 in fp32."""
    o, state = chunked(*_args(data), chunk=chunk, state_BxHxKxV=data["state"])
    assert o.shape == (B, S, H, V) and o.dtype == jnp.float32 and state.dtype == jnp.float32
    np.testing.assert_allclose(o, recurrence[0], **TOL)
    np.testing.assert_allclose(state, recurrence[1], **TOL)


def _grads(rule, x: dict[str, jax.Array], segment_ids=None) -> dict[str, np.ndarray]:
    """Gradients of a random projection of the outputs and final state w.r.t. every
    input and the initial state."""
    rng = np.random.default_rng(7)
    co = jnp.asarray(rng.normal(size=x["v"].shape).astype(np.float32))
    cs = jnp.asarray(rng.normal(size=x["state"].shape).astype(np.float32))

    def loss(p: dict[str, jax.Array]) -> jax.Array:
        o, state = rule(*_args(p), state_BxHxKxV=p["state"], segment_ids_BxS=segment_ids)
        return jnp.sum(o * co) + jnp.sum(state * cs)

    return {k: np.asarray(v) for k, v in jax.jit(jax.grad(loss))(x).items()}


def _assert_grads_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    # fp32: the two forms sum the same terms in other orders (and the chunked one through a
    # triangular system's inverse), so each gradient differs by a few ulps of its largest terms, not
    # of each entry (an entry that nearly cancels can be off relatively by much more):
    # 1e-5 of the array's largest magnitude, ~100 ulps at that scale
    for name, w in want.items():
        assert np.all(np.isfinite(got[name])), name
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_gradients_equal_recurrence(data) -> None:
    """jax.grad of the chunked form (chunk 8, the last chunk padded) equals jax.grad of
    the recurrence w.r.t. q, k, v, g, beta and the initial state."""
    got = _grads(lambda *a, **kw: dn.gated_delta_rule(*a, chunk=8, **kw), data)
    _assert_grads_close(got, _grads(dn.recurrent_gated_delta_rule, data))


# row 0: three documents, boundaries inside chunks of 8; row 1: a boundary at a chunk's
# start (16) and a one-token document at the end
SEGMENTS = np.array([[0] * 10 + [1] * 15 + [2] * 12, [5] * 16 + [6] * 20 + [7]], np.int32)


@pytest.fixture(scope="module")
def alone(data: dict[str, jax.Array]) -> tuple[np.ndarray, np.ndarray]:
    """Each document of each row through the recurrence on its own; the row's first
    document continues the initial state."""
    x = data
    o = np.zeros(x["v"].shape, np.float32)
    final = np.zeros(x["state"].shape, np.float32)
    for r, row in enumerate(SEGMENTS):
        bounds = [0, *np.flatnonzero(row[1:] != row[:-1]) + 1, len(row)]
        for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            part = [a[r : r + 1, lo:hi] for a in _args(x)]
            state = x["state"][r : r + 1] if i == 0 else None
            o_doc, s_doc = recurrent(*part, state)
            o[r, lo:hi] = o_doc[0]
            final[r] = s_doc[0]
    return o, final


@pytest.mark.parametrize("form", ["chunk8", "chunk16", "recurrent"])
def test_packed_documents_run_alone(data, alone, form: str) -> None:
    """With segment ids, the state restarts at each document's first token: outputs and
    final state equal each document run alone."""
    seg = jnp.asarray(SEGMENTS)
    if form == "recurrent":
        o, state = recurrent(*_args(data), data["state"], seg)
    else:
        o, state = chunked(
            *_args(data), chunk=int(form[5:]), state_BxHxKxV=data["state"], segment_ids_BxS=seg
        )
    want_o, want_state = alone
    np.testing.assert_allclose(o, want_o, **TOL)
    np.testing.assert_allclose(state, want_state, **TOL)


def test_packed_gradients_equal_recurrence(data) -> None:
    """The masks that cut the chunked form at documents keep its gradients finite and
    equal to the recurrence's (no -inf in the log-space sums)."""
    seg = jnp.asarray(SEGMENTS)
    got = _grads(lambda *a, **kw: dn.gated_delta_rule(*a, chunk=8, **kw), data, seg)
    _assert_grads_close(got, _grads(dn.recurrent_gated_delta_rule, data, seg))


def test_vmap_and_grouped_heads(data) -> None:
    """vmap over a leading axis equals a loop; a key head serves H/G consecutive value
    heads (repeat_interleave): G = 2 equals G = H with each key head repeated."""
    stacked = [jnp.stack([a, a[::-1]]) for a in _args(data)]
    o_v, s_v = jax.jit(jax.vmap(lambda *a: dn.gated_delta_rule(*a, chunk=16)))(*stacked)
    for i in range(2):
        o_i, s_i = chunked(*[a[i] for a in stacked], chunk=16)
        np.testing.assert_allclose(o_v[i], o_i, **TOL)
        np.testing.assert_allclose(s_v[i], s_i, **TOL)
    q, k, v, g, beta = _args(data)
    rep = [jnp.repeat(a, H // G, axis=2) for a in (q, k)]
    np.testing.assert_allclose(
        chunked(q, k, v, g, beta, chunk=16)[0],
        chunked(*rep, v, g, beta, chunk=16)[0],
        **TOL,
    )


def test_prefill_then_one_token_steps(data, recurrence) -> None:
    """Sampling's use: the chunked form over a prompt, then the recurrence one token at
    a time from its state, equals the whole sequence's outputs and final state."""
    p = 30
    args = _args(data)
    o_prompt, state = chunked(*[a[:, :p] for a in args], chunk=8, state_BxHxKxV=data["state"])
    outs = [o_prompt]
    for t in range(p, S):
        o_t, state = recurrent(*[a[:, t : t + 1] for a in args], state)
        outs.append(o_t)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), recurrence[0], **TOL)
    np.testing.assert_allclose(state, recurrence[1], **TOL)


def test_dtypes(data) -> None:
    """bf16 in: outputs in q's dtype (bf16), the state fp32, the math fp32 (the bf16
    result is the fp32 one rounded, not bf16 arithmetic's)."""
    args16 = [a.astype(jnp.bfloat16) for a in _args(data)]
    o16, s16 = chunked(*args16, chunk=16)
    o32, s32 = chunked(*[a.astype(jnp.float32) for a in args16], chunk=16)
    assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
    np.testing.assert_array_equal(o16, o32.astype(jnp.bfloat16))
    np.testing.assert_allclose(s16, s32, **TOL)
    y = dn.gated_rms_norm(args16[2], args16[2], jnp.ones(V, jnp.bfloat16), 1e-6)
    assert y.dtype == jnp.bfloat16


def test_refusals(data) -> None:
    q, k, v, g, beta = _args(data)
    with pytest.raises(ValueError, match="multiple"):
        dn.gated_delta_rule(q[:, :, :1].repeat(3, 2), k[:, :, :1].repeat(3, 2), v, g, beta)
    with pytest.raises(ValueError, match="state"):
        dn.recurrent_gated_delta_rule(q, k, v, g, beta, jnp.zeros((B, H, V, K)))


def _conv_loop(x: np.ndarray, w: np.ndarray, seg: np.ndarray | None = None) -> np.ndarray:
    b, s, c = x.shape
    width = w.shape[1]
    y = np.zeros_like(x)
    for r in range(b):
        for t in range(s):
            for i in range(width):
                src = t - (width - 1) + i
                if src >= 0 and (seg is None or seg[r, src] == seg[r, t]):
                    y[r, t] += w[:, i] * x[r, src]
    return y / (1 + np.exp(-y))


def test_conv_equals_loop_and_step() -> None:
    """causal_conv1d == a numpy loop (and with segment ids, reading nothing of an earlier
    document); conv1d_step one token at a time, then three at a time, == the full conv."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 9, 5)).astype(np.float32)
    w = rng.normal(size=(5, 4)).astype(np.float32)
    seg = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 3], [0] * 9], np.int32)
    full = dn.causal_conv1d(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(full, _conv_loop(x, w), **TOL)
    np.testing.assert_allclose(
        dn.causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg)),
        _conv_loop(x, w, seg),
        **TOL,
    )
    for t in (1, 3):
        window = jnp.zeros((2, 3, 5), jnp.float32)
        steps = []
        for lo in range(0, 9, t):
            y, window = dn.conv1d_step(jnp.asarray(x[:, lo : lo + t]), window, jnp.asarray(w))
            steps.append(y)
        np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, **TOL)
        np.testing.assert_array_equal(window, x[:, -3:])


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(REFERENCE) as f:
        return dict(f)


@pytest.mark.parametrize("case", ["a", "b"])
def test_rule_equals_transformers(ref, case: str) -> None:
    """torch_chunk_gated_delta_rule (chunk 64; 16 too in case a) and
    torch_recurrent_gated_delta_rule with use_qk_l2norm_in_kernel: both JAX forms, from
    the raw a, b, A_log, dt_bias through decay and beta_gate."""
    p = f"rule_{case}_"
    g = dn.decay(ref[p + "a"], ref[p + "a_log"], ref[p + "dt_bias"])
    beta = dn.beta_gate(jnp.asarray(ref[p + "b"]))
    np.testing.assert_allclose(g, ref[p + "g"], **TOL)
    np.testing.assert_allclose(beta, ref[p + "beta"], **TOL)
    args = (ref[p + "q"], ref[p + "k"], ref[p + "v"], g, beta)
    state0 = ref.get(p + "state0")
    chunks = [int(k[len(p) + 5 : -2]) for k in ref if k.startswith(p + "chunk") and k[-2:] == "_o"]
    assert chunks
    o_r, s_r = recurrent(*args, state0)
    for c in chunks:
        o_c, s_c = chunked(*args, chunk=c, state_BxHxKxV=state0)
        for o, s in ((o_c, s_c), (o_r, s_r)):
            np.testing.assert_allclose(o, ref[f"{p}chunk{c}_o"], **TOL)
            np.testing.assert_allclose(s, ref[f"{p}chunk{c}_state"], **TOL)
    np.testing.assert_allclose(o_r, ref[p + "recurrent_o"], **TOL)
    np.testing.assert_allclose(s_r, ref[p + "recurrent_state"], **TOL)


def test_conv_and_norm_equal_transformers(ref) -> None:
    """causal_conv1d_fn(activation="silu") with HF's [C, 1, W] weight squeezed to
    [C, W], and Qwen3_5RMSNormGated."""
    np.testing.assert_allclose(dn.causal_conv1d(ref["conv_x"], ref["conv_w"]), ref["conv_y"], **TOL)
    y = dn.gated_rms_norm(ref["norm_x"], ref["norm_gate"], ref["norm_w"], 1e-6)
    np.testing.assert_allclose(y, ref["norm_y"], **TOL)


def mixer(w: dict[str, np.ndarray], x_BxSxD: jax.Array, heads: tuple[int, int, int, int]):
    """Qwen3_5GatedDeltaNet.forward from these functions, HF's weights as they are
    (``w[name]`` for ``linear_attn.<name>``; linear weights ``[out, in]``)."""
    g, h, k, v = heads
    b, s, _ = x_BxSxD.shape
    qkv = dn.causal_conv1d(x_BxSxD @ w["in_proj_qkv.weight"].T, w["conv1d.weight"][:, 0])
    q = qkv[..., : g * k].reshape(b, s, g, k)
    kk = qkv[..., g * k : 2 * g * k].reshape(b, s, g, k)
    vv = qkv[..., 2 * g * k :].reshape(b, s, h, v)
    z = (x_BxSxD @ w["in_proj_z.weight"].T).reshape(b, s, h, v)
    beta = dn.beta_gate(x_BxSxD @ w["in_proj_b.weight"].T)
    decay = dn.decay(x_BxSxD @ w["in_proj_a.weight"].T, w["A_log"], w["dt_bias"])
    o, _ = dn.gated_delta_rule(q, kk, vv, decay, beta, chunk=8)
    y = dn.gated_rms_norm(o, z, w["norm.weight"], 1e-6).reshape(b, s, h * v)
    return y @ w["out_proj.weight"].T


def test_layer_equals_transformers(ref) -> None:
    """A whole Qwen3_5GatedDeltaNet (2 key heads of 8, 4 value heads of 6) composed of
    these functions: its output to 1e-5."""
    w = {k[len("layer_w_") :]: v for k, v in ref.items() if k.startswith("layer_w_")}
    y = jax.jit(mixer, static_argnums=2)(w, jnp.asarray(ref["layer_x"]), (2, 4, 8, 6))
    np.testing.assert_allclose(y, ref["layer_y"], **TOL)


def test_flops_linear_in_sequence() -> None:
    """The mixer's FLOPs a token have no sequence term: 3x forward when training, the
    rule's term H·(C·(6K + 4V) + 2C²/3 + 6KV)."""
    assert dn.rule_flops_per_token(4, 8, 6, chunk=16) == 4 * (16 * (48 + 24) + 512 / 3 + 6 * 48)
    fwd = dn.flops_per_token(32, 2, 4, 8, 6, conv_kernel=4, chunk=16, training=False)
    params = 32 * (2 * 16 + 2 * 24 + 8) + 24 * 32 + (32 + 24) * 4
    assert fwd == 2 * params + dn.rule_flops_per_token(4, 8, 6, chunk=16)
    assert dn.flops_per_token(32, 2, 4, 8, 6, chunk=16) == 3 * fwd
