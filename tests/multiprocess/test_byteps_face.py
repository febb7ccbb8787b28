"""The BytePS-style face on real ranks: BytePS's MNIST example, one import line changed.

``examples/byteps_digits.py`` is written as BytePS's PyTorch examples are
(``import ... as bps``, ``bps.init()``, ``bps.DistributedOptimizer(...,
named_parameters=..., compression_params={...})``, ``bps.broadcast_parameters``,
``bps.declare`` + ``bps.push_pull_inplace`` for metrics) and imports
``hipress_like.byteps.torch as bps``. It trains digits under a torchrun-style
launch (env://) and under a one-machine bpslaunch-style environment.
"""
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hipress_like.launch.launch import run_workers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "byteps_digits.py"


def _example():
    spec = importlib.util.spec_from_file_location("byteps_digits", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def example_worker(ctx, argv):
    return _example().main(argv)


def test_the_script_imports_the_face_and_nothing_of_byteps():
    src = SCRIPT.read_text()
    assert "import hipress_like.byteps.torch as bps" in src
    assert "\nimport byteps" not in src and "hipress_like.torch" not in src


def test_byteps_script_trains_digits_with_onebit_ef_under_torchrun_style_launch():
    res = run_workers(example_worker, 2, args=(["--epochs", "4", "--compressor", "onebit",
                                                "--ef", "vanilla"],), timeout=240)
    assert res[0]["digest"] == res[1]["digest"]  # replicas identical
    assert res[0]["acc"] == res[1]["acc"] and res[0]["acc"] >= 85.0, res


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_byteps_script_trains_under_a_bpslaunch_style_environment():
    port = _free_port()
    code = ("import json, runpy, sys; sys.argv = ['x', '--epochs', '3', '--compressor', "
            "'topk', '--k', '0.05']; "
            f"g = runpy.run_path({str(SCRIPT)!r}); print('RESULT', json.dumps(g['main']()))")
    procs = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                            "LOCAL_WORLD_SIZE")}
        env.update(DMLC_WORKER_ID=str(r), DMLC_NUM_WORKER="2", DMLC_ROLE="worker",
                   DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        finally:
            p.kill()
        assert p.returncode == 0, out
        outs.append(json.loads(out.split("RESULT", 1)[1]))
    assert outs[0]["digest"] == outs[1]["digest"]
    assert outs[0]["acc"] >= 80.0, outs
