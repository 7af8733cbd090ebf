"""Tiny random Hugging Face checkpoints and PyTorch reference logits, as test fixtures.

CI has no torch, so jaxzero's Llama-family implementation is checked against logits that
`transformers` computed once, here, and committed under tests/fixtures/hf/:

    <name>/single/    save_pretrained(dir): config.json, model.safetensors, reference.npz
    <name>/sharded/   save_pretrained(dir, max_shard_size=...): 2-4 model-0000k-of-0000n
                      shards + model.safetensors.index.json, reference.npz

Models (vocab 64, hidden 32, intermediate 48, 2 layers): llama_gqa (bf16, GQA 4/2),
qwen2_tied (fp16, q/k/v biases, tied embeddings; its sharded copy also ships a stray
lm_head.weight), llama3_rope (fp32, llama3 rope scaling, head_dim 16 != hidden/heads,
attention biases; single only), mistral (bf16, single only), qwen3 (bf16, q/k norms,
GQA 4/2, head_dim 16, single only), mistral_window (fp32, a sliding window of 8 tokens on
every layer, single only) and qwen3_window (bf16, 3 layers of types sliding/full/sliding
with a window of 8, head_dim 8, GQA 4/1, biases on q/k/v/o, tied embeddings, single
only), smollm3 (bf16, 3 layers, layer 1 without rope and windowed), gemma2 (fp32, 3
layers sliding/full/sliding, soft-caps low enough to bind) and gemma3 (bf16, 3 layers
sliding/sliding/full, q/k norms, a rope base a layer type, the full layers' linearly
scaled), qwen3_5 (bf16, Qwen3.5 text: 4 layers, 3 Gated DeltaNet and 1 full attention,
2 key heads for 4 value heads, a quarter of head_dim 16 rotated, gated attention output;
the decay and write strength each checked to move the logits). Every weight is
redrawn at a scale that makes attention non-uniform (biases and norm gains included;
q/k norm gains wider), so rope, biases and norms all move the logits, and a window
shorter than the 24 reference tokens moves them too; each soft-cap is checked to move
them (without it, the same weights).
reference.npz holds `tokens` (int32, 2x24) and `logits` (float32, 2x24xV) from the
directory loaded back in float32, eager attention.

Needs torch, transformers and safetensors (not jaxzero). Regenerate (all, or only the
models named: the others' files are left as they are), or check that transformers
loads a directory that jaxzero saved to the same logits:

    /path/to/venv-with-torch/bin/python -m experiments.hf_fixtures [--out tests/fixtures/hf] \\
        [--only NAME ...]
    /path/to/venv-with-torch/bin/python -m experiments.hf_fixtures check SAVED_DIR \\
        REFERENCE_NPZ [--atol 1e-4]

qwen3_5/single/ also holds grads.npz: transformers' loss on the reference tokens (the
mean next-token cross-entropy, fp32, eager) and its gradient by torch autograd, every
parameter under its checkpoint name (float32). Generating the model writes it; `grads`
writes it alone from the committed weights:

    /path/to/venv-with-torch/bin/python -m experiments.hf_fixtures grads [--only qwen3_5]
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import shutil
import sys
import zipfile

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

OUT = pathlib.Path(__file__).parent.parent / "tests" / "fixtures" / "hf"
VOCAB = 64
TOKENS_SHAPE = (2, 24)
WEIGHT_STD = 0.2  # ~1/sqrt(hidden): attention scores of order 1, so rope matters
NORM_STD = 0.1  # norm gains 1 + N(0, NORM_STD^2)
QK_NORM_STD = 0.5  # Qwen3's q/k norm gains: wide, so applying them after rope would show
WINDOW = 8  # the window fixtures' sliding window: a third of the reference tokens
ATTN_CAP, FINAL_CAP = 1.0, 2.0  # gemma2's soft-caps: below its largest scores and logits
# vocab 64 (not 96), intermediate 48 (not 64) and no llama3_rope/sharded: under 400 KB in all
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def llama_gqa() -> PreTrainedModel:
    config = LlamaConfig(
        **SIZES,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return LlamaForCausalLM(config)


def qwen2_tied() -> PreTrainedModel:
    config = Qwen2Config(
        **SIZES,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return Qwen2ForCausalLM(config)


def llama3_rope() -> PreTrainedModel:
    config = LlamaConfig(
        **SIZES,
        head_dim=16,
        num_key_value_heads=1,
        attention_bias=True,
        mlp_bias=False,
        tie_word_embeddings=False,
        rope_parameters=dict(LLAMA3_ROPE),
    )
    return LlamaForCausalLM(config)


def mistral() -> PreTrainedModel:
    config = MistralConfig(
        **SIZES,
        num_key_value_heads=2,
        sliding_window=None,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return MistralForCausalLM(config)


def qwen3() -> PreTrainedModel:
    config = Qwen3Config(
        **SIZES,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=False,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return Qwen3ForCausalLM(config)


def mistral_window() -> PreTrainedModel:
    config = MistralConfig(
        **SIZES,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return MistralForCausalLM(config)


def qwen3_window() -> PreTrainedModel:
    config = Qwen3Config(
        **{**SIZES, "num_hidden_layers": 3},
        num_key_value_heads=1,
        head_dim=8,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Qwen3ForCausalLM(config)


def smollm3() -> PreTrainedModel:
    """Layer 1 without rope; use_sliding_window puts the window on that no-rope layer
    (transformers' default layer_types, written out in config.json)."""
    config = SmolLM3Config(
        **{**SIZES, "num_hidden_layers": 3},
        num_key_value_heads=2,
        no_rope_layers=[1, 0, 1],
        use_sliding_window=True,
        sliding_window=WINDOW,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=None,  # SmolLM3's are past the tiny vocabulary
        bos_token_id=1,
        eos_token_id=2,
    )
    return SmolLM3ForCausalLM(config)


def gemma2() -> PreTrainedModel:
    """Sliding/full/sliding (transformers' default alternation), head_dim 16 (4 heads x
    16 != hidden 32), query_pre_attn_scalar 24 (not head_dim), caps low enough to bind."""
    config = Gemma2Config(
        **{**SIZES, "num_hidden_layers": 3},
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Gemma2ForCausalLM(config)


def gemma3() -> PreTrainedModel:
    """Sliding/sliding/full, the full layer's rope linearly scaled on a base of its own."""
    config = Gemma3TextConfig(
        **{**SIZES, "num_hidden_layers": 3},
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    return Gemma3ForCausalLM(config)


def qwen3_5() -> PreTrainedModel:
    """Qwen3.5 text: 3 Gated DeltaNet layers then a full-attention one (the default
    full_attention_interval 4), 2 key heads serving 4 value heads, head_dim 16 with a
    quarter rotated, the attention output gated."""
    config = Qwen3_5TextConfig(
        **{**SIZES, "num_hidden_layers": 4},
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    )
    return Qwen3_5ForCausalLM(config)


# name: (builder, seed, saved dtype, layouts)
MODELS = {
    "llama_gqa": (llama_gqa, 0, torch.bfloat16, ("single", "sharded")),
    "qwen2_tied": (qwen2_tied, 1, torch.float16, ("single", "sharded")),
    "llama3_rope": (llama3_rope, 2, torch.float32, ("single",)),
    "mistral": (mistral, 3, torch.bfloat16, ("single",)),
    "qwen3": (qwen3, 4, torch.bfloat16, ("single",)),
    "mistral_window": (mistral_window, 5, torch.float32, ("single",)),
    "qwen3_window": (qwen3_window, 6, torch.bfloat16, ("single",)),
    "smollm3": (smollm3, 7, torch.bfloat16, ("single",)),
    "gemma2": (gemma2, 8, torch.float32, ("single",)),
    "gemma3": (gemma3, 9, torch.bfloat16, ("single",)),
    "qwen3_5": (qwen3_5, 10, torch.bfloat16, ("single",)),
}


# models whose single/ also gets grads.npz (one training step's gradients, torch autograd)
GRADS = ("qwen3_5",)


def reference_tokens(vocab: int) -> np.ndarray:
    return np.random.RandomState(0).randint(0, vocab, size=TOKENS_SHAPE).astype(np.int64)


def randomize(model: PreTrainedModel) -> None:
    """Redraw every parameter (norm gains around 1, the rest around 0) from the torch seed;
    Gemma's and Qwen3.5's norms scale by 1 + weight, so theirs are drawn around 0 (but
    Qwen3.5's gated DeltaNet norm, a plain weight). Qwen3.5's DeltaNet: A = exp(A_log)
    in [0.05, 2] and dt_bias ~ N(0, 1), so the per-token decay exp(g) spreads over
    (0.1, 1) by head and token rather than sitting at one value."""
    centred = model.config.model_type.startswith(("gemma", "qwen3_5"))
    one = 0.0 if centred else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights come once
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif "linear_attn.norm" in name:  # Qwen3_5RMSNormGated: weight * x, not (1 + w)
                p.copy_(1.0 + NORM_STD * torch.randn_like(p))
            elif "q_norm" in name or "k_norm" in name:
                p.copy_(one + QK_NORM_STD * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(one + NORM_STD * torch.randn_like(p))
            else:
                p.copy_(WEIGHT_STD * torch.randn_like(p))


def build(name: str) -> PreTrainedModel:
    builder, seed, dtype, _ = MODELS[name]
    torch.manual_seed(seed)
    model = builder()
    randomize(model)
    return model.to(dtype).eval()


def shard_files(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("model-*-of-*.safetensors"))


def save_sharded(model: PreTrainedModel, directory: pathlib.Path) -> None:
    """save_pretrained with a max_shard_size that gives 2-4 shards (checked)."""
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    model.save_pretrained(directory, max_shard_size=total // 3 + 1)  # an int: bytes
    n = len(shard_files(directory))
    index = directory / "model.safetensors.index.json"
    if not 2 <= n <= 4 or not index.exists() or (directory / "model.safetensors").exists():
        raise RuntimeError(f"{directory}: expected 2-4 shards and an index, got {n}")


def add_stray_lm_head(directory: pathlib.Path, seed: int) -> torch.Tensor:
    """Ship an lm_head.weight (unlike embed_tokens) in the last shard of a tied checkpoint."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    embed = next(
        load_file(f)["model.embed_tokens.weight"]
        for f in shard_files(directory)
        if "model.embed_tokens.weight" in load_file(f)
    )
    gen = torch.Generator().manual_seed(seed)
    head = (WEIGHT_STD * torch.randn(embed.shape, generator=gen)).to(embed.dtype)
    last = shard_files(directory)[-1]
    tensors = load_file(last)
    tensors["lm_head.weight"] = head
    save_file(tensors, last, metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = last.name
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    meta = index.setdefault("metadata", {})
    meta["total_size"] = meta.get("total_size", 0) + head.numel() * head.element_size()
    if "total_parameters" in meta:
        meta["total_parameters"] += head.numel()
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return head


def save_tokenizer(directory: pathlib.Path) -> None:
    """A WordLevel tokenizer over VOCAB tokens (<unk>, <s>, </s>, t3 ...), whitespace split."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)


def load(directory: pathlib.Path, **kwargs) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()


def logits_of(model: PreTrainedModel, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)))
    return out.logits.float().numpy()


def write_npz(path: pathlib.Path, **arrays: np.ndarray) -> None:
    """np.savez with fixed zip timestamps, so regenerating gives identical bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(value), allow_pickle=False)
            zf.writestr(
                zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue()
            )


def write_reference(directory: pathlib.Path, vocab: int) -> np.ndarray:
    tokens = reference_tokens(vocab)
    logits = logits_of(load(directory, attn_implementation="eager"), tokens)
    write_npz(
        directory / "reference.npz",
        tokens=tokens.astype(np.int32),
        logits=logits.astype(np.float32),
    )
    return logits


def write_grads(directory: pathlib.Path, vocab: int) -> float:
    """One training step's truth (``grads.npz``): transformers' loss on the reference
    tokens (``labels = tokens``: the mean next-token cross-entropy over the 2 x 23
    predicted tokens, fp32, eager attention) and its gradient by torch autograd, a
    float32 array a parameter under its checkpoint name, with ``loss`` beside them."""
    model = load(directory, attn_implementation="eager")
    tokens = torch.from_numpy(reference_tokens(vocab))
    model.zero_grad()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    params = dict(model.named_parameters())  # tied weights come once
    missing = [n for n, p in params.items() if p.grad is None or not p.grad.abs().max() > 0]
    if missing:
        raise RuntimeError(f"{directory}: no gradient reaches {missing[:3]}")
    grads = {n: p.grad.detach().float().numpy() for n, p in params.items()}
    write_npz(directory / "grads.npz", loss=np.float32(loss.item()), **grads)
    return float(loss.item())


def describe_head(directory: pathlib.Path, shipped: torch.Tensor) -> str:
    """Which tensor the loaded model uses as its output head (and as its input embedding)."""
    model = load(directory, attn_implementation="eager")
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    shipped = shipped.float()
    files = {k: v for f in shard_files(directory) for k, v in load_file(f).items()}
    saved_embed = files["model.embed_tokens.weight"].float()
    name = lambda w: (
        "shipped lm_head"
        if torch.equal(w, shipped)
        else "embed_tokens"
        if torch.equal(w, saved_embed)
        else "neither"
    )
    return (
        f"head = {name(head)}, input embedding = {name(embed)}, "
        f"same tensor: {head.data_ptr() == embed.data_ptr()}"
    )


def check_window(directory: pathlib.Path, logits: np.ndarray) -> None:
    """The reference logits with the window and without it (the same weights): they
    must differ, or the window would not be tested."""
    config = json.loads((directory / "config.json").read_text())
    if config.get("sliding_window") is None:
        return
    types = config.get("layer_types") if config["model_type"] != "mistral" else None
    unwindowed: dict[str, object] = {"sliding_window": None}
    if types is not None:
        unwindowed["layer_types"] = ["full_attention"] * len(types)
    if config["model_type"].startswith("gemma"):  # no null window: one past the sequence
        unwindowed["sliding_window"] = TOKENS_SHAPE[1] + 1
    full = load(directory, attn_implementation="eager", **unwindowed)
    diff = float(np.abs(logits - logits_of(full, reference_tokens(VOCAB))).max())
    print(
        f"  sliding_window {config['sliding_window']}, layer_types {types}: "
        f"max |logits - logits without the window| = {diff:.4g}"
    )
    if diff < 1e-2:
        raise RuntimeError("the window leaves the logits unchanged")


def check_softcap(directory: pathlib.Path, logits: np.ndarray) -> None:
    """The reference logits against the same weights with each soft-cap off: the caps
    must bind (the largest uncapped logit above its cap, both changing the logits)."""
    config = json.loads((directory / "config.json").read_text())
    tokens = reference_tokens(VOCAB)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is None:
            continue
        uncapped = logits_of(load(directory, attn_implementation="eager", **{key: None}), tokens)
        diff = float(np.abs(logits - uncapped).max())
        print(
            f"  {key} {config[key]}: max |logits - logits without it| = {diff:.4g}"
            f" (max |uncapped logit| {np.abs(uncapped).max():.4g})"
        )
        if diff < 1e-2:
            raise RuntimeError(f"{key} leaves the logits unchanged")


def check_decay(directory: pathlib.Path, logits: np.ndarray) -> None:
    """Qwen3.5's reference logits against the same weights with the DeltaNet decay off
    (A_log very negative: exp(g) = 1) and with its write strength at one half (the b
    projection zero): each must move them, or the decay and beta would not be tested."""
    config = json.loads((directory / "config.json").read_text())
    if config["model_type"] != "qwen3_5_text":
        return
    tokens = reference_tokens(VOCAB)
    for what, suffix, value in (("decay", "A_log", -30.0), ("beta", "in_proj_b.weight", 0.0)):
        model = load(directory, attn_implementation="eager")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(suffix):
                    p.fill_(value)
        diff = float(np.abs(logits - logits_of(model, tokens)).max())
        print(f"  DeltaNet {what} off ({suffix} = {value}): max |logits - reference| = {diff:.4g}")
        if diff < 1e-2:
            raise RuntimeError(f"the DeltaNet {what} leaves the logits unchanged")


def check_rope(model: PreTrainedModel) -> None:
    cfg = model.config
    if "partial_rotary_factor" in cfg.rope_parameters:  # Qwen3.5: a part of each head
        inv = model.model.rotary_emb.inv_freq.float()
        print(f"  rope {cfg.rope_parameters}: inv_freq {inv.numpy().round(6).tolist()}")
        return
    if "full_attention" in cfg.rope_parameters:  # Gemma 3: a rope a layer type
        for kind, params in cfg.rope_parameters.items():
            inv = getattr(model.model.rotary_emb, f"{kind}_inv_freq").float()
            print(f"  rope {kind} {params}: inv_freq {inv.numpy().round(6).tolist()}")
        return
    inv = model.model.rotary_emb.inv_freq.float()
    theta = cfg.rope_parameters["rope_theta"]
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    default = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    changed = int((~torch.isclose(inv, default)).sum())
    print(
        f"  rope {cfg.rope_parameters['rope_type']}: {changed}/{len(inv)} inverse frequencies"
        f" differ from default theta={theta:g}\n  inv_freq {inv.numpy().round(6).tolist()}"
        f"\n  default  {default.numpy().round(6).tolist()}"
    )
    if cfg.rope_parameters["rope_type"] == "llama3" and changed == 0:
        raise RuntimeError("llama3 scaling left the frequencies unchanged")


def generate_one(name: str, out: pathlib.Path) -> None:
    _, seed, dtype, layouts = MODELS[name]
    shutil.rmtree(out / name, ignore_errors=True)  # no stale shards or layouts
    model = build(name)
    print(
        f"{name}: {type(model).__name__}, {sum(p.numel() for p in model.parameters())} "
        f"params, saved as {dtype}"
    )
    logits, stray = {}, None
    for layout in layouts:
        directory = out / name / layout
        directory.mkdir(parents=True, exist_ok=True)
        if layout == "single":
            model.save_pretrained(directory)
        else:
            save_sharded(model, directory)
            if name == "qwen2_tied":
                stray = add_stray_lm_head(directory, seed + 100)
        if name == "llama_gqa" and layout == "single":
            save_tokenizer(directory)
        logits[layout] = write_reference(directory, model.config.vocab_size)
        if name in GRADS and layout == "single":
            loss = write_grads(directory, model.config.vocab_size)
            print(f"  grads.npz: loss {loss:.6f} and its gradient by torch autograd")
        files = sorted(p.name for p in directory.iterdir())
        print(f"  {layout}: max |logits| = {np.abs(logits[layout]).max():.4f}; files {files}")
    if "sharded" in logits:
        diff = np.abs(logits["single"] - logits["sharded"]).max()
        print(f"  max |single - sharded| = {diff:.6g}")
    if stray is not None:
        print(f"  {name}/sharded: {describe_head(out / name / 'sharded', stray)}")
    check_window(out / name / "single", logits["single"])
    check_softcap(out / name / "single", logits["single"])
    check_decay(out / name / "single", logits["single"])
    config = json.loads((out / name / "single" / "config.json").read_text())
    rope = {k: v for k, v in config.items() if "rope" in k or "theta" in k}
    print(f"  config.json rope keys: {rope}")
    check_rope(load(out / name / "single"))


def write_readme(out: pathlib.Path) -> None:
    (out / "README.md").write_text(f"""\
# Tiny Hugging Face checkpoints with reference logits

Written by `experiments/hf_fixtures.py` with transformers {transformers.__version__} and
torch {torch.__version__} (CPU). Random weights (norm gains and biases included),
vocab {VOCAB}, hidden {SIZES["hidden_size"]}, intermediate {SIZES["intermediate_size"]}, \
{SIZES["num_hidden_layers"]} layers.

- `llama_gqa/` (Llama, GQA 4/2, bf16; `single/` also has a tokenizer),
  `qwen2_tied/` (Qwen2, q/k/v biases, tied embeddings, fp16; `sharded/` also ships a stray
  `lm_head.weight` that differs from `embed_tokens`), `llama3_rope/` (Llama, llama3 rope
  scaling, head_dim 16, attention biases, fp32, `single/` only), `mistral/` (bf16,
  `single/` only), `qwen3/` (Qwen3, q/k norms with gains 1 + N(0, {QK_NORM_STD}^2), GQA
  4/2, head_dim 16, bf16, `single/` only), `mistral_window/` (Mistral, sliding window
  {WINDOW} on every layer, fp32, `single/` only), `qwen3_window/` (Qwen3, 3 layers of
  `layer_types` sliding/full/sliding, window {WINDOW}, head_dim 8, GQA 4/1, biases on
  q/k/v/o, tied embeddings, bf16, `single/` only), `smollm3/` (SmolLM3, 3 layers,
  `no_rope_layers` 1/0/1, `use_sliding_window` with window {WINDOW} on the no-rope
  layer, tied embeddings, bf16, `single/` only), `gemma2/` (Gemma 2, 3 layers
  sliding/full/sliding, window {WINDOW}, head_dim 16, `query_pre_attn_scalar` 24,
  soft-caps {ATTN_CAP} on the scores and {FINAL_CAP} on the logits, both binding, fp32,
  `single/` only), `gemma3/` (Gemma 3 text, 3 layers sliding/sliding/full, window
  {WINDOW}, head_dim 16, GQA 4/1, q/k norms, the full layer's rope linear x4 on base
  1e6, the sliding layers' default rope on base 1e4, bf16, `single/` only), `qwen3_5/`
  (Qwen3.5 text: 4 layers, 3 Gated DeltaNet `linear_attention` then one
  `full_attention`, 2 key heads of 8 serving 4 value heads of 8, conv kernel 4; the full
  layer GQA 4/2, head_dim 16 with a quarter rotated, q/k norms, its output gated;
  `A_log` = log U(0.05, 2), `dt_bias` ~ N(0, 1): the decay and the write strength each
  move the logits; bf16, `single/` only). Gemma's and Qwen3.5's norm weights are drawn
  around 0 (they scale by 1 + weight), Qwen3.5's gated DeltaNet norm around 1.
- `single/` is one `model.safetensors`; `sharded/` is 2-4 shards plus
  `model.safetensors.index.json`.
- `reference.npz` in each directory: `tokens` (int32, 2x24) and the float32 `logits`
  (2x24xV) transformers computes from that directory loaded in float32 (eager attention).
- `qwen3_5/single/grads.npz`: one training step's truth, transformers' loss on those
  tokens (`labels = tokens`: the mean next-token cross-entropy, fp32, eager) as `loss` and
  its gradient by torch autograd, a float32 array a parameter under its checkpoint name
  (`python -m experiments.hf_fixtures grads` writes it alone from the committed weights).

Regenerate (needs torch + transformers, not jaxzero; `--only NAME`, repeatable, writes
those models alone and leaves this file as it is):

    /path/to/venv-with-torch/bin/python -m experiments.hf_fixtures --out tests/fixtures/hf

Check that transformers loads a directory jaxzero saved to the same logits:

    /path/to/venv-with-torch/bin/python -m experiments.hf_fixtures check DIR REFERENCE_NPZ
""")


def generate(out: pathlib.Path, only: list[str] | None = None) -> None:
    """Every model and the README, or only the models named (the rest left as they are)."""
    transformers.utils.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name in only or MODELS:
        generate_one(name, out)
    if only:
        print(f"{out / 'README.md'} left as it is: update it by hand if the list changed")
    else:
        write_readme(out)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: {total / 1024:.1f} KiB in files")


def check(saved: pathlib.Path, reference: pathlib.Path, atol: float) -> int:
    """Load SAVED as transformers would, compare to REFERENCE's logits; 1 if above atol."""
    ref = np.load(reference)
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    err = float(np.abs(logits_of(model, ref["tokens"]) - ref["logits"]).max())
    print(f"loaded {type(model).__name__}; max |logits - reference| = {err:.3g} (atol {atol:g})")
    return 0 if err <= atol else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        p = argparse.ArgumentParser(prog="hf_fixtures.py check", description=check.__doc__)
        p.add_argument("saved", type=pathlib.Path)
        p.add_argument("reference", type=pathlib.Path)
        p.add_argument("--atol", type=float, default=1e-4)
        a = p.parse_args(argv[1:])
        return check(a.saved, a.reference, a.atol)
    if argv[:1] == ["grads"]:  # grads.npz from the committed weights, nothing else written
        p = argparse.ArgumentParser(prog="hf_fixtures.py grads", description=write_grads.__doc__)
        p.add_argument("--out", type=pathlib.Path, default=OUT)
        p.add_argument("--only", action="append", choices=list(GRADS))
        a = p.parse_args(argv[1:])
        for name in a.only or GRADS:
            loss = write_grads(a.out / name / "single", VOCAB)
            print(f"{a.out / name / 'single' / 'grads.npz'}: loss {loss:.6f}")
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", choices=["generate"], default="generate")
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument(
        "--only", action="append", choices=list(MODELS), help="write this model only (repeatable)"
    )
    a = p.parse_args(argv)
    generate(a.out, a.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
