"""What the reference models share: remat policies, causal attention, sampling with
a key/value cache."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.loss import Weighted
from jaxzero.models import deltanet

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


ATTENTION = ("auto", "xla", "cudnn")


def attention_impl(choice: str, dtype: Any, backend: str | None = None) -> str:
    """``"cudnn"`` or ``"xla"``: ``"auto"`` takes cuDNN's fused (flash) attention on
    GPUs for 16-bit inputs, where it exists, and XLA's einsum-softmax otherwise."""
    if choice != "auto":
        return choice
    backend = backend or jax.default_backend()
    return "cudnn" if backend == "gpu" and jnp.dtype(dtype).itemsize == 2 else "xla"


def cudnn_refusal(choice: str, dtype: Any, backend: str | None = None) -> str | None:
    """Why an explicit ``attention="cudnn"`` cannot run here (None: it can, or the choice
    is another): cuDNN's fused attention needs an NVIDIA GPU and 16-bit inputs, and JAX
    would say so only from deep inside the first step's trace."""
    if choice != "cudnn":
        return None
    backend = backend or jax.default_backend()
    if backend != "gpu":
        return (
            f"attention=cudnn needs an NVIDIA GPU (this backend is {backend}): "
            "use auto (cuDNN where it can run, else XLA) or xla"
        )
    if jnp.dtype(dtype).itemsize != 2:
        return (
            f"attention=cudnn needs 16-bit inputs, not {jnp.dtype(dtype).name}: "
            "use bf16 compute, or attention auto or xla"
        )
    return None


# a layer's attention window that no sequence reaches: full causal attention (windows
# are int32 data, scanned with the layers, so every layer runs the same program)
FULL = 2**31 - 1


def causal_attention(
    q_BxSxHxK: jax.Array,
    k_BxSxHxK: jax.Array,
    v_BxSxHxK: jax.Array,
    choice: str = "auto",
    segment_ids_BxS: jax.Array | None = None,
    window: jax.Array | None = None,
    windows: tuple[int, ...] = (),
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal multi-head attention with the implementation ``choice`` resolves to.

    With ``segment_ids`` (packed documents), a token attends only to earlier tokens of
    its own segment. Key/value heads may be fewer than query heads (grouped-query).
    ``"auto"`` falls back to XLA, with a warning, when cuDNN refuses the shapes or the
    mask (e.g. a head dim it does not support); an explicit ``"cudnn"`` raises instead.

    ``window`` (an int32 scalar, traced: the layer's, scanned with the layers; None:
    none) is a sliding window: the token at ``i`` attends to the key at ``j`` only when
    ``i - j < window``, the ``window`` latest tokens with itself (``transformers``'
    ``sliding_window``); :data:`FULL` is no limit. ``windows`` are the values it takes
    (static): XLA masks with the traced value, cuDNN's kernel takes its window as a
    compile-time constant, so with several values each layer runs the kernel of its own
    (``lax.switch``, one branch a value).

    ``scale`` multiplies the scores (None: ``1/sqrt(head_dim)``); ``softcap`` caps them
    at ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2's
    ``attn_logit_softcapping``). Neither fused kernel has a cap: soft-capped attention
    is XLA's (:func:`capped_attention`) under ``"auto"``, and ``"cudnn"`` is refused.
    """
    if softcap is not None and choice == "cudnn":
        raise ValueError(SOFTCAP_REFUSAL)
    impl = "xla" if softcap is not None else attention_impl(choice, q_BxSxHxK.dtype)
    mask = None
    if segment_ids_BxS is not None:
        mask = segment_ids_BxS[:, None, :, None] == segment_ids_BxS[:, None, None, :]

    def attend(
        i: Literal["xla", "cudnn"], mask: jax.Array | None, w: int | None = None
    ) -> jax.Array:
        return jax.nn.dot_product_attention(
            q_BxSxHxK,
            k_BxSxHxK,
            v_BxSxHxK,
            mask=mask,
            is_causal=True,
            scale=scale,
            implementation=i,
            local_window_size=None if w is None or w >= FULL else (w - 1, 0),
        )

    def xla() -> jax.Array:
        if softcap is not None:
            t, s = q_BxSxHxK.shape[1], k_BxSxHxK.shape[1]
            behind_TxS = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
            allowed = behind_TxS >= 0
            if window is not None:
                allowed = allowed & (behind_TxS < window)
            allowed_Bx1xTxS = allowed[None, None] if mask is None else mask & allowed[None, None]
            return capped_attention(
                q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, allowed_Bx1xTxS, scale, softcap
            )
        if window is None:
            return attend("xla", mask)
        t, s = q_BxSxHxK.shape[1], k_BxSxHxK.shape[1]
        near = (jnp.arange(t)[:, None] - jnp.arange(s)[None, :] < window)[None, None]
        return attend("xla", near if mask is None else mask & near)

    def cudnn() -> jax.Array:
        if window is None:
            return attend("cudnn", mask)
        if not windows:
            raise TypeError("a window on cuDNN needs the values it takes (windows=)")
        values = sorted(set(windows))
        branches = [functools.partial(attend, "cudnn", mask, w) for w in values]
        if len(branches) == 1:
            return branches[0]()
        return jax.lax.switch(jnp.searchsorted(jnp.asarray(values, jnp.int32), window), branches)

    if impl == "cudnn" and choice == "auto":
        try:
            return cudnn()
        except (NotImplementedError, ValueError, RuntimeError) as e:
            # said, not silent: XLA's attention materialises the S x S scores (slower)
            warnings.warn(
                f"attention=auto: cuDNN's fused attention refused this layer "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                "running XLA's attention instead",
                stacklevel=2,
            )
            return xla()
    return cudnn() if impl == "cudnn" else xla()


SOFTCAP_REFUSAL = (
    "attention=cudnn cannot soft-cap attention scores (attn_logit_softcapping): "
    "use auto or xla, which run XLA's attention with the cap"
)


def capped_attention(
    q_BxTxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    allowed_Bx1xTxS: jax.Array,
    scale: float | None,
    softcap: float,
) -> jax.Array:
    """XLA attention whose scores are soft-capped, as ``transformers``' eager Gemma 2:
    ``softcap * tanh(q.k * scale / softcap)`` in the inputs' dtype, then the mask, a
    softmax in fp32, the weights back in the inputs' dtype. ``allowed`` (bool) is the
    whole mask (causal and any window or segments); G key/value heads serve H query
    heads in groups."""
    b, t, h, d = q_BxTxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxTxGxRxK = q_BxTxHxK.reshape(b, t, g, h // g, d)
    scale = d**-0.5 if scale is None else scale
    scores = jnp.einsum("btgrk,bsgk->bgrts", q_BxTxGxRxK, k_BxSxGxK) * jnp.asarray(
        scale, q_BxTxHxK.dtype
    )
    scores_BxGxRxTxS = softcap * jnp.tanh(scores / softcap)
    allowed = allowed_Bx1xTxS[:, :, None]  # B x 1 x 1 x T x S over the groups
    scores_f32 = jnp.where(allowed, scores_BxGxRxTxS.astype(jnp.float32), -jnp.inf)
    weights = jax.nn.softmax(scores_f32, axis=-1).astype(q_BxTxHxK.dtype)
    out_BxTxGxRxK = jnp.einsum("bgrts,bsgk->btgrk", weights, v_BxSxGxK)
    return out_BxTxGxRxK.reshape(b, t, h, d)


def positions(tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None = None) -> jax.Array:
    """Each token's position in its document: from 0 in every row, or from 0 at the
    start of every segment of packed documents."""
    b, s = tokens_BxS.shape
    index = jnp.broadcast_to(jnp.arange(s), (b, s))
    if segment_ids_BxS is None:
        return index
    starts = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids_BxS[:, 1:] != segment_ids_BxS[:, :-1]], axis=1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def token_loss(logits_BxSxV: jax.Array, batch: dict[str, jax.Array]) -> Any:
    """Next-token cross-entropy: the mean over every token, or, when the batch has a
    ``loss_mask`` (prompt and padding 0), its sum over the unmasked tokens and their
    count (:class:`jaxzero.Weighted`), so the step's loss is exact over the global batch."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, batch["targets"])
    return tokens_loss(ce, batch)


def tokens_loss(ce_BxS: jax.Array, batch: dict[str, jax.Array]) -> Any:
    """:func:`token_loss` from each token's cross-entropy (the vocabulary-parallel
    loss computes it apart: :func:`jaxzero.tensor_parallel.vocab_cross_entropy`)."""
    if "loss_mask" not in batch:
        return ce_BxS.mean()
    mask = batch["loss_mask"].astype(jnp.float32)
    return Weighted(jnp.sum(ce_BxS * mask), jnp.sum(mask))


class LayerCache:
    """One layer's keys and values at every position of the sampling window
    (``B x W x G x K``, G key/value heads), and the position this call's tokens start at.

    Built inside the traced decode step and handed through the layer, which returns
    the one with its tokens written in (:meth:`attend`).
    """

    def __init__(self, k_BxWxGxK: jax.Array, v_BxWxGxK: jax.Array, start: jax.Array):
        self.k, self.v, self.start = k_BxWxGxK, v_BxWxGxK, start

    def attend(
        self,
        q_BxTxHxK: jax.Array,
        k_BxTxGxK: jax.Array,
        v_BxTxGxK: jax.Array,
        window: jax.Array | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> tuple[jax.Array, LayerCache]:
        """Attention of T new tokens (positions ``start .. start+T-1``) to every position
        up to their own: theirs, written into the cache first, and the earlier ones held
        there. Slots past a token's position (never written, or stale) are masked, and
        with a ``window`` (as :func:`causal_attention`'s) those ``window`` or more
        positions before it; ``scale`` and ``softcap`` as :func:`causal_attention`'s."""
        at = (0, self.start, 0, 0)
        k = jax.lax.dynamic_update_slice(self.k, k_BxTxGxK.astype(self.k.dtype), at)
        v = jax.lax.dynamic_update_slice(self.v, v_BxTxGxK.astype(self.v.dtype), at)
        w, t = k.shape[1], q_BxTxHxK.shape[1]
        behind_TxW = self.start + jnp.arange(t)[:, None] - jnp.arange(w)[None, :]
        mask_TxW = behind_TxW >= 0
        if window is not None:
            mask_TxW = mask_TxW & (behind_TxW < window)
        # XLA's: cuDNN's fused kernel gains nothing on a few query rows and refuses masks
        if softcap is not None:
            out = capped_attention(q_BxTxHxK, k, v, mask_TxW[None, None], scale, softcap)
        else:
            out = jax.nn.dot_product_attention(
                q_BxTxHxK, k, v, mask=mask_TxW[None, None], scale=scale, implementation="xla"
            )
        return out, LayerCache(k, v, self.start)


class LinearCache:
    """One linear-attention (Gated DeltaNet) layer's sampling state: the delta rule's
    state (``B x H x K x V``, fp32) and the conv's last ``width - 1`` inputs
    (``B x (W-1) x C``), with the position this call's tokens start at and how many of
    them are real (``valid``: a prefill is padded to a power of two, and the padding
    must leave both as they were, where attention's cache merely masks it).

    At position 0 a sequence starts afresh (:func:`decode_steps` runs the later half
    of a full window again from 0): the state and window then count as zero, whatever
    the buffers hold. Built inside the traced decode step; each method returns the
    cache with this call's tokens in.
    """

    def __init__(
        self, state_BxHxKxV: jax.Array, window_BxWxC: jax.Array, start: jax.Array, valid: jax.Array
    ):
        self.state, self.window, self.start, self.valid = state_BxHxKxV, window_BxWxC, start, valid

    def conv(self, x_BxTxC: jax.Array, w_CxW: jax.Array) -> tuple[jax.Array, LinearCache]:
        """The causal conv (SiLU) of the tokens after the window; the window comes back
        as the last ``width - 1`` inputs up to the last real token."""
        window = jnp.where(self.start == 0, 0, self.window).astype(x_BxTxC.dtype)
        y_BxTxC, _ = deltanet.conv1d_step(x_BxTxC, window, w_CxW)
        seen = jnp.concatenate([window, x_BxTxC], axis=1)
        kept = jax.lax.dynamic_slice_in_dim(seen, self.valid, window.shape[1], axis=1)
        return y_BxTxC, LinearCache(
            self.state, kept.astype(self.window.dtype), self.start, self.valid
        )

    def recur(
        self,
        q_BxTxGxK: jax.Array,
        k_BxTxGxK: jax.Array,
        v_BxTxHxV: jax.Array,
        g_BxTxH: jax.Array,
        beta_BxTxH: jax.Array,
    ) -> tuple[jax.Array, LinearCache]:
        """The gated delta rule of the tokens from the held state (the padding: no decay,
        no write, so the state after it is the last real token's)."""
        real_1xTx1 = (jnp.arange(g_BxTxH.shape[1]) < self.valid)[None, :, None]
        g_BxTxH = jnp.where(real_1xTx1, g_BxTxH, 0)
        beta_BxTxH = jnp.where(real_1xTx1, beta_BxTxH, 0)
        state = jnp.where(self.start == 0, 0, self.state)
        if q_BxTxGxK.shape[1] == 1:
            o, state = deltanet.recurrent_gated_delta_rule(
                q_BxTxGxK, k_BxTxGxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, state
            )
        else:
            o, state = deltanet.gated_delta_rule(
                q_BxTxGxK, k_BxTxGxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, state_BxHxKxV=state
            )
        return o, LinearCache(state.astype(self.state.dtype), self.window, self.start, self.valid)


# every attention layer's keys and values (L x B x W x G x K); a model with linear-attention
# layers adds their delta-rule states and conv windows (LinearCache's, stacked)
KVCache = tuple[jax.Array, ...]


def new_cache(layers: int, window: int, kv_heads: int, head_dim: int, dtype: Any) -> KVCache:
    """An empty key/value cache of one sequence, in the activations' dtype."""
    shape = (layers, 1, window, kv_heads, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)  # two buffers: both are donated


class Decoder(Protocol):
    """What :func:`generate` needs of a model (:class:`GPT` and :class:`Llama` have it)."""

    def new_cache(self, params: Any) -> KVCache: ...

    def decode(
        self, params: Any, tokens_BxT: jax.Array, start: jax.Array, cache: KVCache, last: jax.Array
    ) -> tuple[jax.Array, KVCache]: ...


@functools.partial(jax.jit, static_argnames=("decode", "top_k"), donate_argnames=("cache",))
def _step(decode, params, tokens_1xT, start, last, cache, rng, temperature, top_k):
    """Runs ``tokens`` through the cached model and draws the next token from the
    logits at index ``last``: ``(token, those logits, the cache, the next rng)``. One
    program per model, T and top_k; the cache's buffers are reused in place (donated)."""
    rng, key = jax.random.split(rng)
    logits_1xV, cache = decode(params, tokens_1xT, start, cache, last)
    logits = logits_1xV[0]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    if top_k is not None:
        kth = jax.lax.top_k(scaled, top_k)[0][-1]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled), logits, cache, rng


def _prefill_length(n: int, room: int) -> int:
    """Prompts are padded to a power of two (at least 16, at most the room left), so a
    handful of prefill programs serve every prompt length."""
    return min(room, max(16, 1 << (n - 1).bit_length()))


def decode_steps(
    model: Decoder,
    window: int,
    params: Any,
    prompt: np.ndarray,
    rng: jax.Array,
    temperature: float = 0.8,
    top_k: int | None = None,
) -> Iterator[tuple[int, jax.Array, np.ndarray]]:
    """Endless sampling after ``prompt``: each next token, the logits it was drawn from,
    and the context those logits saw (the tokens in the cache, positions from 0).

    The prompt's last ``window`` tokens are run once (prefill) into a key/value cache,
    then each new token alone at the next position. When the window is full, its
    later half (new token included) is run again from position 0 and sampling goes on
    from there, so every token sees between ``window // 2`` and ``window`` tokens,
    at positions the model was trained at.
    """
    params = jax.tree.map(jnp.asarray, params)
    tokens = [int(t) for t in np.asarray(prompt).reshape(-1)] or [0]
    context = tokens[-window:]  # what the cache holds once `pending` is in
    pending, filled, cache = list(context), 0, model.new_cache(params)
    temp = jnp.float32(temperature)
    while True:
        n = len(pending)
        buf = np.zeros((1, n if n == 1 else _prefill_length(n, window - filled)), np.int32)
        buf[0, :n] = pending
        token, logits, cache, rng = _step(
            model.decode, params, buf, np.int32(filled), np.int32(n - 1), cache, rng, temp, top_k
        )
        token = int(token)
        yield token, logits, np.asarray(context, np.int32)
        filled += n
        context.append(token)
        if filled < window:
            pending = [token]
        else:  # the window is full: start again from its later half
            context = context[-max(1, window // 2) :]
            pending, filled = list(context), 0


def generate(
    model: Decoder,
    window: int,
    params: Any,
    prompt: np.ndarray,
    max_new_tokens: int,
    rng: jax.Array,
    temperature: float = 0.8,
    top_k: int | None = None,
    eos: int | Iterable[int] | None = None,
) -> np.ndarray:
    """``prompt`` (int array ``[1, P]``) and up to ``max_new_tokens`` sampled after it,
    with a key/value cache over a ``window`` of tokens (:func:`decode_steps`).

    ``top_k`` keeps only the k likeliest tokens of each step (None: all). Sampling
    stops after the first token in ``eos`` (an id or several; None: never), which is
    kept, as ``transformers``' ``generate`` does.
    """
    stop = {int(e) for e in (eos if isinstance(eos, Iterable) else [eos]) if e is not None}
    tokens = list(np.asarray(prompt).reshape(-1)) or [0]
    steps = decode_steps(model, window, params, prompt, rng, temperature, top_k)
    for token, _, _ in itertools.islice(steps, max_new_tokens):
        tokens.append(token)
        if token in stop:
            break
    return np.asarray(tokens, np.int32)[None]
