"""Tiny random PEFT LoRA adapters and PyTorch reference logits, as test fixtures.

CI has no torch, so jaxzero's LoRA loading and merging is checked against logits that
`peft` computed once, here, over the base checkpoints of tests/fixtures/hf/ (see
experiments/hf_fixtures.py), and committed under tests/fixtures/peft/<name>/:

    adapter_config.json, adapter_model.safetensors   PeftModel.save_pretrained(dir)
    reference.npz   tokens (int32, 2x24), logits (base + adapter), base_logits (base
                    alone) and merged_logits (merge_and_unload), all float32 2x24xV

Adapters: llama_gqa_r4 (llama_gqa base, r=4, alpha=8, all-linear) and
qwen2_tied_qv_rslora (qwen2_tied base, r=2, alpha=4, q_proj/v_proj, rsLoRA). lora_A and
lora_B are both redrawn from seeded normals (peft would start B at zero), so the adapter
moves the logits. Bases are loaded in float32 with eager attention; the adapter's
base_model_name_or_path is the base directory relative to the repository root.

Needs torch, transformers, peft and safetensors (not jaxzero). Run from the repository
root. Regenerate; check an adapter (peft applies it) or a merged plain transformers
directory (e.g. one that jaxzero wrote) against a reference:

    /path/to/venv-with-torch/bin/python -m experiments.peft_fixtures [generate] [--out DIR]
    /path/to/venv-with-torch/bin/python -m experiments.peft_fixtures check BASE_DIR \\
        ADAPTER_DIR REFERENCE_NPZ [--rtol 1e-4]
    /path/to/venv-with-torch/bin/python -m experiments.peft_fixtures check-merged \\
        MERGED_DIR REFERENCE_NPZ [--rtol 1e-4]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open

from experiments.hf_fixtures import load, logits_of, reference_tokens, write_npz

ROOT = pathlib.Path(__file__).parent.parent
OUT = ROOT / "tests" / "fixtures" / "peft"
LORA_STD = 0.2  # both A and B: B @ A * scaling is of the order of the base weights
MIN_EFFECT = 0.05  # the adapter must move some logit by more than this
MERGE_RTOL = 1e-5  # merge_and_unload must agree with the unmerged adapter

# name: (base directory relative to ROOT, seed, LoraConfig kwargs)
ADAPTERS = {
    "llama_gqa_r4": (
        "tests/fixtures/hf/llama_gqa/single",
        10,
        dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    ),
    "qwen2_tied_qv_rslora": (
        "tests/fixtures/hf/qwen2_tied/single",
        11,
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
    ),
}


def load_base(directory: pathlib.Path) -> transformers.PreTrainedModel:
    return load(directory, attn_implementation="eager")


def randomize_lora(model: torch.nn.Module, seed: int) -> None:
    """Redraw every lora_A and lora_B weight as LORA_STD * N(0, 1) from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(LORA_STD * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def adapted(base_dir: pathlib.Path, adapter_dir: pathlib.Path) -> PeftModel:
    return PeftModel.from_pretrained(load_base(base_dir), adapter_dir).eval()


def max_diffs(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / max |b|)."""
    err = float(np.abs(a - b).max())
    return err, err / float(np.abs(b).max())


def tensor_shapes(path: pathlib.Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(path, "pt") as f:
        return {
            k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
        }


def save_adapter(name: str, directory: pathlib.Path) -> float:
    """get_peft_model + random A and B + save_pretrained; returns the LoRA scaling."""
    base_rel, seed, kwargs = ADAPTERS[name]
    model = get_peft_model(load_base(ROOT / base_rel), LoraConfig(task_type="CAUSAL_LM", **kwargs))
    randomize_lora(model, seed)
    model.save_pretrained(directory)
    (directory / "README.md").unlink(missing_ok=True)  # peft's boilerplate model card
    (directory / "adapter_model.safetensors").chmod(0o644)  # peft writes it 0600
    config_path = directory / "adapter_config.json"
    config = json.loads(config_path.read_text())
    print(f"{name}: peft wrote base_model_name_or_path={config['base_model_name_or_path']!r}")
    config["base_model_name_or_path"] = base_rel
    if isinstance(config["target_modules"], list):  # "all-linear" comes back in set order
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    layer = next(m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    return layer.scaling["default"]


def generate_one(name: str, out: pathlib.Path) -> None:
    base_rel, _, kwargs = ADAPTERS[name]
    base_dir, directory = ROOT / base_rel, out / name
    shutil.rmtree(directory, ignore_errors=True)
    scaling = save_adapter(name, directory)
    base = load_base(base_dir)
    tokens = reference_tokens(base.config.vocab_size)
    base_logits = logits_of(base, tokens)
    logits = logits_of(adapted(base_dir, directory), tokens)
    merged_logits = logits_of(adapted(base_dir, directory).merge_and_unload(), tokens)
    hf_ref = np.load(base_dir / "reference.npz")
    assert np.array_equal(hf_ref["tokens"], tokens.astype(np.int32))
    write_npz(
        directory / "reference.npz",
        tokens=tokens.astype(np.int32),
        logits=logits.astype(np.float32),
        base_logits=base_logits.astype(np.float32),
        merged_logits=merged_logits.astype(np.float32),
    )
    effect = float(np.abs(logits - base_logits).max())
    merge_abs, merge_rel = max_diffs(merged_logits, logits)
    n = len(tensor_shapes(directory / "adapter_model.safetensors"))
    print(
        f"  {n} LoRA tensors over {type(base).__name__}, scaling {scaling:.6g} (r={kwargs['r']},"
        f" alpha={kwargs['lora_alpha']}, rslora={kwargs.get('use_rslora', False)})\n"
        f"  max |logits| = {np.abs(logits).max():.4f}, "
        f"max |base_logits| = {np.abs(base_logits).max():.4f}\n"
        f"  max |logits - base_logits| = {effect:.4f} (must be > {MIN_EFFECT})\n"
        f"  max |merged - logits| = {merge_abs:.3g}, relative {merge_rel:.3g}"
        f" (must be <= {MERGE_RTOL})\n"
        f"  max |base_logits - hf reference| = {np.abs(base_logits - hf_ref['logits']).max():.3g}"
    )
    if effect <= MIN_EFFECT:
        raise RuntimeError(f"{name}: the adapter barely changes the logits ({effect:.3g})")
    if merge_rel > MERGE_RTOL:
        raise RuntimeError(f"{name}: merged logits differ from the adapter's ({merge_rel:.3g})")
    print("  " + ", ".join(f"{p.name} {p.stat().st_size} B" for p in sorted(directory.iterdir())))


def adapter_section(name: str, out: pathlib.Path) -> str:
    directory = out / name
    shapes = tensor_shapes(directory / "adapter_model.safetensors")
    keys = "\n".join(f"    {k}  {list(s)} {dt}" for k, (s, dt) in shapes.items())
    config = (directory / "adapter_config.json").read_text()
    return (
        f"### `{name}/` ({len(shapes)} tensors)\n\n"
        f"`adapter_model.safetensors` keys (shape, dtype):\n\n{keys}\n\n"
        f"`adapter_config.json`:\n\n```json\n{config}```\n"
    )


def write_readme(out: pathlib.Path) -> None:
    sections = "\n".join(adapter_section(name, out) for name in ADAPTERS)
    (out / "README.md").write_text(f"""\
# Tiny PEFT LoRA adapters with reference logits

Written by `experiments/peft_fixtures.py` with peft {peft.__version__},
transformers {transformers.__version__} and torch {torch.__version__}, over the base
checkpoints of `tests/fixtures/hf/` (each adapter's `base_model_name_or_path` is its base
directory relative to the repository root; `target_modules` lists are sorted).

- `llama_gqa_r4/`: base `llama_gqa/single` (Llama, GQA 4/2), `LoraConfig(r=4,
  lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")`:
  q/k/v/o and gate/up/down of both layers (not `lm_head`), scaling alpha/r = 2.
- `qwen2_tied_qv_rslora/`: base `qwen2_tied/single` (Qwen2, q/k/v biases, tied
  embeddings), `LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
  use_rslora=True, task_type="CAUSAL_LM")`: scaling alpha/sqrt(r) = 2.828 (not alpha/r).
- lora_A and lora_B are both `{LORA_STD} * N(0, 1)` from a seeded `torch.Generator` (peft
  itself starts B at zero), float32. peft adds `scaling * B(A(x))` to each target's output;
  merging adds `scaling * B @ A` to its weight.
- `reference.npz`: `tokens` (int32, 2x24, the same as `tests/fixtures/hf`), and float32
  2x24xV `logits` (`PeftModel.from_pretrained(base, adapter_dir)`, eval), `base_logits`
  (the base alone) and `merged_logits` (`merge_and_unload()` of a fresh load; equal to
  `logits` within {MERGE_RTOL:g} relative). Bases are loaded in float32, eager attention.
- A merged model must be saved in float32 to pass `check-merged` at its default rtol 1e-4:
  the same merge saved in bf16 is about 2e-2 off (relative to max |logits|).

Regenerate (needs torch + transformers + peft, not jaxzero; from the repository root):

    /path/to/venv-with-torch/bin/python -m experiments.peft_fixtures

Check an adapter (peft applies it), or a merged plain transformers directory:

    /path/to/venv-with-torch/bin/python -m experiments.peft_fixtures check BASE_DIR ADAPTER_DIR NPZ
    /path/to/venv-with-torch/bin/python -m experiments.peft_fixtures check-merged MERGED_DIR NPZ

## Files

{sections}""")


def generate(out: pathlib.Path) -> None:
    versions = (peft.__version__, transformers.__version__, torch.__version__)
    print("peft {}, transformers {}, torch {}".format(*versions))
    for name in ADAPTERS:
        generate_one(name, out)
    write_readme(out)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: {total / 1024:.1f} KiB in files")


def report(model: torch.nn.Module, ref: np.lib.npyio.NpzFile, base: np.ndarray, rtol: float) -> int:
    """Compare the model's logits on ref's tokens to ref's logits; 1 if above rtol."""
    got = logits_of(model, ref["tokens"])
    err, rel = max_diffs(got, ref["logits"])
    effect = float(np.abs(got - base).max())
    print(
        f"max |logits - reference| = {err:.3g}, relative {rel:.3g} (rtol {rtol:g}); "
        f"max |logits - base logits| = {effect:.4f}"
    )
    return 0 if rel <= rtol else 1


def check(base_dir: pathlib.Path, adapter_dir: pathlib.Path, npz: pathlib.Path, rtol: float) -> int:
    """Apply ADAPTER_DIR to BASE_DIR with peft, compare to NPZ's logits; 1 if above rtol."""
    ref = np.load(npz)
    base = logits_of(load_base(base_dir), ref["tokens"])
    model = adapted(base_dir, adapter_dir)
    print(f"loaded {type(model).__name__} over {type(model.get_base_model()).__name__}")
    return report(model, ref, base, rtol)


def check_merged(merged_dir: pathlib.Path, npz: pathlib.Path, rtol: float) -> int:
    """Load MERGED_DIR as a plain transformers model, compare to NPZ's logits; 1 if above rtol."""
    ref = np.load(npz)
    model = load_base(merged_dir)
    print(f"loaded {type(model).__name__}")
    return report(model, ref, ref["base_logits"], rtol)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    transformers.utils.logging.disable_progress_bar()
    if argv[:1] in (["check"], ["check-merged"]):
        fn = check if argv[0] == "check" else check_merged
        p = argparse.ArgumentParser(prog=f"peft_fixtures.py {argv[0]}", description=fn.__doc__)
        if fn is check:
            p.add_argument("base_dir", type=pathlib.Path)
            p.add_argument("adapter_dir", type=pathlib.Path)
        else:
            p.add_argument("merged_dir", type=pathlib.Path)
        p.add_argument("npz", type=pathlib.Path)
        p.add_argument("--rtol", type=float, default=1e-4)
        return fn(**vars(p.parse_args(argv[1:])))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", choices=["generate"], default="generate")
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    generate(p.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
