"""``hipress-profile``: measure costs, plan a model, draw the model against measurements.

Four subcommands (HiPress Sec. 3.3, Table 7, Fig. 14):

    # 1. profile: encode/decode curves per compressor, and the link
    hipress-profile profile --compressors onebit,fp16 --bandwidth 1gbit --latency 50us
    hipress-profile profile --compressors onebit --nprocs 4          # link timed over gloo
    run_ns.sh 4 python -m hipress_like.tuning profile --from-env  # ranks already launched

    # 2. plan: <compress?, K> per gradient, printed like HiPress Table 7
    hipress-profile plan --profile profile.json --model vgg19 --nodes 4 --strategy ps
    hipress-profile plan --profile profile.json --model 4MB,16MB,392MB --nodes 16
    hipress-profile plan --profile profile.json --model torchvision.models:resnet50 --nodes 4

    # 3. report: PNG plots of predicted (and measured) sync time and chosen K
    hipress-profile report --profile profile.json --nodes 4 --measured bench.json

    # 4. advise: predicted step time of every configuration, ranked, with the
    #    DistributedOptimizer(...) line of the fastest (tuning/advise.py)
    hipress-profile advise --profile paper --model vgg19 --nodes 16 --bandwidth 56gbit \
        --latency 10us --compute-time 300ms
    PYTHONPATH=examples hipress-profile advise --profile profile.json \
        --model models:vgg_style --input-shape 8,3,32,32 --nodes 4 --ranks-per-host 4 \
        --write-plan plan.json

Units and ``--model`` are read by ``cli_common.py`` (its docstring lists
them); ``advise`` lives in ``cli_advise.py``. Bad input prints one line
``hipress-profile: error: ...`` and exits with 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..cost_model.model import Link
from ..cost_model.plan import PlanError
from ..cost_model.planner import NEVER, Planner, plan_per_gradient
from ..cost_model.presets import PRESETS
from ..cost_model.profile import Profile, ProfileError, log_sizes
from .cli_advise import cmd_advise
from .cli_common import (
    CLIError,
    format_bytes,
    model_sizes,
    parse_bandwidth,
    parse_bytes,
    parse_seconds,
)

__all__ = ["main", "parse_bytes", "parse_bandwidth", "parse_seconds", "MEASUREMENTS_FORMAT"]

PROG = "hipress-profile"
MEASUREMENTS_FORMAT = "hipress-like-sync-measurements"


# -- argument helpers -------------------------------------------------------
def _compressor_specs(text: str) -> Dict[str, Dict[str, Any]]:
    """``"onebit,topk:ratio=0.01"`` -> {"onebit": {}, "topk": {"ratio": 0.01}}."""
    out: Dict[str, Dict[str, Any]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, *kvs = item.split(":")
        params: Dict[str, Any] = {}
        for kv in kvs:
            k, eq, v = kv.partition("=")
            if not eq or not k:
                raise CLIError(f"compressor parameter {kv!r} must look like key=value "
                               f"(e.g. topk:ratio=0.01)")
            try:
                params[k] = json.loads(v)
            except json.JSONDecodeError:
                params[k] = v
        out[name.strip().lower()] = params
    if not out:
        raise CLIError("no compressor given; e.g. --compressors onebit,fp16")
    return out


def _check_compressors(specs: Dict[str, Dict[str, Any]]) -> None:
    from .. import compressors
    from .profiler import candidate

    for label, params in specs.items():
        try:
            name, params = candidate(label, params)
            compressors.get(name, **params)
        except (ValueError, TypeError) as e:
            raise CLIError(str(e)) from e


def _progress(quiet: bool):
    def wrap(items: Iterable[Any], desc: str, total: int) -> Iterable[Any]:
        from tqdm import tqdm

        return tqdm(items, desc=desc, total=total, file=sys.stderr, disable=quiet,
                    unit="size", leave=True)
    return wrap


def _pick_compressor(profile: Profile, name: Optional[str]) -> str:
    if name:
        profile.compressor(name)  # raises ProfileError naming what exists
        return name
    names = sorted(profile.compressors)
    if len(names) != 1:
        raise CLIError(f"the profile has {len(names)} compressors ({', '.join(names) or 'none'});"
                       " choose one with --compressor")
    return names[0]


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {v}")
    return v


# -- profile ------------------------------------------------------------------
def _profile_worker(ctx: Any, specs: Dict[str, Dict[str, Any]], sizes: List[int],
                    link_sizes: List[int], repeats: int, link: Optional[Tuple[float, float]],
                    quiet: bool, opts: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """One rank of ``profile --nprocs``: the collective profile; rank 0 returns it."""
    prof = _collective_profile(ctx.transport, specs, sizes, link_sizes, repeats, link, quiet,
                               opts)
    return prof.to_dict() if ctx.rank == 0 else None


def _collective_profile(transport, specs, sizes, link_sizes, repeats, link, quiet, opts
                        ) -> Profile:
    from .profiler import profile_transport

    _import_compressors(specs)
    return profile_transport(transport, specs, sizes=sizes, link_sizes=link_sizes,
                             link=Link(*link) if link else None, repeats=repeats,
                             progress=_progress(quiet), **opts)


def _import_compressors(specs: Dict[str, Dict[str, Any]]) -> None:
    """Import compressor modules the package does not import yet (new algorithms)."""
    import importlib

    from .. import compressors
    from .profiler import candidate

    for label, params in specs.items():
        name = candidate(label, params)[0]
        if name not in compressors.available():
            try:
                importlib.import_module(f"{compressors.__name__}.{name}")
            except ImportError:
                pass


def _engine_opts(a: argparse.Namespace, ef: Any) -> Dict[str, Any]:
    """How to time rounds and overheads as the CaSync engine runs them."""
    opts: Dict[str, Any] = {"error_feedback": ef}
    if a.engine:
        from ..casync.coordinator import report_len
        from ..casync.engine import EngineConfig

        opts["round_meta_bytes"] = 8 * report_len(EngineConfig().report_capacity)
        opts["engine_overhead"] = ("ps", "ring") if a.strategy == "both" else a.strategy
    return opts


def _cmd_profile(a: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(a.threads)
    specs = _compressor_specs(a.compressors)
    _import_compressors(specs)
    _check_compressors(specs)
    lo, hi = parse_bytes(a.min_size), parse_bytes(a.max_size)
    if lo > hi:
        raise CLIError(f"--min-size {a.min_size} is larger than --max-size {a.max_size}")
    sizes = log_sizes(max(4, lo), hi, a.per_octave)
    link_sizes = log_sizes(4096, max(8192, parse_bytes(a.link_max_size)), 0.5)
    given = None
    if (a.bandwidth is None) != (a.latency is None):
        raise CLIError("give both --bandwidth and --latency (or neither, to measure the link)")
    if a.bandwidth is not None:
        given = (parse_seconds(a.latency), parse_bandwidth(a.bandwidth))
    ef = {"auto": "auto", "on": True, "off": False}[a.error_feedback]
    if a.nprocs and a.from_env:
        raise CLIError("--nprocs and --from-env exclude each other")
    if a.nprocs:
        from ..launch.launch import run_workers

        res = run_workers(_profile_worker, a.nprocs, a.backend,
                          args=(specs, sizes, link_sizes, a.repeats, given, a.quiet,
                                _engine_opts(a, ef)),
                          timeout=a.timeout)
        prof = Profile.from_dict(res[0])
    elif a.from_env:
        prof = _profile_from_env(specs, sizes, link_sizes, a.repeats, given, a.quiet,
                                 _engine_opts(a, ef))
        if prof is None:  # not rank 0: rank 0 writes the file
            return 0
    else:
        if given is None:
            raise CLIError("the link is unknown: give --bandwidth and --latency, or measure it "
                           "with --nprocs N (or --from-env under a launcher)")
        from .profiler import candidate, profile_compressor

        comps = {n: profile_compressor(*candidate(n, p), sizes, repeats=a.repeats,
                                       error_feedback=ef, progress=_progress(a.quiet))
                 for n, p in specs.items()}
        prof = Profile(link=Link(*given), compressors=comps,
                       meta={"ranks": 1, "link_source": "given"})
    prof.save(a.output)
    lk = prof.link
    print(f"link: {lk.latency * 1e6:.1f} us + bytes / {lk.bandwidth * 8 / 1e9:.3f} Gbit/s "
          f"({prof.meta.get('link_source', 'given')}, all links busy)")
    if prof.link_one is not None:
        print(f"one link: {prof.link_one.latency * 1e6:.1f} us + bytes / "
              f"{prof.link_one.bandwidth * 8 / 1e9:.3f} Gbit/s")
    if prof.sync_overhead:
        print(f"engine overhead per synchronisation: {prof.sync_overhead * 1e3:.2f} ms")
    if prof.lane is not None:
        print(f"engine lane (uncompressed): {prof.lane.latency * 1e6:.1f} us + bytes / "
              f"{prof.lane.bandwidth * 8 / 1e9:.3f} Gbit/s")
    for name, c in sorted(prof.compressors.items()):
        tag = " with error feedback" if c.error_feedback else ""
        print(f"{name}{tag}: {c.category}, r = {c.ratio:.4g} (+{c.header_bytes} B header), "
              f"encode {format_bytes(c.encode.sizes[-1])} in {c.encode.times[-1] * 1e3:.2f} ms")
        if c.engine_samples and isinstance(prof.meta.get("ranks"), int):
            from ..cost_model.planner import Planner

            for st in ("ps", "ring"):
                t = Planner(prof, name, prof.meta["ranks"], st).engine_term
                if t is not None:
                    print(f"  engine beyond Eq. 2 ({st}): {t.describe()}")
    print(f"wrote {a.output}")
    return 0


def _profile_from_env(specs, sizes, link_sizes, repeats, given, quiet, opts
                      ) -> Optional[Profile]:
    import torch.distributed as dist

    from ..casync.transport.torch_dist import TorchDistTransport

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise CLIError("--from-env needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                       "(set by torchrun or run_ns.sh)")
    dist.init_process_group("gloo")
    try:
        t = TorchDistTransport()
        prof = _collective_profile(t, specs, sizes, link_sizes, repeats, given, quiet, opts)
        rank = t.rank
        t.barrier()
        t.close()
    finally:
        dist.destroy_process_group()
    return prof if rank == 0 else None


# -- plan ---------------------------------------------------------------------
def _cmd_plan(a: argparse.Namespace) -> int:
    prof = Profile.load(a.profile)
    if a.compressor == "all":
        names = sorted(prof.compressors)
    elif a.compressor and "," in a.compressor:
        names = [_pick_compressor(prof, c) for c in a.compressor.split(",") if c]
    else:
        names = [_pick_compressor(prof, a.compressor)]
    sizes = model_sizes(a.model, a.scale)
    back = _pick_compressor(prof, a.back) if a.back else None
    planners = [Planner(prof, c, a.nodes, a.strategy, max_partitions=a.max_partitions,
                        raw_collective=not a.raw_via_workflow, back=back) for c in names]
    meta = {"model": a.model, "profile": os.fspath(a.profile), "scale": a.scale}
    plan = (planners[0].plan(sizes, meta=meta) if len(planners) == 1
            else plan_per_gradient(planners, sizes, meta=meta))
    p = planners[0].params
    print(f"plan: {', '.join(names)} on CaSync-{a.strategy.upper()} "
          f"({planners[0].model_strategy}: alpha={p.alpha}, beta={p.beta}, gamma={p.gamma}; "
          f"{p.source}), N={a.nodes}, {len(sizes)} gradients, "
          f"{format_bytes(sum(s for _, s in sizes))}")
    by_name = {pl.cp.name: pl for pl in planners}
    per_gradient = len(sizes) <= a.list_limit
    # HiPress Table 7's <compress?, K>, with the compressor in place of "yes"
    print(f"{'gradient' if per_gradient else 'gradient size':<28} {'count':>6}  "
          f"{'<compress, K>':<18}{'T_orig ms':>11}{'T_plan ms':>11}{'speedup':>9}")
    groups: Dict[Any, List[str]] = {}
    for name, s in sizes:
        key = name if per_gradient else s
        groups.setdefault(key, []).append(name)
    for key, members in groups.items():
        nbytes = dict(sizes)[members[0]]
        dec = plan.decide(members[0], nbytes, a.nodes)
        comp = plan.compressor_of(dec)[0] if dec.compress else "none"
        c = (by_name.get(comp) or planners[0]).choose(nbytes)
        t = c.t_cpr if dec.compress else c.t_orig
        label = key if per_gradient else format_bytes(nbytes)
        if dec.compress and dec.compressor_back:
            comp = f"{comp}/{dec.compressor_back}"
        if dec.collective:  # a top-k gradient's selected collective (Eq. 5a-5c)
            comp = f"{comp}@{dec.collective}"
        tup = f"<{comp if dec.compress else 'no'}, {dec.partitions}>"
        print(f"{str(label)[:28]:<28} {len(members):>6}  {tup:<18}"
              f"{c.t_orig * 1e3:>11.3f}{t * 1e3:>11.3f}{c.t_orig / t if t else 1:>8.2f}x")
    r = plan.rule
    thr = "never" if r.min_compress_bytes >= NEVER else f">= {format_bytes(r.min_compress_bytes)}"
    print(f"gradients the plan does not name: {plan.compressor} {thr}, one partition per "
          f"{format_bytes(r.bytes_per_partition)}, at most {r.max_partitions}")
    picks = plan.meta.get("collectives")
    if picks:
        counts = {w: sum(1 for v in picks.values() if v == w) for w in sorted(set(picks.values()))}
        print("top-k gradients by the selected collective (flexible-communication paper, Eq. "
              "5a-5c on the profile's links): "
              + ", ".join(f"{w} {c}" for w, c in counts.items()))
    tot = plan.meta["predicted_total_s"]
    others = ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.1f} ms" for k, v in tot.items()
                       if k != "plan")
    print(f"predicted sync time per iteration (no overlap): {tot['plan'] * 1e3:.1f} ms "
          f"({others})")
    plan.save(a.output)
    print(f"wrote {a.output}")
    return 0


# -- report -------------------------------------------------------------------
def load_measurements(path: str) -> Dict[str, Any]:
    """Read a measurements file written by ``bench/cost_model.py``.

    Format: ``{"format": "hipress-like-sync-measurements", "version": 1,
    "nodes": N, "strategy": "ps", "compressor": "onebit", "rows": [{"nbytes":
    int, "compress": bool, "partitions": K, "measured_s": float}, ...]}``.

    Raises:
        CLIError: unreadable or invalid file.
    """
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CLIError(f"cannot read measurements {path!r}: {e}") from e
    if not isinstance(d, dict) or d.get("format") != MEASUREMENTS_FORMAT or d.get("version") != 1:
        raise CLIError(f"{path}: not a version-1 {MEASUREMENTS_FORMAT!r} file")
    rows = d.get("rows")
    need = {"nbytes", "compress", "partitions", "measured_s"}
    if not isinstance(rows, list) or not all(isinstance(r, dict) and need <= set(r)
                                             for r in rows):
        raise CLIError(f"{path}: 'rows' must be a list of objects with keys {sorted(need)}")
    return d


def _save(plt, fig, ax, path: str) -> str:
    """Grid, legend, tight layout, then ``path`` (PNG, 120 dpi); returns ``path``."""
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cmd_report(a: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prof = Profile.load(a.profile)
    meas = load_measurements(a.measured) if a.measured else None
    if meas and a.nodes != meas.get("nodes", a.nodes):
        raise CLIError(f"--nodes {a.nodes} differs from the measurements' nodes "
                       f"{meas.get('nodes')}")
    name = _pick_compressor(prof, a.compressor or (meas or {}).get("compressor"))
    planner = Planner(prof, name, a.nodes, a.strategy, max_partitions=a.max_partitions,
                      raw_collective=not a.raw_via_workflow)
    lo, hi = parse_bytes(a.min_size), parse_bytes(a.max_size)
    if lo > hi:
        raise CLIError(f"--min-size {a.min_size} is larger than --max-size {a.max_size}")
    sizes = [1 << e for e in range(max(2, math.ceil(math.log2(lo))), int(math.log2(hi)) + 1)]
    if not sizes:
        raise CLIError("no power-of-two size between --min-size and --max-size")
    choices = planner.table(sizes)
    os.makedirs(a.out_dir, exist_ok=True)
    xs = [s / 2**20 for s in sizes]
    title = f"{name}, CaSync-{a.strategy.upper()}, N={a.nodes}"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [planner.t_orig(s, 1) * 1e3 for s in sizes], "b-",
            label="predicted, no compression, K=1")
    ax.plot(xs, [planner.t_cpr(s, 1) * 1e3 for s in sizes], "r-",
            label=f"predicted, {name}, K=1")
    ax.plot(xs, [c.time * 1e3 for c in choices], "k--", label="predicted, plan's <compress?, K>")
    errors = []
    if meas:
        for compress, colour in ((False, "b"), (True, "r")):
            pts = [(r["nbytes"], r["measured_s"]) for r in meas["rows"]
                   if bool(r["compress"]) == compress and int(r["partitions"]) == 1]
            if pts:
                ax.plot([p / 2**20 for p, _ in pts], [t * 1e3 for _, t in pts], colour + "o",
                        label=f"measured, {'compressed' if compress else 'uncompressed'}, K=1")
        for r in meas["rows"]:
            f = planner.t_cpr if r["compress"] else planner.t_orig
            errors.append(abs(f(r["nbytes"], int(r["partitions"])) / r["measured_s"] - 1))
    ax.set(xscale="log", yscale="log", xlabel="gradient size (MB)",
           ylabel="synchronisation time (ms)", title=f"Predicted vs measured sync time: {title}")
    p1 = _save(plt, fig, ax, os.path.join(a.out_dir, "sync_time.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [c.k_cpr for c in choices], "rs-", label="model: best K with compression")
    if meas:
        best = _measured_best_k(meas["rows"])
        if best:
            ax.plot([s / 2**20 for s in best], list(best.values()), "ko",
                    label="measured: best K with compression")
    ax.set(xscale="log", xlabel="gradient size (MB)", ylabel="partitions K",
           title=f"Chosen number of partitions: {title}")
    p2 = _save(plt, fig, ax, os.path.join(a.out_dir, "partitions.png"))
    print(f"wrote {p1}")
    print(f"wrote {p2}")
    if errors:
        print(f"median |predicted/measured - 1| over {len(errors)} measurements: "
              f"{statistics.median(errors) * 100:.1f}%")
    return 0


def _measured_best_k(rows: Sequence[Dict[str, Any]]) -> Dict[int, int]:
    best: Dict[int, Tuple[float, int]] = {}
    for r in rows:
        if r["compress"]:
            s, t, k = int(r["nbytes"]), float(r["measured_s"]), int(r["partitions"])
            if s not in best or t < best[s][0]:
                best[s] = (t, k)
    return {s: k for s, (_, k) in sorted(best.items())}


# -- advise -------------------------------------------------------------------------------
# -- entry point ----------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``hipress-profile``."""
    ap = _Parser(prog=PROG, description="HiPress-style cost model: profile "
                                 "compressors and links, plan <compress?, K> per gradient, "
                                 "report predictions against measurements, and advise "
                                 "which configuration to train with.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="measure encode/decode curves and the link")
    p.add_argument("--compressors", default="onebit",
                   help="comma-separated names, parameters as name:key=value (default onebit); "
                        "a label naming its compressor profiles one compressor twice: "
                        "topk:ratio=0.01,topk-bloom:compressor=topk:ratio=0.01:index_codec=bloom")
    p.add_argument("--min-size", default="4KB", help="smallest gradient (default 4KB)")
    p.add_argument("--max-size", default="256MB", help="largest gradient (default 256MB; "
                   "sizes that do not fit in memory are skipped)")
    p.add_argument("--per-octave", type=float, default=0.5,
                   help="sizes per doubling (default 0.5: every factor of 4)")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed calls per size")
    p.add_argument("--bandwidth", help="given link bandwidth, e.g. 1gbit, 125MB/s")
    p.add_argument("--latency", help="given link latency, e.g. 50us")
    p.add_argument("--nprocs", type=_positive_int, help="measure over this many local ranks")
    p.add_argument("--backend", default="gloo", choices=("gloo", "mpi"))
    p.add_argument("--from-env", action="store_true",
                   help="this process is one rank of a launched job (torchrun, run_ns.sh)")
    p.add_argument("--link-max-size", default="16MB", help="largest message timed on the link")
    p.add_argument("--strategy", default="both", choices=("ps", "ring", "both"),
                   help="strategies whose engine synchronisations are timed (with --nprocs/"
                   "--from-env); the advisor ranks both, so both by default")
    p.add_argument("--no-engine", dest="engine", action="store_false",
                   help="time bare links (no coordinator metadata, no engine overhead): "
                   "HiPress's Eq. 1/2 exactly")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for --nprocs runs")
    p.add_argument("--error-feedback", choices=("auto", "on", "off"), default="auto",
                   help="time compressors inside error feedback: auto = as the engine runs "
                   "them (biased single-round compressors are wrapped)")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="torch threads while timing (default 1, as launched ranks run)")
    p.add_argument("-o", "--output", default="profile.json")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("plan", help="plan <compress?, K> per gradient of a model")
    p.add_argument("--profile", required=True, help="profile.json from 'profile'")
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(sorted(PRESETS))}), "
                   "sizes like 4MB,16MB, a JSON file, or package.module:attr (a torch module)")
    p.add_argument("--nodes", "-N", type=_positive_int, required=True, help="number of nodes N")
    p.add_argument("--strategy", default="ps", choices=("ps", "ring"))
    p.add_argument("--compressor", help="compressor in the profile (default: the only one); "
                   "a comma-separated list, or 'all', chooses one per gradient (or none)")
    p.add_argument("--back", help="a master compressor in the profile that encodes each "
                   "aggregate on its way back (bidirectional compression); priced in both "
                   "directions and named in the plan's entries")
    p.add_argument("--max-partitions", type=_positive_int, help="largest K (default 4N)")
    p.add_argument("--list-limit", type=_positive_int, default=60,
                   help="list each gradient by name up to this many (else by size)")
    p.add_argument("--raw-via-workflow", action="store_true",
                   help="model uncompressed gradients as HiPress Eq. 1 (the engine's "
                        "raw_collective=False) instead of a ring allreduce")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every gradient size")
    p.add_argument("-o", "--output", default="plan.json")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("report", help="plot predicted (and measured) sync time and K per size")
    p.add_argument("--profile", required=True)
    p.add_argument("--nodes", "-N", type=_positive_int, required=True)
    p.add_argument("--strategy", default="ps", choices=("ps", "ring"))
    p.add_argument("--compressor")
    p.add_argument("--measured", help="measurements JSON from bench/cost_model.py")
    p.add_argument("--max-partitions", type=_positive_int)
    p.add_argument("--raw-via-workflow", action="store_true",
                   help="uncompressed as HiPress Eq. 1 (engine raw_collective=False)")
    p.add_argument("--min-size", default="32KB")
    p.add_argument("--max-size", default="128MB")
    p.add_argument("--out-dir", default=".")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("advise", help="predict and rank the step time of every configuration")
    p.add_argument("--profile", required=True,
                   help="profile.json from 'profile', or 'paper' (HiPress's published values; "
                        "needs --bandwidth and --latency)")
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(sorted(PRESETS))}), "
                   "sizes like 4MB,16MB, a JSON file, or package.module:attr (a torch module: "
                   "its backward is timed)")
    p.add_argument("--nodes", "-N", type=_positive_int, required=True, help="number of nodes N")
    p.add_argument("--bandwidth", help="link rate, e.g. 1gbit (default: the profile's)")
    p.add_argument("--latency", help="link latency, e.g. 50us (default: the profile's)")
    p.add_argument("--compressors", help="compressors to predict alone (default: all profiled)")
    p.add_argument("--candidates", help="compressors the per-gradient plan chooses from "
                   "(default: --compressors)")
    p.add_argument("--strategies", default="ps,ring", help="default ps,ring")
    p.add_argument("--compressor-plans", choices=("model", "rule"), default="model",
                   help="each compressor with the cost model's plan for it (model, default) or "
                   "the engine's size rule (rule: plan=None)")
    p.add_argument("--compute-time", help="forward+backward seconds per step of one rank "
                   "(e.g. 120ms); default: timed on the torch module, else 0")
    p.add_argument("--input-shape", help="the module's input, batch first (e.g. 8,3,32,32); "
                   "default: guessed from its first layer with --batch")
    p.add_argument("--batch", type=_positive_int, default=32, help="batch for a guessed input")
    p.add_argument("--ranks-per-host", type=_positive_int, default=1,
                   help="ranks sharing this host's cores in training (the backward is timed "
                   "with that many copies running)")
    p.add_argument("--cores-per-rank", type=float, help="cores each rank may use (default: "
                   "this host's cores / --ranks-per-host; 2 with --profile paper): below 2, "
                   "backward and compression slow each other")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed steps of the module")
    p.add_argument("--max-partitions", type=_positive_int, help="largest K (default 4N)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every gradient size")
    p.add_argument("--write-plan", metavar="PATH", help="write the recommended plan")
    p.set_defaults(func=cmd_advise)

    p = sub.add_parser("compll", help="check|build|show a CompLL program (.compll)",
                       add_help=False)  # the compll module parses its own options (-h too)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: __import__("hipress_like.compressors.compll.cli",
                                             fromlist=["main"]).main(a.rest, f"{PROG} compll"))
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit code (2 on bad input, with a one-line message)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "scale", 1.0) <= 0:
        return _fail("--scale must be > 0")
    try:
        return args.func(args)
    except (CLIError, PlanError, ProfileError, ValueError, OSError, ImportError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        return _fail("interrupted")


def _fail(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
