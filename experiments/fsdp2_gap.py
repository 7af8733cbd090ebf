"""Where PyTorch FSDP2's lead on ``user_gpt`` comes from: one rank's step, part by part.

On the same 2-core CPU, FSDP2 (``fsdp2_step.py``) runs the zoo's ``user_gpt`` faster than
plain ``jax.jit`` does before any sharding (docs/dev/performance-log.md). This cuts one rank's
work into parts and times each in JAX (XLA:CPU) and in PyTorch, each process pinned to
ONE core (``taskset``) with one rank's share of the batch, i.e. what each rank of the
2-rank step computes:

* ``dots``: the model's dense matmuls, forward and both backward products
  (``jax.vjp`` / autograd of ``x @ w`` at every projection's shape);
* ``attention``: the hand-written attention's forward and backward, every layer
  (``zoo.user_gpt_attention`` / ``fsdp2_step.hand_attention``);
* ``forward+backward``: the whole model's loss and gradients;
* ``adamw``: the update of the 3.3M params (``optax.adamw`` / ``torch.optim.AdamW``);
* ``step``: forward, backward and update, no communication.

What the 2-rank step takes beyond this one-core ``step`` is what communication and
sharing the machine cost. Before any timing both load the same weights and batch and
must agree on the loss (the two are one model). Run with jaxzero's Python, naming one
that has torch:

    python -m experiments.fsdp2_gap --torch-python /path/to/torch/venv/bin/python

Each framework runs in ``--rounds`` processes, alternating (JAX, PyTorch, JAX, ...),
each timing ``--runs`` passes over the parts (a fresh random order each pass) of
``--steps`` calls; a part's figure is the median over its passes' medians, with range.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).parent.parent  # workers run as python -m experiments.fsdp2_gap

PARTS = ["dots", "attention", "forward+backward", "adamw", "step"]
LR, WEIGHT_DECAY = 1e-4, 1e-4  # bench_step's optax.adamw(1e-4); fsdp2_step's AdamW


def dense_shapes(a) -> list[tuple[int, int]]:
    """(in, out) of every projection of user_gpt, in order."""
    d = a.d_model
    per_layer = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]
    return per_layer * a.layers + [(d, a.vocab)]


def flatten(tree, prefix: str = "") -> dict:
    """A nested dict/list of arrays as {"blocks.0.qkv.w": array}."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out = {}
    for k, v in items:
        name = f"{prefix}{k}"
        out.update(flatten(v, name + ".") if isinstance(v, (dict, list)) else {name: v})
    return out


def time_parts(fns: dict, runs: int, steps: int) -> dict[str, list[float]]:
    """Per part, the median ms of ``steps`` calls in each of ``runs`` passes."""
    for fn in fns.values():  # compile / warm up
        fn()
        fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        order = list(fns)
        random.shuffle(order)
        for name in order:
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                fns[name]()
                times.append(time.perf_counter() - t)
            out[name].append(1e3 * statistics.median(times))
    return out


def jax_worker(a, work: pathlib.Path) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from experiments import zoo

    params = zoo.user_gpt_init(jax.random.key(0), a.vocab, a.seq_len, a.d_model, a.layers)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, a.vocab, (a.batch, a.seq_len + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    np.savez(
        work / "weights.npz",
        tokens=tokens,
        **{k: np.asarray(v) for k, v in flatten(params).items()},
    )
    loss_fn = lambda p, b: zoo.user_gpt_loss(p, b, n_heads=a.heads)
    tx = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    opt_state = tx.init(params)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    loss, grads = grad_fn(params, batch)

    def update(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        return (loss, *update(g, s, p))

    m = a.batch * a.seq_len
    draws = itertools.count()
    normal = lambda *shape: jax.random.normal(
        jax.random.fold_in(jax.random.key(1), next(draws)), shape
    )
    mats = [(normal(m, i), normal(i, o), normal(m, o)) for i, o in dense_shapes(a)]

    @jax.jit
    def dots(mats):
        # the forward product returned too, or XLA drops it (PyTorch computes it)
        return [(y, f(dy)) for (y, f), dy in ((jax.vjp(jnp.matmul, x, w), dy) for x, w, dy in mats)]

    hd = a.d_model // a.heads
    causal = jnp.tril(jnp.ones((a.seq_len, a.seq_len), dtype=bool))
    qkvs = [[normal(a.batch, a.heads, a.seq_len, hd) for _ in range(4)] for _ in range(a.layers)]

    @jax.jit
    def attention(qkvs):
        att = lambda q, k, v: zoo.user_gpt_attention(q, k, v, causal)
        return [(y, f(dy)) for (y, f), dy in ((jax.vjp(att, q, k, v), dy) for q, k, v, dy in qkvs)]

    jit_update = jax.jit(update)
    ready = jax.block_until_ready
    fns = {
        "dots": lambda: ready(dots(mats)),
        "attention": lambda: ready(attention(qkvs)),
        "forward+backward": lambda: ready(grad_fn(params, batch)),
        "adamw": lambda: ready(jit_update(grads, opt_state, params)),
        "step": lambda: ready(step(params, opt_state, batch)),
    }
    return {"loss": float(loss), "ms": time_parts(fns, a.runs, a.steps)}


def torch_worker(a, work: pathlib.Path) -> dict:
    import numpy as np
    import torch

    from experiments import fsdp2_step

    torch.set_num_threads(1)
    a.model, a.attention = "user_gpt", "hand"
    model = fsdp2_step.build(a)
    w = np.load(work / "weights.npz")
    t = lambda name, transpose=False: torch.from_numpy(w[name].T.copy() if transpose else w[name])
    state = {"tok.weight": t("tok"), "pos.weight": t("pos")}
    for i in range(a.layers):
        for ln in ("ln1", "ln2"):
            state[f"blocks.{i}.{ln}.weight"] = t(f"blocks.{i}.{ln}.scale")
            state[f"blocks.{i}.{ln}.bias"] = t(f"blocks.{i}.{ln}.bias")
        for lin in ("qkv", "proj", "fc", "out"):
            state[f"blocks.{i}.{lin}.weight"] = t(f"blocks.{i}.{lin}.w", transpose=True)
            state[f"blocks.{i}.{lin}.bias"] = t(f"blocks.{i}.{lin}.b")
    state.update({"ln_f.weight": t("ln_f.scale"), "ln_f.bias": t("ln_f.bias")})
    state.update({"head.weight": t("head.w", transpose=True), "head.bias": t("head.b")})
    model.load_state_dict(state)  # strict: every param named once
    tokens = torch.from_numpy(w["tokens"]).long()
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    with torch.no_grad():
        loss = model(x, y)

    def forward_backward():
        model.zero_grad()
        model(x, y).backward()

    def step():
        forward_backward()
        opt.step()

    m = a.batch * a.seq_len
    g = torch.Generator().manual_seed(1)
    normal = lambda *shape, grad=True: torch.randn(*shape, generator=g).requires_grad_(grad)
    mats = [(normal(m, i), normal(i, o), normal(m, o, grad=False)) for i, o in dense_shapes(a)]
    hd = a.d_model // a.heads
    shape = (a.batch, a.heads, a.seq_len, hd)
    qkvs = [
        (normal(*shape), normal(*shape), normal(*shape), normal(*shape, grad=False))
        for _ in range(a.layers)
    ]

    def dots():
        for x_, w_, dy in mats:
            torch.autograd.grad(x_ @ w_, (x_, w_), dy)

    def attention():
        for q, k, v, dy in qkvs:
            torch.autograd.grad(fsdp2_step.hand_attention(q, k, v), (q, k, v), dy)

    forward_backward()  # grads for adamw to apply
    fns = {
        "dots": dots,
        "attention": attention,
        "forward+backward": forward_backward,
        "adamw": opt.step,
        "step": step,
    }
    return {"loss": float(loss), "ms": time_parts(fns, a.runs, a.steps)}


def parse_args(argv):
    from experiments import fsdp2_step

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--torch-python", help="a Python with torch (default: this one)")
    p.add_argument("--core", default="0", help="taskset CPU list for every worker")
    p.add_argument("--rounds", type=int, default=2, help="processes per framework, alternating")
    p.add_argument("--runs", type=int, default=3, help="passes over the parts per process")
    p.add_argument("--steps", type=int, default=11, help="timed calls of a part per pass")
    for k, v in fsdp2_step.SHAPES.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--ranks", type=int, default=2, help="the batch is one rank's share")
    p.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--work", type=pathlib.Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.batch % a.ranks:
        p.error(f"--batch {a.batch} is not divisible by --ranks {a.ranks}")
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.worker:
        a.batch //= a.ranks
        worker = jax_worker if a.worker == "jax" else torch_worker
        print(json.dumps(worker(a, a.work)))
        return 0
    if shutil.which("taskset") is None:
        sys.exit("fsdp2_gap.py needs taskset (util-linux) to pin each worker to one core")
    python = {"jax": sys.executable, "torch": a.torch_python or sys.executable}
    work = pathlib.Path(tempfile.mkdtemp(prefix="fsdp2_gap_"))
    results: dict[str, list[dict]] = {"jax": [], "torch": []}
    try:
        for _ in range(a.rounds):
            for fw in ("jax", "torch"):  # jax first: it writes the weights torch loads
                cmd = ["taskset", "-c", a.core, python[fw], "-m", "experiments.fsdp2_gap", *argv]
                cmd += ["--worker", fw, "--work", str(work)]
                run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if run.returncode:
                    sys.exit(f"the {fw} worker failed:\n{run.stderr[-3000:]}")
                results[fw].append(json.loads(run.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    jax_loss, torch_loss = results["jax"][0]["loss"], results["torch"][0]["loss"]
    if abs(jax_loss - torch_loss) > 1e-4 * abs(jax_loss):
        sys.exit(f"not the same model: JAX loss {jax_loss:.6f}, PyTorch {torch_loss:.6f}")

    def figure(fw: str, part: str) -> tuple[float, float, float]:
        ms = [t for r in results[fw] for t in r["ms"][part]]
        return statistics.median(ms), min(ms), max(ms)

    print(
        f"user_gpt, one rank's work on core {a.core}: batch {a.batch // a.ranks} x "
        f"{a.seq_len}, d_model {a.d_model}, layers {a.layers}; same weights, loss "
        f"{jax_loss:.6f} (JAX) / {torch_loss:.6f} (PyTorch); median ms of {a.steps} calls, "
        f"{a.rounds} processes x {a.runs} passes each (range)"
    )
    print(f"{'part':<18}{'JAX':>22}{'PyTorch':>22}{'JAX / PyTorch':>15}")
    for part in PARTS:
        j, t = figure("jax", part), figure("torch", part)
        cell = lambda f: f"{f[0]:.1f} ({f[1]:.1f}-{f[2]:.1f})"
        print(f"{part:<18}{cell(j):>22}{cell(t):>22}{j[0] / t[0]:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
