"""The fault-injection suite as a benchmark: every fault of the catalogue, N trials, one table.

    PYTHONPATH=$PWD python bench/faults.py [--trials 3] [--only kill/forward ...] [--out F]

Runs ``tests/faults/harness.py``'s catalogue (all of it by default, the slow
tier included) without pytest, prints the summary table issue 46 asks for and
writes it as JSON (``--out``, default ``results/faults.json``). It asserts
nothing: the tests in ``tests/faults/test_injected_faults.py`` do. The
columns are explained in docs/reliability.md.
"""
from __future__ import annotations

import argparse
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
    args = ap.parse_args(argv)
    names = args.only or (list(harness.DEFAULT_TIER) if args.default_tier
                          else list(harness.CATALOG))
    unknown = [n for n in names if n not in harness.CATALOG]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; known: {', '.join(harness.CATALOG)}")
    trials = []
    for name in names:
        for i in range(args.trials):
            t = harness.run_trial(harness.CATALOG[name])
            trials.append(t)
            bad = [s.rank for s in t.survivors if not (s.names_rank and s.names_cause)]
            print(f"{name} #{i + 1}: {t.wall_s:.1f}s, hangs {t.hangs}, left {t.left_behind}, "
                  f"corrupted {t.corrupted}, survivors not naming it right: {bad}", flush=True)
    path = harness.write_summary(trials, args.out)
    print(harness.render(harness.summarize(trials)))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
