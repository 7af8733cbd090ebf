"""Progress of a long data step (building a token store): a tqdm bar on a terminal, else
plain lines every ``LINE_EVERY`` seconds, so that a log file or a pipe is never silent."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

LINE_EVERY = 10.0  # seconds between progress lines when the output is not a terminal


class Meter:
    """Tokenizing progress: a tqdm bar on a terminal, else a line every ``LINE_EVERY``
    seconds, so that a long build is never silence."""

    def __init__(self, total: int, mode: bool | str, what: str, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        if isinstance(mode, bool):
            mode = "auto" if mode else "none"
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode, self.total, self.n = mode, total, 0
        self.start = self.last = time.monotonic()
        self.bar = None
        if mode == "bar":
            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc="tokenizing",
                leave=False,
                file=self.stream,
                dynamic_ncols=True,
            )
        elif mode == "lines":
            self._line(f"tokenizing {what} ({_mb(total)}), once: the tokens are cached")

    def _line(self, text: str) -> None:
        print(f"  {text}", file=self.stream, flush=True)

    def update(self, n: int) -> None:
        """Advances to ``n`` bytes read."""
        self.n = n
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
        elif self.mode == "lines" and time.monotonic() - self.last >= LINE_EVERY:
            self.last = time.monotonic()
            rate = n / max(self.last - self.start, 1e-9)
            self._line(
                f"tokenizing: {_mb(n)} of {_mb(self.total)} ({n / max(self.total, 1):.0%}), "
                f"{_mb(rate)}/s"
            )

    def close(self, summary: str) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.mode == "lines":
            self._line(f"{summary} in {time.monotonic() - self.start:.1f}s")


def _mb(n: float) -> str:
    return tqdm.format_sizeof(n, "B")  # as the bar writes sizes: 300B, 11.0kB, 65.4MB
