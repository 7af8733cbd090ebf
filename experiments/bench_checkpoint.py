"""Checkpoint cost: save/restore time, bytes on disk, export, and the step slowdown of an
asynchronous save, for the reference GPT and a ~100M-param GPT at stages 0 and 3.

For each model and stage (fp32, AdamW): two saves measured alone (the first of a
process pays one-time set-up; of the second, ``save()`` returning = the device-to-host
copy, ``wait()`` = on disk), the bytes of the step directory, the step time while a
save is in flight against the normal step time, interleaved round by round (save, time
the steps until it is on disk, then as many steps with no save) so that load from
other processes hits both alike, then two restores into a fresh uninitialised engine
(the first builds the layouts and compiles the state builder) and an export.

Simulated devices share one host, so stage 0 holds N full copies of params, grads and
moments in this process; a case that would take more than half the host's available
memory runs on fewer devices (said, and recorded in the ``devices`` column).

    python -m experiments.bench_checkpoint                     # 8 simulated CPU devices
    python -m experiments.bench_checkpoint --models reference --rounds 10
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from experiments.results_io import write_csv

RESULTS = pathlib.Path(__file__).parent / "results" / "bench_checkpoint.csv"
MEMORY_SHARE = 0.5  # of MemAvailable one case may take: the host is shared
MODELS = {  # name: (GPTConfig kwargs, global batch); the reference is `jaxzero train`'s model
    "reference": (dict(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4), 32),
    "gpt-100m": (dict(vocab_size=256, seq_len=64, d_model=768, n_layers=14, n_heads=12), 8),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--devices",
        type=int,
        default=8,
        help="simulated CPU devices (fewer for a case this host cannot hold)",
    )
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="save/no-save rounds of the slowdown test (default 6; 2 for 100M)",
    )
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: tmp)")
    p.add_argument("--out", default=str(RESULTS), help="CSV path")
    return p.parse_args(argv)


def du(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def mem_available() -> int:
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def footprint(n_params: int, stage: int, n: int) -> int:
    """Bytes the case needs: fp32 params, grads and Adam moments on every device holding
    them (stage 0: all N, simulated in this one process), the save's host copy, slack."""
    copies = n if stage == 0 else 1
    return 16 * n_params * copies + 12 * n_params + (2 << 30)


def pick_devices(n_params: int, stage: int, want: int, batch: int) -> int | None:
    """``want``, or fewer devices when this shared host could not hold the case."""
    budget = MEMORY_SHARE * mem_available()
    for n in range(want, 0, -1):
        if batch % n == 0 and footprint(n_params, stage, n) <= budget:
            return n
    return None


def bench(name: str, stage: int, args: argparse.Namespace, root: pathlib.Path) -> dict | None:
    import jax
    import numpy as np
    import optax

    import jaxzero
    from jaxzero.models.gpt import GPT, GPTConfig
    from jaxzero.train import export as ex

    kwargs, batch_size = MODELS[name]
    model = GPT(GPTConfig(**kwargs))
    n_params = model.num_params(jax.eval_shape(model.init, jax.random.key(0)))
    n = pick_devices(n_params, stage, args.devices, batch_size)
    if n != args.devices:
        print(
            f"# {name} stage {stage}: {args.devices} devices would need "
            f"~{footprint(n_params, stage, args.devices) / 2**30:.1f} GiB of this shared "
            f"host ({mem_available() / 2**30:.1f} GiB available): "
            + (f"measured on {n}" if n else "skipped"),
            flush=True,
        )
        if n is None:
            return None
    mesh = jaxzero.make_mesh(n)
    tx = optax.adamw(1e-4)
    engine = model.engine(tx, mesh=mesh, stage=stage)
    state = engine.init_from(model.init, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch_size, kwargs["seq_len"] + 1)).astype(np.int32)
    batch = engine.shard_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})

    def step(state):
        t = time.perf_counter()
        state, m = engine.step(state, batch)
        jax.block_until_ready(m)
        return state, time.perf_counter() - t

    state, _ = step(state)  # compile
    directory = root / f"{name}-s{stage}"
    ckpt = jaxzero.CheckpointManager(directory, keep_last=1)
    saves = []
    for _ in range(2):  # the first save of a process pays one-time set-up
        state, _ = step(state)
        t = time.perf_counter()
        ckpt.save(engine, state)
        blocking = time.perf_counter() - t
        ckpt.wait()
        saves.append((blocking, time.perf_counter() - t))
    step_dir = directory / str(ckpt.latest_step())
    on_disk = du(step_dir)

    rounds = args.rounds or (2 if n_params > 50e6 else 6)
    during, normal = [], []
    for _ in range(rounds):
        ckpt.save(engine, state)
        k = 0
        while ckpt._manager.is_saving_in_progress():  # the orbax manager underneath
            state, dt = step(state)
            during.append(dt)
            k += 1
        ckpt.wait()
        for _ in range(max(k, 1)):
            state, dt = step(state)
            normal.append(dt)
    step_dir = directory / str(ckpt.latest_step())
    del state  # restore next: never two train states in memory at once

    restores = []
    for _ in range(2):
        fresh = model.engine(tx, mesh=mesh, stage=stage)
        t = time.perf_counter()
        restored, _ = ckpt.restore(fresh)
        jax.block_until_ready(restored)
        restores.append(time.perf_counter() - t)
        del restored, fresh
    ckpt.close()
    t = time.perf_counter()
    info = ex.export_params(step_dir, root / f"{name}-s{stage}.safetensors")
    export_s = time.perf_counter() - t
    shutil.rmtree(directory, ignore_errors=True)
    (root / f"{name}-s{stage}.safetensors").unlink(missing_ok=True)
    t_normal = statistics.median(normal)
    t_during = statistics.median(during) if during else float("nan")
    return {
        "model": name,
        "params_m": round(n_params / 1e6, 2),
        "stage": stage,
        "devices": n,
        "save_first_s": round(saves[0][1], 3),
        "save_blocking_s": round(saves[1][0], 3),
        "save_total_s": round(saves[1][1], 3),
        "disk_mb": round(on_disk / 1e6, 2),
        "restore_cold_s": round(restores[0], 3),
        "restore_s": round(restores[1], 3),
        "export_s": round(export_s, 3),
        "export_mb": round(info["bytes"] / 1e6, 2),
        "step_s": round(t_normal, 4),
        "step_during_save_s": round(t_during, 4),
        "slowdown": round(t_during / t_normal, 3),
        "steps_during_save": len(during),
    }


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from jaxzero.mesh import simulate_devices

    # orbax warns at each save about the time our own wait() spent: not a stall here
    logging.getLogger("absl").setLevel(logging.ERROR)
    simulate_devices(args.devices)
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint-"))
    root.mkdir(parents=True, exist_ok=True)
    cols = [
        "model",
        "params_m",
        "stage",
        "devices",
        "save_first_s",
        "save_blocking_s",
        "save_total_s",
        "disk_mb",
        "restore_cold_s",
        "restore_s",
        "export_s",
        "step_s",
        "step_during_save_s",
        "slowdown",
        "steps_during_save",
    ]
    print(" ".join(f"{c:>{max(len(c), 9)}}" for c in cols), flush=True)
    rows = []
    try:
        for name in args.models:
            for stage in args.stages:
                row = bench(name, stage, args, root)
                if row is not None:
                    rows.append(row)
                    print(" ".join(f"{row[c]!s:>{max(len(c), 9)}}" for c in cols), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
