"""Flax Linen and NNX models mark their layers with use_params and train at stage 3."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import rel_diff, train_engine, train_reference
from flax import nnx

import jaxzero
from jaxzero.accounting.comm import collectives_from_hlo

D = 64
TX = optax.adam(1e-2)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(D, name="fc")(x))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        # the one line: gather this block's params where it uses them
        block = nn.map_variables(LinenBlock, "params", trans_in_fn=jaxzero.use_params, init=True)
        for i in range(2):
            x = block(name=f"block{i}")(x)
        return x


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        p = jaxzero.use_params({"w": self.fc.kernel.get_value(), "b": self.fc.bias.get_value()})
        return x + jnp.tanh(x @ p["w"] + p["b"])


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _linen():
    model = LinenModel()
    params = model.init(jax.random.key(0), jnp.zeros((1, D)))["params"]
    return params, lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)


def _nnx():
    graphdef, state = nnx.split(NNXModel(nnx.Rngs(0)), nnx.Param)

    def loss(p, b):
        return jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2)

    return nnx.to_pure_dict(state), loss


@pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen", "nnx"])
def test_flax_model_gathers_per_layer_and_matches(make):
    params, loss = make()
    params = jax.tree.map(np.asarray, params)
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.standard_normal((16, D)).astype(np.float32),
            "y": rng.standard_normal((16, D)).astype(np.float32),
        }
        for _ in range(5)
    ]
    ref_losses, ref_params = train_reference(loss, params, batches, TX)
    engine = jaxzero.Engine(loss, TX, mesh=jaxzero.make_mesh(8), stage=3, per_layer=True)
    losses, final, state = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= 1e-5 and rel_diff(final, ref_params) <= 1e-5
    # one all-gather per block (its kernel and bias packed), none of the whole tree
    found = collectives_from_hlo(engine.compile(state, batches[0]).as_text()).collectives
    gathers = [c for c in found if c.kind == "all-gather"]
    assert len(gathers) >= 2
    assert all(sum(b.elements for b in c.buffers) <= D * D + D for c in gathers)
