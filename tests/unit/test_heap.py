"""heap.settle: the collector's permanent generation holds what is alive at init().

Each case runs in a fresh interpreter: freezing is once per process and would
otherwise freeze the test runner's own heap.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SETTLE = """
import gc, weakref
from hipress_like import heap
class Node:
    pass
keep = Node(); keep.self = keep          # alive at settle(): frozen with the imports
assert heap.settle() is True and heap.settled()
frozen = gc.get_freeze_count()
assert frozen > 10000, frozen            # torch's and the library's objects
assert heap.settle() is False            # once per process
later = Node(); later.self = later       # created afterwards: collected as usual
ref = weakref.ref(later)
del later
gc.collect()
assert ref() is None
print("ok", frozen)
"""


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **env), timeout=300)


def test_settle_freezes_once_and_later_garbage_is_still_collected():
    p = _run("import torch\n" + _SETTLE)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stderr[-2000:]


def test_the_environment_turns_it_off():
    p = _run("import gc\nfrom hipress_like import heap\n"
             "assert heap.settle() is False and not heap.settled()\n"
             "assert gc.get_freeze_count() == 0\nprint('off')", HIPRESS_GC_FREEZE="0")
    assert p.returncode == 0 and p.stdout.strip() == "off", p.stderr[-2000:]


def test_init_settles_the_heap():
    p = _run("import gc\nimport hipress_like.torch as hpt\nhpt.init()\n"
             "from hipress_like import heap\nassert heap.settled() and gc.get_freeze_count() > 0"
             "\nhpt.shutdown()\nprint('init')")
    assert p.returncode == 0 and p.stdout.strip().endswith("init"), p.stderr[-2000:]
