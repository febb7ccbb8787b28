"""Partial aggregation against a straggler: job time with and without a quorum, same run.

THC Sec. 8.3's scenario on digits (``hipress_like.demo.stragglers``): 4
ranks, THC at 4 bits (with error feedback, as ``DistributedOptimizer``
wraps it), and one rank that sleeps twice the usual step time before the
backward of one step in every five. Four configurations, each timed over
the same steps after a warm-up, in alternation (repeat 1 of every
configuration, then repeat 2, ...) so that a drifting load on this shared
machine falls on all of them alike:

    partial   Quorum(fraction=0.75): a step closes once 3 of 4 ranks are in
    full      Quorum(fraction=1.0): the same lane, every rank waited for
    x {no straggler, straggler}

The usual step time is the median loop iteration of the no-straggler
``full`` runs of the first repeat. The job time is the slowest rank's end
minus the first rank's start of the timed steps. Then two longer runs
(``--acc-steps``) give the test accuracy with the straggler under the quorum
against no straggler. Every run checks that all ranks end bitwise identical.

    python bench/stragglers.py                  # 50 timed steps, 2 repeats
    python bench/stragglers.py --steps 50 --repeats 3 --out results/stragglers.json

Goals (issue 22): with the quorum, the straggler's job takes at most 1.2x the
job without it; without the quorum at least 1.4x; ranks bitwise identical;
accuracy with the straggler within 1 point.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hipress_like.demo.stragglers import StragglerConfig, train_straggling  # noqa: E402
from hipress_like.launch.launch import run_workers  # noqa: E402


def run(cfg: StragglerConfig, ranks: int) -> dict:
    """One job: its time, median step, accuracy, whether replicas agree, counters."""
    res = run_workers(train_straggling, ranks, args=(asdict(cfg),), timeout=1800)
    steps = sorted(t for r in res for t in r["step_seconds"])
    return {"job_s": max(r["end"] for r in res) - min(r["start"] for r in res),
            "median_step_s": steps[len(steps) // 2],
            "acc": res[0]["acc"],
            "identical": len({r["param_digest"] for r in res}) == 1,
            "counters": [r["stragglers"] for r in res]}


def main(argv=None) -> int:
    """Run the comparison; print ratios and goals; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50, help="timed steps per job")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=0.75)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--acc-steps", type=int, default=300,
                    help="steps of the two accuracy runs (0: skip them)")
    ap.add_argument("--compressor", default="thc")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out", default="results/stragglers.json")
    a = ap.parse_args(argv)
    if a.ranks < 2:
        ap.error("--ranks must be >= 2 (one of them straggles)")
    params = {"bits": a.bits} if a.compressor == "thc" else {}
    base = dict(compressor=a.compressor, params=params, steps=a.steps, warmup=a.warmup,
                every=a.every)
    straggler = a.ranks - 1
    rows: dict = {k: [] for k in ("full", "partial", "full+straggler", "partial+straggler")}
    sleep = None
    for rep in range(a.repeats):
        for name in ("full", "partial", "full+straggler", "partial+straggler"):
            frac = a.fraction if name.startswith("partial") else 1.0
            lag = "straggler" in name
            cfg = StragglerConfig(**base, fraction=frac, straggler=straggler if lag else -1,
                                  sleep=sleep if lag else 0.0)
            r = run(cfg, a.ranks)
            rows[name].append(r)
            print(f"[{rep + 1}/{a.repeats}] {name:18s} job {r['job_s']:6.2f} s  "
                  f"median step {r['median_step_s'] * 1e3:6.1f} ms  acc {r['acc']:5.1f}%  "
                  f"identical {r['identical']}", flush=True)
            if name == "partial" and sleep is None:
                sleep = 2 * rows["full"][0]["median_step_s"]
                print(f"usual step time {sleep / 2 * 1e3:.1f} ms: the straggler sleeps "
                      f"{sleep * 1e3:.1f} ms in one step of every {a.every}", flush=True)
    med = {k: statistics.median(r["job_s"] for r in v) for k, v in rows.items()}
    with_q = med["partial+straggler"] / med["partial"]
    without_q = med["full+straggler"] / med["full"]
    identical = all(r["identical"] for v in rows.values() for r in v)
    print(f"\n{a.steps} steps, {a.ranks} ranks, {a.compressor}, straggler rank {straggler}")
    print(f"  quorum {a.fraction}: {med['partial+straggler']:.2f} s vs {med['partial']:.2f} s "
          f"without the straggler = {with_q:.2f}x  (goal <= 1.2x)")
    print(f"  every rank waited for: {med['full+straggler']:.2f} s vs {med['full']:.2f} s = "
          f"{without_q:.2f}x  (goal >= 1.4x)")
    print(f"  ranks bitwise identical in every run: {identical}")
    last = rows["partial+straggler"][-1]["counters"][straggler]
    print(f"  straggler's counters (last run): {last}")
    acc = {}
    if a.acc_steps:
        for name, lag, frac in (("no straggler", False, 1.0),
                                ("straggler, quorum", True, a.fraction)):
            cfg = StragglerConfig(**{**base, "steps": a.acc_steps}, fraction=frac,
                                  straggler=straggler if lag else -1,
                                  sleep=sleep if lag else 0.0)
            r = run(cfg, a.ranks)
            acc[name] = r
            identical = identical and r["identical"]
            print(f"  accuracy after {a.acc_steps} steps, {name}: {r['acc']:.1f}% "
                  f"(identical {r['identical']})", flush=True)
        gap = acc["no straggler"]["acc"] - acc["straggler, quorum"]["acc"]
        print(f"  accuracy gap {gap:+.1f} points  (goal <= 1)")
    goals = [("quorum job ratio", with_q, "<= 1.2", with_q <= 1.2),
             ("no-quorum job ratio", without_q, ">= 1.4", without_q >= 1.4),
             ("bitwise identical", identical, "True", identical)]
    if acc:
        goals.append(("accuracy gap", gap, "<= 1.0", gap <= 1.0))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "sleep_s": sleep, "rows": rows, "median_job_s": med,
                   "accuracy": acc, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "goals": [dict(zip(("name", "value", "target", "pass"), g)) for g in goals]},
                  f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
