"""The package's seams that no other test watches: one version, experiments without sys.path.

(The layers themselves are import-linter's contract in pyproject.toml, checked by CI's
``lint-imports``: docs/layout.md.)
"""

import importlib.metadata
import re
import tomllib
from pathlib import Path

import jaxzero
from jaxzero.checkpoint import format as checkpoint_format

ROOT = Path(__file__).parent.parent


def test_the_version_is_pyprojects_through_the_package_metadata():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert jaxzero.__version__ == importlib.metadata.version("jaxzero")
    assert jaxzero.__version__ == pyproject["project"]["version"]
    assert checkpoint_format.__version__ is jaxzero.__version__  # what checkpoints record
    # read once: no other module spells a version out
    literal = re.compile(r"""__version__\s*=\s*["']""")
    others = (p for p in (ROOT / "jaxzero").rglob("*.py") if p.name != "version.py")
    spelled = [p for p in others if literal.search(p.read_text())]
    assert spelled == [], spelled


def test_experiments_import_each_other_as_a_package_not_through_sys_path():
    scripts = sorted((ROOT / "experiments").glob("*.py"))
    assert (ROOT / "experiments" / "__init__.py") in scripts
    trick = re.compile(r"sys\.path\.(insert|append)|sys\.path\s*\+?=")
    tricks = [p.name for p in scripts if trick.search(p.read_text())]
    assert tricks == [], f"{tricks}: import siblings as `from experiments import x`"
