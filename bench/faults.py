"""The fault-injection suite as a benchmark: every fault of the catalogue, N trials, one table.

    PYTHONPATH=$PWD python bench/faults.py [--trials 3] [--only kill/forward ...] [--out F]

Runs ``tests/faults/harness.py``'s catalogue (all of it by default, the slow
tier included) without pytest, prints the summary table issue 46 asks for and
writes it as JSON (``--out``, default ``results/faults.json``). It asserts
nothing: the tests in ``tests/faults/test_injected_faults.py`` do. The
columns are explained in docs/reliability.md.

``--load N`` runs the trials beside N busy processes (each a Python loop that
never sleeps), so the table shows detection and exit times on a host loaded
as a shared CI machine is; the load averages before and after are printed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "faults"))
import harness  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="fault names (default: all); "
                    f"known: {', '.join(harness.CATALOG)}")
    ap.add_argument("--default-tier", action="store_true", help="only the default tier's faults")
    ap.add_argument("--out", default=None)
    ap.add_argument("--load", type=int, default=0,
                    help="busy processes running beside the trials (default 0)")
    args = ap.parse_args(argv)
    names = args.only or (list(harness.DEFAULT_TIER) if args.default_tier
                          else list(harness.CATALOG))
    unknown = [n for n in names if n not in harness.CATALOG]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; known: {', '.join(harness.CATALOG)}")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(max(0, args.load))]
    if hogs:
        print(f"{len(hogs)} busy processes beside the trials; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    try:
        trials, load_end = _run(names, args.trials)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if hogs:
        print(f"load average at the end, before the hogs stopped: {load_end:.1f}")
    path = harness.write_summary(trials, args.out)
    print(harness.render(harness.summarize(trials)))
    print(f"written to {path}")


def _run(names, n):
    """``n`` trials of every fault in ``names``, each reported as it ends; the trials
    and the load average when the last ended."""
    trials = []
    for name in names:
        for i in range(n):
            t = harness.run_trial(harness.CATALOG[name])
            trials.append(t)
            bad = [s.rank for s in t.survivors if not (s.names_rank and s.names_cause)]
            print(f"{name} #{i + 1}: {t.wall_s:.1f}s, hangs {t.hangs}, left {t.left_behind}, "
                  f"corrupted {t.corrupted}, survivors not naming it right: {bad}", flush=True)
    return trials, os.getloadavg()[0]


if __name__ == "__main__":
    main()
