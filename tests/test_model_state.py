"""Model state that is not trained (BatchNorm statistics, :mod:`jaxzero.model_state`): a
Linen convnet (``batch_stats``) and an NNX model (``nnx.BatchStat``) trained at every
stage on 8 devices equal a one-device loop written here with Flax alone (params and
statistics), with micro-batches too; ``eval_loss`` uses the stored statistics; the state
is checkpointed and restored exactly; a malformed state-form loss is refused in one line.

Each engine is built and trained once (``_linen``, ``_nnx``: cached) and shared.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxzero
from jaxzero.checkpoint import CheckpointError, CheckpointManager

STEPS = 3
ROWS = 16  # 2 rows a device on 8; with 2 micro-batches, 1
LR = 0.1
MOMENTUM = 0.8  # far from 1, so 3 steps move the statistics


class ConvNet(nn.Module):
    """8x8 images: conv, BatchNorm (synchronised when given the axes), conv, dense head."""

    axis_name: tuple[str, ...] | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(4, (3, 3), use_bias=False)(x)  # a bias before BN has no gradient
        x = nn.BatchNorm(
            use_running_average=not train, momentum=MOMENTUM, axis_name=self.axis_name
        )(x)
        x = nn.Conv(6, (3, 3), strides=(2, 2))(nn.relu(x))
        return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))


def _data(steps: int = STEPS) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.standard_normal((ROWS, 8, 8, 2)).astype(np.float32) * 2 + 1,
            "y": rng.integers(0, 3, ROWS).astype(np.int32),
        }
        for _ in range(steps)
    ]


def _variables():
    return ConvNet().init(jax.random.key(0), jnp.zeros((2, 8, 8, 2)), False)


def _terms(logits, y):
    """The weighted form's sum, weight and aux (correct rows) of one batch."""
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    correct = jnp.sum(jnp.argmax(logits, -1) == y).astype(jnp.float32)
    return jnp.sum(xent), jnp.float32(y.shape[0]), correct


def _linen_loss(net: ConvNet):
    """The engine's loss: weighted, with aux, returning the new statistics."""

    def loss_fn(params, batch, state, train):
        logits, new = net.apply(
            {"params": params, **state}, batch["x"], train, mutable=["batch_stats"]
        )
        total, weight, correct = _terms(logits, batch["y"])
        return jaxzero.WithState((jaxzero.Weighted(total, weight), {"correct": correct}), new)

    return loss_fn


def _micro_batches(batch: dict, k: int, n: int = 8) -> list[dict]:
    """Global micro-batch ``j`` as the engine on ``n`` devices forms it: each device's
    ``j``-th slice of its rows (jaxzero.model_state)."""
    per = ROWS // n // k
    rows = lambda j: np.concatenate(
        [np.arange(d * ROWS // n + j * per, d * ROWS // n + (j + 1) * per) for d in range(n)]
    )
    return [{key: v[rows(j)] for key, v in batch.items()} for j in range(k)]


@functools.cache
def _linen_reference(k: int):
    """``(params, stats)`` after STEPS SGD steps on one device with Flax alone: ``k``
    micro-batches a step, each seeing the statistics the previous one left."""
    params, stats = jaxzero.split_variables(_variables())
    net = ConvNet()

    def sums(p, s, mb):
        logits, new = net.apply({"params": p, **s}, mb["x"], True, mutable=["batch_stats"])
        return _terms(logits, mb["y"])[0], new

    grad = jax.jit(jax.grad(sums, has_aux=True))
    for batch in _data():
        total = jax.tree.map(jnp.zeros_like, params)
        for mb in _micro_batches(batch, k):
            g, stats = grad(params, stats, mb)
            total = jax.tree.map(jnp.add, total, g)
        params = jax.tree.map(lambda p, g: p - LR * g / ROWS, params, total)
    return params, stats


def _linen_engine(stage: int, k: int = 1, mesh=None, **kwargs) -> jaxzero.Engine:
    mesh = jaxzero.make_mesh(8) if mesh is None else mesh
    net = ConvNet(axis_name=jaxzero.batch_axes(mesh))  # synchronised BatchNorm
    stats = jaxzero.split_variables(_variables())[1]
    return jaxzero.Engine(
        _linen_loss(net),
        optax.sgd(LR),
        mesh=mesh,
        stage=stage,
        micro_batches=k,
        model_state=stats,
        **kwargs,
    )


@functools.cache
def _linen(stage: int, k: int = 1, replicas: int = 1, offload: str | None = None):
    """``(engine, state, metrics)`` after STEPS steps on 8 devices."""
    extra = {"offload": offload, "ema": 0.9} if offload else {}
    engine = _linen_engine(stage, k, jaxzero.make_mesh(8, replicas=replicas), **extra)
    state = engine.init(jaxzero.split_variables(_variables())[0])
    for batch in _data():
        state, metrics = engine.step(state, batch)
    return engine, state, metrics


def _max_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_linen_batchnorm_equals_one_device(stage, k):
    """Params and running statistics after 3 steps equal the one-device Flax loop; the
    statistics moved, are replicated, and (k=2) saw two updates a step."""
    engine, state, metrics = _linen(stage, k)
    params, stats = _linen_reference(k)
    assert _max_diff(engine.gather_params(state), params) < 1e-5
    assert _max_diff(state.model_state, stats) < 1e-5
    assert all(x.is_fully_replicated for x in jax.tree.leaves(state.model_state))
    start = jaxzero.split_variables(_variables())[1]
    assert _max_diff(state.model_state, start) > 0.1  # the statistics moved
    assert "correct" in metrics["aux"] and float(metrics["tokens"]) == ROWS
    if k == 2:  # two updates of the running averages a step, not one
        assert _max_diff(stats, _linen_reference(1)[1]) > 1e-2


def test_hybrid_mesh_synchronises_over_both_batch_axes():
    """On a hybrid mesh the batch axes are ("replica", "data"): the tuple is BatchNorm's
    axis_name, and stage 3 still equals one device."""
    engine, state, _ = _linen(3, 1, replicas=2)
    assert engine.batch_axes == ("replica", "data") == jaxzero.batch_axes(engine.mesh)
    params, stats = _linen_reference(1)
    assert _max_diff(engine.gather_params(state), params) < 1e-5
    assert _max_diff(state.model_state, stats) < 1e-5


def test_offload_and_ema_leave_the_statistics_alone():
    """With offload the statistics stay on the device, with an EMA the EMA averages the
    params only; both train as the plain stage-3 run."""
    engine, state, _ = _linen(3, 1, offload="optimizer")
    plain_engine, plain, _ = _linen(3)
    assert _max_diff(state.model_state, plain.model_state) < 1e-6
    assert _max_diff(engine.gather_params(state), plain_engine.gather_params(plain)) < 1e-6
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.model_state)}
    assert kinds == {plain.model_state["batch_stats"]["BatchNorm_0"]["mean"].sharding.memory_kind}
    assert jax.tree.structure(state.ema) == jax.tree.structure(state.params)


def test_the_accounting_counts_the_statistics_with_the_step():
    """jaxzero.report's persistent "other": the int32 step and the replicated statistics."""
    engine, state, _ = _linen(3)
    report = jaxzero.report(engine, state, _data(1)[0])
    stats = sum(x.nbytes for x in jax.tree.leaves(state.model_state))
    assert stats == 4 * 4 * 2  # a mean and a variance of 4 channels, fp32
    assert report.persistent["other"] == 4 + stats


def test_unsynchronised_statistics_are_averaged_over_devices():
    """A BatchNorm without axis_name normalises by each device's rows; the step stores
    the mean over devices of each device's new statistics, one replicated value."""
    mesh = jaxzero.make_mesh(8)
    stats = jaxzero.split_variables(_variables())[1]
    params = jaxzero.split_variables(_variables())[0]
    engine = jaxzero.Engine(
        _linen_loss(ConvNet()), optax.sgd(LR), mesh=mesh, stage=1, model_state=stats
    )
    batch = _data(1)[0]
    state, _ = engine.step(engine.init(params), batch)
    per_device = [
        ConvNet().apply(
            {"params": params, **stats},
            batch["x"][d * 2 : d * 2 + 2],
            True,
            mutable=["batch_stats"],
        )[1]
        for d in range(8)
    ]
    want = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *per_device)
    assert _max_diff(state.model_state, want) < 1e-6
    synced = ConvNet().apply({"params": params, **stats}, batch["x"], True, mutable=["batch_stats"])
    var = lambda s: s["batch_stats"]["BatchNorm_0"]["var"]
    assert float(np.max(np.abs(var(want) - var(synced[1])))) > 1e-3  # not the global batch's


def test_eval_uses_the_stored_statistics():
    """eval_loss is the loss with the running statistics (train=False), computed here by
    hand; it differs from the training-mode loss and leaves the state as it was."""
    engine, state, _ = _linen(2)
    batch = _data(1)[0]
    before = jax.tree.map(np.asarray, state.model_state)
    got = float(engine.eval_loss(state, batch))
    params = jax.tree.map(jnp.asarray, engine.gather_params(state))
    stats = jax.tree.map(jnp.asarray, before)
    logits = ConvNet().apply({"params": params, **stats}, batch["x"], False)
    want = float(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean())
    train_logits, _ = ConvNet().apply(
        {"params": params, **stats}, batch["x"], True, mutable=["batch_stats"]
    )
    train = float(optax.softmax_cross_entropy_with_integer_labels(train_logits, batch["y"]).mean())
    assert got == pytest.approx(want, rel=1e-5)
    assert abs(got - train) > 1e-4  # 50 times the tolerance above
    assert _max_diff(state.model_state, before) == 0.0


def test_checkpoint_restores_the_statistics_exactly(tmp_path):
    """Saved at stage 3 on 8 devices, restored at stage 1 on 4: the statistics are
    bit-identical and the next step matches; a checkpoint and an engine that disagree
    about model state are refused in one line."""
    engine, state, _ = _linen(3)
    with CheckpointManager(tmp_path / "bn") as ckpt:
        ckpt.save(engine, state)
        ckpt.wait()
    other = _linen_engine(1, mesh=jaxzero.make_mesh(4))
    with CheckpointManager(tmp_path / "bn") as ckpt:
        restored, _ = ckpt.restore(other)
    assert _max_diff(restored.model_state, state.model_state) == 0.0
    assert all(x.is_fully_replicated for x in jax.tree.leaves(restored.model_state))
    batch = _data(1)[0]
    a, _ = other.step(restored, batch)
    engine_b = _linen_engine(3)  # the saving engine's layout, fresh (the cached state stays)
    with CheckpointManager(tmp_path / "bn") as ckpt:
        b, _ = engine_b.step(ckpt.restore(engine_b)[0], batch)
    assert _max_diff(a.model_state, b.model_state) < 1e-6

    plain_loss = lambda p, b: jnp.mean(
        ConvNet().apply({"params": p, **_variables()}, b["x"], False)
    )
    without = jaxzero.Engine(plain_loss, optax.sgd(LR), mesh=jaxzero.make_mesh(8), stage=3)
    with CheckpointManager(tmp_path / "bn") as ckpt, pytest.raises(CheckpointError) as e:
        ckpt.restore(without)
    assert "holds model state" in str(e.value) and "\n" not in str(e.value)

    plain_state = without.init(jaxzero.split_variables(_variables())[0])
    with CheckpointManager(tmp_path / "plain") as ckpt:
        ckpt.save(without, plain_state)
        ckpt.wait()
    with CheckpointManager(tmp_path / "plain") as ckpt, pytest.raises(CheckpointError) as e:
        ckpt.restore(_linen_engine(3))
    assert "holds no model state" in str(e.value) and "\n" not in str(e.value)


def _one_line(error_type, match, fn):
    """``fn()`` raises ``error_type`` whose first line says all (``match``); under jit JAX
    may add its traceback-filtering note on lines of its own."""
    with pytest.raises(error_type) as e:
        fn()
    assert re.search(match, str(e.value).splitlines()[0]), str(e.value)


def test_malformed_state_losses_are_refused_in_one_line():
    mesh = jaxzero.make_mesh(8)
    params, stats = jaxzero.split_variables(_variables())
    batch = _data(1)[0]
    net = ConvNet(axis_name=jaxzero.batch_axes(mesh))
    apply = lambda p, b, s, t: net.apply({"params": p, **s}, b["x"], t, mutable=["batch_stats"])
    xent = lambda logits, b: optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def step(loss_fn):
        engine = jaxzero.Engine(loss_fn, optax.sgd(LR), mesh=mesh, stage=0, model_state=stats)
        return engine.step(engine.init(params), batch)

    # the signature: state and train by keyword, or no model state at all
    _one_line(ValueError, "takes no 'state' or 'train'", lambda: step(lambda p, b: 0.0))
    _one_line(ValueError, "takes no 'train'", lambda: step(lambda p, b, state: 0.0))

    def needs_state(p, b, state, train):
        return 0.0

    _one_line(
        ValueError,
        "'state' parameter with no default.*model_state",
        lambda: jaxzero.Engine(needs_state, optax.sgd(LR), mesh=mesh),
    )
    # what it returns: WithState with the whole state, outermost
    _one_line(
        TypeError,
        r"must return jaxzero.WithState\(loss, new_state\), got",
        lambda: step(lambda p, b, state, train: xent(apply(p, b, state, train)[0], b)),
    )

    def inner(p, b, state, train):
        logits, new = apply(p, b, state, train)
        return jaxzero.WithState(xent(logits, b), new), {"aux": 1.0}

    _one_line(TypeError, "WithState inside another form", lambda: step(inner))

    def partial(p, b, state, train):
        logits, new = apply(p, b, state, train)
        return jaxzero.WithState(xent(logits, b), new["batch_stats"])

    _one_line(ValueError, "model state of structure", lambda: step(partial))

    def reshaped(p, b, state, train):
        logits, new = apply(p, b, state, train)
        return jaxzero.WithState(xent(logits, b), jax.tree.map(lambda x: x[:2], new))

    _one_line(
        ValueError,
        r"BatchNorm_0/mean' of shape \(2,\); it is stored as \(4,\)",
        lambda: step(reshaped),
    )

    plain = jaxzero.Engine(
        lambda p, b: jaxzero.WithState(
            xent(net.apply({"params": p, **stats}, b["x"], False), b), stats
        ),
        optax.sgd(LR),
        mesh=mesh,
        stage=0,
    )
    _one_line(TypeError, "keeps no model state", lambda: plain.step(plain.init(params), batch))


def test_state_composes_with_rng():
    """loss_fn(params, batch, rng, state=, train=): dropout and BatchNorm together, at
    stage 3 on 8 devices as on one."""

    class Dropped(nn.Module):
        axis_name: tuple[str, ...] | None = None

        @nn.compact
        def __call__(self, x, train):
            x = nn.Dropout(0.3, deterministic=not train)(x)
            return ConvNet(self.axis_name)(x, train)

    params, stats = jaxzero.split_variables(
        Dropped().init(jax.random.key(0), jnp.zeros((2, 8, 8, 2)), False)
    )

    def run(n):
        mesh = jaxzero.make_mesh(n)
        net = Dropped(jaxzero.batch_axes(mesh))

        def loss_fn(p, b, rng, state, train):
            logits, new = net.apply(
                {"params": p, **state},
                b["x"],
                train,
                mutable=["batch_stats"],
                rngs=None if rng is None else {"dropout": rng},
            )
            return jaxzero.WithState(
                optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), new
            )

        engine = jaxzero.Engine(
            loss_fn,
            optax.sgd(LR),
            mesh=mesh,
            stage=3 if n > 1 else 0,
            loss_takes_rng=True,
            model_state=stats,
        )
        state = engine.init(params)
        for batch in _data(2):
            state, _ = engine.step(state, batch)
        return engine.gather_params(state), state.model_state, engine.eval_loss(state, batch)

    (p8, s8, e8), (p1, s1, e1) = run(8), run(1)
    assert _max_diff(p8, p1) < 1e-5 and _max_diff(s8, s1) < 1e-5
    assert float(e8) == pytest.approx(float(e1), rel=1e-5)


# --- NNX: nnx.BatchNorm's nnx.BatchStat ------------------------------------------------


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, axis_name: tuple[str, ...] | None = None):
        self.linear1 = nnx.Linear(6, 12, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(12, momentum=MOMENTUM, axis_name=axis_name, rngs=rngs)
        self.linear2 = nnx.Linear(12, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.bn(self.linear1(x))))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _nnx_data() -> list[dict]:
    rng = np.random.default_rng(2)
    return [
        {
            "x": rng.standard_normal((ROWS, 6)).astype(np.float32) * 3 - 1,
            "y": rng.standard_normal((ROWS, 3)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


@functools.cache
def _nnx_reference(k: int):
    """``(params, stats)`` after STEPS SGD steps of an eager NNX module on one device
    (``nnx.grad``; the module updates its own statistics), ``k`` micro-batches a step."""
    model = NNXNet(nnx.Rngs(0))
    grad = nnx.grad(nnx_loss)
    for batch in _nnx_data():
        total = None
        for mb in _micro_batches(batch, k):
            g = nnx.to_pure_dict(grad(model, mb))
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        new = jax.tree.map(lambda p, g: p - LR * g / k, params, total)
        nnx.update(model, _pure(nnx.state(model, nnx.Param), new))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(
        nnx.state(model, nnx.BatchStat)
    )


def _pure(template, values):
    state = jax.tree.map(lambda v: v, template)
    nnx.replace_by_pure_dict(state, values)
    return state


@functools.cache
def _nnx(stage: int, k: int = 1):
    mesh = jaxzero.make_mesh(8)
    model = NNXNet(nnx.Rngs(0), axis_name=jaxzero.batch_axes(mesh))
    engine = jaxzero.NNXEngine(
        model, nnx_loss, optax.sgd(LR), mesh=mesh, stage=stage, micro_batches=k
    )
    state = engine.init()
    for batch in _nnx_data():
        state, _ = engine.step(state, batch)
    return engine, state


@pytest.mark.parametrize("stage, k", [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2), (3, 2)])
def test_nnx_batchnorm_equals_one_device(stage, k):
    engine, state = _nnx(stage, k)
    params, stats = _nnx_reference(k)
    assert _max_diff(engine.gather_params(state), params) < 1e-5
    assert _max_diff(state.model_state, stats) < 1e-5
    start = nnx.to_pure_dict(nnx.state(NNXNet(nnx.Rngs(0)), nnx.BatchStat))
    assert _max_diff(state.model_state, start) > 0.1


def test_nnx_eval_and_module_use_the_stored_statistics():
    """eval_loss runs the module in eval() mode with the stored statistics; the module
    engine.module returns carries them; init_from builds them from the same call."""
    engine, state = _nnx(3)
    batch = _nnx_data()[0]
    trained = engine.module(state)
    assert _max_diff(nnx.to_pure_dict(nnx.state(trained, nnx.BatchStat)), state.model_state) == 0
    trained.eval()
    want = float(nnx_loss(trained, batch))
    assert float(engine.eval_loss(state, batch)) == pytest.approx(want, rel=1e-5)
    local = NNXNet(nnx.Rngs(1))  # training mode, outside the step: no axis to sync over
    nnx.update(local, nnx.state(trained, nnx.Any(nnx.Param, nnx.BatchStat)))
    assert abs(float(nnx_loss(local, batch)) - want) > 1e-3

    fresh = engine.init_from(lambda: NNXNet(nnx.Rngs(0), axis_name=engine.batch_axes))
    start = nnx.to_pure_dict(nnx.state(NNXNet(nnx.Rngs(0)), nnx.BatchStat))
    assert _max_diff(fresh.model_state, start) == 0.0
    with pytest.raises(TypeError, match="do not pass model_state"):
        jaxzero.NNXEngine(NNXNet(nnx.Rngs(0)), nnx_loss, optax.sgd(LR), model_state={})
