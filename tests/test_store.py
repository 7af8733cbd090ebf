"""Tokenizers and the token store (jaxzero.data): documents and prompt/completion pairs
tokenized once, cached and invalidated, packed windows with segment ids and loss masks,
and one-line errors for bad data."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from jaxzero import cli
from jaxzero.data import progress as progress_lib
from jaxzero.data import store as store_lib
from jaxzero.data import tokenizer as tokenizer_lib
from jaxzero.data.tokenizer import Tokenizer, TokenizerError
from jaxzero.train import data as data_lib
from jaxzero.train.config import DataConfig

WORDS = "the cat dog sat on mat ran fast slow big small red blue a and or not is was".split()
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained here, offline, with an EOS and a chat template."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    raw = Raw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator([sentence(rng, 20) for _ in range(300)], trainer)
    out = tmp_path_factory.mktemp("tok")
    raw.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE})
    )
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tokenizer_round_trips_text_and_finds_its_eos(tokenizer_dir, tmp_path):
    tok = Tokenizer.load(tokenizer_dir)  # a directory holding tokenizer.json
    text = "the big cat sat on the red mat, and was not slow!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.eos_id]) == "<|endoftext|>" and tok.dtype == np.uint16
    assert Tokenizer.load(tokenizer_dir / "tokenizer.json").fingerprint == tok.fingerprint
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="is not a tokenizers file"):
        Tokenizer.load(tmp_path)


def test_store_tokenizes_documents_once_with_prompt_masks(tokenizer_dir, tmp_path):
    tok = Tokenizer.load(tokenizer_dir)
    rows = [
        {"text": "the cat sat"},
        {"prompt": "Q: a dog?", "completion": " ran fast"},
        {
            "messages": [
                {"role": "user", "content": "red or blue"},
                {"role": "assistant", "content": "blue"},
            ]
        },
    ]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    store = store_lib.build(data, tok, progress=False)
    eos = tok.eos_id
    chat_prompt = "<|user|>red or blue\n<|assistant|>"
    want = (
        tok.encode("the cat sat")
        + [eos]
        + tok.encode("Q: a dog?")
        + tok.encode(" ran fast")
        + [eos]
        + tok.encode(chat_prompt)
        + tok.encode("blue")
        + [eos]
    )
    np.testing.assert_array_equal(store.tokens, want)
    n1, n2 = len(tok.encode("the cat sat")) + 1, len(tok.encode("Q: a dog?"))
    n3 = len(tok.encode(" ran fast")) + 1
    n4 = len(tok.encode(chat_prompt))
    mask = [1] * n1 + [0] * n2 + [1] * n3 + [0] * n4 + [1] * (len(tok.encode("blue")) + 1)
    np.testing.assert_array_equal(store.mask, mask)
    assert store.meta["documents"] == 3
    assert store.path.parent == tmp_path / "data.jsonl.jaxzero-tokens"  # beside the data

    again = store_lib.build(data, tok, progress=False)  # cached: the same files, not rebuilt
    assert again.path == store.path
    assert (store.path / "tokens.bin").stat().st_mtime_ns == (
        again.path / "tokens.bin"
    ).stat().st_mtime_ns
    host, root = socket.gethostname(), store.path.parent
    killed = root / f".{store.path.name}.partial-{host}-{2**22 + 12345}"  # no such pid
    alive = root / f".{store.path.name}.partial-{host}-{os.getppid()}"  # a build under way
    elsewhere = root / f".{store.path.name}.partial-otherhost-{2**22 + 12345}"
    for d in (killed, alive, elsewhere):
        d.mkdir()
    write_jsonl(data, rows + [{"text": "a new line"}])  # the data changed: a new store
    changed = store_lib.build(data, tok, progress=False)
    assert changed.path != store.path and not store.path.exists()
    assert changed.meta["documents"] == 4
    # a build killed mid-way on this host is cleared; live or other hosts' builds are not
    assert not killed.exists() and alive.exists() and elsewhere.exists()


def test_packed_windows_carry_segments_and_the_loss_mask():
    tokens = np.array([5, 6, 0, 7, 8, 9, 0, 4, 4, 0], np.uint16)  # eos 0
    mask = np.array([1, 1, 1, 0, 0, 1, 1, 0, 1, 1], np.uint8)
    out = data_lib.read_windows(tokens, np.array([0, 3]), 6, mask, eos=0)
    np.testing.assert_array_equal(out["inputs"][0], [5, 6, 0, 7, 8, 9])
    np.testing.assert_array_equal(out["segment_ids"][0], [0, 0, 0, 1, 1, 1])  # EOS ends its own
    np.testing.assert_array_equal(out["loss_mask"][0], mask[1:7])  # aligned with the targets
    np.testing.assert_array_equal(out["segment_ids"][1], [0, 0, 0, 0, 1, 1])
    assert set(data_lib.read_windows(tokens, np.array([0]), 6)) == {"inputs", "targets"}


def test_corpus_from_a_tokenizer_and_how_much_packing_saves(tokenizer_dir, tmp_path):
    rng = np.random.default_rng(1)
    rows = [
        {
            "prompt": "Q: " + sentence(rng, int(rng.integers(2, 8))),
            "completion": " " + sentence(rng, int(rng.integers(1, 12))),
        }
        for _ in range(200)
    ]
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    cfg = DataConfig(path=str(data), tokenizer=str(tokenizer_dir), val_fraction=0.1)
    corpus = data_lib.load_corpus(cfg)
    assert corpus.kind == "tokenizer" and corpus.eos == Tokenizer.load(tokenizer_dir).eos_id
    assert len(corpus.train_mask) == len(corpus.train) and 0 < corpus.train_mask.mean() < 1
    loader = data_lib.Loader(corpus.train, 32, 8, 0, mask=corpus.train_mask, eos=corpus.eos)
    batch = loader.batch(3)
    assert set(batch) == {"inputs", "targets", "segment_ids", "loss_mask"}
    np.testing.assert_array_equal(loader.batch(3)["loss_mask"], batch["loss_mask"])  # pure
    store = store_lib.build(data, Tokenizer.load(tokenizer_dir), progress=False)
    unpacked = store_lib.real_fraction(store, 32)
    assert 0.2 < unpacked < 0.8  # short pairs padded to 33 tokens; packed windows: 1.0
    with pytest.raises(
        data_lib.DataError,
        match=r"vocabulary \(300\) is larger than "
        r"model.vocab_size=256",
    ):
        data_lib.load_corpus(cfg, vocab_size=256)


@pytest.mark.parametrize(
    "line,match",
    [
        ('{"text": "ok"}\n{not json\n', r"bad.jsonl:2: not JSON"),
        ('{"txt": "typo"}\n', r"bad.jsonl:1: needs a string 'text'.*found txt"),
        ("[1, 2]\n", r"bad.jsonl:1: a line must be a JSON object"),
        (
            '{"text": "a", "prompt": "b", "completion": "c"}\n',
            r"bad.jsonl:1: holds both 'text' and 'prompt/completion'",
        ),
        ("\n\n", r"no documents in"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', "ending with an assistant"),
    ],
)
def test_bad_lines_are_named_by_file_and_line(tokenizer_dir, tmp_path, line, match):
    (tmp_path / "bad.jsonl").write_text(line)
    cfg = DataConfig(path=str(tmp_path / "bad.jsonl"), tokenizer=str(tokenizer_dir))
    with pytest.raises(data_lib.DataError, match=match) as e:
        data_lib.load_corpus(cfg)
    assert "\n" not in str(e.value)
    assert not any(
        p.name.startswith(".") for p in (tmp_path / "bad.jsonl.jaxzero-tokens").iterdir()
    ), "no partial store left behind"


def test_a_line_that_is_not_utf8_is_named_by_file_and_line(tokenizer_dir, tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    cfg = DataConfig(path=str(tmp_path / "bad.jsonl"), tokenizer=str(tokenizer_dir))
    with pytest.raises(data_lib.DataError, match=r"bad.jsonl:2: not JSON \('utf-8' codec"):
        data_lib.load_corpus(cfg)


@pytest.mark.system
def test_train_on_jsonl_with_a_tokenizer_and_sample_with_it(tokenizer_dir, tmp_path, capsys):
    rng = np.random.default_rng(2)
    rows = [{"text": sentence(rng, int(rng.integers(5, 30)))} for _ in range(150)]
    data = write_jsonl(tmp_path / "docs.jsonl", rows)
    argv = [
        "train",
        "--tokenizer",
        str(tokenizer_dir),
        "--data",
        str(data),
        "--set",
        "model.arch=llama",
        "--set",
        "model.d_model=32",
        "--set",
        "model.n_layers=1",
        "--set",
        "model.seq_len=16",
        "--set",
        "train.steps=2",
        "--set",
        "train.batch_size=8",
        "--set",
        "logging.eval_every=2",
        "--set",
        "logging.sample_tokens=0",
        "--set",
        "checkpoint.every=2",
        "--set",
        f"logging.root={tmp_path}",
        "--name",
        "tok",
        "--devices",
        "2",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out  # not a terminal: tokenizing says so in lines
    run = out.index(f"jaxzero train: tok -> {tmp_path / 'tok'}\n")  # said first, then the rest
    assert run < out.index(f"  tokenizing {data} (") < out.index("  tokenized 150 documents")
    assert "EOS <|endoftext|> (id 0, eos_token of tokenizer_config.json)" in out
    assert cli.main(["sample", str(tmp_path / "tok"), "--prompt", "the cat", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out.split()) >= 2  # text, not ids


def test_packing_off_gives_each_document_a_padded_row():
    tokens = np.array([5, 6, 0, 7, 8, 9, 9, 9, 0], np.uint16)  # two documents, eos 0
    mask = np.array([0, 1, 1, 0, 1, 1, 1, 1, 1], np.uint8)
    docs = np.array([[0, 3], [3, 9]])
    out = data_lib.read_documents(tokens, docs, 4, mask, eos=0)
    np.testing.assert_array_equal(out["inputs"], [[5, 6, 0, 0], [7, 8, 9, 9]])
    np.testing.assert_array_equal(out["segment_ids"], [[0, 0, 0, 1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["loss_mask"], [[1, 1, 0, 0], [1, 1, 1, 1]])  # no pad loss
    assert data_lib.truncated(docs, 4) == 1  # the second document is cut at 5 tokens


@pytest.mark.system
def test_packing_off_trains_and_says_what_it_cut(tokenizer_dir, tmp_path, capsys):
    rng = np.random.default_rng(3)
    rows = [
        {"prompt": sentence(rng, 3), "completion": " " + sentence(rng, int(n))}
        for n in rng.integers(1, 40, 60)
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = DataConfig(path=str(data), tokenizer=str(tokenizer_dir), packing=False)
    corpus = data_lib.load_corpus(cfg)
    assert corpus.train_docs is not None and corpus.val_docs[0, 0] == 0  # val starts a doc
    loader = data_lib.Loader(
        corpus.train, 16, 4, 0, mask=corpus.train_mask, eos=corpus.eos, docs=corpus.train_docs
    )
    batch = loader.batch(0)
    assert batch["inputs"].shape == (4, 16) and (batch["loss_mask"] <= 1).all()
    argv = [
        "train",
        "--tokenizer",
        str(tokenizer_dir),
        "--data",
        str(data),
        "--set",
        "data.packing=false",
        "--set",
        "model.arch=llama",
        "--set",
        "model.d_model=32",
        "--set",
        "model.n_layers=1",
        "--set",
        "model.seq_len=16",
        "--set",
        "train.steps=1",
        "--set",
        "train.batch_size=4",
        "--set",
        "logging.eval_every=1",
        "--set",
        "logging.eval_batches=1",
        "--set",
        "logging.sample_tokens=0",
        "--set",
        f"logging.root={tmp_path}",
        "--name",
        "unpacked",
        "--devices",
        "2",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "packing off:" in out and "train documents cut at 17 tokens" in out


def test_a_long_text_file_is_one_document_read_in_pieces(tokenizer_dir, tmp_path, monkeypatch):
    """A text file streams a piece at a time (whole lines), with one EOS at its end."""
    monkeypatch.setattr(store_lib, "PIECE", 64)
    rng = np.random.default_rng(4)
    lines = [sentence(rng, 6) + "\n" for _ in range(40)]
    (tmp_path / "a.txt").write_text("".join(lines))
    (tmp_path / "b.txt").write_text("the end\n")
    tok = Tokenizer.load(tokenizer_dir)
    store = store_lib.build(tmp_path, tok, progress=False)
    assert store.meta["documents"] == 2 and store.mask is None
    whole = tok.encode("".join(lines))
    np.testing.assert_array_equal(store.tokens[: len(whole) + 1], whole + [tok.eos_id])
    np.testing.assert_array_equal(
        np.load(store.path / "lengths.npy"), [len(whole) + 1, len(tok.encode("the end\n")) + 1]
    )


def test_chat_templates_render_as_transformers_renders_them(tokenizer_dir, tmp_path):
    """Sandboxed, with eos_token and raise_exception, trim_blocks and lstrip_blocks on."""
    import shutil

    tok_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok_dir)
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}\n{% for m in messages %}\n  {{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}"
    )
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": template})
    )
    tok = Tokenizer.load(tok_dir)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]
    store = store_lib.build(
        write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}]), tok, progress=False
    )
    # trim_blocks ate the newlines after the tags; the indent before {{ stays
    want = tok.encode("  hi<|endoftext|>\n") + tok.encode("red") + [tok.eos_id]
    np.testing.assert_array_equal(store.tokens, want)
    system = [{"role": "system", "content": "x"}] + chat
    write_jsonl(tmp_path / "s.jsonl", [{"messages": system}])
    with pytest.raises(
        store_lib.StoreError,
        match="s.jsonl:1: the chat template failed "
        r"\(no system\)",
    ):
        store_lib.build(tmp_path / "s.jsonl", tok, progress=False)


HF_TOKENIZER = Path(__file__).parent / "fixtures" / "hf" / "llama_gqa" / "single"  # transformers'
CHAT = [{"role": "user", "content": "t7 t8"}, {"role": "assistant", "content": "t9"}]


def hf_tokenizer_dir(tmp_path: Path) -> Path:
    """A copy of the tokenizer transformers 5 saved (WordLevel: <unk> 0, <s> 1, </s> 2, t3..)."""
    import shutil

    out = tmp_path / "hf-tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(HF_TOKENIZER / name, out / name)
    return out


def set_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | fields))


def test_the_store_key_covers_the_chat_template_and_the_eos(tokenizer_dir, tmp_path):
    """The template (wherever it is read from) and the EOS change the tokens: a new store,
    never the old tokens."""
    import shutil

    from tokenizers import Tokenizer as Raw

    tok_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok_dir)
    raw = Raw.from_file(str(tok_dir / "tokenizer.json"))
    raw.add_special_tokens(["</s>"])  # a second end-of-text token to choose
    raw.save(str(tok_dir / "tokenizer.json"))
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"text": "the cat"}])

    def store_and_prompt(prompt: str):
        tok = Tokenizer.load(tok_dir)
        store = store_lib.build(data, tok, progress=False)
        want = tok.encode(prompt) + tok.encode("t9") + [tok.eos_id]
        np.testing.assert_array_equal(store.tokens[: len(want)], want)
        return store

    first = store_and_prompt("<|user|>t7 t8\n<|assistant|>")
    set_config(tok_dir, chat_template="SYSTEM: be brief\n" + TEMPLATE)  # a changed system prompt
    second = store_and_prompt("SYSTEM: be brief\n<|user|>t7 t8\n<|assistant|>")
    assert second.path != first.path and len(second.tokens) > len(first.tokens)
    (tok_dir / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]")  # wins
    third = store_and_prompt("[t7 t8]")
    (tok_dir / "chat_template.jinja").write_text("({{ messages[0]['content'] }})")  # edited
    fourth = store_and_prompt("(t7 t8)")
    assert len({first.path, second.path, third.path, fourth.path}) == 4
    set_config(tok_dir, eos_token="</s>")
    fifth = store_and_prompt("(t7 t8)")
    eos = Tokenizer.load(tok_dir).eos_id
    assert fifth.path != fourth.path and fifth.meta["eos_id"] == eos != fourth.meta["eos_id"]
    ends = np.cumsum(np.load(fifth.path / "lengths.npy")) - 1
    assert (fifth.tokens[ends] == eos).all()  # every document ends with the new EOS
    assert store_lib.build(data, Tokenizer.load(tok_dir), progress=False).path == fifth.path


def test_templates_are_read_as_transformers_5_reads_them(tmp_path):
    """chat_template.jinja and additional_chat_templates/ replace tokenizer_config.json's
    chat_template; the template used is the one named default (a lone file or string is)."""
    tok_dir = hf_tokenizer_dir(tmp_path)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(store_lib.StoreError, match=r"has none: no chat_template.jinja"):
        store_lib.build(data, Tokenizer.load(tok_dir), progress=False)
    (tok_dir / "chat_template.jinja").write_text("t3 {{ messages[0]['content'] }} t4 ")
    tok = Tokenizer.load(tok_dir)  # what save_pretrained writes today: the .jinja file only
    store = store_lib.build(data, tok, progress=False)
    np.testing.assert_array_equal(store.tokens, [3, 7, 8, 4, 9, tok.eos_id])
    np.testing.assert_array_equal(store.mask, [0, 0, 0, 0, 1, 1])

    set_config(tok_dir, chat_template="t5 {{ messages[0]['content'] }}")
    assert Tokenizer.load(tok_dir).chat_template.startswith("t3")  # the file wins over it
    named = tok_dir / "additional_chat_templates"
    named.mkdir()
    (named / "tool_use.jinja").write_text("t6")
    tok = Tokenizer.load(tok_dir)
    assert tok.chat_template.startswith("t3") and set(tok.templates) == {"default", "tool_use"}
    (tok_dir / "chat_template.jinja").unlink()  # named templates only, none the default
    (named / "rag.jinja").write_text("t7")
    with pytest.raises(store_lib.StoreError, match=r"only named ones \(rag, tool_use, in"):
        store_lib.build(data, Tokenizer.load(tok_dir), progress=False)
    (named / "default.jinja").write_text("t8")
    assert Tokenizer.load(tok_dir).chat_template == "t8"

    shutil_rmtree(named)
    templates = [{"name": "tool_use", "template": "t6"}, {"name": "default", "template": "t5"}]
    set_config(tok_dir, chat_template=templates)  # the older list form
    assert Tokenizer.load(tok_dir).chat_template == "t5"
    set_config(tok_dir, chat_template=templates[:1])  # named only: no default, as transformers
    assert Tokenizer.load(tok_dir).chat_template is None
    assert tokenizer_lib.template_files(tok_dir) == []
    (named).mkdir()
    (named / "x.jinja").write_text("t4")
    (tok_dir / "chat_template.jinja").write_text("t3")
    assert tokenizer_lib.template_files(tok_dir) == [
        "chat_template.jinja",
        "additional_chat_templates/x.jinja",
    ]


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def test_lossy_tokenization_is_said_once_with_the_figure(tmp_path):
    """French text through a WordLevel vocabulary of t3..t63 is all <unk>: the banner warns;
    data the vocabulary covers does not."""
    from jaxzero.train import metrics
    from jaxzero.train.config import Config

    tok_dir = hf_tokenizer_dir(tmp_path)
    tok = Tokenizer.load(tok_dir)
    assert tok.unk_id == 0 and tokenizer_lib.unk_share(tok, [0, 5, 0, 7]) == 0.5
    assert tokenizer_lib.unk_share(tok, []) == 0.0
    assert tokenizer_lib.unk_warning(tok, 0.005, "the prompt") is None
    french = write_jsonl(tmp_path / "fr.jsonl", [{"text": "le chat est sur le tapis"}] * 20)
    corpus = data_lib.load_corpus(DataConfig(path=str(french), tokenizer=str(tok_dir)))
    assert corpus.warnings == (
        f"warning: 100.0% of the data's tokens are <unk>: {tok_dir / 'tokenizer.json'} cannot "
        "represent that text, and the model never sees it; use a tokenizer that covers it",
    )
    banner = metrics.banner(Config(), corpus, 1000, None)
    assert banner.count("warning: 100.0% of the data's tokens are <unk>") == 1
    assert "EOS </s> (id 2, eos_token of tokenizer_config.json)" in banner.splitlines()[0]
    from jaxzero.train.sample import prompt_ids  # a sampling prompt: the same figure

    ids, (warning,) = prompt_ids("le chat t5", "tokenizer", tok)
    assert warning.startswith("warning: 66.7% of the prompt's tokens are <unk>"), warning
    assert prompt_ids("t3 t4 t5", "tokenizer", tok)[1] == []
    ids, (warning,) = prompt_ids("   ", "tokenizer", tok)  # whitespace alone: no token
    assert ids.size == 0 and "encodes to no tokens" in warning
    covered = write_jsonl(tmp_path / "t.jsonl", [{"text": "t3 t4 t5 t6"}] * 20)
    assert (
        data_lib.load_corpus(DataConfig(path=str(covered), tokenizer=str(tok_dir))).warnings == ()
    )


def test_max_bytes_applies_to_jsonl_by_whole_lines(tokenizer_dir, tmp_path):
    rows = [{"text": f"the cat {i}"} for i in range(100)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    size, line = data.stat().st_size, len(json.dumps(rows[0])) + 1
    cfg = DataConfig(path=str(data), tokenizer=str(tokenizer_dir), max_bytes=10 * line + 3)
    corpus = data_lib.load_corpus(cfg)
    assert corpus.tokenizer is not None and "10 documents" in corpus.source
    assert f"the first {10 * line:,} of {size:,} bytes (data.max_bytes)" in corpus.source
    whole = data_lib.load_corpus(DataConfig(path=str(data), tokenizer=str(tokenizer_dir)))
    assert "100 documents" in whole.source and "(data.max_bytes)" not in whole.source
    tok = Tokenizer.load(tokenizer_dir)  # a cap above the data's size is no cut: the same store
    assert store_lib.build(data, tok, False, size).path == store_lib.build(data, tok, False).path
    with pytest.raises(store_lib.StoreError, match=r"no whole document within data.max_bytes=5"):
        store_lib.build(data, tok, False, 5)


def test_tokenizing_shows_its_progress_on_a_terminal_or_in_lines(
    tokenizer_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(progress_lib, "LINE_EVERY", 0.0)  # a line at every update
    tok = Tokenizer.load(tokenizer_dir)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}] * 30)
    store_lib.build(data, tok, progress=False)
    assert capsys.readouterr().out == ""
    write_jsonl(data, [{"text": "the dog"}] * 30)
    store_lib.build(data, tok, progress="auto")  # not a terminal: lines
    lines = capsys.readouterr().out.splitlines()
    size = data.stat().st_size
    assert lines[0] == f"  tokenizing {data} ({size}B), once: the tokens are cached"
    assert lines[1].startswith("  tokenizing: ") and f"B of {size}B (" in lines[1]
    assert lines[-2] == f"  tokenizing: {size}B of {size}B (100%), " + lines[-2].split(", ")[1]
    assert lines[-1].startswith("  tokenized 30 documents, 90 tokens in ")
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    meter = progress_lib.Meter(1000, "auto", "x", screen)  # a terminal: tqdm's bar
    meter.update(500)
    meter.close("done")
    assert meter.mode == "bar" and "\rtokenizing:   0%|" in screen.getvalue()
