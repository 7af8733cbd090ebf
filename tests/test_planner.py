"""The planner (``jaxzero plan``), the pre-flight of ``jaxzero train`` and ``zero.auto``,
on 8 simulated CPU devices: its peaks are the compiled programs', its ranking holds
only what fits, and the slides' 7B-on-80-GB example agrees with the formulas."""

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jaxzero.accounting import planner as pl
from jaxzero.accounting.estimate import (
    format_bytes,
    model_state_bytes,
    parse_bytes,
    precision_bytes,
)
from jaxzero.accounting.measure import compiled_memory
from jaxzero.commands import plan as plan_cmd
from jaxzero.mesh import make_mesh
from jaxzero.train import config as C
from jaxzero.train import loop as train
from jaxzero.train import planning

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
SEQ = 32


BATCH = 8  # one row per device: one micro-batch count, so zero.auto compiles 12 candidates


def _cfg(**model) -> C.Config:
    cfg = C.load_file(TINY)
    fields = dict(d_model=32, seq_len=SEQ, vocab_size=256, **model)
    train_ = dataclasses.replace(cfg.train, batch_size=BATCH)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields), train=train_)


def _sample() -> dict[str, np.ndarray]:
    row = np.zeros((1, SEQ), np.int32)
    return {"inputs": row, "targets": row}


def _cands(cfg: C.Config) -> planning.Candidates:
    return planning.Candidates(cfg, make_mesh(8), _sample())


# --------------------------------------------------------------------------- unit parts


@pytest.mark.unit
def test_bytes_are_read_and_written_in_the_papers_units():
    assert parse_bytes("80GB") == 80e9 and parse_bytes("1GiB") == 2**30
    assert parse_bytes(" 512 MB ") == 512e6 and parse_bytes("8e10") == 8e10
    for bad in ("eighty", "80 parsecs", "-1GB", "0"):
        with pytest.raises(ValueError, match="bytes|positive"):
            parse_bytes(bad)
    assert format_bytes(26.7e6) == "26.7 MB" and format_bytes(3.09e9) == "3.09 GB"


@pytest.mark.unit
def test_candidates_are_the_divisors_of_the_rows_per_device():
    cands = pl.candidates(32, 8, stages=[3], remats=["none"])
    assert [c.micro_batches for c in cands] == [1, 2, 4]
    assert len(pl.candidates(32, 8)) == 4 * 3 * 3
    with pytest.raises(ValueError, match="not divisible by 8 devices"):
        pl.candidates(30, 8)
    with pytest.raises(ValueError, match="3 micro-batches do not divide the 4 rows"):
        pl.candidates(32, 8, micro_batches=[3])
    c = pl.Candidate(2, "full", 2, 32)
    assert c.flags() == "--stage 2 --micro-batches 2 --set model.remat=full"


@pytest.mark.unit
def test_a_bad_device_memory_is_one_line(capsys):
    assert plan_cmd.main(["--device-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot read 'lots' as bytes" in err and "\n" not in err
    with pytest.raises(C.ConfigError, match="zero.device_memory"):
        C.validate(C.apply_overrides(C.Config(), ["zero.device_memory=much"]))


def test_plan_exits_1_when_nothing_fits_so_scripts_can_tell(capsys):
    """Exit codes: 0 a candidate fits, 1 nothing fits, 2 an error (above). At 1 KB per
    device the formulas rule out every stage: nothing is compiled."""
    argv = ["--config", TINY, "--devices", "8", "--set", "data.max_bytes=100000",
            "--set", "model.d_model=32", "--device-memory", "1KB", "--max-batch", "0"]  # fmt: skip
    assert plan_cmd.main(argv) == plan_cmd.NOTHING_FITS == 1
    out = capsys.readouterr().out
    assert "nothing fits" in out and "first choice" not in out
    with pytest.raises(C.ConfigError, match="zero.headroom=1.5: a share of the budget"):
        C.validate(C.apply_overrides(C.Config(), ["zero.headroom=1.5"]))


# --------------------------------------------------------------------------- the planner


@pytest.fixture(scope="module")
def tiny_peaks():
    """Stage 0 and stage 3 (remat none, 1 micro-batch) of the tiny GPT, compiled directly."""
    cfg = _cfg()
    peaks = {}
    for stage in (0, 3):
        c = pl.Candidate(stage, "none", 1, cfg.train.batch_size)
        _, engine, _ = planning.build(planning.with_candidate(cfg, c), make_mesh(8))
        model = planning.Candidates(cfg, make_mesh(8), _sample()).model(cfg)
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        batch = planning.batch_like(_sample(), c.batch)
        peaks[stage] = compiled_memory(engine.compile(engine.abstract_state(shapes), batch)).peak
    assert peaks[3] < peaks[0]
    return cfg, peaks


@pytest.mark.equivalence
def test_the_planner_ranks_only_what_fits_with_the_compiled_peaks(tiny_peaks):
    cfg, peaks = tiny_peaks
    limit = (peaks[0] + peaks[3]) / 2  # between the two stages' peaks
    which = [pl.Candidate(s, "none", 1, cfg.train.batch_size) for s in (0, 1, 2, 3)]
    found = planning.plan_run(
        cfg, _cands(cfg), limit, "test", pl.HARDWARE["cpu"], which=which, max_batch=0
    )
    rows = {r.candidate.stage: r for r in found.rows}
    assert rows[0].status == "over" and rows[3].status == "fits"
    assert all(r.peak <= limit for r in found.fitting())
    assert [r.candidate.stage for r in found.fitting()] == sorted(
        (r.candidate.stage for r in found.fitting()),
        key=lambda s: (rows[s].predicted_s, rows[s].comm_s, rows[s].peak),
    )
    for stage in (0, 3):  # the same compile: the planner's peak is memory_analysis's
        assert rows[stage].peak == peaks[stage]
    assert rows[3].persistent < rows[0].persistent
    text = found.table()
    assert "compiled, over the budget" in text and "first choice: stage" in text
    assert json.loads(json.dumps(found.to_dict()))["rows"][0]["status"] in ("fits", "over")


@pytest.mark.equivalence
def test_the_largest_batch_fits_and_the_next_does_not(tiny_peaks):
    cfg, peaks = tiny_peaks
    limit = 6 * peaks[3]
    cands = _cands(cfg)
    planner = pl.Planner(cands, limit, pl.HARDWARE["cpu"], 8)
    c = pl.Candidate(3, "none", 1, cfg.train.batch_size)
    assert planner.fits(c)
    best = planner.max_batch(c, 8)
    assert best > c.batch
    assert planner.row(dataclasses.replace(c, batch=best)).peak <= limit
    assert planner.row(dataclasses.replace(c, batch=best + 8)).peak > limit
    assert len(planner.memo) <= 7  # the secant search, not a bisection from scratch


@pytest.mark.equivalence
def test_pruned_by_the_formulas_is_not_compiled():
    def build(c):
        raise AssertionError("a pruned candidate was compiled")

    prec = precision_bytes("mixed", "adam")
    psi = 7e9
    states = lambda s: model_state_bytes(psi, 8, s, prec).persistent  # noqa: E731
    planner = pl.Planner(build, 80e9, pl.HARDWARE["h100"], 8, states)
    row = planner.row(pl.Candidate(0, "none", 1, 8))
    assert row.status == "pruned" and "98 GB > 80 GB (formulas)" in row.why


# --------------------------------------------------------------------------- the slides' 7B


@pytest.mark.system
def test_7b_llama_on_8_x_80gb_agrees_with_the_formulas(capsys):
    """A 7B Llama (Adam, mixed precision) on 8 x 80 GB: 16Ψ does not fit one device;
    stage 0 is pruned by the formulas; stage 3 holds 16Ψ/8 of model states."""
    argv = [
        "--set", "model.arch=llama", "--set", "model.d_model=4096", "--set", "model.n_layers=32",
        "--set", "model.n_heads=32", "--set", "model.d_ff=11008", "--set", "model.vocab_size=32000",
        "--set", "model.seq_len=512", "--set", "model.tie_embeddings=false",
        "--set", "data.max_bytes=200000", "--precision", "bf16", "--devices", "8",
        "--batch", "8", "--device-memory", "80GB", "--hardware", "h100",
        "--remats", "full", "--micro-batch-counts", "1", "--max-batch", "0", "--json",
    ]  # fmt: skip
    assert plan_cmd.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["stage"]: r for r in out["rows"] if not r["offload"]}  # offload: below
    psi = 6.74e9  # this shape's count (32 layers of 4096, vocab 32000, untied)
    prec = precision_bytes("mixed", "adam")
    assert model_state_bytes(psi, 1, 0, prec).total > 80e9  # 16Ψ: not on one device
    assert rows[0]["status"] == "pruned"  # 14Ψ persistent on each of 8: 94 GB
    # a GPU target keeps 10% of 80 GB free: a stage whose peak compiles under 80 GB but
    # within the headroom is not offered (stage 1 remat full: 78.5 GB on jax 0.10, under
    # 72 GB on 0.12, whose XLA schedules it differently)
    assert out["headroom"] == 0.1 and out["held_bytes"] == pytest.approx(72e9)
    for s in (1, 2, 3):
        assert rows[s]["status"] == ("fits" if rows[s]["peak_bytes"] <= 72e9 else "over")
        assert rows[s]["peak_bytes"] < 80e9
    assert rows[2]["status"] == rows[3]["status"] == "fits"
    formula = model_state_bytes(psi, 8, 3, prec)
    assert formula.total == pytest.approx(16 * psi / 8)
    assert rows[3]["persistent_bytes"] == pytest.approx(formula.persistent, rel=0.01)
    assert rows[3]["peak_bytes"] < rows[2]["peak_bytes"] < 72e9
    ranked = sorted(rows[s]["rank"] for s in (1, 2, 3) if rows[s]["rank"] is not None)
    assert ranked == list(range(1, len(ranked) + 1)) and rows[0]["rank"] is None


# --------------------------------------------------------------------------- pre-flight


def _train_args(root: Path, name: str, *extra: str) -> list[str]:
    return [
        "--config", TINY, "--steps", "2", "--name", name, "--devices", "8",
        "--set", f"logging.root={root}", "--set", "logging.eval_every=2",
        "--set", "logging.eval_batches=1", "--set", "logging.sample_tokens=0",
        "--set", "data.max_bytes=100000", "--set", "model.d_model=32",
        "--set", f"model.seq_len={SEQ}", "--set", f"train.batch_size={BATCH}", *extra,
    ]  # fmt: skip


@pytest.mark.system
def test_preflight_refuses_in_one_line_and_auto_trains_what_fits(tmp_path, capsys, tiny_peaks):
    _, peaks = tiny_peaks
    limit = int((peaks[0] + peaks[3]) / 2)
    argv = _train_args(tmp_path, "over", "--stage", "0", "--set", f"zero.device_memory={limit}")
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "will not fit" in err, err
    assert format_bytes(limit) in err and "What fits: stage " in err and "peak" in err
    assert not (tmp_path / "over").exists()  # refused before anything was written

    argv = _train_args(
        tmp_path, "auto", "--stage", "0", "--set", f"zero.device_memory={limit}",
        "--set", "zero.auto=true",
    )  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train.main(argv) == 0
    assert "zero.auto: stage" in printed.getvalue()
    saved = yaml.safe_load((tmp_path / "auto" / train.RESOLVED_CONFIG).read_text())
    assert saved["parallel"]["stage"] != 0  # stage 0 does not fit this budget
    assert (tmp_path / "auto" / "summary.json").is_file()


@pytest.mark.system
def test_preflight_passes_a_run_that_fits_and_says_so(tmp_path):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train.main(_train_args(tmp_path, "fits", "--set", "zero.device_memory=1GB")) == 0
    out = printed.getvalue()
    held = "of 800 MB per device (1 GB per device: as given; less 20% headroom, zero.headroom"
    assert "fits: peak" in out and held in out, out


@pytest.mark.unit
def test_more_micro_batches_than_the_fewest_that_fit_are_skipped(monkeypatch):
    peaks = {1: 300, 2: 150, 4: 80}  # bytes by micro-batch count: 1 is over a budget of 200
    fake = lambda built, c, hw, group: pl.Row(c, "fits", peak=peaks[c.micro_batches])  # noqa: E731
    monkeypatch.setattr(pl, "measure", fake)
    planner = pl.Planner(lambda c: None, 200, pl.HARDWARE["cpu"], 8)
    rows = planner.survey(pl.candidates(32, 8, stages=[3], remats=["none"]))
    assert [(r.candidate.micro_batches, r.status) for r in rows] == [
        (1, "over"), (2, "fits"), (4, "skipped")
    ]  # fmt: skip
    assert rows[2].why == "2 micro-batch(es) fit" and len(planner.memo) == 2


@pytest.mark.unit
def test_a_candidate_within_the_headroom_of_the_budget_is_not_chosen(monkeypatch):
    """Issue 46: zero.auto chose a step at 95% of its budget, and the kernel killed it. With
    15% kept free, the fastest candidate (90 of 100 bytes) is over; the slower one that
    leaves room (80) is the first choice."""
    peaks = {0: 90, 3: 80}
    compute = {0: 1.0, 3: 2.0}  # stage 0 is faster on the roofline

    def fake(built, c, hw, group):
        return pl.Row(c, "fits", peak=peaks[c.stage], compute_s=compute[c.stage])

    monkeypatch.setattr(pl, "measure", fake)
    cands = pl.candidates(8, 8, stages=[0, 3], remats=["none"])
    hw = pl.HARDWARE["cpu"]
    assert pl.survey(lambda c: None, cands, 100, hw, devices=8).best().candidate.stage == 0
    found = pl.survey(lambda c: None, cands, 100, hw, devices=8, headroom=0.15)
    assert found.held == pytest.approx(85)
    assert [(r.candidate.stage, r.status) for r in found.rows] == [(0, "over"), (3, "fits")]
    assert found.rows[0].why == "peak 90 B > 85 B (100 B less 15% headroom)"
    assert found.best().candidate.stage == 3
    assert "a step is held to 85 B, 15% kept free (zero.headroom)" in found.table()
    with pytest.raises(ValueError, match="headroom 1 must be in"):
        pl.held_to(100, 1)


# --------------------------------------------------------------------------- frozen params


@pytest.mark.unit
def test_a_frozen_base_is_not_pruned_as_if_it_trained(monkeypatch):
    """A LoRA run of a 7B bf16 base with 40M adapters on 8 x 80 GB: by the formulas its
    stage 0 holds 14Ψt + 2Ψf = 14.6 GB, and compiles; counted as 7.04B trainable params
    (14 bytes each: 98.6 GB) it would be pruned."""
    fake = lambda built, c, hw, group: pl.Row(c, "fits", peak=1)  # noqa: E731
    monkeypatch.setattr(pl, "measure", fake)
    built = []
    build = lambda c: built.append(c.stage)  # noqa: E731
    prec = precision_bytes("mixed", "adamw")
    psi_t, psi_f = 40e6, 7e9
    cands = [pl.Candidate(s, "none", 1, 8) for s in (0, 1, 2, 3)]
    kw = dict(devices=8, precision=prec, max_batch=0)
    found = pl.survey(
        build, cands, 80e9, pl.HARDWARE["h100"], num_params=psi_t, frozen_bytes=2 * psi_f, **kw
    )
    assert [r.status for r in found.rows] == ["fits"] * 4 and built == [0, 1, 2, 3]
    states = pl.formula_states(psi_t, 8, prec, 2 * psi_f)
    assert states(0) == pytest.approx(14 * psi_t + 2 * psi_f)  # 14.56 GB
    assert states(3) == pytest.approx((14 * psi_t + 2 * psi_f) / 8)
    # the frozen base counted as trainable: the stage-0 run that fits would be pruned
    built.clear()
    wrong = pl.survey(build, cands, 80e9, pl.HARDWARE["h100"], num_params=psi_t + psi_f, **kw)
    assert wrong.rows[0].status == "pruned" and "(formulas)" in wrong.rows[0].why
    assert built == [1, 2, 3]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_prune_is_a_lower_bound_of_a_frozen_base_state(precision):
    """For an engine with a frozen bf16 base (padded: 100 rows on 8 devices) and small
    adapters, :func:`param_split` and the formulas give at most the bytes its state
    holds on a device, at every stage, and within 5% of them (104 rows stored of 100)."""
    import jax.numpy as jnp
    import optax

    import jaxzero

    L, D, R = 3, 100, 4
    shapes = {
        "emb": jax.ShapeDtypeStruct((256, D), jnp.bfloat16),
        "layers": {
            "w": jax.ShapeDtypeStruct((L, D, D), jnp.bfloat16),
            "a": jax.ShapeDtypeStruct((L, R, D), jnp.float32),
            "b": jax.ShapeDtypeStruct((L, D, R), jnp.float32),
        },
    }
    trainable = lambda path: path.rsplit("/", 1)[-1] in ("a", "b")  # noqa: E731
    psi, held = pl.param_split(shapes, trainable)
    assert (psi, held) == (2 * L * R * D, 2 * (256 * D + L * D * D))
    assert pl.param_split(shapes) == (256 * D + L * D * D + 2 * L * R * D, 0.0)
    prec = precision_bytes("mixed" if precision == "bf16" else "fp32", "adamw")
    states = pl.formula_states(psi, 8, prec, held)
    for stage in (0, 1, 2, 3):
        engine = jaxzero.Engine(
            lambda p, b: 0.0, optax.adamw(1e-3), mesh=make_mesh(8), stage=stage,
            precision=precision, stacked="^layers/", trainable=trainable,
        )  # fmt: skip
        assert pl.param_split(shapes, engine.trainable) == (psi, held)
        actual = pl.shard_bytes(engine.abstract_state(shapes))
        assert states(stage) <= actual <= 1.05 * states(stage), (stage, states(stage), actual)
        assert (engine.num_params, engine.num_frozen) == (psi, held / 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_prune_is_a_lower_bound_with_a_model_axis(stage):
    """A Llama split over a model axis of 2 on 8 devices (4 data devices): a device holds
    its slices of the split params and the rest whole, so the formulas for Ψ/2 over 4
    bound its state from below (within 20%: the norms and biases held whole); Ψ over 8
    would not (stage 0 holds each slice whole: 16Ψ/2, not 16Ψ)."""
    import optax

    from jaxzero.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, seq_len=16)  # fmt: skip
    llama = Llama(cfg)
    shapes = jax.eval_shape(llama.init, jax.random.key(0))
    engine = llama.engine(optax.adamw(1e-3), mesh=make_mesh(8, model=2), stage=stage)
    actual = pl.shard_bytes(engine.abstract_state(shapes))
    psi, _ = pl.param_split(shapes)
    prec = precision_bytes("fp32", "adamw")
    bound = pl.formula_states(psi, 8, prec, model=2)(stage)
    assert bound <= actual <= 1.2 * bound, (bound, actual)
    if stage == 0:
        assert pl.formula_states(psi, 8, prec)(stage) > actual  # the bound without the axis


def _llama_plan(capsys, *extra: str) -> dict:
    argv = ["--config", TINY, "--devices", "8", "--set", "data.max_bytes=100000",
            "--set", "model.arch=llama", "--set", "model.n_kv_heads=2",
            "--set", "model.d_model=32", "--set", "model.seq_len=64",
            "--set", f"train.batch_size={BATCH}", "--stages", "3", "--remats", "none",
            "--max-batch", "0", "--json", *extra]  # fmt: skip
    code = plan_cmd.main(argv)
    return {"code": code, **json.loads(capsys.readouterr().out)}


def test_plan_keeps_a_runs_split_or_surveys_model_axes(capsys):
    """`jaxzero plan` of a Llama run with mesh.model=2 on 8 devices: its rows are over the
    4 data devices (batch 8: 2 rows a model group, so 1 or 2 micro-batches), the split
    kept. With --model-axes 1 2 each is a candidate: the model axis' collectives add to
    the roofline (nothing overlaps them), so where both fit the axis of 1 ranks first;
    where only the split step fits (a budget between their peaks), it is the choice."""
    kept = _llama_plan(capsys, "--set", "mesh.model=2")
    assert kept["code"] == plan_cmd.FITS
    assert "each layer split over 2 (mesh.model)" in kept["title"]
    assert [(r["micro_batches"], r["status"]) for r in kept["rows"]] == [
        (1, "fits"), (2, "skipped"),
    ]  # fmt: skip

    both = _llama_plan(capsys, "--model-axes", "1", "2")
    fits = sorted((r for r in both["rows"] if r["status"] == "fits"), key=lambda r: r["rank"])
    assert [(r["model"], r["micro_batches"]) for r in fits] == [(1, 1), (2, 1)]
    assert fits[0]["model_s"] == 0 < fits[1]["model_s"]
    peak = {r["model"]: r["peak_bytes"] for r in fits}
    assert peak[2] < peak[1]  # the activations split over the model axis
    budget = (peak[1] + peak[2]) / 2 / 0.8  # held to 80% of it (zero.headroom)
    tight = _llama_plan(capsys, "--model-axes", "1", "2", "--device-memory", str(int(budget)))
    first = next(r for r in tight["rows"] if r["rank"] == 1)
    assert (first["model"], first["micro_batches"]) == (2, 1)
    assert any(r["model"] == 1 and r["status"] == "over" for r in tight["rows"])


@pytest.mark.unit
def test_the_rows_are_over_the_data_devices_or_the_ulysses_groups():
    ulysses = C.apply_overrides(C.Config(), ["mesh.ulysses=true", "mesh.group_size=4"])
    assert planning.row_devices(ulysses, make_mesh(8, replicas=2)) == 2
    assert planning.row_devices(C.Config(), make_mesh(8, model=2)) == 4
    cands = pl.candidates(8, 8, stages=[3], remats=["none"], model_axes=[1, 2, 4])
    assert [(c.model, c.micro_batches) for c in cands] == [
        (1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4),
    ]  # fmt: skip
    assert cands[1].flags().endswith("--set mesh.model=2")
    assert cands[1].describe() == "stage 3, remat none, 1 micro-batch, model axis 2"


# --------------------------------------------------------------------------- offload


@pytest.mark.unit
def test_an_offloaded_candidate_is_compiled_where_it_alone_fits(monkeypatch):
    """Offload is offered where the same candidate without it does not fit (with it, the
    same step and a host transfer more: never faster). Its device peak is held to the
    device budget and its host bytes to the host's; where the host is the devices' own
    memory (simulated CPU devices: no host budget) both count against the device's."""
    peaks = {(1, False): 80, (1, True): 50, (3, False): 90, (3, True): 60}
    hw = dataclasses.replace(pl.HARDWARE["cpu"], host_link=10.0)

    def fake(built, c, hw, group):
        host = 40 if c.offload else 0
        return pl.Row(c, "fits", peak=peaks[c.stage, c.offload], host=host, host_moved=host,
                      host_s=host / hw.host_link, compute_s=1.0)  # fmt: skip

    monkeypatch.setattr(pl, "measure", fake)
    cands = pl.candidates(8, 8, stages=[1, 3], remats=["none"], offload=True)
    assert [(c.stage, c.offload) for c in cands] == list(peaks)
    found = pl.survey(lambda c: None, cands, 100, hw, devices=8, headroom=0.15, host_budget=100)
    status = {(r.candidate.stage, r.candidate.offload): (r.status, r.why) for r in found.rows}
    assert status == {
        (1, False): ("fits", ""),
        (1, True): ("skipped", "fits without offload"),  # not compiled
        (3, False): ("over", "peak 90 B > 85 B (100 B less 15% headroom)"),
        (3, True): ("fits", ""),
    }
    best = found.best()
    assert best.candidate.stage == 1 and [r.candidate.stage for r in found.fitting()] == [1, 3]
    assert found.fitting()[1].predicted_s == 4.0  # 40 B each way at 10 B/s: the host's bound
    text = found.table()
    assert "offload" in text and "host/dev" in text and "40 B x2, 4 s" in text
    assert "1 offloaded candidate(s) not compiled: they fit without offload" in text
    c = pl.Candidate(3, "none", 1, 8, offload=True)
    assert c.flags().endswith("--set zero.offload=optimizer") and c.describe().endswith("offload")
    # the host's budget holds the host bytes ...
    small = pl.survey(lambda c: None, cands, 100, hw, devices=8, headroom=0.15, host_budget=40)
    over = {r.candidate: r for r in small.rows}[c]
    assert (
        over.status == "over"
        and over.why == "host memory 40 B > 34 B of host memory (40 B less 15% headroom)"
    )
    # ... and where the host is the devices' memory, 60 + 40 > 85 on the device budget
    shared = pl.survey(lambda c: None, cands, 100, hw, devices=8, headroom=0.15)
    over = {r.candidate: r for r in shared.rows}[c]
    assert over.status == "over" and "+ 40 B in host memory > 85 B" in over.why


@pytest.mark.system
def test_a_model_too_big_for_stage_3_is_offered_offload():
    """The 7B Llama on 8 GPUs of 16 GB (an H100 host: 256 GB per GPU, a 55 GB/s PCIe link):
    stage 3 keeps 14Ψ/8 = 11.8 GB of state and peaks at 19 GB, over the 14.4 GB a step
    may take; with its 12Ψ/8 = 10.1 GB of master and moments in host memory, the device
    peak drops by as much and fits: ``jaxzero plan`` prints it, with the host transfers."""
    argv = [
        "--set", "model.arch=llama", "--set", "model.d_model=4096", "--set", "model.n_layers=32",
        "--set", "model.n_heads=32", "--set", "model.d_ff=11008", "--set", "model.vocab_size=32000",
        "--set", "model.seq_len=512", "--set", "model.tie_embeddings=false",
        "--set", "data.max_bytes=200000", "--precision", "bf16", "--devices", "8",
        "--batch", "8", "--device-memory", "16GB", "--hardware", "h100", "--stages", "3",
        "--remats", "full", "--micro-batch-counts", "1", "--max-batch", "0",
    ]  # fmt: skip
    found = plan_cmd.plan(plan_cmd._parse(argv))
    rows = {r.candidate.offload: r for r in found.rows}
    psi, n = 6.74e9, 8
    assert rows[False].status == "over" and rows[True].status == "fits"
    host = 12 * psi / n  # the fp32 master and Adam's moments of one device's shard
    assert rows[True].host == pytest.approx(host, rel=0.01)
    assert rows[True].host_moved == pytest.approx(host, rel=0.01)
    assert rows[False].peak - rows[True].peak == pytest.approx(host, rel=0.01)
    assert rows[True].persistent == pytest.approx(2 * psi / n, rel=0.01)  # bf16 params
    assert rows[True].host_s == pytest.approx(rows[True].host_moved / 55e9)
    assert found.host_budget == 256e9 and found.best().candidate.offload
    text = found.table()
    assert "host     256 GB per device for offloaded state (H100 SXM's host" in text
    assert "--set zero.offload=optimizer" in text.splitlines()[-1]
    assert "55 GB/s host link" in text


def test_preflight_holds_offloaded_state_to_the_host_not_the_device(monkeypatch):
    """XLA:CPU's ``memory_analysis`` counts a host-resident argument as any other (its
    host figures are 0): the pre-flight takes the offloaded state out of the device peak
    and holds it to ``zero.host_memory``; without one (the simulated devices are the
    host's memory) it counts on the device budget, as without offload."""
    cfg = _cfg()
    cfg = C.apply_overrides(cfg, ["precision.compute=bf16", "zero.offload=optimizer",
                                  "zero.device_memory=1GB", "zero.host_memory=1GB"])  # fmt: skip
    mesh = make_mesh(8)
    model, engine, _ = planning.build(cfg, mesh)
    checked = planning.preflight(cfg, mesh, model, engine, _sample())
    state = planning.Candidates(cfg, mesh, _sample()).shapes(model)
    abstract = engine.abstract_state(state)
    host = pl.shard_bytes(abstract, "host")  # master + AdamW state, one device's shard
    assert host == pl.shard_bytes(abstract.master) + pl.shard_bytes(abstract.opt_state) > 0
    compiled = engine.compile(abstract, planning.batch_like(_sample(), cfg.train.batch_size))
    mem = compiled_memory(compiled)
    assert mem.host_argument == mem.host_output == mem.host_alias == host  # donated: once
    assert checked.peak == mem.peak - host == mem.device_peak  # the step's, not the eval's
    assert f"offload: {format_bytes(host)} of host memory per device" in checked.line
    shared = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, host_memory=None))
    assert planning.preflight(shared, mesh, model, engine, _sample()).peak == mem.peak
    # over the host's budget: refused in one line (what fits is the planner's: not surveyed)
    survey = lambda *a, **k: pl.Survey([], 0, "", pl.HARDWARE["cpu"], 8, 8)  # noqa: E731
    monkeypatch.setattr(planning, "plan_run", survey)
    tight = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, host_memory="1KB"))
    with pytest.raises(C.ConfigError, match="of host memory per device \\(offload\\)"):
        planning.preflight(tight, mesh, model, engine, _sample())
    with pytest.raises(C.ConfigError, match="zero.host_memory"):
        C.validate(C.apply_overrides(C.Config(), ["zero.host_memory=lots"]))


@pytest.mark.unit
def test_quantized_candidates_are_offered_where_the_mesh_has_a_slow_axis():
    """On a hybrid mesh (groups across nodes) stages 1-3 are also compiled with qgZ int8,
    stage 3 with qwZ too; offload only where a host budget apart from the devices' is known."""
    cands = pl.candidates(8, 8, stages=[0, 1, 3], remats=["none"], quantized=True)
    beyond = [(c.stage, c.qwz, c.qgz) for c in cands]
    assert beyond == [(0, False, None), (1, False, None), (1, False, "int8"),
                      (3, False, None), (3, True, "int8")]  # fmt: skip
    assert cands[-1].flags().endswith("--set zero.qwz=true --set zero.qgz=int8")
    assert cands[-1].describe().endswith(", qwZ + qgZ int8")
    hybrid, flat = make_mesh(8, replicas=2), make_mesh(8)
    assert planning.beyond_options(hybrid, None) == {"offload": False, "quantized": True}
    assert planning.beyond_options(flat, 256e9) == {"offload": True, "quantized": False}
    assert planning.host_budget(None, 8) == (None, planning.host_budget(None, 8)[1])  # CPU
    assert planning.host_budget("1GB", 8)[0] == 1e9
    assert planning.host_budget(None, 8, hw=pl.HARDWARE["gh200"])[0] == 480e9
    cfg = planning.with_candidate(_cfg(), cands[-1])
    assert (cfg.zero.qwz, cfg.zero.qgz, cfg.zero.offload) == (True, "int8", None)
    assert planning.candidate_of(cfg) == cands[-1]


@pytest.mark.parametrize(
    "settings, lowest",
    [(["zero.qgz=int8"], 1), (["zero.offload=optimizer"], 1), (["zero.qwz=true"], 3)],
)
def test_the_planner_keeps_the_runs_own_offload_and_zeropp_choices(settings, lowest):
    """zero.auto and jaxzero plan choose stage, remat and micro-batches; a user's offload or
    ZeRO++ setting stays on every candidate, and stages that cannot take it are left out."""
    cfg = C.validate(C.apply_overrides(C.Config(), ["parallel.stage=3", *settings]))
    kept = planning.keep_choices(cfg, pl.candidates(32, 8, offload=True, quantized=True))
    assert kept and {c.stage for c in kept} == set(range(lowest, 4))
    z = cfg.zero
    for c in kept:
        assert (c.offload or not z.offload) and (c.qwz or not z.qwz)
        assert c.qgz == (z.qgz or c.qgz)
    assert len(kept) == len(set(kept))
    assert planning.keep_choices(C.Config(), kept[:3]) == kept[:3]  # nothing set: as given
