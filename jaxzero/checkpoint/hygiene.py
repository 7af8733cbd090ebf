"""Process hygiene around orbax: saves finished at exit, its echoes kept off the console,
and a host-only reader process.

orbax writes in background threads and logs a failure on several of them; these keep a
script's last save and keep one failure one message.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook first: see finish_saves
import ctypes
import logging
import os
import sys
import threading
from typing import Any

import jax

# managers with a save that may be in flight, held so that one dropped right after
# save() (``CheckpointManager(d).save(...)``) still completes it
SAVING: set[Any] = set()


def finish_saves() -> None:
    """Complete the saves still in flight, as the interpreter begins to exit.

    orbax writes in a background thread through ``concurrent.futures`` pools, which
    refuse new work once the interpreter starts shutting down; a script that saved
    and ended without ``wait()`` then lost its checkpoint amid "cannot schedule new
    futures after shutdown" / "Event loop is closed" tracebacks. This runs before the
    pools stop: Python's ``threading`` calls its exit hooks in reverse order of
    registration, and ``concurrent.futures`` registers its own on import, before ours.
    """
    for manager in list(SAVING):
        try:
            manager.close()
        except Exception as e:  # noqa: BLE001 - at exit: say it in one line, go on
            print(
                f"jaxzero: the checkpoint save in flight in {manager.directory} did not "
                f"finish: {type(e).__name__}: {e}",
                file=sys.stderr,
            )


# threading's exit hooks run in reverse order of registration, so ours runs before the
# pools' own (registered when concurrent.futures.thread is first imported, just above);
# atexit's hooks would run only after the pools stopped
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(finish_saves)


class Echoes(logging.Filter):
    """Keeps orbax's echoes of a failure jaxzero already reports off the console.

    orbax reads and writes leaves concurrently on a private event loop and closes it
    as soon as one operation fails; the operations still in flight finish moments
    later on tensorstore's threads and report to the closed loop ("Event loop is
    closed", "Task/Future exception was never retrieved"). A save that fails in the
    background is also logged, with its traceback, by each of orbax's threads before
    the next ``wait``/``save`` raises it, which :class:`CheckpointManager` turns into
    one :class:`CheckpointWriteError`. Installed once, when the first manager opens;
    every other message passes through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return "exception was never retrieved" not in record.getMessage()  # Task, Future
        # orbax's own report of a save in flight failing: the next wait() raises it
        return not (SAVING and record.levelno >= logging.ERROR and "orbax" in record.pathname)

    @classmethod
    def install(cls) -> None:
        if getattr(sys.unraisablehook, "_jaxzero", False):
            return
        previous = sys.unraisablehook

        def hook(u: Any) -> None:
            if not (
                isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value)
            ):
                previous(u)

        hook._jaxzero = True  # type: ignore[attr-defined]
        sys.unraisablehook = hook
        echoes = cls()
        for name in ("asyncio", "absl"):
            logging.getLogger(name).addFilter(echoes)


def host_reader_process() -> None:
    """Set up a process that streams checkpoints on the host (``jaxzero export``).

    * JAX on the CPU, unless ``JAX_PLATFORMS`` says otherwise: orbax starts JAX's
      backend (for the process index), and a GPU backend would take most of the GPU's
      memory, perhaps from the run that wrote the checkpoint.
    * glibc's malloc limited to one arena: tensorstore allocates each leaf on one of
      its threads, and each thread's arena kept its freed leaves, so memory grew to
      about a leaf per arena (measured: 6 of 12 16-MiB leaves held after an export on
      two cores; glibc allows 8 arenas a core) instead of staying at a few leaves.

    Call it first: a backend already started stays, and threads that already have an
    arena keep it. Elsewhere than glibc the second part does nothing.
    """
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    try:
        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX (malloc.h)
    except (AttributeError, OSError):
        pass
