"""End to end: `jaxzero train` and `jaxzero plot` on 8 simulated CPU devices, and their errors."""

import contextlib
import errno
import io
import json
import math
import shutil
import sys
from pathlib import Path

import _procs
import numpy as np
import pytest
import yaml

from jaxzero.train import args as train_args
from jaxzero.train import config as C
from jaxzero.train import devices, metrics, optimizer, plot, rundir
from jaxzero.train import loop as train

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
STEPS = 4


def _args(root: Path, name: str, *extra: str) -> list[str]:
    return [
        "--config", TINY, "--steps", str(STEPS), "--name", name, "--devices", "8",
        "--set", f"logging.root={root}", "--set", "logging.log_every=1",
        "--set", "logging.eval_every=2", "--set", "logging.eval_batches=1",
        "--set", "logging.sample_tokens=8", "--set", "data.max_bytes=200000",
        "--set", "model.d_model=32", "--set", "model.seq_len=32",
        *extra,
    ]  # fmt: skip


def _train(root: Path, stage: int) -> tuple[Path, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train.main(_args(root, f"s{stage}", "--stage", str(stage))) == 0
    return root / f"s{stage}", printed.getvalue()


def _check_run_dir(run: Path) -> None:
    records = rundir.read_jsonl(run / rundir.METRICS_FILE)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "step_time"} <= set(r)
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert records[-1]["tokens"] == STEPS * 16 * 32
    assert records[0]["lr"] < records[-1]["lr"]  # warmup
    assert list(run.glob("events.out.tfevents.*"))
    cfg = C.load_file(run / train.RESOLVED_CONFIG)  # the resolved config reloads as a config
    assert (cfg.parallel.devices, cfg.model.vocab_size, cfg.train.steps) == (8, 256, STEPS)
    assert cfg.logging.name == run.name
    summary = (run / rundir.SUMMARY_FILE).read_text()
    assert '"flops_per_token"' in summary and '"final_val_loss"' in summary


def _losses(run: Path) -> np.ndarray:
    return np.array([r["loss"] for r in rundir.read_jsonl(run / rundir.METRICS_FILE)])


def test_train_stage_3_and_stage_0_then_plot(tmp_path, capsys):
    """One test, so that pytest-xdist never trains the same runs twice in two workers."""
    s3, printed = _train(tmp_path, 3)
    s0, _ = _train(tmp_path, 0)
    for run in (s3, s0):
        _check_run_dir(run)
    assert C.load_file(s3 / train.RESOLVED_CONFIG).parallel.stage == 3
    # Every stage computes the same update as one device: the losses agree to fp32 rounding.
    np.testing.assert_allclose(_losses(s3), _losses(s0), rtol=2e-5, atol=0)
    assert _losses(s3)[-1] < _losses(s3)[0]  # and it trains
    # stdout is not a TTY here: plain progress lines, then the summary and a sample.
    assert "step 1/4 | loss" in printed and "tok/s" in printed
    assert "MFU" in printed and "6*N + 12*L*D*S" in printed and "sample:" in printed
    assert " val bytes, vocab 256" in printed and "bytes tokens" not in printed  # the banner
    out = tmp_path / "curves.png"
    assert plot.main([str(s0), str(s3), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [plot.load_run(r).label for r in (s0, s3)] == [
        "s0 (stage 0, 8 dev)",
        "s3 (stage 3, 8 dev)",
    ]
    capsys.readouterr()
    assert train.main(_args(tmp_path, "s3")) == 2  # a finished run is never appended to
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.unit
def test_plot_rejects_a_directory_without_metrics(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def _error_of(argv, capsys) -> str:
    rc = train.main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--data", "/no/such/corpus.txt"], "/no/such/corpus.txt' does not exist"),
        (["--set", "model.dmodel=8"], "unknown config key 'model.dmodel'"),
        (["--set", "train.steps=many"], "train.steps: expected int"),
        (["--set", "optimizer.lr=[1]"], "optimizer.lr: expected float"),
        (["--stage", "abc"], "argument --stage: invalid int value"),
        (["--stage", "5"], "parallel.stage: expected one of [0, 1, 2, 3]"),
    ],
)
def test_user_errors_are_one_line_without_traceback(tmp_path, capsys, extra, expected):
    assert expected in _error_of(_args(tmp_path, "e", *extra), capsys)


def _exit_2_error(argv, capsys, main=train.main) -> str:
    """The one line a user error prints, after checking the exit status is 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def _file(directory: Path) -> Path:
    path = directory / "a-file"
    path.write_text("not a directory\n")
    return path


@pytest.mark.parametrize("under", ["", "runs"], ids=["root-is-a-file", "root-under-a-file"])
def test_run_root_that_is_a_file_is_one_line_exit_2(tmp_path, capsys, under):
    root = _file(tmp_path) / under if under else _file(tmp_path)
    err = _exit_2_error(_args(tmp_path, "r", "--set", f"logging.root={root}"), capsys)
    assert "cannot write run directory" in err
    assert f"{str(_file(tmp_path))!r} is a file, not a directory" in err
    assert "logging.root" in err  # what to do


def test_read_only_run_root_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "mkdir", read_only)
    err = _exit_2_error(_args(tmp_path / "ro", "r"), capsys)
    assert f"cannot write run directory {str(tmp_path / 'ro' / 'r')!r}: Read-only" in err


def test_run_root_parents_are_created_and_an_unstarted_run_frees_its_name(tmp_path):
    cfg = C.Config(logging=C.LoggingConfig(root=str(tmp_path / "new" / "root"), name="r"))
    run = rundir.prepare_run_dir(cfg, True)  # missing parents are created
    assert run == tmp_path / "new" / "root" / "r" and run.is_dir()
    # Stopped before its first record: a config, an empty metrics.jsonl, an events file.
    (run / train.RESOLVED_CONFIG).write_text(C.dump_yaml(cfg))
    (run / "events.out.tfevents.1.host").write_bytes(b"stale")
    assert (run / rundir.METRICS_FILE).read_text() == "" and not rundir.holds_run(run)
    assert rundir.prepare_run_dir(cfg, True) == run  # the name is free again
    assert not list(run.glob("events.out.tfevents.*"))  # and the stale events are gone
    (run / rundir.METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n')
    assert rundir.holds_run(run)
    with pytest.raises(C.ConfigError, match="already holds a run"):
        rundir.prepare_run_dir(cfg, True)
    other = tmp_path / "tb"  # someone else's event files: never deleted
    other.mkdir()
    (other / "events.out.tfevents.2.host").write_bytes(b"theirs")
    assert rundir.holds_run(other)


def test_rerunning_a_saved_config_gets_a_fresh_name(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    saved = run / train.RESOLVED_CONFIG
    saved.write_text(C.dump_yaml(C.Config(logging=C.LoggingConfig(root=str(tmp_path), name="r"))))

    def name(*argv: str) -> str:
        args = train_args.build_parser().parse_args(["--config", str(saved), *argv])
        return train_args.config_from_args(args).logging.name

    assert name() == "r"  # nothing logged there yet
    (run / rundir.METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n')
    assert name().startswith("r-2")  # r-YYYYmmdd-HHMMSS
    # A name given on the command line is taken as given (and then refused as taken).
    assert name("--name", "r") == name("--set", "logging.name=r") == "r"
    assert name("--set", "logging={name: r}") == "r"


def test_binary_data_file_is_refused_like_in_a_directory(tmp_path, capsys):
    (tmp_path / "prog").write_bytes(b"\x7fELF\x02\x01\x01\x00" * 200)
    err = _exit_2_error(_args(tmp_path, "e", "--data", str(tmp_path / "prog")), capsys)
    assert "looks binary" in err and "--set data.format=bytes" in err


@pytest.mark.unit
def test_print_config_resolves_what_it_can_without_the_data(tmp_path, capsys):
    assert train.main(["--print-config", "--set", f"logging.root={tmp_path}"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(printed)
    cfg = C.load_file(tmp_path / "printed.yaml")  # still a config file
    assert (cfg.model.vocab_size, cfg.parallel.devices) == (256, 8)
    assert cfg.logging.name.startswith("stage3-8dev-") and "--name fixes it" in printed
    # uint16 tokens: only the data knows the vocab, and the output says so.
    assert train.main(["--print-config", "--name", "t", "--data", "tokens.bin"]) == 0
    printed = capsys.readouterr().out
    assert "vocab_size: null" in printed and "set at start-up from the data" in printed
    assert "name: t\n" in printed and "--name fixes it" not in printed


def test_plot_to_an_unwritable_path_is_one_line_exit_2(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / rundir.METRICS_FILE).write_text('{"step": 1, "tokens": 64, "loss": 2.0}\n')
    err = _exit_2_error([str(run), "-o", str(_file(tmp_path) / "x.png")], capsys, plot.main)
    assert "cannot write" in err and "is a file, not a directory" in err
    out = tmp_path / "new" / "x.png"  # a missing parent directory is created
    assert plot.main([str(run), "-o", str(out)]) == 0 and out.is_file()


def test_empty_corpus_and_too_short_corpus(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    err = _error_of(_args(tmp_path, "e", "--data", str(tmp_path / "empty.txt")), capsys)
    assert "empty" in err
    (tmp_path / "short.txt").write_text("x = 1\n" * 8)  # 48 bytes < seq_len 32 + 1 in val split
    err = _error_of(_args(tmp_path, "e", "--data", str(tmp_path / "short.txt")), capsys)
    assert "model.seq_len=32 needs at least 33 tokens" in err


def test_nan_loss_stops_training_naming_the_step(tmp_path, capsys):
    argv = _args(
        tmp_path, "nan", "--devices", "1", "--stage", "0",
        "--set", "optimizer.lr=1e30", "--set", "optimizer.max_grad_norm=null",
        "--set", "optimizer.warmup_steps=0",
    )  # fmt: skip
    err = _error_of(argv, capsys)
    assert "at step 2" in err and "last with finite values" in err
    records = rundir.read_jsonl(tmp_path / "nan" / rundir.METRICS_FILE)
    assert [r["step"] for r in records] == [1]  # nothing non-finite was logged


def test_cli_subprocess_error_exit_code(tmp_path):
    proc = _procs.run(
        [sys.executable, "-m", "jaxzero.cli", "train", "--data", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("jaxzero train: error: data path")
    assert "Traceback" not in proc.stderr


@pytest.mark.unit
def test_lr_schedule_warms_up_then_decays_to_the_floor():
    opt = C.OptimizerConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    sched = optimizer.lr_schedule(opt, steps=100)
    lrs = np.array([float(sched(i)) for i in range(100)])
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert np.all(np.diff(lrs[:10]) > 0) and np.all(np.diff(lrs[10:]) <= 1e-7)
    assert lrs[-1] == pytest.approx(0.1)


@pytest.mark.unit
def test_weight_decay_only_on_kernels():
    import jax

    from jaxzero.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, tie_embeddings=False))
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    mask = optimizer.decay_mask(shapes)
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): v
            for p, v in jax.tree_util.tree_leaves_with_path(mask)}  # fmt: skip
    decayed = sorted(k for k, v in flat.items() if v)
    assert decayed and all(k.endswith("kernel") for k in decayed)
    assert "head/kernel" in decayed
    for key in ("wte", "wpe", "ln_f/scale", "ln_f/bias"):
        assert flat[key] is False


@pytest.mark.unit
def test_weight_decay_on_llama_projections_and_head_only():
    import jax

    from jaxzero.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        qkv_bias=True,
        tie_word_embeddings=False,
    )
    mask = optimizer.decay_mask(jax.eval_shape(Llama(cfg).init, jax.random.key(0)))
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): v
            for p, v in jax.tree_util.tree_leaves_with_path(mask)}  # fmt: skip
    assert sorted(k for k, v in flat.items() if v) == [
        "layers/mlp/down_proj/weight", "layers/mlp/gate_proj/weight", "layers/mlp/up_proj/weight",
        "layers/self_attn/k_proj/weight", "layers/self_attn/o_proj/weight",
        "layers/self_attn/q_proj/weight", "layers/self_attn/v_proj/weight", "lm_head/weight",
    ]  # fmt: skip


@pytest.mark.unit
def test_devices_to_simulate(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    P = C.ParallelConfig
    assert devices.devices_to_simulate(P()) == 8  # CPU only, one device: simulate 8
    assert devices.devices_to_simulate(P(devices=4)) == 4
    assert devices.devices_to_simulate(P(simulate_devices=2)) == 2
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert devices.devices_to_simulate(P()) is None  # already several CPU devices
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert devices.devices_to_simulate(P()) is None  # an accelerator: leave it alone


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.unit
def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    record = {"step": 10, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0}
    lines = io.StringIO()
    progress = metrics.Progress(20, "auto", stream=lines)
    progress.update(10, 2.5, 1234.0)
    progress.log(record)
    progress.close()
    assert progress.mode == "lines"
    assert (
        lines.getvalue() == "step 10/20 | loss 2.5000 | lr 1.00e-03 | gnorm 0.500 | 1,234 tok/s\n"
    )
    tty = _TTY()
    progress = metrics.Progress(20, "auto", stream=tty)
    progress.update(10, 2.5, 1234.0)
    progress.log(record)  # no val loss: the bar already shows it
    progress.log({**record, "val_loss": 2.7})
    progress.close()
    assert progress.mode == "bar"
    assert "10/20" in tty.getvalue() and "val 2.7000" in tty.getvalue()
    assert tty.getvalue().count("step 10/20") == 1
    quiet = io.StringIO()
    progress = metrics.Progress(20, "auto", enabled=False, stream=quiet)  # processes other than 0
    progress.log(record)
    progress.print("hello")
    assert quiet.getvalue() == ""


@pytest.mark.unit
def test_metrics_writer_nulls_non_finite_values(tmp_path):
    writer = metrics.MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"step": 1, "loss": float("nan"), "lr": 0.1})
    writer.close()
    assert rundir.read_jsonl(tmp_path / rundir.METRICS_FILE) == [
        {"step": 1, "loss": None, "lr": 0.1}
    ]
    metrics.MetricsWriter(None).write({"step": 1})  # inert on other processes


@pytest.mark.unit
def test_mfu_against_a_configured_or_data_sheet_peak_and_none_on_cpus():
    """A CPU has no peak to divide by (a nominal 80 GFLOP/s a core printed "MFU 80.6%" on
    an AVX-512 machine): its summary says so and how to give one, and prints no MFU."""
    cpu = type("Device", (), {"platform": "cpu", "device_kind": "cpu"})()
    gpu = type("Device", (), {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})()
    assert metrics.peak_flops_per_device(gpu, None)[0] == 989e12
    assert metrics.peak_flops_per_device(gpu, 1e12) == (1e12, "train.peak_flops_per_device")
    assert metrics.peak_flops_per_device(cpu, 1e12) == (1e12, "train.peak_flops_per_device")
    peak, source = metrics.peak_flops_per_device(cpu, None)
    assert peak is None and "set train.peak_flops_per_device" in source
    assert metrics.mfu(6e6, 1000.0, 1e10, 2) == pytest.approx(6e9 / 2e10)
    assert metrics.mfu(6e6, 1000.0, None, 2) is None
    summary = {
        "name": "r", "stage": 3, "devices": 8, "params": 10, "steps": 1, "tokens": 64,
        "wall_s": 1.0, "train_s": 1.0, "tokens_per_s": 1000.0, "flops_per_token": 6e6,
        "flops_formula": "6*N", "achieved_flops": 6e9, "peak_flops_per_device": None,
        "peak_flops_source": source, "mfu": None, "final_loss": 1.0, "final_val_loss": 1.0,
        "peak_memory_bytes_per_device": None,
    }  # fmt: skip
    (line,) = [x for x in metrics.format_summary(summary).splitlines() if "MFU" in x]
    assert line == f"throughput 1,000 tokens/s | 6.00 GFLOP/s | MFU n/a ({source})"
    line = metrics.format_summary({**summary, "peak_flops_per_device": 1e10, "mfu": 0.075})
    assert "| MFU 7.5% of 1e+10 FLOP/s per device" in line


# --------------------------------------------------------------------------- paths


@pytest.mark.unit
def test_a_run_config_holds_absolute_paths_and_says_so(tmp_path, capsys, monkeypatch):
    """data.path, data.tokenizer, the base model (train.init_from), checkpoint.dir and
    model.hf_config were stored as typed, relative to where the run started."""
    monkeypatch.chdir(tmp_path)
    argv = ["--print-config", "--name", "t", "--data", "d.txt", "--tokenizer", "tok/"]
    argv += ["--set", "checkpoint.dir=../ck", "--set", "model.hf_config=hf.json"]
    assert train.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(C.PATHS_NOTE)
    cfg = C.from_dict(yaml.safe_load(printed))
    assert cfg.data.path == str(tmp_path / "d.txt")
    assert cfg.data.tokenizer == str(tmp_path / "tok")
    assert cfg.checkpoint.dir == str(tmp_path.parent / "ck")
    assert cfg.model.hf_config == str(tmp_path / "hf.json")
    got = C.absolute_paths(C.Config(train=C.TrainConfig(init_from="hf:~/base")))
    assert got.train.init_from == "hf:" + str(Path.home() / "base")
    for spec in ("hf:", "llama", None):  # not paths: left for finetune.source to refuse
        cfg = C.Config(train=C.TrainConfig(init_from=spec))
        assert C.absolute_paths(cfg) == cfg


def test_a_run_resumes_samples_and_exports_from_another_directory(tmp_path, monkeypatch, capsys):
    """A fine-tune started with relative paths (--init-from hf:base --data pairs.jsonl)
    could be resumed, sampled and exported only from the directory it started in; the
    export from elsewhere left a model without its tokenizer."""
    from jaxzero import cli

    start, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(Path(__file__).parent / "fixtures/hf/llama_gqa/single", start / "base")
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"t{i}" for i in rng.integers(3, 64, n))
    rows = [{"prompt": words(3), "completion": " " + words(4)} for _ in range(60)]
    (start / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(start)
    argv = ["train", "--init-from", "hf:base", "--data", "pairs.jsonl", "--name", "ft"]
    argv += ["--steps", "2", "--devices", "2", "--set", "model.seq_len=16"]
    argv += ["--set", "train.batch_size=8", "--set", "logging.eval_every=2"]
    argv += ["--set", "logging.sample_tokens=0", "--set", "logging.progress=none"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    saved = C.load_file(start / "runs/ft/config.yaml")
    assert saved.data.path == str(start / "pairs.jsonl")
    assert saved.data.tokenizer == str(start / "base")
    assert saved.train.init_from == f"hf:{start / 'base'}"

    monkeypatch.chdir(elsewhere)
    run = "../project/runs/ft"  # as a user types it from here
    capsys.readouterr()
    assert cli.main(["train", "--resume", run, "--steps", "3"]) == 0, capsys.readouterr().err
    assert [r["step"] for r in rundir.read_jsonl(start / "runs/ft/metrics.jsonl")][-1] == 3
    assert cli.main(["sample", run, "--prompt", "t3 t4", "--tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("t3 t4")
    assert cli.main(["export", run, "--out", "ft-hf", "--format", "hf"]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {
        p.name for p in (elsewhere / "ft-hf").iterdir()
    }
