"""The documented API is the exported API (as optax's docs coverage check): every name a
public module exports has an entry in docs/api.md, every entry is exported, and every
``jaxzero.x.y`` the docs name resolves.

A module is public when docs/api.md documents something in it (``jaxzero`` always); a
public module says what it exports in ``__all__``.
"""

import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
API = (ROOT / "docs" / "api.md").read_text()
ENTRIES = re.findall(r"^::: ([\w.]+)\s*$", API, re.M)
DOCS = {
    "README.md": (ROOT / "README.md").read_text(),
    **{str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))},
}
DOTTED = re.compile(r"\bjaxzero(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^\s*from (jaxzero(?:\.\w+)*) import ([\w, ]+)$", re.M)


def resolve(dotted: str) -> tuple[types.ModuleType, object]:
    """The longest importable module of ``dotted`` and the object the rest names in it
    (getattr by getattr); AttributeError or ImportError when it names nothing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is None or not dotted.startswith(e.name):
                raise  # the module exists and fails to import: that is the error to see
            continue
        obj: object = module
        for name in parts[i:]:
            obj = getattr(obj, name)
        return module, obj
    raise ImportError(f"no module in {dotted}")


def public_modules() -> dict[str, types.ModuleType]:
    """``jaxzero`` and every module docs/api.md documents a member of."""
    found = {"jaxzero": importlib.import_module("jaxzero")}
    for entry in ENTRIES:
        module, obj = resolve(entry)
        if isinstance(obj, types.ModuleType):
            found[obj.__name__] = obj
        elif module.__name__.startswith("jaxzero"):
            found[module.__name__] = module
    return found


def _documented(obj: object) -> bool:
    """Whether an entry of docs/api.md is ``obj`` (a module: an entry is in it)."""
    for entry in ENTRIES:
        module, found = resolve(entry)
        if found is obj:
            return True
        if isinstance(obj, types.ModuleType) and module is obj:
            return True
    return False


@pytest.mark.unit
def test_every_api_entry_resolves():
    for entry in ENTRIES:
        resolve(entry)  # raises, naming it, when the entry names nothing
    assert "jaxzero.Engine" in ENTRIES


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(public_modules()))
def test_every_exported_name_of_a_public_module_is_documented(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, (
        f"docs/api.md documents {name}, so {name} is public: say what it exports in __all__"
    )
    missing = [n for n in exported if not _documented(getattr(module, n))]
    assert not missing, f"{name}.__all__ names {missing}: give each an entry in docs/api.md"


@pytest.mark.unit
def test_every_api_entry_is_exported():
    """An entry names a module's public member: one in its ``__all__`` (or the module)."""
    for entry in ENTRIES:
        module, obj = resolve(entry)
        if isinstance(obj, types.ModuleType):
            continue
        exported = getattr(module, "__all__", [])
        assert entry.rsplit(".", 1)[1] in exported, (
            f"docs/api.md documents {entry}, which {module.__name__}.__all__ does not export"
        )


def _named_in_docs() -> dict[str, str]:
    """Every ``jaxzero.x.y`` and ``from jaxzero.x import y`` in README.md and docs/, with
    the page that names it."""
    named = {}
    for page, text in DOCS.items():
        for dotted in DOTTED.findall(text):
            named.setdefault(dotted, page)
        for module, names in FROM_IMPORT.findall(text):
            for name in names.replace(" ", "").split(","):
                named.setdefault(f"{module}.{name}", page)
    return named


@pytest.mark.unit
def test_every_jaxzero_name_the_docs_mention_resolves():
    named = _named_in_docs()
    assert "jaxzero.nnx.use" in named and len(named) > 20
    broken = []
    for dotted, page in sorted(named.items()):
        try:
            resolve(dotted)
        except (ImportError, AttributeError) as e:
            broken.append(f"{page}: {dotted} ({e})")
    assert not broken, "the docs name what is not there:\n" + "\n".join(broken)
