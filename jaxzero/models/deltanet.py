r"""Gated DeltaNet, the linear attention of Qwen3.5's ``linear_attention`` layers, as
pure JAX functions (fp32 math inside): the gated delta rule in its chunked (training)
and step-by-step (reference, decoding) forms, the causal depthwise conv1d before it and
the RMSNorm gated by ``silu(z)`` after it. ``transformers``' pure-torch path
(``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
``causal_conv1d_fn``, ``Qwen3_5RMSNormGated``) is what these match.

The mixer (``Qwen3_5GatedDeltaNet.forward``), for hidden ``x`` (``B x S x D``)::

    qkv = silu(causal_conv1d(x @ W_qkv))       # split into q, k (G heads of K), v (H of V)
    z = x @ W_z                                 # H x V, the output gate
    beta = sigmoid(x @ W_b)                     # H, the write strength (beta_gate)
    g = -exp(A_log) * softplus(x @ W_a + dt_bias)   # H, the log decay (decay)
    o, state = gated_delta_rule(q, k, v, g, beta)
    y = gated_rms_norm(o, z, norm_weight, eps) @ W_out

The gated delta rule, per value head, with ``q_t``, ``k_t`` L2-normalised (and ``q_t``
scaled by ``K**-0.5``), state ``S`` (``K x V``)::

    S_t = exp(g_t) S_{t-1} + k_t ⊗ beta_t (v_t - exp(g_t) S_{t-1}ᵀ k_t)
        = (I - beta_t k_t k_tᵀ) exp(g_t) S_{t-1} + beta_t k_t ⊗ v_t
    o_t = S_tᵀ q_t

(the read ``Sᵀ k`` is of the decayed state, as ``transformers`` and FLA compute it).
``G`` key heads each serve ``H/G`` consecutive value heads (``repeat_interleave``).

**Why chunked.** The recurrence is ``S`` steps of rank-one updates of a ``K x V`` state:
memory-bound, sequential. Cut into chunks of ``C`` tokens, with ``Γ_i`` the cumulative
decay from the chunk's start and ``D_ij = Γ_i / Γ_j`` (``j <= i``), the writes ``u`` of
a chunk solve one unit-lower-triangular system ``(I + tril₋₁(beta k kᵀ ∘ D)) u =
beta v - beta Γ k S₀`` (the UT transform), and the chunk's outputs and next state are
matmuls: ``o = (Γ q) S₀ + (q kᵀ ∘ D) u``, ``S_C = Γ_C S₀ + (D_C k)ᵀ u``. The system's
inverse is built by block forward substitution in matmuls (no LAPACK call; see
``_unit_lower_inverse``). A ``lax.scan`` over the chunks carries ``S``; every
intermediate is ``O(S·C)`` or ``O(S/C·K·V)``, so memory grows linearly with the
sequence, and the work is matmuls of size ``C``.

**Packed documents** (``segment_ids_BxS``, jaxzero's packing): the state restarts at
every document's first token (a token whose id differs from the one before it), as if
each document ran alone. This is the recurrence with the decay ``exp(g_t) = 0`` at a
document's first token, so the chunked form stays exact by multiplying by 0/1 masks
(no ``-inf`` in the log-space cumsums, so no NaN in the gradients): within a chunk the
pairs across documents, the carried state read by a token past a boundary and the
carried state at a chunk with a boundary. An initial state is the state before the
row's first token: it continues the row's first document.

**FLOPs per token** (:func:`flops_per_token`): the projections and the conv are
``2·params`` a token forward (``D·(2GK + 2HV + 2H) + HV·D`` matmul weights, ``(2GK +
HV)·W`` conv taps), and the chunked rule adds, per value head, ``C·(6K + 4V) + 2C²/3 +
6·K·V`` (``q kᵀ``, ``beta k kᵀ`` and ``(q kᵀ) u``: ``2C·K, 2C·K, 2C·V``; the system's
inverse ``2C²/3`` and its product with the ``V + K`` right-hand sides ``2C·(V + K)``;
the state's read by ``k`` and ``q`` and its update: ``3 · 2KV``), independent of the
sequence length: a DeltaNet layer's cost is
linear in the sequence, where softmax attention's grows with it (``4·S·H·K``).
Training (forward and backward) is 3x the forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "beta_gate",
    "causal_conv1d",
    "conv1d_step",
    "decay",
    "flops_per_token",
    "gated_delta_rule",
    "gated_rms_norm",
    "l2norm",
    "recurrent_gated_delta_rule",
    "rule_flops_per_token",
]

F32 = jnp.float32


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x²) + eps)`` over the last axis (FLA's and ``transformers``'
    ``l2norm``), in fp32, returned in ``x``'s dtype."""
    x32 = x.astype(F32)
    return (x32 * lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def decay(a_BxSxH: jax.Array, a_log_H: jax.Array, dt_bias_H: jax.Array) -> jax.Array:
    """The log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32, ``<= 0``) of
    ``a = x @ W_a`` (``in_proj_a``)."""
    a32 = a_BxSxH.astype(F32) + dt_bias_H.astype(F32)
    return -jnp.exp(a_log_H.astype(F32)) * jax.nn.softplus(a32)


def beta_gate(b_BxSxH: jax.Array) -> jax.Array:
    """The write strength ``beta = sigmoid(b)`` of ``b = x @ W_b`` (``in_proj_b``), in
    ``b``'s dtype as ``transformers`` computes it (the rule takes it to fp32)."""
    return jax.nn.sigmoid(b_BxSxH)


def gated_rms_norm(
    x_xV: jax.Array, gate_xV: jax.Array, weight_V: jax.Array, eps: float = 1e-6
) -> jax.Array:
    """``Qwen3_5RMSNormGated``: ``x`` normalised over its last axis in fp32, back to its
    dtype, times ``weight`` (plain ``w``, ones at init, not ``1 + w``), times
    ``silu(gate)`` in fp32, in ``x``'s dtype."""
    x32 = x_xV.astype(F32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = weight_V * normed.astype(x_xV.dtype)
    return (y * jax.nn.silu(gate_xV.astype(F32))).astype(x_xV.dtype)


def _doc_index(segment_ids_BxS: jax.Array) -> jax.Array:
    """Each token's document within its row (int32, 0 for the row's first): the count
    of id changes up to it."""
    starts = segment_ids_BxS[:, 1:] != segment_ids_BxS[:, :-1]
    zero = jnp.zeros((segment_ids_BxS.shape[0], 1), jnp.int32)
    return jnp.concatenate([zero, jnp.cumsum(starts.astype(jnp.int32), axis=1)], axis=1)


def causal_conv1d(
    x_BxSxC: jax.Array, w_CxW: jax.Array, segment_ids_BxS: jax.Array | None = None
) -> jax.Array:
    """The depthwise causal conv1d of kernel ``W`` (no bias) then SiLU, in fp32, in
    ``x``'s dtype: ``y[t] = silu(sum_i w[:, i] * x[t - (W-1) + i])`` (zeros before the
    row), as ``transformers``' ``causal_conv1d_fn(..., activation="silu")``.

    ``w_CxW`` is HF's ``conv1d.weight`` (``C x 1 x W``) with its middle axis squeezed:
    ``w[:, W-1]`` multiplies the current token. With ``segment_ids``, a token reads no
    input of an earlier document (zeros, as at the row's start)."""
    b, s, c = x_BxSxC.shape
    width = w_CxW.shape[1]
    if w_CxW.shape[0] != c:
        raise ValueError(f"conv weight {w_CxW.shape} is not [channels={c}, width]")
    x32 = x_BxSxC.astype(F32)
    w32 = w_CxW.astype(F32)
    doc_BxS = None if segment_ids_BxS is None else _doc_index(segment_ids_BxS)
    y_BxSxC = x32 * w32[:, width - 1]
    for back in range(1, min(width, s)):  # the tap reading the token `back` steps before
        shifted = jnp.pad(x32[:, : s - back], ((0, 0), (back, 0), (0, 0)))
        if doc_BxS is not None:
            prev_doc = jnp.pad(doc_BxS[:, : s - back], ((0, 0), (back, 0)), constant_values=-1)
            shifted = jnp.where((prev_doc == doc_BxS)[..., None], shifted, 0.0)
        y_BxSxC = y_BxSxC + shifted * w32[:, width - 1 - back]
    return jax.nn.silu(y_BxSxC).astype(x_BxSxC.dtype)


def conv1d_step(
    x_BxTxC: jax.Array, window_BxWm1xC: jax.Array, w_CxW: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_conv1d` continued from a cache: ``window`` holds the last ``W-1``
    inputs before ``x`` (zeros at a sequence's start), ``x`` the ``T`` new ones (one
    token a step when sampling). Returns the outputs (``x``'s dtype) and the new window
    (the last ``W-1`` inputs, in ``window``'s dtype), as ``causal_conv1d_update``."""
    t = x_BxTxC.shape[1]
    width = w_CxW.shape[1]
    full = jnp.concatenate([window_BxWm1xC.astype(F32), x_BxTxC.astype(F32)], axis=1)
    w32 = w_CxW.astype(F32)
    y_BxTxC = full[:, :t] * w32[:, 0]
    for i in range(1, width):
        y_BxTxC = y_BxTxC + full[:, i : i + t] * w32[:, i]
    new_window = full[:, full.shape[1] - (width - 1) :].astype(window_BxWm1xC.dtype)
    return jax.nn.silu(y_BxTxC).astype(x_BxTxC.dtype), new_window


def _prepared(
    q_BxSxGxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxHxV: jax.Array,
    g_BxSxH: jax.Array,
    beta_BxSxH: jax.Array,
) -> tuple[jax.Array, ...]:
    """fp32 inputs: q, k L2-normalised, q scaled by ``K**-0.5``, both repeated to the
    ``H`` value heads (each key head serving ``H/G`` consecutive ones)."""
    b, s, groups, kd = q_BxSxGxK.shape
    heads = v_BxSxHxV.shape[2]
    if k_BxSxGxK.shape != q_BxSxGxK.shape:
        raise ValueError(f"q {q_BxSxGxK.shape} and k {k_BxSxGxK.shape} differ")
    if heads % groups or v_BxSxHxV.shape[:2] != (b, s):
        raise ValueError(
            f"v {v_BxSxHxV.shape}: its heads must be a multiple of q/k's {groups}, "
            f"its batch and sequence q's ({b}, {s})"
        )
    if g_BxSxH.shape != (b, s, heads) or beta_BxSxH.shape != (b, s, heads):
        raise ValueError(f"g {g_BxSxH.shape} and beta {beta_BxSxH.shape} must be {(b, s, heads)}")
    q = l2norm(q_BxSxGxK.astype(F32)) * (kd**-0.5)
    k = l2norm(k_BxSxGxK.astype(F32))
    if heads != groups:
        q = jnp.repeat(q, heads // groups, axis=2)
        k = jnp.repeat(k, heads // groups, axis=2)
    return q, k, v_BxSxHxV.astype(F32), g_BxSxH.astype(F32), beta_BxSxH.astype(F32)


def _initial_state(state_BxHxKxV: jax.Array | None, b: int, h: int, kd: int, vd: int) -> jax.Array:
    if state_BxHxKxV is None:
        return jnp.zeros((b, h, kd, vd), F32)
    if state_BxHxKxV.shape != (b, h, kd, vd):
        raise ValueError(f"state {state_BxHxKxV.shape} is not {(b, h, kd, vd)}")
    return state_BxHxKxV.astype(F32)


def _unit_lower_inverse(t_xCxC: jax.Array) -> jax.Array:
    """The inverse of unit-lower-triangular matrices (a batch), by block forward
    substitution in matmuls: the inverses of the diagonal blocks of size ``b`` give those
    of size ``2b``, ``[[A, 0], [X, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ X A⁻¹, D⁻¹]]``, from ``b = 1``
    (ones) to the whole matrix (padded to a power of two by an identity block).

    Not ``jax.scipy.linalg.solve_triangular``: on CPU it is LAPACK's ``trsm`` run
    batch-parallel on XLA's intra-op pool (``ParallelBatchMap``), and two such solves at
    once (forward and backward of the rule) deadlocked jaxlib 0.10.2 on 2 cores, every
    pool thread waiting on the other solve's tasks (experiments/deltanet_speed.py at 8192
    tokens: 512 systems a solve). This is XLA matmuls only, on GPUs too: ``C³/3``
    multiply-adds a matrix."""
    c = t_xCxC.shape[-1]
    size = 1 << max(c - 1, 0).bit_length()
    lead = t_xCxC.shape[:-2]
    if size != c:
        t_xCxC = jnp.pad(t_xCxC, [(0, 0)] * len(lead) + [(0, size - c), (0, size - c)])
        t_xCxC = t_xCxC + jnp.diag(jnp.arange(size) >= c).astype(t_xCxC.dtype)
    inv = jnp.ones((*lead, size, 1, 1), t_xCxC.dtype)  # the 1x1 diagonal blocks
    b = 1
    while b < size:
        pairs = size // (2 * b)
        blocks = t_xCxC.reshape(*lead, pairs, 2, b, pairs, 2, b)[..., :, 1, :, :, 0, :]
        below_xPxBxB = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        off = -(d_inv @ below_xPxBxB @ a_inv)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([off, d_inv], axis=-1)], axis=-2)
        b *= 2
    return inv[..., 0, :c, :c]


def recurrent_gated_delta_rule(
    q_BxSxGxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxHxV: jax.Array,
    g_BxSxH: jax.Array,
    beta_BxSxH: jax.Array,
    state_BxHxKxV: jax.Array | None = None,
    segment_ids_BxS: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (a ``lax.scan`` over the sequence), as
    ``torch_recurrent_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)``: the tests'
    reference and the one-token decoding step.

    ``g`` is the log decay (``<= 0``), ``beta`` the write strength; ``state`` the state
    before the first token (None: zeros). With ``segment_ids`` the state restarts at
    each document's first token. Returns the outputs (``q``'s dtype) and the final
    state (fp32)."""
    b, s, _, kd = q_BxSxGxK.shape
    h, vd = v_BxSxHxV.shape[2:]
    q, k, v, g, beta = _prepared(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH)
    state0 = _initial_state(state_BxHxKxV, b, h, kd, vd)
    multiplier_BxSxH = jnp.exp(g)
    if segment_ids_BxS is not None:
        doc_BxS = _doc_index(segment_ids_BxS)
        first_BxS = jnp.pad(doc_BxS[:, 1:] != doc_BxS[:, :-1], ((0, 0), (1, 0)))
        multiplier_BxSxH = jnp.where(first_BxS[..., None], 0.0, multiplier_BxSxH)

    def step(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_BxHxK, k_BxHxK, v_BxHxV, m_BxH, beta_BxH = xs
        state = state * m_BxH[..., None, None]
        read_BxHxV = jnp.einsum("bhkv,bhk->bhv", state, k_BxHxK)
        delta_BxHxV = (v_BxHxV - read_BxHxV) * beta_BxH[..., None]
        state = state + k_BxHxK[..., :, None] * delta_BxHxV[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_BxHxK)

    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, multiplier_BxSxH, beta))
    state, o_SxBxHxV = lax.scan(step, state0, xs)
    return jnp.swapaxes(o_SxBxHxV, 0, 1).astype(q_BxSxGxK.dtype), state


def gated_delta_rule(
    q_BxSxGxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxHxV: jax.Array,
    g_BxSxH: jax.Array,
    beta_BxSxH: jax.Array,
    chunk: int = 64,
    state_BxHxKxV: jax.Array | None = None,
    segment_ids_BxS: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks of ``chunk`` tokens (the training form; the
    module's docstring has the math), equal to :func:`recurrent_gated_delta_rule` and
    to ``torch_chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)``.

    The sequence is padded to a multiple of the chunk (a chunk is at most the sequence);
    within a chunk a unit-lower-triangular system's inverse and matmuls, across chunks a
    ``lax.scan`` carrying the fp32 state: memory linear in the sequence. Differentiable,
    jit-able, vmappable. Arguments and results as :func:`recurrent_gated_delta_rule`."""
    b, s, _, kd = q_BxSxGxK.shape
    h, vd = v_BxSxHxV.shape[2:]
    if chunk < 1:
        raise ValueError(f"chunk must be positive, not {chunk}")
    q, k, v, g, beta = _prepared(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH)
    state0 = _initial_state(state_BxHxKxV, b, h, kd, vd)
    c = min(chunk, s)
    n = -(-s // c)
    pad = n * c - s

    def chunked(x: jax.Array) -> jax.Array:
        """``B x S x H (x D)`` -> ``B x N x H x C (x D)``, zeros padding the end."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, *x.shape[2:])
        return jnp.moveaxis(x, 2, 3)

    q_BxNxHxCxK, k_BxNxHxCxK, v_BxNxHxCxV = chunked(q), chunked(k), chunked(v)
    g_BxNxHxC, beta_BxNxHxC = chunked(g), chunked(beta)
    cum_BxNxHxC = jnp.cumsum(g_BxNxHxC, axis=-1)  # log of the decay from the chunk's start
    last_BxNxHx1 = cum_BxNxHxC[..., -1:]
    causal_CxC = jnp.tril(jnp.ones((c, c), bool))

    # 0/1 masks of the packed documents (None: one document): pairs of one document, the
    # tokens still in the document the chunk starts in, those in the one it ends in
    pair = causal_CxC
    from_prev_BxNx1xC = to_end_BxNx1xC = carry_BxNx1x1 = None
    if segment_ids_BxS is not None:
        doc_BxS = _doc_index(segment_ids_BxS)
        doc_BxS = jnp.pad(doc_BxS, ((0, 0), (0, pad)), mode="edge")
        doc_BxNx1xC = doc_BxS.reshape(b, n, 1, c)
        prev_BxNx1x1 = jnp.concatenate(
            [doc_BxNx1xC[:, :1, :, :1], doc_BxNx1xC[:, :-1, :, -1:]], axis=1
        )
        end_BxNx1x1 = doc_BxNx1xC[..., -1:]
        pair = pair & (doc_BxNx1xC[..., :, None] == doc_BxNx1xC[..., None, :])
        from_prev_BxNx1xC = doc_BxNx1xC == prev_BxNx1x1
        to_end_BxNx1xC = doc_BxNx1xC == end_BxNx1x1
        carry_BxNx1x1 = end_BxNx1x1 == prev_BxNx1x1

    def masked(x: jax.Array, mask: jax.Array | None) -> jax.Array:
        return x if mask is None else jnp.where(mask, x, 0.0)

    # D_ij = exp(cum_i - cum_j) for j <= i in one document; the exponent is zeroed where
    # masked (above the diagonal it is positive and could overflow, even unused)
    diff_BxNxHxCxC = cum_BxNxHxC[..., :, None] - cum_BxNxHxC[..., None, :]
    decay_BxNxHxCxC = jnp.where(pair, jnp.exp(jnp.where(pair, diff_BxNxHxCxC, 0.0)), 0.0)
    from_start_BxNxHxC = masked(jnp.exp(cum_BxNxHxC), from_prev_BxNx1xC)
    to_end_BxNxHxC = masked(jnp.exp(last_BxNxHx1 - cum_BxNxHxC), to_end_BxNx1xC)
    chunk_decay_BxNxH = masked(jnp.exp(last_BxNxHx1), carry_BxNx1x1)[..., 0]

    # the UT transform: (I + strictly_lower(beta k kᵀ ∘ D)) [u₀ | w] = [beta v | beta Γ k]
    kb_BxNxHxCxK = k_BxNxHxCxK * beta_BxNxHxC[..., None]
    kk_BxNxHxCxC = jnp.einsum("bnhik,bnhjk->bnhij", kb_BxNxHxCxK, k_BxNxHxCxK)
    strict_CxC = jnp.tril(jnp.ones((c, c), bool), -1)
    system = jnp.where(strict_CxC, kk_BxNxHxCxC * decay_BxNxHxCxC, 0.0) + jnp.eye(c, dtype=F32)
    rhs = jnp.concatenate(
        [v_BxNxHxCxV * beta_BxNxHxC[..., None], kb_BxNxHxCxK * from_start_BxNxHxC[..., None]],
        axis=-1,
    )
    solved = jnp.einsum("bnhij,bnhjd->bnhid", _unit_lower_inverse(system), rhs)
    u0_BxNxHxCxV, w_BxNxHxCxK = solved[..., :vd], solved[..., vd:]
    attn_BxNxHxCxC = jnp.einsum("bnhik,bnhjk->bnhij", q_BxNxHxCxK, k_BxNxHxCxK) * decay_BxNxHxCxC
    qd_BxNxHxCxK = q_BxNxHxCxK * from_start_BxNxHxC[..., None]
    kd_BxNxHxCxK = k_BxNxHxCxK * to_end_BxNxHxC[..., None]

    def step(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        u0_BxHxCxV, w_BxHxCxK, attn_BxHxCxC, qd_BxHxCxK, kd_BxHxCxK, cd_BxH = xs
        u_BxHxCxV = u0_BxHxCxV - jnp.einsum("bhck,bhkv->bhcv", w_BxHxCxK, state)
        o_BxHxCxV = jnp.einsum("bhck,bhkv->bhcv", qd_BxHxCxK, state) + jnp.einsum(
            "bhij,bhjv->bhiv", attn_BxHxCxC, u_BxHxCxV
        )
        state = state * cd_BxH[..., None, None] + jnp.einsum(
            "bhck,bhcv->bhkv", kd_BxHxCxK, u_BxHxCxV
        )
        return state, o_BxHxCxV

    xs = (u0_BxNxHxCxV, w_BxNxHxCxK, attn_BxNxHxCxC, qd_BxNxHxCxK, kd_BxNxHxCxK)
    xs_n = tuple(jnp.moveaxis(x, 1, 0) for x in (*xs, chunk_decay_BxNxH))
    state, o_NxBxHxCxV = lax.scan(step, state0, xs_n)
    o_BxSxHxV = jnp.moveaxis(o_NxBxHxCxV, 0, 1).swapaxes(2, 3).reshape(b, n * c, h, vd)
    return o_BxSxHxV[:, :s].astype(q_BxSxGxK.dtype), state


def rule_flops_per_token(value_heads: int, key_dim: int, value_dim: int, chunk: int = 64) -> float:
    """Forward FLOPs a token of the chunked gated delta rule beyond the projections
    (the module's docstring): ``H · (C·(6K + 4V) + 2C²/3 + 6·K·V)``, independent of the sequence
    length. Training is 3x."""
    c, k, v = chunk, key_dim, value_dim
    return value_heads * (c * (6 * k + 4 * v) + 2 * c * c / 3 + 6 * k * v)


def flops_per_token(
    hidden: int,
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    conv_kernel: int = 4,
    chunk: int = 64,
    training: bool = True,
) -> float:
    """FLOPs a token of the whole DeltaNet mixer (projections, conv, chunked rule, gated
    norm's few elementwise ops left out): forward ``2·(D·(2GK + 2HV + 2H) + HV·D +
    (2GK + HV)·W) +`` :func:`rule_flops_per_token`, and 3x that when ``training``
    (forward and backward). Linear in the sequence: no term grows with it."""
    d, g, h, k, v = hidden, key_heads, value_heads, key_dim, value_dim
    matmul_params = d * (2 * g * k + 2 * h * v + 2 * h) + h * v * d
    conv_params = (2 * g * k + h * v) * conv_kernel
    forward = 2.0 * (matmul_params + conv_params) + rule_flops_per_token(h, k, v, chunk)
    return 3.0 * forward if training else forward
