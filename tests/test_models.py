"""The model fields are defined once (jaxzero.models.fields) and both reference models
implement the one model protocol."""

from __future__ import annotations

import dataclasses
import typing

import optax
import pytest

from jaxzero.models import GPT, GPTConfig, Llama, LlamaConfig, Model, ModelConfig, from_fields
from jaxzero.models import fields as fields_lib
from jaxzero.models.common import ATTENTION, REMAT_POLICIES
from jaxzero.train import config as C
from jaxzero.train import export as ex

pytestmark = pytest.mark.unit


def test_the_model_fields_are_the_run_configs():
    assert C.ModelConfig is ModelConfig  # the run config's model section is the schema
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    assert list(fields_lib.FIELDS) == names
    assert set(ex.MODEL_FIELDS) == set(names) - {"attention"}  # an export's: all but the kernel
    gpt = {f.name for f in dataclasses.fields(GPTConfig)}
    assert gpt <= set(names)  # from_fields gives the GPT each of its fields


def test_the_literals_are_the_models_choices():
    hints = typing.get_type_hints(ModelConfig)
    assert typing.get_args(hints["remat"]) == tuple(REMAT_POLICIES)
    assert typing.get_args(hints["attention"]) == ATTENTION
    assert fields_lib.ARCHS == ("gpt", "llama")


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_from_fields_takes_the_config_defaults(arch):
    """A field left out takes ModelConfig's default (seq_len once fell back to 128 here)."""
    default = ModelConfig(arch=arch, vocab_size=32)
    given = from_fields({"arch": arch, "vocab_size": 32})
    assert given.config == from_fields(default).config
    assert given.config.seq_len == ModelConfig.seq_len
    with pytest.raises(ValueError, match="unknown model field 'd_modle'"):
        from_fields({"vocab_size": 32, "d_modle": 8})
    with pytest.raises(ValueError, match="model.vocab_size is not set"):
        from_fields({"arch": arch})


def test_both_models_implement_the_protocol():
    gpt = GPT(GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2))
    llama = Llama(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, seq_len=8))
    for model in (gpt, llama):
        assert isinstance(model, Model)
        engine = model.engine(optax.sgd(0.1))
        assert not hasattr(engine, "model")  # no back-pointer: hf.save takes the model
    assert not isinstance(object(), Model)
