"""The Llama (NNX) at every stage against one device; its config, FLOPs and the CLI around
it: train with model.arch=llama, export --format hf, sample from a Hugging Face directory,
estimate and compile configs/llama-1b.yaml without allocating it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxzero
from jaxzero import cli, hf
from jaxzero.data.tokenizer import Tokenizer
from jaxzero.models import from_fields
from jaxzero.models.llama import Llama, LlamaConfig, rope_frequencies
from jaxzero.train import config as C
from jaxzero.train import export as ex
from jaxzero.train import sample as sm
from tests._models import (
    QWEN3_5_FIELDS,
    params_of,
    rel_diff,
    train_engine,
    train_reference,
)

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# hidden 36 and kv 2 x 6: leaves that do not divide by 8 carry padding; q/k/v biases as Qwen2
TINY = LlamaConfig(
    vocab_size=64,
    hidden_size=36,
    intermediate_size=52,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    qkv_bias=True,
    seq_len=8,
)


def _batches(n: int, cfg: LlamaConfig = TINY, rows: int = 16) -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        t = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_len + 1)).astype(np.int32)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


@pytest.mark.parametrize("stage,micro", [(0, 1), (1, 2), (2, 1), (3, 2)])
def test_llama_trains_like_one_device(stage, micro):
    model = Llama(dataclasses.replace(TINY, remat="full" if stage == 3 else "none"))
    params = params_of(Llama, TINY)
    tx, data = optax.adamw(1e-2), _batches(3)
    ref_losses, ref_params = train_reference(model.loss_fn, params, data, tx)
    engine = model.engine(tx, mesh=jaxzero.make_mesh(8), stage=stage, micro_batches=micro)
    losses, final, _ = train_engine(engine, params, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_diff(final, ref_params) < 1e-4


# Gemma's options (2 and 3 at once), and a SmolLM3 no-rope layer
GEMMA = dict(
    norm_offset=True,
    sandwich_norms=True,
    embed_scale=True,
    hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=4.0,
    attn_logit_softcapping=1.0,
    final_logit_softcapping=2.0,
    rope_local_base_freq=100.0,
)


@pytest.mark.parametrize(
    "options", [{}, {**GEMMA, "no_rope_layers": (0, 1)}], ids=["qwen3", "gemma_nope"]
)
def test_windows_and_qk_norms_train_like_one_device(options):
    """Qwen3's q/k norms and a sliding window of 3 (< seq_len 8) on one layer of two, at
    stage 3 with 2 micro-batches and remat on 8 devices: one device's losses and params;
    with Gemma's norms, scales and soft-caps and a layer without rope too."""
    cfg = dataclasses.replace(
        TINY,
        qk_norm=True,
        sliding_window=3,
        layer_types=("sliding_attention", "full_attention"),
        remat="full",
        **options,
    )
    model = Llama(cfg)
    # 2x the init's weights: attention less uniform, so the window moves the loss (by 0.03;
    # 0.01 with Gemma's capped scores)
    params = jax.tree.map(lambda x: 2 * x, params_of(Llama, cfg))
    tx, data = optax.adamw(1e-2), _batches(3)
    ref_losses, ref_params = train_reference(model.loss_fn, params, data, tx)
    engine = model.engine(tx, mesh=jaxzero.make_mesh(8), stage=3, micro_batches=2)
    losses, final, _ = train_engine(engine, params, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_diff(final, ref_params) < 1e-4
    full = Llama(dataclasses.replace(cfg, sliding_window=None, layer_types=None))
    assert abs(full.loss_fn(params, data[0]) - ref_losses[0]) > 5e-3  # the window counts


# Qwen3.5's options: 2 groups of (linear attention, full attention), 2 key heads for 4
# value heads, half of head_dim 8 rotated, the attention output gated, (1 + w) norms
QWEN3_5 = dataclasses.replace(TINY, **QWEN3_5_FIELDS)


def _packed(batches: list[dict]) -> list[dict]:
    """The batches as packed rows: two documents a row, split at a row's own place."""
    out = []
    for i, b in enumerate(batches):
        rows, s = b["inputs"].shape
        cut = 2 + (np.arange(rows)[:, None] + i) % (s - 3)
        out.append({**b, "segment_ids": (np.arange(s)[None, :] >= cut).astype(np.int32)})
    return out


def test_qwen3_5_trains_like_one_device():
    """Linear-attention layers scanned in groups with the attention layers, at stage 3
    with 2 micro-batches and remat on 8 devices (each kind's layers gathered where they
    run) over packed documents: one device's losses and params over 10 steps. The documents matter
    (the DeltaNet state and conv restart at each)."""
    cfg = dataclasses.replace(QWEN3_5, remat="full")
    model = Llama(cfg)
    params = params_of(Llama, cfg)
    assert set(params) >= {"layers", "linear_layers"}
    assert params["linear_layers"]["linear_attn"]["conv1d"]["weight"].shape == (
        2,
        2 * 12 + 20,
        1,
        3,
    )
    assert params["layers"]["self_attn"]["q_proj"]["weight"].shape == (2, 2 * 6 * 8, 36)
    # SGD, not Adam: the decay projection (in_proj_a) has gradients of 1e-7 to 1e-9 at
    # this init, around Adam's eps, where Adam turns fp32 summation order into update
    # noise (one device with 2 micro-batches lands 1.8e-4 from one without); SGD's
    # update is the gradient, equal to 1e-5 whatever the order (at a rate of 0.1: at 1.0
    # this tiny model's loss climbs after 7 steps and the two runs' last bits part)
    tx, data = optax.sgd(0.1), _packed(_batches(10))
    ref_losses, ref_params = train_reference(model.loss_fn, params, data, tx)
    engine = model.engine(tx, mesh=jaxzero.make_mesh(8), stage=3, micro_batches=2)
    losses, final, _ = train_engine(engine, params, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_diff(final, ref_params) < 1e-4
    assert rel_diff(ref_params, params) > 1e-3  # the 10 steps moved the params
    unpacked = {k: v for k, v in data[0].items() if k != "segment_ids"}
    assert abs(model.loss_fn(params, unpacked) - ref_losses[0]) > 1e-3


@pytest.mark.unit
def test_qwen3_5_fields_are_checked():
    """Linear-attention layers only in Qwen3.5's arrangement, named in one line when not."""
    with pytest.raises(ValueError, match=r"layer_types \['full_attention', 'linear_attention'"):
        dataclasses.replace(QWEN3_5, layer_types=("full_attention", "linear_attention") * 2)
    with pytest.raises(ValueError, match="the layers a multiple of the interval"):
        dataclasses.replace(
            QWEN3_5,
            num_hidden_layers=5,
            layer_types=("linear_attention", "full_attention") * 2 + ("linear_attention",),
        )
    with pytest.raises(ValueError, match="not a multiple of linear_num_key_heads 3"):
        dataclasses.replace(QWEN3_5, linear_num_key_heads=3)
    with pytest.raises(ValueError, match="linear_attention layers do not go with no_rope_layers"):
        dataclasses.replace(QWEN3_5, no_rope_layers=(1, 0, 1, 1))
    with pytest.raises(ValueError, match=r"the rotary part of head_dim 8 \(1\) must be even"):
        dataclasses.replace(QWEN3_5, partial_rotary_factor=0.125)
    assert (QWEN3_5.interval, QWEN3_5.attention_layers, QWEN3_5.rotary_dim) == (2, (1, 3), 4)
    assert QWEN3_5.linear_attention_layers == (0, 2) and TINY.interval == 0


@pytest.mark.unit
def test_qwen3_5_params_and_flops_are_counted():
    """Each DeltaNet layer's params as transformers has them (projections, conv taps,
    dt_bias, A_log, the gated norm), the gated q_proj twice as wide; FLOPs per token: 6 x
    the matmul params, attention's 12·L·S·H·K over the 2 attention layers, and the chunked
    delta rule's 3·H·(C·(6K + 4V) + 2C²/3 + 6·K·V) over the 2 linear ones (C = seq_len 8 <
    64: ``deltanet.rule_flops_per_token``, written out here)."""
    model = Llama(QWEN3_5)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    d, f, h, g, kd, vd = 36, 52, 4, 2, 6, 5
    conv = 2 * g * kd + h * vd
    mixer = d * conv + d * h * vd + 2 * d * h + conv * 3 + 2 * h + vd + h * vd * d
    common = 3 * d * f + 2 * d
    assert model.num_params(shapes["linear_layers"]) == 2 * (mixer + common)
    attention = d * 2 * 6 * 8 + 2 * d * 2 * 8 + 6 * 8 * d + 2 * 8
    assert model.num_params(shapes["layers"]) == 2 * (attention + common)
    n = model.num_params(shapes)
    lookup = QWEN3_5.vocab_size * d
    rule = h * (8 * (6 * kd + 4 * vd) + 2 * 8 * 8 / 3 + 6 * kd * vd)
    want = 6 * (n - lookup) + 12 * 2 * 8 * 6 * 8 + 3 * 2 * rule
    assert model.flops_per_token() == pytest.approx(want, rel=1e-12)


@pytest.mark.unit
def test_window_fields_are_checked():
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        LlamaConfig(sliding_window=0)
    with pytest.raises(ValueError, match="layer_types has 1 entries for 4 layers"):
        LlamaConfig(sliding_window=8, layer_types=("full_attention",))
    with pytest.raises(ValueError, match="layer type 'chunked_attention' is not supported"):
        LlamaConfig(sliding_window=8, layer_types=("chunked_attention",) * 4)
    with pytest.raises(ValueError, match="sliding_attention layers but no sliding_window"):
        LlamaConfig(layer_types=("sliding_attention",) * 4)
    listed = LlamaConfig(
        sliding_window=8, layer_types=["full_attention"] * 3 + ["sliding_attention"]
    )
    assert listed.layer_types == ("full_attention",) * 3 + ("sliding_attention",)
    assert hash(listed) and listed.windows == (2**31 - 1,) * 3 + (8,)
    assert LlamaConfig(sliding_window=8, layer_types=("full_attention",) * 4).windows is None


@pytest.mark.unit
def test_gemma_and_smollm3_fields_are_checked_and_counted():
    """The new fields refused in one line; the sandwich norms (2 x layers x hidden) and
    q/k norms counted in the params and the training FLOPs per token."""
    with pytest.raises(ValueError, match="attention=cudnn cannot soft-cap attention scores"):
        LlamaConfig(attn_logit_softcapping=50.0, attention="cudnn")
    with pytest.raises(ValueError, match="no_rope_layers must be 4 flags of 0 or 1"):
        LlamaConfig(no_rope_layers=(1, 0))
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        LlamaConfig(hidden_act="relu")
    with pytest.raises(ValueError, match="final_logit_softcapping must be a positive number"):
        LlamaConfig(final_logit_softcapping=0.0)
    capped = LlamaConfig(attn_logit_softcapping=50.0)
    assert capped.attention_implementation(jnp.bfloat16, "gpu") == "xla"
    assert LlamaConfig().attention_implementation(jnp.bfloat16, "gpu") == "cudnn"
    base = Llama(TINY)
    gemma = Llama(dataclasses.replace(TINY, **GEMMA))
    count = lambda m: m.num_params(jax.eval_shape(m.init, jax.random.key(0)))
    d, layers = TINY.hidden_size, TINY.num_hidden_layers
    assert count(gemma) == count(base) + 2 * layers * d  # pre/post feed-forward norms
    lookup = TINY.vocab_size * d
    attention = 12 * layers * TINY.seq_len * 6 * 6
    assert gemma.flops_per_token() == 6 * (count(gemma) - lookup) + attention
    params = params_of(Llama, dataclasses.replace(TINY, **GEMMA))
    assert not params["layers"]["post_feedforward_layernorm"]["weight"].any()  # 1 + 0: unit


@pytest.mark.unit
def test_config_is_checked_and_flops_count_gqa():
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads 4"):
        LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="seq_len 4096 exceeds max_position_embeddings 2048"):
        LlamaConfig(seq_len=4096)
    model = Llama(TINY)
    n = model.num_params(jax.eval_shape(model.init, jax.random.key(0)))
    lookup = TINY.vocab_size * TINY.hidden_size  # untied: the input embedding is a lookup
    attention = 12 * TINY.num_hidden_layers * TINY.seq_len * 6 * 6  # query heads x head dim
    assert model.flops_per_token() == 6 * (n - lookup) + attention
    frozen = n - 100  # LoRA: the base (the lookup table among it) has no weight gradient
    assert model.flops_per_token(n, frozen) == 6 * (n - lookup) - 2 * (frozen - lookup) + attention
    linear = rope_frequencies(
        dataclasses.replace(TINY, rope_scaling={"rope_type": "linear", "factor": 4.0})
    )
    np.testing.assert_allclose(linear * 4, rope_frequencies(TINY), rtol=1e-6)


@pytest.mark.unit
def test_train_config_builds_either_model():
    gpt = from_fields(dataclasses.asdict(C.ModelConfig(vocab_size=32)))
    llama = from_fields(
        dataclasses.asdict(C.ModelConfig(arch="llama", vocab_size=32, n_kv_heads=2))
    )
    assert type(gpt).__name__ == "GPT" and isinstance(llama, Llama)
    assert (llama.config.kv_heads, llama.config.intermediate_size) == (2, 352)
    with pytest.raises(C.ConfigError, match="model.n_kv_heads applies to model.arch=llama"):
        C.validate(C.Config(model=C.ModelConfig(n_kv_heads=2)))
    with pytest.raises(C.ConfigError, match="n_heads=4 is not a multiple of model.n_kv_heads=3"):
        C.validate(C.Config(model=C.ModelConfig(arch="llama", n_kv_heads=3)))


@pytest.mark.every_lane
@pytest.mark.system
def test_llama_1b_config_estimates_and_compiles_abstractly(capsys):
    """Llama 3.2 1B's shapes: counted exactly by jaxzero estimate, and its stage-3 step
    compiled from abstract_state on 8 devices, nothing allocated."""
    path = ROOT / "configs" / "llama-1b.yaml"
    assert cli.main(["estimate", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Ψ = 1.236e+09 parameters, N = 8 devices" in out
    cfg = C.resolve(str(path), [])
    model = from_fields(dataclasses.asdict(cfg.model))
    engine = model.engine(
        optax.adamw(1e-4),
        mesh=jaxzero.make_mesh(8),
        stage=3,
        precision="bf16",
        micro_batches=cfg.parallel.micro_batches,
    )
    state = engine.abstract_state(jax.eval_shape(model.init, jax.random.key(0)))
    assert engine.num_params == 1_235_814_400  # Llama-3.2-1B's count, tied embeddings
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len), jnp.int32)
    compiled = engine.compile(state, {"inputs": tokens, "targets": tokens})
    # stage 3 in bf16: 2 + 4 + 8 bytes a param (params, master, Adam) over 8 devices
    held = compiled.memory_analysis().argument_size_in_bytes
    assert abs(held - 14 * engine.num_params / 8) < 0.01 * held


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_run")
    rc = cli.main(
        [
            "train",
            "--set",
            "model.arch=llama",
            "--set",
            "model.n_kv_heads=2",
            "--set",
            "model.d_model=32",
            "--set",
            "model.n_layers=2",
            "--set",
            "model.seq_len=16",
            "--set",
            "train.steps=3",
            "--set",
            "train.batch_size=8",
            "--set",
            "logging.eval_every=3",
            "--set",
            "logging.sample_tokens=0",
            "--set",
            "checkpoint.every=3",
            "--set",
            "data.max_bytes=20000",
            "--devices",
            "2",
            "--set",
            f"logging.root={root}",
            "--name",
            "llama",
        ]
    )
    assert rc == 0
    return root / "llama"


@pytest.mark.system
def test_export_hf_of_a_llama_run_equals_its_params(llama_run, tmp_path, capsys):
    assert cli.main(["export", str(llama_run), "--out", str(tmp_path / "plain")]) == 0
    assert (
        cli.main(
            [
                "export",
                str(llama_run),
                "--out",
                str(tmp_path / "hf"),
                "--format",
                "hf",
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    assert "Hugging Face format" in capsys.readouterr().out
    plain = hf.safetensors.read_all(tmp_path / "plain" / ex.WEIGHTS)
    model = hf.model(tmp_path / "hf", seq_len=16)
    assert model.config.kv_heads == 2 and model.config.tie_word_embeddings
    got = hf.read_params(tmp_path / "hf", model)
    for name, x in jax.tree_util.tree_leaves_with_path(got):
        key = "/".join(k.key for k in name)
        np.testing.assert_array_equal(x, plain[key])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.system
def test_export_hf_of_a_gpt_run_is_refused(tmp_path, capsys):
    run = tmp_path / "gpt"
    run.mkdir()
    (run / "config.yaml").write_text(C.dump_yaml(C.Config(model=C.ModelConfig(vocab_size=64))))
    model = from_fields(
        {"vocab_size": 64, "seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}
    )
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=0)
    with jaxzero.CheckpointManager(run / "checkpoints") as ckpt:
        ckpt.save(engine, engine.init_from(model.init, jax.random.key(0)))
    rc = cli.main(["export", str(run), "--out", str(tmp_path / "x"), "--format", "hf"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "--format hf needs a model.arch=llama run" in err


@pytest.mark.system
def test_sample_stops_at_the_models_eos_unless_told_to_go_on(tmp_path, capsys):
    """`jaxzero sample` ends after an end-of-text token (kept): the tokenizer's, or one
    that config.json or generation_config.json names (a list, as Llama 3 ships);
    ``--ignore-eos`` samples every token asked for."""
    path = tmp_path / "model"
    shutil.copytree(FIXTURES / "llama_gqa" / "single", path)
    full, full_text = sm.sample(path, "t5 t9", 16, seed=1, ignore_eos=True)
    assert len(full) == 16
    i = next(i for i in range(2, 16) if full[i] not in full[:i])
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(
        json.dumps({**gen, "eos_token_id": [int(full[i])]})
    )
    stop = {
        Tokenizer.load(path).eos_id,
        json.loads((path / "config.json").read_text())["eos_token_id"],
    }
    j = next(k for k, t in enumerate(full) if t in stop | {full[i]})
    new, text = sm.sample(path, "t5 t9", 16, seed=1)
    np.testing.assert_array_equal(new, full[: j + 1])

    argv = ["sample", str(path), "--prompt", "t5 t9", "--tokens", "16", "--seed", "1"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == text + "\n"
    assert f"stopped at the end-of-text token {full[j]} after {j + 1} of 16 tokens" in err, err
    assert cli.main([*argv, "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out == full_text + "\n" and err == ""


@pytest.mark.system
def test_sample_from_a_hugging_face_directory(capsys):
    """Without a tokenizer beside the weights: token ids in and out; with one, text."""
    path = FIXTURES / "llama_gqa" / "sharded"
    argv = ["sample", str(path), "--prompt", "5 9 17", "--tokens", "6", "--seed", "1"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out.split()
    assert first[:3] == ["5", "9", "17"] and len(first) == 9
    assert all(0 <= int(t) < 64 for t in first)
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.split() == first  # deterministic given the seed
    assert cli.main(["sample", str(path), "--prompt", "hello"]) == 2
    assert "token ids" in capsys.readouterr().err
    with_tokenizer = FIXTURES / "llama_gqa" / "single"
    assert cli.main(["sample", str(with_tokenizer), "--prompt", "t5 t9", "--tokens", "4"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["t5", "t9"] and len(words) >= 3  # decoded by its tokenizer.json
