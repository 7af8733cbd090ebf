"""ZeRO-Offload (``Engine(offload="optimizer")``): the same training, the state on the host.

Each case is checked against the same engine without offload: the schedule moves the
master and the optimizer state to the device for the update and back, so the numbers
must be bit-identical, not merely close.
"""

import functools
import re

import jax
import numpy as np
import optax
import pytest
from _models import mlp_batches, mlp_loss, mlp_params

import jaxzero
from jaxzero import offload
from jaxzero.accounting.measure import device0_bytes

STEPS = 10


@functools.cache
def _run(stage: int, precision: str, micro_batches: int, off: str | None, opt: str = "adamw"):
    """``(losses, params, engine, state)`` after STEPS steps (cached: each case runs once)."""
    tx = {
        "adamw": optax.adamw(1e-2),
        "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=8),
        "lion": optax.lion(1e-3),
    }[opt]
    engine = jaxzero.Engine(
        mlp_loss,
        tx,
        mesh=jaxzero.make_mesh(8),
        stage=stage,
        precision=precision,
        micro_batches=micro_batches,
        max_grad_norm=0.5,
        offload=off,
    )
    state = engine.init(mlp_params())
    losses = []
    for batch in mlp_batches(STEPS):
        state, metrics = engine.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, engine.gather_params(state), engine, state


def _same(a, b):
    (la, pa, *_), (lb, pb, *_) = a, b
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_offload_trains_as_without(stage, micro_batches, precision):
    """fp32 (the optimizer state offloaded; the params are the master) and bf16 (the master
    too), clipping, with and without micro-batches: the losses and params of 10 steps equal
    the engine's without offload."""
    _same(
        _run(stage, precision, micro_batches, None),
        _run(stage, precision, micro_batches, "optimizer"),
    )


@pytest.mark.parametrize("opt", ["adafactor", "lion"])
def test_offload_with_other_optimizers(opt):
    """A factored optimizer (state leaves of their own shapes) and one with a single
    moment, in fp32."""
    _same(_run(3, "fp32", 1, None, opt), _run(3, "fp32", 1, "optimizer", opt))


def test_offloaded_state_lives_on_the_host():
    """The master and the optimizer state report pinned_host, the params the device; the
    device's persistent bytes drop by exactly what moved (12 bytes a param over N for
    AdamW in bf16: the master's 4 and the moments' 8)."""
    *_, e0, s0 = _run(3, "bf16", 1, None)
    *_, e1, s1 = _run(3, "bf16", 1, "optimizer")
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
    assert kinds(s1.master) == kinds(s1.opt_state) == {offload.HOST}
    assert kinds(s1.params) == kinds(s1.step) == {"device"}
    moved = offload.offloaded(s1, mixed=True)
    host = sum(device0_bytes(x) for x in moved)
    on_device = lambda s: sum(
        device0_bytes(x) for x in jax.tree.leaves(s) if not offload.is_host(x.sharding)
    )
    assert on_device(s0) - on_device(s1) == host
    n = e1.num_shards
    # per device: a sharded leaf's padded slice, a small (replicated) leaf whole
    per_device = sum(
        lay.size if lay.dim is None else lay.padded_size // n for lay in e1.plan.leaves()
    )
    assert e1.num_params / n < per_device < e1.num_params
    assert host == 12 * per_device + 4  # fp32 master, mu and nu; Adam's int32 count


def test_the_compiled_step_moves_each_offloaded_leaf_once_each_way():
    """In the compiled step, every offloaded leaf is a host-memory parameter and a
    host-memory output (``S(5)`` in the entry layout), nothing else is."""
    *_, engine, state = _run(3, "bf16", 1, "optimizer")
    batch = engine.shard_batch(mlp_batches(1)[0])
    text = engine.compile(state, batch).as_text()
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->(.*)\}", text)
    assert layout is not None
    params, outputs = layout.group(1), layout.group(2)
    moved = len(offload.offloaded(state, mixed=True))
    assert params.count("S(5)") == moved
    assert outputs.count("S(5)") == moved


@pytest.mark.parametrize("saved,restored", [("optimizer", None), (None, "optimizer")])
def test_checkpoints_restore_across_offload_settings(tmp_path, saved, restored):
    """Saved with offload, resumed without (and the other way): the next steps are the
    same as the saving engine's own."""
    batches = mlp_batches(4)

    def engine(off):
        return jaxzero.Engine(
            mlp_loss, optax.adamw(1e-2), mesh=jaxzero.make_mesh(8), stage=3,
            precision="bf16", offload=off,
        )  # fmt: skip

    first = engine(saved)
    state = first.init(mlp_params())
    state, _ = first.step(state, batches[0])
    ckpt = jaxzero.CheckpointManager(tmp_path)
    ckpt.save(first, state)
    ckpt.wait()
    for b in batches[1:]:
        state, _ = first.step(state, b)
    second = engine(restored)
    resumed, _ = ckpt.restore(second)
    want = {offload.HOST} if restored else {"device"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(resumed.opt_state)} == want
    for b in batches[1:]:
        resumed, _ = second.step(resumed, b)
    a, b = first.gather_params(state), second.gather_params(resumed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_offload_with_frozen_params():
    """A LoRA-style run (frozen leaves): the trainable leaves' state moves, the frozen ones
    stay on the device, and training is unchanged."""
    trainable = lambda path: path.startswith("w")

    def run(off):
        e = jaxzero.Engine(
            mlp_loss, optax.adamw(1e-2), mesh=jaxzero.make_mesh(8), stage=2,
            precision="bf16", trainable=trainable, offload=off,
        )  # fmt: skip
        s = e.init(mlp_params())
        for b in mlp_batches(3):
            s, _ = e.step(s, b)
        return e.gather_params(s), s

    (p0, _), (p1, s1) = run(None), run("optimizer")
    assert {x.sharding.memory_kind for x in jax.tree.leaves(s1.frozen)} == {"device"}
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)


def test_offload_at_stage_0_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"offload='optimizer' needs stage 1, 2 or 3"):
        jaxzero.Engine(mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(8), stage=0,
                       offload="optimizer")  # fmt: skip
    with pytest.raises(ValueError, match=r"offload='params': use None or 'optimizer'"):
        jaxzero.Engine(mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(8), offload="params")
