"""Beyond ZeRO: offload and ZeRO++ (qwZ, qgZ, hpZ), measured per option beside the formulas.

For two models we did not write for this (the Llama family model at a small size, with
grouped-query attention, and the default GPT), bf16 with fp32 AdamW, on 8 simulated CPU
devices (or the local GPUs), each option at each stage where it applies:

    none      stages 1-3
    offload   stages 1-3   Engine(offload="optimizer"): fp32 master + moments in pinned_host
    qwZ       stage 3      Engine(qwz=True): int8 weight all-gathers
    qgZ-int8  stages 1-3   Engine(qgz="int8"): int8 all-to-all gradient reduce-scatter
    qgZ-int4  stages 1-3   Engine(qgz="int4")
    qwZ+qgZ   stage 3      both, int8
    hpZ       stage 3      Engine(hpz=True) on make_mesh(8, replicas=2)

and records, per device:

* the persistent train state by memory kind (``device`` / ``pinned_host``: device 0's
  shards), beside the formulas (bf16 params 2Ψ, replicated at stages 1-2 and / N at
  stage 3; fp32 master 4Ψ/N and Adam moments 8Ψ/N, on the host with offload);
* the compiled step's peak (argument + output + temp - alias). Where XLA's memory
  analysis does not split memory kinds (the CPU backend counts host arguments with the
  device's), ``peak_device_bytes`` is that peak less the host-resident state;
* bytes on the wire per step from the compiled HLO (:mod:`jaxzero.accounting.comm`,
  at the element types the program asked for) beside the formula;
* the step time: the median of a few steps, every option of a (model, stage) run in
  turn in one process, as a ratio to "none" of the same stage.

An option whose flag is accepted but not yet in effect (no quantized collective in the
compiled HLO; hpZ's state sharded as without it) is marked ``in_effect = False``; hpZ is
then skipped with a one-line note.

Writes experiments/results/zero_beyond.{csv,png,md} (the CSV row by row, as each
(model, stage) is measured). The default leaves stage 2 out (at one micro-batch it
holds what stage 1 does and sends it within 0.01%; only its peak is lower, by 0.8-1.1
MB here): 22 compiled steps, about 3.5-4.5 minutes on 2 shared CPU cores.
``--stages 1 2 3`` adds it (8 more); ``--tiny`` is the tests' run (tiny GPT, stage 3,
four options: seconds).

    python -m experiments.zero_beyond
    python -m experiments.zero_beyond --stages 1 2 3
    python -m experiments.zero_beyond --tiny --out /tmp/zb
    python -m experiments.zero_beyond --replot      # the plot and table from the CSV
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

N_DEVICES = 8
REPLICAS = 2  # hpZ's hybrid mesh: 2 groups of 4


def gpus_present() -> bool:
    """A GPU this process may use (seen without starting JAX: the driver's device files)."""
    allowed = os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu")
    return allowed and any(pathlib.Path("/dev").glob("nvidia[0-9]*"))


if not gpus_present():
    from jaxzero.mesh import simulate_devices

    simulate_devices(N_DEVICES)  # before JAX starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxzero  # noqa: E402
from experiments.results_io import read_csv, write_csv  # noqa: E402
from jaxzero import offload as offload_lib  # noqa: E402
from jaxzero.accounting import measure as accounting  # noqa: E402
from jaxzero.accounting.planner import shard_bytes  # noqa: E402
from jaxzero.models.gpt import GPT, GPTConfig  # noqa: E402
from jaxzero.models.llama import Llama, LlamaConfig  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
PRECISION = "bf16"  # offload and ZeRO++ are mixed-precision features: bf16 + fp32 master
PARAM_BYTES = 2  # bf16 working params, gathered and reduced in bf16
MASTER_BYTES = 4  # fp32 master
ADAM_BYTES = 8  # fp32 first and second moments
SCALE_BYTES = 4  # one fp32 scale per quant_block elements (the formula's assumption)

MODELS = {
    "gpt": lambda tiny: GPT(
        GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=1, n_heads=2)
        if tiny
        else GPTConfig()  # the default: V 256, s 128, d 128, L 4
    ),
    "llama": lambda tiny: Llama(
        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            seq_len=16,
        )
        if tiny
        else LlamaConfig(num_key_value_heads=2)  # d 128, SwiGLU 352, L 4, 4 heads, GQA 2
    ),
}

# option -> (Engine keywords, stages where it applies)
OPTIONS = {
    "none": ({}, (1, 2, 3)),
    "offload": ({"offload": "optimizer"}, (1, 2, 3)),
    "qwZ": ({"qwz": True}, (3,)),
    "qgZ-int8": ({"qgz": "int8"}, (1, 2, 3)),
    "qgZ-int4": ({"qgz": "int4"}, (1, 2, 3)),
    "qwZ+qgZ": ({"qwz": True, "qgz": "int8"}, (3,)),
    "hpZ": ({"hpz": True}, (3,)),
}
QGZ_BITS = {"int8": 8, "int4": 4}
# what runs unless --models/--stages/--options say otherwise: at one micro-batch stage 2
# holds what stage 1 does and sends it within 0.01% (its gradients are sharded: only the
# peak differs), so the default leaves it out to stay within ~5 minutes on 2 cores
DEFAULT_RUN = {"models": list(MODELS), "stages": [1, 3], "options": list(OPTIONS)}
TINY_RUN = {"models": ["gpt"], "stages": [3], "options": ["none", "offload", "qwZ", "qgZ-int8"]}


def make_engine(model, option: str, stage: int, quant_block: int):
    kwargs, _ = OPTIONS[option]
    n = min(N_DEVICES, jax.device_count())
    replicas = REPLICAS if kwargs.get("hpz") else 1
    return model.engine(
        optax.adamw(1e-3),
        mesh=jaxzero.make_mesh(n, replicas=replicas),
        stage=stage,
        precision=PRECISION,
        donate=True,  # as on accelerators: the compiled peak of the real program
        quant_block=quant_block,
        **kwargs,
    )


def hpz_check(model, quant_block: int) -> str | None:
    """None when ``Engine(hpz=True)`` shards the master and moments over every device of
    a hybrid mesh (compared without compiling); otherwise the one-line reason to skip."""
    n = min(N_DEVICES, jax.device_count())
    if n % REPLICAS or n < 2 * REPLICAS:
        return f"hpZ: needs {2 * REPLICAS}+ devices for make_mesh(n, replicas={REPLICAS})"
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    try:
        hpz = make_engine(model, "hpZ", 3, quant_block).abstract_state(shapes)
    except Exception as e:  # noqa: BLE001 - any refusal is the note
        return f"hpZ: Engine(hpz=True) refused: {type(e).__name__}: {str(e).splitlines()[0]}"
    plain = model.engine(
        optax.adamw(1e-3),
        mesh=jaxzero.make_mesh(n, replicas=REPLICAS),
        stage=3,
        precision=PRECISION,
    ).abstract_state(shapes)
    if shard_bytes(hpz.opt_state) >= shard_bytes(plain.opt_state):
        return (
            "hpZ: Engine(hpz=True) is accepted but not in effect yet (the moments are "
            "sharded within each group, as without it): skipped"
        )
    return None


def state_by_kind(state) -> dict[str, int]:
    """Device 0's bytes of the state by memory kind: device, host."""
    out = {"device": 0, "host": 0}
    for leaf in jax.tree.leaves(state):
        shards = getattr(leaf, "addressable_shards", None)
        if not shards:
            continue
        out["host" if offload_lib.is_host(leaf.sharding) else "device"] += int(
            shards[0].data.nbytes
        )
    return out


def formulas(option: str, stage: int, psi: int, n: int, quant_block: int) -> dict[str, float]:
    """Per-device bytes by the formulas (Ψ, no padding): persistent state on the device
    and the host, and bytes sent per step (ring: (N-1)/N of each full buffer)."""
    kwargs, _ = OPTIONS[option]
    groups = REPLICAS if kwargs.get("hpz") else 1
    group = n // groups  # devices a param is sharded over
    params = PARAM_BYTES * psi / (group if stage == 3 else 1)
    states = (MASTER_BYTES + ADAM_BYTES) * psi / n  # over every device, hpZ's too
    off = bool(kwargs.get("offload"))
    # communication, one micro-batch
    ring = lambda full, g: full * (g - 1) / g  # noqa: E731
    grad_elem = PARAM_BYTES
    if kwargs.get("qgz"):
        grad_elem = QGZ_BITS[kwargs["qgz"]] / 8 + SCALE_BYTES / quant_block
    gather_elem = 1 + SCALE_BYTES / quant_block if kwargs.get("qwz") else PARAM_BYTES
    if kwargs.get("hpz"):
        # gradients reduce-scattered over every device (primary partition); the updated
        # params gathered from 1/(R N) to the group's 1/N shards across groups; forward and
        # backward gathers within the group (secondary partition)
        wire = (
            ring(psi * grad_elem, n)
            + ring(psi * PARAM_BYTES / group, groups)
            + 2 * ring(psi * gather_elem, group)
        )
    elif stage == 3:
        wire = ring(psi * grad_elem, group) + 2 * ring(psi * gather_elem, group)
    else:
        wire = ring(psi * grad_elem, group) + ring(psi * PARAM_BYTES, group)
    return {
        "device_formula": params + (0 if off else states),
        "host_formula": states if off else 0,
        "wire_formula": wire,
    }


def device_peak(mem, compiled, host_state: int) -> dict:
    """The compiled peak as reported, and the device's part: the accounting's
    ``device_peak`` where it has one; else, when the backend's analysis does not split
    memory kinds (CPU: host arguments counted as ordinary ones), the peak less the
    host-resident state (donated: counted once)."""
    raw = compiled.memory_analysis()
    split = bool(getattr(raw, "host_argument_size_in_bytes", 0))
    if hasattr(mem, "device_peak"):
        device, host = mem.device_peak, mem.host_peak
    elif split or not host_state:
        device = mem.peak
        host = sum(
            int(getattr(raw, f"host_{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "temp")
        ) - int(getattr(raw, "host_alias_size_in_bytes", 0) or 0)
    else:
        device, host = mem.peak - host_state, host_state
    return {
        "peak_bytes": mem.peak,
        "peak_device_bytes": device,
        "peak_host_bytes": host,
        "peak_split": "by XLA" if split else "host state taken out" if host_state else "",
    }


def quantized_collectives(report) -> dict[str, bool]:
    """Which quantized collectives the compiled step has (int8/int4 buffers)."""
    narrow = ("s8", "u8", "s4", "u4")

    def has(kind: str) -> bool:
        return any(
            c.kind == kind and any(b.dtype in narrow for b in (c.logical_buffers or c.buffers))
            for c in report.collectives
        )

    return {"int_all_gather": has("all-gather"), "int_all_to_all": has("all-to-all")}


def in_effect(option: str, by_kind: dict[str, int], quant: dict[str, bool]) -> bool:
    kwargs, _ = OPTIONS[option]
    ok = True
    if kwargs.get("offload"):
        ok &= by_kind["host"] > 0
    if kwargs.get("qwz"):
        ok &= quant["int_all_gather"]
    if kwargs.get("qgz"):
        ok &= quant["int_all_to_all"]
    return ok


def make_batch(model, rows: int) -> dict:
    rng = np.random.default_rng(0)
    s = model.config.seq_len
    tokens = rng.integers(0, model.config.vocab_size, (rows, s + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def measure(model_name: str, model, option: str, stage: int, batch: dict, quant_block: int):
    """Compile one option and read its bytes; return (row, compiled, engine, state)."""
    engine = make_engine(model, option, stage, quant_block)
    state = engine.init_from(model.init, jax.random.key(0))
    t = time.perf_counter()
    compiled = engine.compile(state, batch)
    compile_s = time.perf_counter() - t
    r = accounting.report(engine, state, batch, compiled=compiled)
    by_kind = state_by_kind(state)
    peak = device_peak(r.compiled, compiled, by_kind["host"])
    psi, n = r.config["num_params"], int(engine.mesh.devices.size)
    quant = quantized_collectives(r)
    tr = r.traffic
    moved = getattr(r, "host_transfers", None)  # the accounting reads them since offload
    row = {
        "model": model_name,
        "params": psi,
        "stage": stage,
        "option": option,
        "devices": n,
        "replicas": r.config["replicas"],
        "precision": PRECISION,
        "quant_block": quant_block,
        "in_effect": in_effect(option, by_kind, quant),
        "device_bytes": by_kind["device"],
        "host_bytes": by_kind["host"],
        "params_bytes": r.persistent["params"],
        "master_bytes": r.persistent["master"],
        "optimizer_bytes": r.persistent["optimizer"],
        **peak,
        "temp_bytes": r.compiled.temp,
        # offload's copies between host and device memory per step, from the HLO
        "to_device_bytes": getattr(moved, "to_device_bytes", ""),
        "to_host_bytes": getattr(moved, "to_host_bytes", ""),
        "wire_bytes": tr.grad_param_logical,
        "wire_bytes_as_compiled": tr.grad_param,
        "wire_inter_bytes": tr.by_scope_logical.get("inter", 0.0),
        **{
            f"{k.replace('-', '_')}_bytes": tr.by_kind_logical.get(k, 0.0)
            for k in ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")
        },
        **quant,
        **formulas(option, stage, psi, n, quant_block),
        # the accounting's leaf-by-leaf count (padding, replicated leaves), where it knows
        # the options (its Theory has ``host`` since offload and ZeRO++ reached it)
        "wire_layouts": r.expected.comm if hasattr(r.theory, "host") else "",
        "compile_s": round(compile_s, 1),
    }
    row["device_ratio"] = round(row["device_bytes"] / row["device_formula"], 4)
    row["wire_ratio"] = round(row["wire_bytes"] / row["wire_formula"], 4)
    return row, compiled, engine, state


def time_steps(runs: dict, batches: dict, rounds: int) -> tuple[dict, dict]:
    """Each option's step times and last loss, the options taking turns (order rotated
    each round), after one untimed step each; the states advance in ``runs``."""
    names = list(runs)
    times: dict[str, list[float]] = {k: [] for k in names}
    losses: dict[str, float] = {}
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            compiled, state = runs[name]
            t = time.perf_counter()
            state, metrics = compiled(state, batches[name])
            jax.block_until_ready((state, metrics))
            if r:
                times[name].append(time.perf_counter() - t)
            runs[name] = (compiled, state)
            losses[name] = float(metrics["loss"])
    return times, losses


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Per model: the persistent state by memory kind, and the bytes sent per step beside
    the formula, a bar per option at each stage (faded: the flag not in effect)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    models = list(dict.fromkeys(r["model"] for r in rows))
    options = [o for o in OPTIONS if any(r["option"] == o for r in rows)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {o: colors[i % len(colors)] for i, o in enumerate(options)}
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.2 * len(models)), squeeze=False)
    for (ax1, ax2), name in zip(axes, models, strict=True):
        mine = [r for r in rows if r["model"] == name]
        stages = sorted({r["stage"] for r in mine})
        width = 0.85 / max(sum(r["stage"] == s for r in mine) for s in stages)
        for s in stages:
            here = sorted(
                (r for r in mine if r["stage"] == s), key=lambda r: options.index(r["option"])
            )
            for i, r in enumerate(here):
                x = s + (i - (len(here) - 1) / 2) * width
                alpha = 1.0 if str(r["in_effect"]) == "True" else 0.35
                dev, host = r["device_bytes"] / 1e6, r["host_bytes"] / 1e6
                ax1.bar(x, dev, width, color=color[r["option"]], alpha=alpha)
                if host:
                    ax1.bar(x, host, width, bottom=dev, color="none", hatch="//", edgecolor="grey")
                ax2.bar(x, r["wire_bytes"] / 1e6, width, color=color[r["option"]], alpha=alpha)
                ax2.plot([x - width / 2, x + width / 2], [r["wire_formula"] / 1e6] * 2, "k-")
        handles = [Patch(color=color[o], label=o) for o in options]
        host = Patch(facecolor="none", hatch="//", edgecolor="grey", label="in pinned_host")
        ax1.legend(handles=[*handles, host], fontsize=7, ncol=2)
        ax2.legend(
            handles=[*handles, plt.Line2D([], [], color="k", label="formula")], fontsize=7, ncol=2
        )
        ax1.set_title(f"{name} (Ψ = {mine[0]['params']:,}): persistent state of device 0")
        ax2.set_title(f"{name}: bytes sent per step, from the compiled HLO")
        for ax in (ax1, ax2):
            ax.set_xticks(stages, [f"stage {s}" for s in stages])
        ax1.set_ylabel("MB per device")
        ax2.set_ylabel("MB per device per step")
    r = rows[0]
    faded = any(str(x["in_effect"]) != "True" for x in rows)
    fig.suptitle(
        f"offload and ZeRO++: bf16, fp32 master and AdamW, {r['devices']} "
        f"{r.get('backend', 'cpu')} devices" + ("; faded: flag not in effect" if faded else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _span(xs: list[float], fmt: str = ".3f") -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}"


def findings(rows: list[dict]) -> list[str]:
    """What the rows show, a line an option over every model and stage: offload's saving
    against the state it moved, each other option's bytes against none's."""
    get = {(r["model"], r["stage"], r["option"]): r for r in rows}
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    for (model, stage, option), r in get.items():
        if option != "none" and (model, stage, "none") in get:
            pairs.setdefault(option, []).append((r, get[model, stage, "none"]))
    out = []
    for option, got in pairs.items():
        steps = _span([float(r["step_ratio"]) for r, _ in got], ".2f")
        if option == "offload":
            saved = [
                (n["device_bytes"] - r["device_bytes"]) / (n["master_bytes"] + n["optimizer_bytes"])
                for r, n in got
            ]
            peak = [
                (n["peak_device_bytes"] - r["peak_device_bytes"]) / r["host_bytes"] for r, n in got
            ]
            same = all(
                (r["peak_bytes"], r["temp_bytes"]) == (n["peak_bytes"], n["temp_bytes"])
                for r, n in got
            )
            out.append(
                f"offload: the device holds less by {_span(saved)}x the fp32 master + moments, "
                f"which the host holds; the compiled peak's device part drops by {_span(peak)}x "
                "them"
                + (
                    " (the reported peak and temp are none's: the drop is the host-resident "
                    "arguments the accounting takes out)"
                    if same
                    else ""
                )
                + f"; step {steps}x none."
            )
            continue
        sent = _span([r["wire_bytes"] / n["wire_bytes"] for r, n in got])
        formula = _span([r["wire_formula"] / n["wire_formula"] for r, n in got])
        line = f"{option}: sends {sent}x none's bytes (formula {formula}x); step {steps}x none"
        if option == "hpZ":
            inter = _span([r["wire_inter_bytes"] / r["wire_bytes"] for r, _ in got])
            held = _span([r["device_bytes"] / n["device_bytes"] for r, n in got])
            line += (
                f"; {inter} of its bytes cross the groups; it holds {held}x none's state "
                "(the working params sharded over a group of 4, not 8)"
            )
        out.append(line + ".")
    wire = _span([r["wire_bytes"] / r["wire_formula"] for r in rows])
    held = _span([float(r["device_ratio"]) for r in rows])
    out.append(
        f"Measured / formula: wire bytes {wire} (below 1 at stage 3: the backward pass "
        f"reuses a few gathered params, as in zero_comm.md); device bytes {held}"
        + (" (above 1: padding, leaves under 64 elements kept whole)." if "-" in held else ".")
    )
    return out


NOTES = [
    "Formulas, per device: params 2Ψ (stages 1-2) or 2Ψ/N (stage 3; hpZ: over the group's "
    "4); master + moments 12Ψ/N, in host memory with offload. Bytes sent per step, ring "
    "(N-1)/N of each full buffer: the gradients Ψb, and one (stages 1-2) or two (stage 3) "
    "param all-gathers Ψb; b = 2 (bf16); qgZ's gradients b = bits/8 + "
    f"{SCALE_BYTES}/quant_block (int8/int4 and a float32 scale a block, one all-to-all); "
    f"qwZ's gathers b = 1 + {SCALE_BYTES}/quant_block; hpZ: the gradients reduced over all "
    "8, the updated params gathered across the 2 groups (Ψb/4 x 1/2), the layer gathers "
    "within a group.",
    "Peak: the CPU backend's memory analysis counts host-resident arguments as ordinary "
    "ones; the accounting takes them out (peak = the device's part). On CPUs the host and "
    "the device are one memory: offload's step time there measures copies within RAM, "
    "not a PCIe link (experiments/gpu_check.py measures that on a GPU).",
    "Step ratios: medians of 8 steps of a few hundred ms on 2 shared CPU cores; runs of "
    "the same code differ by up to ~10% (more on a loaded machine).",
]


def summary(rows: list[dict], notes: list[str]) -> str:
    r0 = rows[0]
    lines = [
        "# Beyond ZeRO: offload and ZeRO++ measured",
        "",
        f"Generated by `{r0['command']}`. bf16 params and gradients, fp32 master and AdamW "
        f"moments; {r0['devices']} {r0.get('backend', 'cpu')} devices (hpZ: "
        f"{REPLICAS} groups). MB = 1e6 bytes, per device. Device / host = device 0's "
        "persistent state by memory kind; peak = the compiled step's (device part); wire = "
        "bytes sent per step, from the compiled HLO; step = median step time / none's at "
        "the same stage, in one process.",
        "",
        "| model | stage | option | in effect | device MB | formula | host MB | formula | "
        "peak MB | wire MB | formula | step vs none |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['stage']} | {r['option']} | "
            f"{'yes' if str(r['in_effect']) == 'True' else 'no'} | "
            f"{r['device_bytes'] / 1e6:.3f} | {r['device_formula'] / 1e6:.3f} | "
            f"{r['host_bytes'] / 1e6:.3f} | {r['host_formula'] / 1e6:.3f} | "
            f"{r['peak_device_bytes'] / 1e6:.2f} | {r['wire_bytes'] / 1e6:.3f} | "
            f"{r['wire_formula'] / 1e6:.3f} | {float(r['step_ratio']):.2f}x |"
        )
    lines += ["", *[f"- {n}" for n in [*findings(rows), *notes, *NOTES]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tiny",
        action="store_true",
        help=f"tiny shapes, 2 timed rounds; by default {' '.join(TINY_RUN['models'])} at stage "
        f"{' '.join(map(str, TINY_RUN['stages']))}, {' '.join(TINY_RUN['options'])}: seconds",
    )
    p.add_argument("--models", nargs="+", choices=list(MODELS))
    p.add_argument("--stages", type=int, nargs="+", help="default 1 3 (stage 2: see DEFAULT_RUN)")
    p.add_argument("--options", nargs="+", choices=list(OPTIONS))
    p.add_argument("--rounds", type=int, default=None, help="timed steps per option")
    p.add_argument("--batch", type=int, default=None, help="global batch (rows)")
    p.add_argument("--quant-block", type=int, default=None)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument("--replot", action="store_true", help="redraw the plot and table from the CSV")
    args = p.parse_args(argv)
    run = TINY_RUN if args.tiny else DEFAULT_RUN
    models = args.models or run["models"]
    stages = args.stages or run["stages"]
    options = args.options or run["options"]
    rounds = args.rounds or (2 if args.tiny else 8)
    rows_per_batch = args.batch or (N_DEVICES if args.tiny else 2 * N_DEVICES)
    quant_block = args.quant_block or (64 if args.tiny else 2048)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "zero_beyond.csv"
    given = [a for a in (sys.argv[1:] if argv is None else argv) if a]
    command = " ".join(["python -m experiments.zero_beyond", *given])
    notes: list[str] = []
    rows = read_csv(csv_path) if args.replot else []
    started = time.time()
    for name in [] if args.replot else models:
        model = MODELS[name](args.tiny)
        hpz_note = hpz_check(model, quant_block) if "hpZ" in options else None
        if hpz_note and 3 in stages:
            print(f"{name}: {hpz_note}", flush=True)
            if hpz_note not in notes:
                notes.append(hpz_note)
        batch = make_batch(model, rows_per_batch)
        for stage in stages:
            group, runs, batches = [], {}, {}
            for option in options:
                if stage not in OPTIONS[option][1] or (option == "hpZ" and hpz_note):
                    continue
                t = time.time()
                row, compiled, engine, state = measure(
                    name, model, option, stage, batch, quant_block
                )
                row["backend"] = jax.default_backend()
                group.append(row)
                runs[option] = (compiled, state)
                batches[option] = engine.shard_batch(batch)
                mb = {
                    k: v / 1e6
                    for k, v in row.items()
                    if isinstance(v, float | int) and k.endswith(("_bytes", "_formula"))
                }
                print(
                    f"{name} stage {stage} {option:>8}: device {mb['device_bytes']:.3f} MB "
                    f"(formula {mb['device_formula']:.3f}), host {mb['host_bytes']:.3f} MB, "
                    f"peak {mb['peak_device_bytes']:.2f} MB, wire {mb['wire_bytes']:.3f} MB "
                    f"(formula {mb['wire_formula']:.3f})"
                    f"{'' if row['in_effect'] else ' [not in effect]'} ({time.time() - t:.0f}s)",
                    flush=True,
                )
            times, losses = time_steps(runs, batches, rounds)
            base = statistics.median(times["none"]) if "none" in times else float("nan")
            for row in group:
                ms = statistics.median(times[row["option"]])
                row["step_ms"] = round(ms * 1e3, 2)
                row["step_ratio"] = round(ms / base, 3)
                row["steps_timed"] = len(times[row["option"]])
                row["loss"] = round(losses[row["option"]], 4)
                row["command"] = command
                print(
                    f"{name} stage {stage} {row['option']:>8}: step {row['step_ms']:.1f} ms, "
                    f"{row['step_ratio']:.2f}x none",
                    flush=True,
                )
            rows += group
            write_csv(csv_path, rows)  # as each (model, stage) is measured
            del runs, batches
    if not rows:
        print("nothing measured")
        return 1
    if "hpZ" in options and not any(r["option"] == "hpZ" for r in rows) and not notes:
        notes.append("hpZ: no rows (skipped when measured: the run printed why)")
    plot(rows, args.out / "zero_beyond.png")
    text = summary(rows, notes)
    (args.out / "zero_beyond.md").write_text(text)
    print("\n".join(ln for ln in text.splitlines() if ln.startswith("- ")))
    print(f"wrote {csv_path}, zero_beyond.png, zero_beyond.md ({time.time() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
