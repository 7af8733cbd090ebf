"""Config: defaults, YAML/JSON files, --set overrides, and errors that name the key."""

import json
from pathlib import Path

import pytest

from jaxzero.train import args as train_args
from jaxzero.train import config as C

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_defaults_validate_and_round_trip_through_yaml(tmp_path):
    cfg = C.validate(C.Config())
    path = tmp_path / "run.yaml"
    path.write_text(C.dump_yaml(cfg))
    assert C.load_file(path) == cfg


def test_json_file_and_yaml_floats(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"optimizer": {"lr": 0.0003}, "train": {"steps": 7}}))
    cfg = C.load_file(path)
    assert cfg.optimizer.lr == 3e-4 and cfg.train.steps == 7
    assert cfg.model == C.ModelConfig()  # untouched sections keep defaults
    # YAML 1.1 would read "3e-4" as a string; the loader reads it as the float it means.
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  lr: 3e-4\nmodel:\n")
    assert C.load_file(path).optimizer.lr == pytest.approx(3e-4)


def test_set_overrides_are_typed():
    cfg = C.apply_overrides(
        C.Config(),
        [
            "optimizer.lr=3e-4",
            "train.steps=12",
            "model.remat=full",
            "parallel.devices=null",
            "optimizer.max_grad_norm=2",
            "logging.tensorboard=false",
            "data.path=some/file.txt",
        ],
    )
    assert cfg.optimizer.lr == pytest.approx(3e-4) and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.steps == 12 and cfg.model.remat == "full"
    assert cfg.parallel.devices is None
    assert cfg.optimizer.max_grad_norm == 2.0 and isinstance(cfg.optimizer.max_grad_norm, float)
    assert cfg.logging.tensorboard is False and cfg.data.path == "some/file.txt"


def test_set_a_section_with_a_mapping_updates_only_named_fields():
    cfg = C.apply_overrides(C.Config(), ["model={d_model: 64, n_heads: 2}"])
    assert (cfg.model.d_model, cfg.model.n_heads) == (64, 2)
    assert cfg.model.n_layers == C.ModelConfig().n_layers


@pytest.mark.parametrize(
    "assignment, key",
    [
        ("optimizer.lrr=1e-3", "optimizer.lrr"),
        ("nosuch.field=1", "nosuch.field"),
        ("train.steps.deeper=1", "train.steps.deeper"),
        ("model={d_modl: 3}", "model.d_modl"),
    ],
)
def test_unknown_keys_are_errors_naming_the_key(assignment, key):
    with pytest.raises(C.ConfigError, match=f"unknown config key '{key}'"):
        C.apply_overrides(C.Config(), [assignment])


@pytest.mark.parametrize(
    "assignment, key",
    [
        ("train.steps=abc", "train.steps"),
        ("train.steps=1.5", "train.steps"),
        ("train.steps=true", "train.steps"),
        ("optimizer.lr=fast", "optimizer.lr"),
        ("parallel.stage=4", "parallel.stage"),
        ("parallel.stage=3.0", "parallel.stage"),
        ("precision.compute=fp16", "precision.compute"),
        ("logging.tensorboard=1", "logging.tensorboard"),
        ("parallel.devices=two", "parallel.devices"),
        ("model=3", "model"),
    ],
)
def test_ill_typed_values_are_errors_naming_the_key(assignment, key):
    with pytest.raises(C.ConfigError) as err:
        C.apply_overrides(C.Config(), [assignment])
    assert str(err.value).startswith(f"{key}:")
    assert "\n" not in str(err.value)


def test_file_errors_name_the_dotted_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: 64\n  heads: 4\n")
    with pytest.raises(C.ConfigError, match="'model.heads'"):
        C.load_file(path)
    path.write_text("optimizer:\n  lr: '0.1'\n")
    with pytest.raises(C.ConfigError, match="^optimizer.lr: expected float"):
        C.load_file(path)
    path.write_text("model: [1, 2]\n")
    with pytest.raises(C.ConfigError, match="^model: expected a mapping"):
        C.load_file(path)
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load_file(tmp_path / "missing.yaml")


def test_malformed_yaml_names_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: 64\n  n_heads: 4: 3\n")
    with pytest.raises(C.ConfigError) as err:
        C.load_file(path)
    assert "not valid YAML/JSON at line 3, column 13: mapping values are not allowed" in str(
        err.value
    )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "assignments, match",
    [
        (["model.d_model=100", "model.n_heads=3"], "not divisible by model.n_heads"),
        (["train.batch_size=30", "parallel.micro_batches=4"], "parallel.micro_batches"),
        (["train.steps=0"], "train.steps"),
        (["data.val_fraction=1.5"], "data.val_fraction"),
        (["parallel.devices=0"], "parallel.devices"),
        (["zero.offload=optimizer", "parallel.stage=0"], "offload='optimizer' needs stage 1"),
        (["zero.qwz=true", "parallel.stage=2"], "qwz=True quantizes stage 3's"),
        (["zero.qgz=int8", "parallel.stage=0"], "qgz='int8' reduce-scatters"),
        (["zero.hpz=true"], "hpz=True keeps a params copy sharded within each group"),
        (["zero.hpz=true", "mesh.group_size=4", "parallel.stage=1"], "hpz=True is stage 3's"),
        (["zero.quant_block=0"], "quant_block must be a positive"),
        (["mesh.model=0"], "mesh.model: must be >= 1"),
        (["mesh.model=2"], "mesh.model=2 splits Llama-family layers"),
        (["mesh.ulysses=true"], "mesh.ulysses splits Llama-family attention"),
        (["zero.qgz=int4", "zero.quant_block=63"], "quant_block=63 must be even"),
    ],
)
def test_validate_rejects_inconsistent_values(assignments, match):
    with pytest.raises(C.ConfigError, match=match):
        C.validate(C.apply_overrides(C.Config(), assignments))


def test_set_rejects_text_without_equals():
    with pytest.raises(C.ConfigError, match="KEY=VALUE"):
        C.apply_overrides(C.Config(), ["optimizer.lr"])


def test_cli_shortcuts_map_to_fields_and_set_wins():
    args = train_args.build_parser().parse_args(
        [
            "--stage",
            "1",
            "--devices",
            "2",
            "--data",
            "x.txt",
            "--steps",
            "5",
            "--name",
            "r",
            "--precision",
            "bf16",
            "--set",
            "train.steps=7",
        ]
    )
    cfg = train_args.config_from_args(args)
    assert cfg.parallel.stage == 1 and cfg.parallel.devices == 2
    assert cfg.data.path == str(Path.cwd() / "x.txt") and cfg.logging.name == "r"  # absolute
    assert cfg.precision.compute == "bf16"
    assert cfg.train.steps == 7  # --set is applied after the shortcuts


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_named_configs_load_and_validate(path):
    cfg = C.validate(C.load_file(path))
    assert isinstance(cfg, C.Config)


def test_named_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "gpt2-small", "gpt-1.3b"} <= names
