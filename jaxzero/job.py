"""What this process is in a multi-process job, decided from arguments and the environment.

Pure functions of their arguments and an environment mapping (no devices, no
network), so every rule about which variable wins and which combination is an error
is testable in microseconds; the connecting happens in :mod:`jaxzero.distributed`.
Each field is taken from the first place that sets it: an explicit argument, the
``JAXZERO_*`` variable, the torchrun variable (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``). With no rank and
world size anywhere, a SLURM, Open MPI or Kubernetes job with several processes is
left to JAX's own detection; otherwise this is a single process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Any

from jaxzero.errors import Error

DEFAULT_INIT_TIMEOUT_CPU = 60.0  # seconds; accelerators use JAX's 300
DEFAULT_INIT_TIMEOUT_ACCELERATOR = 300.0
DEFAULT_HEARTBEAT_TIMEOUT = 30  # a dead peer is declared after this many seconds (JAX: 100)
EXIT_SETUP = 2  # exit status when the job cannot be set up (like a usage error)

# field -> (JAXZERO_* variable, torchrun variable or None)
VARIABLES = {
    "host": ("JAXZERO_HOST", "MASTER_ADDR"),
    "port": ("JAXZERO_PORT", "MASTER_PORT"),
    "rank": ("JAXZERO_RANK", "RANK"),
    "world_size": ("JAXZERO_WORLD_SIZE", "WORLD_SIZE"),
    "local_rank": ("JAXZERO_LOCAL_RANK", "LOCAL_RANK"),
    "local_world_size": ("JAXZERO_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    "simulate_devices": ("JAXZERO_SIMULATE_DEVICES", None),
    "init_timeout": ("JAXZERO_INIT_TIMEOUT", None),
    "heartbeat_timeout": ("JAXZERO_HEARTBEAT_TIMEOUT", None),
    "local_device_ids": ("JAXZERO_LOCAL_DEVICE_IDS", None),
}


# Under torchrun (which sets TORCHELASTIC_RUN_ID) MASTER_PORT is its rendezvous store's,
# already bound on rank 0's host: the JAX coordinator takes the port this far above it
# (JAXZERO_PORT, when set, is used as it is).
TORCHRUN_MARKER = "TORCHELASTIC_RUN_ID"
TORCHRUN_PORT_OFFSET = 1


# Set by ``jaxzero launch`` for its processes: the folder where one says its program ended
# (see jaxzero.distributed._program_ended and launch.Group.ended_early).
LAUNCH_EVENTS = "JAXZERO_LAUNCH_EVENTS"


class DistributedError(Error, RuntimeError):
    """The job cannot be set up; the message is one line naming the variables at fault."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One resolved value and where it came from, to name it in messages."""

    value: Any
    source: str  # a variable name, or "argument"
    field: str

    def __str__(self) -> str:
        if self.source == "argument":
            return f"{self.field}={self.value!r} (argument)"
        value = ",".join(map(str, self.value)) if isinstance(self.value, tuple) else self.value
        return f"{self.source}={value}"


@dataclasses.dataclass(frozen=True)
class Job:
    """What this process is in the job. ``mode``: "single", "explicit" or a cluster name."""

    mode: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    host: Setting | None = None
    port: Setting | None = None
    settings: Mapping[str, Setting] = dataclasses.field(default_factory=dict)
    simulate_devices: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    init_timeout: float = DEFAULT_INIT_TIMEOUT_CPU
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT

    @property
    def multi(self) -> bool:
        return self.mode != "single"

    @property
    def coordinator(self) -> str | None:
        """``host:port`` of the coordinator (rank 0), when known before connecting."""
        if self.host is None or self.port is None:
            return None
        return f"{self.host.value}:{self.port.value}"

    def named(self, *fields: str) -> str:
        """``"RANK=2, WORLD_SIZE=2"``: the settings behind ``fields``, for messages."""
        return ", ".join(str(self.settings[f]) for f in fields if f in self.settings)


# --------------------------------------------------------------------------- resolving


def _integer(low: int, high: int | None = None) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        value = int(str(raw).strip())
        if value < low or (high is not None and value > high):
            raise ValueError
        return value

    parse.expect = f"an integer >= {low}" + (f" and <= {high}" if high else "")  # type: ignore
    return parse


def _text(raw: Any) -> str:
    if not str(raw).strip():
        raise ValueError
    return str(raw).strip()


def _seconds(raw: Any) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError
    return value


def _ids(raw: Any) -> tuple[int, ...]:
    if isinstance(raw, (list, tuple)):
        return tuple(int(x) for x in raw)
    return tuple(int(x) for x in str(raw).split(",") if x.strip())


_seconds.expect = "a positive number of seconds"  # type: ignore
_ids.expect = "a comma-separated list of device ids"  # type: ignore
_text.expect = "a host name or address"  # type: ignore
_PARSERS: dict[str, Callable[[Any], Any]] = {
    "host": _text,
    "port": _integer(1, 65535),
    "rank": _integer(0),
    "world_size": _integer(1),
    "local_rank": _integer(0),
    "local_world_size": _integer(1),
    "simulate_devices": _integer(1),
    "init_timeout": _seconds,
    "heartbeat_timeout": _integer(1),
    "local_device_ids": _ids,
}


def _pick(field: str, argument: Any, environ: Mapping[str, str]) -> Setting | None:
    """The first of: the argument, the JAXZERO_* variable, the torchrun variable."""
    candidates = [("argument", argument)] + [
        (name, environ.get(name)) for name in VARIABLES[field] if name
    ]
    for source, raw in candidates:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            continue
        try:
            value = _PARSERS[field](raw)
        except (TypeError, ValueError):
            what = getattr(_PARSERS[field], "expect", "a valid value")
            label = f"{field}={raw!r} (argument)" if source == "argument" else f"{source}={raw}"
            raise DistributedError(f"{label} is not {what}") from None
        return Setting(value, source, field)
    return None


def _order(setting: Setting) -> int:
    """Precedence of where a setting came from: argument 0, JAXZERO_* 1, torchrun 2."""
    if setting.source == "argument":
        return 0
    return 1 if setting.source.startswith("JAXZERO_") else 2


def detect_cluster(environ: Mapping[str, str]) -> str | None:
    """The launcher JAX would auto-detect, when it started more than one process."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in environ for v in slurm) and _int_or(environ["SLURM_NTASKS"], 1) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in environ and _int_or(environ.get("OMPI_COMM_WORLD_SIZE"), 1) > 1:
        return "ompi"
    if (
        "KUBERNETES_SERVICE_HOST" in environ
        and "JOB_COMPLETION_INDEX" in environ
        and importlib.util.find_spec("kubernetes") is not None
    ):
        return "kubernetes"
    return None


def _int_or(text: Any, default: int) -> int:
    try:
        return int(str(text).split("(")[0].split(",")[0])
    except (TypeError, ValueError):
        return default


_CLUSTER_LOCAL = {  # cluster -> (local rank variable, processes-per-node variable)
    "slurm": ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    "ompi": ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "kubernetes": (None, None),
}


def resolve(
    environ: Mapping[str, str] | None = None, *, accelerator: bool = False, **arguments: Any
) -> Job:
    """Decides the job from ``arguments`` (the fields of ``VARIABLES``) and ``environ``.

    Pure: reads nothing but its inputs, so every rule is testable without devices or
    processes.
    Raises :class:`DistributedError` naming the variable and its value.

    Example:
      >>> env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1",
      ...        "WORLD_SIZE": "2", "JAXZERO_RANK": "0"}
      >>> job = resolve(env)
      >>> job.coordinator, job.rank, job.named("rank", "world_size")
      ('10.0.0.1:29500', 0, 'JAXZERO_RANK=0, WORLD_SIZE=2')
    """
    environ = os.environ if environ is None else environ
    got = _settings(environ, arguments)
    common = _common(got, accelerator)
    rank, world = got.get("rank"), got.get("world_size")
    local_rank, local_world = got.get("local_rank"), got.get("local_world_size")
    host, port = got.get("host"), got.get("port")
    if world is None and rank is not None:
        raise DistributedError(
            f"{rank} is set but the world size is not: set {_names('world_size', rank.source)}"
        )
    if world is not None:
        return _explicit(got, common)
    cluster = detect_cluster(environ)
    if cluster is None:
        return Job("single", **common)
    lr_var, lw_var = _CLUSTER_LOCAL[cluster]
    lr = local_rank.value if local_rank else _int_or(environ.get(lr_var or ""), 0)
    lw = local_world.value if local_world else _int_or(environ.get(lw_var or ""), 1)
    return Job(cluster, -1, -1, lr, lw, host, port, **common)  # rank, world: from JAX


def _settings(environ: Mapping[str, str], arguments: Mapping[str, Any]) -> dict[str, Setting]:
    """Each field's setting, from ``arguments`` or ``environ`` (the first that names it);
    a port embedded in the host (``addr:port``) split off, torchrun's port moved past its
    store."""
    unknown = set(arguments) - set(VARIABLES)
    if unknown:
        raise TypeError(f"unknown argument(s) {sorted(unknown)}; use {sorted(VARIABLES)}")
    got = {f: s for f in VARIABLES if (s := _pick(f, arguments.get(f), environ)) is not None}
    if "host" in got and str(got["host"].value).count(":") == 1:  # "addr:port", as JAX has it
        given = got["host"]
        name, embedded = str(given.value).split(":")
        got["host"] = dataclasses.replace(given, value=name)
        if "port" not in got or _order(got["host"]) < _order(got["port"]):
            port = _pick("port", embedded, {})
            if port is None:  # "addr:" with nothing after the colon
                raise DistributedError(f"{given} gives no port after the ':': give host:port")
            got["port"] = dataclasses.replace(port, source=got["host"].source)
    if (
        "port" in got and got["port"].source == "MASTER_PORT" and TORCHRUN_MARKER in environ
    ):  # torchrun's own store listens on MASTER_PORT
        got["port"] = Setting(
            got["port"].value + TORCHRUN_PORT_OFFSET, f"MASTER_PORT+{TORCHRUN_PORT_OFFSET}", "port"
        )
    return got


def _common(got: Mapping[str, Setting], accelerator: bool) -> dict[str, Any]:
    """The fields every kind of job has: the settings, and the knobs with their defaults."""
    return dict(
        settings=got,
        simulate_devices=got["simulate_devices"].value if "simulate_devices" in got else None,
        local_device_ids=got["local_device_ids"].value if "local_device_ids" in got else None,
        init_timeout=got["init_timeout"].value
        if "init_timeout" in got
        else (DEFAULT_INIT_TIMEOUT_ACCELERATOR if accelerator else DEFAULT_INIT_TIMEOUT_CPU),
        heartbeat_timeout=got["heartbeat_timeout"].value
        if "heartbeat_timeout" in got
        else DEFAULT_HEARTBEAT_TIMEOUT,
    )


def _explicit(got: Mapping[str, Setting], common: dict[str, Any]) -> Job:
    """The job a world size names (torchrun's variables, ``JAXZERO_*`` or arguments):
    single for a world of one, else explicit, every rule between the settings checked."""
    rank, world = got.get("rank"), got["world_size"]
    local_rank, local_world = got.get("local_rank"), got.get("local_world_size")
    host, port = got.get("host"), got.get("port")
    if rank is None:
        if world.value == 1:
            return Job("single", **common)
        raise DistributedError(
            f"{world} is set but the rank is not: set "
            f"{_names('rank', world.source)} (0 to {world.value - 1})"
        )
    if rank.value >= world.value:
        raise DistributedError(
            f"{rank} must be below {world}: ranks run from 0 to {world.value - 1}"
        )
    if world.value == 1:
        return Job("single", **common)
    missing = [f for f in ("host", "port") if f not in got]
    if missing:
        raise DistributedError(
            f"{rank}, {world} are set but the coordinator's "
            + " and ".join(missing)
            + " are not: set "
            + " and ".join(_names(f, rank.source) for f in missing)
            + " (rank 0's address and a free port)"
        )
    lr = local_rank.value if local_rank else 0
    lw = local_world.value if local_world else lr + 1  # unknown: at least this many
    if lr >= lw:
        raise DistributedError(
            f"{local_rank} must be below {local_world or 'a local world size of 1'}"
        )
    if lw > world.value:
        raise DistributedError(f"{local_world} cannot exceed {world}")
    return Job("explicit", rank.value, world.value, lr, lw, host, port, **common)


def _names(field: str, like: str) -> str:
    """The variable to set for ``field``, in the family (JAXZERO_ or torchrun) already used."""
    ours, torch = VARIABLES[field]
    if like == "argument":
        return f"the {field} argument"
    return ours if like.startswith("JAXZERO_") or torch is None else torch
