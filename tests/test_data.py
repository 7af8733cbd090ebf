"""Data: byte and uint16 corpora, deterministic per-process batches, resumable position."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from jaxzero import batch as batch_lib
from jaxzero.train import data as D
from jaxzero.train.config import DataConfig


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _cfg(path=None, **kw) -> DataConfig:
    return DataConfig(path=None if path is None else str(path), **kw)


def test_text_file_round_trips_as_bytes(tmp_path):
    text = "def f(x):\n    return x + 1  # é\n" * 50
    path = tmp_path / "code.py"
    path.write_text(text, encoding="utf-8")
    corpus = D.load_corpus(_cfg(path, val_fraction=0.1))
    assert corpus.kind == "bytes" and corpus.vocab_size == 256
    joined = np.concatenate([corpus.train, corpus.val])
    assert D.decode(joined, "bytes") == text
    assert len(corpus.val) == round(0.1 * len(text.encode()))


def test_directory_of_text_files_is_sorted_and_skips_binary_and_hidden(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first")  # no trailing newline: one is added
    (tmp_path / "blob.bin.dat").write_bytes(b"\x00\x01binary")
    (tmp_path / ".hidden").write_text("secret\n")
    corpus = D.load_corpus(_cfg(tmp_path, val_fraction=0.2))
    assert D.decode(np.concatenate([corpus.train, corpus.val]), "bytes") == "first\nsecond\n"


def test_split_files_holds_out_every_kth_whole_file():
    chunks = [bytes([i]) * (i + 1) for i in range(10)]
    train, val = D.split_files(chunks, val_fraction=0.25)  # k = 4: files 3 and 7
    assert val.tobytes() == chunks[3] + chunks[7]
    assert train.tobytes() == b"".join(c for i, c in enumerate(chunks) if i not in (3, 7))
    train, val = D.split_files(chunks[:2], val_fraction=0.1)  # fewer than k: the last file
    assert (train.tobytes(), val.tobytes()) == (chunks[0], chunks[1])


def test_uint16_token_file_round_trips(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, size=5000).astype(np.uint16)
    D.write_tokens(tmp_path / "tokens.bin", tokens)
    corpus = D.load_corpus(_cfg(tmp_path / "tokens.bin", val_fraction=0.1))
    assert corpus.kind == "uint16" and corpus.train.dtype == np.uint16
    assert isinstance(corpus.train, np.memmap)
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]), tokens)
    assert corpus.vocab_size == int(tokens.max()) + 1
    assert D.load_corpus(_cfg(tmp_path / "tokens.bin"), vocab_size=50304).vocab_size == 50304
    with pytest.raises(D.DataError, match="model.vocab_size"):
        D.load_corpus(_cfg(tmp_path / "tokens.bin"), vocab_size=100)


def test_nanogpt_directory_uses_train_and_val_bin(tmp_path):
    train, val = np.arange(1000, dtype=np.uint16), np.arange(300, dtype=np.uint16)[::-1]
    D.write_tokens(tmp_path / "train.bin", train)
    D.write_tokens(tmp_path / "val.bin", val)
    corpus = D.load_corpus(_cfg(tmp_path))
    np.testing.assert_array_equal(corpus.train, train)
    np.testing.assert_array_equal(corpus.val, val)
    batch = D.Loader(corpus.train, seq_len=16, batch_size=4, seed=0).batch(0)
    assert batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)  # arange data


def test_default_corpus_is_the_stdlib_and_deterministic():
    files = D.stdlib_files()
    assert files == D.stdlib_files() and len(files) > 100
    assert not any("site-packages" in p.parts or "test" in p.parts for p in files)
    a = D.load_corpus(_cfg(max_bytes=200_000))
    b = D.load_corpus(_cfg(max_bytes=200_000))
    assert len(a.train) + len(a.val) == 200_000
    np.testing.assert_array_equal(a.val, b.val)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p / "missing.txt", "does not exist"),
        (lambda p: _write(p / "empty.txt", b""), "empty"),
        (lambda p: _write(p / "one.txt", b"x"), "empty"),
        (lambda p: p, "no text files"),
        (lambda p: _write(p / "empty.bin", b""), "empty"),
        (lambda p: _write(p / "odd.bin", b"abc"), "odd number of bytes"),
    ],
    ids=["missing", "empty-file", "one-byte", "empty-dir", "empty-token-file", "odd-token-file"],
)
def test_data_errors(tmp_path, make, match):
    with pytest.raises(D.DataError, match=match) as err:
        D.load_corpus(_cfg(make(tmp_path)))
    assert "\n" not in str(err.value)


def test_a_binary_file_is_refused_unless_read_as_bytes(tmp_path):
    path = _write(tmp_path / "prog", b"\x7fELF\x02\x01\x00" * 100)
    with pytest.raises(D.DataError, match="looks binary .* --set data.format=bytes"):
        D.load_corpus(_cfg(path))
    corpus = D.load_corpus(_cfg(path, format="bytes"))  # asked for explicitly
    assert len(corpus.train) + len(corpus.val) == 700


@pytest.mark.parametrize(
    "name, fmt, kind",
    [(None, "auto", "bytes"), ("a.txt", "auto", "bytes"), ("a.bin", "auto", "uint16"),
     ("a.bin", "bytes", "bytes"), ("a.txt", "uint16", "uint16"), ("tok", "auto", "uint16"),
     ("txt", "auto", "bytes")],
)  # fmt: skip
def test_data_kind_from_the_path_alone(tmp_path, name, fmt, kind):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "train.bin").write_bytes(b"")
    (tmp_path / "txt").mkdir()
    path = None if name is None else tmp_path / name
    assert D.data_kind(_cfg(path, format=fmt)) == kind


def test_sequence_longer_than_corpus_is_an_error():
    with pytest.raises(D.DataError, match="seq_len=64 needs at least 65 tokens"):
        D.Loader(np.arange(50, dtype=np.uint8), seq_len=64, batch_size=2, seed=0)
    with pytest.raises(D.DataError, match="validation split has 10") as e:
        D.eval_batches(np.arange(10, dtype=np.uint8), seq_len=16, batch_size=2, num_batches=1)
    # what to do: configs/sft.yaml on little data stops here
    assert str(e.value).endswith(
        ": lower model.seq_len or give more data (or raise data.val_fraction)"
    )


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.random.default_rng(1).integers(0, 256, 10_000).astype(np.uint8)
    a, b = D.Loader(tokens, 32, 8, seed=3), D.Loader(tokens, 32, 8, seed=3)
    for _ in range(3):
        np.testing.assert_array_equal(next(a)["inputs"], next(b)["inputs"])
    assert not np.array_equal(a.batch(0)["inputs"], a.batch(1)["inputs"])
    other = D.Loader(tokens, 32, 8, seed=4)
    assert not np.array_equal(a.batch(0)["inputs"], other.batch(0)["inputs"])
    starts = D.offsets(len(tokens), 32, 1000, seed=0, step=0)
    assert starts.min() >= 0 and starts.max() <= len(tokens) - 33


def test_restoring_the_position_reproduces_the_next_batches():
    tokens = np.random.default_rng(2).integers(0, 256, 5000).astype(np.uint8)
    loader = D.Loader(tokens, 16, 4, seed=7)
    for _ in range(5):
        next(loader)
    saved = loader.state_dict()
    expected = [next(loader) for _ in range(3)]
    fresh = D.Loader(tokens, 16, 4, seed=0)
    fresh.load_state_dict(saved)
    for want in expected:
        got = next(fresh)
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])
    with pytest.raises(D.DataError, match="corpus of"):
        D.Loader(tokens[:1000], 16, 4, seed=0).load_state_dict(saved)


def _fake_device_map(batch, num_procs, devices_per_proc):
    """A devices_indices_map for a batch split evenly over devices in process order."""
    n = num_procs * devices_per_proc
    per = batch // n
    return {
        FakeDevice(i, i // devices_per_proc): (
            slice(i * per, (i + 1) * per),
            slice(None),
        )
        for i in range(n)
    }


@pytest.mark.parametrize("num_procs, per_proc", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_per_process_rows_cover_the_global_batch_exactly_once(num_procs, per_proc):
    batch = 32
    rows = batch_lib.process_rows(_fake_device_map(batch, num_procs, per_proc), batch)
    assert sorted(rows) == list(range(num_procs))
    covered = np.concatenate([np.arange(batch)[rows[p]] for p in range(num_procs)])
    np.testing.assert_array_equal(np.sort(covered), np.arange(batch))
    # Each process's loader reads only its rows; in process order they are the global batch.
    tokens = np.random.default_rng(3).integers(0, 256, 4000).astype(np.uint8)
    whole = D.Loader(tokens, 16, batch, seed=5).batch(9)
    parts = [D.Loader(tokens, 16, batch, seed=5, rows=rows[p]).batch(9) for p in range(num_procs)]
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_non_contiguous_rows_are_refused():
    dev = {
        FakeDevice(0, 0): (slice(0, 2),),
        FakeDevice(1, 1): (slice(2, 4),),
        FakeDevice(2, 0): (slice(4, 6),),
    }
    with pytest.raises(ValueError, match="non-contiguous"):
        batch_lib.process_rows(dev, 6)


@pytest.mark.parametrize("replicas", [1, 2])
def test_process_rows_of_a_real_mesh(replicas):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxzero.mesh import batch_axes, make_mesh

    mesh = make_mesh(8, replicas=replicas)
    sharding = NamedSharding(mesh, P(batch_axes(mesh)))
    rows = batch_lib.process_rows(sharding.devices_indices_map((16, 4)), 16)
    assert rows == {0: slice(0, 16)}  # one process holds every row


def test_eval_batches_are_fixed_and_spread_over_the_split():
    tokens = np.random.default_rng(4).integers(0, 256, 3000).astype(np.uint8)
    a = D.eval_batches(tokens, 16, 4, 3)
    b = D.eval_batches(tokens, 16, 4, 3)
    assert len(a) == 3
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    starts = D.eval_starts(len(tokens), 16, 4, 3)
    assert starts[0, 0] == 0 and starts[-1, -1] == len(tokens) - 17


def test_a_jsonl_file_without_a_tokenizer_is_refused(tmp_path):
    """JSONL trained as raw bytes would learn its braces and keys: one line says what to do."""
    (tmp_path / "d").mkdir()
    for path in (tmp_path / "chat.jsonl", tmp_path / "d" / "a.ndjson"):
        path.write_text('{"text": "hello there"}\n' * 50)
    for where in (tmp_path / "chat.jsonl", tmp_path / "d"):  # a file, a directory holding one
        with pytest.raises(
            D.DataError, match=r"is JSONL, which needs a tokenizer: give --tok"
        ) as e:
            D.load_corpus(_cfg(where))
        assert "\n" not in str(e.value)
    corpus = D.load_corpus(_cfg(tmp_path / "chat.jsonl", format="bytes"))  # asked for
    assert corpus.kind == "bytes"


def test_max_bytes_caps_every_text_source_and_says_so(tmp_path):
    """A text file too (it was read whole); the banner's data line says what was left out."""
    path = _write(tmp_path / "big.txt", b"0123456789\n" * 1000)  # 11,000 bytes
    corpus = D.load_corpus(_cfg(path, max_bytes=2000))
    assert len(corpus.train) + len(corpus.val) == 2000
    assert corpus.source.endswith("the first 2,000 of 11,000 bytes (data.max_bytes)")
    whole = D.load_corpus(_cfg(path, max_bytes=None))
    assert len(whole.train) + len(whole.val) == 11_000 and whole.source == str(path)
    (tmp_path / "d").mkdir()
    for name in "ab":
        _write(tmp_path / "d" / f"{name}.txt", b"x" * 999 + b"\n")
    cut = D.load_corpus(_cfg(tmp_path / "d", max_bytes=1500))
    assert cut.source.endswith("the first 1,500 of 2,000 bytes (data.max_bytes)")
    assert "data.max_bytes" not in D.load_corpus(_cfg(tmp_path / "d")).source
