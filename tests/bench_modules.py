"""Load a benchmark script of ``bench/`` as a module, for the tests of its logic.

The scripts are not a package: each is loaded from its file under the name
``bench_<name>`` (registered in ``sys.modules``, where dataclasses look their
module up), with ``bench/`` on ``sys.path`` for the scripts' own imports of each
other (``import bound``, ``import netem``).
"""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def load(name: str, alias: str = ""):
    """A fresh module of ``bench/<name>.py`` named ``alias`` (default ``bench_<name>``)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    alias = alias or f"bench_{name}"
    spec = importlib.util.spec_from_file_location(alias, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod
