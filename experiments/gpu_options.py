"""Which XLA:GPU options the step gets from this jaxlib, and what they change.

XLA renames its flags between releases (``xla_gpu_enable_pipelined_all_gather``, a
bool up to jaxlib 0.10, is ``xla_gpu_pipeline_all_gather``, a mode, in 0.12), and an
option the build does not know is dropped from the preset with a warning. This prints,
for the installed jaxlib:

* each option of ``jaxzero.backend.GPU_OPTIONS`` as this XLA spells it, or "dropped";
* the reference GPT's stage-3 per-layer step compiled with the preset and with XLA's
  own defaults, in alternating order: compile time, median step time, the async
  collectives in the compiled program, and whether the two train to the same losses.

    python -m experiments.gpu_options                     # every local GPU
    python -m experiments.gpu_options --d-model 1024 --layers 16 --steps 10

On one GPU the mesh has no collectives to overlap: there only the spellings, the
compile and the loss agreement mean anything. Runs on CPU too (no preset there).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import warnings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-per-device", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="compile and run both, alternating which goes first (the first "
        "compile of a process also pays CUDA's start-up)",
    )
    args = ap.parse_args()

    import jax
    import jaxlib
    import numpy as np
    import optax

    import jaxzero
    from jaxzero import backend
    from jaxzero.models.gpt import GPT, GPTConfig

    mesh = jaxzero.make_mesh(jax.device_count())
    plat = backend.platform(mesh)
    print(
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind} ({plat})"
    )
    if plat != "cpu":
        for name, value in backend.GPU_OPTIONS.items():
            found = backend.spelled(plat, name, value)
            said = "dropped: unknown to this XLA" if found is None else f"{found[0]}={found[1]}"
            print(f"  {name}: {said}")

    cfg = GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=max(1, args.d_model // 64),
    )
    model = GPT(cfg)
    rng = np.random.default_rng(0)
    b = args.batch_per_device * jax.device_count()
    tokens = rng.integers(0, cfg.vocab_size, (args.steps, b, cfg.seq_len + 1)).astype(np.int32)
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    params = model.init(jax.random.key(0))
    plain = {name: None for name in backend.GPU_OPTIONS}
    results = {}
    order = [("XLA defaults", plain), ("preset", None)]
    for label, options in [order[(r + i) % 2] for r in range(args.rounds) for i in range(2)]:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            engine = model.engine(optax.adamw(1e-3), mesh=mesh, stage=3, compiler_options=options)
        state = engine.init(params)
        t0 = time.perf_counter()
        hlo = engine.compile(state, batches[0]).as_text()
        compile_s = time.perf_counter() - t0
        losses, times = [], []
        for batch in batches:
            t0 = time.perf_counter()
            state, metrics = engine.step(state, batch)
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - t0)
        starts = {
            op: len(re.findall(rf"\b{op}-start\(", hlo))
            for op in ("all-gather", "reduce-scatter", "all-reduce")
        }
        results[label] = losses
        print(f"{label}: options {engine.compiler_options}")
        for w in warned:
            print(f"  warning: {w.message}")
        print(
            f"  compile {compile_s:.1f} s, step {statistics.median(times[1:]) * 1e3:.1f} ms "
            f"(median of {len(times) - 1}), async collective starts {starts}"
        )
        print(f"  losses {' '.join(f'{x:.5f}' for x in losses)}")
    a, c = np.array(results["preset"]), np.array(results["XLA defaults"])
    print(f"largest loss difference, preset vs XLA defaults: {np.max(np.abs(a - c)):.2e}")


if __name__ == "__main__":
    main()
