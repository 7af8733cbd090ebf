"""A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

``Tokenizer.load`` takes the file or a model directory holding it. The end-of-text
token, which separates packed documents, is the one ``tokenizer_config.json`` (or the
model's ``config.json``) names, else the first of the usual spellings the vocabulary
has. Encoding adds no special tokens: documents get exactly one EOS, from the store.

Chat templates are read as ``transformers`` 5 reads them (``PreTrainedTokenizerBase.
from_pretrained`` and ``get_chat_template``): ``chat_template.jinja`` is the default
template and ``additional_chat_templates/<name>.jinja`` are named ones; when either exists
they replace whatever ``tokenizer_config.json`` holds, else its ``chat_template`` is read
(a string, or a list of ``{name, template}``). The template used is the one named
``default`` (``chat_template.jinja``, or a string in the config).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as Raw

from jaxzero.errors import Error
from jaxzero.modeldir import TEMPLATE_DIR, TEMPLATE_FILE, TOKENIZER_CONFIG, TOKENIZER_FILE

FILE = TOKENIZER_FILE
CONFIG = TOKENIZER_CONFIG
EOS_SPELLINGS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>", "<eos>", "<|eot_id|>")
UNK_WARN = 0.01  # above this share of unknown tokens, text is being lost: say so


class TokenizerError(Error, ValueError):
    """A tokenizer that cannot be used; its message is one line."""


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _content(token: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{content}``."""
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None


def template_files(directory: str | Path) -> list[str]:
    """The chat template files a model directory holds, relative to it, sorted."""
    directory = Path(directory)
    found = [TEMPLATE_FILE] if (directory / TEMPLATE_FILE).is_file() else []
    if (directory / TEMPLATE_DIR).is_dir():
        found += sorted(
            f"{TEMPLATE_DIR}/{p.name}" for p in (directory / TEMPLATE_DIR).glob("*.jinja")
        )
    return found


def read_templates(directory: str | Path) -> tuple[dict[str, str], str]:
    """``({name: template}, where they came from)`` as ``transformers`` 5 reads them: the
    template files when there are any (``chat_template.jinja`` is ``default``), else
    ``tokenizer_config.json``'s ``chat_template`` (a string is ``default``)."""
    directory = Path(directory)
    files = template_files(directory)
    if files:
        templates = {}
        for rel in files:
            name = "default" if rel == TEMPLATE_FILE else Path(rel).name.removesuffix(".jinja")
            try:
                templates[name] = (directory / rel).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(
                    f"cannot read the chat template {directory / rel}: {e}"
                ) from None
        return templates, ", ".join(files)
    value = _json(directory / CONFIG).get("chat_template")
    if isinstance(value, str):
        return {"default": value}, CONFIG
    if isinstance(value, list):
        named = {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
        return named, CONFIG
    return {}, ""


def pick_template(templates: dict[str, str]) -> str | None:
    """The template a chat is rendered with: the one named ``default`` (a lone template
    file or string is that one), as transformers' ``get_chat_template`` picks with no
    name and no tools; named templates alone give none (transformers refuses them too)."""
    return templates.get("default")


class Tokenizer:
    """Text <-> token ids, the EOS id, the vocabulary size, a fingerprint.

    ``fingerprint`` hashes everything about the tokenizer that changes the tokens of a
    document: ``tokenizer.json``, the EOS and BOS tokens, and the chat template used.

    Example:
      >>> from tokenizers import Tokenizer as Raw, models, pre_tokenizers
      >>> raw = Raw(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "hi": 2, "there": 3},
      ...                            unk_token="[UNK]"))
      >>> raw.pre_tokenizer = pre_tokenizers.Whitespace()
      >>> tok = Tokenizer(raw)
      >>> tok.encode("hi there"), tok.eos_id, tok.vocab_size, tok.unk_id
      ([2, 3], 0, 4, 1)
    """

    def __init__(
        self,
        raw: Any,
        eos: str | None = None,
        source: str = "",
        chat_template: str | None = None,
        bos: str | None = None,
        eos_from: str = "",
        templates: dict[str, str] | None = None,
        template_source: str = "",
    ):
        self.raw, self.source, self.chat_template = raw, source, chat_template
        self.templates = templates if templates is not None else {}
        self.template_source = template_source  # the files the templates came from
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
        self.eos_from = eos_from or ("given" if eos else "the first usual spelling it has")
        text = raw.to_str()
        model = json.loads(text).get("model") or {}
        unk = model.get("unk_token")
        self.unk_id: int | None = vocab.get(unk) if isinstance(unk, str) else None
        if self.unk_id is None and isinstance(model.get("unk_id"), int):  # Unigram
            self.unk_id = model["unk_id"]
        key = [text, self.eos_token, self.eos_id, self.bos_token, chat_template]
        self.fingerprint = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

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
        config = _json(file.parent / CONFIG)
        eos, eos_from = _content(config.get("eos_token")), f"eos_token of {CONFIG}"
        if eos is None:  # the model's config.json may name it by id
            eos_id = _json(file.parent / "config.json").get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
            eos = raw.id_to_token(eos_id) if isinstance(eos_id, int) else None
            eos_from = "eos_token_id of config.json" if eos is not None else ""
        templates, where = read_templates(file.parent)
        return cls(
            raw,
            eos,
            str(file),
            pick_template(templates),
            _content(config.get("bos_token")),
            eos_from,
            templates,
            where,
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

    def describe_eos(self) -> str:
        """Which EOS token was chosen and why, for the banner: ``</s> (id 2, eos_token of
        tokenizer_config.json)``."""
        return f"{self.eos_token} (id {self.eos_id}, {self.eos_from})"


def unk_share(tok: Tokenizer, ids: Sequence[int] | np.ndarray) -> float:
    """The share of ``ids`` that are the tokenizer's unknown token (0 when it has none, or
    for no ids): text the tokenizer could not represent, lost to the model."""
    ids = np.asarray(ids).reshape(-1)
    if tok.unk_id is None or ids.size == 0:
        return 0.0
    return float(np.count_nonzero(ids == tok.unk_id) / ids.size)


def unk_warning(tok: Tokenizer, share: float, what: str) -> str | None:
    """The one-line warning for ``what`` ("the data", "the prompt") when its unknown-token
    share is above ``UNK_WARN``; None otherwise."""
    if share <= UNK_WARN:
        return None
    unk = tok.raw.id_to_token(tok.unk_id) if tok.unk_id is not None else "unknown"
    return (
        f"warning: {share:.1%} of {what}'s tokens are {unk}: {tok.source or 'the tokenizer'} "
        "cannot represent that text, and the model never sees it; use a tokenizer that "
        "covers it"
    )
