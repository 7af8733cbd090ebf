"""Every stage, on 1, 2 and 8 devices, trains exactly like one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
    TINY_GPT,
    gpt,
    gpt_batches,
    mlp_batches,
    mlp_loss,
    mlp_params,
    rel_diff,
    train_engine,
    train_reference,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero
from jaxzero.engine import gather_leaf
from jaxzero.models.gpt import GPT

STEPS = 10
TX = optax.adamw(1e-3, weight_decay=0.1)


@pytest.fixture(scope="module")
def gpt_reference():
    model, params = gpt()
    batches = gpt_batches(STEPS)
    return model, params, batches, train_reference(model.loss_fn, params, batches, TX)


@pytest.fixture(scope="module")
def mlp_reference():
    params, batches = mlp_params(), mlp_batches(STEPS)
    return params, batches, train_reference(mlp_loss, params, batches, TX)


@pytest.mark.parametrize("n", [1, 8])  # 2 devices: the odd MLP's and the buckets' grids
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_matches_one_device(gpt_reference, stage, n):
    model, params, batches, (ref_losses, ref_params) = gpt_reference
    engine = model.engine(TX, mesh=jaxzero.make_mesh(n), stage=stage)
    losses, final, _ = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= 1e-5
    assert rel_diff(final, ref_params) <= 1e-5
    assert jax.tree.structure(final) == jax.tree.structure(params)


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_odd_mlp_matches_one_device(mlp_reference, stage, n):
    params, batches, (ref_losses, ref_params) = mlp_reference
    engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(n), stage=stage)
    losses, final, _ = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= 1e-5
    assert rel_diff(final, ref_params) <= 1e-5


@pytest.mark.parametrize("bucket_mb", [0, 0.002])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bucket_sizes_match_one_device(mlp_reference, stage, bucket_mb):
    """One collective per leaf (0) and ~2 KB buckets (w1 and w2 apart) train alike."""
    params, batches, (ref_losses, ref_params) = mlp_reference
    engine = jaxzero.Engine(
        mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=stage, bucket_mb=bucket_mb
    )
    losses, final, _ = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= 1e-5
    assert rel_diff(final, ref_params) <= 1e-5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_micro_batches_and_clipping_match(mlp_reference, stage):
    params, batches, _ = mlp_reference
    tx = optax.chain(optax.clip_by_global_norm(0.05), TX)
    ref_losses, ref_params = train_reference(mlp_loss, params, batches, tx)
    engine = jaxzero.Engine(
        mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=stage, micro_batches=2, max_grad_norm=0.05
    )
    losses, final, _ = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= 1e-5
    assert rel_diff(final, ref_params) <= 1e-5


BF16_LOSS_TOL = 2e-2  # documented in README: bf16 vs fp32 training, 10 steps


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("reduce_dtype", [None, "fp32"])
def test_bf16_within_tolerance_of_fp32(gpt_reference, stage, reduce_dtype):
    model, params, batches, (ref_losses, _) = gpt_reference
    engine = model.engine(
        TX, mesh=jaxzero.make_mesh(8), stage=stage, precision="bf16", reduce_dtype=reduce_dtype
    )
    losses, _, state = train_engine(engine, params, batches)
    assert rel_diff(losses, ref_losses) <= BF16_LOSS_TOL
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(state.master)} == {np.dtype("float32")}


def test_grad_norm_is_the_global_norm(mlp_reference):
    params, batches, _ = mlp_reference
    want = float(optax.tree.norm(jax.grad(mlp_loss)(params, batches[0])))
    for stage in (0, 3):
        engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=stage)
        _, metrics = engine.step(engine.init(params), batches[0])
        np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=1e-5)


def test_init_from_creates_sharded_state():
    model, _ = gpt()
    engine = model.engine(TX, mesh=jaxzero.make_mesh(8), stage=3)
    state = engine.init_from(model.init, jax.random.key(0))
    wte, lay = state.params["wte"], engine.layouts["wte"]
    assert not wte.is_fully_replicated
    assert wte.addressable_shards[0].data.shape[lay.dim] * 8 == wte.shape[lay.dim]
    assert rel_diff(engine.gather_params(state), gpt()[1]) < 1e-6


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stage": 4}, "stage must be 0, 1, 2 or 3"),
        ({"precision": "fp8"}, "unknown precision"),
        ({"reduce_dtype": "int8"}, "unknown reduce_dtype"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"bucket_mb": -1}, "bucket_mb must be a non-negative"),
    ],
)
def test_bad_engine_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(2), **kwargs)


def test_bad_batches():
    engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=3, micro_batches=2)
    state = engine.init(mlp_params())
    b = mlp_batches(1, batch=24)[0]
    with pytest.raises(ValueError, match="global batch 24 is not divisible by 8 devices x 2"):
        engine.step(state, b)
    with pytest.raises(ValueError, match="same leading"):
        engine.step(state, {"x": b["x"][:16], "y": b["y"][:8]})
    state, _ = engine.step(state, mlp_batches(1)[0])
    with pytest.raises(ValueError, match="batch structure changed"):
        engine.step(state, {"x": b["x"][:16], "y": b["y"][:16], "z": b["y"][:16]})


def test_param_used_without_hook_is_named():
    def loss(p, b):
        return mlp_loss(p, b)  # never calls use_params

    engine = jaxzero.Engine(loss, TX, mesh=jaxzero.make_mesh(8), stage=3, per_layer=True)
    state = engine.init(mlp_params())
    with pytest.raises(TypeError, match="'w1' is used without jaxzero.use_params"):
        engine.step(state, mlp_batches(1)[0])


@pytest.mark.parametrize("stage", [1, 3])
def test_hybrid_mesh_matches_one_device(mlp_reference, stage):
    """Shard over 4 devices, replicate over 2 groups: the batch still splits 8 ways."""
    params, batches, (ref_losses, ref_params) = mlp_reference
    engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8, replicas=2), stage=stage)
    losses, final, state = train_engine(engine, params, batches)
    assert engine.num_shards == 4
    assert rel_diff(losses, ref_losses) <= 1e-5 and rel_diff(final, ref_params) <= 1e-5


def test_untied_gpt_and_eval_loss():
    model, params = gpt(dataclasses.replace(TINY_GPT, tie_embeddings=False))
    batches = gpt_batches(3)
    ref_losses, ref_params = train_reference(model.loss_fn, params, batches, TX)
    engine = model.engine(TX, mesh=jaxzero.make_mesh(8), stage=3)
    losses, final, state = train_engine(engine, params, batches)
    assert "head" in final and rel_diff(final, ref_params) <= 1e-5
    want = float(model.loss_fn(ref_params, batches[0]))
    np.testing.assert_allclose(float(engine.eval_loss(state, batches[0])), want, rtol=1e-5)


def test_batch_on_one_device_is_resharded(mlp_reference):
    params, batches, _ = mlp_reference
    engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=3)
    placed, m0 = engine.step(engine.init(params), batches[0])  # host batch, placed by the engine
    on_one = jax.device_put(batches[0], jax.devices()[3])
    state, m1 = engine.step(engine.init(params), on_one)
    with pytest.raises(ValueError, match="global batch 12 is not divisible by 8 devices"):
        engine.step(state, jax.tree.map(lambda x: x[:12], on_one))
    # the same rows, so the same step: the one-device batch was split over the 8, not misread
    assert float(m1["loss"]) == float(m0["loss"]) and float(m1["grad_norm"]) == float(
        m0["grad_norm"]
    )
    assert rel_diff(engine.gather_params(state), engine.gather_params(placed)) == 0.0
    np.testing.assert_allclose(float(m1["loss"]), mlp_reference[2][0][0], rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_init_warns_only_about_converted_params(stage):
    import warnings

    params = mlp_params()
    engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=stage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no donated-buffer warning, nothing else
        engine.init(params)
    params["w1"] = params["w1"].astype(np.float64)
    params["b2"] = params["b2"].astype(np.float16)
    with pytest.warns(
        UserWarning,
        match=r"2 param\(s\) converted: b2 \(float16\), w1 "
        r"\(float64\)",
    ):
        state = engine.init(params)
    assert state.params["w1"].dtype == np.float32


def test_optimizer_is_required():
    mesh = jaxzero.make_mesh(1)
    with pytest.raises(TypeError, match="optimizer"):
        jaxzero.Engine(mlp_loss, mesh=mesh)
    with pytest.raises(TypeError, match=r"pass an optax transformation, e\.g\. optax\.adamw"):
        jaxzero.Engine(mlp_loss, None, mesh=mesh)
    with pytest.raises(TypeError, match="must be an optax transformation.*'adamw'"):
        jaxzero.Engine(mlp_loss, "adamw", mesh=mesh)
    with pytest.raises(TypeError, match="optimizer"):
        GPT(TINY_GPT).engine(mesh=mesh)


OWN_LOOP_STEPS = 4


@pytest.fixture(scope="module")
def stepped(mlp_reference):
    """Per stage: an engine on 8 devices and what 4 calls of ``engine.step`` gave (losses,
    the params after each step), made once for the tests of ``engine.step_fn``."""
    params, batches, _ = mlp_reference
    batches = batches[:OWN_LOOP_STEPS]
    runs = {}

    def run(stage):
        if stage not in runs:
            engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), stage=stage)
            state, losses, after = engine.init(params), [], []
            for b in batches:
                state, metrics = engine.step(state, b)
                losses.append(np.asarray(metrics["loss"]))
                after.append(engine.gather_params(state))
            runs[stage] = engine, np.array(losses), after
        return runs[stage]

    return params, batches, run


def test_step_fn_needs_init():
    engine = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(1))
    for name in ("step_fn", "state_shardings"):
        with pytest.raises(RuntimeError, match=r"engine.init\(params\)"):
            getattr(engine, name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_own_jit_scans_step_fn_like_engine_step(stepped, stage):
    """A user's own ``jax.jit`` of ``lax.scan`` over the public step, four batches stacked
    on a leading axis, trains as four calls of ``engine.step``. Bit-equal with jax 0.10;
    with 0.12 stages 1-3 differ by an ulp or two in a few elements (relative 6e-8 at
    most): XLA:CPU compiles the loop body on its own, and its weight-gradient dot, which
    reads a dynamic slice of the stacked batches instead of the step's batch parameter,
    rounds differently. A jit of the step alone is bit-equal on both (the EMA test)."""
    params, batches, run = stepped
    engine, losses, after = run(stage)
    sh = engine.state_shardings
    stacked = NamedSharding(engine.mesh, P(None, *engine.batch_sharding.spec))
    scan = jax.jit(
        lambda state, bs: jax.lax.scan(engine.step_fn, state, bs),
        in_shardings=(sh, stacked),
        out_shardings=(sh, None),
        donate_argnums=0,
        compiler_options=engine.compiler_options or None,
    )
    stack = jax.tree.map(lambda *xs: np.stack(xs), *batches)
    state, metrics = scan(engine.init(params), stack)
    assert int(state.step) == OWN_LOOP_STEPS
    np.testing.assert_allclose(np.asarray(metrics["loss"]), losses, rtol=1e-6)
    assert rel_diff(engine.gather_params(state), after[-1]) <= 1e-6


@pytest.mark.parametrize("stage", [0, 3])
def test_step_fn_wrapped_with_an_ema_of_params(stepped, stage):
    """The step wrapped in a function of the user's (an EMA of the params beside the state,
    in the params' stored layout), jitted per step: the same params as ``engine.step``,
    bit for bit, and their EMA."""
    params, batches, run = stepped
    engine, losses, after = run(stage)
    decay = 0.5

    def ema_step(state, ema, batch):
        state, metrics = engine.step_fn(state, batch)
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, state.params)
        return state, ema, metrics

    sh = engine.state_shardings
    step = jax.jit(
        ema_step,
        in_shardings=(sh, sh.params, engine.batch_sharding),
        out_shardings=(sh, sh.params, None),
        donate_argnums=(0, 1),
    )
    state = engine.init(params)
    ema = jax.tree.map(jnp.copy, state.params)
    want = params
    for b, p in zip(batches, after, strict=True):
        state, ema, _ = step(state, ema, engine.shard_batch(b))
        want = jax.tree.map(lambda e, q: decay * e + (1 - decay) * q, want, p)
    got = jax.tree.map(gather_leaf, ema, engine.layouts)
    assert rel_diff(engine.gather_params(state), after[-1]) == 0
    assert rel_diff(got, want) <= 1e-6
