"""A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

``Tokenizer.load`` takes the file or a model directory holding it. The end-of-text
token, which separates packed documents, is the one ``tokenizer_config.json`` (or the
model's ``config.json``) names, else the first of the usual spellings the vocabulary
has. Encoding adds no special tokens: documents get exactly one EOS, from the store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as Raw

FILE = "tokenizer.json"
EOS_SPELLINGS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>", "<eos>", "<|eot_id|>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; its message is one line."""


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


class Tokenizer:
    """Text <-> token ids, the EOS id, the vocabulary size, a fingerprint.

    Example:
      >>> from tokenizers import Tokenizer as Raw, models, pre_tokenizers
      >>> raw = Raw(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "hi": 2, "there": 3},
      ...                            unk_token="[UNK]"))
      >>> raw.pre_tokenizer = pre_tokenizers.Whitespace()
      >>> tok = Tokenizer(raw)
      >>> tok.encode("hi there"), tok.eos_id, tok.vocab_size
      ([2, 3], 0, 4)
    """

    def __init__(
        self,
        raw: Any,
        eos: str | None = None,
        source: str = "",
        chat_template=None,
        bos: str | None = None,
    ):
        self.raw, self.source, self.chat_template = raw, source, chat_template
        self.bos_token = bos or ""  # what a chat template may print
        vocab = raw.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        names = [eos] if eos else [s for s in EOS_SPELLINGS if s in vocab]
        if not names or names[0] not in vocab:
            raise TokenizerError(
                f"tokenizer {source or '(in memory)'} has no end-of-text token "
                f"({eos or ' / '.join(EOS_SPELLINGS)}): packed documents need "
                "one; name it as eos_token in tokenizer_config.json"
            )
        self.eos_id, self.eos_token = vocab[names[0]], names[0]
        self.fingerprint = hashlib.sha256(raw.to_str().encode()).hexdigest()[:16]

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """From ``tokenizer.json`` or a directory holding it (and its config files)."""
        path = Path(path).expanduser()
        file = path / FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(
                f"no tokenizer at {path} (give a {FILE} or a model directory holding one)"
            )
        try:
            raw = Raw.from_file(str(file))
        except Exception as e:  # the library raises its own exception type
            raise TokenizerError(
                f"{file} is not a tokenizers file ({' '.join(str(e).split())[:150]})"
            ) from None
        config = _json(file.parent / "tokenizer_config.json")
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos is None:  # the model's config.json may name it by id
            eos_id = _json(file.parent / "config.json").get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
            eos = raw.id_to_token(eos_id) if isinstance(eos_id, int) else None
        bos = config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        return cls(
            raw, eos, str(file), config.get("chat_template"), bos if isinstance(bos, str) else None
        )

    def encode(self, text: str) -> list[int]:
        return self.raw.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once: the library spreads them over every core."""
        return [e.ids for e in self.raw.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.raw.decode(
            [int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False
        )

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned dtype that holds every id."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)
