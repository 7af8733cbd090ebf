"""Sampling with a key/value cache (:func:`jaxzero.models.common.generate`): along a sampled
sequence, past the window too, each step's logits are the full forward's over the tokens
the cache holds, for the GPT (Linen) and the Llama (NNX, grouped-query; with Qwen3.5's
linear-attention layers, whose cache is a state and a conv window); the Llama's
cached logits are ``transformers``' (rotary positions); an EOS token ends sampling, in
``generate`` and in the end-of-run sample."""

from __future__ import annotations

import dataclasses
import itertools
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxzero import hf
from jaxzero.models.common import decode_steps
from jaxzero.models.gpt import GPT
from jaxzero.models.llama import Llama, LlamaConfig
from jaxzero.train import config as C
from jaxzero.train import loop
from jaxzero.train.data import Corpus
from tests._models import QWEN3_5_FIELDS, TINY_GPT

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
WINDOW = 8  # both models' seq_len
TINY_LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=36,
    intermediate_size=52,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,  # grouped-query: the cache holds 2 heads, the queries 6
    qkv_bias=True,
    seq_len=WINDOW,
)
# Qwen3.5: linear-attention layers (their state and conv window cached) between full ones
TINY_QWEN3_5 = dataclasses.replace(TINY_LLAMA, **QWEN3_5_FIELDS)
MODELS = {"gpt": GPT(TINY_GPT), "llama": Llama(TINY_LLAMA), "qwen3_5": Llama(TINY_QWEN3_5)}
# cached vs full forward: attention caches are the same arithmetic (2e-5); Qwen3.5's
# DeltaNet steps its recurrence where the forward runs the chunked form, two fp32
# algorithms whose logits part by up to 2.05e-5 on an AVX-512 CPU
TOL = {"gpt": 2e-5, "llama": 2e-5, "qwen3_5": 5e-5}


def _params(model):
    """4x the init's weights: logits far apart, so a wrong position or cache slot shows."""
    return jax.tree.map(lambda x: 4 * x, model.init(jax.random.key(0)))


@pytest.mark.parametrize("prompt_len", [3, 11])
@pytest.mark.parametrize("name", MODELS)
def test_cached_logits_are_the_full_forwards_along_a_sampled_sequence(name, prompt_len):
    """16 tokens after a prompt shorter or longer than the 8-token window: each step's
    context is the sequence's suffix (the prompt's last 8 at most; when the window is
    full, its later half, 4 tokens, from position 0 again), and its logits are
    ``apply``'s at the context's last position (Qwen3.5: the padding of a prefill leaves
    the DeltaNet states and conv windows as they were, position 0 starts them afresh)."""
    model = MODELS[name]
    params = _params(model)
    prompt = np.arange(prompt_len, dtype=np.int32) * 5 % 64
    steps = list(
        itertools.islice(decode_steps(model, WINDOW, params, prompt, jax.random.key(1)), 16)
    )
    tokens = [*prompt, *(t for t, _, _ in steps)]
    first = min(prompt_len, WINDOW)
    want_lengths = list(range(first, WINDOW + 1))
    while len(want_lengths) < 16:
        want_lengths += list(range(WINDOW // 2, WINDOW + 1))
    assert [len(c) for _, _, c in steps] == want_lengths[:16]

    # uncached, as sampling was before the cache: the context in a window-long row
    forward = jax.jit(lambda p, row: model.apply(p, row)[0])
    for i, (_, logits, context) in enumerate(steps):
        end, n = prompt_len + i, len(context)
        np.testing.assert_array_equal(context, tokens[end - n : end])
        row = np.zeros((1, WINDOW), np.int32)
        row[0, :n] = context
        want = np.asarray(forward(params, row))[n - 1]
        assert want.std() > 0.1  # a signal well above the tolerance
        np.testing.assert_allclose(
            np.asarray(logits), want, rtol=0, atol=TOL[name], err_msg=f"step {i}"
        )


@pytest.mark.parametrize("name", ["llama3_rope/single", "llama_gqa/single"])
def test_cached_decoding_gives_transformers_logits(name):
    """A prefill of 8 reference tokens, then one token at a time up to 24: the logits
    of every position are the ones ``transformers`` computed (llama3 rope scaling and
    head_dim 16; grouped-query), so the cache's rotary positions are right."""
    path = FIXTURES / name
    ref = np.load(path / "reference.npz")
    model = hf.model(path, seq_len=24)
    params = hf.read_params(path, model)
    decode = jax.jit(model.decode)
    tokens = ref["tokens"][:1]
    logits, cache = decode(params, tokens[:, :8], 0, model.new_cache(params), 7)
    got = [logits[0]]
    for i in range(8, 24):
        logits, cache = decode(params, tokens[:, i : i + 1], i, cache, 0)
        got.append(logits[0])
    np.testing.assert_allclose(np.stack(got), ref["logits"][0, 7:], atol=1e-4, rtol=0)


def _first_repeat_free(tokens: np.ndarray) -> int:
    """The index of the first token (from the third) not sampled before it."""
    return next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])


def test_generation_stops_after_the_eos_token():
    """The same seed samples the same tokens; with ``eos`` (one id or several) the
    sequence ends at its first occurrence, EOS kept; tokens past the window go on."""
    model = MODELS["llama"]
    params, key, prompt = _params(model), jax.random.key(2), np.array([[5, 9, 17]])
    free = model.generate(params, prompt, 12, key)[0]
    assert free.shape == (3 + 12,)  # past the 8-token window
    i = _first_repeat_free(free[3:])
    eos = int(free[3 + i])
    for stop in (eos, [63 if eos != 63 else 62, eos]):
        np.testing.assert_array_equal(
            model.generate(params, prompt, 12, key, eos=stop)[0], free[: 4 + i]
        )
    np.testing.assert_array_equal(model.generate(params, prompt, 12, key, eos=None)[0], free)


def test_the_end_of_run_sample_stops_at_the_datas_eos():
    """``jaxzero train``'s closing sample ends at the data's EOS token."""
    model = MODELS["gpt"]
    params = _params(model)
    cfg = C.Config(logging=C.LoggingConfig(sample_tokens=12))
    val = np.array([7, 1, 2, 3], np.int32)
    corpus = Corpus(val, val, "uint16", 64, "test")  # token ids, printed as ids
    engine = types.SimpleNamespace(gather_params=lambda state: params)
    free = loop._sample(cfg, engine, None, model, corpus).split()
    p = len(free) - 12  # the prompt's tokens
    i = _first_repeat_free(free[p:])
    corpus = dataclasses.replace(corpus, eos=int(free[p + i]))
    assert loop._sample(cfg, engine, None, model, corpus).split() == free[: p + i + 1]
