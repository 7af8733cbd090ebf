"""Packed documents in the reference models: positions restart and attention stays inside
each document, so packing changes no token's logits; loss masks make the loss weighted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxzero
from jaxzero.models.common import positions
from jaxzero.models.llama import Llama, LlamaConfig
from tests._models import gpt

LLAMA = Llama(
    LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        seq_len=16,
    )
)


def _models():
    model, params = gpt()
    return {"gpt": (model, params), "llama": (LLAMA, LLAMA.init(jax.random.key(0)))}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_packing_another_document_before_changes_no_logits(name):
    model, params = _models()[name]
    s = model.config.seq_len
    rng = np.random.default_rng(0)
    first, second = rng.integers(1, 64, 3), rng.integers(1, 64, s - 3)
    alone = np.zeros((1, s), np.int32)
    alone[0, : s - 3] = second
    packed = np.concatenate([first, second])[None].astype(np.int32)
    seg_alone = np.where(np.arange(s) < s - 3, 1, 2)[None]  # the padding: its own segment
    seg_packed = np.where(np.arange(s) < 3, 0, 1)[None]
    a = model.apply(params, alone, seg_alone)[0, : s - 3]
    b = model.apply(params, packed, seg_packed)[0, 3:]
    np.testing.assert_allclose(b, a, atol=1e-5)
    unmasked = model.apply(params, packed)[0, 3:]  # the control: without segment ids
    assert float(jnp.max(jnp.abs(unmasked - a))) > 1e-3


def test_positions_restart_at_each_segment():
    seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    np.testing.assert_array_equal(
        positions(seg, seg), [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]]
    )


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_loss_mask_makes_the_models_loss_weighted(name):
    model, params = _models()[name]
    s = model.config.seq_len
    t = np.random.default_rng(1).integers(0, 64, (2, s + 1)).astype(np.int32)
    batch = {"inputs": t[:, :-1], "targets": t[:, 1:]}
    assert jnp.shape(model.loss_fn(params, batch)) == ()
    mask = np.zeros((2, s), np.int32)
    mask[0, 5:] = 1
    out = model.loss_fn(params, {**batch, "loss_mask": mask})
    assert isinstance(out, jaxzero.Weighted) and float(out.weight) == s - 5
    logits = model.apply(params, batch["inputs"])
    logz = jax.nn.logsumexp(logits[0, 5:], axis=-1)
    want = jnp.sum(logz - jnp.take_along_axis(logits[0, 5:], t[0, 6:, None], -1)[:, 0])
    np.testing.assert_allclose(float(out.total), float(want), rtol=1e-5)
