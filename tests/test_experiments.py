"""The speed scripts still run end to end (tiny shapes, a step or two: no timing asserted)."""

import csv
import sys
from pathlib import Path

import _procs
import pytest

ROOT = Path(__file__).parent.parent


def _run(script: str, *args: str, optimized: bool = False) -> str:
    """``python -m experiments.SCRIPT ARGS`` from the repository root, as the docs run it
    (``optimized``: at XLA's usual code generation, :func:`_procs.optimized_env`)."""
    out = _procs.run(
        [sys.executable, "-m", f"experiments.{script.removesuffix('.py')}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=_procs.optimized_env() if optimized else None,
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
    assert "plain jit" in out and "shard_map + pmean" in out and "targets:" in out
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


def test_bench_step_zoo_runs_each_model_in_its_own_process_and_tables_them(tmp_path):
    """One model, the cheapest to compile (each costs about ten XLA:CPU compilations):
    the driver is the same for all; the table's rules are the next test's."""
    path = tmp_path / "zoo.csv"
    shrink = ["--layers", "1", "--d-model", "16", "--seq-len", "8", "--batch", "8"]
    out = _run(
        "bench_step.py",
        "--zoo",
        "--models",
        "embed",
        "--invocations",
        "1",
        "--stages",
        "3",
        "--steps",
        "1",
        "--devices",
        "2",
        "--vocab",
        "64",
        *shrink,
        "--csv",
        str(path),
    )
    rows = list(csv.DictReader(path.open()))
    assert [(r["model"], r["stage"]) for r in rows] == [("embed", "3")]
    assert all(float(r["jaxzero_other_donation_ms"]) > 0 for r in rows)
    assert "| embed | 3 |" in out and "targets:" in out


def test_the_zoo_table_holds_each_model_to_its_target(tmp_path):
    """Stage 3 may take 1.25x plain jit without per-layer gathering, 1.15x with it."""
    path = tmp_path / "zoo.csv"
    fields = "model,stage,invocation,jaxzero_ms,gspmd_ms,jit_donate_ms,jit_no_donate_ms"
    fields += ",shard_map_ms,jaxzero_other_donation_ms"
    rows = [
        "user_gpt,3,1,120,100,100,110,100,100",  # 1.20x: under 1.25
        "gpt,3,1,120,100,100,110,100,100",  # 1.20x: over gpt's 1.15 (per layer)
        "gpt,0,1,105,100,100,110,100,100",
    ]
    path.write_text("\n".join([fields, *rows]) + "\n")
    out = _run("bench_step.py", "--table", str(path))
    assert "| user_gpt | 3 | 120.0 | 1.20 (1.20–1.20) |" in out
    assert "| 1.25 met |" in out and "| 1.15 **missed** |" in out and "| 1.10 met |" in out
    assert "targets: MISSED: gpt stage 3" in out


@pytest.mark.parametrize("model", ["user_gpt", "convnet"])
def test_zoo_models_the_driver_test_skips_take_a_step_like_plain_jit(model):
    """The zoo models no other test runs, built tiny: a stage-3 step's loss is plain jit's
    (the zoo times them, so they must be what they claim to be; every timed run checks
    the same on its first step)."""
    vocab = "64" if model == "user_gpt" else "10"
    shrink = ["--layers", "1", "--d-model", "16", "--seq-len", "8", "--batch", "8"]
    out = _run(
        "bench_step.py", "--check", "--model", model, "--stages", "3", "--devices", "2",
        "--vocab", vocab, *shrink,
    )  # fmt: skip
    assert f"{model}: first-step losses agree" in out and "'jaxzero 3'" in out


def test_bench_step_profile_says_where_each_step_spends_its_time():
    """--profile reads every contestant's kernels from a jax.profiler trace: stage 3's
    step spends time in collectives (its all-gathers and reduce-scatters), every step
    in some kernel."""
    shrink = ["--layers", "1", "--d-model", "16", "--seq-len", "8", "--batch", "8"]
    out = _run(
        "bench_step.py", "--profile", "--model", "embed", "--stages", "3", "--devices", "2",
        "--vocab", "64", "--steps", "1", *shrink,
    )  # fmt: skip
    header, *rows = out.split("largest kernels")[0].strip().splitlines()[1:]
    kinds = header.split()
    assert kinds[:3] == ["step", "ms", "collectives"] and kinds[-1] == "sum"
    cells = {r.rsplit(None, 6)[0].strip(): [float(x) for x in r.rsplit(None, 6)[1:]] for r in rows}
    assert set(cells) >= {"plain jit, donate=False", "jaxzero 3", "GSPMD 3"}
    assert cells["jaxzero 3"][1] > 0  # collectives
    assert all(c[-1] > 0 for c in cells.values())  # kernel time summed over kinds


def test_sample_speed_script_times_the_uncached_and_cached_loops():
    out = _run(
        "sample_speed.py",
        "--shape",
        "tiny",
        "--window",
        "16",
        "--prompt-len",
        "4",
        "--tokens",
        "6",
        "--old-tokens",
        "2",
    )
    assert "uncached:" in out and "ms/token" in out and "speed-up per token" in out
    assert "the first 2 of 2 uncached tokens are the cached loop's" in out
    assert float(out.rsplit("max |diff| ", 1)[1].split()[0]) < 1e-4


def test_cpu_placement_compiles_one_program_twice_and_profiles_both():
    """The two compiled steps are the same program but for donation's alias line (the
    script's premise, checked, not assumed), and both are timed and profiled."""
    out = _run(
        "cpu_placement.py", "--d-model", "16", "--layers", "1", "--seq-len", "8",
        "--batch", "4", "--steps", "1", "--rounds", "1", optimized=True,
    )  # fmt: skip  # the programs users compile (jaxlib 0.10's legacy emitters fuse apart)
    assert "compiled programs identical but for the alias line: True" in out
    assert float(out.split("donating / not: ")[1].split()[0]) > 0
    assert "copies/transposes in all:" in out


def test_same_program_ignores_only_the_alias_line_and_the_root_tuples_name():
    from experiments.cpu_placement import same_program

    layout = "entry_computation_layout={(f32[2]{0})->(f32[2]{0})}\n"
    donating = (
        "HloModule jit_step, input_output_alias={ {0}: (0, {}, may-alias) }, " + layout
        + "  ROOT %tuple.15 = (f32[2]{0}) tuple(%multiply_add_fusion.1)"
    )  # fmt: skip
    plain = (
        "HloModule jit_step, "
        + layout
        + "  ROOT %tuple.14 = (f32[2]{0}) tuple(%multiply_add_fusion.1)"
    )
    assert same_program(plain, donating)
    assert not same_program(plain, donating.replace("multiply_add", "add"))
    assert not same_program(plain, donating.replace("f32[2]{0})->", "f32[4]{0})->"))


@pytest.mark.timeout(900)
def test_zeropp_quantized_collectives_train_the_default_run_to_the_exact_loss(tmp_path):
    """Issue 47: a default ``jaxzero train`` with qwZ + qgZ int8 ends within 2% of the exact
    run's validation loss (each in a fresh process, the same seed and data). 100 steps, a
    third of the experiment's 300 (its figures: +0.06% at 300, +0.10% at 150; at 100, on
    this machine: exact 2.390, quantized -0.60%), for CI's time."""
    _run("zeropp_loss.py", "--steps", "100", "--variants", "exact", "qwZ + qgZ int8",
         "--out", str(tmp_path), optimized=True)  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "zeropp_loss.csv").open()))
    assert [r["variant"] for r in rows] == ["exact", "qwZ + qgZ int8"]
    exact, quantized = (float(r["val_loss"]) for r in rows)
    assert exact < 2.5  # it learned (uniform over bytes: 5.55)
    assert abs(quantized - exact) / exact < 0.02, rows


def test_zero_beyond_tiny_measures_each_option_and_offload_moves_the_state_to_the_host(tmp_path):
    """experiments/zero_beyond.py --tiny (tiny GPT, stage 3, 8 simulated devices): a row per
    option with bytes by memory kind, wire bytes beside the formula and a step-time ratio;
    offload's device bytes are none's less the master and the moments (within 5%), which
    sit in host memory; the quantized options send fewer bytes than none."""
    out = _run("zero_beyond.py", "--tiny", "--out", str(tmp_path))
    rows = list(csv.DictReader((tmp_path / "zero_beyond.csv").open()))
    assert [(r["model"], r["stage"], r["option"]) for r in rows] == [
        ("gpt", "3", option) for option in ("none", "offload", "qwZ", "qgZ-int8")
    ]
    for column in (
        "device_bytes", "host_bytes", "device_formula", "host_formula", "peak_bytes",
        "peak_device_bytes", "wire_bytes", "wire_formula", "step_ms", "step_ratio", "in_effect",
    ):  # fmt: skip
        assert all(r[column] != "" for r in rows), column
    get = {r["option"]: r for r in rows}
    none, offload = get["none"], get["offload"]
    state = int(none["master_bytes"]) + int(none["optimizer_bytes"])  # fp32 master + moments
    saved = int(none["device_bytes"]) - int(offload["device_bytes"])
    assert abs(saved / state - 1) < 0.05, (saved, state)
    assert abs(int(offload["host_bytes"]) / state - 1) < 0.05 and int(none["host_bytes"]) == 0
    assert float(none["step_ratio"]) == 1.0 and float(offload["step_ratio"]) > 0
    assert all(r["in_effect"] == "True" for r in rows)
    for quantized in ("qwZ", "qgZ-int8"):
        assert float(get[quantized]["wire_bytes"]) < float(none["wire_bytes"])
    assert (tmp_path / "zero_beyond.png").read_bytes()[:4] == b"\x89PNG"
    assert "| gpt | 3 | offload | yes |" in (tmp_path / "zero_beyond.md").read_text()
    assert "offload: device" in out


def test_gpu_check_tiny_runs_every_check_in_its_own_process(tmp_path):
    """experiments/gpu_check.py --tiny: the GPU script's code paths at tiny sizes on CPU, a
    process a measurement; every row is there and ok, and the summary is printed."""
    path = tmp_path / "gpu_check.csv"
    out = _procs.run(
        [sys.executable, "-m", "experiments.gpu_check", "--tiny", "--csv", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = list(csv.DictReader(path.open()))
    assert all(r["status"] == "ok" for r in rows), [(r["name"], r["why"]) for r in rows]
    got = [(r["check"], r["stage"], r["offload"], r["option"]) for r in rows]
    assert got == [
        ("probe", "0", "0", "0"),
        ("mfu", "0", "False", "0"),
        ("mfu", "3", "False", "0"),
        ("offload", "1", "False", "0"),
        ("offload", "1", "True", "0"),
        ("zeropp", "3", "0", "none"),
        ("zeropp", "3", "0", "qwZ"),
        ("zeropp", "3", "0", "qgZ-int8"),
    ]
    mfu, big = rows[1], rows[4]
    assert int(mfu["predicted_peak_bytes"]) > 0 and float(mfu["tokens_per_s"]) > 0
    assert int(big["model_states_16psi_bytes"]) > int(big["bytes_limit"])  # would not fit
    assert float(big["host_bytes"]) > 0 and float(big["per_param_ratio"]) > 0
    assert all(int(r["int8_ops_in_hlo"]) > 0 for r in rows[6:])
    assert "== gpu_check summary" in out.stdout and "x the one without" in out.stdout


def test_deltanet_speed_tiny_tables_both_mixers_and_their_peaks(tmp_path):
    out = _run("deltanet_speed.py", "--tiny", "--min-time", "0", "--out", str(tmp_path))
    rows = list(csv.DictReader((tmp_path / "deltanet_speed.csv").open()))
    assert [(r["mixer"], r["seq"]) for r in rows] == [
        ("deltanet", "64"),
        ("attention", "64"),
        ("deltanet", "256"),
        ("attention", "256"),
    ]
    assert all(float(r["tokens_per_s"]) > 0 and int(r["temp_bytes"]) > 0 for r in rows)
    assert "x per 4x S" in out and rows[0]["recorded"] == "measured"
