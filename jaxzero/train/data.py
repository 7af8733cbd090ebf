"""Token corpora and a deterministic, resumable, per-process batch loader.

Three sources are read: raw bytes (any text; vocab 256, no tokenizer to install),
nanoGPT-style token files, a flat ``uint16`` array written with ``ndarray.tofile``
(``train.bin``/``val.bin``), read through ``np.memmap`` so a corpus of billions of
tokens costs no RAM, and, with ``data.tokenizer``, text and JSONL through the cached
token store of :mod:`jaxzero.data.store` (documents packed with their EOS, and a loss
mask for prompt/completion data; windows then carry ``segment_ids`` and
``loss_mask``). With no path, the corpus is this Python's own standard library
sources: every machine that can run jaxzero has it.

Batches are windows of ``seq_len + 1`` tokens at offsets drawn from
``numpy.random.default_rng((seed, step))``. The batch of a step is therefore a
pure function of ``(seed, step)``: the loader's whole position is one integer,
which makes save/restore exact, and a process computes all ``B`` offsets (cheap)
but reads only the rows its devices hold.

Why not grain: grain gives deterministic, checkpointable, per-process-sharded
pipelines with worker processes, and is the right tool for record datasets
with decoding and augmentation. Here a "record" is a random crop of one flat
token array, reading it is a memmap slice, and the state is one integer; grain
would add a dependency and worker machinery (and its record-index sampling
does not express random crops of a stream) for nothing this module lacks: a packed,
masked batch of 32 x 1024 tokens takes 0.5 ms here (``experiments/bench_tokenize.py``).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jaxzero.data import store as store_lib
from jaxzero.data.store import is_text, text_files
from jaxzero.data.tokenizer import Tokenizer, TokenizerError, unk_warning
from jaxzero.errors import Error
from jaxzero.train.config import DataConfig

TOKEN_SUFFIX = ".bin"  # nanoGPT's uint16 token files
BYTE_VOCAB = 256
Kind = Literal["bytes", "uint16", "tokenizer"]


class DataError(Error, ValueError):
    """A data problem the user must fix; its message is one line."""


@dataclass(frozen=True)
class Corpus:
    """A train and a validation token stream, and how to read them.

    Attributes:
      train: 1-D ``uint8`` (bytes) or ``uint16`` array, possibly a memmap.
      val: like ``train``, held out.
      kind: ``"bytes"`` or ``"uint16"``.
      vocab_size: tokens are in ``[0, vocab_size)``.
      source: a short human description (for logs and the run config).
    """

    train: np.ndarray
    val: np.ndarray
    kind: Kind
    vocab_size: int
    source: str
    train_mask: np.ndarray | None = None  # 1 where a loss is taken (None: everywhere)
    val_mask: np.ndarray | None = None
    eos: int | None = None  # separates packed documents (tokenizer data)
    tokenizer: Any = None  # a jaxzero.data.tokenizer.Tokenizer for tokenizer data
    train_docs: np.ndarray | None = None  # [n, 2] document start/end (packing off only)
    val_docs: np.ndarray | None = None
    warnings: tuple[str, ...] = ()  # said once, under the banner's data line


# --------------------------------------------------------------------------- reading


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


def truncated(docs: np.ndarray | None, seq_len: int) -> int:
    """Documents longer than a row (``seq_len + 1`` tokens), cut when packing is off."""
    return 0 if docs is None else int(np.sum(docs[:, 1] - docs[:, 0] > seq_len + 1))


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


def decode(tokens: np.ndarray, kind: str, tokenizer: Any = None) -> str:
    """Text of byte tokens or through ``tokenizer``; ids without one are printed as ids."""
    tokens = np.asarray(tokens).reshape(-1)
    if tokenizer is not None:
        return tokenizer.decode(tokens)
    if kind == "bytes":
        return bytes(tokens.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
    return " ".join(str(int(t)) for t in tokens)


def encode(text: str, kind: Kind, tokenizer: Any = None) -> np.ndarray:
    """Byte tokens of ``text``, or through ``tokenizer``; for uint16 data (no tokenizer)
    an empty prompt."""
    if tokenizer is not None:
        return np.asarray(tokenizer.encode(text), np.int32)
    if kind == "bytes":
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    return np.zeros(0, np.int32)


def val_prompt(corpus: Corpus, max_tokens: int = 32, window: int = 1 << 16) -> np.ndarray:
    """The sample prompt of ``logging.sample_prompt: null``: the first validation document's
    start, text the model did not train on and in the shape the data has.

    With a loss mask (prompt/completion and chat data) it is the document's prompt, the
    tokens before the first one a loss is taken on, so the model writes the reply;
    otherwise its first ``max_tokens`` tokens, at most half of it, so the model goes on
    with it. Only the first ``window`` tokens of the split are read.
    """
    head = np.asarray(corpus.val[:window], np.int32)
    if corpus.eos is not None:
        ends = np.flatnonzero(head == corpus.eos)
        head = head[: ends[0]] if ends.size else head
    if corpus.val_mask is not None and head.size:
        trained = np.flatnonzero(np.asarray(corpus.val_mask[: head.size]))
        if trained.size and trained[0] > 0:
            return head[: trained[0]]
    prompt = head[: min(max_tokens, head.size // 2)]
    return prompt if prompt.size else np.asarray(corpus.val[:1], np.int32)


# --------------------------------------------------------------------------- batching


def check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    """A window needs ``seq_len + 1`` tokens (inputs and shifted targets)."""
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"model.seq_len={seq_len} needs at least {seq_len + 1} tokens, but the "
            f"{what} split has {len(tokens)}: lower model.seq_len or give more data"
            + (" (or raise data.val_fraction)" if what == "validation" else "")
        )


def offsets(num_tokens: int, seq_len: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Start offsets of the ``batch_size`` windows of global step ``step`` (all processes agree)."""
    rng = np.random.default_rng((seed, step))
    return rng.integers(0, num_tokens - seq_len, size=batch_size, dtype=np.int64)


def read_windows(
    tokens: np.ndarray,
    starts: np.ndarray,
    seq_len: int,
    mask: np.ndarray | None = None,
    eos: int | None = None,
) -> dict[str, np.ndarray]:
    """``{"inputs", "targets"}`` int32 ``[len(starts), seq_len]``: windows and their shift.

    With ``eos`` (packed documents) also ``segment_ids``: a document's tokens share one,
    its EOS included, so attention stays inside it and positions restart after it. With
    ``mask`` also ``loss_mask``: 1 where the target token carries a loss.
    """
    take = lambda a: (
        np.stack([np.asarray(a[s : s + seq_len + 1]) for s in starts])
        if len(starts)
        else np.zeros((0, seq_len + 1), a.dtype)
    )
    rows = take(tokens).astype(np.int32)
    out = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    if eos is not None:
        ends = (out["inputs"] == eos).astype(np.int32)
        out["segment_ids"] = np.cumsum(ends, axis=1) - ends  # the EOS ends its own segment
    if mask is not None:
        out["loss_mask"] = take(mask)[:, 1:].astype(np.int32)
    return out


def read_documents(
    tokens: np.ndarray, docs: np.ndarray, seq_len: int, mask: np.ndarray | None, eos: int | None
) -> dict[str, np.ndarray]:
    """One document a row (packing off): cut at ``seq_len + 1`` tokens, padded with EOS.
    The padding carries no loss and a segment of its own."""
    if eos is None:
        raise ValueError("documents a row (packing off) need eos: the token that pads a row")
    rows = np.full((len(docs), seq_len + 1), eos, np.int32)
    loss = np.zeros((len(docs), seq_len + 1), np.int32)  # 0 on the padding
    pad = np.ones((len(docs), seq_len + 1), np.int32)
    for i, (start, end) in enumerate(docs):
        n = min(int(end - start), seq_len + 1)
        rows[i, :n] = tokens[start : start + n]
        loss[i, :n] = 1 if mask is None else mask[start : start + n]
        pad[i, :n] = 0
    return {
        "inputs": rows[:, :-1],
        "targets": rows[:, 1:],
        "segment_ids": pad[:, :-1],
        "loss_mask": loss[:, 1:],
    }


class Loader:
    """Deterministic batches of a token stream, resumable from :meth:`state_dict`.

    Args:
      tokens: the 1-D token array (a split of a :class:`Corpus`).
      seq_len: tokens per row.
      batch_size: global rows per step.
      seed: with the step, determines every batch.
      rows: the rows of the global batch this process reads (default: all).

    Example:
      >>> loader = Loader(np.arange(100, dtype=np.uint16), seq_len=4, batch_size=2, seed=0)
      >>> first = next(loader)["inputs"]
      >>> loader.load_state_dict({"step": 0, "seed": 0})
      >>> bool((next(loader)["inputs"] == first).all())
      True
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        rows: slice = slice(None),
        mask: np.ndarray | None = None,
        eos: int | None = None,
        docs: np.ndarray | None = None,
    ):
        if docs is None:
            check_length(tokens, seq_len, "training")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.rows, self.mask, self.eos, self.docs = rows, mask, eos, docs
        self.step = 0

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the global batch of ``step`` (pure: no position change)."""
        if self.docs is not None:  # packing off: documents drawn at random, a row each
            rng = np.random.default_rng((self.seed, step))
            picked = rng.integers(0, len(self.docs), size=self.batch_size)[self.rows]
            return read_documents(self.tokens, self.docs[picked], self.seq_len, self.mask, self.eos)
        starts = offsets(len(self.tokens), self.seq_len, self.batch_size, self.seed, step)
        return read_windows(self.tokens, starts[self.rows], self.seq_len, self.mask, self.eos)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The position: the next step to read, and the seed (with the corpus size, to check)."""
        return {"step": self.step, "seed": self.seed, "num_tokens": len(self.tokens)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restores a position from :meth:`state_dict`; refuses a different corpus."""
        if "num_tokens" in state and int(state["num_tokens"]) != len(self.tokens):
            raise DataError(
                f"loader state is for a corpus of {state['num_tokens']} tokens, "
                f"this one has {len(self.tokens)}"
            )
        self.seed, self.step = int(state["seed"]), int(state["step"])


def eval_starts(num_tokens: int, seq_len: int, batch_size: int, num_batches: int) -> np.ndarray:
    """Evenly spaced window offsets over the whole split, ``[num_batches, batch_size]``.

    The same windows every evaluation, spread over all of the validation text,
    so validation curves compare like with like across steps and runs.
    """
    total = num_batches * batch_size
    return (
        np.linspace(0, num_tokens - seq_len - 1, total)
        .astype(np.int64)
        .reshape(num_batches, batch_size)
    )


def eval_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    rows: slice = slice(None),
    mask: np.ndarray | None = None,
    eos: int | None = None,
    docs: np.ndarray | None = None,
) -> list[dict[str, np.ndarray]]:
    """This process's rows of the fixed validation batches (packing off: documents spread
    evenly over the split, a row each)."""
    if docs is not None:
        picks = np.linspace(0, len(docs) - 1, num_batches * batch_size).astype(np.int64)
        return [
            read_documents(tokens, docs[p[rows]], seq_len, mask, eos)
            for p in picks.reshape(num_batches, batch_size)
        ]
    check_length(tokens, seq_len, "validation")
    starts = eval_starts(len(tokens), seq_len, batch_size, num_batches)
    return [read_windows(tokens, s[rows], seq_len, mask, eos) for s in starts]
