"""The EMA of the weights (``Engine(ema=...)``, ``--set train.ema``): kept in the state,
sharded as the master, updated shard by shard inside the step with no collective, saved
and restored with the state, exported and evaluated.

Each engine is built and trained once (:func:`_run`, cached) and shared by the tests
that read it; a test that steps a state steps one of its own.
"""

import collections
import functools
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import mlp_batches, mlp_loss, mlp_params

import jaxzero
from jaxzero import hf, offload
from jaxzero.accounting.comm import collectives_from_hlo
from jaxzero.ema import EMAWarning
from jaxzero.hf.safetensors import SafetensorsFile
from jaxzero.train import config as config_lib
from jaxzero.train import export as ex

STEPS = 20
FLOAT = 0.9  # the fp32 runs' decay: far enough from 1 that 20 steps move the EMA


def warmup(step):
    """optax's and timm's warmup of the decay, on the traced step."""
    return jnp.minimum(0.95, (1 + step) / (10 + step))


def _decay_of(precision: str):
    return FLOAT if precision == "fp32" else warmup  # both forms, each in one precision


def _engine(stage, precision, micro_batches=1, off=None, ema=True, n=8):
    return jaxzero.Engine(
        mlp_loss,
        optax.adamw(1e-2),
        mesh=jaxzero.make_mesh(n),
        stage=stage,
        precision=precision,
        micro_batches=micro_batches,
        offload=off,
        ema=_decay_of(precision) if ema else None,
    )


@functools.cache
def _run(stage: int, precision: str, micro_batches: int = 1, off: str | None = None):
    """``(engine, state, reference)`` after STEPS steps: ``reference`` is the EMA computed
    on the host in fp32 from the engine's own sequence of (gathered, master) params."""
    engine = _engine(stage, precision, micro_batches, off)
    state = engine.init(mlp_params())
    ref = engine.gather_params(state)
    for step, batch in enumerate(mlp_batches(STEPS)):
        state, _ = engine.step(state, batch)
        new = engine.gather_params(state)
        d = np.float32(FLOAT if precision == "fp32" else min(0.95, (1 + step) / (10 + step)))
        ref = {k: d * ref[k] + (np.float32(1) - d) * new[k] for k in new}
    return engine, state, ref


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ema_equals_one_device_reference(stage, precision):
    """After 20 steps on 8 devices the EMA equals the one computed on the host from the
    same params (a float decay in fp32, a warmup schedule in bf16); it is fp32, laid out
    as the master, its padding zero, and it is not the params."""
    engine, state, ref = _run(stage, precision)
    got = engine.gather_params(state, ema=True)
    assert _max_diff(got, ref) < 1e-6
    assert _max_diff(got, engine.gather_params(state)) > 1e-3  # it lags the params
    specs = jax.tree.map(lambda x: x.sharding.spec, state.ema)
    assert (
        specs == engine.specs.ema == jax.tree.map(lambda sh: sh.spec, engine.plan.master_shardings)
    )
    assert {x.dtype for x in jax.tree.leaves(state.ema)} == {jnp.dtype(jnp.float32)}
    w1 = np.asarray(state.ema["w1"])  # (37, 53): padded where sharded
    assert w1.shape == (engine.layouts["w1"].padded_shape if stage else (37, 53))
    assert not w1[37:].any() and not w1[:, 53:].any()


def test_ema_with_micro_batches_equals_reference():
    engine, state, ref = _run(2, "bf16", 2)
    assert _max_diff(engine.gather_params(state, ema=True), ref) < 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ema_adds_no_collective(stage):
    """The compiled step with an EMA holds exactly the collectives of the step without."""
    batch = mlp_batches(1)[0]

    def kinds(engine, state):
        hlo = engine.compile(state, batch).as_text()
        return collections.Counter(c.kind for c in collectives_from_hlo(hlo).collectives)

    with_ema = kinds(*_run(stage, "bf16")[:2])
    plain = _engine(stage, "bf16", ema=False)
    without = kinds(plain, plain.abstract_state(jax.eval_shape(lambda: mlp_params())))
    assert with_ema == without and sum(without.values()) > 0


@pytest.mark.parametrize("stage, precision", [(3, "bf16"), (1, "fp32")])
def test_ema_with_offload_lives_on_the_host_and_matches(stage, precision):
    """With offload the EMA is in pinned host memory (fp32 training too, where the master
    is the params, on the device), moved to the device for its update and back once each
    way, and it equals the EMA of the same run without offload."""
    engine, state, _ = _run(stage, precision, 1, "optimizer")
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.ema)} == {offload.HOST}
    plain, plain_state, _ = _run(stage, precision)
    got, want = engine.gather_params(state, ema=True), plain.gather_params(plain_state, ema=True)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    text = engine.compile(state, mlp_batches(1)[0]).as_text()
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->(.*)\}", text)
    assert layout is not None
    moved = len(offload.offloaded(state, engine.plan.mixed))
    leaves = lambda tree: len(jax.tree.leaves(tree))
    assert moved == leaves(state.opt_state) + leaves(state.ema) + leaves(state.master)
    assert layout.group(1).count("S(5)") == moved == layout.group(2).count("S(5)")
    loss = engine.eval_loss(state, mlp_batches(1)[0], ema=True)
    want = plain.eval_loss(plain_state, mlp_batches(1)[0], ema=True)
    assert float(loss) == float(want)


def test_eval_loss_at_the_ema_weights():
    """``eval_loss(ema=True)`` is the loss at the EMA's weights: at stage 1 (gathered for
    the evaluation) the loss computed on the host at those weights."""
    engine, state, _ = _run(1, "fp32")
    batch = mlp_batches(1, seed=7)[0]
    weights = engine.gather_params(state, ema=True)
    want = float(mlp_loss(weights, batch))
    got = float(engine.eval_loss(state, batch, ema=True))
    assert abs(got - want) < 1e-5 * abs(want)
    assert got != float(engine.eval_loss(state, batch))


def _train(engine, state, batches):
    for b in batches:
        state, _ = engine.step(state, b)
    return state


def test_checkpoint_round_trip_and_resume_are_exact(tmp_path):
    """Saved and restored with the state (``ema/...`` leaves), every leaf exactly; two more
    steps from the restored state give the EMA of two more steps from the saved one; into
    another stage, precision and N (other padding) the EMA restores as it was."""
    engine = _run(3, "bf16")[0]
    batches = mlp_batches(5)
    state = _train(engine, engine.init(mlp_params()), batches[:3])
    ckpt = jaxzero.CheckpointManager(tmp_path)
    ckpt.save(engine, state)
    ckpt.wait()
    assert any(n.startswith("ema/") for n in ckpt.metadata()["leaves"])
    saved = engine.gather_params(state, ema=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: both keep an EMA
        back, _ = ckpt.restore(engine)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cont = engine.gather_params(_train(engine, state, batches[3:]), ema=True)
    resumed = engine.gather_params(_train(engine, back, batches[3:]), ema=True)
    for k in cont:
        np.testing.assert_array_equal(cont[k], resumed[k], err_msg=k)
    other = _engine(1, "fp32", n=3)  # 3 devices, stage 1, fp32: other padding
    moved, _ = ckpt.restore(other)
    assert moved.ema["w1"].shape == other.layouts["w1"].padded_shape != state.ema["w1"].shape
    got = other.gather_params(moved, ema=True)
    for k in saved:
        np.testing.assert_array_equal(got[k], saved[k], err_msg=k)


def test_restore_without_and_with_ema(tmp_path):
    """A checkpoint without an EMA into an engine with one: the EMA starts at the restored
    params, said in one line; one with an EMA into an engine without: dropped, said so."""
    plain = _engine(3, "bf16", ema=False)
    state = plain.init(mlp_params(seed=3))
    ckpt = jaxzero.CheckpointManager(tmp_path / "plain")
    ckpt.save(plain, state)
    ckpt.wait()
    engine = _run(3, "bf16")[0]
    with pytest.warns(EMAWarning, match="holds no EMA of the weights: the EMA starts") as got:
        restored, _ = ckpt.restore(engine)
    assert len(str(got[0].message).splitlines()) == 1
    ema, params = engine.gather_params(restored, ema=True), plain.gather_params(state)
    for k in params:
        np.testing.assert_array_equal(ema[k], params[k], err_msg=k)

    with_ema = jaxzero.CheckpointManager(tmp_path / "ema")
    with_ema.save(engine, _run(3, "bf16")[1])
    with_ema.wait()
    with pytest.warns(EMAWarning, match="holds an EMA of the weights.*dropped") as got:
        dropped, _ = with_ema.restore(plain)
    assert len(str(got[0].message).splitlines()) == 1
    assert dropped.ema is None
    want = engine.gather_params(_run(3, "bf16")[1])
    for k, v in plain.gather_params(dropped).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)


def test_init_starts_the_ema_at_the_params_and_frozen_params_have_none():
    """A fresh state's EMA is its params; ``trainable=`` leaves the frozen ones out of it
    (they do not change), and those keep their one copy in ``gather_params(ema=True)``."""
    engine = jaxzero.Engine(
        mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(8), stage=2, ema=0.99,
        trainable=lambda path: path.startswith("w"),
    )  # fmt: skip
    state = engine.init(mlp_params())
    assert sorted(k for k, v in state.ema.items() if not isinstance(v, optax.MaskedNode)) == [
        "w1",
        "w2",
    ]
    for k, v in engine.gather_params(state, ema=True).items():
        np.testing.assert_array_equal(v, mlp_params()[k], err_msg=k)
    state, _ = engine.step(state, mlp_batches(1)[0])
    got = engine.gather_params(state, ema=True)
    np.testing.assert_array_equal(got["b1"], mlp_params()["b1"])  # frozen: as it was
    live = engine.gather_params(state)
    want = np.float32(0.99) * mlp_params()["w1"] + np.float32(1 - np.float32(0.99)) * live["w1"]
    np.testing.assert_allclose(got["w1"], want, atol=1e-6)


def _tiny_llama():
    from jaxzero.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, seq_len=8,
    )  # fmt: skip
    return Llama(cfg)


def test_hf_save_writes_the_ema_weights(tmp_path):
    """``hf.save(..., ema=True)`` of a tiny Llama trained at stage 3 writes the EMA's
    tensors, not the live ones; a state without an EMA is refused in one line."""
    model = _tiny_llama()
    engine = model.engine(optax.sgd(0.5), mesh=jaxzero.make_mesh(8), stage=3, ema=0.5)
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
    state = engine.init(params)
    rng = np.random.default_rng(0)
    for _ in range(3):
        t = rng.integers(0, 32, (8, 9)).astype(np.int32)
        state, _ = engine.step(state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
    out = hf.save(tmp_path / "ema", model, engine, state, dtype="float32", ema=True)
    got = jax.tree.leaves(hf.read_params(out))
    ema = jax.tree.leaves(engine.gather_params(state, ema=True))
    live = jax.tree.leaves(engine.gather_params(state))
    for a, b in zip(got, ema, strict=True):
        np.testing.assert_array_equal(a, b)
    assert max(float(np.max(np.abs(a - c))) for a, c in zip(got, live, strict=True)) > 1e-4

    plain = model.engine(optax.sgd(0.5), mesh=jaxzero.make_mesh(8), stage=3)
    with pytest.raises(hf.HFError, match="this state has no EMA") as e:
        hf.save(tmp_path / "no", model, plain, plain.init(params), ema=True)
    assert len(str(e.value).splitlines()) == 1 and not (tmp_path / "no").exists()


def test_export_ema_from_a_checkpoint(tmp_path, capsys):
    """``jaxzero export --ema`` writes the EMA of the checkpoint's weights; a checkpoint
    without one is refused in one line naming the setting."""
    engine, state, _ = _run(2, "bf16")
    config = {"model": {}, "data": {}}
    ckpt = jaxzero.CheckpointManager(tmp_path / "ck")
    ckpt.save(engine, state, extra={"config": config})
    ckpt.wait()
    out = ex.export(tmp_path / "ck", tmp_path / "out", ema=True)
    written = SafetensorsFile(out / ex.WEIGHTS)
    want = engine.gather_params(state, ema=True)
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(written.tensor(k)), v, err_msg=k)
    assert json.loads((out / ex.CONFIG).read_text())["source"]["ema"] is True

    plain = _engine(2, "bf16", ema=False)
    ckpt = jaxzero.CheckpointManager(tmp_path / "plain")
    ckpt.save(plain, plain.init(mlp_params()), extra={"config": config})
    ckpt.wait()
    assert ex.main([str(tmp_path / "plain"), "--out", str(tmp_path / "o2"), "--ema"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("jaxzero export: error: this run has no EMA: train with --set train.ema=0.999")


@pytest.mark.parametrize(
    "ema, error, says",
    [
        (1.0, ValueError, "ema=1.0: the decay must lie in (0, 1)"),
        (0, ValueError, "ema=0: the decay must lie in (0, 1)"),
        (-0.5, ValueError, "ema=-0.5"),
        ("0.9", TypeError, "ema must be a decay in (0, 1) or a function of the step, got '0.9'"),
        (True, TypeError, "got True"),
        (lambda: 0.9, TypeError, "must be a function of the step, ema(step) -> decay"),
        (lambda a, b: a, TypeError, "(one argument)"),
        (lambda s: min(0.9, (1 + s) / (10 + s)), TypeError, "jnp.minimum, not min"),
        (lambda s: jnp.ones(3), TypeError, "must return a float scalar decay"),
    ],
)
def test_bad_ema_is_refused_in_one_line(ema, error, says):
    with pytest.raises(error) as e:
        jaxzero.Engine(mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(1), ema=ema)
    assert says in str(e.value) and len(str(e.value).splitlines()) == 1


def test_reading_an_ema_that_is_not_there_is_refused():
    engine = jaxzero.Engine(mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(1))
    state = engine.init(mlp_params())
    for read in (
        lambda: engine.gather_params(state, ema=True),
        lambda: engine.eval_loss(state, mlp_batches(1)[0], ema=True),
    ):
        with pytest.raises(ValueError, match="this state has no EMA: build the engine with ema"):
            read()


def test_run_config_ema():
    """``--set train.ema=0.999`` reaches the engine; a decay outside (0, 1) is refused
    naming the key and the value; a resume may turn it on or off."""
    from jaxzero.train import resume
    from jaxzero.train.planning import build

    cfg = config_lib.resolve(None, ["train.ema=0.999", "model.vocab_size=64"])
    assert build(cfg, jaxzero.make_mesh(1))[1].ema == 0.999
    with pytest.raises(config_lib.ConfigError, match=r"train.ema=1.5: the EMA's decay must"):
        config_lib.resolve(None, ["train.ema=1.5"])
    before = config_lib.resolve(None, ["model.vocab_size=64"])
    said = resume.check_changes(resume.changes(before, cfg))
    assert said == ["train.ema: None -> 0.999"]
