"""Per-backend compilation choices: donation and the XLA option presets."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
    TINY_GPT,
    eigen_dots,
    gpt,
    gpt_batches,
    mlp_batches,
    mlp_loss,
    mlp_params,
    rel_diff,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero
from jaxzero import backend
from jaxzero.accounting.comm import collectives_from_hlo
from jaxzero.models.gpt import GPT, GPTConfig, attention_impl


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(backend.GPU_OPTIONS))
def test_gpu_preset_options_exist_in_this_xla(name):
    """XLA rejects an unknown option at compile time; the GPU plugin ships the same XLA
    as this jaxlib, so every preset option must be known here in one of its spellings."""
    assert backend.spelled("cpu", name, backend.GPU_OPTIONS[name]) is not None


def _gpu_here(monkeypatch):
    """compiler_options as on a GPU, asking this jaxlib's XLA (the same options parser)."""
    known = backend._known
    monkeypatch.setattr(backend, "platform", lambda m: "gpu")
    monkeypatch.setattr(backend, "_known", lambda plat, k, v: known("cpu", k, v))


@pytest.mark.unit
def test_renamed_pipelining_options_take_this_xlas_spelling(monkeypatch):
    """jaxlib 0.10 knows only xla_gpu_enable_pipelined_* (bool), 0.12 only
    xla_gpu_pipeline_* (mode): the preset keeps pipelining on either, dropping nothing."""
    _gpu_here(monkeypatch)
    mesh = jaxzero.make_mesh(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not know" warning
        opts = backend.compiler_options(mesh)
    assert len(opts) == len(backend.GPU_OPTIONS)
    for c in ("all_gather", "reduce_scatter", "all_reduce"):
        new, old = f"xla_gpu_pipeline_{c}", f"xla_gpu_enable_pipelined_{c}"
        assert (opts.get(new) == backend.PIPELINE_ON) != (opts.get(old) is True), opts
        assert backend._known("cpu", *next((k, v) for k, v in opts.items() if k in (new, old)))
    # either spelling overrides, or drops, the preset's option
    for name, value in [
        ("xla_gpu_enable_pipelined_all_gather", False),
        ("xla_gpu_pipeline_all_gather", "COLLECTIVE_PIPELINING_MODE_OFF"),
    ]:
        got = backend.compiler_options(mesh, {name: value})
        ag = {k: v for k, v in got.items() if "pipeline" in k and "all_gather" in k}
        assert ag in (
            {"xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_OFF"},
            {"xla_gpu_enable_pipelined_all_gather": False},
        )
    for name in ("xla_gpu_enable_pipelined_reduce_scatter", "xla_gpu_pipeline_reduce_scatter"):
        got = backend.compiler_options(mesh, {name: None})
        assert not any("reduce_scatter" in k and "pipelin" in k for k in got)


@pytest.mark.unit
def test_options_per_platform_and_overrides(monkeypatch):
    mesh = jaxzero.make_mesh(2)
    assert backend.platform(mesh) == "cpu"
    assert backend.compiler_options(mesh) == {}
    assert backend.compiler_options(mesh, {"xla_cpu_enable_fast_math": False}) == {
        "xla_cpu_enable_fast_math": False
    }

    monkeypatch.setattr(backend, "platform", lambda m: "gpu")
    monkeypatch.setattr(backend, "_known", lambda plat, k, v: True)
    assert backend.compiler_options(mesh) == backend.GPU_OPTIONS
    opts = backend.compiler_options(
        mesh,
        {
            "xla_gpu_enable_while_loop_double_buffering": None,  # drop from the preset
            "xla_gpu_all_gather_combine_threshold_bytes": 1 << 20,  # change
        },
    )
    assert "xla_gpu_enable_while_loop_double_buffering" not in opts
    assert opts["xla_gpu_all_gather_combine_threshold_bytes"] == 1 << 20
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True


@pytest.mark.unit
def test_preset_option_unknown_to_this_xla_is_dropped_with_a_warning(monkeypatch):
    monkeypatch.setitem(
        backend.PRESETS, "cpu", {"xla_gpu_no_such_pass": True, "xla_cpu_enable_fast_math": False}
    )
    with pytest.warns(UserWarning, match="xla_gpu_no_such_pass"):
        opts = backend.compiler_options(jaxzero.make_mesh(1))
    assert opts == {"xla_cpu_enable_fast_math": False}


@pytest.mark.unit
def test_bad_user_option_is_a_clear_error():
    with pytest.raises(ValueError, match="xla_no_such_option.*not an option"):
        jaxzero.Engine(
            mlp_loss,
            optax.sgd(0.1),
            mesh=jaxzero.make_mesh(1),
            compiler_options={"xla_no_such_option": True},
        )


def test_compiler_options_reach_the_compiled_step():
    """An option that visibly changes the program: without the main fusion pass, XLA:CPU
    falls back to many small loop fusions (its MLIR fusion emitters wrap every op in one),
    or to a few (jaxlib 0.10's legacy emitters, which lane py311's tests compile with:
    conftest.py)."""
    params, batch = mlp_params(), mlp_batches(1)[0]
    fusions = {}
    for opts in (None, {"xla_disable_hlo_passes": "fusion"}):
        engine = jaxzero.Engine(
            mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(2), stage=1, compiler_options=opts
        )
        fusions[bool(opts)] = engine.compile(engine.init(params), batch).as_text().count(" fusion(")
    assert max(fusions.values()) > 2 * min(fusions.values()) > 0, fusions


def test_donation_switch():
    """Both settings train identically; only a donating step consumes its input."""
    params, batches = mlp_params(), mlp_batches(3)
    finals = {}
    for donate in (True, False):
        engine = jaxzero.Engine(
            mlp_loss, optax.adam(1e-2), mesh=jaxzero.make_mesh(2), stage=1, donate=donate
        )
        assert engine.donate is donate
        state = engine.init(params)
        for b in batches:
            old = state
            state, _ = engine.step(state, b)
            assert jax.tree.leaves(old.opt_state)[1].is_deleted() is donate
        finals[donate] = engine.gather_params(state)
    assert rel_diff(finals[True], finals[False]) == 0
    for stage in range(4):  # on CPUs the default donates at stage 3 only
        default = jaxzero.Engine(mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=stage)
        assert default.donate is (stage == 3) and backend.DONATE["cpu"] == (3,)
    with pytest.raises(TypeError, match="donate must be True, False or None"):
        jaxzero.Engine(mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(1), donate="yes")


def _token_mlp_loss(p, batch):
    """Three dense layers on B x S x D activations, as in a transformer's MLP."""
    h = jnp.tanh(batch["x_BxSxD"] @ p["w0"])
    h = jnp.tanh(h @ p["w1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def _token_mlp(d=16):
    rng = np.random.default_rng(0)
    params = {
        "w0": rng.standard_normal((d, 2 * d)),
        "w1": rng.standard_normal((2 * d, 2 * d)),
        "w2": rng.standard_normal((2 * d, 4)),
    }
    params = jax.tree.map(lambda w: (0.3 * w).astype(np.float32), params)
    batches = [
        {
            "x_BxSxD": rng.standard_normal((8, 8, d)).astype(np.float32),
            "y": rng.standard_normal((8, 8, 4)).astype(np.float32),
        }
        for _ in range(3)
    ]
    return params, batches


def _plain_jit_eigen_dots(params, batch, tx, mesh):
    def step(state, b):
        p, opt = state
        u, opt = tx.update(jax.grad(_token_mlp_loss)(p, b), opt, p)
        return optax.apply_updates(p, u), opt

    p = jax.device_put(params, NamedSharding(mesh, P()))
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    return eigen_dots(jax.jit(step).lower((p, tx.init(p)), b).compile().as_text())


@pytest.mark.unit
def test_bucket_defaults_per_platform(monkeypatch):
    """None: 64 MiB, a CPU whole-tree call one collective a leaf; a number: both."""
    mesh = jaxzero.make_mesh(2)
    assert backend.bucket_bytes(None, mesh) == (64 << 20, 0)
    assert backend.bucket_bytes(0.5, mesh) == (1 << 19, 1 << 19)
    monkeypatch.setattr(backend, "platform", lambda m: "gpu")
    assert backend.bucket_bytes(None, mesh) == (64 << 20, 64 << 20)
    for bad in (-1, True, "64"):
        with pytest.raises(ValueError, match="bucket_mb must be a non-negative number"):
            backend.bucket_bytes(bad, mesh)


@pytest.mark.parametrize("stage, bucket_mb", [(3, None), (3, 64), (2, None)])
def test_whole_tree_collectives_go_leaf_by_leaf_at_stage_3_on_cpu_by_default(stage, bucket_mb):
    """A per_layer=False step: by default (on CPUs) stage 3 sends one all-gather and one
    reduce-scatter per sharded leaf; stage 2 packs its reduce-scatter (and its end-of-step
    all-gather) into one, as stage 1 does; an explicit bucket_mb packs as asked."""
    params, batches = mlp_params(), mlp_batches(1)
    engine = jaxzero.Engine(
        mlp_loss, optax.adam(1e-2), mesh=jaxzero.make_mesh(2), stage=stage, bucket_mb=bucket_mb
    )
    state = engine.init(params)
    found = collectives_from_hlo(engine.compile(state, batches[0]).as_text()).collectives
    lays = jax.tree.leaves(engine.layouts, is_leaf=lambda x: isinstance(x, jaxzero.LeafLayout))
    sharded = sum(lay.sharded for lay in lays)
    assert sharded > 1
    per_leaf = stage == 3 and bucket_mb is None
    for kind in ("all-gather", "reduce-scatter"):
        assert len([c for c in found if c.kind == kind]) == (sharded if per_leaf else 1)


# stage 0's gradients; the use_params backward; accumulated over micro-batches
@pytest.mark.parametrize("stage, micro_batches", [(0, 1), (2, 1), (1, 2)])
def test_dot_barrier_switch(stage, micro_batches):
    """The barrier changes which kernel XLA:CPU runs the weight-gradient dots with, not
    the math: on and off train alike (to fp32 rounding: the kernels sum in different
    orders). With it, as in plain jit, no dot is left to Eigen; without it all three
    weight-gradient dots are."""
    params, batches = _token_mlp()
    tx, mesh = optax.adam(1e-2), jaxzero.make_mesh(2)
    finals, unfused = {}, {}
    for on in (True, False):
        engine = jaxzero.Engine(
            _token_mlp_loss, tx, mesh=mesh, stage=stage, micro_batches=micro_batches, dot_barrier=on
        )
        state = engine.init(params)
        unfused[on] = eigen_dots(engine.compile(state, batches[0]).as_text())
        for b in batches:
            state, _ = engine.step(state, b)
        finals[on] = engine.gather_params(state)
    assert rel_diff(finals[True], finals[False]) < 1e-5
    assert unfused == {True: _plain_jit_eigen_dots(params, batches[0], tx, mesh), False: 3}
    assert unfused[True] == 0
    assert jaxzero.Engine(mlp_loss, tx, mesh=jaxzero.make_mesh(1)).dot_barrier is True  # CPU
    with pytest.raises(TypeError, match="dot_barrier must be True, False or None"):
        jaxzero.Engine(mlp_loss, tx, mesh=jaxzero.make_mesh(1), dot_barrier=1)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_dot_barrier_skips_an_embeddings_scatter_add(stage, monkeypatch):
    """Only weight gradients pass the barrier (its two transposes of an embedding's
    scatter-add gradient were pure cost); training is the same either way."""
    from jaxzero import collectives

    rng = np.random.default_rng(0)
    params = {
        "emb": (0.3 * rng.standard_normal((64, 16))).astype(np.float32),
        "w": (0.3 * rng.standard_normal((16, 24))).astype(np.float32),
        "b": np.zeros((24,), np.float32),
    }
    batch = {"t": rng.integers(0, 64, (8, 5)).astype(np.int32)}

    def loss(p, b):
        return jnp.mean(jnp.tanh(p["emb"][b["t"]] @ p["w"] + p["b"]) ** 2)

    seen, barrier = [], collectives.dot_barrier
    monkeypatch.setattr(collectives, "dot_barrier", lambda g: seen.append(g.shape) or barrier(g))
    tx, mesh = optax.adam(1e-2), jaxzero.make_mesh(2)
    finals = {}
    for on in (True, False):
        engine = jaxzero.Engine(loss, tx, mesh=mesh, stage=stage, dot_barrier=on)
        state, _ = engine.step(engine.init(params), batch)
        finals[on] = engine.gather_params(state)
    assert seen == [(16, 24)]  # traced once, with the barrier on, for w alone
    assert rel_diff(finals[True], finals[False]) < 1e-5


def test_dot_barrier_reaches_scanned_layers():
    """In a scan over layers the weight-gradient dots sit in the loop body, where a barrier
    after the backward pass comes too late: ``use_params``'s backward applies it there, at
    stages 0-1 as well as 2-3 (whose hooks test_dot_barrier_switch covers)."""
    model, batch = GPT(TINY_GPT), gpt_batches(1)[0]
    counts = {}
    for on in (True, False):
        engine = model.engine(optax.adam(1e-3), mesh=jaxzero.make_mesh(2), stage=1, dot_barrier=on)
        state = engine.init_from(model.init, jax.random.key(0))
        counts[on] = eigen_dots(engine.compile(state, batch).as_text())
    assert counts[True] == 0 < counts[False]


def test_attention_choice():
    assert attention_impl("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert attention_impl("auto", jnp.float16, "gpu") == "cudnn"
    assert attention_impl("auto", jnp.float32, "gpu") == "xla"  # cuDNN's kernel is 16-bit
    assert attention_impl("auto", jnp.bfloat16, "cpu") == "xla"
    assert attention_impl("xla", jnp.bfloat16, "gpu") == "xla"
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        GPTConfig(attention="flash")
    cfg = dict(seq_len=8, d_model=16, n_layers=1, n_heads=2)
    _, params = gpt(GPTConfig(**cfg))
    tokens = jnp.zeros((1, 8), jnp.int32)
    auto = GPT(GPTConfig(**cfg, attention="auto")).apply(params, tokens)
    xla = GPT(GPTConfig(**cfg, attention="xla")).apply(params, tokens)
    np.testing.assert_array_equal(auto, xla)  # on CPU, auto is XLA's attention
