"""ZeRO++ hpZ (``Engine(hpz=True)``): on a hybrid mesh, the working params sharded within
each group, the master and optimizer state over every device.

Each case is checked against plain single-device training (what every stage must
reproduce) and against today's hybrid mesh, whose state is replicated per group.
"""

import functools

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
from jaxzero.accounting.measure import device0_bytes
from jaxzero.mesh import DATA, REPLICA

TX = optax.adamw(1e-2)


@functools.cache
def _mlp(hpz: bool, micro_batches: int = 1, precision: str = "fp32"):
    engine = jaxzero.Engine(
        mlp_loss, TX, mesh=jaxzero.make_mesh(8, replicas=2), stage=3, precision=precision,
        micro_batches=micro_batches, max_grad_norm=0.5, hpz=hpz,
    )  # fmt: skip
    return engine, *train_engine(engine, mlp_params(), mlp_batches(10))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_hpz_trains_as_one_device(micro_batches):
    """10 steps with clipping equal plain one-device training (fp32, 1e-5)."""
    ref_losses, ref_params = train_reference(
        mlp_loss, mlp_params(), mlp_batches(10), optax.chain(optax.clip_by_global_norm(0.5), TX)
    )
    _, losses, params, _ = _mlp(True, micro_batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_diff(params, ref_params) < 1e-5


def test_hpz_lays_the_state_out_over_every_device():
    """The params are sharded over the group's devices only (4 of 8: each device holds a
    quarter of a sharded leaf), the master and Adam's moments over all 8 (an eighth);
    without hpZ the hybrid mesh keeps a quarter of each on every device."""
    engine, *_, state = _mlp(True)
    _, *_, plain = _mlp(False)
    w1 = engine.plan.layouts["w1"]
    assert state.params["w1"].sharding.spec[w1.dim] == DATA
    assert state.master["w1"].sharding.spec[w1.dim] == (DATA, REPLICA)
    quarter, eighth = w1.padded_size // 4 * 4, w1.padded_size // 8 * 4  # fp32 bytes
    assert device0_bytes(state.params["w1"]) == quarter
    assert device0_bytes(state.master["w1"]) == eighth
    mu = state.opt_state[0].mu["w1"]
    assert device0_bytes(mu) == eighth
    assert device0_bytes(plain.opt_state[0].mu["w1"]) == plain.opt_state[0].mu["w1"].nbytes // 4


def test_hpz_per_layer_gpt_bf16_matches_the_hybrid_mesh():
    """A scanned per-layer GPT (use_params gathers within the group) in bf16 with two
    micro-batches: the same losses as the hybrid mesh without hpZ."""
    model, params = gpt()
    out = []
    for hpz in (False, True):
        engine = model.engine(
            TX, mesh=jaxzero.make_mesh(8, replicas=2), stage=3, precision="bf16",
            micro_batches=2, hpz=hpz,
        )  # fmt: skip
        out.append(train_engine(engine, params, gpt_batches(4)))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=2e-3)
    assert rel_diff(out[1][1], out[0][1]) < 1e-2  # bf16 working params: rounding differs


def test_hpz_checkpoint_resumes_without_hpz(tmp_path):
    """Saved with hpZ, restored into a plain hybrid engine (and its padding): the params
    read back are the same."""
    engine, _, params, state = _mlp(True)
    ckpt = jaxzero.CheckpointManager(tmp_path)
    ckpt.save(engine, state)
    ckpt.wait()
    other = jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8, replicas=2), stage=3)
    restored, _ = ckpt.restore(other)
    back = other.gather_params(restored)
    for k in params:
        np.testing.assert_array_equal(back[k], params[k], err_msg=k)


def test_hpz_without_a_hybrid_mesh_or_below_stage_3_is_refused():
    with pytest.raises(ValueError, match="hpz=True keeps a params copy sharded within each"):
        jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8), hpz=True)
    with pytest.raises(ValueError, match="hpz=True is stage 3's"):
        jaxzero.Engine(mlp_loss, TX, mesh=jaxzero.make_mesh(8, replicas=2), stage=2, hpz=True)
