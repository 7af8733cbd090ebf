"""LoRA on the Hugging Face fixtures: exact at every stage against one device, PEFT
adapters in and out against peft's own logits, and a LoRA run from the command line."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxzero import cli, hf, make_mesh
from jaxzero.hf import peft
from jaxzero.hf.safetensors import SafetensorsFile
from jaxzero.models.llama import Llama
from jaxzero.models.llama_hf import HFError
from jaxzero.models.lora import LoraConfig

HF = Path(__file__).parent / "fixtures" / "hf"
PEFT = Path(__file__).parent / "fixtures" / "peft"
BASE = HF / "llama_gqa" / "single"  # bf16 weights


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize(
    "name, base", [("llama_gqa_r4", "llama_gqa"), ("qwen2_tied_qv_rslora", "qwen2_tied")]
)
def test_a_peft_adapter_loads_to_peft_logits_and_merges(name, base, tmp_path):
    """peft's own logits (reference.npz, torch) from the adapter over its base; the merged
    weights give peft's merge_and_unload logits; written back, the adapter is the same."""
    adapter = peft.read_adapter(PEFT / name)
    ref = np.load(PEFT / name / "reference.npz")
    m = hf.model(HF / base / "single", lora=adapter.config, seq_len=24)
    engine = m.engine(optax.sgd(0.0), mesh=make_mesh(8), stage=3)
    state = hf.load(HF / base / "single", engine, m, adapter=adapter)
    params = engine.gather_params(state)
    tokens = jnp.asarray(ref["tokens"])
    assert _relative(np.asarray(m.apply(params, tokens)), ref["logits"]) < 1e-4
    assert _relative(ref["logits"], ref["base_logits"]) > 0.1  # the adapter matters
    merged = peft.merged(params, adapter.config)
    plain = np.asarray(Llama(m.config).apply(merged, tokens))
    assert _relative(plain, ref["merged_logits"]) < 1e-4
    peft.write_adapter(tmp_path, adapter.config, adapter.tensors, base=str(HF / base / "single"))
    again = peft.read_adapter(tmp_path)
    assert again.config == adapter.config
    for k, v in adapter.tensors.items():
        np.testing.assert_array_equal(again.tensors[k], v)


def _batch(rows: int = 16, seq: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (rows, seq + 1)).astype(np.int32)
    mask = (rng.random((rows, seq)) < 0.6).astype(np.float32)  # uneven tokens per row
    mask[0] = 0.0  # a row with nothing to learn from
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


def _train(stage: int, devices: int, micro: int, steps: int = 3):
    lora = LoraConfig(rank=4, alpha=8)
    m = hf.model(BASE, lora=lora, seq_len=16)
    engine = m.engine(optax.adamw(1e-3), mesh=make_mesh(devices), stage=stage, micro_batches=micro)
    state = hf.load(BASE, engine, m, seed=1)
    base = jax.tree.map(np.asarray, jax.device_get(engine.gather_params(state)))
    losses = []
    for _ in range(steps):
        state, metrics = engine.step(state, _batch())
        losses.append(float(metrics["loss"]))
    return m, engine, state, base, np.array(losses)


@pytest.fixture(scope="module")
def one_device():
    return _train(0, 1, 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lora_at_every_stage_equals_one_device(stage, one_device):
    """8 devices, 2 micro-batches, masked uneven tokens: the losses and adapters of one
    device to 1e-5; the step-1 loss is the base model's; the base is bit-identical."""
    m, e1, s1, base, ref = one_device
    _, engine, state, _, losses = _train(stage, 8, 2)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    got, want = engine.gather_params(state), e1.gather_params(s1)
    flat = dict(jax.tree_util.tree_leaves_with_path(want))
    before = dict(jax.tree_util.tree_leaves_with_path(base))
    for path, x in jax.tree_util.tree_leaves_with_path(got):
        np.testing.assert_allclose(x, flat[path], atol=1e-5, rtol=1e-5)
        if "lora" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(x, before[path])  # the base, bit for bit
    plain = Llama(m.config)  # the base model alone, the same batch
    out = plain.loss_fn(hf.read_params(BASE, plain), _batch())
    np.testing.assert_allclose(losses[0], float(out.total / out.weight), rtol=1e-5)
    assert engine.num_frozen > 5 * engine.num_params  # the base is frozen, its bf16 kept
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.frozen))
    assert len(jax.tree.leaves(state.opt_state)) == 1 + 2 * 14  # count, mu and nu per adapter


def test_bad_lora_settings_are_one_line():
    with pytest.raises(ValueError, match="matches none of the model's linear modules: self_attn"):
        hf.model(BASE, lora=LoraConfig(rank=2, targets="nothing_proj"))
    with pytest.raises(ValueError, match="lora.rank must be a positive integer"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="lora.rank 40 exceeds self_attn.q_proj's dimensions"):
        hf.model(BASE, lora=LoraConfig(rank=40))
    other = peft.read_adapter(PEFT / "qwen2_tied_qv_rslora")
    wrong = LoraConfig(rank=2, alpha=4, targets=("self_attn.q_proj", "self_attn.v_proj"))
    m = hf.model(BASE, lora=wrong)
    bad = peft.Adapter(
        other.config,
        {k: v[:, :, :5] if k.endswith("lora_A") else v for k, v in other.tensors.items()},
        None,
    )
    engine = m.engine(optax.sgd(0.1), mesh=make_mesh(1))
    with pytest.raises(HFError, match="made for another base model"):
        hf.load(BASE, engine, m, adapter=bad)


def _lora_run(root: Path, base: Path, data: Path, *extra: str) -> int:
    return cli.main(
        [
            "train",
            *extra,
            *("--set", "model.seq_len=16", "--set", "train.batch_size=8"),
            *("--set", "logging.eval_every=2", "--set", "logging.sample_tokens=0"),
            *("--set", "checkpoint.every=2", "--set", f"logging.root={root}"),
            *("--devices", "2", "--stage", "3"),
        ]
    )


@pytest.mark.system  # the command line end to end
def test_a_lora_run_checkpoints_adapters_and_refuses_a_changed_base(tmp_path, capsys):
    """The command line: step 1 is the base model's loss, checkpoints hold no base, resume
    continues, and a base that changed since is refused in one line."""
    base = tmp_path / "base"
    shutil.copytree(BASE, base)
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"t{i}" for i in rng.integers(3, 64, n))
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": words(4), "completion": " " + words(5)} for _ in range(80)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "runs" / "lora"
    start = ("--init-from", f"hf:{base}", "--data", str(data), "--set", "lora.rank=4")
    assert _lora_run(tmp_path / "runs", base, data, *start, "--steps", "2", "--name", "lora") == 0
    out = capsys.readouterr().out
    assert "lora   rank 4, alpha 16 on all-linear: 3,712 params train" in out
    meta = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["frozen_saved"] is False
    assert not any(n.startswith("frozen/") for n in meta["leaves"])
    assert cli.main(["train", "--resume", str(run), "--steps", "4"]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if "loss" in json.loads(x)][-1] == 4
    _exports_merge_the_adapters(run, base, tmp_path, capsys)
    weights = base / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 1
    weights.write_bytes(bytes(raw))
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run), "--steps", "6"]) != 0
    err = capsys.readouterr().err
    assert "changed since the checkpoint was saved" in err and len(err.strip().splitlines()) == 1


def _exports_merge_the_adapters(run: Path, base: Path, tmp_path: Path, capsys) -> None:
    """--format peft writes the trained adapters over the base (peft's names and
    config), --format hf the base with them merged (in the base's bf16), and both give
    the same logits; sample runs the merged model."""
    for fmt in ("peft", "hf"):
        assert cli.main(["export", str(run), "--out", str(tmp_path / fmt), "--format", fmt]) == 0
    adapter = peft.read_adapter(tmp_path / "peft")
    assert adapter.config.rank == 4 and adapter.base == str(base)
    raw = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert raw["r"] == 4 and raw["lora_alpha"] == 16 and "q_proj" in raw["target_modules"]
    m = hf.model(base, lora=adapter.config, seq_len=16)
    engine = m.engine(optax.sgd(0.0), mesh=make_mesh(1))
    params = engine.gather_params(hf.load(base, engine, m, adapter=adapter))
    tokens = jnp.asarray(np.arange(32).reshape(2, 16) % 64)
    with_adapter = np.asarray(m.apply(params, tokens))
    plain = hf.model(tmp_path / "hf", seq_len=16)
    out = np.asarray(plain.apply(hf.read_params(tmp_path / "hf", plain), tokens))
    assert hf.Weights(tmp_path / "hf").dtype("model.embed_tokens.weight") == "bfloat16"
    assert _relative(out, with_adapter) < 2e-2  # the merged weights rounded to bf16 once
    before = np.asarray(Llama(m.config).apply(hf.read_params(base, plain), tokens))
    assert np.max(np.abs(with_adapter - before)) > 1e-3  # the adapters trained
    capsys.readouterr()
    assert cli.main(["sample", str(run), "--prompt", "t3 t4", "--tokens", "3"]) == 0
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x"), "--format", "jaxzero"]) == 0
    mine = tmp_path / "mine"  # a directory jaxzero did not write: refused, left as it was
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert cli.main(["export", str(run), "--out", str(mine), "--format", "peft"]) != 0
    assert (mine / "notes.txt").read_text() == "keep" and len(list(mine.iterdir())) == 1


def test_peft_export_of_a_full_fine_tune_is_one_line(tmp_path, capsys):
    from jaxzero.train.export import ExportError, export_peft

    meta = {"param_tree": [], "leaves": {}}
    with pytest.raises(ExportError, match="--format peft needs a LoRA run"):
        export_peft(tmp_path, meta, tmp_path / "out", "fp32")


@pytest.mark.unit
def test_peft_export_of_a_qwen3_5_run_numbers_layers_by_its_checkpoint(tmp_path, monkeypatch):
    """A Qwen3.5 LoRA run (8 layers: attention on 3 and 7) with adapters on the attention
    stack only, whose base directory is gone: --format peft names them by the model's
    layers 3 and 7, which the checkpoint's own param tree says (the stacks' sizes), never
    by their stack index (0, 1: the linear-attention layers, silently, before); a tree
    whose stacks fit no arrangement is refused in one line."""
    import dataclasses

    from jaxzero.partition import path_str
    from jaxzero.train import merged
    from jaxzero.train.export import ExportError, export_peft

    src = HF / "qwen3_5" / "single"
    cfg = hf.model(src).config
    cfg = dataclasses.replace(cfg, num_hidden_layers=8, layer_types=cfg.layer_types * 2)
    lora = LoraConfig(rank=2, alpha=4, targets=("q_proj", "v_proj"))
    shapes = jax.eval_shape(Llama(cfg, lora=lora).init, jax.random.key(0))
    tree = [(path_str(p), tuple(x.shape)) for p, x in jax.tree_util.tree_leaves_with_path(shapes)]
    meta = {
        "param_tree": [
            {"path": [["k", k] for k in n.split("/")], "shape": list(s), "trainable": t}
            for n, s in tree
            for t in [n.rsplit("/", 1)[-1] in ("lora_A", "lora_B")]
        ],
        "leaves": {},
    }
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in tree if "lora_" in n}
    assert sorted(tensors) == [
        f"layers/self_attn/{m}/lora_{ab}" for m in ("q_proj", "v_proj") for ab in "AB"
    ]
    assert tensors["layers/self_attn/q_proj/lora_A"].shape[0] == 2  # the attention stack
    record = {"path": str(tmp_path / "gone"), "rank": 2, "alpha": 4.0}
    record |= {"targets": ["q_proj", "v_proj"], "use_rslora": False}
    monkeypatch.setattr(merged, "lora_of", lambda _: record)
    monkeypatch.setattr(merged, "adapters", lambda *_: tensors)
    assert merged.stack_layers(meta) == {
        "layers": (3, 7),
        "linear_layers": (0, 1, 2, 4, 5, 6),
    }
    out = export_peft(tmp_path / "step", meta, tmp_path / "peft", "fp32")
    keys = set(SafetensorsFile(out / peft.WEIGHTS).names())
    assert keys == {
        f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
        for i in (3, 7)
        for m in ("q_proj", "v_proj")
        for ab in "AB"
    }
    back = peft.read_adapter(out, cfg)
    for k, x in tensors.items():
        np.testing.assert_array_equal(back.tensors[k], x)
    odd = [e for e in meta["param_tree"] if e["path"][0][1] == "linear_layers"]
    for e in odd:
        e["shape"][0] = 5  # 2 + 5 layers: no group of interval layers
    with pytest.raises(ExportError, match="does not say which model layer") as ex:
        export_peft(tmp_path / "step", meta, tmp_path / "peft2", "fp32")
    assert "\n" not in str(ex.value)
    with pytest.raises(HFError, match="need layers="):
        peft.write_adapter(tmp_path / "x", lora, {"linear_layers/a/lora_A": np.zeros((1, 2))}, None)


@pytest.fixture(scope="module")
def wide_base(tmp_path_factory) -> Path:
    """A bf16 Hugging Face directory whose projections take multiples of 64 inputs (a
    quantization block), written by jaxzero.hf.save from a random Llama."""
    from jaxzero.models.llama import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, seq_len=16,
    )  # fmt: skip
    m = Llama(cfg)
    engine = m.engine(optax.sgd(0.1), mesh=make_mesh(1))
    out = tmp_path_factory.mktemp("qbase") / "base"
    hf.save(out, m, engine, engine.init_from(m.init, jax.random.key(0)), dtype="bfloat16")
    return out


@pytest.fixture(scope="module")
def wide_qwen3_5(tmp_path_factory) -> Path:
    """A bf16 Qwen3.5 directory (Gated DeltaNet and gated full attention) whose
    projections take multiples of 64 inputs, written by jaxzero.hf.save."""
    import dataclasses

    from jaxzero.models.llama import LlamaConfig
    from tests._models import QWEN3_5_FIELDS

    cfg = dataclasses.replace(
        LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, seq_len=16),
        **QWEN3_5_FIELDS | dict(head_dim=16, linear_value_head_dim=16, num_hidden_layers=2,
                                layer_types=("linear_attention", "full_attention")),
    )  # fmt: skip  # one group of each kind: half the compile of two
    m = Llama(cfg)
    engine = m.engine(optax.sgd(0.1), mesh=make_mesh(1))
    out = tmp_path_factory.mktemp("qbase") / "qwen3_5"
    hf.save(out, m, engine, engine.init_from(m.init, jax.random.key(0)), dtype="bfloat16")
    return out


def _qlora(base: Path, kind: str | None, stage: int, devices: int, micro: int):
    m = hf.model(base, lora=LoraConfig(rank=4, alpha=8, base_dtype=kind), seq_len=16)
    engine = m.engine(optax.adamw(1e-3), mesh=make_mesh(devices), stage=stage, micro_batches=micro)
    state = hf.load(base, engine, m, seed=1)
    frozen = jax.tree.map(np.asarray, jax.device_get(state.frozen))
    losses = []
    for _ in range(3):
        state, metrics = engine.step(state, _batch())
        losses.append(float(metrics["loss"]))
    return engine, state, frozen, np.array(losses)


@functools.cache
def _qlora_bf16(base: Path) -> np.ndarray:
    """The bf16 base's LoRA losses on one device (both kinds compare with them)."""
    return _qlora(base, None, 0, 1, 1)[3]


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_qlora_trains_like_one_device_and_stores_the_formula(kind, wide_base):
    """A quantized base trains at stages 0 and 3 on 8 devices as on one device (the same
    quantized base), stays bit-identical, and stores bytes_per_param bytes a weight."""
    from jaxzero.models import quant

    e1, s1, q1, ref = _qlora(wide_base, kind, 0, 1, 1)
    bf16 = _qlora_bf16(wide_base)
    assert abs(ref[0] - bf16[0]) / bf16[0] < (2e-3 if kind == "int8" else 2e-2)
    for stage in (0, 3):
        engine, state, before, losses = _qlora(wide_base, kind, stage, 8, 2)
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(q1), strict=True):
            np.testing.assert_array_equal(a, b)  # the same quantized base on 8 devices
        after = jax.tree.leaves(jax.device_get(state.frozen))
        for a, b in zip(after, jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(a, b)
        codes = [x for p, x in jax.tree_util.tree_leaves_with_path(state.frozen)
                 if jax.tree_util.keystr(p).endswith("'weight_codes']")]  # fmt: skip
        scales = [x for p, x in jax.tree_util.tree_leaves_with_path(state.frozen)
                  if jax.tree_util.keystr(p).endswith("'weight_scale']")]  # fmt: skip
        weights = sum(x.size for x in scales) * quant.BLOCK  # the quantized weights' count
        held = sum(x.nbytes for x in codes + scales)
        assert abs(held / (weights * quant.bytes_per_param(kind)) - 1) < 0.01
        per_device = sum(x.addressable_shards[0].data.nbytes for x in codes + scales)
        assert abs(per_device * (8 if stage == 3 else 1) / held - 1) < 0.01


def test_qlora_on_qwen3_5_quantizes_every_projection_and_trains_like_one_device(wide_qwen3_5):
    """QLoRA on Qwen3.5: the Gated DeltaNet's and the gated attention's projections are
    quantized (nf4) beside the MLP's, the rest of the base (conv, decay, norms) kept as
    stored; stage 3 on 8 devices trains as one device does."""
    _, _, q1, ref = _qlora(wide_qwen3_5, "nf4", 0, 1, 1)
    _, state, before, losses = _qlora(wide_qwen3_5, "nf4", 3, 8, 1)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(q1), strict=True):
        np.testing.assert_array_equal(a[tuple(map(slice, b.shape))], b)  # padded to 8 rows
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(before)}
    for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj",
                 "o_proj", "down_proj"):  # fmt: skip
        assert any(proj in n and n.endswith("'weight_codes']") for n in names), proj
    assert any("conv1d" in n for n in names) and any("A_log" in n for n in names)
    assert not any("conv1d" in n and "codes" in n for n in names)


@pytest.mark.system  # the command line end to end
def test_a_run_starts_from_a_peft_adapter(tmp_path):
    """--set lora.adapter=DIR: peft's adapter (rank, alpha, targets and tensors) is what
    step 1 computes with: its loss is the adapted model's on the loader's first batch."""
    from jaxzero.data.tokenizer import Tokenizer
    from jaxzero.train import data as data_lib

    rng = np.random.default_rng(1)
    words = lambda n: " ".join(f"t{i}" for i in rng.integers(3, 64, n))
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": words(4), "completion": " " + words(5)} for _ in range(80)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    adapter_dir = PEFT / "llama_gqa_r4"
    start = ("--init-from", f"hf:{BASE}", "--data", str(data))
    extra = ("--set", f"lora.adapter={adapter_dir}", "--steps", "1", "--name", "ad")
    assert _lora_run(tmp_path / "runs", BASE, data, *start, *extra) == 0
    first = json.loads((tmp_path / "runs" / "ad" / "metrics.jsonl").read_text().splitlines()[0])
    tok = Tokenizer.load(BASE)
    corpus = data_lib.load_corpus(data_lib.DataConfig(path=str(data), tokenizer=str(BASE)))
    loader = data_lib.Loader(corpus.train, 16, 8, 0, mask=corpus.train_mask, eos=tok.eos_id)
    adapter = peft.read_adapter(adapter_dir)
    m = hf.model(BASE, lora=adapter.config, seq_len=16)
    engine = m.engine(optax.sgd(0.0), mesh=make_mesh(1))
    params = engine.gather_params(hf.load(BASE, engine, m, adapter=adapter))
    out = m.loss_fn(params, loader.batch(0))
    np.testing.assert_allclose(first["loss"], float(out.total / out.weight), rtol=1e-5)
    plain = hf.model(BASE, seq_len=16)
    base_out = plain.loss_fn(hf.read_params(BASE, plain), loader.batch(0))
    assert abs(first["loss"] - float(base_out.total / base_out.weight)) > 1e-2


def test_adapter_dropout_is_a_mask_per_row_on_any_device_count():
    """lora.dropout: the engine passes the loss its key (a mask per global row), so 8
    devices with 2 micro-batches train as one device; the masks change training."""

    def run(devices: int, micro: int, rate: float) -> np.ndarray:
        m = hf.model(BASE, lora=LoraConfig(rank=4, alpha=8, dropout=rate), seq_len=16)
        engine = m.engine(optax.adamw(1e-3), mesh=make_mesh(devices), stage=3, micro_batches=micro)
        state = hf.load(BASE, engine, m, seed=1)
        losses = []
        for _ in range(2):  # step 1 has B = 0: the masks show from step 2
            state, metrics = engine.step(state, _batch())
            losses.append(float(metrics["loss"]))
        return np.array(losses)

    one = run(1, 1, 0.3)
    np.testing.assert_allclose(run(8, 2, 0.3), one, rtol=1e-5)
    assert np.max(np.abs(one - run(1, 1, 0.0))) > 1e-4
    with pytest.raises(ValueError, match=r"lora.dropout must be in \[0, 1\)"):
        LoraConfig(dropout=1.0)


@pytest.mark.unit
def test_qwen3_5_adapters_map_each_layer_to_its_stack(tmp_path):
    """LoRA on every projection of Qwen3.5's two layer kinds (peft's names: the DeltaNet's
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj too): written as PEFT keys of
    the model's own layer indices (the linear-attention layers 0-2, attention layer 3),
    read back into the two stacks by the base's config."""
    src = HF / "qwen3_5" / "single"
    base = hf.model(src)
    model = hf.model(src, lora=LoraConfig(rank=2, alpha=4))
    params = jax.eval_shape(model.init, jax.random.key(0))
    rng = np.random.default_rng(0)
    tensors = {
        k: rng.standard_normal(v.shape).astype(np.float32)
        for k, v in peft.adapters_of(jax.tree.map(lambda s: np.zeros(s.shape), params)).items()
    }
    assert "linear_layers/linear_attn/in_proj_a/lora_A" in tensors
    assert tensors["layers/self_attn/q_proj/lora_B"].shape == (1, 2 * 4 * 16, 2)
    peft.write_adapter(tmp_path, model.lora, tensors, str(src), layers=base.config)
    keys = set(SafetensorsFile(tmp_path / peft.WEIGHTS).names())
    for i in range(3):
        assert f"base_model.model.model.layers.{i}.linear_attn.in_proj_qkv.lora_A.weight" in keys
        assert f"base_model.model.model.layers.{i}.mlp.up_proj.lora_B.weight" in keys
    assert "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" in keys
    assert not any("layers.3.linear_attn" in k or "layers.0.self_attn" in k for k in keys)
    config = json.loads((tmp_path / peft.CONFIG).read_text())
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"} <= set(
        config["target_modules"]
    )
    back = peft.read_adapter(tmp_path, base.config)
    assert set(back.tensors) == set(tensors)
    for k, x in tensors.items():
        np.testing.assert_array_equal(back.tensors[k], x)
