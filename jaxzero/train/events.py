"""TensorBoard event files written unbuffered, so that every logged step is on disk.

tensorboardX is imported where it is used: it takes about 0.1 s to import (measured beside
``import jaxzero``), which ``--help``, ``jaxzero plot`` and runs with logging.tensorboard
off need not pay.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO


class EventFile:
    """A TensorBoard event file (a TFRecord of ``Event`` protos), written unbuffered.

    Each record is on disk when :meth:`write` returns, and a write that fails raises
    there with the file's name, leaving nothing buffered to fail again when the
    file is collected. The protos and checksum are tensorboardX's.
    """

    def __init__(self, run_dir: Path):
        from tensorboardX.proto.event_pb2 import Event

        self.path = run_dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        with naming(self.path):
            self._file = open(self.path, "ab", buffering=0)
        self._record(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, summary: Any, step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self._record(Event(summary=summary, step=step, wall_time=time.time()))

    def _record(self, event: Any) -> None:
        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        write_all(
            self._file,
            self.path,
            header
            + struct.pack("<I", masked_crc32c(header))
            + data
            + struct.pack("<I", masked_crc32c(data)),
        )

    def close(self) -> None:
        self._file.close()


def write_all(file: BinaryIO, path: Path, data: bytes) -> None:
    """All of ``data`` to an unbuffered ``file``: on disk when this returns, and nothing
    left in a buffer to fail again at close when a write fails (a full disk)."""
    view = memoryview(data)
    with naming(path):
        while view:
            view = view[file.write(view) :]


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Re-raises an OSError of a write (which names no file: a full disk) naming ``path``."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
