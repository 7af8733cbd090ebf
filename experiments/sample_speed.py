"""Time per sampled token: the key/value-cached loop of ``model.generate`` against the
uncached one jaxzero used before (the model over the whole window for every token).

A Llama of SmolLM2-135M's shape (vocab 49152, hidden 576, 30 layers, 9 query / 3
key-value heads, tied embeddings) with random fp32 weights and a 2048-token window,
``jaxzero sample``'s set-up: one device, one sequence. Both loops draw with the same
keys, so they sample the same tokens while their logits agree (printed). Compilation
is timed apart; the cached loop's prefill (the prompt, padded to a power of two) apart
from its per-token steps.

    python -m experiments.sample_speed                          # SmolLM2-135M shape, 2048
    python -m experiments.sample_speed --shape tiny --window 64 --tokens 8 --old-tokens 2
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxzero.models.common import decode_steps  # noqa: E402
from jaxzero.models.llama import Llama, LlamaConfig  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def uncached_step(model, temperature):
    """The compiled step of the loop before the cache (``models/common.generate`` until
    then): the model over a window-long row holding the context, for every token."""

    @jax.jit
    def next_token(params, row_1xS, pos, key):
        logits = model.apply(params, row_1xS)[0, pos] / max(temperature, 1e-6)
        return jax.random.categorical(key, logits)

    return next_token


def uncached_tokens(next_token, model, params, prompt, n, rng):
    """That loop, with the time of each token."""
    window = model.config.seq_len
    tokens, times = list(prompt), []
    for _ in range(n):
        ctx = tokens[-window:]
        row = np.zeros((1, window), np.int32)
        row[0, : len(ctx)] = ctx
        rng, key = jax.random.split(rng)
        tokens.append(int(next_token(params, row, np.int32(len(ctx) - 1), key)))
        times.append(time.perf_counter())
    return tokens[len(prompt) :], times


def cached_tokens(model, params, prompt, n, rng, temperature):
    """``model.generate``'s loop (:func:`decode_steps`), with the time of each token,
    and the last token's logits and the context they saw."""
    steps = decode_steps(model, model.config.seq_len, params, prompt, rng, temperature)
    tokens, times = [], []
    for token, logits, context in itertools.islice(steps, n):  # noqa: B007 - the last's
        tokens.append(token)
        times.append(time.perf_counter())
    return tokens, times, logits, context


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    p.add_argument("--window", type=int, default=2048, help="seq_len: the sampling window")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--tokens", type=int, default=100, help="tokens the cached loop samples")
    p.add_argument("--old-tokens", type=int, default=3, help="tokens the uncached loop samples")
    args = p.parse_args()

    cfg = LlamaConfig(**SHAPES[args.shape], seq_len=args.window)
    model = Llama(cfg)
    params = jax.jit(model.init)(jax.random.key(0))
    n_params = model.num_params(params)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len).astype(np.int32)
    rng, temperature = jax.random.key(1), 0.8
    print(
        f"{args.shape}: {n_params / 1e6:.1f}M params, window {args.window}, prompt "
        f"{args.prompt_len} tokens, {jax.device_count()} {jax.default_backend()} device(s), "
        f"{os.cpu_count()} cores, jax {jax.__version__}"
    )

    # compile (and warm) both loops first, on two tokens each
    next_token = uncached_step(model, temperature)
    t0 = time.perf_counter()
    uncached_tokens(next_token, model, params, prompt, 2, rng)
    t1 = time.perf_counter()
    cached_tokens(model, params, prompt, 2, rng, temperature)
    t2 = time.perf_counter()
    print(f"compile + 2 tokens: uncached {t1 - t0:.1f} s, cached {t2 - t1:.1f} s")

    start = time.perf_counter()
    old, old_times = uncached_tokens(next_token, model, params, prompt, args.old_tokens, rng)
    old_per_token = (old_times[-1] - start) / len(old)
    start = time.perf_counter()
    new, new_times, logits, ctx = cached_tokens(
        model, params, prompt, args.tokens, rng, temperature
    )
    prefill = new_times[0] - start
    per_token = (new_times[-1] - new_times[0]) / max(1, len(new) - 1)
    same = sum(
        1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(old, new, strict=False))
    )
    print(f"uncached: {old_per_token:.3f} s/token ({len(old)} tokens)")
    print(
        f"cached:   {per_token * 1e3:.1f} ms/token ({len(new) - 1} tokens after the first), "
        f"prefill + first token {prefill:.3f} s; {args.tokens} tokens in "
        f"{new_times[-1] - start:.2f} s against {old_per_token * args.tokens:.1f} s uncached"
    )
    print(f"speed-up per token: {old_per_token / per_token:.0f}x")
    print(f"the first {same} of {len(old)} uncached tokens are the cached loop's")

    row = np.zeros((1, args.window), np.int32)
    row[0, : len(ctx)] = ctx
    full = jax.jit(model.apply)(params, jnp.asarray(row))[0, len(ctx) - 1]
    diff = float(jnp.abs(full - logits).max())
    print(f"last token's logits, cached vs the full forward: max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
