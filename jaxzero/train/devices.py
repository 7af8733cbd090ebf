"""Which devices a run trains on: simulated CPU devices when there is nothing else, the
mesh, and the config with what the devices decided filled in (``--print-config``).

Simulated CPU devices can only be requested before the backend starts, so these run
before JAX does any computation.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any

import jax

from jaxzero.mesh import accelerator_expected, make_mesh, replicas_for, simulate_devices
from jaxzero.train import config as config_lib
from jaxzero.train import data as data_lib
from jaxzero.train import finetune
from jaxzero.train.config import Config, ConfigError

DEFAULT_SIMULATED_DEVICES = 8


def _configured_cpu_devices() -> int:
    """CPU devices already requested through XLA_FLAGS or jax.config (1 if none)."""
    match = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    # jax < 0.12 declares its config flags at run time only: mypy sees no such attribute
    cpu_devices = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined,unused-ignore]
    return max(int(match.group(1)) if match else 1, cpu_devices)


def devices_to_simulate(parallel: config_lib.ParallelConfig) -> int | None:
    """How many CPU devices to simulate (None: leave the backend alone)."""
    if parallel.simulate_devices is not None:
        return parallel.simulate_devices
    if accelerator_expected() or _configured_cpu_devices() > 1:
        return None
    return parallel.devices or DEFAULT_SIMULATED_DEVICES


def setup_devices(
    parallel: config_lib.ParallelConfig,
    job: Any = None,
    group_size: int | str | None = None,
    model: int = 1,
) -> tuple[Any, int | None]:
    """Simulates CPU devices if asked (before any computation) and builds the mesh.

    In a multi-process ``job`` the devices were set up by ``distributed.initialize``
    (``simulate_devices`` counts per process) and the mesh spans every process.
    """
    multi = job is not None and job.multi
    simulated = devices_to_simulate(parallel) if not multi else None
    try:
        if simulated is not None:
            simulate_devices(simulated)
        if multi:
            simulated = job.simulate_devices if jax.default_backend() == "cpu" else None
            if parallel.devices not in (None, jax.device_count()):
                raise ConfigError(
                    f"parallel.devices={parallel.devices}: a multi-process run trains on all "
                    f"{jax.device_count()} devices of its {job.world_size} processes; leave it "
                    "unset"
                )
        n = parallel.devices or jax.device_count()
        node = jax.local_device_count() * (job.local_world_size if multi else 1)
        mesh = make_mesh(n, replicas=replicas_for(group_size, n, node), model=model)
        return mesh, simulated
    except (RuntimeError, ValueError) as e:
        raise ConfigError(" ".join(str(e).split())) from None


# --------------------------------------------------------------------------- run directory


def resolve_run(cfg: Config, num_devices: int, simulated: int | None, vocab: int | None) -> Config:
    """The config with every ``None`` the run decided filled in (name, devices, vocab)."""
    name = cfg.logging.name or (
        f"stage{cfg.parallel.stage}-{num_devices}dev-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=vocab),
        parallel=dataclasses.replace(cfg.parallel, devices=num_devices, simulate_devices=simulated),
        logging=dataclasses.replace(cfg.logging, name=name),
    )


def printable_config(cfg: Config) -> str:
    """``--print-config``: the config as a run resolves it, without reading the data.

    Devices, simulated devices, the name and (for byte data) the vocab are filled
    in as ``train`` would; what only the data decides is said in a YAML comment.
    """
    mesh, simulated = setup_devices(cfg.parallel)
    if finetune.source(cfg) is not None:
        cfg, _ = finetune.resolve(cfg)
    vocab = cfg.model.vocab_size
    if vocab is None and data_lib.data_kind(cfg.data) == "bytes":
        vocab = data_lib.BYTE_VOCAB
    text = config_lib.dump_yaml(resolve_run(cfg, mesh.size, simulated, vocab))
    if finetune.source(cfg) is not None:
        text += finetune.defaults_note(cfg)
    if cfg.logging.name is None:
        text += "# logging.name: from the stage, devices and start time; --name fixes it\n"
    if vocab is None:
        text += "# model.vocab_size: set at start-up from the data (largest token + 1)\n"
    return text
