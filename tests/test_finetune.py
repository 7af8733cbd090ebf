"""`jaxzero train --init-from hf:PATH`: the checkpoint sets the model and the tokenizer, its
weights are what the first step starts from, and the run exports as the same architecture."""

from __future__ import annotations

import json
from pathlib import Path

import _procs
import jax
import numpy as np
import pytest

from jaxzero import cli, hf
from jaxzero.data.tokenizer import Tokenizer
from jaxzero.train import data as data_lib

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"t{i}" for i in rng.integers(3, 64, n))
    rows = [
        {
            "prompt": words(int(rng.integers(2, 6))),
            "completion": " " + words(int(rng.integers(1, 8))),
        }
        for _ in range(120)
    ]
    path = tmp_path_factory.mktemp("ft") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(root: Path, name: str, *extra: str) -> int:
    return cli.main(
        [
            "train",
            *extra,
            "--set",
            "model.seq_len=16",
            "--set",
            "train.steps=2",
            "--set",
            "train.batch_size=8",
            "--set",
            "logging.eval_every=2",
            "--set",
            "logging.log_every=1",
            "--set",
            "logging.sample_tokens=0",
            "--set",
            "checkpoint.every=2",
            "--set",
            f"logging.root={root}",
            "--name",
            name,
            "--devices",
            "2",
        ]
    )


def test_the_first_step_starts_from_the_checkpoint(pairs, tmp_path):
    src = FIXTURES / "llama_gqa/single"
    assert _train(tmp_path, "ft", "--init-from", f"hf:{src}", "--data", str(pairs)) == 0
    run = tmp_path / "ft"
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    # the step-1 loss from the checkpoint's weights on the loader's first global batch,
    # masked to the completions (the tokenizer came from the checkpoint)
    tok = Tokenizer.load(src)
    corpus = data_lib.load_corpus(data_lib.DataConfig(path=str(pairs), tokenizer=str(src)))
    batch = data_lib.Loader(corpus.train, 16, 8, 0, mask=corpus.train_mask, eos=tok.eos_id).batch(0)
    model = hf.model(src, seq_len=16)
    out = model.loss_fn(jax.tree.map(np.asarray, hf.read_params(src, model)), batch)
    np.testing.assert_allclose(first["loss"], float(out.total / out.weight), rtol=1e-5)
    config = (run / "config.yaml").read_text()
    assert "arch: llama" in config and "n_kv_heads: 2" in config
    assert f"tokenizer: {src}" in config and "hf_config:" in config


def test_a_qwen2_run_exports_as_qwen2_with_its_own_head(pairs, tmp_path, capsys):
    """qwen2_tied/sharded: q/k/v biases and a shipped lm_head that unties it; the run's
    config copy keeps both, so export --format hf writes what it loaded."""
    src = FIXTURES / "qwen2_tied/sharded"
    tok = str(FIXTURES / "llama_gqa/single")  # this fixture has no tokenizer of its own
    assert (
        _train(tmp_path, "qw", "--init-from", f"hf:{src}", "--data", str(pairs), "--tokenizer", tok)
        == 0
    )
    assert (
        cli.main(["export", str(tmp_path / "qw"), "--out", str(tmp_path / "out"), "--format", "hf"])
        == 0
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    names = set(hf.Weights(tmp_path / "out").where)
    assert "lm_head.weight" in names and "model.layers.0.self_attn.q_proj.bias" in names
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_an_override_that_contradicts_the_checkpoint_is_refused(pairs, tmp_path, capsys):
    rc = _train(
        tmp_path,
        "bad",
        "--init-from",
        f"hf:{FIXTURES / 'llama_gqa/single'}",
        "--data",
        str(pairs),
        "--set",
        "model.d_model=64",
    )
    err = capsys.readouterr().err
    assert rc == 2 and "model.d_model=64 contradicts the checkpoint's 32" in err
    assert err.count("\n") == 1
    rc = _train(tmp_path, "bad2", "--init-from", "llama", "--data", str(pairs))
    assert rc == 2 and "use hf:PATH" in capsys.readouterr().err


def test_the_sft_config_takes_its_model_from_the_checkpoint(capsys):
    """experiments/configs/sft.yaml with a checkpoint: --print-config shows its fields."""
    root = Path(__file__).parent.parent
    argv = [
        "train",
        "--config",
        str(root / "experiments/configs/sft.yaml"),
        "--init-from",
        f"hf:{FIXTURES / 'llama_gqa/single'}",
        "--set",
        "model.seq_len=64",
        "--print-config",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "arch: llama" in out and "d_model: 32" in out and "n_kv_heads: 2" in out
    assert "init_from: hf:" in out and "lr: 2.0e-05" in out


def test_a_fine_tune_killed_mid_epoch_resumes_with_the_same_batches(pairs, tmp_path):
    """SIGKILL after step 6 (checkpoint of step 4): the resumed run reads exactly the packed,
    masked batches an uninterrupted one read, so its losses are the same bits."""
    import signal
    import sys

    from tests.test_checkpoint import _records, _run_until

    def cmd(name: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "jaxzero.train",
            "--init-from",
            f"hf:{FIXTURES / 'llama_gqa/single'}",
            "--data",
            str(pairs),
            "--steps",
            "8",
            "--name",
            name,
            "--simulate-devices",
            "2",
            "--set",
            f"logging.root={tmp_path}",
            "--set",
            "model.seq_len=16",
            "--set",
            "train.batch_size=8",
            "--set",
            "logging.log_every=1",
            "--set",
            "logging.eval_every=100",
            "--set",
            "logging.eval_batches=1",
            "--set",
            "logging.sample_tokens=0",
            "--set",
            "logging.tensorboard=false",
            "--set",
            "checkpoint.every=4",
        ]

    full = _procs.run(cmd("full"), capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-2000:]
    want = _records(tmp_path / "full")
    run = tmp_path / "killed"
    proc, _ = _run_until(cmd("killed"), run, 6, signal.SIGKILL, saved=4)
    assert proc.returncode == -signal.SIGKILL and max(_records(run)) < 8
    again = _procs.run(
        [sys.executable, "-m", "jaxzero.train", "--resume", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(step 4)" in again.stdout
    got = _records(run)
    assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]
