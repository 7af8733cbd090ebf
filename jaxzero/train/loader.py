"""Batches of a token stream: random windows (packed documents) or one document a row,
the resumable :class:`Loader`, and the fixed validation batches.

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

from collections.abc import Mapping

import numpy as np

from jaxzero.train.corpus import DataError


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
