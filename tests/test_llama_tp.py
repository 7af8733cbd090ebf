"""Tensor and sequence parallelism on the Llama (jaxzero.models.llama_tp), composed with
ZeRO over the data axis: (data=4, model=2) and (data=2, model=4) at every stage train as
one device does, with micro-batches and masks; the layout and the refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxzero
from jaxzero import hf
from jaxzero.models.llama import Llama, LlamaConfig
from tests._models import params_of, rel_diff, train_engine, train_reference

# 4 query heads over 2 key/value heads: model=2 splits both, model=4 splits the queries
# and replicates the key/value heads (a device's one query head keeps its group's);
# hidden 36 (not split) pads over data; Qwen2's q/k/v biases, Qwen3's q/k norms
TINY = LlamaConfig(
    vocab_size=64,
    hidden_size=36,
    intermediate_size=52,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qkv_bias=True,
    qk_norm=True,
    tie_word_embeddings=False,
    seq_len=8,
)


def _batches(n: int, cfg: LlamaConfig = TINY, rows: int = 8) -> list[dict]:
    """Rows with a loss mask (a prompt of 1-3 tokens and the rest trained)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        t = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_len + 1)).astype(np.int32)
        prompt = rng.integers(1, 4, (rows, 1))
        mask = (np.arange(cfg.seq_len)[None, :] >= prompt).astype(np.float32)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:], "loss_mask": mask})
    return out


def _mean_loss(cfg: LlamaConfig):
    """One device's loss: the masked mean over the whole batch."""

    def mean_loss(p, b):
        out = Llama(cfg).loss_fn(p, b)
        return out.total / out.weight

    return mean_loss


@pytest.fixture(scope="module")
def reference():
    cfg = dataclasses.replace(TINY, remat="full")
    params = params_of(Llama, cfg)
    # SGD with momentum: linear in the gradient, so params agree to fp32 rounding (Adam's
    # g / sqrt(v) magnifies a near-zero gradient's rounding: 1e-4 for data-only ZeRO too)
    tx, data = optax.sgd(0.5, momentum=0.9), _batches(3)

    losses, final = train_reference(_mean_loss(cfg), params, data, tx)
    return cfg, params, tx, data, losses, final


@pytest.mark.parametrize("model", [2, 4])
@pytest.mark.parametrize("stage,micro", [(0, 1), (1, 2), (2, 1), (3, 2)])
def test_tensor_parallel_trains_like_one_device(reference, model, stage, micro):
    cfg, params, tx, data, ref_losses, ref_params = reference
    mesh = jaxzero.make_mesh(8, model=model)
    engine = Llama(cfg).engine(tx, mesh=mesh, stage=stage, micro_batches=micro)
    losses, final, _ = train_engine(engine, params, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_diff(final, ref_params) < 1e-5


def test_layout_splits_heads_columns_and_vocabulary():
    """The plan: q/gate/up by their output rows, o/down by their input columns, the
    vocabulary by rows; key/value heads split at model=2, replicated at model=4; ZeRO
    shards each model slice over data."""
    model = Llama(TINY)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    for m, kv in ((2, P(None, "model")), (4, None)):
        engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(8, model=m), stage=3)
        engine.abstract_state(shapes)
        lay = {path: x for path, x in _flat(engine.plan.layouts).items()}
        assert lay["layers/self_attn/q_proj/weight"].model_dim == 1
        assert lay["layers/mlp/down_proj/weight"].model_dim == 2
        assert lay["embed_tokens/weight"].model_dim == 0
        assert lay["norm/weight"].model_dim is None
        k = lay["layers/self_attn/k_proj/weight"]
        assert (k.model_dim is not None) == (kv is not None)
        q = lay["layers/self_attn/q_proj/weight"]
        assert q.local().shape == (2, 4 * 8 // m, 36)
        spec = engine.plan.specs.params["layers"]["self_attn"]["q_proj"]["weight"]
        assert "model" in jax.tree.leaves(tuple(spec)) and "data" in jax.tree.leaves(tuple(spec))
        assert np.prod(q.shard_shape) * 8 == np.prod(q.padded_shape)  # an eighth a device


def _flat(layouts):
    from jaxzero.partition import is_layout, path_str

    return {
        path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(layouts, is_leaf=is_layout)
    }


def test_models_the_axis_cannot_split_are_refused():
    mesh = jaxzero.make_mesh(8, model=4)
    with pytest.raises(ValueError, match="intermediate_size=50, which 4 does not divide"):
        Llama(dataclasses.replace(TINY, intermediate_size=50)).engine(optax.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        cfg = dataclasses.replace(TINY, num_attention_heads=12, num_key_value_heads=3)
        Llama(cfg).engine(optax.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match="positive divisor of 8 devices"):
        jaxzero.make_mesh(8, model=3)
    with pytest.raises(ValueError, match="GPT does not support tensor parallelism"):
        from jaxzero.models.gpt import GPT, GPTConfig

        GPT(GPTConfig()).engine(optax.sgd(0.1), mesh=mesh)


FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize("name,model", [("llama_gqa", 2), ("qwen3", 4), ("gemma3", 2)])
def test_hugging_face_checkpoints_load_into_tensor_parallel_layouts(name, model):
    """hf.load reads each device's slices of a transformers checkpoint into the split
    layout: at stage 0 the per-device forward gives transformers' logits (each device its
    slice of the vocabulary); at stage 3 the engine's loss is theirs. Key/value heads
    split (model=2 over 2), replicated (model=4 over 2; Gemma 3's one over 2), tied and
    untied heads, Qwen3's q/k norms, Gemma's norms, scales and soft-caps (Qwen2's biases:
    the equivalence test's model has them)."""
    path = FIXTURES / name / "single"
    ref = np.load(path / "reference.npz")
    tokens = ref["tokens"]  # 2 x 24
    llama = hf.model(path, seq_len=tokens.shape[1])
    mesh = jaxzero.make_mesh(8, model=model)
    engine = llama.engine(optax.sgd(0.0), mesh=mesh, stage=0)
    state = hf.load(path, engine)
    logits = jax.jit(
        jax.shard_map(
            llama.tensor_parallel_apply(model),
            mesh=mesh,
            in_specs=(engine.plan.specs.params, P()),
            out_specs=P(None, None, "model"),
            check_vma=False,
        )
    )(state.params, tokens)
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-4, rtol=0)

    engine3 = llama.engine(optax.sgd(0.0), mesh=mesh, stage=3)
    state3 = hf.load(path, engine3)
    rows = np.concatenate([tokens] * 4)[:, :21]  # 8 rows of 20 inputs, which 4 divides
    loss = float(engine3.eval_loss(state3, {"inputs": rows[:, :-1], "targets": rows[:, 1:]}))
    want = cross_entropy(ref["logits"][:, :20], tokens[:, 1:21])
    assert abs(loss - want) < 1e-5 * max(1.0, abs(want)), (loss, want)


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    z = logits.astype(np.float64)
    logz = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return float(np.mean(logz - np.take_along_axis(z, targets[..., None], -1)[..., 0]))


def test_a_tensor_parallel_checkpoint_restores_into_pure_zero_and_back(reference, tmp_path):
    """Saved at (data=4, model=2), stage 3; restored on 8 data devices at stage 1 and saved
    again; restored at (data=4, model=2): each step's loss is the uninterrupted run's,
    and the last params one device's."""
    cfg, params, tx, data, ref_losses, ref_params = reference  # SGD's momentum moves too
    llama = Llama(cfg)
    split = llama.engine(tx, mesh=jaxzero.make_mesh(8, model=2), stage=3)
    plain = llama.engine(tx, mesh=jaxzero.make_mesh(8), stage=1)
    losses, state = [], split.init(params)
    for i, engine in enumerate((split, plain, split)):
        if i:
            state = jaxzero.CheckpointManager(tmp_path / f"run{i - 1}").restore(engine)[0]
        state, m = engine.step(state, data[i])
        losses.append(float(m["loss"]))
        ckpt = jaxzero.CheckpointManager(tmp_path / f"run{i}")
        ckpt.save(engine, state)
        ckpt.wait()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_diff(engine.gather_params(state), ref_params) < 1e-5


def test_report_puts_each_axis_traffic_beside_its_formula(capsys):
    """`jaxzero report --arch llama --model-axis 2` on 8 devices, 2 micro-batches: the
    compiled step's collectives split by axis (within a model group: ``model``; across
    groups: ``data``) equal the formulas: tensor_parallel_bytes along ``model`` (4 rows
    of 16 tokens a micro-batch: the loss' all-reduces are not scalars), ZeRO's
    stage-1 formula for the params a model device holds along ``data``; the state a
    device holds, ZeRO's for that Ψ (experiments/tp_traffic.py measures every stage on a
    larger model)."""
    import json

    from jaxzero.commands import report

    argv = ["--arch", "llama", "--model-axis", "2", "--stage", "1", "--layers", "2",
            "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--seq-len", "16",
            "--vocab", "64", "--micro-batches", "2", "--batch", "32", "--json"]  # fmt: skip
    assert report.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    c, ratios = data["config"], data["ratios"]
    assert c["model_shards"] == 2 and c["num_shards"] == 4
    assert c["params_a_model_device"] < c["num_params"] < 2 * c["params_a_model_device"]
    assert ratios["persistent"] == pytest.approx(1.0, abs=1e-3)
    assert ratios["comm"] == pytest.approx(1.0, abs=1e-3)  # the data axis
    assert ratios["model_axis"] == pytest.approx(1.0, abs=1e-3)
    assert data["traffic"]["by_scope"]["both"] == 0
    groups = {x["group_size"] for x in data["collectives"] if x["kind"] == "reduce-scatter"}
    assert groups == {2, 4}  # the sequence's within a group, the gradients' across


def test_report_puts_ulysses_all_to_alls_beside_their_formula(capsys):
    """`jaxzero report --arch llama --ulysses` on 4 devices (the layers recomputed in the
    backward pass; 2 key/value heads, repeated for 4 devices): the all-to-alls equal
    formulas.ulysses_bytes, the rest ZeRO's stage-1 formula, the state ZeRO's."""
    import json

    from jaxzero.commands import report

    argv = ["--arch", "llama", "--ulysses", "--devices", "4", "--stage", "1", "--layers", "2",
            "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--seq-len", "32",
            "--vocab", "64", "--remat", "full", "--json"]  # fmt: skip
    assert report.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["ulysses"] and data["traffic"]["by_kind"]["all-to-all"] > 0
    for key in ("persistent", "comm", "ulysses"):
        assert data["ratios"][key] == pytest.approx(1.0, abs=1e-3), key


@pytest.mark.unit
def test_report_needs_the_model_that_splits():
    from jaxzero.accounting import measure

    llama = Llama(TINY)
    shapes = jax.eval_shape(llama.init, jax.random.key(0))
    tokens = np.zeros((8, TINY.seq_len), np.int32)
    for mesh, ulysses in ((jaxzero.make_mesh(8, model=2), False), (jaxzero.make_mesh(4), True)):
        engine = llama.engine(optax.sgd(0.1), mesh=mesh, stage=1, ulysses=ulysses)
        state = engine.abstract_state(shapes)
        with pytest.raises(ValueError, match="pass the Llama it trains"):
            measure.report(engine, state, {"inputs": tokens, "targets": tokens})


@pytest.mark.parametrize("stage,micro", [(1, 1), (3, 2)])
def test_ulysses_trains_a_four_times_longer_sequence_like_one_device(stage, micro):
    """DeepSpeed-Ulysses on (rows over replica=2, sequence over data=4): a device holds a
    quarter of each 32-token row (8 tokens), the attention exchanges heads for sequence;
    packed documents (positions restart mid-row, across slices) and a loss mask: one
    device's losses and params on the whole rows. 2 key/value heads for 4 devices: each
    repeated to its query heads before the exchange."""
    cfg = dataclasses.replace(TINY, seq_len=32, remat="full")
    params = params_of(Llama, cfg)
    data = []
    for i, b in enumerate(_batches(3, cfg)):
        cut = 5 + (np.arange(8)[:, None] + 3 * i) % 20  # a second document from `cut` on
        data.append({**b, "segment_ids": (np.arange(32)[None, :] >= cut).astype(np.int32)})
    tx = optax.sgd(0.5, momentum=0.9)
    ref_losses, ref_params = train_reference(_mean_loss(cfg), params, data, tx)
    mesh = jaxzero.make_mesh(8, replicas=2)
    engine = Llama(cfg).engine(tx, mesh=mesh, stage=stage, micro_batches=micro, ulysses=True)
    losses, final, _ = train_engine(engine, params, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_diff(final, ref_params) < 1e-5


def test_ulysses_refuses_what_it_cannot_split():
    llama = Llama(dataclasses.replace(TINY, num_attention_heads=6, num_key_value_heads=2))
    with pytest.raises(ValueError, match="num_attention_heads=6, which 4 does not divide"):
        llama.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(8, replicas=2), ulysses=True)
    mesh = jaxzero.make_mesh(8, replicas=2)
    engine = Llama(TINY).engine(optax.sgd(0.1), mesh=mesh, ulysses=True)
    bad = {"inputs": np.zeros((2, 10), np.int32), "targets": np.zeros((2, 10), np.int32)}
    with pytest.raises(ValueError, match="splits each sequence over the 4 data devices"):
        engine.step(engine.init(params_of(Llama, TINY)), bad)
    with pytest.raises(ValueError, match="loss_takes_rng"):
        jaxzero.Engine(lambda p, b, r: 0.0, optax.sgd(0.1), mesh=mesh, ulysses=True,
                       loss_takes_rng=True)  # fmt: skip


def test_a_run_resumes_with_another_model_axis_or_ulysses():
    """`jaxzero train --resume RUN --set mesh.model=1`: checkpoints hold global arrays, so
    a resumed run may change its mesh (the library round trip is tested above)."""
    from jaxzero.train import config as C
    from jaxzero.train import resume

    before = C.apply_overrides(C.Config(), ["model.arch=llama", "mesh.model=2"])
    after = C.apply_overrides(before, ["mesh.model=1", "mesh.ulysses=true"])
    said = resume.check_changes(resume.changes(before, after))
    assert said == ["mesh.model: 2 -> 1", "mesh.ulysses: False -> True"]


def test_estimate_with_a_model_axis_counts_a_model_devices_share(tmp_path, capsys):
    """`jaxzero estimate --config` with mesh.model=2 on 8 devices: Ψ a model device's share
    (the engine's own split), N = 4, activations of the 2 rows a model group holds / 2,
    and the bytes along the model axis the compiled stage-0 step sends."""
    import json

    from jaxzero.accounting import activations
    from jaxzero.accounting.comm import collectives_from_hlo, traffic
    from jaxzero.commands import estimate as command
    from jaxzero.models import from_fields
    from jaxzero.partition import is_layout

    fields = {"arch": "llama", "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "seq_len": 16}  # fmt: skip
    path = tmp_path / "tp.yaml"  # YAML reads JSON
    path.write_text(json.dumps({"model": fields, "mesh": {"model": 2}, "train": {"batch_size": 8}}))
    assert command.main(["--config", str(path), "-n", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)

    llama = from_fields(fields)
    engine = llama.engine(optax.adamw(1e-3), mesh=jaxzero.make_mesh(8, model=2), stage=0)
    state = engine.abstract_state(jax.eval_shape(llama.init, jax.random.key(0)))
    lays = jax.tree.leaves(engine.plan.layouts, is_leaf=is_layout)
    assert got["num_params"] == sum(np.prod(x.local().shape) for x in lays)
    assert got["total_params"] == engine.num_params and got["devices"] == 4
    whole = activations.activation_bytes(
        activations.DecoderShape.of(llama.config), 2, bytes_per_value=4.0
    )
    assert got["activations"]["per_layer"] == pytest.approx(whole.per_layer / 2)
    tokens = jax.ShapeDtypeStruct((8, 16), np.int32)
    compiled = engine.compile(state, {"inputs": tokens, "targets": tokens})
    tr = traffic(collectives_from_hlo(compiled.as_text()).collectives, 1, group_size=2)
    assert got["model_comm"] == pytest.approx(tr.by_scope["intra"], rel=1e-3)


def test_estimate_with_ulysses_divides_activations_and_counts_the_all_to_alls(tmp_path, capsys):
    """`jaxzero estimate --config` with mesh.ulysses on 4 devices: Ψ whole over N = 4, the
    activations of a device's 2 whole rows / 4, and the all-to-all bytes the compiled
    step sends (layers recomputed; 2 key/value heads repeated for 4 devices)."""
    import json

    from jaxzero.accounting import activations
    from jaxzero.accounting.comm import collectives_from_hlo, traffic
    from jaxzero.commands import estimate as command
    from jaxzero.models import from_fields

    fields = {"arch": "llama", "vocab_size": 64, "d_model": 64, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "seq_len": 32, "remat": "full"}  # fmt: skip
    path = tmp_path / "ulysses.yaml"
    path.write_text(json.dumps({"model": fields, "mesh": {"ulysses": True},
                                "train": {"batch_size": 2}}))  # fmt: skip
    assert command.main(["--config", str(path), "-n", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)

    llama = from_fields(fields)
    engine = llama.engine(optax.adamw(1e-3), mesh=jaxzero.make_mesh(4), stage=1, ulysses=True)
    state = engine.abstract_state(jax.eval_shape(llama.init, jax.random.key(0)))
    assert got["num_params"] == engine.num_params and got["devices"] == 4
    whole = activations.activation_bytes(
        activations.DecoderShape.of(llama.config), 2, "full", bytes_per_value=4.0
    )
    assert got["sequence"] == 4
    assert got["activations"]["per_layer"] == pytest.approx(whole.per_layer / 4)
    tokens = jax.ShapeDtypeStruct((2, 32), np.int32)
    compiled = engine.compile(state, {"inputs": tokens, "targets": tokens})
    tr = traffic(collectives_from_hlo(compiled.as_text()).collectives, 1)
    assert got["sequence_comm"] == pytest.approx(tr.by_kind["all-to-all"], rel=1e-6)
