"""What the reference models share: remat policies, causal attention, sampling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.loss import Weighted

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


def causal_attention(
    q_BxSxHxK: jax.Array,
    k_BxSxHxK: jax.Array,
    v_BxSxHxK: jax.Array,
    choice: str = "auto",
    segment_ids_BxS: jax.Array | None = None,
) -> jax.Array:
    """Causal multi-head attention with the implementation ``choice`` resolves to.

    With ``segment_ids`` (packed documents), a token attends only to earlier tokens of
    its own segment. Key/value heads may be fewer than query heads (grouped-query).
    ``"auto"`` falls back to XLA when cuDNN refuses the shapes or the mask (e.g. a head
    dim it does not support); an explicit ``"cudnn"`` raises instead.
    """
    impl = attention_impl(choice, q_BxSxHxK.dtype)
    mask = None
    if segment_ids_BxS is not None:
        mask = segment_ids_BxS[:, None, :, None] == segment_ids_BxS[:, None, None, :]
    attend = lambda i: jax.nn.dot_product_attention(
        q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, mask=mask, is_causal=True, implementation=i
    )
    if impl == "cudnn" and choice == "auto":
        try:
            return attend("cudnn")
        except (NotImplementedError, ValueError, RuntimeError):
            return attend("xla")
    return attend(impl)


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
    if "loss_mask" not in batch:
        return ce.mean()
    mask = batch["loss_mask"].astype(jnp.float32)
    return Weighted(jnp.sum(ce * mask), jnp.sum(mask))


def generate(
    apply: Callable[[Any, jax.Array], jax.Array],
    window: int,
    params: Any,
    prompt: np.ndarray,
    max_new_tokens: int,
    rng: jax.Array,
    temperature: float = 0.8,
    top_k: int | None = None,
) -> np.ndarray:
    """Sample ``max_new_tokens`` after ``prompt`` (int array ``[1, P]``) with
    ``apply(params, tokens_1xS) -> logits``, the context a sliding ``window`` of tokens.

    ``top_k`` keeps only the k likeliest tokens of each step (None: all).
    """
    params = jax.tree.map(jnp.asarray, params)

    @jax.jit  # params are an argument, not constants baked into the program
    def next_token(params, window_1xS, pos, key):
        logits = apply(params, window_1xS)[0, pos] / max(temperature, 1e-6)
        if top_k is not None:
            kth = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits)

    tokens = list(np.asarray(prompt).reshape(-1)) or [0]
    for _ in range(max_new_tokens):
        ctx = tokens[-window:]
        buf = np.zeros((1, window), np.int32)
        buf[0, : len(ctx)] = ctx
        rng, key = jax.random.split(rng)
        pos = np.int32(len(ctx) - 1)  # traced, so one compilation serves every position
        tokens.append(int(next_token(params, buf, pos, key)))
    return np.asarray(tokens, np.int32)[None]
