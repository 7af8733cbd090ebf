"""The runnable examples in the public docstrings stay true."""

import doctest
import importlib

import pytest

MODULES = ["jaxzero.engine", "jaxzero.partition", "jaxzero.hooks", "jaxzero.mesh",
           "jaxzero.models.gpt", "jaxzero.job"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
