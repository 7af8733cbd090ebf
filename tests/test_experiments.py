"""The speed scripts still run end to end (tiny shapes, a step or two: no timing asserted)."""

import csv
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).parent.parent / "experiments"


def _run(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(EXPERIMENTS / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_bench_step_plain_model_prints_every_contestant(tmp_path):
    path = tmp_path / "bench.csv"
    out = _run(
        "bench_step.py",
        "--model",
        "plain",
        "--stages",
        "0",
        "3",
        "--steps",
        "1",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--seq-len",
        "16",
        "--batch",
        "4",
        "--csv",
        str(path),
    )
    assert "plain jit" in out and "shard_map + pmean" in out and "targets:" in out
    rows = list(csv.DictReader(path.open()))
    assert [r["stage"] for r in rows] == ["0", "3"]
    assert all(
        float(r[k]) > 0
        for r in rows
        for k in ("jaxzero_ms", "jit_no_donate_ms", "shard_map_ms", "gspmd_ms")
    )


def test_bench_step_llama_model_prints_every_contestant(tmp_path):
    path = tmp_path / "bench.csv"
    out = _run(
        "bench_step.py",
        "--model",
        "llama",
        "--stages",
        "3",
        "--steps",
        "1",
        "--devices",
        "2",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--seq-len",
        "16",
        "--vocab",
        "64",
        "--batch",
        "4",
        "--csv",
        str(path),
    )
    assert "plain jit" in out and "shard_map + pmean" in out and "targets:" not in out
    assert "2 heads, 1 kv, intermediate 96" in out  # GQA, SwiGLU of about 8/3 x d_model
    rows = list(csv.DictReader(path.open()))
    assert [(r["model"], r["stage"]) for r in rows] == [("llama", "3")]  # one stage: CI time
    assert all(
        float(r[k]) > 0
        for r in rows
        for k in ("jaxzero_ms", "jit_no_donate_ms", "shard_map_ms", "gspmd_ms")
    )


def test_mfu_script_runs_one_config(tmp_path):
    path = tmp_path / "mfu.csv"
    out = _run(
        "mfu.py",
        "--tiny",
        "--batch",
        "2",
        "--steps",
        "1",
        "--configs",
        "3,dots,auto",
        "--csv",
        str(path),
    )
    assert "failed" not in out
    (row,) = csv.DictReader(path.open())
    assert (row["stage"], row["remat"], row["batch"], row["backend"]) == ("3", "dots", "2", "cpu")
    assert row["fused_attention"] == "False"  # XLA's attention on CPU
    assert float(row["tokens_per_s"]) > 0 and float(row["loss"]) > 0


def test_gpu_options_script_compares_preset_and_xla_defaults():
    out = _run(
        "gpu_options.py",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--batch-per-device",
        "1",
    )
    assert out.count("compile ") == 2 and "largest loss difference" in out
    assert float(out.rsplit("XLA defaults: ", 1)[1].split()[0]) == 0.0  # no preset on CPU
