"""The safetensors format, read memory-mapped and written streaming, without the library.

A file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and ``[begin, end)`` byte offsets into the data, plus optional string
``__metadata__``), then the raw little-endian bytes. Reading maps the data region,
so a tensor (or a slice of one) costs only the pages it touches; writing computes
the header first, which is what lets a model be written one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxzero.errors import Error

CODES = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F64": np.dtype(np.float64),
}
NAMES = {dt.name: code for code, dt in CODES.items()}  # numpy dtype name -> code


class SafetensorsError(Error, ValueError):
    """A file that is not a complete safetensors file; its message is one line."""


class SafetensorsFile:
    """The tensors of one file as read-only memory-mapped numpy views.

    Raises :class:`SafetensorsError` naming the file when it is not safetensors, is
    truncated, or holds a dtype jaxzero does not read.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise SafetensorsError(
                        f"{self.path}: header of {n} bytes in a file of "
                        f"{size}: truncated or not safetensors"
                    )
                header = json.loads(f.read(n))
        except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(
                f"{self.path} is not a readable safetensors file ({type(e).__name__})"
            ) from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: the header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict[str, Any]] = header
        self._start, data = 8 + n, size - 8 - n
        end = max((h["data_offsets"][1] for h in header.values()), default=0)
        if end > data:
            raise SafetensorsError(
                f"{self.path} is truncated: its header needs {end} bytes of "
                f"data, the file holds {data}"
            )
        for name, h in header.items():
            if h.get("dtype") not in CODES:
                raise SafetensorsError(
                    f"{self.path}: tensor {name} has dtype {h.get('dtype')}; "
                    f"jaxzero reads {sorted(CODES)}"
                )

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return CODES[self.header[name]["dtype"]]

    def tensor(self, name: str) -> np.ndarray:
        """A read-only memory map of one tensor: nothing is read until it is indexed or
        copied, and the mapping (with the pages it brought in) goes when it is dropped,
        so a reader going tensor by tensor holds one tensor's pages, not the file's."""
        h = self.header[name]
        begin, end = h["data_offsets"]
        dtype, shape = CODES[h["dtype"]], tuple(h["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise SafetensorsError(
                f"{self.path}: tensor {name} has {end - begin} bytes for "
                f"shape {shape} of {dtype.name}"
            )
        if not math.prod(shape):
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype, "r", offset=self._start + begin, shape=shape)


def header_bytes(
    entries: Iterable[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> bytes:
    """Length prefix + JSON header for tensors written back to back in ``entries`` order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": NAMES[np.dtype(dtype).name],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw


def write(
    path: Path,
    entries: list[tuple[str, np.dtype, tuple[int, ...]]],
    arrays: Iterator[np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Streams ``arrays`` (one per entry, in order) into ``path`` atomically; returns bytes."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header_bytes(entries, metadata))
            for (name, dtype, shape), x in zip(entries, arrays, strict=True):
                if x.dtype != dtype or x.shape != tuple(shape):
                    raise ValueError(
                        f"{name}: got {x.dtype}{x.shape}, header says {dtype}{tuple(shape)}"
                    )
                f.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)
                del x
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read_all(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a file, copied into memory."""
    f = SafetensorsFile(path)
    return {name: np.array(f.tensor(name)) for name in f.names()}
