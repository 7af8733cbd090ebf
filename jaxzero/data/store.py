"""Documents tokenized once into a cached, memory-mapped token store beside the data.

Sources: text files (a file is a document, read a megabyte of whole lines at a time)
and JSONL, one document a line, as ``{"text": ...}``, ``{"prompt": ...,
"completion": ...}`` or a chat ``{"messages": [...]}`` rendered with the tokenizer's
chat template (the last assistant turn is the completion); a line holding two of these
forms is refused. Every document ends with the tokenizer's EOS, so packed windows know
their boundaries. Prompt tokens carry no loss: a ``mask.bin`` beside ``tokens.bin`` holds
1 for every token a loss is taken on (the completion and its EOS).

The store is streamed: lines are read and tokenized a batch at a time (the
``tokenizers`` library spreads a batch over every core) and appended to the files,
so a corpus of any size costs one batch of Python objects. ``max_bytes`` reads only the
whole lines within that many bytes of the sources. It lives in
``<data>.jaxzero-tokens/<key>/``, the key a hash of everything that changes the tokens:
the sources (path, size, modification time), the tokenizer's fingerprint
(``tokenizer.json``, EOS and BOS, the chat template used), the ``max_bytes`` cut, and this
format; anything else is a new store, and a store is renamed into place only once complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from jaxzero.data.progress import Meter
from jaxzero.data.tokenizer import CONFIG, TEMPLATE_DIR, TEMPLATE_FILE, Tokenizer
from jaxzero.errors import Error

VERSION = 2  # 2: the key covers the EOS, BOS, chat template and max_bytes
BATCH = 512  # documents tokenized at once


class StoreError(Error, ValueError):
    """Data that cannot be tokenized; its message is one line (file and line number)."""


@dataclass(frozen=True)
class Document:
    """A document, or a piece of a long text file (``eos`` False but on its last)."""

    prompt: str  # no loss on it ("" for plain text)
    text: str  # the loss is taken on it, and on the EOS after it
    eos: bool = True


PIECE = 1 << 20  # a text file is read and tokenized a megabyte of whole lines at a time
FORMS = {
    "text": ("text",),
    "prompt/completion": ("prompt", "completion"),
    "messages": ("messages",),
}


@dataclass(frozen=True)
class TokenStore:
    """An opened store: ``tokens`` and ``mask`` (None: every token counts) memory-mapped."""

    path: Path
    tokens: np.ndarray
    mask: np.ndarray | None
    meta: dict[str, Any]

    @classmethod
    def open(cls, path: Path) -> TokenStore:
        meta = json.loads((path / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        tokens = (
            np.memmap(path / "tokens.bin", dtype, "r") if meta["tokens"] else np.zeros(0, dtype)
        )
        mask = None
        if meta["masked"]:
            mask = np.memmap(path / "mask.bin", np.uint8, "r") if meta["tokens"] else None
        return cls(path, tokens, mask, meta)


def sources_of(path: Path) -> list[Path]:
    """The files of a data path: itself, or a directory's ``.jsonl``/text files, sorted."""
    if path.is_file():
        return [path]
    return sorted(text_files(path))


def text_files(directory: Path) -> list[Path]:
    """Non-hidden regular files under ``directory`` that look like text, sorted."""
    files = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).parts
        if p.is_file() and not any(part.startswith(".") for part in rel) and is_text(p):
            files.append(p)
    return files


def is_text(path: Path) -> bool:
    """Binary files (a NUL byte in the first 8 KiB) are skipped, like ``grep -I``."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


JSONL_SUFFIXES = (".jsonl", ".ndjson")  # one JSON document a line


def _is_jsonl(path: Path) -> bool:
    return path.suffix in JSONL_SUFFIXES


def _render_chat(tok: Tokenizer, messages: Any, where: str) -> Document:
    if not tok.chat_template:
        home = str(Path(tok.source).parent) if tok.source else "the tokenizer"
        if tok.templates:  # named templates, none of them the default
            raise StoreError(
                f"{where}: a 'messages' line needs a default chat template, and {home} has "
                f"only named ones ({', '.join(sorted(tok.templates))}, in "
                f"{tok.template_source}): add {TEMPLATE_FILE}"
            )
        raise StoreError(
            f"{where}: a 'messages' line needs a tokenizer with a chat template ({home} has "
            f"none: no {TEMPLATE_FILE}, {TEMPLATE_DIR}/ or chat_template in {CONFIG})"
        )
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
        or messages[-1]["role"] != "assistant"
    ):
        raise StoreError(
            f"{where}: 'messages' must be a list of {{role, content}} ending with "
            "an assistant turn (the completion)"
        )
    try:  # here: 0.08 s to import (measured beside `import jaxzero`), for chat data only
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise StoreError("chat templates need jinja2 (pip install jinja2)") from None

    def raise_exception(message: str) -> None:  # what templates call to refuse a chat
        raise jinja2.TemplateError(message)

    # as transformers renders them: sandboxed, trim_blocks and lstrip_blocks on
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        prompt = env.from_string(tok.chat_template).render(
            messages=messages[:-1],
            add_generation_prompt=True,
            eos_token=tok.eos_token,
            bos_token=tok.bos_token,
            raise_exception=raise_exception,
        )
    except jinja2.TemplateError as e:
        raise StoreError(f"{where}: the chat template failed ({e})") from None
    return Document(prompt, messages[-1]["content"])


def documents(
    path: Path, tok: Tokenizer, limit: int | None = None
) -> Iterator[tuple[Document, int]]:
    """``(document, bytes read so far)`` of one source file, streamed; with ``limit``, only
    the whole lines within its first ``limit`` bytes."""
    if not _is_jsonl(path):  # one document, streamed in pieces that end at a newline
        done, piece, size, cut = 0, [], 0, False
        with open(path, "rb") as f:
            for line in f:
                if limit is not None and done + len(line) > limit:
                    cut = True
                    break
                piece.append(line)
                done += len(line)
                size += len(line)
                if size >= PIECE:
                    yield Document("", b"".join(piece).decode(errors="replace"), False), done
                    piece, size = [], 0
        if done or not cut:  # a file cut before its first line gives no document
            yield Document("", b"".join(piece).decode(errors="replace")), done
        return
    done = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and done + len(line) > limit:
                return
            done += len(line)
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as e:  # UnicodeDecodeError too: a line that is not UTF-8
                why = e.msg if isinstance(e, json.JSONDecodeError) else e
                raise StoreError(f"{where}: not JSON ({why})") from None
            if not isinstance(row, dict):
                raise StoreError(f"{where}: a line must be a JSON object")
            forms = [name for name, keys in FORMS.items() if any(k in row for k in keys)]
            if len(forms) > 1:  # which one to train on is the user's call, not ours
                raise StoreError(
                    f"{where}: holds both {' and '.join(repr(f) for f in forms)}: keep one form "
                    "a line ('text' takes a loss on every token, 'prompt'/'completion' on the "
                    "completion only)"
                )
            if isinstance(row.get("text"), str):
                yield Document("", row["text"]), done
            elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
                yield Document(row["prompt"], row["completion"]), done
            elif "messages" in row:
                yield _render_chat(tok, row["messages"], where), done
            else:
                raise StoreError(
                    f"{where}: needs a string 'text', 'prompt' and 'completion', or "
                    f"'messages' (found {', '.join(sorted(row)) or 'nothing'})"
                )


def store_key(files: list[Path], tok: Tokenizer, limit: int | None = None) -> str:
    """Everything that changes the tokens: the sources, the tokenizer's fingerprint (its
    file, EOS, BOS and chat template), the ``max_bytes`` cut (None: whole files), the format."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    blob = json.dumps([VERSION, stats, tok.fingerprint, limit]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_root(path: Path) -> Path:
    path = path.resolve()
    return path.parent / f"{path.name}.jaxzero-tokens"


def build(
    path: str | Path,
    tok: Tokenizer,
    progress: bool | str = True,
    max_bytes: int | None = None,
) -> TokenStore:
    """The store of ``path`` for ``tok``: opened from the cache, or tokenized now.

    ``progress``: ``"bar"`` (tqdm), ``"lines"`` (one every ``progress.LINE_EVERY`` s),
    ``"none"``/False, or ``"auto"``/True (a bar on a terminal, lines otherwise).
    ``max_bytes``: read only the whole lines (JSONL: documents) within that many bytes of
    the sources, in order (None: everything).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise StoreError(f"data path {str(path)!r} does not exist")
    files = sources_of(path)
    if not files:
        raise StoreError(f"data directory {str(path)!r} holds no text or JSONL files")
    total = sum(f.stat().st_size for f in files)
    limit = max_bytes if max_bytes is not None and max_bytes < total else None
    root = cache_root(path)
    out = root / store_key(files, tok, limit)
    if (out / "meta.json").is_file():
        return TokenStore.open(out)
    tmp = root / f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(files, tok, tmp, progress, limit)
        os.replace(tmp, out)
    except FileExistsError:
        pass  # another process finished the same store first
    except OSError as e:
        if not (out / "meta.json").is_file():
            raise StoreError(f"cannot write the token store {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in root.iterdir():  # older stores of other sources or tokenizers
        if stale.is_dir() and stale.name != out.name and not stale.name.startswith("."):
            shutil.rmtree(stale, ignore_errors=True)
        elif _abandoned(stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    return TokenStore.open(out)


def _abandoned(name: str) -> bool:
    """A partial store of a build on this host whose process is gone (killed mid-build):
    builds on other hosts sharing the file system are never touched."""
    host, _, pid = name.rpartition(".partial-")[2].rpartition("-")
    if ".partial-" not in name or host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


@dataclass
class _Tally:
    """What the documents written so far add up to."""

    tokens: int = 0
    docs: int = 0
    current: int = 0  # tokens so far of the document being written
    unk: int = 0
    masked: bool = False  # some document has a prompt (no loss on it)
    read: int = 0  # bytes of the sources read
    lengths: list[int] = field(default_factory=list)  # tokens of each whole document


def _append(batch: list[Document], tok: Tokenizer, ft: BinaryIO, fm: BinaryIO, t: _Tally) -> None:
    """Tokenizes ``batch`` and appends its tokens to ``ft``, its loss mask to ``fm``."""
    prompts = tok.encode_batch([d.prompt for d in batch])
    texts = tok.encode_batch([d.text for d in batch])
    for d, p, x in zip(batch, prompts, texts, strict=True):
        ids = np.asarray(p + x + [tok.eos_id] * d.eos, tok.dtype)
        ft.write(ids.tobytes())
        mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(ids) - len(p), np.uint8)])
        fm.write(mask.tobytes())  # no loss on the prompt
        t.masked |= bool(p)
        if tok.unk_id is not None:  # the EOS is never unknown
            t.unk += int(np.count_nonzero(ids[: len(ids) - d.eos] == tok.unk_id))
        t.tokens += len(ids)
        t.current += len(ids)
        if d.eos:
            t.docs += 1
            t.lengths.append(t.current)
            t.current = 0


def _write(
    files: list[Path], tok: Tokenizer, out: Path, progress: bool | str, limit: int | None = None
) -> None:
    total = sum(f.stat().st_size for f in files)
    what = str(files[0]) if len(files) == 1 else f"{len(files)} files in {files[0].parent}"
    bar = Meter(total if limit is None else limit, progress, what)
    t = _Tally()
    with open(out / "tokens.bin", "wb") as ft, open(out / "mask.bin", "wb") as fm:
        for file in files:
            left = None if limit is None else limit - t.read
            if left is not None and left <= 0:
                break
            batch: list[Document] = []
            done = 0
            for doc, done in documents(file, tok, left):
                batch.append(doc)
                if len(batch) == BATCH:
                    _append(batch, tok, ft, fm, t)
                    batch = []
                bar.update(t.read + done)
            if batch:
                _append(batch, tok, ft, fm, t)
            t.read += done if left is not None else file.stat().st_size
            bar.update(t.read)
    bar.close(f"tokenized {t.docs:,} documents, {t.tokens:,} tokens")
    if t.docs == 0:
        where = ", ".join(map(str, files[:3]))
        if limit is not None:
            raise StoreError(
                f"no whole document within data.max_bytes={limit:,} bytes of {where}: "
                "raise data.max_bytes"
            )
        raise StoreError(f"no documents in {where}")
    if not t.masked:
        (out / "mask.bin").unlink()
    np.save(out / "lengths.npy", np.asarray(t.lengths, np.int64))
    meta = _meta(files, tok, t, total, limit)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")  # last: complete


def _meta(files: list[Path], tok: Tokenizer, t: _Tally, total: int, limit: int | None) -> dict:
    """The store's ``meta.json``: what it holds, from which sources, through which tokenizer."""
    lens = np.asarray(t.lengths, np.int64)
    return {
        "version": VERSION,
        "dtype": tok.dtype.name,
        "tokens": t.tokens,
        "documents": t.docs,
        "masked": t.masked,
        "eos_id": tok.eos_id,
        "eos_token": tok.eos_token,
        "unk_tokens": t.unk,
        "bytes": t.read,  # of the sources' total_bytes; fewer when max_bytes cut them
        "total_bytes": total,
        "max_bytes": limit,
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.source,
        "tokenizer_fingerprint": tok.fingerprint,
        "sources": [str(f) for f in files],
        "document_tokens": {
            "mean": float(lens.mean()),
            "max": int(lens.max()),
            "min": int(lens.min()),
        },
    }


def real_fraction(store: TokenStore, seq_len: int) -> float:
    """The fraction of a row's tokens that are real if each document had a row of its
    own (padded, longer ones cut); packed windows (what the loader reads) are all real."""
    lens = np.load(store.path / "lengths.npy")
    return float(np.minimum(lens, seq_len + 1).sum() / (len(lens) * (seq_len + 1)))
