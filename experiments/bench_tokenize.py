"""Tokenizing a text corpus into the token store, and the loader's cost per step.

    python -m experiments.bench_tokenize --mb 100 [--tokenizer DIR_OR_JSON]

Writes a JSONL corpus of random English-like documents (``--mb`` megabytes), trains a
byte-level BPE tokenizer of 8k tokens on a slice of it (or uses ``--tokenizer``),
builds the store (the ``tokenizers`` library spreads each batch over every core) and
prints MB/s; then times the packed loader (windows, segment ids, loss masks) for a
batch of 32 x 1024 tokens, against the step it feeds, and the fraction of tokens
that would be real if each document had a padded row of its own.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his "
    "from at which but have an they you were her she there been one all we their has "
    "would when if so no will more can out up said what about into than them only "
    "time could new some these two may first then do any like my now over such our "
    "man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little"
).split()


def corpus(path: Path, mb: float, seed: int = 0) -> int:
    """Documents of 20-2,000 words (prompt/completion pairs every fifth line)."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    size = 0
    with open(path, "w") as f:
        while size < mb * 1e6:
            n = int(rng.integers(20, 2000))
            text = " ".join(words[rng.integers(0, len(words), n)])
            row = (
                {"prompt": text[:200], "completion": text[200:]}
                if rng.random() < 0.2
                else {"text": text}
            )
            line = json.dumps(row) + "\n"
            f.write(line)
            size += len(line)
    return size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--tokenizer")
    p.add_argument("--seq-len", type=int, default=1024)
    args = p.parse_args()
    from jaxzero.data import store as store_lib
    from jaxzero.data.tokenizer import Tokenizer
    from jaxzero.train import data as data_lib

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        size = corpus(tmp / "corpus.jsonl", args.mb)
        if args.tokenizer:
            tok = Tokenizer.load(args.tokenizer)
        else:
            from tokenizers import Tokenizer as Raw
            from tokenizers import decoders, models, pre_tokenizers, trainers

            raw = Raw(models.BPE())
            raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            raw.decoder = decoders.ByteLevel()
            lines = (tmp / "corpus.jsonl").open().readlines()[:2000]
            raw.train_from_iterator(
                lines,
                trainers.BpeTrainer(
                    vocab_size=8192,
                    special_tokens=["<|endoftext|>"],
                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                ),
            )
            raw.save(str(tmp / "tokenizer.json"))
            tok = Tokenizer.load(tmp / "tokenizer.json")
        start = time.perf_counter()
        store = store_lib.build(tmp / "corpus.jsonl", tok, progress=False)
        took = time.perf_counter() - start
        start = time.perf_counter()
        store_lib.build(tmp / "corpus.jsonl", tok, progress=False)
        cached = time.perf_counter() - start
        n = store.meta["tokens"]
        print(
            f"corpus {size / 1e6:.1f} MB, {store.meta['documents']:,} documents -> "
            f"{n:,} tokens ({tok.dtype.name}) in {took:.1f} s: {size / 1e6 / took:.1f} MB/s, "
            f"{n / took / 1e6:.2f} M tokens/s; opening the cached store: {cached * 1e3:.2f} ms"
        )
        loader = data_lib.Loader(store.tokens, args.seq_len, 32, 0, mask=store.mask, eos=tok.eos_id)
        loader.batch(0)
        start = time.perf_counter()
        for step in range(20):
            loader.batch(step)
        per = (time.perf_counter() - start) / 20
        print(
            f"loader: {per * 1e3:.1f} ms a batch of 32 x {args.seq_len} (packed: every token "
            f"real; one padded row per document instead: "
            f"{100 * store_lib.real_fraction(store, args.seq_len):.0f}% real)"
        )


if __name__ == "__main__":
    main()
