"""Every exception class hipress_like defines derives from ``HipressError``.

Two views that check each other: the import view (every importable module is
imported and every ``BaseException`` subclass defined there is listed) and
the source view (``ast``: every class whose bases name a built-in exception
or another error class of the package), so a module that cannot be imported
here (TensorFlow or MXNet absent) cannot hide an error class.
"""
import ast
import builtins
import importlib
import inspect
import pathlib
import pkgutil
import sys

import pytest

import hipress_like
from hipress_like.errors import HipressError

PKG = pathlib.Path(hipress_like.__file__).parent
_BUILTIN_EXC = {n for n, v in vars(builtins).items()
                if inspect.isclass(v) and issubclass(v, BaseException)}


def _imported_error_classes():
    unimportable = set()
    for m in pkgutil.walk_packages(hipress_like.__path__, "hipress_like."):
        if m.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(m.name)
        except ImportError:  # an optional framework is absent here
            unimportable.add(m.name)
    found = {}
    for name, mod in list(sys.modules.items()):
        if name == "hipress_like" or name.startswith("hipress_like."):
            for k, v in vars(mod).items():
                if inspect.isclass(v) and issubclass(v, BaseException) and v.__module__ == name:
                    found[f"{name}.{k}"] = v
    return found, unimportable


def _source_error_classes():
    """(module, class, base names) for every class the source says is an exception."""
    classes = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                classes.append((mod, node.name, bases))
    errors, names = [], set(_BUILTIN_EXC) | {"HipressError"}
    changed = True
    while changed:  # an error class may derive from one defined later in the walk
        changed = False
        for _mod, cls, bases in classes:
            if cls not in names and any(b in names for b in bases):
                names.add(cls)
                changed = True
    for mod, cls, bases in classes:
        if any(b in names for b in bases):
            errors.append((mod, cls, bases))
    return errors


def test_every_exception_class_derives_from_hipress_error():
    found, _ = _imported_error_classes()
    assert len(found) >= 19, sorted(found)  # the 19 classes issue 44 counted, and the base
    bad = [n for n, c in found.items() if not issubclass(c, HipressError)]
    assert not bad, f"expected every error to derive from HipressError; found {bad}; " \
                    "fix: add hipress_like.errors.HipressError to its bases"


def test_the_source_view_sees_the_same_classes_and_unimportable_ones_derive_too():
    found, unimportable = _imported_error_classes()
    for mod, cls, bases in _source_error_classes():
        key = f"{mod}.{cls}"
        if key in found:
            continue
        assert any(mod == u or mod.startswith(u + ".") for u in unimportable), \
            f"{key} is in the source but was not imported"
        assert "HipressError" in bases or any(
            b in {c.__name__ for c in found.values()} for b in bases), (key, bases)


@pytest.mark.parametrize("name, builtin", [
    ("hipress_like.cost_model.plan.PlanError", ValueError),
    ("hipress_like.compressors.params.ParamTypeError", TypeError),
    ("hipress_like.casync.errors.EngineError", RuntimeError),
    ("hipress_like.casync.transport.base.PeerError", RuntimeError),
    ("hipress_like.adapters.ordering.OrderingError", AssertionError),
])
def test_errors_keep_their_builtin_bases(name, builtin):
    mod, cls = name.rsplit(".", 1)
    c = getattr(importlib.import_module(mod), cls)
    assert issubclass(c, HipressError) and issubclass(c, builtin)


def test_hipress_error_is_exported_from_the_package():
    assert hipress_like.HipressError is HipressError
