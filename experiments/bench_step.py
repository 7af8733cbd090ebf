"""Step time of each ZeRO stage next to a GSPMD baseline, measured in the same run.

The baseline trains the same model on the same state, stored with the same
shardings, with plain ``jax.jit`` (in/out ``NamedSharding``s, no ``shard_map``):
XLA's partitioner inserts the collectives. jaxzero's step writes them by hand, so
the ratio says what the explicit step costs or saves. Also: stage 3 on one
device against a plain single-device ``jax.jit`` step.

    python experiments/bench_step.py                 # 8 simulated CPU devices
    python experiments/bench_step.py --devices 1 --stages 0 3 --precision bf16 \
        --d-model 1024 --layers 24 --seq-len 1024 --batch 8   # one GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--simulate", type=int, default=None,
                   help="simulated CPU devices (default: --devices when no accelerator)")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up)")
    p.add_argument("--remat", default="none")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak of one device, for MFU (H100/H200: 989)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from jaxzero.mesh import accelerator_expected, simulate_devices

    if args.simulate or not accelerator_expected():
        simulate_devices(args.simulate or args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxzero
    from jaxzero.models.gpt import GPT, GPTConfig
    from jaxzero.partition import pad, unpad

    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                          n_layers=args.layers, n_heads=args.heads, remat=args.remat))
    tx = optax.adamw(1e-4)
    mesh = jaxzero.make_mesh(args.devices)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq_len + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    n_params = model.num_params(jax.eval_shape(model.init, jax.random.key(0)))
    tokens_per_step = args.batch * args.seq_len

    def timed(runs):
        """Median seconds per step of each (step, state, batch), interleaved step by step
        so that load from other processes hits every contestant alike."""
        states = [state for _, state, _ in runs]
        for _ in range(2):  # compile and warm up
            for i, (step, _, b) in enumerate(runs):
                states[i], m = step(states[i], b)
                jax.block_until_ready(m)
        times = [[] for _ in runs]
        for _ in range(args.steps):
            for i, (step, _, b) in enumerate(runs):
                t = time.perf_counter()
                states[i], m = step(states[i], b)
                jax.block_until_ready(m)
                times[i].append(time.perf_counter() - t)
        return [statistics.median(t) for t in times]

    def gspmd_step_for(engine):
        """The same update on the same stored state, partitioned by XLA."""
        lays, stage = engine.layouts, engine.stage
        cdt = engine.compute_dtype

        def step(state, b):
            params = state.params
            if stage == 3:
                params = jax.tree.map(lambda x, lay: unpad(x, lay), params, lays)
            loss, grads = jax.value_and_grad(model.loss_fn)(params, b)
            if stage >= 1:
                grads = jax.tree.map(lambda g, lay: pad(g, lay), grads, lays)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            master = state.master if engine.mixed else (
                jax.tree.map(lambda x, lay: pad(x, lay), state.params, lays)
                if stage in (1, 2) else state.params)
            updates, opt = tx.update(grads, state.opt_state, master)
            master = optax.apply_updates(master, updates)
            new_params = jax.tree.map(lambda m: m.astype(cdt), master)
            if stage in (1, 2):
                new_params = jax.tree.map(lambda x, lay: unpad(x, lay), new_params, lays)
            return jaxzero.TrainState(state.step + 1, new_params,
                                      master if engine.mixed else None, opt), {"loss": loss}

        sh = engine.state_shardings
        return jax.jit(step, in_shardings=(sh, engine.batch_sharding),
                       out_shardings=(sh, None), donate_argnums=0)

    print(f"GPT {n_params / 1e6:.1f}M params, {args.devices} {jax.default_backend()} device(s), "
          f"{args.precision}, global batch {args.batch} x {args.seq_len} tokens")
    print(f"{'stage':>5} {'jaxzero ms':>11} {'GSPMD ms':>9} {'ratio':>6} {'tokens/s':>10} "
          f"{'MFU %':>6}")
    flops_per_step = model.flops_per_token(n_params) * tokens_per_step
    results = {}
    for stage in args.stages:
        engine = model.engine(tx, mesh=mesh, stage=stage, precision=args.precision)
        b = engine.shard_batch(batch)
        t_zero, t_base = timed([
            (engine.step, engine.init_from(model.init, jax.random.key(0)), b),
            (gspmd_step_for(engine), engine.init_from(model.init, jax.random.key(0)), b)])
        mfu = flops_per_step / t_zero / (args.peak_tflops * 1e12 * args.devices) * 100
        mfu = f"{mfu:>6.2f}" if jax.default_backend() == "gpu" else f"{'n/a':>6}"
        results[stage] = (t_zero, t_base)
        print(f"{stage:>5} {t_zero * 1e3:>11.1f} {t_base * 1e3:>9.1f} {t_zero / t_base:>6.3f} "
              f"{tokens_per_step / t_zero:>10.0f} {mfu}")

    if args.devices == 1 and 3 in results:
        p = jax.device_put(model.init(jax.random.key(0)), jax.devices()[0])
        cdt = jnp.bfloat16 if args.precision == "bf16" else jnp.float32
        state = (jax.tree.map(lambda x: x.astype(cdt), p), p, tx.init(p))

        @jax.jit
        def plain(state, b):
            params, master, opt = state
            loss, g = jax.value_and_grad(model.loss_fn)(params, b)
            u, opt = tx.update(jax.tree.map(lambda x: x.astype(jnp.float32), g), opt, master)
            master = optax.apply_updates(master, u)
            return (jax.tree.map(lambda x: x.astype(cdt), master), master, opt), {"loss": loss}

        engine = model.engine(tx, mesh=mesh, stage=3, precision=args.precision)
        zero_state = engine.init_from(model.init, jax.random.key(0))
        t_zero3, t_plain = timed([(engine.step, zero_state, engine.shard_batch(batch)),
                                  (plain, state, jax.device_put(batch))])
        print(f"stage 3 at N=1 vs plain single-device jit: {t_zero3 * 1e3:.1f} ms / "
              f"{t_plain * 1e3:.1f} ms = {t_zero3 / t_plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
