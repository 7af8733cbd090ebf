"""QLoRA against LoRA on a bf16 base: the loss after 50 steps, and what dequantizing costs.

A random bf16 Llama (d=128, 4 layers, SwiGLU 384, vocab 256), written as a Hugging Face
directory by ``jaxzero.hf.save`` and loaded back three ways: LoRA over the bf16 base,
QLoRA over its int8 and nf4 quantization (rank 16 on every projection, alpha 32,
AdamW 2e-3, fp32 compute, 2 simulated devices, stage 3). All three train 50 steps on the
same learnable sequence (``t[i+1] = (5 t[i] + 3) mod 256``, random starts), 16 x 64
tokens a step. Printed: the loss at steps 1 and 50 of each, the gap to the bf16 base's,
and the step time (median of the last 40 steps; the quantized bases dequantize each
layer's weights in every forward and backward pass).

    python -m experiments.qlora_loss
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from jaxzero.mesh import simulate_devices

simulate_devices(2)  # before JAX starts its backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxzero  # noqa: E402
from jaxzero import hf  # noqa: E402
from jaxzero.models.llama import Llama, LlamaConfig  # noqa: E402
from jaxzero.models.lora import LoraConfig  # noqa: E402

OUT = Path(__file__).parent / "results" / "qlora_loss.md"
STEPS = 50


def _base(root: Path) -> Path:
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, seq_len=64,
    )  # fmt: skip
    m = Llama(cfg)
    engine = m.engine(optax.sgd(0.0), mesh=jaxzero.make_mesh(1))
    path = root / "base"
    hf.save(path, m, engine, engine.init_from(m.init, jax.random.key(0)), dtype="bfloat16")
    return path


def _batch(step: int) -> dict[str, np.ndarray]:
    start = np.random.default_rng(step).integers(0, 256, (16, 1))
    seq = [start]
    for _ in range(64):
        seq.append((5 * seq[-1] + 3) % 256)
    tokens = np.concatenate(seq, axis=1).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _train(base: Path, kind: str | None) -> tuple[list[float], float]:
    m = hf.model(base, lora=LoraConfig(rank=16, alpha=32, base_dtype=kind), seq_len=64)
    engine = m.engine(optax.adamw(2e-3), mesh=jaxzero.make_mesh(2), stage=3)
    state = hf.load(base, engine, m)
    losses, times = [], []
    for step in range(STEPS):
        t = time.perf_counter()
        state, metrics = engine.step(state, _batch(step))
        losses.append(float(metrics["loss"]))  # waits for the step
        times.append(time.perf_counter() - t)
    return losses, float(np.median(times[10:]))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = _base(Path(tmp))
        runs = {kind or "bf16": _train(base, kind) for kind in (None, "int8", "nf4")}
    ref = runs["bf16"][0]
    lines = [
        "| base | loss at step 1 | loss at step 50 | gap to bf16 at 50 | ms/step | vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for name, (losses, sec) in runs.items():
        gap = (losses[-1] - ref[-1]) / ref[-1]
        lines.append(
            f"| {name} | {losses[0]:.4f} | {losses[-1]:.4f} | {100 * gap:+.2f}% | "
            f"{1e3 * sec:.1f} | {sec / runs['bf16'][1]:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text + "\n")


if __name__ == "__main__":
    main()
