"""Validate the cost model against the CaSync engine (issue 5, HiPress Sec. 6.5 / Fig. 14).

For each compressor, on N ranks (default 4):

1. profile: encode/decode curves of the compressor (all ranks timing at
   once, with the engine's error-feedback wrapping) and the link (ring-shift
   ``alltoallv`` timings fitted to latency + bytes / bandwidth);
2. sweep: for every gradient size from 32 KB to 64 MB and every
   <compress?, K> in {no, yes} x {1, 2, 4, 8, 16} plus the planner's own
   choice (uncompressed with the engine's collective lane, the default, is
   one fused allreduce whatever K, so only K = 1 is run; with
   ``--raw-via-workflow`` uncompressed bytes go through PS/Ring: Eq. 1),
   synchronise one gradient of that size through the engine with a
   one-entry plan, and take the median over repeats of the slowest rank's
   submit-to-synchronize time;
3. compare: predicted (HiPress Eq. 1/2 with the profile) against measured,
   and the measured cost of the planner's choice against the best measured
   choice at that size.

Prints two ratios per compressor and writes a JSON report, plus, next to
it, ``<stem>.profile.json`` and ``<stem>.<compressor>.json`` for
``hipress-profile report --profile ... --measured ...``.

    # loopback, 4 local ranks
    python bench/cost_model.py --compressors onebit,tbq -o bench_loopback.json
    # emulated 1 Gbit/s (root; see ../shared/netem/README.md)
    ../shared/netem/netem.sh up 4 1gbit
    GLOO_SOCKET_IFNAME=eth0 PYTHON=$PWD/.venv/bin/python ../shared/netem/run_ns.sh 4 \\
        bench/cost_model.py --from-env -o bench_1gbit.json
    ../shared/netem/netem.sh down

Pass criteria (issue 5): median |predicted / measured - 1| <= 20% with and
without compression; the planner's choice costs <= 10% more than the best
measured choice (median over sizes; the worst size is printed too).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hipress_like.casync.engine import Engine, EngineConfig  # noqa: E402
from hipress_like.cost_model import GradientPlan, Plan, Planner  # noqa: E402
from hipress_like.cost_model.profiler import log_sizes, profile_transport  # noqa: E402

MEASUREMENTS_FORMAT = "hipress-like-sync-measurements"


def engine_round_meta_bytes() -> int:
    """Bytes each rank allgathers before every CaSync round (the coordinator's report)."""
    from hipress_like.casync.coordinator import report_len

    return 8 * report_len(EngineConfig().report_capacity)


def _sync_time(transport: Any, comp: str, strategy: str, nbytes: int, compress: bool, k: int,
               repeats: int, timeout: float, raw_collective: bool = True) -> float:
    """Median over repeats of the slowest rank's time to synchronise one gradient."""
    plan = Plan(compressor=comp, strategy=strategy, world_size=transport.size,
                gradients={"g": GradientPlan(compress=compress, partitions=k)})
    numel = nbytes // 4
    eng = Engine(transport, EngineConfig(plan=plan, strategy=strategy, timeout=timeout,
                                         timeline=False, raw_collective=raw_collective))
    try:
        eng.register([("g", (numel,), torch.float32)])
        gen = torch.Generator().manual_seed(transport.rank)
        src = torch.randn(numel, generator=gen)
        grad = src.clone()
        times = []
        for i in range(repeats + 1):
            grad.copy_(src)
            transport.barrier(timeout)
            t0 = time.perf_counter()
            eng.submit("g", grad)
            eng.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            transport.allreduce(dt, "max", timeout)
            if i:  # the first step warms up buffers, threads and compressor state
                times.append(float(dt.item()))
        return statistics.median(times)
    finally:
        eng.close()


def _repeats_for(nbytes: int, base: int) -> int:
    # Small sizes are noisy (DESIGN: 4 KB p50 ~4 ms on loopback): more repeats.
    return base * 3 if nbytes <= (1 << 20) else base


def run(transport: Any, compressors: Sequence[str], sizes: Sequence[int], ks: Sequence[int],
        strategy: str, repeats: int, timeout: float, raw_collective: bool = True,
        quiet: bool = False) -> Optional[Dict[str, Any]]:
    """The whole benchmark on one rank (collective); rank 0 returns the report."""
    n, rank = transport.size, transport.rank
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 and not quiet \
        else (lambda *a: None)
    t_start = time.perf_counter()
    prof = profile_transport(transport, {c: {} for c in compressors},
                             sizes=log_sizes(4096, max(sizes), 1.0),
                             link_sizes=log_sizes(4096, max(sizes), 0.5), repeats=7,
                             timeout=timeout, round_meta_bytes=engine_round_meta_bytes(),
                             engine_overhead=strategy)
    one = prof.link_one or prof.link
    say(f"profile: all links {prof.link.latency * 1e6:.0f} us + "
        f"{prof.link.bandwidth * 8 / 1e9:.2f} Gbit/s, one link {one.latency * 1e6:.0f} us + "
        f"{one.bandwidth * 8 / 1e9:.2f} Gbit/s, sync overhead {prof.sync_overhead * 1e3:.1f} ms "
        f"({time.perf_counter() - t_start:.0f} s)")
    report: Dict[str, Any] = {"nodes": n, "strategy": strategy, "profile": prof.to_dict(),
                              "raw_collective": raw_collective, "results": {}}
    for comp in compressors:
        planner = Planner(prof, comp, n, strategy, max_partitions=max(ks),
                          raw_collective=raw_collective)
        rows: List[Dict[str, Any]] = []
        for nbytes in sizes:
            choice = planner.choose(nbytes)
            # with the collective lane K does not change the uncompressed path
            configs = {(c, k) for c in (False, True) for k in ks
                       if c or not raw_collective or k == 1}
            configs.add((choice.compress, choice.partitions))
            for compress, k in sorted(configs):
                t = _sync_time(transport, comp, strategy, nbytes, compress, k,
                               _repeats_for(nbytes, repeats), timeout, raw_collective)
                pred = planner.t_cpr(nbytes, k) if compress else planner.t_orig(nbytes, k)
                rows.append({"nbytes": nbytes, "compress": compress, "partitions": k,
                             "measured_s": t, "predicted_s": pred,
                             "planner_choice": (compress, k) == (choice.compress,
                                                                 choice.partitions)})
            say(f"{comp} {nbytes >> 10:>7} KB: plan <{'yes' if choice.compress else 'no'}, "
                f"{choice.partitions}> ({time.perf_counter() - t_start:.0f} s)")
        report["results"][comp] = {"format": MEASUREMENTS_FORMAT, "version": 1, "nodes": n,
                                   "strategy": strategy, "compressor": comp, "rows": rows,
                                   "summary": summarise(rows)}
    report["elapsed_s"] = time.perf_counter() - t_start
    return report if rank == 0 else None


def summarise(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Median prediction errors and the planner's regret against the best measured choice."""
    def err(r):
        return abs(r["predicted_s"] / r["measured_s"] - 1)

    out: Dict[str, Any] = {}
    for label, sel in (("uncompressed_k1", lambda r: not r["compress"] and r["partitions"] == 1),
                       ("compressed_k1", lambda r: r["compress"] and r["partitions"] == 1),
                       ("uncompressed_all_k", lambda r: not r["compress"]),
                       ("compressed_all_k", lambda r: r["compress"]),
                       ("all", lambda r: True)):
        errs = [err(r) for r in rows if sel(r)]
        out[f"median_abs_err_{label}"] = statistics.median(errs) if errs else None
    regrets, per_size = [], {}
    for s in sorted({r["nbytes"] for r in rows}):
        at = [r for r in rows if r["nbytes"] == s]
        best = min(at, key=lambda r: r["measured_s"])
        chosen = next(r for r in at if r["planner_choice"])
        regret = chosen["measured_s"] / best["measured_s"] - 1
        regrets.append(regret)
        per_size[str(s)] = {"plan": [chosen["compress"], chosen["partitions"]],
                            "best": [best["compress"], best["partitions"]],
                            "regret": regret}
    out["planner_regret_median"] = statistics.median(regrets)
    out["planner_regret_max"] = max(regrets)
    out["per_size"] = per_size
    return out


def _ensure_registered(names: Sequence[str]) -> List[str]:
    """Import compressor modules not yet imported by the package; return the missing names."""
    import importlib

    from hipress_like import compressors as registry

    for name in names:
        if name not in registry.available():
            try:
                importlib.import_module(f"hipress_like.compressors.{name}")
            except ImportError:
                pass
    return [n for n in names if n not in registry.available()]


def _worker(ctx: Any, *args: Any) -> Optional[Dict[str, Any]]:
    _ensure_registered(args[0])
    return run(ctx.transport, *args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compressors", default="onebit,tbq")
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--strategy", default="ps", choices=("ps", "ring"))
    ap.add_argument("--min-size", type=int, default=32 << 10)
    ap.add_argument("--max-size", type=int, default=64 << 20)
    ap.add_argument("--per-octave", type=float, default=0.5, help="sizes per doubling")
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--raw-via-workflow", action="store_true",
                    help="uncompressed gradients through the PS/Ring workflow (HiPress Eq. 1; "
                         "engine raw_collective=False) instead of the collective lane")
    ap.add_argument("--from-env", action="store_true",
                    help="this process is one rank (RANK/WORLD_SIZE set, e.g. by run_ns.sh)")
    ap.add_argument("-o", "--output", default="bench_cost_model.json")
    a = ap.parse_args(argv)
    comps = [c for c in a.compressors.split(",") if c]
    missing = _ensure_registered(comps)
    if missing:
        print(f"skipping compressors not registered yet: {missing}", file=sys.stderr)
        comps = [c for c in comps if c not in missing]
    if not comps:
        print("no compressor to benchmark", file=sys.stderr)
        return 2
    sizes = log_sizes(a.min_size, a.max_size, a.per_octave)
    ks = [int(k) for k in a.ks.split(",")]
    args = (comps, sizes, ks, a.strategy, a.repeats, a.timeout, not a.raw_via_workflow)
    if a.from_env:
        import torch.distributed as dist

        from hipress_like.casync.transport.torch_dist import TorchDistTransport

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        t = TorchDistTransport()
        report = run(t, *args)
        # ENVIRONMENT.md: collect, barrier, then destroy, or gloo may abort at exit.
        import gc

        gc.collect()
        t.barrier()
        t.close()
        dist.barrier()
        dist.destroy_process_group()
        if report is None:
            return 0
        report["network"] = "from-env"
    else:
        from hipress_like.casync.launch import run_workers

        report = run_workers(_worker, a.nprocs, "gloo", args=args,
                             timeout=a.timeout * 20)[0]
        report["network"] = "loopback"
    with open(a.output, "w") as f:
        json.dump(report, f, indent=1)
    stem = a.output[:-5] if a.output.endswith(".json") else a.output
    for comp, res in report["results"].items():  # for hipress-profile report --measured
        with open(f"{stem}.{comp}.json", "w") as f:
            json.dump(res, f, indent=1)
    with open(f"{stem}.profile.json", "w") as f:
        json.dump(report["profile"], f, indent=1)
    for comp, res in report["results"].items():
        s = res["summary"]
        print(f"{comp}: median |pred/meas-1|: uncompressed K=1 "
              f"{s['median_abs_err_uncompressed_k1']:.1%}, compressed K=1 "
              f"{s['median_abs_err_compressed_k1']:.1%}, uncompressed all K "
              f"{s['median_abs_err_uncompressed_all_k']:.1%}, compressed all K "
              f"{s['median_abs_err_compressed_all_k']:.1%}; planner regret vs best measured: "
              f"median {s['planner_regret_median']:.1%}, max {s['planner_regret_max']:.1%}")
        for size, d in s["per_size"].items():
            print(f"  {int(size) >> 10:>7} KB plan <{'yes' if d['plan'][0] else 'no'}, "
                  f"{d['plan'][1]}> best <{'yes' if d['best'][0] else 'no'}, {d['best'][1]}> "
                  f"regret {d['regret']:.1%}")
    print(f"wrote {a.output} ({report['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
