"""Run Horovod's own test files on this project's faces and on real Horovod.

``--file torch`` (the default) is ``test/parallel/test_torch.py`` against
``hipress_like.torch``; ``--file mxnet`` is ``test/parallel/test_mxnet1.py``
(its ``MX1Tests``, which inherit ``base_test_mxnet.py``'s ``MXTests``) against
``hipress_like.mxnet``; ``--file tensorflow`` and ``--file keras`` are
``test_tensorflow.py`` and ``test_tensorflow2_keras.py`` against
``hipress_like.tensorflow`` and ``hipress_like.tensorflow.keras``. Each runs with
its framework environment's Python (``scripts/env_mxnet.sh``,
``scripts/env_tensorflow.sh``), Horovod built into it by
``HIPRESS_VENV=<that venv> scripts/env_horovod.sh``.

Horovod's test code stays outside this project: this tool reads it from a
Horovod checkout (a work tree or a bare git mirror, at tag v0.28.1 by
default) into a temporary directory, in two copies:

- ``hipress``: exactly one change, the import line (``import horovod.torch as
  hvd`` -> ``import hipress_like.torch as hvd``; for MXNet the same line of
  ``base_test_mxnet.py``), run under every launcher asked for
  (``horovodrun --gloo -np N`` and ``torchrun``);
- ``horovod`` (``--reference``): the file unmodified, real Horovod under
  ``horovodrun --gloo -np N`` on the same machine: the pass set to compare with.

Every rank runs pytest on the chosen tests and appends each test's start and
outcome to its own log as it happens, so a test that hangs (ranks waiting in
different collectives, a rank dead) costs one per-test timeout: the watchdog
stops the job (every process the launcher started), records the test as
``timeout`` and starts the launcher again on the tests after it (after
``--retries`` fresh tries of the test itself). A test that fails on any rank
also ends the job, and the tests after it start in a fresh one: one rank's
failure leaves the ranks in different collectives, which would otherwise fail
every later test (Horovod's own tearDown resynchronizes only under gloo).
Inside the ranks pytest-timeout (when installed) ends a hung test first.

Per launcher it prints both pass sets side by side, the tests only one side
passes and the ratio "this project passes X of the Y tests real Horovod
passes"; ``--out`` writes all of it as JSON::

    .venv/bin/python tests/frameworks/horovod_suite.py --source /path/to/horovod \\
        [--launchers horovodrun,torchrun] [--reference] [--np 2] \\
        [--tests default|all|name,name] [--test-timeout 120] [--out results/x.json]

The project's own tests (tests/frameworks/test_horovod_surface.py,
test_horovod_calls.py) pin the same behaviours in its own words; this tool is
the cross-check.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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

# Tests that read MPI's or Horovod's launcher variables (Horovod's
# ``mpi_env_rank_and_size``, ``HOROVOD_RANK``): under torchrun the rank and size
# tests expect rank 0 of 1 whatever hvd.rank() says, and the re-init tests skip
# themselves ("Gloo is not available"), so they are reported "n/a" there (they
# run under horovodrun).
TORCHRUN_NOT_APPLICABLE = ("test_horovod_rank", "test_horovod_size", "test_horovod_reinit",
                           "test_horovod_is_initialized")

# Each file: where it is, the TestCase its tests run in, and the one import line
# switched (in the file that holds it) for this project's side.
FILES = {
    "torch": {"test": "test/parallel/test_torch.py", "cls": "TorchTests",
              "switch": ("test/parallel/test_torch.py", "import horovod.torch as hvd\n",
                         "import hipress_like.torch as hvd\n"),
              "bases": ()},
    "mxnet": {"test": "test/parallel/test_mxnet1.py", "cls": "MX1Tests",
              "switch": ("test/parallel/base_test_mxnet.py", "    import horovod.mxnet as hvd\n",
                         "    import hipress_like.mxnet as hvd\n"),
              "bases": ("test/parallel/base_test_mxnet.py",)},
    "tensorflow": {"test": "test/parallel/test_tensorflow.py", "cls": "TensorFlowTests",
                   "switch": ("test/parallel/test_tensorflow.py",
                              "import horovod.tensorflow as hvd\n",
                              "import hipress_like.tensorflow as hvd\n"),
                   "bases": ("test/parallel/base_test_tensorflow.py",)},
    "keras": {"test": "test/parallel/test_tensorflow2_keras.py", "cls": "Tf2KerasTests",
              "switch": ("test/parallel/test_tensorflow2_keras.py",
                         "import horovod.tensorflow.keras as hvd\n",
                         "import hipress_like.tensorflow.keras as hvd\n"),
              "bases": ()},
}

# Runs on every rank: pytest on the given tests, each start and outcome appended
# (and flushed) to log-<rank>.jsonl the moment it happens.
_RANK_WRAPPER = """\
import json, os, sys, time, pytest
rank = next(os.environ[v] for v in ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK")
            if v in os.environ)
log = open(f"log-{rank}.jsonl", "a", buffering=1)

class Record:
    def pytest_runtest_logstart(self, nodeid, location):
        log.write(json.dumps({"start": nodeid.rsplit("::", 1)[-1], "t": time.time()}) + "\\n")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            if report.when == "teardown" and report.outcome == "passed":
                return
            msg = ""
            if report.failed:
                msg = str(getattr(report.longrepr, "reprcrash", None) or report.longrepr)
            elif report.skipped and isinstance(report.longrepr, tuple):
                msg = report.longrepr[2]
            log.write(json.dumps({"test": report.nodeid.rsplit("::", 1)[-1],
                                  "when": report.when, "outcome": report.outcome,
                                  "msg": msg[-400:], "t": time.time()}) + "\\n")

ids = [f"{sys.argv[2]}::{t}" for t in sys.argv[1].split(",")]
args = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", "."]
t = os.environ.get("HVD_SUITE_TEST_TIMEOUT")
if t:
    try:
        import pytest_timeout  # noqa: F401
        args += [f"--timeout={t}", "--timeout-method=thread"]
    except ImportError:
        pass  # the watchdog in horovod_suite.py still ends a hung test
sys.exit(pytest.main([*args, *ids], plugins=[Record()]))
"""


def _read(source: Path, rel: str, ref: str) -> str:
    if (source / rel).exists():
        return (source / rel).read_text()
    return subprocess.run(["git", "--git-dir", str(source), "show", f"{ref}:{rel}"],
                          check=True, capture_output=True, text=True).stdout


def all_tests(source: Path, ref: str, file: str = "torch") -> tuple:
    """Every ``test_*`` method the file's TestCase runs (its bases' first), in file
    order, each once. A file using ``parameterized.expand`` (the Keras file) names its
    tests only when collected: pytest collects them from an unmodified copy."""
    spec = FILES[file]
    names = []
    texts = [_read(source, rel, ref) for rel in (*spec["bases"], spec["test"])]
    if any("@parameterized" in t for t in texts):
        return _collected(source, ref, file)
    for text in texts:
        names += re.findall(r"^    def (test_\w+)\(self", text, flags=re.M)
    return tuple(dict.fromkeys(names))


def _collected(source: Path, ref: str, file: str) -> tuple:
    """The file's test names as pytest collects them (this Python, Horovod's own copy)."""
    with tempfile.TemporaryDirectory(prefix="hvd-collect-") as d:
        prepare(source, ref, Path(d), "horovod", file)
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                              "-p", "no:cacheprovider", "-o", "addopts=",
                              Path(FILES[file]["test"]).name], cwd=d, text=True,
                             capture_output=True).stdout
    names = re.findall(rf"::{FILES[file]['cls']}::(test_\w+)", out)
    if not names:
        raise SystemExit(f"collecting {FILES[file]['test']} found no tests:\n{out[-2000:]}")
    return tuple(dict.fromkeys(names))


def test_id(file: str = "torch") -> str:
    """The pytest id prefix of the file's tests (``module.py::Class``)."""
    spec = FILES[file]
    return f"{Path(spec['test']).name}::{spec['cls']}"


def prepare(source: Path, ref: str, into: Path, side: str = "hipress",
            file: str = "torch") -> None:
    """Write the test file, its bases and helper modules into ``into``.

    Args:
        source: Horovod work tree or bare mirror.
        ref: git ref when ``source`` is a mirror.
        into: directory to write to (created).
        side: "hipress" (the one import line switched to this project's face) or
            "horovod" (the files unmodified).
        file: a key of ``FILES``.
    """
    spec = FILES[file]
    into.mkdir(parents=True, exist_ok=True)
    where, line, ours = spec["switch"]
    for rel in (*spec["bases"], spec["test"]):
        text = _read(source, rel, ref)
        if rel == where:
            if text.count(line) != 1:
                raise SystemExit(f"expected one line {line!r} in {rel}, "
                                 f"found {text.count(line)}")
            if side == "hipress":
                text = text.replace(line, ours)
        (into / Path(rel).name).write_text(text)
    (into / "common.py").write_text(_read(source, "test/utils/common.py", ref))
    (into / "run_rank.py").write_text(_RANK_WRAPPER)
    # common.py imports the PyPI backport ``mock``; the standard library's is the same API
    # (used only where the backport is not installed: ``parameterized``, which the Keras
    # file imports, reads the backport's ``version_info``)
    import importlib.util

    if importlib.util.find_spec("mock") is None:
        (into / "mock.py").write_text("from unittest.mock import *  # noqa: F401,F403\n")


def _command(launcher: str, np: int, expr: str, file: str = "torch") -> list:
    bindir = Path(sys.executable).parent
    if launcher == "torchrun":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return [str(bindir / "torchrun"), f"--nproc-per-node={np}", "--master-addr=127.0.0.1",
                f"--master-port={port}", "run_rank.py", expr, test_id(file)]
    return [str(bindir / "horovodrun"), "--gloo", "-np", str(np), "-H", f"localhost:{np}",
            sys.executable, "run_rank.py", expr, test_id(file)]


def _env(test_timeout: float) -> dict:
    bindir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "HOROVOD_", "OMPI_", "MASTER_", "PMI"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HIPRESS_TIMEOUT=env.get("HIPRESS_TIMEOUT", "60"),
               HVD_SUITE_TEST_TIMEOUT=str(int(test_timeout)),
               PATH=f"{bindir}:{env['PATH']}")
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Stop the launcher and every process it started (Horovod's own run in new sessions)."""
    try:
        import psutil

        kids = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 (psutil missing or the launcher already gone)
        kids = []
    for p in [proc, *kids]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _logs(workdir: Path, np: int) -> list:
    out = []
    for r in range(np):
        path = workdir / f"log-{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        out.append([json.loads(x) for x in lines if x.strip()])
    return out


def run(launcher: str, np: int, tests, workdir: Path, test_timeout: float = 120,
        start_timeout: float = 600, retries: int = 1, isolate: bool = True,
        file: str = "torch") -> tuple:
    """Run ``tests`` on ``np`` ranks; a hung test costs ``test_timeout`` seconds.

    Returns:
        ({test: status}, {test: first failure message}); status is "passed" (on
        every rank), "failed" (on any rank), "skipped", "timeout" (a rank did not
        finish it: hang or death, after ``retries`` more tries in a fresh job), or
        "n/a" (see TORCHRUN_NOT_APPLICABLE). With ``isolate``, a test that fails
        on any rank ends the job and the tests after it run in a fresh one, so
        ranks left in different collectives by one failure fail no other test.
    """
    skipped = [t for t in tests if launcher == "torchrun" and t in TORCHRUN_NOT_APPLICABLE]
    status = {t: "n/a" for t in skipped}
    why = {}
    remaining = [t for t in tests if t not in skipped]
    env = _env(test_timeout)
    tries = {}
    out_path = workdir / f"out-{launcher}.txt"
    out_path.write_text("")
    while remaining:
        for f in workdir.glob("log-*.jsonl"):
            f.unlink()
        with open(out_path, "a") as out:
            proc = subprocess.Popen(_command(launcher, np, ",".join(remaining), file),
                                    cwd=workdir,
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
            began = time.monotonic()
            killed = False
            since = {}  # (rank, lines in its log) -> when first seen
            while proc.poll() is None:
                time.sleep(1.0)
                now = time.monotonic()
                stuck = False
                for r, log in enumerate(_logs(workdir, np)):
                    if not log:  # still importing, or never started
                        stuck |= now - began > start_timeout
                        continue
                    # stuck: its last line is a test's start, unchanged for the timeout
                    first = since.setdefault((r, len(log)), now)
                    stuck |= "start" in log[-1] and now - first > test_timeout + 30
                failed = isolate and any(rec.get("outcome") == "failed"
                                         for log in _logs(workdir, np) for rec in log)
                if stuck or failed:
                    _stop(proc)
                    killed = stuck
        logs = _logs(workdir, np)
        done = {}
        for log in logs:
            for rec in log:
                if "test" in rec:
                    done.setdefault(rec["test"], []).append(rec)
                    if rec["outcome"] == "failed":
                        why.setdefault(rec["test"], rec["msg"])
        first_failed = next((t for t in remaining if any(
            r["outcome"] == "failed" for r in done.get(t, []))), None)
        culprit = None
        for t in remaining:
            if t == first_failed:
                # a test failed on some rank: the ranks may now wait in different
                # collectives, so the tests after it start again in a fresh job
                status[t] = "failed"
                culprit = t
                break
            recs = done.get(t, [])
            if len(recs) >= np:
                outs = [r["outcome"] for r in recs]
                status[t] = ("failed" if "failed" in outs else
                             "skipped" if "skipped" in outs else "passed")
                continue
            culprit = t
            break
        if culprit is None:
            break
        if culprit == first_failed:
            remaining = remaining[remaining.index(culprit) + 1:]
            continue
        tries[culprit] = tries.get(culprit, 0) + 1
        if tries[culprit] <= retries:
            # again in a fresh job: real Horovod's own re-init (every test's tearDown
            # shuts Horovod down under gloo) can hang on a loaded host
            print(f"[{launcher}] {culprit}: {'timeout' if killed else 'a rank ended'}; "
                  "running it again in a fresh job", flush=True)
            remaining = remaining[remaining.index(culprit):]
            continue
        status[culprit] = "timeout"
        tail = out_path.read_text()[-1500:]
        why.setdefault(culprit, ("stopped after the per-test timeout" if killed else
                                 f"launcher exited {proc.returncode}") +
                       f" with ranks {len(done.get(culprit, []))} of {np} done; "
                       f"output tail: {tail[-300:]}")
        print(f"[{launcher}] {culprit}: {'timeout' if killed else 'rank died'}; "
              "restarting on the tests after it", flush=True)
        remaining = remaining[remaining.index(culprit) + 1:]
    return status, why


def summarize(tests, columns: dict, reference: str = None) -> dict:
    """Per project column: passes, the tests only one side passes, and the ratio."""
    summary = {}
    for name, res in columns.items():
        entry = {"passed": sum(v == "passed" for v in res.values()),
                 "ran": sum(v != "n/a" for v in res.values())}
        if reference and name != reference:
            ref = {t for t, v in columns[reference].items() if v == "passed"}
            ours = {t for t, v in res.items() if v == "passed"}
            na = {t for t, v in res.items() if v == "n/a"}
            entry.update(reference_passes=len(ref - na), both=len(ref & ours),
                         only_reference=sorted(ref - ours - na),
                         only_project=sorted(ours - ref),
                         ratio=len(ref & ours) / max(1, len(ref - na)))
        summary[name] = entry
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, type=Path,
                    help="a Horovod checkout or bare git mirror")
    ap.add_argument("--ref", default="v0.28.1", help="git ref when --source is a mirror")
    ap.add_argument("--launchers", default="horovodrun,torchrun",
                    help="launchers for this project's side")
    ap.add_argument("--reference", action="store_true",
                    help="also run the file unmodified with real Horovod under horovodrun")
    ap.add_argument("--reference-from", type=Path, default=None,
                    help="take real Horovod's results from this earlier --out JSON")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--file", choices=sorted(FILES), default="torch",
                    help="which Horovod test file (and face): torch or mxnet")
    ap.add_argument("--tests", default="default", help="default, all, or name,name,...")
    ap.add_argument("--test-timeout", type=float, default=120,
                    help="seconds one test may take before it is stopped as hung")
    ap.add_argument("--retries", type=int, default=1,
                    help="fresh jobs a hung test gets before it counts as 'timeout'")
    ap.add_argument("--update", type=Path, default=None,
                    help="an earlier --out JSON: rerun only --tests and replace their results "
                         "in it (then summarize all of its tests)")
    ap.add_argument("--out", "--json", dest="out", default=None,
                    help="write the results here as JSON")
    ns = ap.parse_args(argv)
    if ns.tests == "default" and ns.file != "torch":
        ns.tests = "all"
    tests = (DEFAULT_TESTS if ns.tests == "default" else all_tests(ns.source, ns.ref, ns.file)
             if ns.tests == "all" else tuple(ns.tests.split(",")))
    columns, reasons = {}, {}
    with tempfile.TemporaryDirectory(prefix="hvd-suite-") as d:
        runs = ([("horovod", "horovodrun")] if ns.reference and not ns.reference_from
                else []) + \
            [("hipress", launcher) for launcher in ns.launchers.split(",") if launcher]
        for side, launcher in runs:
            workdir = Path(d) / f"{side}-{launcher}"
            prepare(ns.source, ns.ref, workdir, side, ns.file)
            name = f"{side}/{launcher}"
            t0 = time.monotonic()
            columns[name], reasons[name] = run(launcher, ns.np, tests, workdir,
                                               ns.test_timeout, retries=ns.retries,
                                               file=ns.file)
            print(f"[{name}] {time.monotonic() - t0:.0f}s", flush=True)
    if ns.update:  # the earlier results, with the rerun tests replaced
        earlier = json.loads(ns.update.read_text())
        for name, res in columns.items():
            earlier["results"].setdefault(name, {}).update(res)
            kept = {t: m for t, m in earlier["reasons"].get(name, {}).items() if t not in res}
            earlier["reasons"][name] = {**kept, **reasons[name]}
        tests = tuple(earlier["tests"])
        columns = {n: r for n, r in earlier["results"].items() if n != "horovod/horovodrun"}
        reasons = earlier["reasons"]
    if ns.reference_from:  # read now: it may have been written while this ran
        earlier = json.loads(ns.reference_from.read_text())
        columns = {"horovod/horovodrun": {t: earlier["results"]["horovod/horovodrun"].get(
            t, "missing") for t in tests}, **columns}
        reasons["horovod/horovodrun"] = earlier["reasons"]["horovod/horovodrun"]
        ns.reference = True
    names = list(columns)
    ref = "horovod/horovodrun" if ns.reference else None
    width = max(len(t) for t in tests) + 1
    print(f"{'test':<{width}}" + " ".join(f"{n:>19}" for n in names))
    for t in tests:
        print(f"{t:<{width}}" + " ".join(f"{columns[n][t]:>19}" for n in names))
    summary = summarize(tests, columns, ref)
    for n in names:
        s = summary[n]
        print(f"{n}: {s['passed']} of {s['ran']} passed")
        if "ratio" in s:
            print(f"  only real Horovod passes ({len(s['only_reference'])}): "
                  f"{', '.join(s['only_reference']) or '-'}")
            print(f"  only this project passes ({len(s['only_project'])}): "
                  f"{', '.join(s['only_project']) or '-'}")
            print(f"  this project passes {s['both']} of the {s['reference_passes']} tests "
                  f"real Horovod passes ({100 * s['ratio']:.0f}%)")
        for t, msg in sorted(reasons[n].items()):
            if columns[n][t] != "passed":
                print(f"  [{n}] {t}: {' '.join(msg.split())[:200]}")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(
            {"np": ns.np, "ref": ns.ref, "file": ns.file, "tests": list(tests),
             "results": columns,
             "summary": summary, "reasons": reasons}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
