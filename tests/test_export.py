"""`jaxzero export` / `jaxzero sample`: round trip against gather_params, streaming memory,
deterministic sampling from a run and an export, and one-line errors for bad inputs."""

import dataclasses
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import _procs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import jaxzero
from jaxzero import cli, modeldir
from jaxzero.checkpoint import read_metadata
from jaxzero.models import from_fields
from jaxzero.models.gpt import GPT, GPTConfig
from jaxzero.partition import path_str
from jaxzero.train import config as C
from jaxzero.train import export as ex
from jaxzero.train import sample as sm

# d_model 20 and qkv 60 do not divide by 8: stored leaves carry padding the export must drop
CFG = GPTConfig(vocab_size=256, seq_len=16, d_model=20, n_layers=2, n_heads=2)
MIB = 1 << 20


def _save(directory: Path, precision: str, extra: dict, steps=(0,)):
    model = GPT(CFG)
    engine = model.engine(optax.adam(1e-3), mesh=jaxzero.make_mesh(8), stage=3, precision=precision)
    state = engine.init_from(model.init, jax.random.key(0))
    ckpt = jaxzero.CheckpointManager(directory)
    for step in steps:
        ckpt.save(
            engine,
            dataclasses.replace(state, step=jax.device_put(jnp.int32(step), state.step.sharding)),
            extra=extra,
        )
        ckpt.wait()
    ckpt.close()
    flat = {
        path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(engine.gather_params(state))
    }
    return flat, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """fp32: a bare checkpoints dir whose extra holds the config; bf16: a run directory
    (config.yaml + checkpoints/, steps 0 and 5) whose checkpoints hold no config."""
    root = tmp_path_factory.mktemp("export")
    model_cfg = dataclasses.asdict(CFG)
    fp32, _ = _save(root / "ckpt32", "fp32", {"config": {"model": model_cfg}})
    run = root / "run16"
    run.mkdir()
    config = C.Config(model=C.ModelConfig(**model_cfg))
    (run / "config.yaml").write_text(C.dump_yaml(config))
    bf16, state16 = _save(run / "checkpoints", "bf16", {"loader": {"step": 0}}, steps=(0, 5))
    return {
        "fp32": (root / "ckpt32", fp32),
        "bf16": (run, bf16),
        "root": root,
        "params16": state16.params,
    }


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_export_equals_gather_params(saved, tmp_path, capsys, precision):
    src, want = saved[precision]
    rc, out, err = _cli(capsys, "export", str(src), "--out", str(tmp_path / "x"))
    assert rc == 0, err
    got = load_file(str(tmp_path / "x" / ex.WEIGHTS))
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == np.float32 and got[name].shape == x.shape, name
        np.testing.assert_array_equal(got[name], x, err_msg=name)
    config = json.loads((tmp_path / "x" / ex.CONFIG).read_text())
    assert from_fields({k: config.get(k) for k in ex.MODEL_FIELDS}).config == CFG
    assert config["tokens"] == "bytes" and config["source"]["stage"] == 3

    meta = read_metadata(ex.find_step_dir(src))  # the export really had padding to drop
    assert any(v["shape"] != v["stored_shape"] for v in meta["leaves"].values())

    rc, _, err = _cli(capsys, "export", str(src), "--out", str(tmp_path / "h"), "--dtype", "bf16")
    assert rc == 0, err
    half = load_file(str(tmp_path / "h" / ex.WEIGHTS))
    for name, x in want.items():
        assert half[name].dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(
            half[name].view(np.uint16), x.astype(jnp.bfloat16).view(np.uint16), err_msg=name
        )


def test_bf16_export_reads_the_fp32_master(saved):
    """The bf16 working copy differs from the master: exporting it would fail the test above."""
    _, want = saved["bf16"]
    working = np.asarray(saved["params16"]["blocks"]["fc"]["kernel"], np.float32)
    lay = want["blocks/fc/kernel"]
    assert not np.array_equal(working[tuple(slice(0, n) for n in lay.shape)], lay)


def test_path_forms_and_step(saved, tmp_path):
    run, _ = saved["bf16"]
    ckpts = run / "checkpoints"
    assert ex.find_step_dir(run) == ckpts / "5"
    assert ex.find_step_dir(ckpts) == ckpts / "5"
    assert ex.find_step_dir(ckpts / "0") == ckpts / "0"
    assert ex.find_step_dir(run, step=0) == ckpts / "0"
    blobs = []
    for i, src in enumerate([run, ckpts, ckpts / "5"]):
        ex.export(src, tmp_path / str(i))
        blobs.append((tmp_path / str(i) / ex.WEIGHTS).read_bytes())
    assert blobs[0] == blobs[1] == blobs[2]
    assert json.loads((tmp_path / "0" / ex.CONFIG).read_text())["source"]["step"] == 5


# --------------------------------------------------------------------------- memory

# Peak RSS growth of the export call alone: VmHWM is reset to the current RSS first
# (/proc/self/clear_refs). ru_maxrss cannot be reset, and after fork+exec it keeps the
# pytest parent's size, which would hide what the export itself costs.
MEASURE = textwrap.dedent("""
    import json, re, sys
    from pathlib import Path
    import orbax.checkpoint  # noqa: F401 - imported before the baseline: not the export's cost
    import tensorstore  # noqa: F401 - (fixed costs, not what export holds per leaf)
    from jaxzero import checkpoint as ck
    from jaxzero.train import export as ex

    def status(key):
        return int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text())[1]) * 1024

    step, out, how = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    ck.host_reader_process()  # as `jaxzero export` does first
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    if how == "stream":
        ex.export_params(step, out)
    else:  # the non-streaming way: every leaf in memory at once
        reader = ck.LeafReader(step)
        leaves = [reader.read(leaf, shape, ex.DTYPES["fp32"])
                  for _, leaf, shape in ck.param_entries(ck.read_metadata(step))]
    print(json.dumps({"delta": status("VmHWM") - before}))
""")


def _export_peak(step_dir: Path, out: Path, how: str) -> int:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = _procs.run(
        [sys.executable, "-c", MEASURE, str(step_dir), str(out), how],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["delta"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_export_memory_is_one_leaf_not_the_model(tmp_path):
    """20 equal 4 MiB leaves (80 MiB): the streaming export's peak host memory growth stays
    under 2 x the largest leaf + 32 MiB; loading every leaf (the control) does not."""
    shape, n = (1025, 1023), 20  # no dim divides by 8: stored padded, in the second dim
    params = {f"w{i:02d}": jax.random.normal(jax.random.key(i), shape) for i in range(n)}
    engine = jaxzero.Engine(
        lambda p, b: sum(jnp.sum(x) for x in jax.tree.leaves(p)) * b["x"],
        optax.sgd(0.1),
        mesh=jaxzero.make_mesh(8),
        stage=3,
    )
    state = engine.init(params)
    assert engine.layouts["w00"].padded_shape == (1025, 1024)  # read padded, copied unpadded
    ckpt = jaxzero.CheckpointManager(tmp_path / "ckpt")
    ckpt.save(engine, state)
    ckpt.close()
    del state
    leaf = shape[0] * shape[1] * 4
    bound = 2 * leaf + 32 * MIB
    assert n * leaf > 1.5 * bound  # the model is far larger than what the export may hold

    out = tmp_path / "w.safetensors"
    streamed = _export_peak(tmp_path / "ckpt" / "0", out, "stream")
    naive = _export_peak(tmp_path / "ckpt" / "0", out, "all")
    got = load_file(str(out))
    np.testing.assert_array_equal(got["w07"], np.asarray(params["w07"]))
    print(
        f"export: +{streamed / MIB:.1f} MiB, all leaves: +{naive / MIB:.1f} MiB, "
        f"bound {bound / MIB:.1f} MiB"
    )
    assert streamed < bound, f"export grew host memory by {streamed / MIB:.1f} MiB"
    assert naive > bound, f"the control grew by only {naive / MIB:.1f} MiB: no signal"


# --------------------------------------------------------------------------- sampling


def test_sample_from_run_and_export(saved, tmp_path, capsys):
    run, _ = saved["bf16"]
    ex.export(run, tmp_path / "exp")
    tokens, text = sm.sample(run, "def ", 12, seed=3)
    assert tokens.shape == (12,) and text.startswith("def ")
    again, _ = sm.sample(run, "def ", 12, seed=3)
    other, _ = sm.sample(run, "def ", 12, seed=4)
    from_export, _ = sm.sample(tmp_path / "exp", "def ", 12, seed=3)
    np.testing.assert_array_equal(tokens, again)
    np.testing.assert_array_equal(tokens, from_export)  # fp32 export = the checkpoint's params
    assert not np.array_equal(tokens, other)

    greedy = [sm.sample(tmp_path / "exp", "def ", 6, seed=s, top_k=1)[0] for s in (0, 1)]
    np.testing.assert_array_equal(greedy[0], greedy[1])  # top-1 ignores the seed

    rc, out, err = _cli(capsys, "sample", str(tmp_path / "exp"), "--tokens", "12", "--seed", "3")
    assert rc == 0, err
    assert out == text + "\n"


# --------------------------------------------------------------------------- bad inputs


def _one_line_error(capsys, *argv: str) -> str:
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_bad_paths(saved, tmp_path, capsys):
    missing = tmp_path / "nope"
    for cmd in ("export", "sample"):
        extra = ("--out", str(tmp_path / "o")) if cmd == "export" else ()
        err = _one_line_error(capsys, cmd, str(missing), *extra)
        assert str(missing) in err and "no such file" in err
        (tmp_path / "junk").mkdir(exist_ok=True)
        (tmp_path / "junk" / "notes.txt").write_text("hi")
        err = _one_line_error(capsys, cmd, str(tmp_path / "junk"), *extra)
        assert "not a jaxzero run, checkpoint or export" in err
    run, _ = saved["bf16"]
    err = _one_line_error(capsys, "export", str(run), "--out", str(tmp_path / "o"), "--step", "3")
    assert "no checkpoint of step 3" in err and "[0, 5]" in err
    (tmp_path / "emptyrun").mkdir()
    (tmp_path / "emptyrun" / "config.yaml").write_text("model: {}\n")
    err = _one_line_error(capsys, "sample", str(tmp_path / "emptyrun"))
    assert "has no checkpoints" in err
    (tmp_path / "file").write_text("x")
    err = _one_line_error(capsys, "export", str(run), "--out", str(tmp_path / "file"))
    assert "is a file" in err
    err = _one_line_error(capsys, "sample", str(run), "--top-k", "0")
    assert "--top-k" in err
    fake = tmp_path / "fake_export"
    fake.mkdir()
    (fake / ex.WEIGHTS).write_bytes(b"\x10")
    (fake / ex.CONFIG).write_text(json.dumps(dataclasses.asdict(CFG)))
    err = _one_line_error(capsys, "export", str(fake), "--out", str(tmp_path / "o"))
    assert "is an export, not a run or checkpoint" in err
    err = _one_line_error(capsys, "sample", str(fake))
    assert "not a readable safetensors file" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("damage", ["truncate", "delete", "garbage", "meta"])
def test_corrupted_checkpoint(saved, tmp_path, capsys, damage):
    src = tmp_path / "ckpt"
    shutil.copytree(saved["fp32"][0], src)
    data = sorted(p for p in (src / "0" / "state").rglob("*") if p.parent.name == "d")
    assert data
    for f in data:
        if damage == "truncate":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        elif damage == "delete":
            f.unlink()
        elif damage == "garbage":
            f.write_bytes(bytes(range(256)) * (f.stat().st_size // 256 + 1))
    if damage == "meta":
        (src / "0" / "meta" / "metadata").write_text('{"param_tree": [')
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    err = _one_line_error(capsys, "export", str(src), "--out", str(tmp_path / "o"))
    assert str(src / "0") in err and "damaged" in err
    err = _one_line_error(capsys, "sample", str(src))
    assert str(src / "0") in err and "damaged" in err
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before  # nothing deleted
    assert not (tmp_path / "o").exists()


def test_cli_subprocess_error_has_no_traceback(saved, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(saved["fp32"][0], src)
    for f in (src / "0" / "state").rglob("*"):
        if f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:10])
    proc = _procs.run(
        [sys.executable, "-m", "jaxzero.cli", "export", str(src), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("jaxzero export: error: checkpoint ")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# --------------------------------------------------------------------------- integrity


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_host_fingerprint_is_the_saved_one(dtype):
    """The numpy fingerprint export checks equals the one the checkpoint writes."""
    from jaxzero.checkpoint.format import _fingerprints, host_fingerprint

    x = np.asarray(jax.random.normal(jax.random.key(0), (37, 53))).astype(dtype)
    want = int(jax.device_get(_fingerprints((jnp.asarray(x),), ((37, 53),)))[0])
    assert host_fingerprint(x, chunk=100) == want
    assert host_fingerprint(np.roll(x, 1, axis=0), chunk=100) != want


def test_a_damaged_checkpoint_stops_export_and_sample(saved, tmp_path, capsys):
    """Flipped bytes in the data: export and sample stop with one line naming the damage
    and the intact checkpoints (exit 2).

    Every data file is damaged: which of orbax's files hold the params, and which only
    optimizer state (that export and sample never read), depends on its write timing."""
    src = saved["bf16"][0]  # a run: checkpoints of steps 0 and 5
    data_files = [
        f.relative_to(src)
        for f in (src / "checkpoints" / "5" / "state").rglob("d/*")
        if f.is_file()
    ]
    assert data_files
    for i, frac in enumerate((0.2, 0.5, 0.8)):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(src, bad)
        for name in data_files:
            data = bytearray((bad / name).read_bytes())
            at = int(len(data) * frac)
            data[at : at + 64] = bytes(x ^ 0x5A for x in data[at : at + 64])
            (bad / name).write_bytes(bytes(data))
        for argv in (
            ["export", str(bad), "--out", str(tmp_path / f"x{i}")],
            ["sample", str(bad), "--tokens", "2"],
        ):
            rc, _, err = _cli(capsys, *argv)
            assert rc == 2 and err.count("\n") == 1, (argv, err)
            assert "is damaged" in err or "could not be read" in err
            assert "Older checkpoints: [0]" in err


def test_export_records_the_tokens_training_read(tmp_path):
    """One rule (data.data_kind) for how training reads the data and what export and sample
    record: a directory of text files with format=uint16 once trained on bytes while its
    exports said uint16; now training refuses it in one line."""
    from jaxzero.train import data as data_lib

    text_dir, token_dir = tmp_path / "text", tmp_path / "tokens"
    text_dir.mkdir()
    (text_dir / "a.py").write_text("print('hello')\n" * 200)
    token_dir.mkdir()
    np.arange(4000, dtype=np.uint16).tofile(token_dir / "train.bin")
    (token_dir / "notes.txt").write_text("how the tokens were made\n" * 200)
    np.arange(4000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    cases = [
        ({}, "bytes"),
        ({"path": str(text_dir)}, "bytes"),
        ({"path": str(token_dir)}, "uint16"),
        ({"path": str(tmp_path / "t.bin")}, "uint16"),
        ({"path": str(tmp_path / "t.bin"), "format": "bytes"}, "bytes"),
        ({"path": str(token_dir), "format": "bytes"}, "bytes"),
        ({"path": str(text_dir), "format": "uint16"}, "uint16"),
    ]
    for data, kind in cases:
        assert ex.token_kind({"data": data}) == kind, data
        cfg = C.DataConfig(**data)
        assert data_lib.data_kind(cfg) == kind, data
        if data.get("path") == str(text_dir) and kind == "uint16":
            with pytest.raises(data_lib.DataError, match="has none: drop data.format"):
                data_lib.load_corpus(cfg)
        elif data:
            assert data_lib.load_corpus(cfg).kind == kind, data
    assert ex.token_kind({"data": {"tokenizer": "gpt2", "path": str(text_dir)}}) == "tokenizer"


# --------------------------------------------------------------------------- what export replaces

HF_FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "llama_gqa" / "single"


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A fine-tune run as ``jaxzero train --init-from hf:BASE`` leaves it (config resolved by
    train.finetune, hf_config.json pinned, one checkpoint of the base's weights), from a
    base saved by transformers 5: its chat template in ``chat_template.jinja`` and
    ``additional_chat_templates/``. No step is compiled."""
    from jaxzero import hf
    from jaxzero.train import finetune

    root = tmp_path_factory.mktemp("finetuned")
    base = root / "base"
    shutil.copytree(HF_FIXTURE, base)
    (base / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (base / "additional_chat_templates").mkdir()
    (base / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    (base / "special_tokens_map.json").write_text('{"eos_token": "</s>"}\n')
    cfg, model = finetune.resolve(C.Config(train=C.TrainConfig(init_from=f"hf:{base}")))
    run = root / "run"
    run.mkdir()
    cfg, _ = finetune.pin_architecture(cfg, model, run, True)
    (run / "config.yaml").write_text(C.dump_yaml(cfg))
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=0)
    with jaxzero.CheckpointManager(run / "checkpoints") as ckpt:
        ckpt.save(engine, hf.load(base, engine, model))
    return run, base


def _listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_export_replaces_only_what_jaxzero_wrote(finetuned, tmp_path, capsys):
    """A copy of a model directory with a README and a reference.npz beside it was deleted
    by `export --format hf` (it holds a config.json); now both formats refuse it in one
    line and leave every file, --overwrite replaces it and says what it deleted, an
    earlier export is replaced without asking, and the run's own base model, run and
    checkpoint are never replaced."""
    run, base = finetuned
    target = tmp_path / "base-copy"
    shutil.copytree(HF_FIXTURE, target)
    (target / "README.md").write_text("my notes\n")
    before = _listing(target)
    for fmt in ("hf", "jaxzero"):
        err = _one_line_error(capsys, "export", str(run), "--out", str(target), "--format", fmt)
        assert "holds files jaxzero did not write" in err and "README.md" in err, err
        assert "--overwrite" in err
        assert _listing(target) == before, fmt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base-copy"]  # nothing beside it

    rc, out, err = _cli(capsys, "export", str(run), "--out", str(target), "--overwrite")
    assert rc == 0, err
    assert "deleting what jaxzero had not written there: README.md" in err
    assert "reference.npz" in err and not (target / "README.md").exists()
    assert (target / ex.WEIGHTS).is_file() and (target / modeldir.MANIFEST).is_file()

    # an export jaxzero wrote is replaced without --overwrite, in either format
    for fmt in ("hf", "jaxzero", "hf"):
        rc, _, err = _cli(capsys, "export", str(run), "--out", str(target), "--format", fmt)
        assert rc == 0 and "deleting" not in err, err
    assert (target / "config.json").is_file() and (target / "chat_template.jinja").is_file()
    (target / "notes.txt").write_text("added by hand")
    err = _one_line_error(capsys, "export", str(run), "--out", str(target))
    assert "(notes.txt)" in err and (target / "notes.txt").read_text() == "added by hand"

    sources = _listing(base), _listing(run)
    for out, what in [
        (base, "is the run's base model"),
        (run, "is the run exported"),
        (run / "checkpoints" / "0", "is the checkpoint exported"),
        (run.parent, "holds the run exported"),
    ]:
        err = _one_line_error(capsys, "export", str(run), "--out", str(out), "--overwrite")
        assert what in err and "never replaces it" in err, err
    assert (_listing(base), _listing(run)) == sources


def _tokenizer_files(path: Path) -> dict[str, bytes]:
    return {
        name: data
        for name, data in _listing(path).items()
        if name.split("/")[0] in modeldir.TOKENIZER_FILES + modeldir.TOKENIZER_DIRS
    }


def test_exports_carry_the_tokenizer_files_hf_save_does(finetuned, tmp_path, capsys):
    """`export --format hf` dropped chat_template.jinja (and special_tokens_map.json,
    additional_chat_templates/) while `jaxzero.hf.save` kept them: one list now, and both
    formats of export carry the base's tokenizer files byte for byte."""
    from jaxzero import hf

    run, base = finetuned
    model = hf.model(base)
    engine = model.engine(optax.sgd(0.1), mesh=jaxzero.make_mesh(1), stage=0)
    hf.save(tmp_path / "saved", model, engine, hf.load(base, engine, model))
    want = _tokenizer_files(base)
    assert {"chat_template.jinja", "additional_chat_templates/tool_use.jinja"} <= set(want)
    assert "special_tokens_map.json" in want and "tokenizer_config.json" in want
    assert _tokenizer_files(tmp_path / "saved") == want
    for fmt in ("hf", "jaxzero"):
        rc, _, err = _cli(capsys, "export", str(run), "--out", str(tmp_path / fmt), "--format", fmt)
        assert rc == 0, err
        assert _tokenizer_files(tmp_path / fmt) == want, fmt
    gen = (tmp_path / "hf" / "generation_config.json").read_bytes()
    assert gen == (base / "generation_config.json").read_bytes()  # as hf.save copies it


def test_a_failed_export_leaves_the_name_as_it_was(finetuned, tmp_path, capsys, monkeypatch):
    """Exports are built beside --out and moved into place whole: a run whose tokenizer is
    gone exported a model without one (format hf) before; a write that fails midway
    leaves the earlier export, byte for byte, and no partial directory."""
    run, base = finetuned
    moved = tmp_path / "run"
    shutil.copytree(run, moved)
    config = (moved / "config.yaml").read_text()
    (moved / "config.yaml").write_text(config.replace(f"tokenizer: {base}", "tokenizer: gone/"))
    for fmt in ("hf", "jaxzero"):
        out = tmp_path / f"x-{fmt}"
        err = _one_line_error(capsys, "export", str(moved), "--out", str(out), "--format", fmt)
        assert "the run's tokenizer gone is gone" in err, err
        assert not out.exists(), fmt

    out = tmp_path / "earlier"
    assert _cli(capsys, "export", str(run), "--out", str(out))[0] == 0
    before = _listing(out)

    def full_disk(step_dir, out_file, dtype="fp32", ema=False):
        out_file.write_bytes(b"\0" * 100)  # part of the weights written, then the disk fills
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ex, "export_params", full_disk)
    err = _one_line_error(capsys, "export", str(run), "--out", str(out))
    assert "No space left on device" in err
    assert _listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "run"]
