"""Step time of each ZeRO stage next to plain ``jax.jit`` and GSPMD baselines, in one run.

Every contestant trains the same model on the same batches, steps interleaved one by
one (in a random order each round) so that load from other processes hits all alike:

* **plain jit**: the data-parallel step a new user writes first: replicated params and
  optimizer state, the batch split with a ``NamedSharding``, ``jax.jit``, XLA inserts
  the gradient all-reduce. Timed donating its state and not; the faster is the bar.
* **shard_map pmean**: plain jit's step with its gradients taken in a hand-written
  ``jax.shard_map`` and averaged by ``pmean``, as a user would write it: what an
  explicit-collective step costs without jaxzero (on XLA:CPU its weight-gradient dots
  fall back to Eigen, which jaxzero's ``dot_barrier`` avoids).
* **GSPMD**: per stage, the same update on jaxzero's stored state and shardings, by
  plain ``jax.jit`` (XLA's partitioner inserts the collectives, no ``shard_map``).
* **jaxzero**: ``Engine`` with its defaults, collectives written by hand.

Models: the zoo of ``zoo.py`` (``--model``), written as users write them: ``user_gpt``
(a pytree GPT with attention by hand, issue 22's model), ``plain`` (``plain_gpt.py``),
``gpt`` (the reference Flax GPT, per-layer), ``llama`` (Flax NNX, per-layer),
``convnet`` and ``embed`` (Flax Linen). ``--zoo`` runs each of them in its own process,
``--invocations`` times, and prints per model and stage jaxzero's ratio to the faster
plain-jit step and to GSPMD: the median and range over invocations. Nothing is timed
unless every contestant's first-step loss is plain jit's (``--check`` stops there).
``--profile`` says where each contestant's step spends its time instead (``step_profile.py``).

    python -m experiments.bench_step --zoo                    # all models, 3 invocations
    python -m experiments.bench_step --model user_gpt --runs 3
    python -m experiments.bench_step --model user_gpt --profile --runs 3 --steps 3
    python -m experiments.bench_step --devices 1 --stages 0 3 --precision bf16 \
        --model gpt --d-model 1024 --layers 24 --seq-len 1024 --batch 8   # one GPU: MFU

Targets (issue 22), with jaxzero's defaults, on every model: stages 0-2 at most 1.10x
the faster plain-jit step; stage 3 at most 1.25x (``per_layer=False``), 1.15x on the
per-layer models.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

from experiments import step_profile, zoo
from experiments.results_io import read_csv, write_csv

HERE = pathlib.Path(__file__).parent


def target(model: str, stage: int) -> float:
    """The most jaxzero's step may take, as a multiple of the faster plain-jit step."""
    if stage < 3:
        return 1.10
    return 1.15 if model in zoo.PER_LAYER else 1.25


def readme_table(path: pathlib.Path) -> str:
    """The README's table from a ``--csv`` file: medians over runs, ratio ranges."""
    rows = read_csv(path)
    out = [
        "| stage | jaxzero ms | plain jit ms (donating / not) | GSPMD ms | shard_map pmean ms "
        "| vs plain jit | vs GSPMD | vs shard_map pmean |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stage in sorted({int(r["stage"]) for r in rows}):
        rs = [r for r in rows if int(r["stage"]) == stage]
        med = lambda k, rs=rs: f"{statistics.median(float(r[k]) for r in rs):.1f}"
        ratio = lambda base, rs=rs: [float(r["jaxzero_ms"]) / base(r) for r in rs]
        span = lambda v: f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})"
        jit = ratio(lambda r: min(float(r["jit_donate_ms"]), float(r["jit_no_donate_ms"])))
        out.append(
            f"| {stage} | {med('jaxzero_ms')} | {med('jit_donate_ms')} / "
            f"{med('jit_no_donate_ms')} | {med('gspmd_ms')} | {med('shard_map_ms')} | "
            f"{span(jit)} | {span(ratio(lambda r: float(r['gspmd_ms'])))} | "
            f"{span(ratio(lambda r: float(r['shard_map_ms'])))} |"
        )
    return "\n".join(out)


HLO_OPS = ("copy", "transpose", "dot", "fusion", "all-gather", "reduce-scatter", "all-reduce")


def hlo_census(compiled) -> str:
    """What a compiled step is made of: instructions of the kinds that cost on XLA:CPU
    (copies, transposes, dots and collectives outside fusions, fusions) and its
    temp/aliased memory. Reads the HLO text: an analysis aid, not an API."""
    import re
    from collections import Counter

    ops, fused = Counter(), False
    for line in compiled.as_text().splitlines():
        if head := re.match(r"(?:ENTRY )?%?([\w.-]+) .*\{$", line):  # a computation begins
            fused = "fused" in head.group(1) or head.group(1).startswith("wrapped")
        elif not fused and (m := re.match(r"\s*(?:ROOT )?%?[\w.-]+ = .*? ([a-z][\w-]*)\(", line)):
            ops[m.group(1)] += 1
    mem = compiled.memory_analysis()
    mib = lambda n: f"{n / 2**20:.1f}"
    return (
        ", ".join(f"{k} {ops[k] + ops[k + '-start']}" for k in HLO_OPS)
        + f"; temp {mib(mem.temp_size_in_bytes)} MiB, aliased {mib(mem.alias_size_in_bytes)} MiB"
    )


def zoo_table(rows: list[dict]) -> str:
    """The docs' table of a ``--zoo`` CSV: per model and stage, median (range) over
    invocations of jaxzero's step over the faster plain-jit step and over GSPMD, the
    target, and what donating costs plain jit and jaxzero (donating / not)."""
    span = lambda v: f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})"
    jit = lambda r: min(r["jit_donate_ms"], r["jit_no_donate_ms"])
    out = [
        "| model | stage | jaxzero ms | vs plain jit | vs GSPMD | target | "
        "plain jit donating / not | jaxzero donating / not |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    misses = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for stage in sorted({r["stage"] for r in rows if r["model"] == model}):
            rs = [r for r in rows if r["model"] == model and r["stage"] == stage]
            vs_jit = [r["jaxzero_ms"] / jit(r) for r in rs]
            bar = target(model, stage)
            met = statistics.median(vs_jit) <= bar
            if not met:
                misses.append(f"{model} stage {stage}")

            def donating(r):  # the donating step over the other, whichever is the default
                if not r.get("jaxzero_other_donation_ms"):
                    return float("nan")
                ratio = r["jaxzero_ms"] / r["jaxzero_other_donation_ms"]
                return ratio if r.get("jaxzero_donates", 1) else 1 / ratio

            out.append(
                f"| {model} | {stage} | {statistics.median(r['jaxzero_ms'] for r in rs):.1f} | "
                f"{span(vs_jit)} | {span([r['jaxzero_ms'] / r['gspmd_ms'] for r in rs])} | "
                f"{bar:.2f} {'met' if met else '**missed**'} | "
                f"{span([r['jit_donate_ms'] / r['jit_no_donate_ms'] for r in rs])} | "
                f"{span([donating(r) for r in rs])} |"
            )
    out.append("")
    out.append("targets: " + ("all met" if not misses else "MISSED: " + ", ".join(misses)))
    return "\n".join(out)


def run_zoo(args) -> int:
    """Every model in its own process (its own device count), ``--invocations`` times,
    models interleaved so that a slow spell of the machine hits them all."""
    import subprocess
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.invocations):
            for model in args.models or list(zoo.DEFAULTS):
                csv = pathlib.Path(tmp) / f"{model}-{i}.csv"
                cmd = [
                    sys.executable,
                    "-m",
                    "experiments.bench_step",
                    "--model",
                    model,
                    "--csv",
                    str(csv),
                ]
                cmd += ["--both-donations", "--stages", *map(str, args.stages), *args.forward]
                print(f"\n== {model}: invocation {i + 1} of {args.invocations}", flush=True)
                subprocess.run(cmd, check=True, cwd=HERE.parent)
                rows += [r | {"invocation": i + 1} for r in read_csv(csv)]
    path = args.csv or HERE / "results" / "bench_step_zoo.csv"
    write_csv(path, rows)
    print(f"\n{path}:\n{zoo_table(rows)}")
    return 0


def check_losses(losses: dict[str, float], reference: str, rtol: float) -> None:
    """Every contestant's first-step loss is the reference's, or nothing is timed: all start
    from the same init and batch, so a contestant that differs is not the same model."""
    want = losses[reference]
    off = {k: v for k, v in losses.items() if not abs(v - want) <= rtol * abs(want)}
    if off:
        raise SystemExit(
            f"first-step losses differ from {reference}'s {want!r} by more than rtol {rtol}: "
            f"{off}; a contestant is not training the same model, so timing it means nothing"
        )


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(zoo.DEFAULTS), default="gpt")
    p.add_argument("--zoo", action="store_true", help="every model, each in its own process")
    p.add_argument("--models", nargs="+", choices=sorted(zoo.DEFAULTS), help="--zoo: these only")
    p.add_argument("--invocations", type=int, default=3, help="--zoo: processes per model")
    p.add_argument("--devices", type=int)
    p.add_argument(
        "--simulate",
        type=int,
        default=None,
        help="simulated CPU devices (default: --devices when no accelerator)",
    )
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    for name in ("d-model", "layers", "heads", "seq-len", "vocab", "batch"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--kv-heads", type=int, help="llama: key/value heads (GQA)")
    p.add_argument(
        "--intermediate",
        type=int,
        help="llama: SwiGLU width (default: 8/3 x d_model, a multiple of 32)",
    )
    p.add_argument("--steps", type=int, help="timed steps per run (after 2 warm-up)")
    p.add_argument("--runs", type=int, default=1, help="timing passes (compiled once)")
    p.add_argument("--remat", default="none")
    p.add_argument(
        "--bucket-mb", type=float, help="Engine(bucket_mb=...) (default: the backend's choice)"
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="dense bf16 peak of one device, for MFU (H100/H200: 989)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="one step of plain jit and each jaxzero stage, their losses compared; no timing",
    )
    p.add_argument(
        "--hlo", action="store_true", help="print what each compiled step is made of; no timing"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="kernel time by kind of each contestant's step (jax.profiler, --runs rounds of "
        "--steps); no timing",
    )
    p.add_argument("--csv", type=pathlib.Path, help="write per-run medians here")
    p.add_argument("--table", type=pathlib.Path, help="print README's table of a --csv file")
    p.add_argument(
        "--both-donations",
        action="store_true",
        help="also time jaxzero with the other donation setting",
    )
    args = p.parse_args(argv)
    # what --zoo forwards to every model (tests shrink the zoo this way)
    args.forward = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("devices", "d_model", "layers", "heads", "seq_len", "vocab", "batch", "steps")
        if getattr(args, k) is not None
    ]
    for k, v in zoo.DEFAULTS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.model == "llama" and args.intermediate is None:
        from jaxzero.models import llama_ff

        args.intermediate = llama_ff(args.d_model)
    if args.model != "llama" and (args.kv_heads is not None or args.intermediate is not None):
        p.error("--kv-heads and --intermediate are for --model llama")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table:
        rows = read_csv(args.table)
        print(zoo_table(rows) if "invocation" in rows[0] else readme_table(args.table))
        return 0
    if args.zoo:
        return run_zoo(args)
    from jaxzero.mesh import accelerator_expected, simulate_devices

    if args.simulate or not accelerator_expected():
        simulate_devices(args.simulate or args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxzero
    from jaxzero.partition import pad, unpad

    tx = optax.adamw(1e-4)
    mesh = jaxzero.make_mesh(args.devices)
    cdt = jnp.bfloat16 if args.precision == "bf16" else jnp.float32
    built = zoo.build(args, mesh, tx)
    loss_fn, init_fn, new_engine = built.loss_fn, built.init_fn, built.new_engine
    key = jax.random.key(0)
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(init_fn, key)))
    tokens_per_step = args.batch * args.seq_len
    batch = built.batch

    def plain_jit(donate: bool, explicit: bool = False):
        """The data-parallel step without jaxzero: replicated state, sharded batch.

        ``explicit``: the gradients by a hand-written ``shard_map`` with ``pmean`` instead,
        as a user first writes it (no dot barrier).
        """
        rep = NamedSharding(mesh, P())

        def grads(params, b):
            if not explicit:
                return jax.value_and_grad(loss_fn)(params, b)
            local = lambda p, b: jax.lax.pmean(jax.value_and_grad(loss_fn)(p, b), mesh.axis_names)
            return jax.shard_map(
                local, mesh=mesh, in_specs=(P(), P(mesh.axis_names)), out_specs=P(), check_vma=False
            )(params, b)

        def step(state, b):  # state: (params, fp32 master params or None, optimizer state)
            params, master, opt = state
            master = params if master is None else master
            loss, g = grads(params, b)
            g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
            u, opt = tx.update(g, opt, master)
            master = optax.apply_updates(master, u)
            if cdt == jnp.float32:
                return (master, None, opt), {"loss": loss}
            return (jax.tree.map(lambda x: x.astype(cdt), master), master, opt), {"loss": loss}

        master = jax.jit(init_fn, out_shardings=rep)(key)
        state = (
            (master, None, tx.init(master))
            if cdt == jnp.float32
            else (jax.tree.map(lambda x: x.astype(cdt), master), master, tx.init(master))
        )
        return jax.jit(step, donate_argnums=0 if donate else ()), state

    def gspmd_step_for(engine):
        """The same update on the same stored state, partitioned by XLA, donating as
        ``engine`` does."""
        lays, stage = engine.layouts, engine.stage

        def step(state, b):
            params = state.params
            if stage == 3:
                params = jax.tree.map(lambda x, lay: unpad(x, lay), params, lays)
            loss, grads = jax.value_and_grad(loss_fn)(params, b)
            if stage >= 1:
                grads = jax.tree.map(lambda g, lay: pad(g, lay), grads, lays)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            master = (
                state.master
                if engine.mixed
                else (
                    jax.tree.map(lambda x, lay: pad(x, lay), state.params, lays)
                    if stage in (1, 2)
                    else state.params
                )
            )
            updates, opt = tx.update(grads, state.opt_state, master)
            master = optax.apply_updates(master, updates)
            new_params = jax.tree.map(lambda m: m.astype(cdt), master)
            if stage in (1, 2):
                new_params = jax.tree.map(lambda x, lay: unpad(x, lay), new_params, lays)
            return jaxzero.TrainState(
                state.step + 1, new_params, master if engine.mixed else None, opt
            ), {"loss": loss}

        sh = engine.state_shardings
        return jax.jit(
            step,
            in_shardings=(sh, engine.batch_sharding),
            out_shardings=(sh, None),
            donate_argnums=0 if engine.donate else (),  # as jaxzero's step at this stage
        )

    # (name, step, state, batch); --check: only what the losses are checked against
    dp_batch = jax.device_put(batch, NamedSharding(mesh, P(mesh.axis_names)))
    runs = [
        (f"plain jit, donate={d}", *plain_jit(d), dp_batch)
        for d in ((False,) if args.check else (True, False))
    ]
    if not args.check:
        runs.append(("shard_map pmean", *plain_jit(True, explicit=True), dp_batch))
    engines = {}  # for --hlo
    for stage in args.stages:
        engine = new_engine(stage)
        engines[f"jaxzero {stage}"] = engine
        b = engine.shard_batch(batch)
        runs.append((f"jaxzero {stage}", engine.step, engine.init_from(init_fn, key), b))
        if args.check:
            continue
        if args.both_donations:  # the other setting too, to compare
            other = new_engine(stage, donate=not engine.donate)
            runs.append(
                (
                    f"jaxzero {stage} donate={other.donate}",
                    other.step,
                    other.init_from(init_fn, key),
                    b,
                )
            )
        runs.append((f"GSPMD {stage}", gspmd_step_for(engine), engine.init_from(init_fn, key), b))
    donates = {s: engines[f"jaxzero {s}"].donate for s in args.stages}  # per stage on CPUs
    if args.hlo:
        for name, step, state, b in runs:
            e = engines.get(name)
            compiled = e.compile(state, b) if e else step.lower(state, b).compile()
            print(f"{name}: {hlo_census(compiled)}")
        return 0

    states = [r[2] for r in runs]

    order = np.random.default_rng(1)

    def timed() -> list[float]:
        """Median seconds per step of every contestant, interleaved step by step.

        Each round runs the contestants in a fresh random order: in a fixed order,
        whoever follows a given contestant pays for its after-effects every time
        (identical programs measured 2-4% apart by their place in the order).
        """
        times = [[] for _ in runs]
        for _ in range(args.steps):
            for i in order.permutation(len(runs)):
                _, step, _, b = runs[i]
                t = time.perf_counter()
                states[i], m = step(states[i], b)
                jax.block_until_ready((states[i], m))  # the whole step, not just its loss
                times[i].append(time.perf_counter() - t)
        return [statistics.median(t) for t in times]

    first_losses = {}
    for _ in range(1 if args.check else 2):  # compile and warm up
        for i, (name, step, _, b) in enumerate(runs):
            states[i], m = step(states[i], b)
            first_losses.setdefault(name, float(m["loss"]))
    check_losses(
        first_losses, "plain jit, donate=False", 2e-2 if args.precision == "bf16" else 1e-4
    )
    if args.check:
        print(f"{args.model}: first-step losses agree: {first_losses}")
        return 0
    if args.profile:

        def one_step(i: int):
            def run() -> None:
                _, step, _, b = runs[i]
                states[i], m = step(states[i], b)
                jax.block_until_ready((states[i], m))

            return run

        steps = {name: one_step(i) for i, (name, *_) in enumerate(runs)}
        kernels, walls = step_profile.profile(steps, args.steps, args.runs, args.devices)
        print(
            f"{args.model}, {args.devices} {jax.default_backend()} device(s): kernel ms per "
            f"device per step by kind, {args.runs} round(s) of {args.steps} steps under "
            f"jax.profiler (step ms: wall, profiler included)"
        )
        print(step_profile.table(kernels, walls))
        return 0

    shape = (
        f" ({args.heads} heads, {args.kv_heads} kv, intermediate {args.intermediate})"
        if args.model == "llama"
        else ""
    )
    print(
        f"{args.model}: {n_params / 1e6:.1f}M params{shape}, {args.devices} "
        f"{jax.default_backend()} device(s), {args.precision}, "
        f"global batch {args.batch} x {args.seq_len} tokens, "
        f"median of {args.steps} steps, jaxzero donates at stages "
        f"{[s for s, d in donates.items() if d]}"
    )
    fastest_jit = lambda m: min(m["plain jit, donate=True"], m["plain jit, donate=False"])
    per_run = []
    for r in range(args.runs):
        med = dict(zip([name for name, *_ in runs], timed(), strict=True))
        per_run.append(med)
        jit = fastest_jit(med)
        print(
            f"run {r + 1}: plain jit {med['plain jit, donate=True'] * 1e3:.1f} ms donating, "
            f"{med['plain jit, donate=False'] * 1e3:.1f} ms not; shard_map pmean "
            f"{med['shard_map pmean'] / jit:.3f}x jit; "
            + ", ".join(
                f"stage {s} {med[f'jaxzero {s}'] / jit:.3f}x jit "
                f"{med[f'jaxzero {s}'] / med[f'GSPMD {s}']:.3f}x GSPMD"
                for s in args.stages
            )
        )

    def spread(values: list[float]) -> str:
        mid = statistics.median(values)
        return f"{mid:.3f}" + (f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else "")

    by_hand = [m["shard_map pmean"] / fastest_jit(m) for m in per_run]
    print(f"\na hand-written shard_map + pmean step (no jaxzero): {spread(by_hand)}x plain jit")
    print(
        f"\n{'stage':>5} {'jaxzero ms':>11} {'GSPMD ms':>9} {'vs jit':>19} {'vs GSPMD':>19} "
        f"{'vs shard_map':>19} {'tokens/s':>9} {'MFU %':>6}"
    )
    rows, misses = [], []
    for s in args.stages:
        zero = [m[f"jaxzero {s}"] for m in per_run]
        vs_jit = [m[f"jaxzero {s}"] / fastest_jit(m) for m in per_run]
        vs_gspmd = [m[f"jaxzero {s}"] / m[f"GSPMD {s}"] for m in per_run]
        vs_sm = [m[f"jaxzero {s}"] / m["shard_map pmean"] for m in per_run]
        t = statistics.median(zero)
        mfu = f"{'n/a':>6}"
        if built.flops_per_step is not None and jax.default_backend() == "gpu":
            peak = args.peak_tflops * 1e12 * args.devices
            mfu = f"{built.flops_per_step / t / peak * 100:>6.2f}"
        base = statistics.median(m[f"GSPMD {s}"] for m in per_run)
        tok_s = "n/a" if built.flops_per_step is None else f"{tokens_per_step / t:.0f}"  # LMs
        print(
            f"{s:>5} {t * 1e3:>11.1f} {base * 1e3:>9.1f} {spread(vs_jit):>19} "
            f"{spread(vs_gspmd):>19} {spread(vs_sm):>19} {tok_s:>9} {mfu}"
        )
        if statistics.median(vs_jit) > target(args.model, s):
            misses.append(
                f"stage {s} is {statistics.median(vs_jit):.3f}x jit > {target(args.model, s)}"
            )
        for r, m in enumerate(per_run):
            rows.append(
                {
                    "model": args.model,
                    "run": r + 1,
                    "stage": s,
                    "jaxzero_ms": m[f"jaxzero {s}"] * 1e3,
                    "gspmd_ms": m[f"GSPMD {s}"] * 1e3,
                    "jit_donate_ms": m["plain jit, donate=True"] * 1e3,
                    "jit_no_donate_ms": m["plain jit, donate=False"] * 1e3,
                    "shard_map_ms": m["shard_map pmean"] * 1e3,
                }
                | (
                    {
                        "jaxzero_other_donation_ms": m[f"jaxzero {s} donate={not donates[s]}"]
                        * 1e3,
                        "jaxzero_donates": int(donates[s]),
                    }
                    if args.both_donations
                    else {}
                )
            )

    def donating_over_not(m: dict, s: int) -> float:
        default, other = m[f"jaxzero {s}"], m[f"jaxzero {s} donate={not donates[s]}"]
        return default / other if donates[s] else other / default

    if args.both_donations:
        print(
            "jaxzero's donating step / its non-donating one, median (range) over runs: "
            + ", ".join(
                f"stage {s} " + spread([donating_over_not(m, s) for m in per_run])
                for s in args.stages
            )
        )
    print("targets: " + ("all met" if not misses else "MISSED: " + "; ".join(misses)))
    if args.csv:
        write_csv(
            args.csv,
            [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
