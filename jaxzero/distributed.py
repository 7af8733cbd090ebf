"""Joining a multi-process job: who am I (rank), how many are we (world size), where is the host.

:func:`initialize` decides the coordinator ("host": rank 0's address and port),
the world size (number of processes), this process's rank and local rank, from,
in this order: explicit arguments; ``JAXZERO_*`` variables; torchrun's
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``; then whatever ``jax.distributed.initialize()`` detects
itself (SLURM, Open MPI, Kubernetes). Each field is taken from the first place
that sets it. A single process with none of them is a no-op.

Nothing here may hang: a bad setting is refused before connecting, an
unreachable coordinator is probed with a deadline, and a watchdog ends the
process with a message naming the variables if connecting takes longer than
``init_timeout`` (JAX's own timeout would abort with a C++ stack trace instead).
Peers that die later are caught by JAX's heartbeats (``heartbeat_timeout``).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from jaxzero import mesh as mesh_lib
from jaxzero.job import EXIT_SETUP, LAUNCH_EVENTS, VARIABLES, DistributedError, Job, resolve

__all__ = [
    "VARIABLES",
    "DistributedError",
    "Job",
    "describe_mesh",
    "describe_processes",
    "initialize",
    "leave",
    "lost_ranks",
    "resolve",
    "shutdown",
]


def probe(host: str, port: int, waited: float, what: str) -> None:
    """Waits up to ``waited`` s until ``host:port`` accepts TCP connections, or raises."""
    deadline = time.monotonic() + waited
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DistributedError(f"cannot resolve the coordinator's host ({what}): {e}") from None
    while True:
        for family, kind, proto, _, address in infos:
            try:
                with socket.socket(family, kind, proto) as s:
                    s.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
                    s.connect(address)
                    return
            except OSError:
                continue
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"nobody listens at the coordinator {host}:{port} ({what}) after waiting "
                f"{waited:g} s (init timeout): start rank 0 there, or fix the address and port"
            )
        time.sleep(0.25)


class _Watchdog:
    """Ends the process with ``message()`` if :meth:`done` is not called in ``seconds``.

    JAX's own connect blocks in C++ (no Python exception can interrupt it) and
    aborts with a stack trace on its timeout; this fires first, with one line.
    """

    def __init__(self, seconds: float, message: Callable[[], str]):
        self._timer = threading.Timer(seconds, self._fire, args=(message,))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _fire(message: Callable[[], str]) -> None:
        sys.stdout.flush()
        print(f"jaxzero.distributed: error: {message()}", file=sys.stderr, flush=True)
        os._exit(EXIT_SETUP)

    def done(self) -> None:
        self._timer.cancel()


def _timeout_message(job: Job, waited: float) -> str:
    where = job.coordinator or "the auto-detected coordinator"
    if job.mode == "explicit":
        return (
            f"waited {waited:g} s (init timeout) for {job.settings['world_size']} processes "
            f"to connect to the coordinator at {where} ({job.named('host', 'port')}); not "
            f"all did. Start every rank 0..{job.world_size - 1} with the same world size, "
            f"or fix {job.settings['world_size']}"
        )
    return (
        f"waited {waited:g} s (init timeout) for the {job.mode} job's processes to connect "
        f"to {where}; not all did (check the number of tasks and the job's variables)"
    )


def check_port_free(port: Any) -> None:
    """Rank 0 binds the coordinator's port itself: a port another process holds (a
    launcher's store) would otherwise fail inside JAX's server, uncatchably."""
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", int(port.value)))
        except OSError as e:
            raise DistributedError(
                f"the coordinator's port {port.value} ({port}) cannot be bound: "
                f"{e.strerror or e}; another process (a launcher's store?) holds it. Set "
                "JAXZERO_PORT to a free port"
            ) from None


def initialize(
    host: str | None = None,
    port: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    *,
    simulate_devices: int | None = None,
    init_timeout: float | None = None,
    heartbeat_timeout: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    verbose: bool = True,
    preemption_service: bool = False,
) -> Job:
    """Joins the job (``jax.distributed.initialize``) if there is one; call before using JAX.

    Args:
      host: the coordinator: rank 0's address (it may be ``"addr:port"``).
      port: the coordinator's port.
      rank: this process's id, 0 to ``world_size - 1``.
      world_size: the number of processes.
      local_rank: this process's index within its node.
      local_world_size: the number of processes on this node.
      simulate_devices: CPU only: devices each process simulates.
      init_timeout: seconds to wait for every process to connect (CPU default 60).
      heartbeat_timeout: seconds after which a silent peer counts as dead (default 30).
      local_device_ids: accelerator ids this process drives (default: ``[local_rank]``
        when several processes share a node, else all).
      verbose: print one line per process and a summary on rank 0 (stderr).
      preemption_service: keep JAX's preemption service, whose notifier takes SIGTERM
        for a preemption notice that a script must poll for
        (``multihost_utils.reached_preemption_sync_point``). Off by default, so that
        SIGTERM (from ``jaxzero launch`` stopping a failed job, or a scheduler) ends
        a script as it ends any program; ``jaxzero train`` handles SIGTERM itself.

    Returns:
      The :class:`Job`. A single process with nothing set is left alone (mode "single");
      in a multi-process job JAX's backend is started, to report the devices.
    """
    global _JOB
    if jax.distributed.is_initialized():  # already joined (by us, or by a direct JAX call)
        return _JOB or _current_job()
    job = resolve(
        accelerator=mesh_lib.accelerator_expected(),
        host=host,
        port=port,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        simulate_devices=simulate_devices,
        init_timeout=init_timeout,
        heartbeat_timeout=heartbeat_timeout,
        local_device_ids=local_device_ids,
    )
    if not job.multi:
        return job
    ids = _prepare_jax(job, preemption_service)
    devices = _join(job, ids)
    _JOB = job = dataclasses.replace(job, rank=jax.process_index(), world_size=jax.process_count())
    previous = sys.excepthook  # an uncaught exception leaves the job at once (see leave)

    def excepthook(kind, value, tb):
        previous(kind, value, tb)
        leave(1, value)

    sys.excepthook = excepthook
    atexit.register(_program_ended)  # after JAX's exit hook, so it runs before it
    if job.mode == "explicit" and job.world_size != job.settings["world_size"].value:
        raise DistributedError(
            f"{job.settings['world_size']} but the coordinator at "
            f"{job.coordinator} runs a job of {job.world_size} processes: "
            "every process must be given the same world size"
        )
    if verbose:
        _announce(job, devices)
    return job


def _prepare_jax(job: Job, preemption_service: bool) -> Sequence[int] | None:
    """Sets JAX up for ``job`` (devices simulated, collectives, preemption); the ids it drives."""
    if mesh_lib.backend_started():
        raise DistributedError(
            "JAX already started its backend: call "
            "jaxzero.distributed.initialize() before any JAX computation"
        )
    accelerator = mesh_lib.accelerator_expected()
    if job.simulate_devices and not accelerator:
        mesh_lib.simulate_devices(job.simulate_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across
    jax.config.update("jax_enable_preemption_service", preemption_service)
    ids = job.local_device_ids
    if ids is None and accelerator and job.local_world_size > 1:
        ids = (job.local_rank,)  # torchrun's layout: one accelerator per process
    return ids


def _join(job: Job, ids: Sequence[int] | None) -> list[Any]:
    """``jax.distributed.initialize`` under a watchdog, then the backend; the job's devices."""
    deadline = time.monotonic() + job.init_timeout
    if job.mode == "explicit" and job.rank != 0:
        assert job.host is not None and job.port is not None  # resolve: explicit needs both
        probe(job.host.value, job.port.value, job.init_timeout, job.named("host", "port"))
    if job.mode == "explicit" and job.rank == 0:
        check_port_free(job.port)
    dog = _Watchdog(
        max(deadline - time.monotonic(), 0.1), lambda: _timeout_message(job, job.init_timeout)
    )
    kwargs: dict[str, Any] = dict(
        initialization_timeout=int(job.init_timeout) + 30,  # the watchdog speaks first
        heartbeat_timeout_seconds=job.heartbeat_timeout,
        local_device_ids=list(ids) if ids is not None else None,
    )
    if job.mode == "explicit":
        kwargs.update(
            coordinator_address=job.coordinator, num_processes=job.world_size, process_id=job.rank
        )
    elif job.coordinator is not None:
        kwargs["coordinator_address"] = job.coordinator
    try:
        jax.distributed.initialize(**kwargs)
        devices = jax.devices()  # starts the backend: the topology exchange is covered too
    except (RuntimeError, ValueError) as e:  # JAX refused before connecting
        where = job.named("host", "port", "rank", "world_size") or job.mode
        raise DistributedError(
            f"jax.distributed.initialize failed ({where}): {str(e).strip().splitlines()[0]}"
        ) from e
    finally:
        dog.done()
    return devices


_JOB: Job | None = None  # the job this process joined


def lost_ranks(wait: float) -> list[int] | None:
    """Ranks JAX's coordination service no longer sees alive; None if it cannot tell in time.

    ``multihost_utils.live_devices`` (public in JAX 0.10 and 0.12, marked unstable) asks
    the service, which answers once every live process asks or a silent one has missed
    its heartbeats, so a survivor learns who died within the heartbeat timeout. Its
    ``with`` asks a second time as it ends (a second barrier). Both are blocking C++
    calls, so they run in a thread, and this returns only once that thread has left
    them: a thread still inside JAX's runtime when the interpreter exits is ended by
    ``pthread_exit``, whose unwinding through JAX's C++ frames aborts the process
    (``terminate called without an active exception``; docs/multiprocess.md). On None
    (no answer in ``wait`` s) the thread is still in there: end the process with
    :func:`leave` (``os._exit``, no interpreter shutdown), never a clean exit.
    """
    if not jax.distributed.is_initialized():
        return None
    everyone: set[int] = set(range(jax.process_count()))
    answer: dict[str, set[int]] = {}

    def ask() -> None:
        try:
            with multihost_utils.live_devices(jax.devices()) as alive:
                answer["live"] = {d.process_index for d in alive}
        except multihost_utils.ProcessFailureError as e:  # one died between the two asks
            gone = {d.process_index for d in e.failed_devices}
            answer["live"] = answer.get("live", everyone) - gone
        except Exception:  # noqa: BLE001 - the service itself is gone: rank 0 hosts it
            answer.setdefault("live", everyone - {0})

    thread = threading.Thread(target=ask, daemon=True, name="jaxzero-lost-ranks")
    thread.start()
    thread.join(wait)
    if thread.is_alive():
        return None
    return sorted(everyone - answer["live"]) if "live" in answer else None


def leave(status: int, error: BaseException | None = None) -> None:
    """Ends this process of a multi-process job now, naming lost ranks after a collective failed.

    Waiting in JAX's shutdown barrier would hang: the peers are blocked in a
    collective waiting for this process. Leaving closes its connections, so they
    fail fast (or see its heartbeats stop). No-op outside a multi-process job.
    """
    if _JOB is None or not jax.distributed.is_initialized():
        return
    if error is not None and type(error).__name__ == "JaxRuntimeError":
        wait = _JOB.heartbeat_timeout + 5
        print(
            f"jaxzero.distributed: rank {_JOB.rank}: a collective failed; asking the "
            f"coordinator which process is gone (up to {wait} s)",
            file=sys.stderr,
            flush=True,
        )
        lost = lost_ranks(wait)
        if lost:
            print(
                f"jaxzero.distributed: rank {_JOB.rank}: lost rank(s) "
                f"{', '.join(map(str, lost))} of {_JOB.world_size} (killed, crashed or "
                "unreachable); leaving the job",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"jaxzero.distributed: rank {_JOB.rank}: exiting with status {status}",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(status)


def _program_ended() -> None:
    """Tells ``jaxzero launch`` that this rank's program ended, as the interpreter exits.

    JAX's own exit hook then holds the process in a shutdown barrier until every
    process reaches it, so the launcher would otherwise learn nothing until the
    others end too (a minute later, or never if they wait for this one in a
    collective). Runs before that hook (atexit runs hooks in reverse order of
    registration, and JAX registers its hook when it is imported); does nothing
    after an explicit :func:`shutdown`, outside ``jaxzero launch``, or if the file
    cannot be written.
    """
    folder = os.environ.get(LAUNCH_EVENTS)
    if not folder or _JOB is None or not jax.distributed.is_initialized():
        return
    try:
        (Path(folder) / f"ended-{_JOB.rank}").write_text(f"{time.time()}\n")
    except OSError:
        pass


def _current_job() -> Job:
    return Job(
        "explicit" if jax.process_count() > 1 else "single",
        jax.process_index(),
        jax.process_count(),
    )


def _announce(job: Job, devices: list[Any]) -> None:
    """One line per process; a summary on rank 0 (stderr: stdout is the program's)."""
    local = jax.local_devices()
    ids = ",".join(str(d.id) for d in local)
    print(
        f"jaxzero.distributed: rank {job.rank} of {job.world_size} | local rank "
        f"{job.local_rank} of {job.local_world_size} | host {socket.gethostname()} "
        f"(pid {os.getpid()}) | {len(local)} local {local[0].platform} device(s) [{ids}] | "
        f"world size {job.world_size} processes, {len(devices)} devices",
        file=sys.stderr,
        flush=True,
    )
    if job.rank == 0:
        coll = " (gloo collectives)" if local[0].platform == "cpu" else ""
        source = job.named("host", "port") if job.mode == "explicit" else f"from {job.mode}"
        print(
            f"jaxzero.distributed: {describe_processes(job, len(local), len(devices))} | "
            f"coordinator {job.coordinator or 'auto'} ({source}) | {local[0].platform}{coll} | "
            f"heartbeat timeout {job.heartbeat_timeout} s",
            file=sys.stderr,
            flush=True,
        )


def describe_processes(job: Job, local_devices: int, devices: int) -> str:
    """``"2 processes x 2 local devices = 4 devices"`` (or the total when they differ)."""
    if job.world_size * local_devices == devices:
        return f"{job.world_size} process(es) x {local_devices} local device(s) = {devices} devices"
    return f"{job.world_size} processes, {devices} devices in all"


def describe_mesh(mesh: Any) -> str:
    """``"(replica=2, data=4): state sharded over 4, replicated over 2 groups"``; with a
    model axis, each layer split over its devices too."""
    axes = ", ".join(f"{a}={n}" for a, n in mesh.shape.items())
    text = f"mesh ({axes}): state sharded over {mesh_lib.num_shards(mesh)} device(s)"
    model = mesh_lib.model_shards(mesh)
    if model > 1:
        text += f", each layer split over {model} (tensor and sequence parallel)"
    replicas = mesh.size // mesh_lib.num_shards(mesh) // model
    if replicas > 1:
        text += f", replicated over {replicas} groups (hybrid)"
    return text


def shutdown() -> None:
    """Leaves the job cleanly (every process waits for the others); no-op if not joined."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
