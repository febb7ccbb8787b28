"""Validate the cost model against the CaSync engine (issue 5, HiPress Sec. 6.5 / Fig. 14).

On N ranks (default 4):

1. profile: encode/decode curves of each compressor (all ranks timing at
   once, with the engine's error-feedback wrapping) and the link (ring-shift
   ``alltoallv`` timings fitted to latency + bytes / bandwidth);
2. time whole synchronisations of one gradient through the engine
   (``measure_engine_sync``), in ``--passes`` shuffled passes over every
   point, medians over passes:
   - calibration points: the uncompressed lane and each compressor at
     64 KB, 512 KB, 4 MB and 32 MB with K = 1, 2, N, 3N
     (``profiler.engine_points``);
   - validation points: every size from 32 KB to 64 MB uncompressed
     (the engine's collective lane: one fused allreduce whatever K, so
     K = 1; all K with ``--raw-via-workflow``, HiPress Eq. 1) and
     compressed with every K of ``--ks``;
   interleaving them means a shared host that slows down for a while
   slows both alike;
3. fit the engine's cost beyond Eq. 1/2 to the calibration points only
   (``Profile.lane``, ``planner.EngineTerm``), then compare predicted
   against measured at the validation points, and the measured cost of
   the planner's choice (among the swept K) against the best measured
   choice at that size.

Prints two ratios per compressor and writes a JSON report, plus, next to
it, ``<stem>.profile.json`` and ``<stem>.<compressor>.json`` for
``hipress-profile report --profile ... --measured ...``.

    # loopback, 4 local ranks
    python bench/cost_model.py --compressors onebit,tbq -o bench_loopback.json
    # emulated 1 Gbit/s links: ranks in network namespaces (bench/netem.py; root)
    python bench/cost_model.py --net 1gbit -o bench_1gbit.json

Pass criteria (issue 5): median |predicted / measured - 1| <= 20% with and
without compression; the planner's choice costs <= 10% more than the best
measured choice (median over sizes; the worst size is printed too).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hipress_like.casync.engine import EngineConfig  # noqa: E402
from hipress_like.cost_model import Planner, Profile  # noqa: E402
from hipress_like.cost_model.model import fit_link  # noqa: E402
from hipress_like.cost_model.profile import log_sizes  # noqa: E402
from hipress_like.tuning.profiler import (  # noqa: E402
    engine_points,
    measure_engine_sync,
    profile_transport,
)

MEASUREMENTS_FORMAT = "hipress-like-sync-measurements"


def engine_round_meta_bytes() -> int:
    """Bytes each rank allgathers before every CaSync round (the coordinator's report)."""
    from hipress_like.casync.coordinator import report_len

    return 8 * report_len(EngineConfig().report_capacity)


# (kind, compressor or None, bytes, K): kind is "calib" (fitted) or "valid" (predicted)
Point = Tuple[str, Optional[str], int, int]


def sweep_points(compressors: Sequence[str], sizes: Sequence[int], ks: Sequence[int], n: int,
                 raw_collective: bool = True) -> List[Point]:
    """Every synchronisation the benchmark times, calibration and validation.

    Calibration: the uncompressed lane and each compressor at
    ``profiler.engine_points`` (64 KB, 512 KB, 4 MB, 32 MB; K = 1, 2, N, 3N),
    none of them a validation size. Validation: every size with
    uncompressed K = 1 (the collective lane ignores K; all of ``ks`` with
    ``raw_collective=False``) and compressed with every K of ``ks``.
    """
    calib_sizes = sorted({m for m, _ in engine_points(max(sizes), n)})
    if len(calib_sizes) < 2:  # the lane's latency + bandwidth fit needs two sizes
        calib_sizes.insert(0, calib_sizes[0] // 8)
    pts: List[Point] = [("calib", None, m, 1) for m in calib_sizes]
    for comp in compressors:
        pts += [("calib", comp, m, k) for m, k in engine_points(max(sizes), n)]
    raw_ks = [1] if raw_collective else list(ks)
    pts += [("valid", None, m, k) for m in sizes for k in raw_ks]
    pts += [("valid", c, m, k) for c in compressors for m in sizes for k in ks]
    return pts


def time_points(transport: Any, prof: Profile, points: Sequence[Point], strategy: str,
                passes: int, repeats: int, timeout: float, raw_collective: bool,
                say: Any = lambda *a: None) -> Dict[Point, float]:
    """Median seconds per point over ``passes`` shuffled passes of ``repeats`` syncs each.

    Points are visited in a new seeded order every pass (the same on every
    rank), so a shared host that slows down for a minute slows calibration
    and validation points alike instead of biasing one against the other.
    """
    rng = random.Random(0)
    per_pass: Dict[Point, List[float]] = {p: [] for p in points}
    t0 = time.perf_counter()
    for i in range(passes):
        order = list(points)
        rng.shuffle(order)
        for pt in order:
            _, comp, m, k = pt
            cp = prof.compressor(comp) if comp else None
            ((_, _, t),) = measure_engine_sync(
                transport, strategy, [(m, k)], compressor=cp, repeats=repeats,
                timeout=timeout, engine_config={"raw_collective": raw_collective})
            per_pass[pt].append(t)
        say(f"pass {i + 1}/{passes}: {len(points)} points ({time.perf_counter() - t0:.0f} s)")
    return {p: statistics.median(ts) for p, ts in per_pass.items()}


def run(transport: Any, compressors: Sequence[str], sizes: Sequence[int], ks: Sequence[int],
        strategy: str, repeats: int, timeout: float, raw_collective: bool = True,
        quiet: bool = False, passes: int = 5) -> Optional[Dict[str, Any]]:
    """The whole benchmark on one rank (collective); rank 0 returns the report."""
    n, rank = transport.size, transport.rank
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 and not quiet \
        else (lambda *a: None)
    t_start = time.perf_counter()
    prof = profile_transport(transport, {c: {} for c in compressors},
                             sizes=log_sizes(4096, max(sizes), 1.0),
                             link_sizes=log_sizes(4096, max(sizes), 0.5), repeats=7,
                             timeout=timeout, round_meta_bytes=engine_round_meta_bytes(),
                             raw_collective=raw_collective)
    one = prof.link_one or prof.link
    say(f"profile: all links {prof.link.latency * 1e6:.0f} us + "
        f"{prof.link.bandwidth * 8 / 1e9:.2f} Gbit/s, one link {one.latency * 1e6:.0f} us + "
        f"{one.bandwidth * 8 / 1e9:.2f} Gbit/s ({time.perf_counter() - t_start:.0f} s)")
    points = sweep_points(compressors, sizes, ks, n, raw_collective)
    measured = time_points(transport, prof, points, strategy, passes, repeats, timeout,
                           raw_collective, say)
    # the engine timings of the profile: calibration points only
    lane_samples = tuple(sorted((m, t) for (kind, c, m, _), t in measured.items()
                                if kind == "calib" and c is None))
    comps = {name: dataclasses.replace(
        cp, engine_samples=tuple(sorted((m, k, t) for (kind, c, m, k), t in measured.items()
                                        if kind == "calib" and c == name)),
        engine_strategy=strategy, engine_samples_by={})
        for name, cp in prof.compressors.items()}
    prof = dataclasses.replace(prof, compressors=comps, lane_samples=lane_samples,
                               lane=fit_link([m for m, _ in lane_samples],
                                             [t for _, t in lane_samples]) if raw_collective
                               else None)
    say(f"engine lane (uncompressed, fitted at {[m >> 10 for m, _ in lane_samples]} KB): "
        f"{prof.lane.latency * 1e3:.1f} ms + {prof.lane.bandwidth * 8 / 1e9:.2f} Gbit/s"
        if prof.lane else "uncompressed: HiPress Eq. 1")
    report: Dict[str, Any] = {"nodes": n, "strategy": strategy, "profile": prof.to_dict(),
                              "raw_collective": raw_collective, "passes": passes,
                              "repeats": repeats, "results": {}}
    for comp in compressors:
        planner = Planner(prof, comp, n, strategy, partitions=list(ks),
                          raw_collective=raw_collective)
        term = planner.engine_term
        say(f"{comp}: engine beyond Eq. 2: {term.describe()}")
        rows: List[Dict[str, Any]] = []
        for (kind, c, nbytes, k), t in sorted(measured.items(), key=lambda x: x[0][2:]):
            if kind != "valid" or c not in (None, comp):
                continue
            compress = c is not None
            choice = planner.choose(nbytes)
            pred = planner.t_cpr(nbytes, k) if compress else planner.t_orig(nbytes, k)
            rows.append({"nbytes": nbytes, "compress": compress, "partitions": k,
                         "measured_s": t, "predicted_s": pred,
                         "planner_choice": (compress, k) == (choice.compress,
                                                             choice.partitions)})
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
    ap.add_argument("--repeats", type=int, default=3, help="timed syncs per point and pass")
    ap.add_argument("--passes", type=int, default=5,
                    help="shuffled passes over all points (medians over passes)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--raw-via-workflow", action="store_true",
                    help="uncompressed gradients through the PS/Ring workflow (HiPress Eq. 1; "
                         "engine raw_collective=False) instead of the collective lane")
    ap.add_argument("--from-env", action="store_true",
                    help="this process is one rank (RANK/WORLD_SIZE set, e.g. by run_ns.sh)")
    ap.add_argument("--net", default="loopback",
                    help="loopback, or a tc rate such as 1gbit: the ranks run in network "
                         "namespaces with links of that rate (bench/netem.py; needs root)")
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
    args = (comps, sizes, ks, a.strategy, a.repeats, a.timeout, not a.raw_via_workflow, False,
            a.passes)
    if a.net != "loopback" and not a.from_env:
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.insert(0, here)
        import netem

        argv_ = list(sys.argv[1:] if argv is None else argv) + ["--from-env"]
        netem.up(a.nprocs, a.net)
        try:
            rc = netem.run_in_namespaces(a.nprocs, [sys.executable, os.path.abspath(__file__),
                                                    *argv_],
                                         env={"HIPRESS_BENCH_NET": a.net},
                                         timeout=a.timeout * 20)
        finally:
            netem.down()
        return rc
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
        report["network"] = os.environ.get("HIPRESS_BENCH_NET", "from-env")
    else:
        from hipress_like.launch.launch import run_workers

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
