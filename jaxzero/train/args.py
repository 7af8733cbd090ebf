"""``jaxzero train``'s command line: flags, shortcuts and ``--set``, turned into a config.

The config file comes first, then the typed shortcut flags, then ``--set``
(later wins); ``--resume`` (or a restart by ``jaxzero launch``) starts from the
run's own saved config instead. Nothing here computes with JAX: the config must
be known before the backend starts (simulated CPU devices are requested first).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

from jaxzero.cli import ArgError, Parser
from jaxzero.train import config as config_lib
from jaxzero.train import finetune, rundir
from jaxzero.train import resume as resume_lib
from jaxzero.train.config import Config

RESOLVED_CONFIG = "config.yaml"  # in the run directory: the config as the run resolved it
SHORTCUTS = {  # --flag: (config key, type, help); applied before --set, so --set wins
    "stage": ("parallel.stage", int, "ZeRO stage 0-3 (default 3)"),
    "devices": ("parallel.devices", int, "devices to train on (default: all)"),
    "simulate_devices": ("parallel.simulate_devices", int, "CPU only: simulate N devices "
                         "(default 8 when only one CPU device would exist)"),
    "micro_batches": ("parallel.micro_batches", int, "gradient accumulation steps"),
    "precision": ("precision.compute", str, "fp32 or bf16"),
    "data": ("data.path", str, "text file, directory of text files, uint16 token file/dir, "
             "or JSONL (with --tokenizer)"),
    "tokenizer": ("data.tokenizer", str, "tokenizer.json or a model directory holding one"),
    "init_from": ("train.init_from", str, "hf:PATH: fine-tune a Hugging Face checkpoint (its "
                  "config sets the model, its tokenizer the data's)"),
    "steps": ("train.steps", int, "optimizer steps"),
    "name": ("logging.name", str, "run name: results go to runs/NAME/"),
}  # fmt: skip


def add_config_flags(p: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()) -> None:
    """``--config``, ``--set`` and the shortcuts (but ``leave_out``'s): what makes a config,
    for ``jaxzero train`` and the commands that read a run's config as it would."""
    p.add_argument("--config", help="YAML or JSON config file (see configs/)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set optimizer.lr=3e-4 (repeatable)")  # fmt: skip
    for flag, (_, type_, help_) in SHORTCUTS.items():
        if flag in leave_out:
            continue
        metavar = "N" if type_ is int else flag.upper()
        p.add_argument("--" + flag.replace("_", "-"), type=type_, metavar=metavar, help=help_)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxzero train",
        description="Train a GPT with ZeRO sharding. Defaults: byte-level GPT on this Python's "
        "stdlib sources, stage 3, 8 simulated CPU devices when only a CPU is present.",
    )
    add_config_flags(p)
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_DIR",
        help="continue RUN_DIR (or --name NAME) from its latest checkpoint",
    )
    p.add_argument("--print-config", action="store_true", help="print the config and exit")
    p.add_argument(
        "--init-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="multi-process: how long to wait for every process to connect "
        "(default 60 on CPU; JAXZERO_INIT_TIMEOUT)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    """The config file, then the typed shortcuts, then ``--set`` (later wins); validated.

    They are laid over :class:`Config`'s defaults, or for a fine-tune (``train.init_from``
    set anywhere) over :func:`jaxzero.train.finetune.defaults`, so a value the user
    gives always wins and one left out takes the fine-tuning default. With
    ``--resume`` the base is the run's own saved config instead of a file.
    Otherwise a name that comes from the config file (a run's own ``config.yaml``,
    say) is a default: if that run directory already holds a run, this run is
    named ``NAME-TIMESTAMP`` instead, so rerunning a saved config just works. A
    name given on the command line is used as given. Paths become absolute here
    (:func:`~jaxzero.train.config.absolute_paths`), against the current directory.
    """

    def apply(cfg: Config) -> Config:
        for flag, (key, _, _) in SHORTCUTS.items():
            value = getattr(args, flag)
            if value is not None:
                cfg = config_lib.override(cfg, key, value)
        cfg = config_lib.validate(config_lib.apply_overrides(cfg, args.assignments))
        return config_lib.absolute_paths(cfg)  # the saved config works from any directory

    def base(defaults: Config | None = None) -> Config:
        defaults = defaults or Config()
        return config_lib.load_file(args.config, defaults) if args.config else defaults

    if not args.resume and os.environ.get("JAXZERO_RESTART_COUNT", "0") != "0":
        args.resume = _restarted_run(apply(base()))
        args.config = None if args.resume else args.config
    if args.resume:
        if args.config:
            raise ArgError("--resume continues a run with its own config: drop --config")
        run = resume_lib.run_dir_to_resume(args.resume, apply(Config()))
        cfg, args.resume_changes = resume_lib.resumed_config(run, apply)
        return cfg
    cfg = apply(base())
    if finetune.source(cfg) is not None:  # the same settings over a fine-tune's defaults
        cfg = apply(base(finetune.defaults(cfg)))
    lg = cfg.logging
    if lg.name is not None and not _names_the_run(args) and not lg.overwrite:
        if rundir.holds_run(Path(lg.root) / lg.name):
            fresh = f"{lg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            cfg = dataclasses.replace(cfg, logging=dataclasses.replace(lg, name=fresh))
    return cfg


def _restarted_run(cfg: Config) -> str | bool:
    """A group restarted by ``jaxzero launch --max-restarts`` continues its named run from
    the latest checkpoint, if it has one (else it starts again)."""
    if cfg.logging.name is None:
        return False
    run = Path(cfg.logging.root) / cfg.logging.name
    ckpts = resume_lib.checkpoint_dir(cfg, run)
    has = ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
    return str(run) if (run / RESOLVED_CONFIG).is_file() and has else False


def _names_the_run(args: argparse.Namespace) -> bool:
    """Whether the command line sets ``logging.name`` (``--name`` or ``--set``)."""
    if args.name is not None:
        return True
    for key, value in map(config_lib.parse_assignment, args.assignments):
        if key == "logging.name" or (key == "logging" and "name" in (value or {})):
            return True
    return False
