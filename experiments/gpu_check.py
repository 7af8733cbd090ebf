"""The prepared GPU check: a ~1B Llama's MFU and peak, offload's cost, ZeRO++'s quantize cost.

One command for a session lent one H100/H200 (docs/dev/gpu-check.md); every figure it
prints is measured on that device, each in its own process with a timeout, so that an
out-of-memory in one leaves the others standing:

(a) ``mfu``: a ~1.1B Llama (TinyLlama's shape: d 2048, SwiGLU 5632, 22 layers, 32 heads,
    4 KV heads, V 32000, s 2048), bf16, remat dots, at stages 0 and 3: step time, tokens/s,
    MFU, and the planner's predicted peak (the compiled step's ``memory_analysis``, read
    by :func:`jaxzero.accounting.planner.measure` as ``jaxzero plan`` reads it) beside
    ``memory_stats()["peak_bytes_in_use"]``.
(b) ``offload``: a Llama sized from the device's memory so that its 16 bytes a param
    (bf16 params and gradients, fp32 master and Adam moments) exceed it, trained with
    ``offload="optimizer"`` (12Ψ in pinned host memory); beside it a smaller model of the
    same width without offload (the big one cannot run without), compared per param.
    Where the host cannot hold 12Ψ, the device is capped (``XLA_PYTHON_CLIENT_MEM_FRACTION``)
    to the size the host can back, and the row says so.
(c) ``zeropp``: qwZ and qgZ int8 vs none at stage 3 on this one device, in one
    process taking turns: the collectives are local, so this is the quantize/dequantize cost.

Everything is time-boxed (``--budget-s``, default 420 s): a measurement whose estimate
does not fit in what is left is skipped, and the row says so. Rows go to
experiments/results/gpu_check.csv as each finishes; a summary ends the output.

    python -m experiments.gpu_check               # one H100/H200: at most ~8 minutes
    python -m experiments.gpu_check --tiny        # the same code paths on CPU: under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
GiB = 2**30
MEM_FRACTION = 0.95  # of the device's memory that XLA may use (children's default)

# (a): TinyLlama-1.1B's shape
LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    seq_len=2048,
)
# (b): Llama 2 7B's width, the depth sized from the device's memory
WIDE = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_attention_heads=32,
    num_key_value_heads=8,
    seq_len=2048,
)
# (c): a 156M Llama: its three compiles must fit the budget
MEDIUM = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    seq_len=2048,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    seq_len=32,
)
ZEROPP = {"none": {}, "qwZ": {"qwz": True}, "qgZ-int8": {"qgz": "int8"}}
# --tiny: the device's and the host's bytes the sizing rules see (CPU keeps no
# memory_stats), small enough that (b)'s host cap applies, as it does on an H200
TINY_DEVICE = 36 * 2**20  # the device's memory: bytes_limit is XLA's fraction of it
TINY_HOST = 48 * 2**20
PINNED_POOL = 64 * GiB  # XLA:GPU's pinned host allocations, at most (docs/offload.md)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (the smoke run)")
    p.add_argument("--budget-s", type=float, default=420.0, help="time box for all of it")
    p.add_argument(
        "--only", nargs="+", choices=["mfu", "offload", "zeropp"], help="run these checks only"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (GPU 5, tiny 2)")
    p.add_argument("--csv", type=pathlib.Path, default=HERE / "results" / "gpu_check.csv")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a JSON spec: run it in this process
    return p.parse_args(argv)


# ------------------------------------------------------------------ in the child


def _start(tiny: bool):
    """JAX, started: one CPU device with --tiny, else the local accelerator."""
    if tiny:
        from jaxzero.mesh import simulate_devices

        simulate_devices(1)
    import jax

    return jax


def _device_memory(jax, tiny: bool) -> tuple[int | None, int | None]:
    """``(bytes_limit, peak_bytes_in_use)`` of device 0. A backend that keeps no
    statistics (CPU) has no peak, and a limit only with ``--tiny``: XLA's
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the nominal :data:`TINY_DEVICE`, as a GPU's is
    of its memory, for the sizing rules and the batch check to see."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit", int(_fraction() * TINY_DEVICE) if tiny else None)
    return limit, stats.get("peak_bytes_in_use")


def _llama(shape: dict, **extra):
    from jaxzero.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(**shape, **extra))


def _batch_shapes(jax, rows: int, seq: int) -> dict:
    import numpy as np

    return {k: jax.ShapeDtypeStruct((rows, seq), np.int32) for k in ("inputs", "targets")}


def _data(engine, vocab: int, rows: int, seq: int) -> dict:
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, vocab, (rows, seq + 1)).astype(np.int32)
    return engine.shard_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})


def _timed(jax, compiled, state, data, warmup: int, steps: int):
    """Run the compiled step ``warmup`` then ``steps`` times; the median timed step."""
    import statistics

    times, metrics = [], None
    for i in range(warmup + steps):
        t = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times), float(metrics["loss"]), state


class _Compiled:
    """An engine whose ``compile`` returns the program already compiled, so that the
    planner's own :func:`~jaxzero.accounting.planner.measure` reads the step that runs
    (one compile, not two)."""

    def __init__(self, engine, compiled):
        self.mesh, self._compiled = engine.mesh, compiled

    def compile(self, state, batch):
        return self._compiled


def _hardware(jax):
    from jaxzero.accounting.planner import HARDWARE

    kind = jax.devices()[0].device_kind.lower()
    for key in ("h200", "h100", "a100"):
        if key in kind:
            return HARDWARE[key]
    return HARDWARE["cpu"]


def _fit_batch(jax, engine, state_shapes, rows: int, seq: int, limit: int | None):
    """Compile at ``rows``; while the compiled peak exceeds ``limit``, halve the rows."""
    from jaxzero.accounting.measure import compiled_memory

    while True:
        compiled = engine.compile(state_shapes, _batch_shapes(jax, rows, seq))
        if limit is None or rows == 1 or compiled_memory(compiled).device_peak <= limit:
            return rows, compiled
        rows //= 2


def _host_built(jax, state_shapes):
    """A state of ``state_shapes`` built leaf by leaf straight into each leaf's memory
    (host or device): the engine's init computes every leaf on the device before moving
    the offloaded ones out (docs/offload.md), which a model whose states exceed the device
    cannot afford. Constant weights and zero moments: a step costs what it costs with any."""
    import numpy as np

    def leaf(s):
        value = 0.02 if np.issubdtype(s.dtype, np.floating) else 0
        return jax.device_put(np.full(s.shape, value, s.dtype), s.sharding)

    return jax.tree.map(leaf, state_shapes)


def _train(spec: dict, shape: dict, stage: int, offload: bool) -> dict:
    """(a) and (b)'s measurement: a Llama of ``shape`` at ``stage`` (with offload or
    not) compiled at the largest batch up to ``spec["batch"]`` whose peak fits the device,
    read by the planner, then trained: the median step and the allocator's peak."""
    jax = _start(spec["tiny"])
    import optax

    import jaxzero
    from jaxzero.accounting import planner

    model = _llama(shape, remat=spec["remat"])
    engine = model.engine(
        optax.adamw(1e-4, weight_decay=0.1),
        mesh=jaxzero.make_mesh(1),
        stage=stage,
        precision="bf16",
        donate=True,  # as on accelerators (the CPU default donates at stage 3 only)
        offload="optimizer" if offload else None,
    )
    limit, _ = _device_memory(jax, spec["tiny"])
    key = jax.random.key(0)
    shapes = jax.eval_shape(model.init, key)
    state_shapes = engine.abstract_state(shapes)
    seq = shape["seq_len"]
    rows, compiled = _fit_batch(jax, engine, state_shapes, spec["batch"], seq, limit)
    n_params = model.num_params(shapes)
    per_token = model.flops_per_token(n_params)
    hw = _hardware(jax)
    built = planner.Built(
        _Compiled(engine, compiled),
        state_shapes,
        _batch_shapes(jax, rows, seq),
        per_token * rows * seq,
    )
    candidate = planner.Candidate(stage, spec["remat"], 1, rows, offload=offload)
    planned = planner.measure(built, candidate, hw, 1)
    state = _host_built(jax, state_shapes) if offload else engine.init_from(model.init, key)
    data = _data(engine, shape["vocab_size"], rows, seq)
    seconds, loss, state = _timed(jax, compiled, state, data, spec["warmup"], spec["steps"])
    _, peak = _device_memory(jax, spec["tiny"])
    tokens_per_s = rows * seq / seconds
    return {
        "params": n_params,
        "stage": stage,
        "remat": spec["remat"],
        "offload": offload,
        "batch": rows,
        "seq_len": seq,
        "step_ms": round(seconds * 1e3, 1),
        "tokens_per_s": round(tokens_per_s),
        "mfu_pct": round(tokens_per_s * per_token / hw.flops * 100, 2),
        "peak_flops": hw.flops,
        "predicted_peak_bytes": planned.peak,  # the planner's: the device's part
        "peak_bytes_in_use": peak if peak is not None else "",
        "peak_ratio": round(peak / planned.peak, 3) if peak else "",
        "predicted_step_ms": round(planned.predicted_s * 1e3, 1),
        "persistent_bytes": planned.persistent,  # on the device
        "host_bytes": planned.host_moved,  # offload: in host memory, moved both ways a step
        "predicted_host_ms": round(planned.host_s * 1e3, 1),
        "bytes_limit": limit if limit is not None else "",
        "loss": round(loss, 3),
    }


def run_mfu(spec: dict) -> list[dict]:
    """(a): MFU and the planner's predicted peak beside the allocator's peak."""
    return [_train(spec, spec["shape"], spec["stage"], offload=False)]


def run_offload(spec: dict) -> list[dict]:
    """(b): one model, with or without offload (stage 1: one device, nothing gathered);
    the step time per param."""
    row = _train(spec, dict(spec["shape"], num_hidden_layers=spec["layers"]), 1, spec["offload"])
    row["layers"] = spec["layers"]
    row["ms_per_Bparams"] = round(row["step_ms"] / (row["params"] / 1e9), 2)
    row["model_states_16psi_bytes"] = 16 * row["params"]
    return [row]


def run_zeropp(spec: dict) -> list[dict]:
    """(c): each option compiled, then all taking turns a step at a time."""
    import re
    import statistics

    jax = _start(spec["tiny"])
    import optax

    import jaxzero

    model = _llama(spec["shape"], remat="dots")
    key = jax.random.key(0)
    seq, rows = spec["shape"]["seq_len"], spec["batch"]
    runs = {}
    for name in spec["options"]:
        engine = model.engine(
            optax.adamw(1e-4),
            mesh=jaxzero.make_mesh(1),
            stage=3,
            precision="bf16",
            quant_block=spec["quant_block"],
            **ZEROPP[name],
        )
        state = engine.init_from(model.init, key)
        t = time.perf_counter()
        compiled = engine.compile(state, _batch_shapes(jax, rows, seq))
        runs[name] = {
            "step": compiled,
            "state": state,
            "data": _data(engine, spec["shape"]["vocab_size"], rows, seq),
            "times": [],
            "compile_s": round(time.perf_counter() - t, 1),
            "int8_ops_in_hlo": len(re.findall(r"\b[su]8\[", compiled.as_text())),
        }
    names = list(runs)
    for i in range(1 + spec["steps"]):  # one untimed round, then turns, order rotated
        for name in names[i % len(names) :] + names[: i % len(names)]:
            r = runs[name]
            t = time.perf_counter()
            r["state"], metrics = r["step"](r["state"], r["data"])
            jax.block_until_ready(metrics)
            if i:
                r["times"].append(time.perf_counter() - t)
            r["loss"] = float(metrics["loss"])
    median = {name: statistics.median(r["times"]) for name, r in runs.items()}
    psi = model.num_params(jax.eval_shape(model.init, key))
    return [
        {
            "option": name,
            "params": psi,
            "stage": 3,
            "batch": rows,
            "seq_len": seq,
            "step_ms": round(median[name] * 1e3, 1),
            "step_ratio": round(median[name] / median.get("none", float("nan")), 3),
            "int8_ops_in_hlo": r["int8_ops_in_hlo"],
            "compile_s": r["compile_s"],
            "loss": round(r["loss"], 3),
        }
        for name, r in runs.items()
    ]


def probe(spec: dict) -> list[dict]:
    """The device, its memory limit and its memory kinds (pinned host for offload)."""
    jax = _start(spec["tiny"])
    limit, _ = _device_memory(jax, spec["tiny"])
    d = jax.devices()[0]
    return [
        {
            "device_kind": d.device_kind,
            "backend": jax.default_backend(),
            "devices": jax.device_count(),
            "bytes_limit": limit if limit is not None else "",
            "memory_kinds": " ".join(sorted(m.kind for m in d.addressable_memories())),
        }
    ]


KINDS = {"probe": probe, "mfu": run_mfu, "offload": run_offload, "zeropp": run_zeropp}


# ------------------------------------------------------------------ in the parent


def llama_params(shape: dict, layers: int) -> int:
    """Ψ of a Llama of ``shape`` with ``layers`` layers (untied embeddings, no biases)."""
    d, ff, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head = d // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d
    return layers * per_layer + 2 * v * d + d


def layers_for(shape: dict, psi: float) -> int:
    """The depth whose Ψ is nearest ``psi`` (at least 1)."""
    one, two = llama_params(shape, 1), llama_params(shape, 2)
    return max(1, round((psi - (one - (two - one))) / (two - one)))


def size_offload(device: float, host: float, shape: dict, pool: float = PINNED_POOL) -> dict:
    """(b)'s two models from the device's and the host's bytes.

    The big one: 16Ψ = 1.15x the device (its states would not fit), unless its 12Ψ of
    host state exceed 40% of the host's available memory or 80% of XLA:GPU's pinned
    host pool (``pool``): then Ψ is what the host can back, and the device is capped to
    16Ψ / 1.15 (the offloaded model still could not run without offload). The small one:
    16Ψ = 40% of the (capped) device, the rest for activations; both of one width.
    """
    psi = 1.15 * device / 16
    psi_host = min(0.4 * host, 0.8 * pool) / 12
    capped = psi > psi_host
    if capped:
        psi, device = psi_host, psi_host * 16 / 1.15
    big, small = layers_for(shape, psi), layers_for(shape, 0.4 * device / 16)
    return {"big_layers": big, "small_layers": small, "device": device, "capped": capped}


def _fraction() -> float:
    """The share of the device's memory XLA may use in the children."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION))


def _child(spec: dict, timeout: float, env_extra: dict | None = None):
    """Run ``spec`` in a fresh process; ``(rows, status, why, seconds)``."""
    env = {**os.environ, **(env_extra or {})}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(MEM_FRACTION))
    cmd = [sys.executable, "-m", "experiments.gpu_check", "--one", json.dumps(spec)]
    t = time.time()
    try:
        out = subprocess.run(
            cmd, cwd=HERE.parent, capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return [], "timeout", f"killed after {timeout:.0f} s", time.time() - t
    took = time.time() - t
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode or line is None:
        tail = (out.stderr or out.stdout).strip().splitlines()
        why = next(
            (ln for ln in reversed(tail) if "Error" in ln or "error" in ln),
            tail[-1] if tail else "",
        )
        oom = "RESOURCE_EXHAUSTED" in out.stderr or "out of memory" in out.stderr.lower()
        return [], "oom" if oom else "failed", f"exit {out.returncode}: {why[:300]}", took
    return json.loads(line[len("RESULT ") :]), "ok", "", took


def plan(args, device: float | None, host: float) -> list[tuple[str, str, dict, float, dict]]:
    """The checks in order, ``(check, name, spec, estimated seconds, env)``: (a), (b) (the
    model without offload first: the one with it is compared per param), (c)."""
    from jaxzero.accounting.estimate import format_bytes

    tiny = args.tiny
    steps = args.steps or (2 if tiny else 5)
    base = {"tiny": tiny, "steps": steps}
    items = []
    a_shape = TINY if tiny else LLAMA_1B
    for stage in (0, 3):
        spec = base | {"kind": "mfu", "shape": a_shape, "stage": stage, "remat": "dots"}
        spec["warmup"] = 2
        spec["batch"] = 2 if tiny else 16
        name = f"{'tiny' if tiny else '1.1B'} llama, stage {stage}"
        items.append(("mfu", name, spec, 10 if tiny else 70, {}))
    b_shape = {k: v for k, v in (TINY if tiny else WIDE).items() if k != "num_hidden_layers"}
    sizes = size_offload(device or 16 * GiB, host, b_shape)  # CPU: 16 GiB, nominal
    env = {}
    if sizes["capped"] and device:  # the fraction XLA's bytes_limit is of the memory, scaled
        fraction = _fraction() * sizes["device"] / device
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.3f}"
    for offload, layers, est in (
        (False, sizes["small_layers"], 10 if tiny else 60),
        (True, sizes["big_layers"], 10 if tiny else 110),
    ):
        spec = base | {"kind": "offload", "shape": b_shape, "layers": layers, "offload": offload}
        spec |= {"batch": 2 if tiny else 4, "remat": "dots", "warmup": 1}
        name = f"{'offload' if offload else 'no offload'}, {layers} layers"
        if sizes["capped"]:
            name += f", device capped to {format_bytes(sizes['device'])} (the host's room)"
        items.append(("offload", name, spec, est, env))
    c_shape = TINY if tiny else MEDIUM
    spec = base | {"kind": "zeropp", "shape": c_shape, "options": list(ZEROPP)}
    spec |= {"batch": 2 if tiny else 8, "quant_block": 64 if tiny else 2048}
    items.append(("zeropp", "qwZ/qgZ, stage 3, one device", spec, 15 if tiny else 80, {}))
    return [it for it in items if not args.only or it[0] in args.only]


def _bytes(v) -> str:
    from jaxzero.accounting.estimate import format_bytes

    return format_bytes(float(v)) if v not in ("", None) else "n/a"


def summary(rows: list[dict]) -> str:
    """One screen: a line a measurement (GB = 1e9 bytes)."""
    from jaxzero.accounting.estimate import format_count

    lines = ["", "== gpu_check summary (GB = 1e9 bytes) =="]
    for r in rows:
        head = f"{r['check']:>7} | {r['name']}: "
        if r["status"] != "ok":
            lines.append(head + f"{r['status'].upper()} {r['why']}")
        elif r["check"] == "probe":
            lines.append(
                head + f"{r['device_kind']} ({r['backend']}), bytes_limit "
                f"{_bytes(r['bytes_limit'])}, memory kinds {r['memory_kinds']}"
            )
        elif r["check"] == "mfu":
            mfu = f"{r['mfu_pct']}%" if r["backend"] == "gpu" else "n/a (not a GPU)"
            lines.append(
                head + f"Ψ {format_count(r['params'])}, batch {r['batch']}x{r['seq_len']}, "
                f"{r['step_ms']} ms (planner {r['predicted_step_ms']}), {r['tokens_per_s']} "
                f"tok/s, MFU {mfu}; peak planned {_bytes(r['predicted_peak_bytes'])}, "
                f"in use {_bytes(r['peak_bytes_in_use'])}"
            )
        elif r["check"] == "offload":
            ratio = r.get("per_param_ratio")
            lines.append(
                head + f"Ψ {format_count(r['params'])} (16Ψ "
                f"{_bytes(r['model_states_16psi_bytes'])}, device {_bytes(r['bytes_limit'])}), "
                f"{r['step_ms']} ms = {r['ms_per_Bparams']} ms per 1B params"
                + (f" = {ratio}x the one without" if ratio else "")
                + f"; host {_bytes(r['host_bytes'])}, peak planned "
                f"{_bytes(r['predicted_peak_bytes'])}, in use {_bytes(r['peak_bytes_in_use'])}"
            )
        elif r["check"] == "zeropp":
            lines.append(
                head + f"{r['option']}: {r['step_ms']} ms = {r['step_ratio']}x none "
                f"({r['int8_ops_in_hlo']} int8 ops in the HLO)"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.one:  # the child: its rows carry the environment they were measured in
        from experiments.results_io import environment

        spec = json.loads(args.one)
        got = KINDS[spec["kind"]](spec)
        print("RESULT " + json.dumps([r | environment() for r in got]), flush=True)
        return 0
    started = time.time()
    left = lambda: args.budget_s - (time.time() - started)  # noqa: E731
    # this process never starts JAX (the device is the children's): rows that no child
    # measured get the environment the probe's child recorded
    from experiments.results_io import PACKAGES, write_csv
    from jaxzero.train import memguard

    args.csv.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    env: dict = {"recorded": "not measured", **dict.fromkeys(PACKAGES, "")}

    def record(check: str, name: str, got: list[dict], status: str, why: str, took: float):
        for r in got or [env]:
            rows.append({"check": check, "name": name, "status": status, "why": why} | r)
            rows[-1]["seconds"] = round(took, 1)
        write_csv(args.csv, rows)

    got, status, why, took = _child({"kind": "probe", "tiny": args.tiny}, min(120, left()))
    record("probe", "device", got, status, why, took)
    if status != "ok":
        print(summary(rows))
        return 1
    dev = got[0]
    env = {k: v for k, v in dev.items() if k not in ("bytes_limit", "memory_kinds")}
    env["recorded"] = "not measured"
    print(summary(rows[-1:]).splitlines()[-1].strip(), flush=True)
    device = float(dev["bytes_limit"]) if dev["bytes_limit"] != "" else None
    now = memguard.host_memory()
    host = TINY_HOST if args.tiny else float(now.available) if now else 64 * GiB
    for check, name, spec, estimate, env in plan(args, device, host):
        if estimate > left():
            why = f"needs ~{estimate:.0f} s, {max(left(), 0):.0f} s of the budget left"
            record(check, name, [], "skipped", why, 0.0)
            print(f"{check}: {name}: skipped ({why})", flush=True)
            continue
        got, status, why, took = _child(spec, left(), env)
        record(check, name, got, status, why, took)
        print(f"{check}: {name}: {status} in {took:.0f} s {why}".rstrip(), flush=True)
    small = next((r for r in rows if r["check"] == "offload" and r.get("offload") is False), None)
    for r in rows:
        if r["check"] == "offload" and r.get("offload") is True and small and r["status"] == "ok":
            r["per_param_ratio"] = round(r["ms_per_Bparams"] / small["ms_per_Bparams"], 2)
    write_csv(args.csv, rows)
    print(summary(rows))
    print(f"wrote {args.csv} ({time.time() - started:.0f} s)")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
