"""The model directories jaxzero writes (``jaxzero export``, ``jaxzero.hf.save``): what
they carry, what they may replace, and how they reach their name.

One owner for three rules, so the command line and the Python API cannot drift apart:

* **Tokenizer files.** :data:`TOKENIZER_FILES` and :data:`TOKENIZER_DIRS` are every
  file ``transformers`` reads a tokenizer and its chat templates from
  (``chat_template.jinja`` and ``additional_chat_templates/`` since ``transformers`` 5);
  both writers copy exactly these.
* **What may be replaced.** A directory jaxzero wrote holds a small manifest
  (:data:`MANIFEST`) naming its files. An existing target is replaced without asking
  only when it is empty or holds nothing but such a manifest's files; anything else
  (a downloaded model, a README beside an old export) needs an explicit overwrite. The
  directories a write reads from (a run's base model, its checkpoints, its tokenizer)
  are never replaced, overwrite or not.
* **Whole or nothing.** The new directory is built beside its target and moved into
  place only once complete, so a failed or interrupted write leaves the old directory
  (or none) under the name, never part of a model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

from jaxzero.errors import Error

# The one list of tokenizer files (data/tokenizer.py reads its names from here).
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers' CHAT_TEMPLATE_FILE: the default template
TEMPLATE_DIR = "additional_chat_templates"  # transformers' CHAT_TEMPLATE_DIR: <name>.jinja each
# the files transformers' AutoTokenizer.save_pretrained writes (any tokenizer class)
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    TEMPLATE_FILE,
    "chat_template.json",
)
TOKENIZER_DIRS = (TEMPLATE_DIR,)  # transformers 5: one .jinja per named template
MANIFEST = "jaxzero-export.json"


class ModelDirError(Error, ValueError):
    """A target jaxzero may not write or replace; its message is one line."""


def _names(entries: list[str], at_most: int = 8) -> str:
    shown = ", ".join(sorted(entries)[:at_most])
    return shown + (f" and {len(entries) - at_most} more" if len(entries) > at_most else "")


def foreign_entries(path: Path) -> list[str]:
    """The entries of directory ``path`` that no jaxzero manifest there accounts for
    (all of them when it has no readable manifest); ``[]`` for an absent directory."""
    if not path.is_dir():
        return []
    entries = [p.name for p in path.iterdir()]
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        ours = set(manifest["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        return entries
    return [e for e in entries if e not in ours]


def _within(inner: Path, outer: Path) -> bool:
    inner, outer = inner.resolve(), outer.resolve()
    return inner == outer or outer in inner.parents


def check_target(
    path: Path,
    overwrite: bool,
    protected: Mapping[str, Path | None] | None = None,
    flag: str = "overwrite=True",
) -> list[str]:
    """Refuses (:class:`ModelDirError`) a target a write may not replace; returns the
    entries an ``overwrite`` will delete that jaxzero did not write.

    ``protected`` maps a description (``"the run's base model"``) to a directory the
    write reads from: ``path`` may be neither it nor a directory holding it. ``flag``
    is how the caller's user asks to overwrite (``--overwrite`` on the command line).
    """
    hits = [
        (what, source)
        for what, source in (protected or {}).items()
        if source is not None and source.exists() and _within(source, path)
    ]
    if hits:  # name the source that is the target, else the outermost one it holds
        what, source = min(hits, key=lambda h: len(h[1].resolve().parts))
        where = "is" if source.resolve() == path.resolve() else "holds"
        raise ModelDirError(
            f"{path} {where} {what} ({source}): jaxzero never replaces it, "
            f"even with {flag}; choose another output directory"
        )
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ModelDirError(
            f"{path} is a file or a link, not a directory: choose another output directory"
        )
    foreign = foreign_entries(path)
    if foreign and not overwrite:
        raise ModelDirError(
            f"{path} holds files jaxzero did not write ({_names(foreign)}): "
            f"choose another output directory, or pass {flag} to replace the whole "
            "directory, deleting them"
        )
    return foreign


def describe_replaced(path: Path, foreign: list[str]) -> str:
    """The line that says what an overwrite deleted."""
    return f"replaced {path}, deleting what jaxzero had not written there: {_names(foreign)}"


def tokenizer_files(source: Path | None, required: bool = False) -> list[tuple[Path, str]]:
    """``(file or folder, name in the output)`` for the tokenizer at ``source``.

    ``source`` is a directory (its :data:`TOKENIZER_FILES` and :data:`TOKENIZER_DIRS`)
    or a ``tokenizer.json`` under any name (copied as ``tokenizer.json``, with the
    other tokenizer files beside it). ``required``: a source that holds none is an
    error (a run whose tokenizer was moved away), not an export without one.
    """
    if source is None:
        return []
    source = Path(source).expanduser()
    folder = source if source.is_dir() else source.parent
    found = [(folder / n, n) for n in TOKENIZER_FILES if (folder / n).is_file()]
    found += [(folder / n, n) for n in TOKENIZER_DIRS if (folder / n).is_dir()]
    if source.is_file():
        found = [(f, n) for f, n in found if n != "tokenizer.json"]
        found.insert(0, (source, "tokenizer.json"))
    if required and not any(n == "tokenizer.json" for _, n in found):
        raise ModelDirError(
            f"the run's tokenizer {source} is gone: an export needs it beside the "
            "weights (put it back, or give the run config the tokenizer's new place)"
        )
    return found


def copy_tokenizer(files: list[tuple[Path, str]], out: Path) -> None:
    """Copies what :func:`tokenizer_files` found into ``out``."""
    for src, name in files:
        if src.is_dir():
            shutil.copytree(src, out / name)
        else:
            shutil.copyfile(src, out / name)


@contextlib.contextmanager
def staged(path: Path, format: str) -> Iterator[Path]:
    """Yields an empty directory beside ``path`` to fill; once the block ends without an
    error it gets a manifest and replaces ``path`` (whatever was there goes only then).

    Call :func:`check_target` first. On an error nothing under ``path`` changes.
    """
    path = Path(os.path.abspath(path))
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    old = path.with_name(f".{path.name}.replaced-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        files = sorted(p.name for p in tmp.iterdir())
        manifest = {"written_by": "jaxzero", "format": format, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)  # out of the way; the name is empty for one rename only
            try:
                os.replace(tmp, path)
            except OSError:
                old.rename(path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
