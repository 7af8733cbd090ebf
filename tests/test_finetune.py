"""`jaxzero train --init-from hf:PATH`: the checkpoint sets the model and the tokenizer, its
weights are what the first step starts from, and the run exports as the same architecture."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import _procs
import jax
import numpy as np
import pytest

from jaxzero import cli, hf, make_mesh
from jaxzero.data.tokenizer import Tokenizer
from jaxzero.hf import safetensors
from jaxzero.models import from_fields
from jaxzero.train import data as data_lib
from jaxzero.train import finetune
from jaxzero.train import loop as train_loop
from jaxzero.train.config import Config, ConfigError

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
    """configs/sft.yaml with a tiny checkpoint: --print-config shows its fields,
    and the window is the model's own context (128 tokens), not one the model refuses."""
    root = Path(__file__).parent.parent
    argv = [
        "train",
        "--config",
        str(root / "configs/sft.yaml"),
        "--init-from",
        f"hf:{FIXTURES / 'llama_gqa/single'}",
        "--print-config",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "arch: llama" in out and "d_model: 32" in out and "n_kv_heads: 2" in out
    assert "init_from: hf:" in out and "lr: 2.0e-05" in out and "seq_len: 128" in out
    assert "weight_decay: 0.0" in out and "warmup_steps: 30" in out  # 3% of its 1000 steps


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
            "20",  # a tiny step takes milliseconds: the kill must land before the end
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
    assert proc.returncode == -signal.SIGKILL and max(_records(run)) < 20
    again = _procs.run(
        [sys.executable, "-m", "jaxzero.train", "--resume", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(step 4)" in again.stdout
    got = _records(run)
    assert [got[s] for s in range(1, 21)] == [want[s] for s in range(1, 21)]


def _configured(*argv: str):
    """The config ``jaxzero train ARGV`` would run (nothing is read but config files)."""
    from jaxzero.train import args as train_args

    return train_args.config_from_args(train_args.build_parser().parse_args(list(argv)))


@pytest.mark.unit
def test_a_fine_tune_gets_fine_tuning_defaults_and_every_setting_given_wins(tmp_path):
    """Not the byte GPT's seq_len 64, lr 4e-3, weight decay 0.1, 30 warmup steps and
    prompt 'def ': the model's context (capped), TRL's 2e-5, no decay, 3% warmup, a
    validation prompt. A value from a config file, a flag or --set is kept as given."""
    src = f"hf:{FIXTURES / 'llama_gqa/single'}"  # max_position_embeddings 128
    cfg = _configured("--init-from", src)
    assert cfg.model.seq_len == 128 and cfg.optimizer.lr == 2e-5
    assert cfg.optimizer.weight_decay == 0.0 and cfg.optimizer.warmup_steps == 24  # 3% of 800
    assert cfg.logging.sample_prompt is None and cfg.data.max_bytes is None  # all the data
    assert cfg.optimizer.b2 == 0.99 and cfg.train.batch_size == 32  # the rest: Config's
    big = tmp_path / "big"  # a 4k context: the window is capped at 1024
    big.mkdir()
    raw = json.loads((FIXTURES / "llama_gqa/single/config.json").read_text())
    (big / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 4096}))
    assert _configured("--init-from", f"hf:{big}").model.seq_len == 1024

    file = tmp_path / "ft.yaml"  # train.init_from from a file, beside settings of its own
    file.write_text(f"train: {{init_from: '{src}'}}\noptimizer: {{lr: 1.0e-4}}\n")
    cfg = _configured(
        "--config", str(file), "--steps", "100", "--set", "model.seq_len=32",
        "--set", "optimizer.weight_decay=0.1", "--set", "logging.sample_prompt=Once",
    )  # fmt: skip
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (1e-4, 0.1)
    assert cfg.model.seq_len == 32 and cfg.logging.sample_prompt == "Once"
    assert cfg.optimizer.warmup_steps == 3  # 3% of the 100 steps asked for
    assert (
        _configured(
            "--config", str(file), "--set", "optimizer.warmup_steps=0"
        ).optimizer.warmup_steps
        == 0
    )
    scratch = _configured()  # a run from scratch keeps the pre-training defaults
    assert (scratch.model.seq_len, scratch.optimizer.lr) == (64, 4e-3)
    assert scratch.logging.sample_prompt == "def " and scratch.data.max_bytes == 4_000_000


def test_print_config_says_which_values_are_fine_tuning_defaults(capsys):
    src = f"hf:{FIXTURES / 'llama_gqa/single'}"
    assert (
        cli.main(["train", "--init-from", src, "--set", "optimizer.lr=1e-4", "--print-config"]) == 0
    )
    out = capsys.readouterr().out
    assert "seq_len: 128" in out and "lr: 0.0001" in out and "sample_prompt: null" in out
    (note,) = [line for line in out.splitlines() if line.startswith("# fine-tuning defaults")]
    assert "model.seq_len (the checkpoint's context, at most 1024)" in note
    assert "optimizer.weight_decay" in note and "optimizer.lr" not in note  # 1e-4 was given
    assert "data.max_bytes (null: all of the data)" in note


@pytest.mark.unit
def test_the_end_of_run_sample_starts_from_the_first_validation_prompt():
    """logging.sample_prompt null: the first validation document's prompt (its tokens before
    the first one a loss is taken on); unmasked data: its first tokens, at most half."""
    from jaxzero.train import config as config_lib
    from jaxzero.train import loop

    eos = 0
    val = np.array([7, 8, 9, 4, 5, eos, 6, 6, eos], np.uint16)  # prompt 7 8 9, reply 4 5
    mask = np.array([0, 0, 0, 1, 1, 1, 0, 1, 1], np.uint8)
    corpus = data_lib.Corpus(val, val, "uint16", 10, "t", mask, mask, eos)
    np.testing.assert_array_equal(data_lib.val_prompt(corpus), [7, 8, 9])
    plain = data_lib.Corpus(val, val, "uint16", 10, "t", eos=eos)
    np.testing.assert_array_equal(data_lib.val_prompt(plain), [7, 8])  # half of 5 tokens
    np.testing.assert_array_equal(data_lib.val_prompt(plain, max_tokens=1), [7])

    prompts = []

    class Model:
        def generate(self, params, prompt, n, rng, temperature, eos=None):
            prompts.append(prompt[0].tolist())
            return prompt

    engine = type("Engine", (), {"gather_params": lambda self, state: None})()
    cfg = config_lib.Config()
    ft = config_lib.override(cfg, "logging.sample_prompt", None)
    assert loop._sample(ft, engine, None, Model(), corpus) == "7 8 9"
    bytes_corpus = data_lib.Corpus(np.frombuffer(b"x = 1\n", np.uint8), val, "bytes", 256, "b")
    assert loop._sample(cfg, engine, None, Model(), bytes_corpus) == "def "
    assert prompts == [[7, 8, 9], list(b"def ")]


# --------------------------------------------------------------------------- bad checkpoints


def _copy(name: str, root: Path, to: str) -> Path:
    return Path(shutil.copytree(FIXTURES / name, root / to))


def _rewrite(path: Path, change) -> None:
    """Rewrites a safetensors file with ``change(dict of tensors)`` applied."""
    tensors = change(safetensors.read_all(path))
    entries = [(k, v.dtype, v.shape) for k, v in tensors.items()]
    safetensors.write(path, entries, iter(tensors.values()), {"format": "pt"})


def _damaged(root: Path) -> dict[str, tuple[Path, str]]:
    """Checkpoint directories damaged as downloads and hand edits damage them, each with
    what its one line must say."""
    out = {}
    d = _copy("llama_gqa/single", root, "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-1000])
    out["truncated"] = d, "model.safetensors is truncated"
    d = _copy("llama_gqa/single", root, "garbage")
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    out["garbage"] = d, "truncated or not safetensors"
    d = _copy("llama_gqa/single", root, "shape")
    k = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(d / "model.safetensors", lambda t: {n: v[:8] if n == k else v for n, v in t.items()})
    out["shape"] = d, f"tensor {k} has shape [8, 32]; the config needs [16, 32]"
    d = _copy("llama_gqa/single", root, "missing")
    up = "model.layers.1.mlp.up_proj.weight"
    _rewrite(d / "model.safetensors", lambda t: {n: v for n, v in t.items() if n != up})
    out["missing"] = d, f"tensor {up} is missing"
    d = _copy("llama_gqa/single", root, "int32")
    raw = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["model.norm.weight"]["dtype"] = "I32"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (d / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    out["int32"] = d, "tensor model.norm.weight has dtype I32"
    d = _copy("llama_gqa/sharded", root, "shard")
    sorted(d.glob("model-*.safetensors"))[1].unlink()
    out["shard"] = d, "model-00002-of-00004.safetensors is missing (listed in"
    d = _copy("llama_gqa/sharded", root, "index")
    (d / "model.safetensors.index.json").write_text("{not json")
    out["index"] = d, "model.safetensors.index.json is unreadable (JSONDecodeError"
    d = _copy("llama_gqa/single", root, "bin")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    out["bin"] = d, "no safetensors weights (found pytorch_model.bin); jaxzero reads safetensors"
    return out


def _finetune_config(src: Path, data: Path, tokenizer: Path | None) -> Config:
    cfg = Config()
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, init_from=f"hf:{src}"),
        data=dataclasses.replace(
            cfg.data, path=str(data), tokenizer=None if tokenizer is None else str(tokenizer)
        ),
    )


@pytest.mark.unit
def test_damaged_checkpoints_are_refused_in_one_line_before_anything_is_built(pairs, tmp_path):
    """What jaxzero sample says in one line, train says too, from the config's resolution
    (before a run directory or a compile); each message names the file or tensor."""
    tok = FIXTURES / "llama_gqa/single"
    for case, (path, says) in _damaged(tmp_path).items():
        with pytest.raises(ConfigError) as e:
            finetune.resolve(_finetune_config(path, pairs, tok))
        msg = str(e.value)
        assert msg.startswith("train.init_from: ") and says in msg, (case, msg)
        assert "\n" not in msg, case
    notok = _copy("llama_gqa/sharded", tmp_path, "notok")  # no tokenizer.json of its own
    with pytest.raises(ConfigError, match="notok has no tokenizer .*pass --tokenizer PATH"):
        finetune.resolve(_finetune_config(notok, pairs, None))
    cfg, _ = finetune.resolve(_finetune_config(notok, pairs, tok))  # given one, it trains
    assert cfg.data.tokenizer == str(tok)


@pytest.mark.unit
def test_explicit_cudnn_attention_off_a_gpu_is_refused_in_one_line():
    from jaxzero.models.common import cudnn_refusal

    assert cudnn_refusal("auto", np.float32, "cpu") is None
    assert "16-bit inputs, not float32" in str(cudnn_refusal("cudnn", np.float32, "gpu"))
    assert cudnn_refusal("cudnn", jax.numpy.bfloat16, "gpu") is None
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, attention="cudnn", vocab_size=256)
    )
    with pytest.raises(ConfigError, match=r"^model.attention=cudnn needs an NVIDIA GPU \(this"):
        train_loop.build(cfg, make_mesh(1))


def test_a_nan_in_the_weights_is_one_line_naming_the_tensor(pairs, tmp_path, capsys):
    """Not "loss is nan ... Lower optimizer.lr" at step 1: the tensor, as it loads."""
    src = _copy("llama_gqa/single", tmp_path, "nan")
    up = "model.layers.1.mlp.up_proj.weight"

    def poison(t):
        t[up] = t[up].copy()
        t[up][0, 3] = np.nan
        return t

    _rewrite(src / "model.safetensors", poison)
    rc = _train(tmp_path, "nan", "--init-from", f"hf:{src}", "--data", str(pairs))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"jaxzero train: error: train.init_from: {src}: tensor {up} holds NaN" in err


# --------------------------------------------------------------------------- several processes


@pytest.mark.unit
def test_no_process_reads_the_architecture_another_writes(tmp_path):
    """pin_architecture on a process other than 0 writes nothing, and that process's
    model is built from what it computed, not from rank 0's file (not there yet); a
    resumed run builds the same architecture from the pinned copy."""
    src = FIXTURES / "qwen2_tied/sharded"  # an untied head: the copy differs from the source
    cfg, pretrained = finetune.resolve(
        _finetune_config(src, tmp_path / "absent.jsonl", FIXTURES / "llama_gqa/single")
    )
    cfg, raw = finetune.pin_architecture(cfg, pretrained, tmp_path, is_main=False)
    assert not (tmp_path / finetune.HF_CONFIG).exists()
    model, _, _ = train_loop.build(cfg, make_mesh(1), pretrained)
    assert model is pretrained  # the checkpoint's config.json, read once by resolve
    rebuilt = from_fields(cfg.model, raw)  # as --resume builds it, from the copy
    assert rebuilt.config == pretrained.config and getattr(rebuilt, "hf_config", None) == raw
    assert raw["tie_word_embeddings"] is False
    finetune.pin_architecture(cfg, pretrained, tmp_path, is_main=True)  # what resume reads
    assert json.loads((tmp_path / finetune.HF_CONFIG).read_text()) == raw


def test_a_fine_tune_under_launch_with_two_processes(pairs, tmp_path):
    """Both ranks start from a fresh copy of the data (each builds the token store) and
    the checkpoint; rank 1 once read rank 0's hf_config.json before it was written."""
    data = tmp_path / "pairs.jsonl"
    shutil.copyfile(pairs, data)
    env = _procs.child_env()  # 2 devices a process
    env["JAX_PLATFORMS"] = "cpu"
    proc = _procs.run(
        [sys.executable, "-m", "jaxzero.cli", "launch", "--nproc-per-node", "2",
         "--simulate-devices", "2", "--", "jaxzero", "train",
         "--init-from", f"hf:{FIXTURES / 'llama_gqa/single'}", "--data", str(data),
         "--steps", "2", "--name", "mp", "--set", f"logging.root={tmp_path}",
         "--set", "model.seq_len=16", "--set", "train.batch_size=8",
         "--set", "logging.sample_tokens=0", "--set", "logging.tensorboard=false",
         "--set", "logging.eval_batches=1"],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0] step 2/2" in proc.stdout
    assert "2 process(es) x 2 local device(s) = 4 devices" in proc.stdout
    run = tmp_path / "mp"
    assert json.loads((run / finetune.HF_CONFIG).read_text())["architectures"]
    assert len(json.loads((run / "summary.json").read_text())) > 0


def test_a_fine_tune_is_planned_and_auto_trains_the_first_choice(pairs, tmp_path, capsys):
    """``jaxzero plan --init-from hf:DIR`` plans the checkpoint's Llama with the data's
    batch (a loss mask, segment ids); ``zero.auto`` fine-tunes with the first choice."""
    src = f"hf:{FIXTURES / 'llama_gqa/single'}"
    argv = [
        "plan", "--init-from", src, "--data", str(pairs), "--devices", "2",
        "--set", "model.seq_len=16", "--set", "train.batch_size=8", "--stages", "2", "3",
        "--remats", "none", "--micro-batch-counts", "1", "--max-batch", "0", "--json",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert "llama" in out["title"] and {r["status"] for r in out["rows"]} == {"fits"}
    assert _train(tmp_path, "auto", "--init-from", src, "--data", str(pairs),
                  "--set", "zero.auto=true") == 0  # fmt: skip
    assert "zero.auto: stage" in capsys.readouterr().out
    assert (tmp_path / "auto" / "checkpoints" / "2").is_dir()
