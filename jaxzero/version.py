"""jaxzero's version, read from the installed package's metadata: pyproject.toml is its one source.

Checkpoints record it (``jaxzero_version`` in their metadata); ``jaxzero.__version__``
re-exports it. A source tree used without installing (no metadata) says ``0+unknown``.
"""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("jaxzero")
except importlib.metadata.PackageNotFoundError:  # imported from a tree pip never installed
    __version__ = "0+unknown"
