"""jaxzero.NNXEngine: an NNX model written as the Flax NNX docs write one, trained at every
stage, against the one-device NNX training loop a user trusts (``nnx.Optimizer``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxzero
from tests._models import rel_diff


class Block(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.linear1 = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.linear2 = nnx.Linear(3 * dim, dim, rngs=rngs)

    def __call__(self, x):
        return x + self.linear2(nnx.gelu(self.linear1(self.norm(x))))


class MLP(nnx.Module):
    """Dimensions not divisible by 8, a list of blocks, a head: the shape of the docs' MLP."""

    def __init__(
        self, din: int, dim: int, dout: int, depth: int, rngs: nnx.Rngs, per_layer: bool = False
    ):
        self.embed = nnx.Linear(din, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, rngs) for _ in range(depth)])
        self.head = nnx.Linear(dim, dout, rngs=rngs)
        self.per_layer = per_layer

    def __call__(self, x):
        use = jaxzero.nnx.use if self.per_layer else (lambda m: m)
        x = use(self.embed)(x)
        for block in self.blocks:
            x = use(block)(x)
        return use(self.head)(x)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n: int = 4, rows: int = 16) -> list[dict]:
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.standard_normal((rows, 13)).astype(np.float32),
            "y": rng.standard_normal((rows, 5)).astype(np.float32),
        }
        for _ in range(n)
    ]


def one_device(model, tx, data):
    """The NNX training loop of the Flax docs: nnx.Optimizer and nnx.value_and_grad."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, b)) for b in data]
    return np.array(losses), nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("stage,per_layer", [(0, False), (1, False), (2, True), (3, True)])
def test_nnx_model_trains_like_one_device(stage, per_layer):
    tx = optax.adamw(3e-3)
    data = batches()
    ref_losses, ref_params = one_device(MLP(13, 37, 5, 2, nnx.Rngs(0), per_layer), tx, data)

    engine = jaxzero.NNXEngine(
        MLP(13, 37, 5, 2, nnx.Rngs(0), per_layer),
        loss_fn,
        tx,
        mesh=jaxzero.make_mesh(8),
        stage=stage,
        per_layer=per_layer,
        min_shard_size=8,
    )
    state = engine.init()
    losses = []
    for b in data:
        state, metrics = engine.step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    trained = engine.module(state)
    assert isinstance(trained, MLP)
    assert rel_diff(nnx.to_pure_dict(nnx.state(trained, nnx.Param)), ref_params) < 1e-4


class DropoutMLP(nnx.Module):
    """Three layers, each followed by Flax's own dropout holding its own stream."""

    def __init__(self, rngs: nnx.Rngs, per_layer: bool = False):
        self.layers = nnx.List([nnx.Linear(13, 13, rngs=rngs) for _ in range(3)])
        self.drops = nnx.List([nnx.Dropout(0.3, rngs=rngs) for _ in range(3)])
        self.head = nnx.Linear(13, 5, rngs=rngs)
        self.per_layer = per_layer

    def __call__(self, x):
        use = jaxzero.nnx.use if self.per_layer else (lambda m: m)
        for layer, drop in zip(self.layers, self.drops, strict=True):
            x = drop(nnx.relu(use(layer)(x)))
        return use(self.head)(x)


def test_flax_dropout_is_fed_by_the_engine_and_the_same_at_every_stage_as_on_one_device():
    """nnx.Dropout(rate, rngs=rngs) as users write it: its stream draws from the engine's
    key, a mask per row of the global batch, so 8 devices at any stage match one."""
    data, tx = batches(2), optax.adam(1e-2)

    def run(devices, stage, micro=1, seed=0):
        engine = jaxzero.NNXEngine(
            DropoutMLP(nnx.Rngs(0), per_layer=stage >= 2),
            loss_fn,
            tx,
            mesh=jaxzero.make_mesh(devices),
            stage=stage,
            per_layer=stage >= 2,
            micro_batches=micro,
            seed=seed,
            min_shard_size=8,
        )
        state, losses = engine.init(), []
        for b in data:
            state, metrics = engine.step(state, b)
            losses.append(float(metrics["loss"]))
        return losses, engine, state

    one, engine, state = run(1, 0)
    trained = engine.module(state)
    trained.eval()  # eval_loss: no dropout
    np.testing.assert_allclose(
        float(engine.eval_loss(state, data[0])), loss_fn(trained, data[0]), rtol=1e-5
    )
    trained.train()
    assert abs(float(loss_fn(trained, data[0])) - float(loss_fn(trained, data[0]))) > 1e-4
    params1 = engine.gather_params(state)
    for stage in range(4):
        losses, engine, state = run(8, stage, micro=2 if stage == 3 else 1)
        np.testing.assert_allclose(losses, one, rtol=1e-5, err_msg=f"stage {stage}")
        assert rel_diff(engine.gather_params(state), params1) <= 1e-5, f"stage {stage}"
    other, _, _ = run(1, 0, seed=1)
    assert abs(other[0] - one[0]) > 1e-4, "the engine's seed must matter"


def test_init_from_never_builds_the_model_outside_the_mesh():
    """An abstract module (nnx.eval_shape) + init_from: the params are created sharded,
    and equal the ones the module would have made eagerly."""
    abstract = nnx.eval_shape(lambda: MLP(13, 37, 5, 2, nnx.Rngs(0)))
    engine = jaxzero.NNXEngine(
        abstract, loss_fn, optax.sgd(0.1), mesh=jaxzero.make_mesh(8), stage=3
    )
    with pytest.raises(ValueError, match="abstract"):
        engine.init()
    state = engine.init_from(lambda: MLP(13, 37, 5, 2, nnx.Rngs(0)))
    sharded = [x for x in jax.tree.leaves(state.params) if not x.is_fully_replicated]
    assert sharded, "stage 3 keeps params sharded"
    eager = nnx.to_pure_dict(nnx.state(MLP(13, 37, 5, 2, nnx.Rngs(0)), nnx.Param))
    assert rel_diff(engine.gather_params(state), eager) == 0.0


def test_bad_models_are_refused_clearly():
    with pytest.raises(TypeError, match="nnx.Module"):
        jaxzero.NNXEngine({"w": jnp.ones(3)}, loss_fn, optax.sgd(0.1))

    class Counting(nnx.Module):  # a variable the step would hold constant, changed
        def __init__(self, rngs):
            self.linear = nnx.Linear(13, 5, rngs=rngs)
            self.calls = nnx.Variable(jnp.zeros(()))

        def __call__(self, x):
            self.calls[...] += 1
            return self.linear(x)

    engine = jaxzero.NNXEngine(Counting(nnx.Rngs(0)), loss_fn, optax.sgd(0.1), stage=0)
    with pytest.raises(ValueError, match="changed calls in the step.*held constant"):
        engine.step(engine.init(), batches(1)[0])


def test_optimizer_is_required():
    model = MLP(13, 37, 5, 1, nnx.Rngs(0))
    with pytest.raises(TypeError, match="optimizer"):
        jaxzero.NNXEngine(model, loss_fn)
    with pytest.raises(TypeError, match=r"pass an optax transformation, e\.g\. optax\.adamw"):
        jaxzero.NNXEngine(model, loss_fn, None)


def test_use_is_identity_outside_the_engine():
    model = MLP(13, 37, 5, 1, nnx.Rngs(0), per_layer=True)
    x = jnp.ones((2, 13))
    plain = MLP(13, 37, 5, 1, nnx.Rngs(0))
    np.testing.assert_array_equal(model(x), plain(x))


def test_the_loss_gets_the_key_only_when_asked_for():
    """The module's streams are fed either way; ``loss_fn(model, batch, rng)`` needs
    ``loss_takes_rng=True`` and then gets the step's key (None in eval_loss)."""
    keys = []

    def with_rng(model, batch, rng):
        keys.append(rng)
        return loss_fn(model, batch)

    model = MLP(13, 37, 5, 1, nnx.Rngs(0))
    with pytest.raises(ValueError, match="third parameter 'rng' has no default"):
        jaxzero.NNXEngine(model, with_rng, optax.sgd(0.1))
    engine = jaxzero.NNXEngine(
        model, with_rng, optax.sgd(0.1), mesh=jaxzero.make_mesh(2), stage=0, loss_takes_rng=True
    )
    state, _ = engine.step(engine.init(), batches(1)[0])
    assert keys and all(k is not None for k in keys)
    keys.clear()
    engine.eval_loss(state, batches(1)[0])
    assert keys and all(k is None for k in keys)
