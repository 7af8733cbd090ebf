"""The smallest program that shows XLA:CPU's placement cost: one step, two speeds.

No jaxzero here: a user's GPT (``plain_gpt.py`` or the zoo's ``user_gpt``), its AdamW
step under plain ``jax.jit``, data parallel over simulated CPU devices, compiled twice:
once donating the state and once not. The script checks that the two compiled
programs are the same text but for the input/output alias line (the same fusions, the
same schedule), then times them interleaved and profiles them kernel by kernel.

What it shows (docs/dev/performance-log.md has the figures): the donating program is
slower, and the time is in a few memory-bound fusions (``copy_bitcast_fusion``:
a transpose fused with the residual stream's sum, a dozen or more inputs) whose code
is identical in both. Their speed depends on where XLA:CPU puts the buffers they read,
not on what they compute. jaxzero's stages 1-2 (and ``plain``'s stage 3) land on the
slow placement on these models, as XLA's own GSPMD steps do; that is the part of
their ratio to plain jit that is not the engine's.

    python -m experiments.cpu_placement                    # plain_gpt, 2 devices
    python -m experiments.cpu_placement --model user_gpt --batch 8
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

ALIAS = re.compile(r"input_output_alias=\{.*?\}, (?=entry_computation_layout)")
TUPLE = re.compile(r"%tuple(\.\d+)?")


def same_program(a: str, b: str) -> bool:
    """Two compiled HLO texts equal once the alias line and the root tuple's name go."""
    strip = lambda t: TUPLE.sub("%tuple", ALIAS.sub("", t))
    return strip(a) == strip(b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["plain", "user_gpt"], default="plain")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds")
    args = p.parse_args(argv)

    from jaxzero.mesh import simulate_devices

    simulate_devices(args.devices)
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from experiments import plain_gpt, step_profile, zoo

    shape = (256, args.seq_len, args.d_model, args.layers)  # vocab, seq_len, d_model, layers
    if args.model == "plain":
        init = lambda key: plain_gpt.init(key, *shape)
        loss_fn = plain_gpt.loss_fn
    else:
        init = lambda key: zoo.user_gpt_init(key, *shape)
        loss_fn = lambda prm, b: zoo.user_gpt_loss(prm, b, n_heads=4)
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((args.devices,), ("data",), axis_types=auto)
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = optax.adamw(1e-4)
    tokens = (
        np.random.default_rng(0).integers(0, 256, (args.batch, args.seq_len + 1)).astype(np.int32)
    )
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, rows)

    def step(state, b):
        prm, opt = state
        loss, g = jax.value_and_grad(loss_fn)(prm, b)
        u, opt = tx.update(g, opt, prm)
        return (optax.apply_updates(prm, u), opt), loss

    def fresh():
        prm = jax.jit(init, out_shardings=rep)(jax.random.key(0))
        return prm, tx.init(prm)

    compiled, states = {}, {}
    for donate in (False, True):
        name = f"donate={donate}"
        compiled[name] = (
            jax.jit(step, donate_argnums=0 if donate else ()).lower(fresh(), batch).compile()
        )
        states[name] = fresh()
    texts = [c.as_text() for c in compiled.values()]
    print(f"{args.model}, global batch {args.batch} x {args.seq_len}, {args.devices} CPU device(s)")
    print(f"compiled programs identical but for the alias line: {same_program(*texts)}")

    def run(name: str) -> None:
        states[name], loss = compiled[name](states[name], batch)
        loss.block_until_ready()

    for name in compiled:  # warm up
        run(name)
    times: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(args.rounds):
        for name in compiled:
            t = time.perf_counter()
            for _ in range(args.steps):
                run(name)
            times[name].append((time.perf_counter() - t) / args.steps * 1e3)
    ms = {n: statistics.median(v) for n, v in times.items()}
    for n, v in ms.items():
        print(f"  {n}: {v:.1f} ms per step (median of {args.rounds} rounds)")
    print(f"  donating / not: {ms['donate=True'] / ms['donate=False']:.3f}")

    kernels, _ = step_profile.profile(
        {n: (lambda n=n: run(n)) for n in compiled}, args.steps, 2, args.devices
    )
    a, b = kernels["donate=False"], kernels["donate=True"]
    print("kernels that differ most (ms per device per step, not donating -> donating):")
    for k in sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k]))[:8]:
        print(f"  {k:<28} {a[k]:6.1f} -> {b[k]:6.1f}")
    by_kind = lambda c: sum(v for k, v in c.items() if step_profile.kind(k) == "copies/transposes")
    print(f"copies/transposes in all: {by_kind(a):.1f} -> {by_kind(b):.1f} ms; "
          f"all kernels: {sum(a.values()):.1f} -> {sum(b.values()):.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
