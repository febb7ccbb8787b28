"""Run Horovod's own ``test/parallel/test_torch.py`` against ``hipress_like.torch``.

Horovod's test code stays outside this project: this tool reads it from a
Horovod checkout (a work tree or a bare git mirror, at tag v0.28.1 by
default), writes it to a temporary directory with exactly one change, the
import line (``import horovod.torch as hvd`` -> ``import hipress_like.torch
as hvd``), and runs the chosen tests with pytest on every rank, under
``horovodrun -np N`` and under ``torchrun``. It prints, per launcher, which
tests passed on every rank.

    .venv/bin/python tests/frameworks/horovod_suite.py --source /path/to/horovod \\
        [--launchers horovodrun,torchrun] [--np 2] [--tests default|all|name,name]

The project's own tests (tests/frameworks/test_horovod_surface.py) pin the
same behaviours in its own words; this tool is the cross-check.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# the surface issue 20 lists (Horovod's test names)
DEFAULT_TESTS = (
    "test_horovod_rank", "test_horovod_size", "test_horovod_allreduce",
    "test_horovod_allreduce_average", "test_horovod_allreduce_inplace",
    "test_horovod_allgather", "test_horovod_allgather_variable_size",
    "test_horovod_broadcast", "test_horovod_broadcast_inplace", "test_broadcast_object",
    "test_broadcast_state_no_grad", "test_compression_fp16", "test_duplicate_names",
    "test_dynamic_requires_grad", "test_gradient_clipping", "test_synchronize_step_warning",
    "test_missing_named_parameters", "test_no_named_parameters",
)

# Tests that read the expected rank and size from MPI's or Horovod's launcher
# variables (Horovod's ``mpi_env_rank_and_size``, ``HOROVOD_RANK``): under
# torchrun they expect rank 0 of 1 whatever hvd.rank() says, so they are
# reported "n/a" there (they run under horovodrun).
TORCHRUN_NOT_APPLICABLE = ("test_horovod_rank", "test_horovod_size")

_RANK_WRAPPER = """\
import os, sys, pytest
rank = next(os.environ[v] for v in ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK")
            if v in os.environ)
ids = [f"test_torch.py::TorchTests::{t}" for t in sys.argv[1].split(",")]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", ".",
                      f"--junitxml=junit-{rank}.xml", *ids]))
"""


def _read(source: Path, rel: str, ref: str) -> str:
    if (source / rel).exists():
        return (source / rel).read_text()
    return subprocess.run(["git", "--git-dir", str(source), "show", f"{ref}:{rel}"],
                          check=True, capture_output=True, text=True).stdout


def prepare(source: Path, ref: str, into: Path) -> None:
    """Write test_torch.py (import switched) and its helper module into ``into``."""
    text = _read(source, "test/parallel/test_torch.py", ref)
    old = "import horovod.torch as hvd\n"
    if text.count(old) != 1:
        raise SystemExit(f"expected one line {old!r} in test_torch.py, found {text.count(old)}")
    (into / "test_torch.py").write_text(text.replace(old, "import hipress_like.torch as hvd\n"))
    (into / "common.py").write_text(_read(source, "test/utils/common.py", ref))
    (into / "run_rank.py").write_text(_RANK_WRAPPER)
    # common.py imports the PyPI backport ``mock``; the standard library's is the same API
    (into / "mock.py").write_text("from unittest.mock import *  # noqa: F401,F403\n")


def run(launcher: str, np: int, tests, workdir: Path, timeout: float) -> dict:
    """Run the tests on ``np`` ranks; {test: "passed"/"failed"/"skipped"/"missing"} by rank 0,
    "failed" if any rank failed it."""
    bindir = Path(sys.executable).parent
    skipped = [t for t in tests if launcher == "torchrun" and t in TORCHRUN_NOT_APPLICABLE]
    tests = [t for t in tests if t not in skipped]
    expr = ",".join(tests)
    if launcher == "torchrun":
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [str(bindir / "torchrun"), f"--nproc-per-node={np}", "--master-addr=127.0.0.1",
               f"--master-port={port}", "run_rank.py", expr]
    else:
        cmd = [str(bindir / "horovodrun"), "--gloo", "-np", str(np), "-H", f"localhost:{np}",
               sys.executable, "run_rank.py", expr]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "HOROVOD_", "OMPI_", "MASTER_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                           env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HIPRESS_TIMEOUT=env.get("HIPRESS_TIMEOUT", "120"),
               PATH=f"{bindir}:{env['PATH']}")
    for f in workdir.glob("junit-*.xml"):
        f.unlink()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout)
    seen = {t: [] for t in tests}
    why = {}
    for r in range(np):
        path = workdir / f"junit-{r}.xml"
        if not path.exists():
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            if case.get("name") in seen:
                kids = {c.tag: c for c in case}
                bad = kids.get("failure", kids.get("error"))
                if bad is not None:
                    why.setdefault(case.get("name"), (bad.get("message") or "")[:160])
                seen[case.get("name")].append(
                    "failed" if bad is not None else
                    "skipped" if "skipped" in kids else "passed")
    status = {t: "n/a" for t in skipped}
    for t, sts in seen.items():
        status[t] = ("missing" if not sts else "failed" if "failed" in sts else
                     "skipped" if "skipped" in sts else
                     "passed" if len(sts) == np else "partial")
    for t, msg in why.items():
        print(f"[{launcher}] {t}: {msg}")
    if proc.returncode not in (0, 1):
        print(f"[{launcher}] exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, type=Path,
                    help="a Horovod checkout or bare git mirror")
    ap.add_argument("--ref", default="v0.28.1", help="git ref when --source is a mirror")
    ap.add_argument("--launchers", default="horovodrun,torchrun")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--tests", default="default")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", default=None, help="write the results here")
    ns = ap.parse_args(argv)
    tests = DEFAULT_TESTS if ns.tests == "default" else tuple(ns.tests.split(","))
    results = {}
    with tempfile.TemporaryDirectory(prefix="hvd-suite-") as d:
        prepare(ns.source, ns.ref, Path(d))
        for launcher in ns.launchers.split(","):
            results[launcher] = run(launcher, ns.np, tests, Path(d), ns.timeout)
    names = list(results)
    print(f"{'test':<40} " + " ".join(f"{n:>11}" for n in names))
    for t in tests:
        print(f"{t:<40} " + " ".join(f"{results[n][t]:>11}" for n in names))
    for n in names:
        ok = sum(v == "passed" for v in results[n].values())
        na = sum(v == "n/a" for v in results[n].values())
        print(f"{n}: {ok} of {len(tests) - na} passed"
              + (f" ({na} not applicable: {', '.join(TORCHRUN_NOT_APPLICABLE)} read "
                 "MPI/Horovod launcher variables)" if na else ""))
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
