"""What the compiled step does per stage: its collectives, its memory, its state bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import TINY_GPT, gpt, gpt_batches

import jaxzero
from jaxzero.accounting.comm import collectives_from_hlo
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
