"""Frozen params (``Engine(trainable=...)``): a frozen base and trainable low-rank
adapters train at every stage exactly as on one device, with no gradient, gradient
collective, master or optimizer state for the base; checkpoints hold it (or not)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import rel_diff
from flax import nnx
from optax import MaskedNode

import jaxzero
from jaxzero.accounting.comm import collectives_from_hlo, traffic
from jaxzero.checkpoint import param_entries, read_metadata

N = 8
D, V, R, L = 32, 16, 4, 2  # width, vocab, adapter rank, layers: all divide by 8 or are small
ROWS, SEQ = 16, 4
STEPS = 3
TX = optax.adamw(1e-2, weight_decay=0.1)  # decay would move a frozen param that got updates


def lora_params(d=D, v=V, r=R, emb_dtype=np.float32, w_dtype=np.float32, seed=0):
    """A frozen base (embedding, one square weight per layer) and adapters ``a``, ``b``."""
    rng = np.random.default_rng(seed)
    return {
        "emb": (0.3 * rng.standard_normal((v, d))).astype(emb_dtype),
        "layers": [
            {
                "w": (rng.standard_normal((d, d)) / np.sqrt(d)).astype(w_dtype),
                "a": (0.1 * rng.standard_normal((r, d))).astype(np.float32),
                "b": (0.1 * rng.standard_normal((d, r))).astype(np.float32),
            }
            for _ in range(L)
        ],
    }


def adapters(path: str) -> bool:
    return path.rsplit("/", 1)[-1] in ("a", "b")


def split_by_hand(params):
    """(trainable, frozen) written out, for references that owe nothing to jaxzero."""
    train = {"layers": [{"a": p["a"], "b": p["b"]} for p in params["layers"]]}
    frozen = {"emb": params["emb"], "layers": [{"w": p["w"]} for p in params["layers"]]}
    return train, frozen


def join_by_hand(train, frozen):
    layers = [{"w": f["w"], **t} for t, f in zip(train["layers"], frozen["layers"], strict=True)]
    return {"emb": frozen["emb"], "layers": layers}


def predict(p, tokens):
    x = jaxzero.use_params({"emb": p["emb"]})["emb"][tokens]
    for layer in p["layers"]:
        layer = jaxzero.use_params(layer)  # stage 3 gathers the layer here, frozen w too
        x = jnp.tanh(x @ layer["w"] + (x @ layer["a"].T) @ layer["b"].T)
    return x.sum(-1)


def mean_loss(p, batch):
    return jnp.mean((predict(p, batch["tokens"]) - batch["y"]) ** 2)


def weighted_loss(p, batch):
    err = (predict(p, batch["tokens"]) - batch["y"]) ** 2
    return jaxzero.loss.Weighted(jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"]))


LOSSES = {"mean": mean_loss, "weighted": weighted_loss}


def batches(n=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    # 0 to 4 tokens a row, unevenly (a device's micro-batch is one row): 0,3,1,4,2,0,...
    counts = (np.arange(ROWS) * 3) % (SEQ + 1)
    mask = (np.arange(SEQ)[None, :] < counts[:, None]).astype(np.float32)
    return [
        {
            "tokens": rng.integers(0, V, (ROWS, SEQ)).astype(np.int32),
            "y": rng.standard_normal((ROWS, SEQ)).astype(np.float32),
            "mask": mask,
        }
        for _ in range(n)
    ]


def train(engine, params, data, state=None):
    state = engine.init(params) if state is None else state
    losses = []
    for b in data:
        state, metrics = engine.step(state, b)
        losses.append(float(metrics["loss"]))
    return np.array(losses), engine.gather_params(state), state


def engine_of(loss, n, stage, trainable=adapters, **kw):
    kw = {"min_shard_size": 1, **kw}
    mesh = jaxzero.make_mesh(n)
    return jaxzero.Engine(loss, TX, mesh=mesh, stage=stage, trainable=trainable, **kw)


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def one_device():
    """Per loss: one device, stage 0, the same trainable params: (losses, params)."""
    params, data = lora_params(), batches()
    return {name: train(engine_of(loss, 1, 0), params, data)[:2] for name, loss in LOSSES.items()}


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("loss", ["mean", "weighted"])
def test_one_device_engine_is_plain_optax_on_the_adapters(one_device, loss):
    """The reference itself: optax on the adapters alone, the base a closed-over constant."""
    params, data = lora_params(), batches()
    train_p, frozen = split_by_hand(jax.tree.map(jnp.asarray, params))

    def objective(t, b):
        out = LOSSES[loss](join_by_hand(t, frozen), b)
        return out.total / out.weight if loss == "weighted" else out

    @jax.jit
    def step(t, s, b):
        value, g = jax.value_and_grad(objective)(t, b)
        u, s = TX.update(g, s, t)
        return optax.apply_updates(t, u), s, value

    s, losses = TX.init(train_p), []
    for b in data:
        train_p, s, value = step(train_p, s, b)
        losses.append(float(value))
    ref_losses, ref_params = one_device[loss]
    assert rel_diff(ref_losses, np.array(losses)) <= 1e-6
    assert rel_diff(ref_params, join_by_hand(train_p, frozen)) <= 1e-6
    assert rel_diff(ref_params, params) > 1e-3, "the adapters must have trained"


@pytest.mark.parametrize(
    "stage, per_layer, loss",
    [(s, pl, "mean") for s in range(4) for pl in (False, True)]
    + [(1, False, "weighted"), (3, True, "weighted")],
)
def test_frozen_base_trains_like_one_device(one_device, stage, per_layer, loss):
    params, data = lora_params(), batches()
    engine = engine_of(LOSSES[loss], N, stage, per_layer=per_layer, micro_batches=2)
    losses, final, state = train(engine, params, data)
    ref_losses, ref_params = one_device[loss]
    assert rel_diff(losses, ref_losses) <= 1e-5
    assert rel_diff(final, ref_params) <= 1e-5
    # the frozen leaves come back bit for bit; the adapters moved
    assert np.array_equal(final["emb"], params["emb"])
    for got, init in zip(final["layers"], params["layers"], strict=True):
        assert np.array_equal(got["w"], init["w"])
        assert not np.array_equal(got["a"], init["a"])
    assert jax.tree.structure(final) == jax.tree.structure(params)
    # stage 3 keeps the base sharded, stages 0-2 replicated
    emb = state.frozen["emb"]
    assert emb.is_fully_replicated == (stage < 3)


# ------------------------------------------------------------------------ what a state holds


@pytest.mark.parametrize("stage", [0, 1])
def test_state_keeps_no_optimizer_state_or_master_for_frozen_params(stage):
    params = lora_params()
    engine = engine_of(mean_loss, N, stage)
    state = engine.init(params)
    train_p, frozen = split_by_hand(params)
    size = lambda tree: sum(np.size(x) for x in jax.tree.leaves(tree))
    assert engine.num_params == size(train_p) == 2 * L * R * D
    assert engine.num_frozen == size(frozen) == V * D + L * D * D
    # optimizer state: as the optimizer's for the adapters alone (count, mu, nu)
    theirs = jax.tree.leaves(TX.init(train_p))
    assert len(jax.tree.leaves(state.opt_state)) == len(theirs) == 1 + 2 * 2 * L
    shapes = lambda xs: sorted(tuple(x.shape) for x in xs)
    assert shapes(jax.tree.leaves(engine.opt_layouts, is_leaf=jaxzero.partition.is_layout)) == (
        shapes(theirs)
    )
    # params hold the adapters, frozen the base, each a MaskedNode where the other has it
    assert state.master is None
    assert isinstance(state.params["emb"], MaskedNode)
    assert isinstance(state.params["layers"][0]["w"], MaskedNode)
    assert isinstance(state.frozen["layers"][0]["a"], MaskedNode)
    assert len(jax.tree.leaves(state.params)) == 2 * L
    assert len(jax.tree.leaves(state.frozen)) == 1 + L
    # a tree of bools says the same as the predicate
    mask = jax.tree_util.tree_map_with_path(
        lambda path, _: adapters(jaxzero.partition.path_str(path)), params
    )
    again = engine_of(mean_loss, N, stage, trainable=mask)
    again_state = again.init(params)
    assert again.num_params == engine.num_params and again.num_frozen == engine.num_frozen
    assert jax.tree.structure(again_state) == jax.tree.structure(state)


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_run_keeps_each_frozen_param_in_its_own_dtype(stage):
    """precision='bf16': a frozen bf16 leaf stays bf16, a frozen fp32 one fp32, neither
    gets a master; the adapters get bf16 working copies and fp32 masters."""
    params = lora_params(emb_dtype=jnp.bfloat16)
    engine = engine_of(mean_loss, N, stage, precision="bf16", per_layer=True)

    def check(s):
        assert s.frozen["emb"].dtype == jnp.bfloat16
        assert s.frozen["layers"][0]["w"].dtype == jnp.float32
        assert s.params["layers"][0]["a"].dtype == jnp.bfloat16
        assert s.master["layers"][0]["a"].dtype == jnp.float32
        assert isinstance(s.master["emb"], MaskedNode)
        assert isinstance(s.master["layers"][1]["w"], MaskedNode)
        assert len(jax.tree.leaves(s.master)) == 2 * L

    state = engine.init(params)
    check(state)
    losses, final, state = train(engine, None, batches(2), state)  # the step donates
    check(state)
    assert np.isfinite(losses).all()
    assert np.array_equal(final["emb"], np.asarray(params["emb"], np.float32))
    assert np.array_equal(final["layers"][1]["w"], params["layers"][1]["w"])


# ------------------------------------------------------------------------ gradient traffic


def _traffic(engine, params, batch):
    shapes = jax.eval_shape(lambda: params)
    compiled = engine.compile(engine.abstract_state(shapes), batch)
    return traffic(collectives_from_hlo(compiled.as_text()).collectives).by_kind


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_frozen_params_get_no_gradient_collective(stage):
    """Reduce-scatter and all-reduce bytes are the adapters' alone: as an engine whose
    loss closes over the base (not a param at all), and as the ring formula."""
    params, batch = lora_params(), batches(1)[0]
    train_p, frozen = split_by_hand(params)
    consts = jax.tree.map(jnp.asarray, frozen)
    kw = {"per_layer": True}
    with_frozen = _traffic(engine_of(mean_loss, N, stage, **kw), params, batch)
    closed = lambda t, b: mean_loss(join_by_hand(t, consts), b)
    without = _traffic(engine_of(closed, N, stage, trainable=None, **kw), train_p, batch)
    grad_bytes = 4 * 2 * L * R * D * (N - 1) / N  # fp32 gradients of Ψt, one ring pass
    reduced = lambda t: t.get("reduce-scatter", 0.0) + t.get("all-reduce", 0.0)
    print(f"stage {stage}: with frozen {with_frozen}, base closed over {without}")
    assert reduced(with_frozen) == pytest.approx(reduced(without))
    if stage == 0:
        assert with_frozen.get("all-reduce") == pytest.approx(2 * grad_bytes)  # two passes
        assert "reduce-scatter" not in with_frozen and "all-gather" not in with_frozen
    else:
        assert with_frozen.get("reduce-scatter") == pytest.approx(grad_bytes)
        assert with_frozen.get("all-reduce", 0.0) == 0.0
    if stage == 3:  # the base is gathered (at least once a step), never reduced
        base_bytes = 4 * (V * D + L * D * D) * (N - 1) / N
        assert with_frozen["all-gather"] >= without["all-gather"] + base_bytes
    else:
        assert with_frozen.get("all-gather") == without.get("all-gather")


# ------------------------------------------------------------------------ persistent bytes


def _device0_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_persistent_bytes_match_the_formula(stage, precision):
    """Per device: trainable Ψt as the ZeRO formulas (params 4|2 B, master 0|4 B, Adam
    8 B), frozen Ψf once in its dtype (4 B fp32, 2 B bf16), replicated below stage 3."""
    wide = 256  # big enough that the replicated Adam count (4 B) is far under 1%
    frozen_dtype = np.float32 if precision == "fp32" else jnp.bfloat16
    params = lora_params(d=wide, v=wide, r=8, emb_dtype=frozen_dtype, w_dtype=frozen_dtype)
    engine = engine_of(lambda p, b: 0.0, N, stage, precision=precision)
    state = engine.init(params)
    psi_t, psi_f = engine.num_params, engine.num_frozen
    assert (psi_t, psi_f) == (2 * L * 8 * wide, wide * wide + L * wide * wide)
    by = lambda sharded: N if sharded else 1
    narrow = 4 if precision == "fp32" else 2
    want = {
        "params": narrow * psi_t / by(stage == 3),
        "master": 0 if precision == "fp32" else 4 * psi_t / by(stage >= 1),
        "opt_state": 8 * psi_t / by(stage >= 1),
        "frozen": narrow * psi_f / by(stage == 3),
    }
    got = {part: _device0_bytes(getattr(state, part)) for part in want}
    print(f"stage {stage} {precision}: {got} want {want}")
    for part, w in want.items():
        if w == 0:
            assert got[part] == 0, part
        else:
            assert abs(got[part] / w - 1) <= 0.01, (part, got[part], w)
    assert abs(sum(got.values()) / sum(want.values()) - 1) <= 0.01


# ------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A stage-3, 8-device run saved after 2 steps with and without its base, and the
    losses and params of its next 2 steps."""
    params, data = lora_params(), batches(4)
    engine = engine_of(mean_loss, N, 3, per_layer=True)
    _, _, state = train(engine, params, data[:2])
    dirs = {}
    for save_frozen in (True, False):
        dirs[save_frozen] = tmp_path_factory.mktemp(f"frozen-{save_frozen}")
        ckpt = jaxzero.CheckpointManager(dirs[save_frozen], save_frozen=save_frozen)
        ckpt.save(engine, state)
        ckpt.wait()
    losses, final, _ = train(engine, None, data[2:], state)
    return dirs, params, data[2:], losses, final


def _stage1_on_two(**kw):
    return engine_of(mean_loss, 2, 1, **kw)


def test_checkpoint_restores_into_another_stage_and_trains_on(saved):
    dirs, params, rest, want_losses, want_params = saved
    meta = read_metadata(dirs[True] / "2")
    trains = {"/".join(str(k) for _, k in e["path"]): e["trainable"] for e in meta["param_tree"]}
    assert trains == {"emb": False} | {
        f"layers/{i}/{k}": k != "w" for i in range(L) for k in ("w", "a", "b")
    }
    engine = _stage1_on_two()  # not initialised: its plan comes from the checkpoint
    state, _ = jaxzero.CheckpointManager(dirs[True]).restore(engine)
    assert int(state.step) == 2
    restored = engine.gather_params(state)
    assert np.array_equal(restored["emb"], params["emb"])
    assert np.array_equal(restored["layers"][1]["w"], params["layers"][1]["w"])
    losses, final, _ = train(engine, None, rest, state)
    assert rel_diff(losses, want_losses) <= 1e-5
    assert rel_diff(final, want_params) <= 1e-5
    assert np.array_equal(final["emb"], params["emb"])


def test_checkpoint_without_frozen_needs_them_given(saved):
    dirs, params, rest, want_losses, want_params = saved
    meta = read_metadata(dirs[False] / "2")
    assert meta["frozen_saved"] is False
    assert not any(name.startswith("frozen/") for name in meta["leaves"])
    assert any(name.startswith("frozen/") for name in read_metadata(dirs[True] / "2")["leaves"])
    with pytest.raises(jaxzero.CheckpointError) as err:
        param_entries(meta)
    assert "'emb'" in one_line(err)
    ckpt = jaxzero.CheckpointManager(dirs[False])
    engine = _stage1_on_two()
    with pytest.raises(jaxzero.CheckpointError) as err:
        ckpt.restore(engine)
    assert "save_frozen" in one_line(err)
    base = _stage1_on_two().init(params).frozen  # another engine's, laid out alike
    state, _ = ckpt.restore(engine, frozen=base)
    assert int(state.step) == 2
    losses, final, _ = train(engine, None, rest, state)
    assert rel_diff(losses, want_losses) <= 1e-5
    assert rel_diff(final, want_params) <= 1e-5


@pytest.mark.parametrize(
    "trainable, name",
    [(lambda path: path.endswith("/a"), "layers/0/b"), (None, "emb")],
)
def test_checkpoint_refuses_an_engine_that_freezes_otherwise(saved, trainable, name):
    dirs = saved[0]
    engine = _stage1_on_two(trainable=trainable)
    with pytest.raises(jaxzero.CheckpointError) as err:
        jaxzero.CheckpointManager(dirs[True]).restore(engine)
    assert f"param {name!r}" in one_line(err)


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "trainable, match",
    [
        (lambda path: 1 if adapters(path) else 0, r"trainable\('emb'\) returned 0"),
        ({"emb": False, "layers": [{"w": False, "a": True, "b": True}]}, "structure"),
        (lambda path: False, "freezes all 7 params"),
        (jax.tree.map(lambda _: False, lora_params()), "freezes all 7 params"),
    ],
    ids=["non-bool", "other-structure", "all-frozen-predicate", "all-frozen-tree"],
)
def test_bad_trainable_is_refused_in_one_line(trainable, match):
    engine = engine_of(mean_loss, 1, 0, trainable=trainable)
    with pytest.raises(ValueError, match=match) as err:
        engine.init(lora_params())
    one_line(err)


# ------------------------------------------------------------------------------------- NNX


class LoRAStack(nnx.Module):
    """Two of Flax's own LoRA layers over frozen linear bases, each through ``use``."""

    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [nnx.LoRA(16, 4, 16, base_module=nnx.Linear(16, 16, rngs=rngs), rngs=rngs)]
            + [nnx.LoRA(16, 4, 16, base_module=nnx.Linear(16, 16, rngs=rngs), rngs=rngs)]
        )
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(jaxzero.nnx.use(layer)(x))
        return jaxzero.nnx.use(self.head)(x)


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_nnx_engine_trains_adapters_at_stage_3():
    """NNXEngine(trainable=...) at stage 3 against Flax's own LoRA recipe on one device
    (nnx.Optimizer and the gradient over nnx.LoRAParam only)."""
    rng = np.random.default_rng(2)
    data = [
        {
            "x": rng.standard_normal((16, 16)).astype(np.float32),
            "y": rng.standard_normal((16, 3)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]
    model = LoRAStack(nnx.Rngs(0))
    # lora_b starts at zero: give it a value, so lora_a's gradient is not zero at step 1
    for layer in model.layers:
        layer.lora_b[...] = 0.1 * jnp.ones_like(layer.lora_b[...])
    initial = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    ref_model = nnx.clone(model)
    optimizer = nnx.Optimizer(ref_model, TX, wrt=nnx.LoRAParam)

    @nnx.jit
    def step(m, opt, batch):
        value, grads = nnx.value_and_grad(nnx_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            m, batch
        )
        opt.update(m, grads)
        return value

    ref_losses = np.array([float(step(ref_model, optimizer, b)) for b in data])
    ref_params = nnx.to_pure_dict(nnx.state(ref_model, nnx.Param))

    engine = jaxzero.NNXEngine(
        model,
        nnx_loss,
        TX,
        mesh=jaxzero.make_mesh(N),
        stage=3,
        per_layer=True,
        min_shard_size=1,
        trainable=lambda path: "/lora_" in path,
    )
    state = engine.init()
    losses = []
    for b in data:
        state, metrics = engine.step(state, b)
        losses.append(float(metrics["loss"]))
    assert engine.num_params == 2 * 2 * 16 * 4
    assert engine.num_frozen == 2 * (16 * 16 + 16) + 16 * 3 + 3
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    trained = nnx.to_pure_dict(nnx.state(engine.module(state), nnx.Param))
    assert rel_diff(trained, ref_params) <= 1e-5
    for i in range(2):
        base = trained["layers"][i]["base_module"]
        assert np.array_equal(base["kernel"], initial["layers"][i]["base_module"]["kernel"])
        assert not np.array_equal(trained["layers"][i]["lora_a"], initial["layers"][i]["lora_a"])
    assert np.array_equal(trained["head"]["kernel"], initial["head"]["kernel"])
