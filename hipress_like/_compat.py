"""Compatibility names: modules that moved, importable under their old names.

``hipress_like.casync.{launch,cli_launch,netem,procs}`` moved to
``hipress_like.launch`` (the launcher is not the scheduler),
``hipress_like.casync.quorum`` to ``hipress_like.partial.lane``, and the
compressors' flat modules into one folder per algorithm family. Users'
scripts that import the old names keep working: a meta-path finder answers
for exactly those names and hands back the *same* module object as the new
name, so state (``netem``'s lock, monkeypatches) is shared, and
``python -m hipress_like.casync.cli_launch`` still runs.

The finder lives here, in the package index's layer, rather than as shims in
``casync/``: a shim there would be the scheduler importing the floor above it
(tests/unit/test_layers.py). Nothing is imported until an old name is asked for.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Dict

__all__ = ["MOVED", "install"]

#: old module name -> new module name
MOVED: Dict[str, str] = {
    f"hipress_like.casync.{m}": f"hipress_like.launch.{m}"
    for m in ("launch", "cli_launch", "netem", "procs")
}
# The compressors' flat layout (one file per algorithm) before the algorithm
# folders. Packages that kept an old module's name (``identity``, ``onebit``,
# ``natural``, ``powersgd``, ``thc``, ``sparse``) re-export its public names
# instead; pickled compressors and plans name these paths.
MOVED.update({f"hipress_like.compressors.{old}": f"hipress_like.compressors.{new}" for old, new in {
    "tbq": "quantizers.tbq",
    "terngrad": "quantizers.terngrad",
    "dithering": "natural.dithering",
    "thc_kernels": "thc.kernels",
    "thc_payload": "thc.payload",
    "thc_tables": "thc.tables",
    "thc_tables_cli": "thc.cli_tables",
    "_fused_lowrank": "powersgd.lowrank",
    "artopk": "sparse.artopk",
    "bloom": "sparse.bloom",
    "bloom_filter": "sparse.bloom_filter",
    "curvefit": "sparse.curvefit",
    "dgc": "sparse.dgc",
    "graddrop": "sparse.graddrop",
    "sparse_codecs": "sparse.codecs",
    "compose": "wrappers.compose",
    "error_feedback": "wrappers.error_feedback",
    "_native": "_build.native",
    "_fused": "_build.fused",
}.items()})
# Partial aggregation left the scheduler for its own floor (issue 44): ``Quorum``
# may be pickled in users' configs, and the lane module re-exports every old name.
MOVED["hipress_like.casync.quorum"] = "hipress_like.partial.lane"


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the already-importable module under its new name."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        """Return the new module itself (imported if needed), not a copy."""
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        """Nothing to run: the new module was executed under its own name."""

    def get_code(self, fullname: str):
        """The new module's code, so ``python -m <old name>`` (runpy) works."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)

    def is_package(self, fullname: str) -> bool:
        """The moved names are plain modules."""
        return False


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Answers only for the names in ``MOVED``; every other import passes by."""

    def find_spec(self, fullname, path=None, target=None):
        """A spec whose loader aliases ``fullname`` to its new name, or None."""
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
