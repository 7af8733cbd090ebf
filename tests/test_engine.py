"""Every stage, on 1, 2 and 8 devices, trains exactly like one device."""

import jax
import numpy as np
import optax
import pytest
from _models import (
    gpt,
    gpt_batches,
    mlp_batches,
    mlp_loss,
    mlp_params,
    rel_diff,
    train_engine,
    train_reference,
)

import jaxzero

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


@pytest.mark.parametrize("n", [1, 2, 8])
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
    ref = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
    assert rel_diff(engine.gather_params(state), ref) < 1e-6


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
    from _models import TINY_GPT

    from jaxzero.models.gpt import GPT

    model = GPT(TINY_GPT.__class__(**{**TINY_GPT.__dict__, "tie_embeddings": False}))
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
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
    state = engine.init(params)
    on_one = jax.device_put(batches[0], jax.devices()[3])
    state, m1 = engine.step(state, on_one)
    with pytest.raises(ValueError, match="global batch 12 is not divisible by 8 devices"):
        engine.step(state, jax.tree.map(lambda x: x[:12], on_one))
    assert np.isfinite(float(m1["loss"]))


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
