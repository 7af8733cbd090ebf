"""A read corpus: the :class:`Corpus` type, the data error, and text to tokens and back.

What every reader of a corpus shares, whatever its source (:mod:`jaxzero.train.data`)
and however it is batched (:mod:`jaxzero.train.loader`): the train and validation
streams with their masks and documents, byte or tokenizer text codecs, and the sample
prompt taken from the validation split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from jaxzero.errors import Error

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


def truncated(docs: np.ndarray | None, seq_len: int) -> int:
    """Documents longer than a row (``seq_len + 1`` tokens), cut when packing is off."""
    return 0 if docs is None else int(np.sum(docs[:, 1] - docs[:, 0] > seq_len + 1))


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
