"""Token corpora: the source ``data.path`` names, read into a :class:`Corpus`.

Three sources are read: raw bytes (any text; vocab 256, no tokenizer to install),
nanoGPT-style token files, a flat ``uint16`` array written with ``ndarray.tofile``
(``train.bin``/``val.bin``), read through ``np.memmap`` so a corpus of billions of
tokens costs no RAM, and, with ``data.tokenizer``, text and JSONL through the cached
token store of :mod:`jaxzero.data.store` (documents packed with their EOS, and a loss
mask for prompt/completion data; windows then carry ``segment_ids`` and
``loss_mask``). With no path, the corpus is this Python's own standard library
sources: every machine that can run jaxzero has it.

The corpus type is :mod:`jaxzero.train.corpus`'s and the batches :mod:`jaxzero.train.loader`'s;
their names are read from here too (``data_lib.Loader``).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

from jaxzero.data import store as store_lib
from jaxzero.data.store import is_text, text_files
from jaxzero.data.tokenizer import Tokenizer, TokenizerError, unk_warning
from jaxzero.train.config import DataConfig
from jaxzero.train.corpus import (
    BYTE_VOCAB,
    Corpus,
    DataError,
    Kind,
    decode,
    encode,
    truncated,
    val_prompt,
)
from jaxzero.train.loader import (
    Loader,
    check_length,
    eval_batches,
    eval_starts,
    offsets,
    read_documents,
    read_windows,
)

__all__ = [  # the corpus type and the loader live beside, and are read from here too
    "BYTE_VOCAB",
    "TOKEN_SUFFIX",
    "Corpus",
    "DataError",
    "Kind",
    "Loader",
    "check_length",
    "cut_note",
    "data_kind",
    "decode",
    "encode",
    "eval_batches",
    "eval_starts",
    "load_corpus",
    "offsets",
    "read_documents",
    "read_files",
    "read_tokens",
    "read_windows",
    "split",
    "split_files",
    "stdlib_files",
    "truncated",
    "val_prompt",
    "write_tokens",
]

TOKEN_SUFFIX = ".bin"  # nanoGPT's uint16 token files


STDLIB_SKIP = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "encodings",
        "pydoc_data",
    }
)  # third-party code, test suites, and generated tables (codecs, pydoc topics)


def stdlib_files() -> list[Path]:
    """This interpreter's stdlib ``*.py`` files in a fixed pseudo-random order.

    Files are ordered by a hash of their relative path: a fixed shuffle, so a
    few-MB prefix samples the whole library (and the held-out tail is whole
    modules from all over it) rather than the modules whose names start with "a".
    Test suites and generated tables are skipped: they are repetitive enough to
    make a validation loss look better than the model is.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    key = lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest()
    return sorted(files, key=key)


def read_files(files: list[Path], max_bytes: int) -> list[bytes]:
    """The contents of ``files`` in order, each ending in a newline, ``max_bytes`` in all."""
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            data += b"\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return [c for c in chunks if c]


def split_files(chunks: list[bytes], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Holds out whole files: every k-th one, ``k = round(1 / val_fraction)``.

    Validation then samples files from all over the corpus rather than the few
    that happen to come last, one of which can be a table of data unlike the
    rest (``html/entities.py`` in the stdlib). A single file is split by its tail.
    """
    if len(chunks) < 2:
        return split(np.frombuffer(b"".join(chunks), np.uint8), val_fraction)
    k = max(2, round(1 / val_fraction))
    held = {i for i in range(len(chunks)) if i % k == k - 1} or {len(chunks) - 1}
    train = [c for i, c in enumerate(chunks) if i not in held]
    val = [c for i, c in enumerate(chunks) if i in held]
    return np.frombuffer(b"".join(train), np.uint8), np.frombuffer(b"".join(val), np.uint8)


def read_tokens(path: Path) -> np.ndarray:
    """A ``uint16`` token file as a read-only memmap (an empty file gives an empty array)."""
    if path.stat().st_size % 2:
        raise DataError(f"token file {str(path)!r} has an odd number of bytes: not uint16 tokens")
    if path.stat().st_size == 0:
        return np.zeros(0, np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r")


def write_tokens(path: str | Path, tokens: np.ndarray) -> None:
    """Writes tokens as a nanoGPT-style ``uint16`` file (values must fit in 16 bits)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise DataError(f"tokens must be in [0, 65535] for a uint16 file, got {tokens.max()}")
    tokens.astype(np.uint16).tofile(path)


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The head for training, the last ``val_fraction`` held out (a fixed split, no shuffle).

    A tail split keeps validation text unseen as whole files, rather than windows
    interleaved with training windows that share most of their bytes.
    """
    n_val = max(1, int(round(len(tokens) * val_fraction)))
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def data_kind(cfg: DataConfig) -> Kind:
    """Whether ``cfg`` names byte text or uint16 tokens, judged from the path alone.

    The one rule: :func:`load_corpus` branches on it, ``--print-config`` uses it to
    state the vocab size of byte data without reading any, and export and sample
    record it (``jaxzero.train.export.token_kind``). An explicit ``format`` wins;
    ``auto`` means tokens for a ``.bin`` file or a directory holding ``train.bin``.
    """
    if cfg.path is None or cfg.format == "bytes":
        return "bytes"
    if cfg.format == "uint16":
        return "uint16"
    path = Path(cfg.path).expanduser()
    if path.is_dir():
        return "uint16" if (path / "train.bin").is_file() else "bytes"
    return "uint16" if path.suffix == TOKEN_SUFFIX else "bytes"


def cut_note(read: int, total: int) -> str:
    """What ``data.max_bytes`` left out, for the banner ("" when it left out nothing)."""
    if read >= total:
        return ""
    return f", the first {read:,} of {total:,} bytes (data.max_bytes)"


def load_corpus(
    cfg: DataConfig, vocab_size: int | None = None, progress: bool | str = True
) -> Corpus:
    """Reads the corpus ``cfg`` names.

    Args:
      cfg: ``path`` None (stdlib sources), a text file, a directory of text
        files, a ``.bin`` token file, or a directory holding ``train.bin`` (and
        optionally ``val.bin``). ``format`` forces bytes or uint16 reading.
        ``max_bytes`` caps every text source (bytes or tokenized), not token files.
      vocab_size: for uint16 data, the model's vocab; None scans for the largest token.
      progress: how a token store being built shows its progress
        (:func:`jaxzero.data.store.build`).

    Returns:
      The train/validation :class:`Corpus`.

    Raises:
      DataError: the path does not exist, holds no tokens, or is a binary file read as text.
    """
    if cfg.tokenizer is not None:
        return _tokenized_corpus(cfg, vocab_size, progress)
    if cfg.path is None:
        files = stdlib_files()
        chunks = read_files(files, _cap(cfg))
        source = f"python stdlib sources ({sysconfig.get_paths()['stdlib']})"
        return _bytes_corpus(
            *split_files(chunks, cfg.val_fraction), source + _files_note(chunks, files)
        )
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise DataError(f"data path {str(path)!r} does not exist")
    kind = data_kind(cfg)
    if kind == "bytes" and cfg.format == "auto":
        candidates = [path] if path.is_file() else text_files(path)
        jsonl = [f for f in candidates if f.suffix in store_lib.JSONL_SUFFIXES]
        if jsonl:
            raise DataError(
                f"{str(jsonl[0])!r} is JSONL, which needs a tokenizer: give --tokenizer "
                "(a tokenizer.json or a model directory) or --init-from hf:DIR; without one "
                "it would be trained on as raw bytes, braces and keys included"
            )
    if path.is_dir():
        if kind == "uint16":
            if not (path / "train.bin").is_file():
                raise DataError(
                    f"data.format=uint16 reads a directory's train.bin (and "
                    f"val.bin), and {str(path)!r} has none: drop data.format to "
                    "train on its text files as bytes"
                )
            train = read_tokens(path / "train.bin")
            val_path = path / "val.bin"
            if val_path.is_file():
                return _token_corpus(train, read_tokens(val_path), vocab_size, str(path))
            return _token_corpus(*split(train, cfg.val_fraction), vocab_size, str(path))
        files = text_files(path)
        if not files:
            raise DataError(f"data directory {str(path)!r} holds no text files")
        chunks = read_files(files, _cap(cfg))
        return _bytes_corpus(
            *split_files(chunks, cfg.val_fraction),
            f"{len(files)} files in {path}" + _files_note(chunks, files),
        )
    if kind == "uint16":
        return _token_corpus(*split(read_tokens(path), cfg.val_fraction), vocab_size, str(path))
    if cfg.format == "auto" and not is_text(path):
        raise DataError(
            f"data file {str(path)!r} looks binary (a NUL byte in its first 8 KiB), like the "
            "files a data directory skips: give a text file, a uint16 token file (.bin), "
            "or --set data.format=bytes to train on its raw bytes"
        )
    size = path.stat().st_size
    data = np.memmap(path, np.uint8, "r") if size else np.zeros(0, np.uint8)
    data = data[: _cap(cfg)]
    return _bytes_corpus(*split(data, cfg.val_fraction), str(path) + cut_note(len(data), size))


def _cap(cfg: DataConfig) -> int:
    """``data.max_bytes`` as a slice bound (None: no cap)."""
    return cfg.max_bytes if cfg.max_bytes is not None else 1 << 62


def _files_note(chunks: list[bytes], files: list[Path]) -> str:
    """:func:`cut_note` of files read by :func:`read_files` (which ends each with a newline)."""
    return cut_note(sum(len(c) for c in chunks), sum(f.stat().st_size for f in files))


def _tokenized_corpus(cfg: DataConfig, vocab_size: int | None, progress: bool | str) -> Corpus:
    """Text or JSONL through a tokenizer, from the cached token store; the validation
    split is the tail of the document stream."""
    assert cfg.tokenizer is not None  # load_corpus comes here only with a tokenizer
    if cfg.path is None:
        raise DataError("data.tokenizer needs data.path (text files or JSONL)")
    try:
        tok = Tokenizer.load(cfg.tokenizer)
        store = store_lib.build(cfg.path, tok, progress, cfg.max_bytes)
    except (TokenizerError, store_lib.StoreError) as e:
        raise DataError(str(e)) from None
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise DataError(
            f"the tokenizer's vocabulary ({tok.vocab_size}) is larger than "
            f"model.vocab_size={vocab_size}: its ids would index past the embedding"
        )
    lengths = np.load(store.path / "lengths.npy")
    ends = np.cumsum(lengths)
    docs = np.stack([ends - lengths, ends], axis=1)
    if len(docs) < 2:
        raise DataError(f"{cfg.path} holds one document: a validation split needs two")
    n_val = min(len(docs) - 1, max(1, round(len(docs) * cfg.val_fraction)))
    cut = int(docs[-n_val, 0])  # the validation split starts at a document
    mask = store.mask
    meta = store.meta
    source = (
        f"{cfg.path} ({meta['documents']:,} documents, {tok.source}, EOS "
        f"{tok.describe_eos()}{cut_note(meta['bytes'], meta['total_bytes'])})"
    )
    share = meta["unk_tokens"] / max(1, meta["tokens"] - meta["documents"])  # EOS aside
    warning = unk_warning(tok, share, "the data")
    train_docs = val_docs = None
    if not cfg.packing:
        train_docs, val_docs = docs[:-n_val], docs[-n_val:] - cut
    return Corpus(
        store.tokens[:cut],
        store.tokens[cut:],
        "tokenizer",
        vocab_size or tok.vocab_size,
        source,
        None if mask is None else mask[:cut],
        None if mask is None else mask[cut:],
        tok.eos_id,
        tok,
        train_docs,
        val_docs,
        (warning,) if warning else (),
    )


def _bytes_corpus(train: np.ndarray, val: np.ndarray, source: str) -> Corpus:
    if len(train) == 0 or len(val) == 0:
        raise DataError(
            f"corpus {source} is empty or too small to split ({len(train) + len(val)} bytes)"
        )
    return Corpus(train, val, "bytes", BYTE_VOCAB, source)


def _token_corpus(
    train: np.ndarray, val: np.ndarray, vocab_size: int | None, source: str
) -> Corpus:
    if len(train) == 0 or len(val) == 0:
        raise DataError(f"token corpus {source} is empty (train {len(train)}, val {len(val)})")
    top = max(_max_token(train), _max_token(val)) + 1
    if vocab_size is not None and top > vocab_size:
        raise DataError(
            f"token corpus {source} holds token {top - 1} >= model.vocab_size {vocab_size}"
        )
    return Corpus(train, val, "uint16", vocab_size or top, source)


def _max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """Largest token, read in chunks so a memmap never materialises whole."""
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))
