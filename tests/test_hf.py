"""jaxzero.hf against transformers itself (fixtures made by experiments/hf_fixtures.py), the
round trip through save and load across stages and meshes, host memory, and bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import _procs
import jax
import numpy as np
import optax
import pytest

import jaxzero
from jaxzero import hf
from jaxzero.hf import safetensors
from jaxzero.models import GPT, GPTConfig, Llama
from jaxzero.models.common import FULL
from jaxzero.models.llama_hf import HFError, llama_config
from tests._models import rel_diff, train_reference

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
DIRS = [
    "llama_gqa/single",
    "llama_gqa/sharded",
    "qwen2_tied/single",
    "qwen2_tied/sharded",
    "llama3_rope/single",
    "mistral/single",
    "qwen3/single",
    "mistral_window/single",
    "qwen3_window/single",
    "smollm3/single",
    "gemma2/single",
    "gemma3/single",
    "qwen3_5/single",
]
WINDOWED = ["mistral_window/single", "qwen3_window/single"]  # sliding window 8 < 24 tokens
# SmolLM3 (a no-rope layer, windowed), Gemma 2 (soft-caps), Gemma 3 (a rope base a layer type)
NEW = ["smollm3/single", "gemma2/single", "gemma3/single"]
MIB = 2**20


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.mean(logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]))


# --------------------------------------------------------------------------- vs transformers


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", DIRS)
def test_logits_match_transformers(name, stage):
    """Loaded at stage 0 or 3 on 8 devices: the params give transformers' logits (1e-4),
    and the engine's sharded forward (per-layer gathers at stage 3) its loss."""
    path = FIXTURES / name
    ref = np.load(path / "reference.npz")
    model = hf.model(path, seq_len=23)
    engine = model.engine(optax.sgd(0.0), mesh=jaxzero.make_mesh(8), stage=stage)
    state = hf.load(path, engine)
    logits = np.asarray(model.apply(engine.gather_params(state), ref["tokens"]))
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)

    tokens = np.concatenate([ref["tokens"]] * 4)  # 8 rows: one a device
    loss = float(engine.eval_loss(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}))
    want = cross_entropy(ref["logits"][:, :-1], ref["tokens"][:, 1:])
    assert abs(loss - want) < 1e-5 * max(1.0, abs(want)), (loss, want)


def test_qwen3_5_training_gradients_match_torch_autograd():
    """One training step's gradients: jax.grad of the model's loss (the mean next-token
    cross-entropy of the reference tokens, fp32) against transformers' loss and its torch
    autograd gradients (grads.npz, experiments/hf_fixtures.py), every param mapped back
    to its checkpoint name(s) by hf_names: the DeltaNet's A_log, dt_bias, conv1d, gated
    norm and in/out projections, the full layer's gated q_proj and q/k norms, the
    embeddings and the head, within 1e-4."""
    from jaxzero.models.llama_hf import hf_names, is_stacked
    from jaxzero.partition import path_str

    path = FIXTURES / "qwen3_5/single"
    ref, want = np.load(path / "reference.npz"), dict(np.load(path / "grads.npz"))
    tokens = ref["tokens"]
    model = hf.model(path, seq_len=23)
    params = jax.tree.map(np.asarray, hf.read_params(path, model))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}  # transformers' shift
    loss, grads = jax.jit(jax.value_and_grad(model.loss_fn))(params, batch)  # one compile
    np.testing.assert_allclose(float(loss), want.pop("loss").item(), rtol=1e-6)
    got = {}
    for p, g in jax.tree_util.tree_leaves_with_path(grads):
        name = path_str(p)
        names = hf_names(name, model.config)
        parts = list(np.asarray(g)) if is_stacked(name) else [np.asarray(g)]
        got.update(zip(names, parts, strict=True))
    assert sorted(got) == sorted(want)  # every parameter, none twice
    worst = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    print(f"max |jax - torch| over every gradient: {worst:.3g}")
    assert worst < 1e-4, worst
    assert min(float(np.abs(want[n]).max()) for n in want) > 1e-6  # each one moves


@pytest.mark.unit
def test_config_fields_read_as_transformers_means_them():
    qwen = hf.model(FIXTURES / "qwen2_tied/single").config
    assert (qwen.qkv_bias, qwen.o_bias, qwen.tie_word_embeddings) == (True, False, True)
    assert hf.model(FIXTURES / "qwen2_tied/sharded").config.tie_word_embeddings is False, (
        "a shipped lm_head of other values unties, as in transformers"
    )
    rope = hf.model(FIXTURES / "llama3_rope/single").config
    assert rope.rope_scaling["rope_type"] == "llama3" and rope.rope_theta == 500000.0
    assert (rope.head_size, rope.kv_heads, rope.qkv_bias, rope.o_bias) == (16, 1, True, True)
    # transformers 4's spelling: rope_theta at the top, the scaling under rope_scaling
    raw = json.loads((FIXTURES / "llama3_rope/single/config.json").read_text())
    params = raw.pop("rope_parameters")
    legacy = {
        **raw,
        "rope_theta": params.pop("rope_theta"),
        "rope_scaling": {"type": params.pop("rope_type"), **params},
    }
    assert llama_config(legacy) == rope


@pytest.mark.unit
def test_qwen3_and_sliding_windows_read_as_transformers_means_them():
    """q/k norms (Qwen3), biases by attention_bias; Mistral's window on every layer;
    Qwen2/Qwen3's by layer_types, or max_window_layers before transformers 5 wrote
    layer_types, and none unless use_sliding_window."""
    qwen3 = hf.model(FIXTURES / "qwen3/single").config
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias, qwen3.head_size) == (
        True,
        False,
        False,
        16,
    )
    assert qwen3.windows is None and qwen3.kv_heads == 2
    mistral = hf.model(FIXTURES / "mistral_window/single").config
    assert (mistral.sliding_window, mistral.layer_types, mistral.windows) == (8, None, (8, 8))
    assert not mistral.qk_norm
    window = hf.model(FIXTURES / "qwen3_window/single").config
    assert window.windows == (8, FULL, 8) and (window.qkv_bias, window.o_bias) == (True, True)
    assert window.tie_word_embeddings and window.qk_norm

    raw = json.loads((FIXTURES / "qwen3_window/single/config.json").read_text())
    older = {k: v for k, v in raw.items() if k != "layer_types"}
    assert llama_config({**older, "max_window_layers": 1}).windows == (FULL, 8, 8)
    assert llama_config({**older, "max_window_layers": 3}).windows is None
    assert llama_config({**older, "use_sliding_window": False}).windows is None  # ignored then
    qwen2 = {**raw, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    assert llama_config(qwen2).windows == (8, FULL, 8) and not llama_config(qwen2).qk_norm
    assert llama_config({**raw, "layer_types": ["sliding_attention"] * 3}).layer_types is None
    # no architectures: the model_type's
    assert llama_config({k: v for k, v in raw.items() if k != "architectures"}) == window


@pytest.mark.unit
def test_smollm3_and_gemma_configs_read_as_transformers_means_them():
    """SmolLM3's no_rope_layers (or one in no_rope_layer_interval) and its windows on
    the no-rope layers; Gemma 2's alternation and Gemma 3's one full layer in six when
    layer_types is absent; Gemma 3's rope bases keyed by layer type or, before
    transformers 5, rope_theta/rope_scaling and rope_local_base_freq."""
    read = lambda name: json.loads((FIXTURES / name / "single/config.json").read_text())
    smol = read("smollm3")
    cfg = llama_config(smol)
    assert cfg.no_rope_layers == (1, 0, 1) and cfg.windows == (FULL, 8, FULL)
    assert cfg.ropes == ("global", "none", "global") and cfg.hidden_act == "silu"
    no_types = {k: v for k, v in smol.items() if k != "layer_types"}
    assert llama_config(no_types) == cfg  # the window on the no-rope layer, as transformers
    assert llama_config({**no_types, "use_sliding_window": False}).windows is None
    # with layer_types, transformers' masks window those layers whatever use_sliding_window
    assert llama_config({**smol, "use_sliding_window": False}).windows == cfg.windows
    every4 = {**no_types, "num_hidden_layers": 8, "no_rope_layers": None}
    assert llama_config(every4).no_rope_layers == (1, 1, 1, 0, 1, 1, 1, 0)
    assert llama_config({**smol, "no_rope_layers": [1, 1, 1, 0]}).no_rope_layers is None

    gemma2 = llama_config(read("gemma2"))
    assert gemma2.windows == (8, FULL, 8) and gemma2.sandwich_norms and gemma2.embed_scale
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (1.0, 2.0)
    assert (gemma2.hidden_act, gemma2.query_pre_attn_scalar) == ("gelu_pytorch_tanh", 24.0)
    raw3 = read("gemma3")
    gemma3 = llama_config(raw3)
    assert gemma3.ropes == ("local", "local", "global") and gemma3.qk_norm
    assert (gemma3.rope_theta, gemma3.rope_local_base_freq) == (1e6, 1e4)
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping is None
    rope = raw3["rope_parameters"]["full_attention"]
    legacy = {
        **{k: v for k, v in raw3.items() if k != "rope_parameters"},
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "rope_local_base_freq": 1e4,
    }
    assert llama_config(legacy) == gemma3
    twelve = {**legacy, "num_hidden_layers": 12, "layer_types": None}
    assert [i for i, w in enumerate(llama_config(twelve).windows) if w == FULL] == [5, 11]
    alternate = {**read("gemma2"), "num_hidden_layers": 4, "layer_types": None}
    assert llama_config(alternate).windows == (8, FULL, 8, FULL)
    with pytest.raises(HFError, match="use_bidirectional_attention=true is not supported"):
        llama_config({**raw3, "use_bidirectional_attention": True})
    with pytest.raises(HFError, match="no_rope_layers must list a 0 or 1 for each of the 3"):
        llama_config({**smol, "no_rope_layers": [1, 0]})
    with pytest.raises(HFError, match="activation 'gelu' is not supported"):
        llama_config({**read("gemma2"), "hidden_activation": "gelu"})


@pytest.mark.unit
def test_qwen3_5_config_reads_as_transformers_means_it():
    """Qwen3.5: its layer_types (or one full layer in every full_attention_interval),
    linear-attention shapes, partial rope in rope_parameters (mrope's keys changing
    nothing for text), the gated attention output and (1 + w) norms; an arrangement the
    decoder does not scan is refused in one line naming it."""
    raw = json.loads((FIXTURES / "qwen3_5/single/config.json").read_text())
    cfg = llama_config(raw)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.interval, cfg.attention_layers, cfg.linear_attention_layers) == (4, (3,), (0, 1, 2))
    assert (cfg.partial_rotary_factor, cfg.rotary_dim, cfg.head_size) == (0.25, 4, 16)
    assert cfg.attn_output_gate and cfg.norm_offset and cfg.qk_norm and not cfg.sandwich_norms
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert cfg.windows is None and not cfg.embed_scale
    every = {k: v for k, v in raw.items() if k != "layer_types"}
    assert llama_config({**every, "num_hidden_layers": 8}).attention_layers == (3, 7)
    interval2 = {**every, "full_attention_interval": 2}
    assert llama_config(interval2).layer_types == ("linear_attention", "full_attention") * 2
    mrope = {**raw["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    assert llama_config({**raw, "rope_parameters": mrope}) == cfg
    with pytest.raises(HFError, match=r"layer_types \['full_attention', 'linear_attention', ") as e:
        llama_config({**raw, "layer_types": ["full_attention"] + ["linear_attention"] * 3})
    _one_line(e)
    with pytest.raises(HFError, match="layer 1 is 'sliding_attention', which is not supported"):
        llama_config({**raw, "layer_types": ["linear_attention", "sliding_attention"] * 2})


# --------------------------------------------------------------------------- round trip


def _batches(vocab: int, n: int, rows: int = 8, seq: int = 12) -> list[dict]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        t = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def test_finetune_round_trip_is_bit_exact_and_matches_one_device(tmp_path):
    """load -> 5 steps at stage 3 on 8 -> save fp32 -> load at stage 1 on 4: the same bits;
    the fine-tune itself trains like one device."""
    src = FIXTURES / "llama_gqa/sharded"
    model = hf.model(src, seq_len=12)
    tx = optax.adamw(1e-2)
    data = _batches(model.config.vocab_size, 5)
    engine = model.engine(tx, mesh=jaxzero.make_mesh(8), stage=3)
    state = hf.load(src, engine)
    losses = []
    for b in data:
        state, metrics = engine.step(state, b)
        losses.append(float(metrics["loss"]))
    ref_losses, ref_params = train_reference(model.loss_fn, hf.read_params(src), data, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    trained = engine.gather_params(state)
    assert rel_diff(trained, ref_params) < 1e-4

    out = hf.save(tmp_path / "ft", model, engine, state, dtype="float32", max_shard_size=30_000)
    again = hf.model(out)
    engine1 = again.engine(tx, mesh=jaxzero.make_mesh(4), stage=1)
    reloaded = engine1.gather_params(hf.load(out, engine1))
    for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)


def test_saved_directory_is_what_transformers_reads(tmp_path):
    """Shards under max_shard_size with an index, pt metadata, bf16, the source's config
    and tokenizer files (transformers loading it is checked by experiments/hf_fixtures.py
    check, which needs torch)."""
    src = FIXTURES / "llama_gqa/single"
    model = hf.model(src)
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(2), stage=2)
    state = hf.load(src, engine)
    out = hf.save(tmp_path / "out", model, engine, state, max_shard_size=16_000)
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n)]
    assert len(shards) >= 2 and "model.safetensors.index.json" in names
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(names)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source = hf.Weights(src)
    assert set(index["weight_map"]) == set(source.where)
    for shard in shards:
        f = safetensors.SafetensorsFile(out / shard)
        assert f.metadata == {"format": "pt"}
        assert {f.dtype(n).name for n in f.names()} == {"bfloat16"}
        assert len(f.names()) == 1 or (out / shard).stat().st_size <= 16_000 + 4096
        for n in f.names():  # bf16 on disk -> fp32 master -> bf16: the same bits
            np.testing.assert_array_equal(f.tensor(n), source.tensor(n))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("name", [*WINDOWED, "smollm3/single", "gemma2/single"])
def test_a_window_shorter_than_the_sequence_changes_the_logits(name):
    """The same weights without the window are far from transformers' logits (the
    window is not ignored), with it within 1e-4; q/k norms at unit gains are far too."""
    path = FIXTURES / name
    ref = np.load(path / "reference.npz")
    model = hf.model(path, seq_len=24)
    params = hf.read_params(path, model)
    full = Llama(dataclasses.replace(model.config, sliding_window=None, layer_types=None))
    early = ref["logits"][:, :8]  # within the window: the same
    np.testing.assert_allclose(full.apply(params, ref["tokens"])[:, :8], early, atol=1e-4)
    assert np.abs(full.apply(params, ref["tokens"]) - ref["logits"]).max() > 0.5
    np.testing.assert_allclose(model.apply(params, ref["tokens"]), ref["logits"], atol=1e-4)
    if model.config.qk_norm:
        attn = params["layers"]["self_attn"]
        unit = {**attn, "q_norm": {"weight": np.ones_like(attn["q_norm"]["weight"])}}
        moved = model.apply(
            {**params, "layers": {**params["layers"], "self_attn": unit}}, ref["tokens"]
        )
        assert np.abs(moved - ref["logits"]).max() > 0.5


def _moved(model: Llama, params, tokens, **change) -> float:
    """max |logits| of the same weights in the model with ``change``d options, less ``model``'s."""
    other = Llama(dataclasses.replace(model.config, **change))
    return float(np.abs(other.apply(params, tokens) - model.apply(params, tokens)).max())


def test_soft_caps_no_rope_layers_and_local_rope_change_the_logits():
    """Each new option moves transformers' logits when left out: Gemma 2's soft-caps
    (attention scores and final logits), SmolLM3's no-rope layer, Gemma 3's rope base of
    its sliding layers and its (1 + w) q/k norms."""
    tokens = np.load(FIXTURES / "gemma2/single/reference.npz")["tokens"]
    for name, changes in (
        ("gemma2", [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}]),
        ("smollm3", [{"no_rope_layers": None}]),
        ("gemma3", [{"rope_local_base_freq": None}, {"norm_offset": False}]),
    ):
        model = hf.model(FIXTURES / name / "single", seq_len=24)
        params = hf.read_params(FIXTURES / name / "single", model)
        for change in changes:
            assert _moved(model, params, tokens, **change) > 0.3, (name, change)
    gemma2 = hf.model(FIXTURES / "gemma2/single").config
    gemma3 = hf.model(FIXTURES / "gemma3/single").config
    assert gemma2.attention_implementation(backend="gpu") == "xla"  # no fused kernel caps
    assert gemma3.attention_implementation(backend="gpu") == "cudnn"
    with pytest.raises(HFError, match="attention=cudnn cannot soft-cap attention scores") as e:
        hf.model(FIXTURES / "gemma2/single", attention="cudnn")
    _one_line(e)


@pytest.mark.parametrize("name", ["qwen3_window", "gemma3"])
def test_cudnn_runs_each_layers_window_as_its_kernel_constant(monkeypatch, name):
    """cuDNN takes a window as a compile-time constant: with layers of two windows each
    runs its own (lax.switch). Run here by JAX's XLA attention given the same static
    ``local_window_size`` (and Gemma 3's scale) cuDNN gets (CPU has no cuDNN):
    transformers' logits."""
    path = FIXTURES / name / "single"
    ref = np.load(path / "reference.npz")
    model = hf.model(path, seq_len=24, attention="cudnn")
    real, seen = jax.nn.dot_product_attention, []

    def as_cudnn_would(*args, implementation=None, local_window_size=None, **kwargs):
        assert implementation == "cudnn" and kwargs.get("mask") is None
        seen.append(local_window_size)
        return real(*args, implementation="xla", local_window_size=local_window_size, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", as_cudnn_would)
    logits = jax.jit(model.apply)(hf.read_params(path, model), ref["tokens"])
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)
    assert sorted(seen, key=str) == [(7, 0), None]  # one branch a window, traced once


@pytest.mark.parametrize("name", [*WINDOWED, *NEW, "qwen3_5/single"])
def test_cached_decoding_respects_the_window(name):
    """A prefill of 8 reference tokens, then one at a time up to 24 (past the window of
    8): every position's logits are transformers', as the full forward's are (Qwen3.5:
    the DeltaNet layers' states and conv windows carried from token to token)."""
    path = FIXTURES / name
    ref = np.load(path / "reference.npz")
    model = hf.model(path, seq_len=24)
    params = hf.read_params(path, model)
    decode = jax.jit(model.decode)
    tokens = ref["tokens"][1:]
    logits, cache = decode(params, tokens[:, :8], 0, model.new_cache(params), 7)
    got = [logits[0]]
    for i in range(8, 24):
        logits, cache = decode(params, tokens[:, i : i + 1], i, cache, 0)
        got.append(logits[0])
    np.testing.assert_allclose(np.stack(got), ref["logits"][1, 7:], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "name,tensor",
    [
        ("qwen3_window", "model.layers.2.self_attn.k_norm.weight"),
        ("smollm3", "model.layers.1.mlp.down_proj.weight"),
        ("gemma2", "model.layers.2.post_feedforward_layernorm.weight"),
        ("gemma3", "model.layers.2.self_attn.q_norm.weight"),
        ("qwen3_5", "model.layers.1.linear_attn.A_log"),
    ],
)
def test_qwen3_with_windows_saves_as_transformers_reads_it(tmp_path, name, tensor):
    """Loaded at stage 3, saved: the source's config (layer_types, use_sliding_window,
    sliding_window, attention_bias, no_rope_layers, soft-caps, rope_parameters) and
    every tensor name transformers has (q_norm, k_norm, the sandwich norms), the bits
    unchanged (saved in the source's dtype); read back, the same model."""
    src = FIXTURES / name / "single"
    model = hf.model(src, seq_len=24)
    source = json.loads((src / "config.json").read_text())
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(8), stage=3)
    state = hf.load(src, engine, model)
    out = hf.save(tmp_path / "out", model, engine, state, dtype=source["dtype"])
    config = json.loads((out / "config.json").read_text())
    assert config == {**source, "torch_dtype": source["dtype"]}
    if name == "qwen3_window":
        assert config["attention_bias"] is True and config["tie_word_embeddings"] is True
    saved, want = hf.Weights(out), hf.Weights(src)
    assert set(saved.where) == set(want.where)
    assert tensor in saved.where
    for t in want.where:
        np.testing.assert_array_equal(saved.tensor(t), want.tensor(t))
    assert hf.model(out, seq_len=24).config == model.config


def test_a_model_built_here_with_qk_norms_or_windows_saves_as_qwen3_or_mistral(tmp_path):
    """No source config.json: q/k norms write Qwen3 (with its layer_types), a window on
    every layer without biases Mistral, no-rope layers SmolLM3, Gemma's norms Gemma 2
    (Gemma 3 with q/k norms, its rope per layer type), linear-attention layers Qwen3.5;
    read back, the same config.
    What no architecture holds is refused in one line."""
    from jaxzero.models.llama import LlamaConfig

    base = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # as hf.model reads it back
        head_dim=8,
        seq_len=8,
    )
    qwen3 = dataclasses.replace(
        base, qk_norm=True, sliding_window=4, layer_types=("full_attention", "sliding_attention")
    )
    mistral = dataclasses.replace(base, sliding_window=4)
    smollm3 = dataclasses.replace(qwen3, qk_norm=False, no_rope_layers=(1, 0))
    gemma = dict(norm_offset=True, sandwich_norms=True, embed_scale=True, query_pre_attn_scalar=8.0)
    gemma2 = dataclasses.replace(
        qwen3, qk_norm=False, **gemma, hidden_act="gelu_pytorch_tanh", attn_logit_softcapping=5.0
    )
    linear = {"rope_type": "linear", "factor": 2.0}
    gemma3 = dataclasses.replace(qwen3, **gemma, rope_local_base_freq=100.0, rope_scaling=linear)
    qwen3_5 = dataclasses.replace(
        base,
        qk_norm=True,
        norm_offset=True,
        attn_output_gate=True,
        partial_rotary_factor=0.5,
        layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        linear_conv_kernel_dim=2,
    )
    engine = lambda m: m.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=0)
    for cfg, arch in (
        (qwen3, "Qwen3ForCausalLM"),
        (mistral, "MistralForCausalLM"),
        (smollm3, "SmolLM3ForCausalLM"),
        (gemma2, "Gemma2ForCausalLM"),
        (gemma3, "Gemma3ForCausalLM"),
        (qwen3_5, "Qwen3_5ForCausalLM"),
    ):
        model = Llama(cfg)
        e = engine(model)
        params = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
        out = hf.save(tmp_path / arch, model, e, e.init(params), dtype="float32")
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == [arch]
        assert hf.model(out, seq_len=8).config == cfg
        assert rel_diff(hf.read_params(out), params) == 0.0
    assert json.loads((tmp_path / "Qwen3ForCausalLM" / "config.json").read_text())[
        "layer_types"
    ] == ["full_attention", "sliding_attention"]
    mixed = Llama(dataclasses.replace(mistral, layer_types=qwen3.layer_types))
    e = engine(mixed)
    state = e.init(jax.tree.map(np.asarray, mixed.init(jax.random.key(0))))
    with pytest.raises(HFError, match="no supported architecture has sliding windows") as ex:
        hf.save(tmp_path / "mixed", mixed, e, state)
    _one_line(ex)
    gemma3_json = json.loads((tmp_path / "Gemma3ForCausalLM" / "config.json").read_text())
    assert gemma3_json["rope_parameters"] == {
        "full_attention": {**linear, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    for bad, match in (
        (dataclasses.replace(gemma2, embed_scale=False), "this model lacks embed_scale"),
        (dataclasses.replace(gemma3, attn_logit_softcapping=5.0), "does not apply attn_logit"),
        (dataclasses.replace(base, hidden_act="gelu_pytorch_tanh"), "without Gemma's norms"),
        (dataclasses.replace(qwen3_5, norm_offset=False), "this model lacks norm_offset"),
        (dataclasses.replace(base, partial_rotary_factor=0.5), "partial_rotary_factor != 1"),
    ):
        with pytest.raises(HFError, match=match) as ex:
            hf.hf_config(bad, "float32")
        _one_line(ex)


@pytest.mark.system  # the CLI end to end: our own Python over either JAX line (one lane)
@pytest.mark.parametrize(
    "name", ["qwen3_window", *(n.split("/")[0] for n in NEW), "qwen3_5", "qwen3_5-lora"]
)
def test_a_qwen3_window_fine_tune_starts_from_the_windowed_checkpoint(tmp_path, name):
    """jaxzero train --init-from hf:DIR (seq_len 16 > its window of 8; Qwen3, SmolLM3,
    Gemma 2 and 3; Qwen3.5's linear-attention layers, fully and with LoRA on every
    projection of both layer kinds), 2 steps on 2 devices: the first step's loss is the
    checkpoint's model's on the first (packed) batch."""
    from jaxzero import cli
    from jaxzero.train import data as data_lib

    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"t{i}" for i in rng.integers(3, 64, n))
    rows = [{"text": words(int(rng.integers(12, 40)))} for _ in range(80)]
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lora = name.endswith("-lora")  # fresh adapters (B = 0): the base's loss at step 1
    name = name.removesuffix("-lora")
    src, tok = FIXTURES / name / "single", FIXTURES / "llama_gqa/single"
    argv = ["train", "--init-from", f"hf:{src}", "--data", str(data), "--tokenizer", str(tok)]
    for item in (
        *(["lora.rank=2"] if lora else []),
        "model.seq_len=16",
        "train.steps=2",
        "train.batch_size=8",
        "logging.eval_batches=1",
        "logging.log_every=1",
        "logging.sample_tokens=0",
        f"logging.root={tmp_path}",
    ):
        argv += ["--set", item]
    assert cli.main([*argv, "--name", "qw3", "--devices", "2"]) == 0
    first = json.loads((tmp_path / "qw3" / "metrics.jsonl").read_text().splitlines()[0])
    corpus = data_lib.load_corpus(data_lib.DataConfig(path=str(data), tokenizer=str(tok)))
    c = corpus
    batch = data_lib.Loader(
        c.train, 16, 8, 0, slice(None), c.train_mask, c.eos, c.train_docs
    ).batch(0)
    model = hf.model(src, seq_len=16)
    if name == "qwen3_5":
        assert model.config.interval == 4 and "segment_ids" in batch  # packed documents
    else:
        assert model.config.windows is not None and 8 in model.config.windows
    loss = model.loss_fn(jax.tree.map(np.asarray, hf.read_params(src, model)), batch)
    loss = float(loss if np.ndim(loss) == 0 else loss.total / loss.weight)
    np.testing.assert_allclose(first["loss"], loss, rtol=1e-5)
    if lora:
        _qwen3_5_lora_exports(tmp_path / "qw3", src, model, batch["inputs"][:2])


def _qwen3_5_lora_exports(run: Path, src: Path, model: Llama, tokens: np.ndarray) -> None:
    """A Qwen3.5 LoRA run exported: --format peft names each adapter by its model layer
    (linear_attn on layers 0-2, self_attn on 3), read back by the base's config; --format
    hf merges them into the base (fp32: bf16 would round away updates of the adapters'
    size), the logits of base + adapter."""
    from jaxzero import cli
    from jaxzero.hf import peft

    for fmt in ("peft", "hf"):
        argv = ["export", str(run), "--out", str(run / fmt), "--format", fmt, "--dtype", "fp32"]
        assert cli.main(argv) == 0
    keys = set(safetensors.SafetensorsFile(run / "peft" / peft.WEIGHTS).names())
    assert "base_model.model.model.layers.2.linear_attn.in_proj_z.lora_B.weight" in keys
    assert "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" in keys
    adapter = peft.read_adapter(run / "peft", model.config)
    m = hf.model(src, lora=adapter.config, seq_len=16)
    engine = m.engine(optax.sgd(0.0), mesh=jaxzero.make_mesh(1))
    params = engine.gather_params(hf.load(src, engine, m, adapter=adapter))
    with_adapter = np.asarray(m.apply(params, tokens))
    merged = hf.model(run / "hf", seq_len=16)
    out = np.asarray(merged.apply(hf.read_params(run / "hf", merged), tokens))
    np.testing.assert_allclose(out, with_adapter, atol=1e-4, rtol=0)
    plain = np.asarray(model.apply(hf.read_params(src, model), tokens))
    assert np.abs(with_adapter - plain).max() > 1e-2  # the adapters trained


def test_a_model_built_here_saves_as_its_architecture(tmp_path):
    """No source directory: config.json is written from LlamaConfig (both rope spellings)."""
    from jaxzero.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        qkv_bias=True,
        seq_len=8,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    model = Llama(cfg)
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=0)
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
    out = hf.save(tmp_path / "m", model, engine, engine.init(params), dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]  # q/k/v biases, none on o_proj
    back = hf.model(out, seq_len=8).config
    assert back == dataclasses.replace(cfg, head_dim=8)  # written out, as transformers 5 does
    assert rel_diff(hf.read_params(out), params) == 0.0


@pytest.mark.every_lane
@pytest.mark.system
def test_two_processes_read_their_own_slices_and_save_together(tmp_path):
    """2 processes x 2 devices at stage 3: each reads about half of every sharded param
    (its devices' slices), the fine-tune trains like one device, hf.save writes once."""
    from _procs import REPORT, free_port, read_report

    src, out, port = FIXTURES / "llama_gqa/sharded", tmp_path / "out", free_port()
    env = _procs.child_env()
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(
            [
                str(Path(__file__).parent),
                str(Path(__file__).parent.parent),
                env.get("PYTHONPATH", ""),
            ]
        ),
    )
    worker = Path(__file__).parent / "_mp_hf_worker.py"
    reports = [tmp_path / f"report{i}.json" for i in range(2)]
    procs = [
        _procs.Child(
            [sys.executable, str(worker), str(i), str(port), str(src), str(out)],
            env={**env, REPORT: str(reports[i])},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    runs = [read_report(r) for r in reports]
    assert runs[0]["sharded"], "stage 3 on 4 devices shards the larger params"
    for path, size in runs[0]["sharded"].items():
        for run in runs:
            assert run["read"][path] <= size / 2 + size / 8, (path, run["read"][path], size)
    model = hf.model(src, seq_len=12)
    rng = np.random.default_rng(3)
    data = []
    for _ in range(3):
        t = rng.integers(0, model.config.vocab_size, (8, 13)).astype(np.int32)
        data.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    ref_losses, ref_params = train_reference(
        model.loss_fn, hf.read_params(src), data, optax.adamw(1e-2)
    )
    np.testing.assert_allclose(runs[0]["losses"], ref_losses, rtol=1e-5)
    assert rel_diff(hf.read_params(out), ref_params) < 1e-4


def test_load_reads_each_slice_once_and_never_the_padding():
    """A hybrid mesh (2 replicas x 4): each distinct slice is read once, inside the
    logical shape, and the state equals the checkpoint."""
    src = FIXTURES / "qwen2_tied/single"
    model = hf.model(src)
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(8, replicas=2), stage=3)
    shapes, read = hf._reader(src, model)
    calls: list = []

    def logged(lay, index):
        assert all(0 <= s.start <= s.stop <= n for s, n in zip(index, lay.shape, strict=True))
        calls.append((lay.path, tuple((s.start, s.stop) for s in index)))
        return read(lay, index)

    state = engine._init_from_slices(shapes, logged)
    assert len(calls) == len(set(calls))
    assert rel_diff(engine.gather_params(state), hf.read_params(src)) == 0.0


# --------------------------------------------------------------------------- memory

MEASURE = textwrap.dedent("""
    import json, os, re, sys
    from pathlib import Path
    import jax, numpy as np, optax, jaxzero
    from jaxzero import hf

    def status(key):
        return int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text())[1]) * 1024

    path, how = Path(sys.argv[1]), sys.argv[2]
    model = hf.model(path, seq_len=8)
    # plain SGD keeps no optimizer state (whose untouched zero pages RSS would not count)
    engine = model.engine(optax.sgd(1e-3), mesh=jaxzero.make_mesh(8), stage=3)
    engine.abstract_state(jax.eval_shape(model.init, jax.random.key(0)))  # compile-free
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    if how == "load":
        state = hf.load(path, engine)
        held = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)
    else:  # the naive way: the whole checkpoint in host memory at once
        params, held = hf.read_params(path, model), 0
    print(json.dumps({"delta": status("VmHWM") - before, "state": held}))
""")


def _load_peak(path: Path, how: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = _procs.run(
        [sys.executable, "-c", MEASURE, str(path), how],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.system
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_load_holds_about_one_param_on_the_host(tmp_path):
    """On CPU the devices' memory is the host's, so the state itself is subtracted: what
    hf.load holds beyond it stays under 2 x the largest param + 32 MiB; reading the
    whole checkpoint first (the control) does not."""
    from jaxzero.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        seq_len=8,
    )
    model = Llama(cfg)
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(8), stage=3)
    state = engine.init_from(model.init, jax.random.key(0))
    hf.save(tmp_path / "big", model, engine, state, dtype="float32")
    largest = max(
        x.size * 4 for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0)))
    )
    total = 4 * engine.num_params
    del state
    bound = 2 * largest + 32 * MIB
    assert total > 1.3 * bound, "the model must be far larger than what the load may hold"
    load, naive = _load_peak(tmp_path / "big", "load"), _load_peak(tmp_path / "big", "naive")
    extra, control = load["delta"] - load["state"], naive["delta"] - naive["state"]
    print(
        f"hf.load: +{extra / MIB:.1f} MiB beyond the state ({load['state'] / MIB:.0f} MiB); "
        f"naive: +{control / MIB:.1f} MiB; largest param {largest / MIB:.1f} MiB, "
        f"model {total / MIB:.0f} MiB"
    )
    assert extra < bound, f"hf.load held {extra / MIB:.1f} MiB beyond the state"
    assert control > bound, f"the control held only {control / MIB:.1f} MiB: no signal"


# --------------------------------------------------------------------------- bad input


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name.replace("/", "_")
    while dst.exists():
        dst = dst.with_name(dst.name + "_")
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.mark.unit
def test_bad_directories_are_refused_in_one_line(tmp_path):
    engine = lambda m: m.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(2), stage=3)
    with pytest.raises(HFError, match="not a directory"):
        hf.model(tmp_path / "absent")
    with pytest.raises(HFError, match="no config.json") as e:
        hf.model(tmp_path)
    _one_line(e)

    bare = _copy("llama_gqa/single", tmp_path)
    (bare / "model.safetensors").unlink()
    with pytest.raises(HFError, match="neither model.safetensors nor") as e:
        hf.load(bare, engine(hf.model(bare)))
    _one_line(e)

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    supported = (
        "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, "
        "SmolLM3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Qwen3_5ForCausalLM"
    )
    with pytest.raises(HFError, match=f"GPT2LMHeadModel is not supported.*{supported}") as e:
        hf.model(gpt2)
    _one_line(e)

    qwen3 = json.loads((FIXTURES / "qwen3_window/single/config.json").read_text())
    for arch in (
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "GptOssForCausalLM",
        "Gemma3ForConditionalGeneration",  # multimodal
        "Qwen2_5_VLForConditionalGeneration",  # multimodal
        "Qwen3_5ForConditionalGeneration",  # Qwen3.5 with its vision tower
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
    ):
        with pytest.raises(HFError, match=f"^architecture {arch} is not supported: .*{supported}$"):
            llama_config({**qwen3, "architectures": [arch]})
    with pytest.raises(HFError, match="architecture of model_type 'gemma3' is not supported"):
        llama_config(
            {**{k: v for k, v in qwen3.items() if k != "architectures"}, "model_type": "gemma3"}
        )
    chunked = ["sliding_attention", "chunked_attention", "full_attention"]
    with pytest.raises(HFError, match="layer 1 is 'chunked_attention', which is not supported"):
        llama_config({**qwen3, "layer_types": chunked})
    with pytest.raises(HFError, match="sliding_attention layers but no sliding_window"):
        llama_config({**qwen3, "sliding_window": None})
    with pytest.raises(HFError, match="layer_types must list one type for each of the 3 layers"):
        llama_config({**qwen3, "layer_types": ["full_attention"]})

    yarn = _copy("llama_gqa/single", tmp_path)
    cfg = json.loads((yarn / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    (yarn / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFError, match="rope type 'yarn' is not supported"):
        hf.model(yarn)


def _rewrite(path: Path, change) -> None:
    """Rewrites a safetensors file with ``change(dict of tensors)`` applied."""
    tensors = change(safetensors.read_all(path))
    entries = [(k, v.dtype, v.shape) for k, v in tensors.items()]
    safetensors.write(path, entries, iter(tensors.values()), {"format": "pt"})


def test_bad_tensors_are_named(tmp_path):
    engine = lambda m: m.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(2), stage=3)
    missing = _copy("llama_gqa/single", tmp_path)
    _rewrite(
        missing / "model.safetensors",
        lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"},
    )
    with pytest.raises(HFError, match="tensor model.layers.1.mlp.up_proj.weight is missing"):
        hf.load(missing, engine(hf.model(missing)))

    shape = _copy("llama_gqa/sharded", tmp_path)
    index = json.loads((shape / "model.safetensors.index.json").read_text())
    file = shape / index["weight_map"]["model.layers.0.self_attn.k_proj.weight"]
    _rewrite(
        file,
        lambda t: {
            k: (v[:8] if k.endswith("0.self_attn.k_proj.weight") else v) for k, v in t.items()
        },
    )
    with pytest.raises(
        HFError,
        match=r"model.layers.0.self_attn.k_proj.weight has shape "
        r"\[8, 32\]; the config needs \[16, 32\]",
    ):
        hf.load(shape, engine(hf.model(shape)))

    cut = _copy("llama_gqa/single", tmp_path)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(safetensors.SafetensorsError, match="is truncated") as e:
        hf.load(cut, engine(hf.model(cut)))
    _one_line(e)

    nan = _copy("llama_gqa/single", tmp_path)
    _rewrite(
        nan / "model.safetensors",
        lambda t: {k: v * np.inf if k == "model.norm.weight" else v for k, v in t.items()},
    )
    for read in (lambda: hf.read_params(nan), lambda: hf.load(nan, engine(hf.model(nan)))):
        with pytest.raises(HFError, match="tensor model.norm.weight holds inf") as e:
            read()  # as sample and train read it; not a non-finite loss at step 1
        _one_line(e)


def test_save_never_replaces_the_models_source_and_replaces_its_own_output(tmp_path):
    """hf.save(..., overwrite=True) into the directory the model was read from deleted the
    model being trained; an earlier output of hf.save (its manifest) is replaced without
    overwrite=True, one with a file added by hand is not."""
    src = _copy("llama_gqa/single", tmp_path)
    model = hf.model(src)
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=0)
    state = hf.load(src, engine)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for out in (src, src.parent):
        with pytest.raises(HFError, match="the model's source directory .* never replaces it"):
            hf.save(out, model, engine, state, overwrite=True)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    hf.save(tmp_path / "out", model, engine, state)
    hf.save(tmp_path / "out", model, engine, state)  # its own earlier output
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(HFError, match=r"\(notes.txt\)"):
        hf.save(tmp_path / "out", model, engine, state)


def test_save_refuses_a_non_empty_directory(tmp_path):
    src = FIXTURES / "llama_gqa/single"
    model = hf.model(src)
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=0)
    state = hf.load(src, engine)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(HFError, match=r"holds files jaxzero did not write \(notes.txt\)") as e:
        hf.save(tmp_path, model, engine, state)
    _one_line(e)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    hf.save(tmp_path, model, engine, state, overwrite=True)
    assert not (tmp_path / "notes.txt").exists() and (tmp_path / "model.safetensors").is_file()
    gpt = GPT(GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(HFError, match="hf.save writes a Llama .* not a GPT"):
        hf.save(tmp_path / "x", gpt, engine, state)
    other = Llama(dataclasses.replace(model.config, num_hidden_layers=1))
    with pytest.raises(HFError, match="the engine's params are not this model's"):
        hf.save(tmp_path / "x", other, engine, state)
