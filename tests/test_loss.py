"""The loss contract (jaxzero.loss): weighted losses exact however unevenly the tokens fall,
aux metrics and dropout (jaxzero's and Linen's) independent of stage, devices and
micro-batching."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxzero
from jaxzero.loss import batch_key, dropout
from jaxzero.models.gpt import GPT
from tests._models import (
    TINY_GPT,
    gpt,
    gpt_batches,
    mlp_batches,
    mlp_loss,
    mlp_params,
    rel_diff,
    train_reference,
)

MODEL = GPT(TINY_GPT)


@pytest.fixture
def gpt_params() -> dict:
    return gpt()[1]


def masked_loss(params, batch):
    """Cross-entropy summed over the unmasked tokens, and their count."""
    logits = MODEL.apply(params, batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jaxzero.Weighted(jnp.sum(ce * mask), jnp.sum(mask))


def mean_of_shares(params, batch):
    """The old scalar form of the same loss: the mean over this share's tokens."""
    w = masked_loss(params, batch)
    return w.total / jnp.maximum(w.weight, 1.0)


def uneven_batches(n: int = 3) -> list[dict]:
    """32 rows: device 0's rows carry no loss at all (all prompt), device 1's every
    token, the rest random lengths of completion at the end of the row."""
    rng = np.random.default_rng(7)
    out = []
    for b in gpt_batches(n, batch=32):
        seq = b["inputs"].shape[1]
        start = rng.integers(0, seq, 32)
        start[:4], start[4:8] = seq, 0  # rows of device 0, then device 1 (8 devices)
        b["loss_mask"] = (np.arange(seq)[None] >= start[:, None]).astype(np.int32)
        out.append(b)
    return out


def _train(engine, params, batches):
    state, losses, tokens = engine.init(params), [], []
    for b in batches:
        state, metrics = engine.step(state, b)
        losses.append(float(metrics["loss"]))
        tokens.append(float(metrics.get("tokens", np.nan)))
    return np.array(losses), engine.gather_params(state), tokens


@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_weighted_loss_is_exact_with_uneven_masks(stage, micro, gpt_params):
    data, tx = uneven_batches(), optax.sgd(0.5)  # the update is the gradient itself
    whole = lambda p, b: (lambda w: w.total / w.weight)(masked_loss(p, b))
    ref_losses, ref_params = train_reference(whole, gpt_params, data, tx)
    engine = jaxzero.Engine(
        masked_loss,
        tx,
        mesh=jaxzero.make_mesh(8),
        stage=stage,
        micro_batches=micro,
        per_layer=True,
        stacked=r"^blocks/",
    )
    losses, params, tokens = _train(engine, gpt_params, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_diff(params, ref_params) <= 1e-5
    assert tokens == [float(b["loss_mask"].sum()) for b in data]


def test_the_scalar_form_of_the_same_loss_is_not_exact(gpt_params):
    """The control: a mean per share, averaged over shares, weighs device 1's tokens less
    than device 7's; the same test as above then fails."""
    data, tx = uneven_batches(), optax.adamw(1e-2)
    whole = lambda p, b: (lambda w: w.total / w.weight)(masked_loss(p, b))
    ref_losses, _ = train_reference(whole, gpt_params, data, tx)
    engine = jaxzero.Engine(
        mean_of_shares,
        tx,
        mesh=jaxzero.make_mesh(8),
        stage=3,
        micro_batches=4,
        per_layer=True,
        stacked=r"^blocks/",
    )
    losses, _, _ = _train(engine, gpt_params, data)
    assert np.max(np.abs(losses - ref_losses) / ref_losses) > 1e-2


def dropout_loss(params, batch, rng):
    """An MLP with dropout on its hidden layer, a weighted loss and an aux metric."""
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    h = dropout(h, 0.3, rng)
    y = params["scale"] * (h @ params["w2"] + params["b2"])
    err = jnp.sum((y - batch["y"]) ** 2, axis=-1)
    close = jnp.sum((jnp.abs(y - batch["y"]) < 0.5).astype(jnp.float32), axis=-1)
    rows = jnp.float32(err.shape[0])
    return jaxzero.Weighted(jnp.sum(err), rows), {"close": jnp.sum(close), "rows": rows}


def test_dropout_and_aux_are_the_same_at_any_stage_device_count_and_micro_batching():
    data, tx = mlp_batches(3, batch=16), optax.adam(1e-2)

    def run(devices, stage, micro):
        engine = jaxzero.Engine(
            dropout_loss,
            tx,
            loss_takes_rng=True,
            mesh=jaxzero.make_mesh(devices),
            stage=stage,
            micro_batches=micro,
            seed=3,
            min_shard_size=8,
        )
        state, out = engine.init(mlp_params()), []
        for b in data:
            state, metrics = engine.step(state, b)
            out.append(jax.tree.map(float, metrics))
        return out, engine.gather_params(state)

    one, p1 = run(1, 0, 1)
    many, p8 = run(8, 3, 2)
    assert rel_diff(p8, p1) <= 1e-5
    for a, b in zip(one, many, strict=True):
        assert a["tokens"] == b["tokens"] == 16.0 and a["aux"]["rows"] == 1.0
        np.testing.assert_allclose(
            [b["loss"], b["aux"]["close"]], [a["loss"], a["aux"]["close"]], rtol=1e-5
        )
    other_seed = jaxzero.Engine(
        dropout_loss, tx, mesh=jaxzero.make_mesh(1), stage=0, seed=4, loss_takes_rng=True
    )
    _, metrics = other_seed.step(other_seed.init(mlp_params()), data[0])
    assert abs(float(metrics["loss"]) - one[0]["loss"]) > 1e-4, "the seed must matter"


def test_a_draw_over_the_rows_is_the_global_batchs_rows_wherever_they_are():
    """What makes dropout exact: rows 4-7 of a 16-row batch draw the same on a device that
    holds rows 4-7 as on one that holds all 16, flattened (rows x positions) too, after
    Flax-style folds and splits; a draw not over the rows is the same on every device."""
    whole, part = batch_key(3, 5, 0, 16), batch_key(3, 5, 4, 4)
    for derive in (lambda k: k, lambda k: jax.random.split(jax.random.fold_in(k, 7))[1]):
        a, b = derive(whole), derive(part)
        got = jax.random.bernoulli(b, 0.5, (4, 6))
        np.testing.assert_array_equal(got, jax.random.bernoulli(a, 0.5, (16, 6))[4:8])
        flat = jax.random.normal(a, (16 * 3, 2))[12:24]  # rows 4-7, 3 positions each
        np.testing.assert_array_equal(jax.random.normal(b, (4 * 3, 2)), flat)
        np.testing.assert_array_equal(jax.random.normal(b, (5,)), jax.random.normal(a, (5,)))
    rows = jax.random.bernoulli(whole, 0.5, (16, 6))
    assert 0 < int(rows.sum()) < 96 and not (rows == rows[0]).all(), "rows draw apart"
    other = [batch_key(4, 5, 0, 16), batch_key(3, 6, 0, 16)]  # another seed, another step
    for k in other:
        assert (jax.random.bernoulli(k, 0.5, (16, 6)) != rows).any()


class LinenDropoutMLP(nn.Module):
    """Dropout as the Flax docs write it: ``deterministic`` from the call, the ``dropout``
    collection from ``apply(..., rngs=)``."""

    @nn.compact
    def __call__(self, x, train: bool):
        for width in (24, 24):
            x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(width)(x)))
        return nn.Dense(11)(x)


LINEN = LinenDropoutMLP()


def linen_loss(params, batch, rng):
    rngs = None if rng is None else {"dropout": rng}
    y = LINEN.apply({"params": params}, batch["x"], rng is not None, rngs=rngs)
    return jnp.mean((y - batch["y"]) ** 2)


def test_linen_dropout_with_the_loss_rng_is_the_same_at_every_stage_as_on_one_device():
    data, tx = mlp_batches(2, batch=16), optax.adam(1e-2)
    params = LINEN.init(jax.random.key(0), data[0]["x"], False)["params"]

    def run(devices, stage, micro=1, seed=3):
        engine = jaxzero.Engine(
            linen_loss,
            tx,
            loss_takes_rng=True,
            mesh=jaxzero.make_mesh(devices),
            stage=stage,
            micro_batches=micro,
            seed=seed,
            min_shard_size=8,
        )
        state, losses = engine.init(params), []
        for b in data:
            state, metrics = engine.step(state, b)
            losses.append(float(metrics["loss"]))
        return losses, engine.gather_params(state), float(engine.eval_loss(state, data[0]))

    one, p1, eval1 = run(1, 0)
    trained = jax.tree.map(jnp.asarray, p1)
    np.testing.assert_allclose(eval1, linen_loss(trained, data[0], None), rtol=1e-5)
    for stage in range(4):
        losses, p8, _ = run(8, stage, micro=2 if stage == 3 else 1)
        np.testing.assert_allclose(losses, one, rtol=1e-5, err_msg=f"stage {stage}")
        assert rel_diff(p8, p1) <= 1e-5, f"stage {stage}"
    other, _, _ = run(1, 0, seed=4)
    assert abs(other[0] - one[0]) > 1e-4, "the seed must matter"


def test_eval_combines_like_the_step_and_passes_no_rng(gpt_params):
    data = uneven_batches(1)[0]
    engine = jaxzero.Engine(masked_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(8), stage=2)
    state = engine.init(gpt_params)
    w = masked_loss(gpt_params, data)
    np.testing.assert_allclose(float(engine.eval_loss(state, data)), w.total / w.weight, rtol=1e-5)
    engine = jaxzero.Engine(
        dropout_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(2), stage=0, loss_takes_rng=True
    )
    b = mlp_batches(1, batch=16)[0]
    got = float(engine.eval_loss(engine.init(mlp_params()), b))
    w, _ = dropout_loss(mlp_params(), b, None)
    np.testing.assert_allclose(got, w.total / w.weight, rtol=1e-5)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda p, b: jnp.ones(3) * p["w"].sum(), "must be a scalar, got \\(3,\\)"),
        (lambda p, b: (p["w"].sum(), 1.0, 2.0), "a tuple of 3"),
        (lambda p, b: jaxzero.Weighted(p["w"], 1.0), "total must be a scalar"),
    ],
)
def test_a_loss_of_another_form_is_refused_naming_the_forms(bad, match):
    engine = jaxzero.Engine(bad, optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=0)
    state = engine.init({"w": np.ones(4, np.float32)})
    with pytest.raises(TypeError, match=match) as e:
        engine.step(state, {"x": np.ones((2, 1), np.float32)})
    assert "jaxzero.Weighted(total, weight)" in str(e.value)


def test_a_batch_with_nothing_to_learn_from_is_zero_not_nan(gpt_params):
    data = uneven_batches(1)[0]
    data["loss_mask"][:] = 0  # every token a prompt
    engine = jaxzero.Engine(masked_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(2), stage=1)
    state, metrics = engine.step(engine.init(gpt_params), data)
    assert float(metrics["loss"]) == 0.0 and float(metrics["tokens"]) == 0.0
    assert float(metrics["grad_norm"]) == 0.0
    assert rel_diff(engine.gather_params(state), gpt_params) == 0.0


def test_the_rng_is_given_only_when_asked_for():
    """``loss_takes_rng`` is the contract, not the signature: a third parameter with a
    default keeps it; one without is refused in one line; asking with two is refused."""
    mesh, tx, b = jaxzero.make_mesh(2), optax.sgd(0.1), mlp_batches(1, batch=16)[0]
    seen = []

    def with_default(params, batch, deterministic=False):
        seen.append(deterministic)
        return mlp_loss(params, batch)

    engine = jaxzero.Engine(with_default, tx, mesh=mesh, stage=0)
    engine.step(engine.init(mlp_params()), b)
    assert seen and all(d is False for d in seen)  # never a key in place of the default
    assert engine.rng_seed is None
    with pytest.raises(ValueError, match="third parameter 'rng' has no default") as e:
        jaxzero.Engine(dropout_loss, tx, mesh=mesh)
    assert "loss_takes_rng=True" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="loss_takes_rng=True, but loss_fn takes fewer"):
        jaxzero.Engine(mlp_loss, tx, mesh=mesh, loss_takes_rng=True)
    keys = []

    def rng_loss(params, batch, rng):
        keys.append(rng)
        return mlp_loss(params, batch)

    engine = jaxzero.Engine(rng_loss, tx, mesh=mesh, stage=0, loss_takes_rng=True)
    engine.step(engine.init(mlp_params()), b)
    assert keys and all(k is not None for k in keys)
