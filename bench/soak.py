"""A soak: thousands of steps on 4 ranks; does memory, thread count or anything open grow?

Issue 46, item 4. ``run_workers`` (the project's launcher: gloo on loopback)
starts ``--ranks`` processes that train a small MLP on digits with
``DistributedOptimizer`` for ``--steps`` steps in all, split into *runs*:

1. **Compressor changes between runs.** Each run builds a fresh model,
   optimizer and ``DistributedOptimizer`` with the next compressor of
   ``--compressors`` (shuffled by the seed, so each soak visits them in another
   order), trains its share of the steps, then ``close()``s it. A thread, file
   descriptor or buffer an engine keeps after ``close()`` piles up run after run.
2. **Random plan switches.** Every step, with probability ``--switch-prob``,
   every rank calls ``opt.engine.set_plan`` (the switch ``plan="adaptive"``
   makes, ``tuning/online.py``) with a plan drawn at random: which gradients
   are compressed (``min_compress_bytes``) and how they are partitioned
   (``bytes_per_partition``). The engine rebuilds its layout and drops its
   replay schedule each time.
3. **Injected delays.** Every step, with probability ``--delay-prob``, one
   rank (drawn at random) sleeps up to ``--max-delay-ms`` before its backward,
   so the others wait in the exchange.

The draws come from one ``random.Random(seed)`` every rank holds, so every
rank takes the same decisions without talking. Every ``--every`` steps each
rank samples itself: RSS (``VmRSS`` of ``/proc/self/status``), threads
(``Threads`` there and ``threading.active_count()``), open file descriptors
(``/proc/self/fd``), the ``/dev/shm`` entries (how many the directory holds, and
the ones this process maps or holds open) and the live ``torch.Tensor`` objects (``gc``). It
samples again after each run's ``close()`` (kind ``closed``).

Verdict (printed; JSON ``--out``, plot next to it): after the warm-up
(``--warmup`` steps: allocator pools, lazy imports and the first plans settle),

- RSS growth per rank: the least-squares slope in MB per 1000 steps, and the
  median of the last quarter of the samples against the second quarter;
- threads and fds: equal at the first and last sample of every run (the
  training loop, plan switches, delays); after each run's ``close()`` never
  more than after the first (engine teardown); and equal at the first sample
  after the warm-up and at the last (the whole soak, every rebuild included);
- live tensors: the most gained between two samples of one run under one plan
  (a plan switch changes how many state tensors the compressor keeps);
- ``/dev/shm``: no entry mapped or held by a rank at the end that was not there
  after the warm-up, and the directory's new entries listed (other processes
  on the host may add some: they are reported, not blamed);
- the replicas end every run bitwise identical (a soak that trains wrong is no soak).

``--tracemalloc`` also traces Python allocations on every rank and returns the
ten lines that grew most between the end of the warm-up and the end.

    python bench/soak.py                       # 3000 steps, 4 ranks, ~5-10 min on 2 cores
    python bench/soak.py --steps 20000 --tracemalloc --out results/soak-long.json
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import random
import statistics
import sys
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hipress_like.launch.launch import run_workers  # noqa: E402

COMPRESSORS = ("onebit", "terngrad", "dgc", "powersgd", "thc", "natural")
# A plan draws its rule from these: compress everything, everything of 4 KB and more
# (the two weight matrices), or nothing (all through the allreduce lane); and cut a
# gradient into 1 KB, 4 KB partitions or keep it whole.
MIN_COMPRESS = (1, 4096, 1 << 30)
PARTITION = (1024, 4096, 1 << 30)


def _status() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(val.split()[0])
    return out


def _own_shm() -> List[str]:
    """``/dev/shm`` files this process maps or holds open."""
    seen = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line:
                seen.add(line.split(None, 5)[-1].strip())
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd is gone already
            continue
        if target.startswith("/dev/shm/"):
            seen.add(target)
    return sorted(seen)


def sample(step: int, run: int, kind: str, plan: str = "") -> Dict[str, Any]:
    """This process now: RSS (kB), threads, fds, /dev/shm, live tensors (``plan``: the
    plan in force, which decides how many state tensors the compressor holds)."""
    import torch

    gc.collect()
    st = _status()
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module proxies
        warnings.simplefilter("ignore")
        tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return {"step": step, "run": run, "kind": kind, "plan": plan, "t": time.time(),
            "rss_kb": st["VmRSS"], "threads": st["Threads"],
            "py_threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")) - 1,  # minus listdir's own
            "shm": len(os.listdir("/dev/shm")), "own_shm": _own_shm(),
            "tensors": tensors}


def _random_plan(rng: random.Random, compressor: str, params: Dict[str, Any]) -> Any:
    from hipress_like.cost_model.plan import Plan, SizeRule

    return Plan(compressor=compressor, params=params,
                rule=SizeRule(min_compress_bytes=rng.choice(MIN_COMPRESS),
                              bytes_per_partition=rng.choice(PARTITION)))


def _key(plan: Any) -> str:
    return f"{plan.rule.min_compress_bytes}/{plan.rule.bytes_per_partition}"


def soak_worker(ctx: Any, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Train the soak on this rank (``run_workers`` calls it on every rank).

    Returns:
        {"rank", "samples", "switches", "delays", "digests" (per run),
        "tracemalloc" (top growth lines, or None)}.
    """
    import torch
    import torch.nn.functional as F

    import hipress_like.torch as hpt
    from hipress_like.demo.cli_digits import load_digits_split

    torch.set_num_threads(1)
    if not cfg["verbose"]:  # each plan switch logs the gradients whose state it reset
        logging.getLogger("hipress_like").setLevel(logging.ERROR)
    hpt.init(timeout=cfg["timeout"])
    rank, size = hpt.rank(), hpt.size()
    xtr, ytr, _, _ = load_digits_split(cfg["seed"])
    xtr, ytr = xtr[rank::size], ytr[rank::size]
    rng = random.Random(cfg["seed"])  # same draws on every rank: same switches, same delays
    data_rng = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    compressors = list(cfg["compressors"])
    per_run = -(-cfg["steps"] // len(compressors))
    trace = None
    if cfg["tracemalloc"]:
        import tracemalloc

        tracemalloc.start(8)
    samples: List[Dict[str, Any]] = []
    digests, switches, delays, step = [], 0, 0, 0
    shm_at_warmup = sorted(os.listdir("/dev/shm"))
    for run, name in enumerate(compressors):
        params = dict(cfg["params"].get(name, {}))
        torch.manual_seed(cfg["seed"] + run)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, cfg["hidden"]),
                                    torch.nn.ReLU(), torch.nn.Linear(cfg["hidden"], 10))
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        hpt.broadcast_parameters(model.state_dict(), root_rank=0)
        plan = _random_plan(rng, name, params)
        opt = hpt.DistributedOptimizer(
            base, named_parameters=model.named_parameters(),
            compression=hpt.Compression.get(name, **params), plan=plan)
        for _ in range(min(per_run, cfg["steps"] - step)):
            if rng.random() < cfg["switch_prob"]:
                plan = _random_plan(rng, name, params)
                opt.engine.set_plan(plan)
                switches += 1
            late = rng.randrange(size) if rng.random() < cfg["delay_prob"] else -1
            pause = rng.uniform(0, cfg["max_delay_ms"] / 1e3)
            idx = torch.randint(0, len(xtr), (cfg["batch"],), generator=data_rng)
            opt.zero_grad()
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            if late == rank:
                time.sleep(pause)
                delays += 1
            loss.backward()
            opt.step()
            step += 1
            if step % cfg["every"] == 0:
                samples.append(sample(step, run, "train", _key(plan)))
            if step == cfg["warmup"]:
                shm_at_warmup = sorted(os.listdir("/dev/shm"))
                if cfg["tracemalloc"]:
                    trace = tracemalloc.take_snapshot()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        digests.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
        opt.close()
        del opt, base, model, loss, flat
        samples.append(sample(step, run, "closed"))
    top = None
    if trace is not None:
        end = tracemalloc.take_snapshot()
        top = [str(s) for s in end.compare_to(trace, "lineno")[:10]]
        tracemalloc.stop()
    hpt.barrier()
    shm_new = sorted(set(os.listdir("/dev/shm")) - set(shm_at_warmup))
    return {"rank": rank, "samples": samples, "switches": switches, "delays": delays,
            "digests": digests, "tracemalloc": top, "shm_new": shm_new}


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def _tensor_growth(train: Sequence[Dict[str, Any]]) -> int:
    """The most live tensors gained between two samples of one run under one plan (a
    switch rebuilds the compressor states for other partitions: their number changes)."""
    groups: Dict[Any, List[int]] = {}
    for s in train:
        groups.setdefault((s["run"], s["plan"]), []).append(s["tensors"])
    return max(max(v) - v[0] for v in groups.values())


def _flat(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in ("threads", "py_threads", "fds"))


def verdict(results: Sequence[Dict[str, Any]], warmup: int) -> Dict[str, Any]:
    """Judge every rank's samples (see the module docstring); returns the verdict dict.

    Three questions about threads and fds, so that a leak says where it is:
    ``within_runs_flat`` (first and last sample after the warm-up of each run:
    the training loop and plan switches), ``closed_flat`` (after each run's
    ``close()``, never more than after the first: engine teardown) and
    ``threads_flat`` / ``fds_flat`` (the first sample after the warm-up against
    the last one, across every rebuild: the whole soak).

    Raises:
        ValueError: no training sample after the warm-up (``--every`` too large
            or ``--warmup`` too close to ``--steps``).
    """
    ranks = []
    for r in results:
        train = [s for s in r["samples"] if s["kind"] == "train" and s["step"] > warmup]
        closed = [s for s in r["samples"] if s["kind"] == "closed"]
        if not train:
            raise ValueError(f"rank {r['rank']}: expected training samples after the "
                             f"{warmup}-step warm-up, found none; lower --warmup or --every")
        steps = [s["step"] for s in train]
        rss = [s["rss_kb"] / 1024 for s in train]
        q = max(1, len(train) // 4)
        q2 = statistics.median(rss[q:2 * q] or rss[:q])
        q4 = statistics.median(rss[-q:])
        first, last = train[0], train[-1]
        runs = sorted({s["run"] for s in train})
        per_run = {n: [s for s in train if s["run"] == n] for n in runs}
        ranks.append({
            "rank": r["rank"],
            "rss_mb_first": rss[0], "rss_mb_last": rss[-1], "rss_mb_max": max(rss),
            "rss_slope_mb_per_1000": 1000 * _slope(steps, rss),
            "rss_q2_mb": q2, "rss_q4_mb": q4, "rss_q4_over_q2": q4 / q2,
            "threads": [first["threads"], last["threads"]],
            "py_threads": [first["py_threads"], last["py_threads"]],
            "fds": [first["fds"], last["fds"]],
            "tensors": [first["tensors"], last["tensors"]],
            "closed_threads": [s["threads"] for s in closed],
            "closed_fds": [s["fds"] for s in closed],
            "new_own_shm": sorted(set(last["own_shm"]) - set(first["own_shm"])),
            "new_shm": r["shm_new"],
            "within_runs_flat": all(_flat(v[0], v[-1]) for v in per_run.values()),
            "tensor_growth": _tensor_growth(train),
            "closed_flat": all(s["threads"] <= closed[0]["threads"]
                               and s["fds"] <= closed[0]["fds"] for s in closed),
            "threads_flat": first["threads"] == last["threads"]
            and first["py_threads"] == last["py_threads"],
            "fds_flat": first["fds"] == last["fds"],
            "switches": r["switches"], "delays": r["delays"],
        })
    digests = [r["digests"] for r in results]
    return {"ranks": ranks,
            "identical": all(d == digests[0] for d in digests),
            "within_runs_flat": all(r["within_runs_flat"] for r in ranks),
            "closed_flat": all(r["closed_flat"] for r in ranks),
            "threads_flat": all(r["threads_flat"] for r in ranks),
            "fds_flat": all(r["fds_flat"] for r in ranks),
            "shm_clean": all(not r["new_own_shm"] for r in ranks),
            "tensor_growth_max": max(r["tensor_growth"] for r in ranks),
            "rss_q4_over_q2_max": max(r["rss_q4_over_q2"] for r in ranks),
            "rss_slope_mb_per_1000_max": max(r["rss_slope_mb_per_1000"] for r in ranks)}


def plot(results: Sequence[Dict[str, Any]], path: str, title: str) -> str:
    """RSS and threads against step, one line per rank; run boundaries dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in results:
        train = [s for s in r["samples"] if s["kind"] == "train"]
        x = [s["step"] for s in train]
        ax1.plot(x, [s["rss_kb"] / 1024 for s in train], label=f"rank {r['rank']}")
        ax2.plot(x, [s["threads"] for s in train], label=f"rank {r['rank']}")
    for s in results[0]["samples"]:
        if s["kind"] == "closed":
            for ax in (ax1, ax2):
                ax.axvline(s["step"], color="grey", linestyle=":", linewidth=0.8)
    ax1.set_ylabel("RSS (MB)")
    ax2.set_ylabel("threads (/proc)")
    ax2.set_xlabel("step (dotted: a run ends, the next compressor starts)")
    ax1.set_title(title)
    ax1.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the soak; print the verdict; write JSON and PNG. Exit 1 if a check fails."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3000, help="steps in all, over every run")
    ap.add_argument("--warmup", type=int, default=300,
                    help="steps before the growth is judged (allocator pools, lazy imports)")
    ap.add_argument("--every", type=int, default=25, help="sample every K steps")
    ap.add_argument("--compressors", default=",".join(COMPRESSORS),
                    help="one run per compressor, in an order shuffled by --seed")
    ap.add_argument("--seed", type=int, default=None, help="default: from the clock")
    ap.add_argument("--switch-prob", type=float, default=0.02)
    ap.add_argument("--delay-prob", type=float, default=0.05)
    ap.add_argument("--max-delay-ms", type=float, default=20.0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=60.0, help="hpt.init(timeout=...)")
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="the library's warnings too")
    ap.add_argument("--max-rss-growth", type=float, default=0.20,
                    help="fail when last-quarter/second-quarter RSS median exceeds 1 + this")
    ap.add_argument("--out", default="results/soak.json")
    a = ap.parse_args(argv)
    if a.ranks < 2:
        ap.error("--ranks must be >= 2 (a soak of one rank exchanges nothing)")
    if a.steps < len([c for c in a.compressors.split(",") if c]):
        ap.error("--steps must give every compressor's run at least one step")
    if a.warmup >= a.steps:
        ap.error(f"--warmup ({a.warmup}) must be below --steps ({a.steps})")
    seed = a.seed if a.seed is not None else int(time.time()) % 100000
    names = [c for c in a.compressors.split(",") if c]
    random.Random(seed).shuffle(names)
    cfg = {"steps": a.steps, "warmup": a.warmup, "every": a.every, "compressors": names,
           "params": {"thc": {"bits": 4}, "powersgd": {"rank": 2}}, "seed": seed,
           "switch_prob": a.switch_prob, "delay_prob": a.delay_prob,
           "max_delay_ms": a.max_delay_ms, "hidden": a.hidden, "batch": a.batch,
           "timeout": a.timeout, "tracemalloc": a.tracemalloc, "verbose": a.verbose}
    print(f"soak: {a.ranks} ranks, {a.steps} steps, seed {seed}, runs: {', '.join(names)}",
          flush=True)
    t0 = time.time()
    results = run_workers(soak_worker, a.ranks, args=(cfg,), timeout=600 + 2.0 * a.steps)
    wall = time.time() - t0
    v = verdict(results, a.warmup)
    for r in v["ranks"]:
        print(f"rank {r['rank']}: RSS {r['rss_mb_first']:.1f} -> {r['rss_mb_last']:.1f} MB "
              f"(max {r['rss_mb_max']:.1f}), slope {r['rss_slope_mb_per_1000']:+.2f} MB/1000 "
              f"steps, Q4/Q2 median {r['rss_q4_over_q2']:.3f}; threads {r['threads']} "
              f"(python {r['py_threads']}, after close {r['closed_threads']}); fds {r['fds']} "
              f"(after close {r['closed_fds']}); tensors {r['tensors']} (most gained in a run "
              f"{r['tensor_growth']}); "
              f"{r['switches']} plan switches, {r['delays']} delays here")
        if r["new_shm"]:
            print(f"  /dev/shm gained {len(r['new_shm'])} entries during the soak (not held by "
                  f"this rank; another process on the host?): {r['new_shm'][:5]}")
    for r in results:
        if r["tracemalloc"]:
            print(f"rank {r['rank']}: tracemalloc growth since the warm-up:")
            for line in r["tracemalloc"]:
                print(f"  {line}")
    rss_ok = v["rss_q4_over_q2_max"] <= 1 + a.max_rss_growth
    checks = [("threads and fds equal at start and end of every run", v["within_runs_flat"]),
              ("threads and fds after each close() no more than after the first",
               v["closed_flat"]),
              ("threads equal at start and end of the soak", v["threads_flat"]),
              ("fds equal at start and end of the soak", v["fds_flat"]),
              ("no /dev/shm entry gained by a rank", v["shm_clean"]),
              (f"RSS last/second quarter <= {1 + a.max_rss_growth:.2f} "
               f"(worst {v['rss_q4_over_q2_max']:.3f})", rss_ok),
              ("replicas bitwise identical after every run", v["identical"])]
    print(f"\n{wall:.0f} s; worst RSS slope {v['rss_slope_mb_per_1000_max']:+.2f} MB per 1000 "
          "steps after the warm-up")
    for what, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {what}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "config": cfg, "wall_s": wall, "verdict": v,
                   "checks": [{"check": w, "pass": ok} for w, ok in checks],
                   "results": results, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
    png = plot(results, os.path.splitext(a.out)[0] + ".png",
               f"soak: {a.ranks} ranks, {a.steps} steps, runs {' > '.join(names)}")
    print(f"wrote {a.out} and {png}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
