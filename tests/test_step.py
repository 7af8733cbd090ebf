"""What the compiled step does per stage: its collectives, its memory, its state bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import TINY_GPT, gpt, gpt_batches, mlp_batches, mlp_loss, mlp_params, rel_diff
from jax.sharding import PartitionSpec as P

import jaxzero
from jaxzero.accounting.comm import collectives_from_hlo
from jaxzero.mesh import DATA
from jaxzero.models.gpt import GPT, GPTConfig

N = 8


def _collectives(stage, precision="fp32"):
    model, params = gpt()
    engine = model.engine(
        optax.adamw(1e-3), mesh=jaxzero.make_mesh(N), stage=stage, precision=precision
    )
    compiled = engine.compile(
        engine.abstract_state(jax.eval_shape(lambda: params)), gpt_batches(1)[0]
    )
    found = {}
    for c in collectives_from_hlo(compiled.as_text()).collectives:
        if max(b.elements for b in c.buffers) > 1:  # ignore the scalar loss / norm
            found.setdefault(c.kind, []).append(c)
    return found


def _in_layer_loop(cs):
    return {c.computation for c in cs if c.runs == TINY_GPT.n_layers}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_per_stage(stage):
    found = _collectives(stage)
    if stage == 0:
        assert "all-reduce" in found
        assert "reduce-scatter" not in found and "all-gather" not in found
        return
    assert "reduce-scatter" in found and "all-gather" in found
    scatter_loops = _in_layer_loop(found["reduce-scatter"])
    gather_loops = _in_layer_loop(found["all-gather"])
    if stage == 1:  # full gradients first, one reduce-scatter after the backward pass
        assert not scatter_loops and not gather_loops
        assert len(found["reduce-scatter"]) == 1  # every leaf in one bucket
    if stage == 2:  # reduce-scatter per layer, inside the backward loop
        assert scatter_loops and not gather_loops
    if stage in (1, 2):  # the updated params: one bucket, one all-gather
        assert len(found["all-gather"]) == 1
    if stage == 3:  # gathered per layer in the forward loop and again in the backward loop
        assert len(gather_loops) == 2 and scatter_loops <= gather_loops


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def test_peak_memory_decreases_with_stage():
    """Model states dominate: d_model 512, 8 layers, one sequence per device."""
    model = GPT(GPTConfig(seq_len=64, d_model=512, n_layers=8, n_heads=8))
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((N, 64), jnp.int32) for k in ("inputs", "targets")}
    peaks = []
    for stage in range(4):
        engine = model.engine(optax.adamw(1e-3), mesh=jaxzero.make_mesh(N), stage=stage)
        peaks.append(_peak(engine.compile(engine.abstract_state(shapes), batch)))
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3], peaks


def _device0_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_persistent_bytes_match_formulas(stage, precision):
    """Design doc: params 4|2 B, master 0|4 B, Adam moments 8 B per param, / N when sharded."""
    rng = np.random.default_rng(0)  # no dimension divides by 8: padding is counted
    params = {
        "w1": rng.standard_normal((97, 515)),
        "b1": np.zeros(515),
        "w2": rng.standard_normal((515, 301)),
        "b2": np.zeros(301),
    }
    engine = jaxzero.Engine(
        lambda p, b: 0.0,
        optax.adam(1e-3),
        mesh=jaxzero.make_mesh(N),
        stage=stage,
        precision=precision,
    )
    state = engine.init(jax.tree.map(lambda x: x.astype(np.float32), params))
    psi = engine.num_params
    param_bytes = 4 if precision == "fp32" else 2
    want = {
        "params": param_bytes * psi / (N if stage == 3 else 1),
        "master": 0 if precision == "fp32" else 4 * psi / (N if stage >= 1 else 1),
        "opt_state": 8 * psi / (N if stage >= 1 else 1),
    }
    got = {
        "params": _device0_bytes(state.params),
        "master": _device0_bytes(state.master),
        "opt_state": _device0_bytes(state.opt_state),
    }
    for part, w in want.items():
        if w == 0:
            assert got[part] == 0
        else:
            assert 0.98 <= got[part] / w <= 1.02, (part, got[part], w)


def test_balance_of_reference_gpt():
    model = GPT(GPTConfig(seq_len=128, d_model=512, n_layers=8, n_heads=8))
    engine = model.engine(optax.adamw(1e-3), mesh=jaxzero.make_mesh(N), stage=3)
    engine.abstract_state(jax.eval_shape(model.init, jax.random.key(0)))
    assert jaxzero.partition.balance(engine.layouts) <= 1.02


# --- the shard_map contract: check_vma=False (jaxzero/step.py's docstring) -----------


def _copies_differ(tree) -> list[str]:
    """Replicated arrays whose devices hold different values. With check_vma=False an
    ``out_specs=P()`` is a promise: each device's result becomes its copy, unchecked."""
    bad = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(x, jax.Array) and x.sharding.is_fully_replicated:
            first = np.asarray(x.addressable_shards[0].data)
            if any(not np.array_equal(s.data, first) for s in x.addressable_shards[1:]):
                bad.append(jax.tree_util.keystr(path))
    return bad


def _zero_carry_loss(p, batch):
    """``mlp_loss`` summed row by row in a scan whose carry starts at ``jnp.zeros``:
    plain JAX, which check_vma=True would refuse to trace (the loss is user code)."""

    def row(total, xy):
        return total + mlp_loss(p, {"x": xy[0][None], "y": xy[1][None]}), None

    total, _ = jax.lax.scan(row, jnp.zeros(()), (batch["x"], batch["y"]))
    return total / batch["x"].shape[0]


@pytest.mark.parametrize("stage, replicas", [(0, 1), (0, 2), (3, 1)])
def test_grad_norm_splits_large_whole_leaves_over_devices(stage, replicas):
    """A whole gradient leaf of at least gradients.SPLIT_NORM_MIN elements has each device sum
    the squares of its 1/N (an odd size: the first device takes the remainder), then
    one psum: the norm is still the one-device norm, the same on every device."""
    from jaxzero import gradients

    rng = np.random.default_rng(0)
    rows = gradients.SPLIT_NORM_MIN // 131 + 2  # 252 x 131: 33012 elements, 33012 % 8 == 4
    params = {"table": rng.standard_normal((rows, 131)).astype(np.float32), "b": np.ones(3)}
    params["b"] = params["b"].astype(np.float32)
    batch = {"i": rng.integers(0, rows, (16,)).astype(np.int32)}

    def loss(p, b):
        rows_used = jnp.sin(p["table"][b["i"]]).sum(-1)[:, None] * p["b"]
        return jnp.mean(rows_used) + jnp.sum(jnp.cos(p["table"]))  # every element counts

    grads = jax.grad(loss)(jax.tree.map(jnp.asarray, params), batch)
    mesh = jaxzero.make_mesh(N, replicas=replicas)
    engine = jaxzero.Engine(loss, optax.sgd(0.1), mesh=mesh, stage=stage)
    state, metrics = engine.step(engine.init(params), batch)
    assert rel_diff(metrics["grad_norm"], optax.tree.norm(grads)) <= 1e-6
    assert _copies_differ(metrics) == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_gives_the_one_device_gradient_on_every_device(stage):
    """SGD at rate 1 moves the params by the gradient. The step's first shard_map must
    give the one-device gradient (JAX summing it too would make it N times that, the
    stage-0 result with check_vma=True), and every P() output (loss, norm, stage 0's
    reduced gradients, the params stages 1-2 all-gather) must be the same on every device."""
    params, batch = mlp_params(), mlp_batches(1)[0]
    loss, grads = jax.value_and_grad(_zero_carry_loss)(jax.tree.map(jnp.asarray, params), batch)
    engine = jaxzero.Engine(
        _zero_carry_loss, optax.sgd(1.0), mesh=jaxzero.make_mesh(N), stage=stage
    )
    state, metrics = engine.step(engine.init(params), batch)
    moved = jax.tree.map(lambda a, b: a - b, params, engine.gather_params(state))
    assert rel_diff(moved, grads) <= 1e-5
    assert rel_diff(metrics["loss"], loss) <= 1e-6
    assert rel_diff(metrics["grad_norm"], optax.tree.norm(grads)) <= 1e-6
    assert _copies_differ((state, metrics)) == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_eval_loss_is_the_one_device_loss_on_every_device(stage):
    """The engine's eval shard_map: its P() output is a pmean, the same everywhere."""
    params, batch = mlp_params(), mlp_batches(1)[0]
    engine = jaxzero.Engine(
        _zero_carry_loss, optax.sgd(1.0), mesh=jaxzero.make_mesh(N), stage=stage
    )
    got = engine.eval_loss(engine.init(params), batch)
    assert rel_diff(got, _zero_carry_loss(params, batch)) <= 1e-6
    assert _copies_differ(got) == []


def test_shard_map_semantics_the_step_relies_on():
    """What check_vma=False gives and check_vma=True would change, in miniature, so a
    JAX release that changes either (or a flip of the flag) shows up here first."""
    mesh = jaxzero.make_mesh(N)
    w, x = jnp.arange(3.0), jnp.arange(3.0 * N).reshape(N, 3)

    def stage0(w, x):  # a local gradient, then the explicit all-reduce
        return jax.lax.psum(jax.grad(lambda w: jnp.sum(x @ w))(w), DATA)

    def run(f, vma, specs):
        return jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=vma)

    np.testing.assert_array_equal(run(stage0, False, (P(), P(DATA)))(w, x), x.sum(0))
    # check_vma=True sums the gradient of a P() input itself: the explicit psum doubles up
    np.testing.assert_array_equal(run(stage0, True, (P(), P(DATA)))(w, x), N * x.sum(0))

    gather = lambda s: jax.lax.all_gather(s, DATA, tiled=True)
    np.testing.assert_array_equal(run(gather, False, P(DATA))(jnp.arange(8.0)), np.arange(8.0))
    with pytest.raises(ValueError, match="out_specs"):  # P() of a gather: not inferred
        run(gather, True, P(DATA))(jnp.arange(8.0))

    def loss(w, x):  # fine under jit; a zeros carry plus batch terms is a type error
        total = jax.lax.scan(lambda c, r: (c + jnp.sum(r * w), None), jnp.zeros(()), x)[0]
        return jax.lax.psum(total, DATA)

    assert float(run(loss, False, (P(), P(DATA)))(w, x)) == float(jnp.sum(x @ w))
    with pytest.raises(TypeError, match="carry"):
        run(loss, True, (P(), P(DATA)))(w, x)

    # P() is not checked: copies that differ come out as one "replicated" array
    differ = run(lambda v: v + jax.lax.axis_index(DATA), False, P())
    assert _copies_differ(jax.jit(differ)(jnp.zeros(()))) == [""]
