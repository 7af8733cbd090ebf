"""Any optax optimizer trains exactly like one device at every stage; none is silently wrong.

The optimizer runs in the global view on the sharded state (``update.optimizer_update``),
on logical shapes, so elementwise, masked, partitioned, norm-based, factored and
matrix optimizers all compute what they compute on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import mlp_batches, mlp_loss, mlp_params, rel_diff, train_engine, train_reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero
from jaxzero import update as update_lib
from jaxzero.accounting.comm import collectives_from_hlo
from jaxzero.partition import is_layout
from jaxzero.state import master_specs

STEPS = 10
N = 8
DECAY = {"w1": True, "b1": False, "w2": True, "b2": False, "scale": False}
GROUPS = {"w1": "adam", "b1": "sgd", "w2": "adam", "b2": "sgd", "scale": "frozen"}

# elementwise: the same arithmetic on a slice as on the whole, to float rounding
ELEMENTWISE = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adamw_dict_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=DECAY),
    "masked_adam_dict": lambda: optax.chain(
        optax.masked(optax.adam(1e-2), DECAY),
        optax.masked(optax.sgd(1e-2), {k: not v for k, v in DECAY.items()}),
    ),
    "masked_adam_callable": lambda: optax.chain(
        optax.masked(optax.adam(1e-2), lambda p: jax.tree.map(lambda x: x.ndim == 2, p)),
        optax.masked(optax.set_to_zero(), lambda p: jax.tree.map(lambda x: x.ndim < 2, p)),
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2), "frozen": optax.set_to_zero()}, GROUPS
    ),
    "lion": lambda: optax.lion(1e-3),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    # accumulates over calls of step, updating every 2nd (Engine(micro_batches=2) does
    # it within one step); given to the engine as it is, not as .gradient_transformation()
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}
# look across elements (norms, factored statistics, matrices, learning-rate estimates)
CROSS_ELEMENT = {
    "clip_in_chain": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor_factored": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "muon": lambda: optax.contrib.muon(1e-2),
    "dog": lambda: optax.contrib.dog(1.0),
    "mechanize": lambda: optax.contrib.mechanize(optax.adam(1e-2)),
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1.0),
    "prodigy": lambda: optax.contrib.prodigy(1.0),
}


@pytest.fixture(scope="module")
def data():
    return mlp_params(), mlp_batches(STEPS)


def _change(final, params):
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, final, params)


_REFERENCES: dict = {}  # one single-device run per optimizer, shared by both stages


def _check(data, make_tx, stage, tol):
    params, batches = data
    if make_tx not in _REFERENCES:
        _REFERENCES[make_tx] = train_reference(mlp_loss, params, batches, make_tx())
    ref_losses, ref_params = _REFERENCES[make_tx]
    assert np.isfinite(ref_losses).all()
    engine = jaxzero.Engine(mlp_loss, make_tx(), mesh=jaxzero.make_mesh(N), stage=stage)
    losses, final, _ = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= tol
    changed = _change(ref_params, params)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(changed)) > 0  # it trains
    # the frozen leaves of the partitioned optimizers stay exactly put
    for k, x in changed.items():
        if np.all(x == 0):
            np.testing.assert_array_equal(final[k], params[k])
    assert rel_diff(_change(final, params), changed) <= tol


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_optimizers_match_one_device(data, name, stage):
    _check(data, ELEMENTWISE[name], stage, 1e-5)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("name", sorted(CROSS_ELEMENT))
def test_cross_element_optimizers_match_one_device(data, name, stage):
    _check(data, CROSS_ELEMENT[name], stage, 1e-4)


@pytest.mark.parametrize("stage", [1, 3])
def test_lbfgs_gets_value_grad_and_value_fn_and_matches_one_device(data, stage):
    params, batches = data[0], data[1][:4]
    if "lbfgs" not in _REFERENCES:
        _REFERENCES["lbfgs"] = train_reference(
            mlp_loss, params, batches, optax.lbfgs(), extra_args=True
        )
    ref_losses, ref_params = _REFERENCES["lbfgs"]
    assert ref_losses[-1] < ref_losses[0] / 2  # the line search works
    engine = jaxzero.Engine(mlp_loss, optax.lbfgs(), mesh=jaxzero.make_mesh(N), stage=stage)
    losses, final, _ = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= 1e-5
    assert rel_diff(_change(final, params), _change(ref_params, params)) <= 1e-4


def test_reduce_on_plateau_gets_the_loss_and_matches_one_device(data):
    params, batches = data[0], data[1][:6]
    make = lambda: optax.chain(
        optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
    )
    tx = make()

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(mlp_loss)(p, b)
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s, loss

    p, ref_losses = jax.tree.map(jnp.asarray, params), []
    s = tx.init(p)
    for b in batches:
        p, s, loss = step(p, s, b)
        ref_losses.append(float(loss))
    assert float(s[1].scale) < 1.0  # the plateau was seen: the test can tell
    engine = jaxzero.Engine(mlp_loss, make(), mesh=jaxzero.make_mesh(N), stage=3)
    losses, final, state = train_engine(engine, params, batches)
    assert rel_diff(losses, np.array(ref_losses)) <= 1e-5
    assert rel_diff(final, jax.tree.map(np.asarray, p)) <= 1e-5
    assert float(state.opt_state[1].scale) == float(s[1].scale)


def test_optimizer_state_layouts_follow_each_leaf():
    """Moments share their param's layout; factored statistics get one of their own."""
    tx = optax.chain(
        optax.masked(optax.adafactor(1e-2, min_dim_size_to_factor=8), DECAY),
        optax.masked(optax.adam(1e-2), {k: not v for k, v in DECAY.items()}),
    )
    engine = jaxzero.Engine(mlp_loss, tx, mesh=jaxzero.make_mesh(N), stage=3)
    state = engine.init(mlp_params())
    lays = {
        jax.tree_util.keystr(p): lay
        for p, lay in jax.tree_util.tree_leaves_with_path(engine.opt_layouts, is_leaf=is_layout)
    }
    rows = [lay for k, lay in lays.items() if "v_row" in k and "'w1'" in k]
    assert rows and rows[0].shape == (37,) and rows[0] is not engine.layouts["w1"]
    mu_b1 = [lay for k, lay in lays.items() if ".mu" in k and "'b1'" in k]
    assert mu_b1 and mu_b1[0] is engine.layouts["b1"]
    for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state):
        lay = lays[jax.tree_util.keystr(path)]
        assert x.shape == lay.padded_shape
        assert x.sharding.spec == lay.spec()
    r = jaxzero.report(engine, state, mlp_batches(1)[0])  # optimizer bytes counted leaf by leaf
    assert r.persistent["total"] - r.persistent["other"] == r.expected.persistent


def _update_collectives(tx, stage):
    """Collectives XLA adds to the global-view update alone, placed as the step places it."""
    engine = jaxzero.Engine(mlp_loss, tx, mesh=jaxzero.make_mesh(N), stage=stage)
    state = engine.abstract_state(jax.eval_shape(lambda: mlp_params()))
    named = lambda tree: jax.tree.map(
        lambda p: NamedSharding(engine.mesh, p), tree, is_leaf=lambda x: isinstance(x, P)
    )
    master_sh = named(master_specs(stage, engine.layouts))
    grads = jax.tree.map(
        lambda lay, sh: jax.ShapeDtypeStruct(lay.padded_shape, jnp.float32, sharding=sh),
        engine.layouts,
        master_sh,
        is_leaf=is_layout,
    )
    update = jax.jit(
        lambda g, s, m: update_lib.optimizer_update(
            engine.tx, engine.layouts, engine.opt_layouts, True, g, s, m
        ),
        out_shardings=(master_sh, named(engine.specs.opt_state)),
    )
    hlo = update.lower(grads, state.opt_state, state.params).compile().as_text()
    return collectives_from_hlo(hlo).collectives


@pytest.mark.parametrize("stage", [1, 3])
def test_elementwise_update_compiles_to_local_code(stage):
    assert _update_collectives(optax.adamw(1e-3, weight_decay=0.1), stage) == []
    assert _update_collectives(ELEMENTWISE["multi_transform"](), stage) == []
    found = _update_collectives(CROSS_ELEMENT["clip_in_chain"](), stage)
    assert found and {c.kind for c in found} == {"all-reduce"}  # the global norm, a scalar
    assert all(b.elements == 1 for c in found for b in c.buffers)


def test_l2_penalty_over_tree_leaves_is_refused_per_layer():
    from _models import gpt, gpt_batches

    model, params = gpt()

    def l2(p, batch):
        return model.loss_fn(p, batch) + 1e-3 * sum(jnp.sum(x**2) for x in jax.tree.leaves(p))

    for stage in (2, 3):
        engine = jaxzero.Engine(
            l2,
            optax.adam(1e-2),
            mesh=jaxzero.make_mesh(N),
            stage=stage,
            per_layer=True,
            stacked="^blocks/",
        )
        state = engine.init(params)
        with pytest.raises(
            TypeError,
            match=r"(?s)only through jaxzero.use_params.*integer_pow at "
            r".*test_optimizers.py.*'blocks/fc/kernel'",
        ):
            engine.step(state, gpt_batches(1)[0])
    # coarse mode gathers the whole tree itself: the same loss trains right
    ref_losses, _ = train_reference(l2, params, gpt_batches(3), optax.adam(1e-2))
    engine = jaxzero.Engine(l2, optax.adam(1e-2), mesh=jaxzero.make_mesh(N), stage=3)
    losses, _, _ = train_engine(engine, params, gpt_batches(3))
    assert rel_diff(losses, ref_losses) <= 1e-5


def test_reparametrisation_before_use_params_is_refused():
    D = 64

    def loss(p, b):
        layer = jax.tree.map(lambda x: x * jax.nn.sigmoid(x), p["layer"])  # before the hook
        layer = jaxzero.use_params(layer)
        return jnp.mean((jnp.tanh(b["x"] @ layer["w"]) - b["y"]) ** 2)

    params = {"layer": {"w": np.eye(D, dtype=np.float32)}}
    engine = jaxzero.Engine(
        loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(N), stage=3, per_layer=True
    )
    state = engine.init(params)
    batch = {"x": np.ones((8, D), np.float32), "y": np.zeros((8, D), np.float32)}
    with pytest.raises(TypeError, match=r"logistic at .*: 'layer/w'"):
        engine.step(state, batch)


def test_indexing_stacked_layers_before_use_params_is_allowed():
    """A Python loop over stacked layers (``x[i]`` on each leaf) is a view, not a use."""
    L, D = 3, 64
    rng = np.random.default_rng(0)
    params = {"w": (rng.standard_normal((L, D, D)) / D**0.5).astype(np.float32)}

    def loss(p, b):
        h = b["x"]
        for i in range(L):
            layer = jaxzero.use_params(jax.tree.map(lambda x, i=i: x[i], p))
            h = jnp.tanh(h @ layer["w"])
        return jnp.mean((h - b["y"]) ** 2)

    batches = [
        {
            "x": rng.standard_normal((16, D)).astype(np.float32),
            "y": rng.standard_normal((16, D)).astype(np.float32),
        }
        for _ in range(3)
    ]
    ref_losses, ref_params = train_reference(loss, params, batches, optax.adam(1e-2))
    engine = jaxzero.Engine(
        loss, optax.adam(1e-2), mesh=jaxzero.make_mesh(N), stage=3, per_layer=True, stacked="^w"
    )
    losses, final, _ = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= 1e-5 and rel_diff(final, ref_params) <= 1e-5
