"""``jaxzero plan``: will this run fit, and which configuration is fastest?

Takes what ``jaxzero train`` takes (a config, ``--set``, ``--init-from hf:DIR``, the
devices) and a target (``--device-memory``, ``--hardware``), compiles each candidate
(ZeRO stage x remat x micro-batches) without allocating anything, and prints those
that fit ranked by a stated roofline, with the largest global batch that fits for
the best few (:mod:`jaxzero.accounting.planner`, :mod:`jaxzero.train.planning`). Where a
host memory apart from the devices' is known (``--hardware``, ``--host-memory``, a GPU
machine's host), candidates that keep the optimizer state in host memory (offload) are
compiled where the same candidate without does not fit; on a hybrid mesh, candidates with
ZeRO++'s quantized collectives too.

Exit codes, so that scripts can tell: 0 a candidate fits (the first choice is printed),
1 nothing fits (the table says why), 2 an error (bad input, one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from jaxzero import cli, distributed
from jaxzero.accounting.estimate import parse_bytes
from jaxzero.accounting.planner import HARDWARE, REMATS, Candidate, candidates
from jaxzero.cli import Parser
from jaxzero.train import data as data_lib
from jaxzero.train import finetune, planning
from jaxzero.train.args import add_config_flags, config_from_args
from jaxzero.train.config import Config, ConfigError
from jaxzero.train.devices import setup_devices

# train's shortcuts that name one configuration; the planner searches over these instead
_SEARCHED = ("stage", "micro_batches")
_UNUSED = ("steps", "name")
FITS, NOTHING_FITS, ERROR = 0, 1, 2  # the exit codes


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxzero plan",
        description="Compile (not run) each ZeRO stage x remat x micro-batch count for a "
        "jaxzero train config; print what fits in the device memory, ranked by a roofline.",
        epilog=f"exit codes: {FITS} a candidate fits, {NOTHING_FITS} nothing fits, {ERROR} an "
        "error (bad input)",
    )
    add_config_flags(p, leave_out=_SEARCHED + _UNUSED)
    g = p.add_argument_group("the target")
    g.add_argument("--device-memory", metavar="BYTES",
                   help="per device: 80GB, 79.6GiB, 8e10 (default: the device's limit; "
                   "--hardware's; on CPU the host's share)")  # fmt: skip
    g.add_argument("--hardware", choices=list(HARDWARE), help="the roofline (and memory) of a "
                   "known device (default: this machine's, if known; else cpu)")  # fmt: skip
    g.add_argument("--host-memory", metavar="BYTES",
                   help="host memory per device for offloaded state (default: --hardware's; "
                   "a GPU host's share; on CPU none apart from the devices')")  # fmt: skip
    g.add_argument("--device-flops", type=float, metavar="FLOP/S", help="override the roofline's")
    g.add_argument("--link-bandwidth", type=float, metavar="BYTES/S",
                   help="bytes/s a device sends within its group (NVLink)")  # fmt: skip
    g.add_argument("--cross-bandwidth", type=float, metavar="BYTES/S",
                   help="bytes/s a device sends across groups (InfiniBand)")  # fmt: skip
    g.add_argument("--host-link-bandwidth", type=float, metavar="BYTES/S",
                   help="bytes/s between a device and host memory, each way (PCIe)")  # fmt: skip
    c = p.add_argument_group("the candidates")
    c.add_argument("--stages", type=int, nargs="+", choices=[0, 1, 2, 3], default=[0, 1, 2, 3])
    c.add_argument("--remats", nargs="+", choices=list(REMATS), default=list(REMATS))
    c.add_argument("--micro-batch-counts", type=int, nargs="+", metavar="K",
                   help="default: every divisor of the rows per device")  # fmt: skip
    c.add_argument("--model-axes", type=int, nargs="+", metavar="M",
                   help="also split each layer over M devices (mesh.model, tensor "
                   "parallelism; Llama-family models); default: the run's mesh.model")  # fmt: skip
    c.add_argument("--batch", type=int, help="global batch (default: train.batch_size)")
    c.add_argument("--max-batch", type=int, default=1, metavar="N",
                   help="find the largest batch that fits for the best N (0: none; each "
                   "takes about four more compiles)")  # fmt: skip
    c.add_argument("--all", action="store_true",
                   help="also compile micro-batch counts above the fewest that fit")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _parse(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for flag in _SEARCHED + _UNUSED:  # what config_from_args reads of train's flags
        setattr(args, flag, None)
    args.resume = False
    return args


def _hardware(args: argparse.Namespace) -> Any:
    hw = planning.hardware(args.hardware)
    for name, field in (("device_flops", "flops"), ("link_bandwidth", "intra"),
                        ("cross_bandwidth", "inter"),
                        ("host_link_bandwidth", "host_link")):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            if not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
            hw = dataclasses.replace(hw, **{field: value, "name": f"{hw.name}, {name} set"})
    return hw


def plan(args: argparse.Namespace) -> Any:
    """The survey ``jaxzero plan`` prints (:class:`~jaxzero.accounting.planner.Survey`)."""
    began = time.perf_counter()
    cfg: Config = config_from_args(args)
    if args.batch is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=args.batch))
    job = distributed.initialize(simulate_devices=cfg.parallel.simulate_devices)
    pretrained = None
    if finetune.source(cfg) is not None:
        cfg, pretrained = finetune.resolve(cfg)
    mesh, _ = setup_devices(cfg.parallel, job, cfg.mesh.group_size, cfg.mesh.model)
    corpus = data_lib.load_corpus(cfg.data, cfg.model.vocab_size, "none")
    vocab = max(cfg.model.vocab_size or 0, corpus.vocab_size)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    cands = planning.Candidates(cfg, mesh, planning.first_batch(cfg, corpus), pretrained)
    hw = _hardware(args)
    n = int(mesh.devices.size)
    configured = args.device_memory or cfg.zero.device_memory
    host = planning.unique_bytes(cands(planning.candidate_of(cfg)).state)
    target = hw if args.hardware else None
    limit, note = planning.budget(configured, n, host, target)
    hosted = planning.host_budget(args.host_memory or cfg.zero.host_memory, n, host, target)
    axes = _model_axes(cfg, n, args.model_axes)
    which: list[Candidate] = candidates(
        cfg.train.batch_size, n if axes else planning.row_devices(cfg, mesh), args.stages,
        args.remats, args.micro_batch_counts, **planning.beyond_options(mesh, hosted[0]),
        model_axes=axes,
    )  # fmt: skip
    found = planning.plan_run(
        cfg, cands, limit, note, hw, which=which, max_batch=args.max_batch, exhaustive=args.all,
        host=hosted,
    )  # fmt: skip
    compiled = len({r.candidate for r in found.rows if r.status in ("fits", "over")})
    found.notes.append(
        f"planned in {time.perf_counter() - began:.1f}s ({compiled} candidates compiled at the "
        "configured batch); the peak is the compiled step's (argument + output + temp - alias)"
    )
    return found


def _model_axes(cfg: Config, devices: int, asked: list[int] | None) -> list[int]:
    """``--model-axes``, checked against the devices and the run (none: the run's own)."""
    if not asked:
        return []
    for m in asked:
        if m < 1 or devices % m:
            raise ConfigError(f"--model-axes {m}: must divide the {devices} devices")
    if cfg.mesh.ulysses and max(asked) > 1:
        raise ConfigError("--model-axes with mesh.ulysses: Ulysses takes no model axis yet")
    return sorted(set(asked))


def main(argv: list[str] | None = None) -> int:
    """``jaxzero plan``: the table, and 0 when a candidate fits, 1 when none does; 2 and
    one line on bad input."""

    def body(args: argparse.Namespace) -> int:
        for given in (args.device_memory, args.host_memory):
            if given is not None:
                parse_bytes(given)  # before anything is built
        found = plan(args)
        print(json.dumps(found.to_dict(), indent=2) if args.json else found.table())
        return FITS if found.best() is not None else NOTHING_FITS

    also = (ValueError, RuntimeError, OSError)  # bad sizes, XLA's refusals, unreadable data
    return cli.run("plan", _parse, body, argv, also=also)


if __name__ == "__main__":
    sys.exit(main())
