"""Synchronisation time of CaSync vs. DDP-style bucketed all_reduce, same run.

Two gradient lists shaped like HiPress Table 6 (``hipress_like.cost_model.presets``):
ResNet50-like (~97 MB in 155 gradients, mostly small) and VGG19-like
(dominated by one very large fully-connected gradient, scaled to fit memory).
For each: torch.distributed ``all_reduce`` over 25 MB buckets in reverse
order (what DDP does), then the engine with PS and Ring x {identity
(uncompressed), onebit, TernGrad, DGC, PowerSGD, natural, THC, top-k
1% with plain and with Bloom-coded indices}, and the coordinator off
for comparison. Uncompressed bytes take the engine's collective lane (fused
allreduce) by default; "(raw via workflow)" rows send them through the
PS/Ring workflow instead. Every figure is a median over repetitions of the slowest
rank's time, printed as a ratio to the all_reduce of the same list timed
in alternation with it (baseline, engine, baseline, ... so the load of a
shared machine drifts over both alike), on loopback and on emulated
1 Gbit/s links (network namespaces shaped with ``tc tbf``;
``bench/netem.py``; needs root).

    python bench/sync.py                       # loopback and 1gbit, all configs
    python bench/sync.py --nets loopback --quick
    python bench/sync.py --out results/sync.json
    python bench/sync.py --nprocs 2,4,8 --reps 3      # scaling (issue 50), see below

Scaling (issue 50, item 4; ``--nprocs`` with several world sizes, or
``--scaling``): for each N, the VGG-style model's gradient list
(``examples/models.py``'s ``vgg``, 106 MB, the model of bench/train.py) over
emulated 1 Gbit/s links, DDP-style bucketed allreduce and PS / Ring x {onebit,
PowerSGD}, each beside the cost model's predicted time (``predict_sync``:
HiPress Eq. 1-2 per gradient with the engine's default plan, Table I's ring
allreduce for the uncompressed bytes, encode and decode times measured on one
thread in this process). Two predictions: with a core per rank (HiPress's
assumption) and with the host's cores shared by the N ranks (compression times
x N / cores once N exceeds them), the second being where this machine's two
cores, not the algorithm, bend the curve. Beside Eq. 2, every row is priced by
the library's own step model (``tuning/step_model.py``, as the advisor and
``plan="auto"`` price plans) from the profile ``plan="auto"`` measures, taken
by the N ranks at the start of the run (``_profile_in_run``; ``--no-profile``
skips it): the engine's and transport's CPU per synchronisation, which Eq. 2
leaves out, is in it, and its host bound shares the host's cores among the N
ranks. Prints each model's median error per N (the goal is judged on the step
model), writes JSON and a plot of sync time vs N (``<out stem>_scaling.png``).
The link each N is priced on is measured in the same run (``measure_link``:
every rank sending to its ring successor at once), not the tc rate's nominal
one; each row also has the slowest rank's CPU seconds per call and
``max(1, N / cores)`` times it (``cpu_bound_s``): where that meets the measured time, the
host's cores set the sync time, not the link or the algorithm.

Goals (issue 3): engine overhead (identity vs all_reduce, loopback) <= 1.15x;
at 1 Gbit/s CaSync-PS + onebit <= 0.15x of all_reduce on the VGG-like list;
with the coordinator on, the ResNet50-like list synchronises faster than off.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)  # bound.py, netem.py, _figures.py

COMPRESSORS = {
    "identity": ("identity", {}),
    "onebit": ("onebit", {}),
    "terngrad": ("terngrad", {"bitwidth": 2}),
    "dgc": ("dgc", {"ratio": 0.001}),
    "powersgd": ("powersgd", {"rank": 4}),
    "natural": ("natural", {}),  # C_nat workers; the aggregate re-encoded by C_nat
    "natural2": ("natural", {}),  # C_nat both ways (Natural Compression Alg. 1)
    "thc": ("thc", {}),  # 4 bits, T_{4,30,1/32}, the transform; sums merge as integers
    # THC without the randomized Hadamard transform: the global [min, max] range, unbiased
    # (no error feedback, so no second decode), the same table and integer sums
    "thc_plain": ("thc", {"transform": False}),
    # issue 25: top-k 1% with plain indices against fp-aware Bloom-coded ones (eps 0.01)
    "topk": ("topk", {"ratio": 0.01}),
    "topk_bloom": ("topk", {"ratio": 0.01, "index_codec": "bloom", "eps": 0.01}),
    # issue 24: top-k 1% by the Allgather of values and indices (LWTopk) against AR-Topk
    # (STAR-Topk) by the PS rounds, a ring, a tree, and the alpha-beta selector's pick
    "star_topk": ("star_topk", {"ratio": 0.01}),
    "topk_ag": ("topk", {"ratio": 0.01}),
    "star_ring": ("star_topk", {"ratio": 0.01}),
    "star_tree": ("star_topk", {"ratio": 0.01}),
    "star_select": ("star_topk", {"ratio": 0.01}),
}
# configurations whose payloads travel by a named collective (EngineConfig.collective):
# strategy-independent, so they run once, as "ps+<name>"
NAMED = {"topk_ag": "allgather", "star_ring": "ring", "star_tree": "tree",
         "star_select": "auto"}
# configurations whose aggregates go back by a master compressor (compression_back)
BACK = {"natural2": ("natural", {})}
LISTS = {"resnet50": ("resnet50", 1.0), "vgg19": ("vgg19", 0.25),
         "vggstyle": ("vggstyle", 1.0)}  # bench/train.py's VGG-style model (examples/models.py)
# the scaling run's defaults (issue 50, item 4)
SCALING_ONLY = ("ps+onebit", "ring+onebit", "ps+powersgd", "ring+powersgd")
ALLREDUCE = "allreduce (DDP buckets 25MB)"
# the scaling run's link measurement: 16 KB (latency) to 16 MB (bandwidth-bound)
LINK_SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def list_shapes(lname: str):
    """(gradient name, shape) of a list: the VGG-style model's parameters, or a preset's
    sizes as flat float32 vectors."""
    if lname == "vggstyle":
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
        from models import MODELS

        net = MODELS["vgg"](num_classes=10, in_channels=1)
        return [(n, tuple(p.shape)) for n, p in net.named_parameters()]
    from hipress_like.cost_model.presets import preset

    pname, scale = LISTS[lname]
    return [(n, (max(1, nb // 4),)) for n, nb in preset(pname, scale)]


def _registered(name: str) -> bool:
    from hipress_like import compressors
    return name in compressors.available()


def _configs(quick: bool):
    comps = ["identity", "onebit"] if quick else list(COMPRESSORS)
    comps = [c for c in comps if _registered(COMPRESSORS[c][0])]
    out = []
    for strategy in ("ps", "ring"):
        for c in comps:
            if strategy == "ps" or c not in NAMED:
                out.append({"strategy": strategy, "comp": c, "coordinator": True})
    for c in ("identity", "onebit"):
        if c in comps:
            out.append({"strategy": "ps", "comp": c, "coordinator": False})
    if "identity" in comps:  # the uncompressed bytes through PS/Ring instead of allreduce
        for strategy in ("ps", "ring"):
            out.append({"strategy": strategy, "comp": "identity", "coordinator": True,
                        "raw_collective": False})
    return out


# --------------------------------------------------------------------------- worker
def _bucketed_allreduce(dist, grads, names, cap=25 << 20):
    """DDP's algorithm: buckets of ~25 MB in reverse order, flatten, all_reduce, average."""
    import torch

    def flush(b):
        if not b:
            return
        flat = torch.cat([grads[n].view(-1) for n in b])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        off = 0
        for n in b:
            k = grads[n].numel()
            grads[n].view(-1).copy_(flat[off: off + k])
            off += k

    bucket, size = [], 0
    for n in reversed(names):
        bucket.append(n)
        size += grads[n].numel() * 4
        if size >= cap:
            flush(bucket)
            bucket, size = [], 0
    flush(bucket)


def worker(args) -> None:
    """One rank: time every configuration on every list; rank 0 writes JSON."""
    import torch
    import torch.distributed as dist

    from hipress_like.casync.engine import Engine, EngineConfig
    from hipress_like.casync.transport.torch_dist import TorchDistTransport
    from hipress_like.cost_model.plan import Plan, SizeRule

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tr = TorchDistTransport()
    results = []

    def log(msg):
        if rank == 0:
            print(f"[{args.net}] {msg}", file=sys.stderr, flush=True)

    def once(fn):
        """(wall, CPU) seconds of one call, each the slowest rank's."""
        restore()  # outside the timing: every call starts from the same gradients
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0],
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time and CPU
        return t[0].item(), t[1].item()

    def timed(fn, reps):
        """(median wall, every wall, median CPU) of ``reps`` calls."""
        fn()  # warm-up: compilation, first-touch allocations, state init
        calls = [once(fn) for _ in range(reps)]
        return (statistics.median(w for w, _ in calls), [w for w, _ in calls],
                statistics.median(c for _, c in calls))

    def timed_pair(base_fn, fn, reps):
        """Alternate baseline and candidate repetitions, so drifting machine load
        (these machines are shared) weighs on both medians alike: (median wall, every
        wall, the baseline's median wall, median CPU) of the candidate."""
        fn()
        fn()  # warm-up twice: compilation, first-touch allocations, state init
        bs, calls = [], []
        for _ in range(reps):
            bs.append(once(base_fn)[0])
            calls.append(once(fn))
        return (statistics.median(w for w, _ in calls), [w for w, _ in calls],
                statistics.median(bs), statistics.median(c for _, c in calls))

    measured, model_profile = None, None
    if args.scaling and args.profile:  # the library's own model (add_predictions)
        prof = _profile_in_run(tr, args, log)
        model_profile = prof.to_dict()
        link, samples = prof.link, prof.link_samples
    elif args.scaling:  # the link as the N ranks get it, for Eq. 2 alone (add_predictions)
        from hipress_like.tuning.link import measure_link

        link, samples = measure_link(tr, sizes=LINK_SIZES, repeats=3, pattern="all")
    if args.scaling:
        measured = {"latency": link.latency, "bandwidth": link.bandwidth,
                    "samples": [list(x) for x in samples]}
        log(f"measured link (every rank to its ring successor at once): "
            f"{link.latency * 1e3:.3f} ms + {8e-9 * link.bandwidth:.3f} Gbit/s")

    for lname in args.lists:
        gen = torch.Generator().manual_seed(rank)
        pristine = {name: torch.randn(shape, generator=gen) for name, shape in list_shapes(lname)}
        # Every call (engine or baseline) averages or sums in place; without a restore
        # the next configuration would compress the previous one's averages (top-k
        # of a 99%-zero tensor is all ties, and took 2-5x as long) or sums grown by
        # N per call.
        grads = {name: v.clone() for name, v in pristine.items()}

        def restore(grads=grads, pristine=pristine):
            for k, v in pristine.items():
                grads[k].copy_(v)
        names = list(grads)
        total = sum(v.numel() * 4 for v in grads.values())
        log(f"{lname}: {len(names)} gradients, {total / 2**20:.1f} MB")
        med, ts, cpu_s = timed(lambda g=grads, ns=names: _bucketed_allreduce(dist, g, ns),
                               args.reps)
        results.append({"list": lname, "config": ALLREDUCE, "seconds": med, "all": ts,
                        "ratio": 1.0, "cpu_s": cpu_s, "measured_link": measured})
        log(f"  allreduce: {med * 1e3:.1f} ms")
        for cfg in _configs(args.quick):
            if args.only and f"{cfg['strategy']}+{cfg['comp']}" not in args.only:
                continue
            if args.scaling and not (cfg["coordinator"] and cfg.get("raw_collective", True)):
                continue  # the scaling rows: the engine as it runs by default
            comp, params = COMPRESSORS[cfg["comp"]]
            # identity = the uncompressed path through the engine (raw bytes)
            rule = SizeRule(min_compress_bytes=1 << 62) if comp == "identity" else SizeRule()
            plan = Plan(compressor=comp, params=params, strategy=cfg["strategy"], rule=rule)
            back, back_params = BACK.get(cfg["comp"], (None, {}))
            eng = Engine(tr, EngineConfig(compressor=None, plan=plan, strategy=cfg["strategy"],
                                          compressor_back=back, params_back=back_params,
                                          coordinator=cfg["coordinator"], timeout=300,
                                          raw_collective=cfg.get("raw_collective", True),
                                          collective=NAMED.get(cfg["comp"]),
                                          **json.loads(args.engine)))
            try:
                eng.register([(k, tuple(v.shape), v.dtype) for k, v in grads.items()])
                colls = sorted(set(eng.collectives.values()))

                def step(eng=eng, names=names, grads=grads):
                    for k in reversed(names):  # backward order
                        eng.submit(k, grads[k])
                    eng.synchronize()
                med, ts, pair_base, cpu_s = timed_pair(
                    lambda g=grads, ns=names: _bucketed_allreduce(dist, g, ns), step, args.reps)
                rounds = sum(1 for e in eng.timeline.events
                             if e.kind == "round" and e.step == eng.step - 1)
                buckets = sum(1 for e in eng.timeline.events
                              if e.kind == "bucket" and e.step == eng.step - 1)
            finally:
                eng.close()
            label = (f"{cfg['strategy']}+{cfg['comp']}"
                     + ("" if cfg["coordinator"] else " (coordinator off)")
                     + (" (raw via workflow)" if cfg.get("raw_collective") is False else ""))
            results.append({"list": lname, "config": label, "seconds": med, "all": ts,
                            "ratio": med / pair_base, "allreduce_interleaved_s": pair_base,
                            "rounds_last_step": rounds,
                            "collectives": colls,
                            "buckets_last_step": buckets,
                            "cpu_s": cpu_s,
                            "measured_link": measured, **cfg})
            log(f"  {label}: {med * 1e3:.1f} ms ({med / pair_base:.3f}x of {pair_base * 1e3:.1f} "
                f"ms interleaved), {rounds} rounds, "
                f"{buckets} fused allreduces")
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"rows": results, "profile": model_profile}, f)
    tr.close()
    dist.barrier()
    dist.destroy_process_group()


def _profile_in_run(tr, args, log):
    """The profile ``plan="auto"`` would measure for these ranks, measured here. Collective.

    ``profiler.profile_transport`` over the ranks' own links: the link (all links
    at once, one link, the allreduce), the engine's fixed cost, its uncompressed
    lane (time and CPU seconds per synchronisation), and each scaling
    compressor's curves and whole engine synchronisations under PS and Ring
    (time and CPU seconds; the grid of ``tuning/auto.py``), with the engine
    configured as the rows run it. ``add_predictions`` prices every row from it
    with the step model the advisor and ``plan="auto"`` use.
    """
    import inspect

    from hipress_like.cost_model.profile import log_sizes
    from hipress_like.tuning.auto import AutoPlanner
    from hipress_like.tuning.engine_timing import top_points
    from hipress_like.tuning.profiler import profile_transport

    cap = inspect.signature(AutoPlanner).parameters["max_profile_bytes"].default
    big = max(4 * math.prod(shape) for lname in args.lists for _, shape in list_shapes(lname))
    sizes = log_sizes(4096, max(4096, min(big, cap)), 0.5)  # as AutoPlanner.plan sizes them
    labels = [c.split("+", 1)[1] for c in args.only]  # "ps+onebit" -> "onebit"
    comps = {c: dict(COMPRESSORS[c][1], compressor=COMPRESSORS[c][0]) for c in labels
             if c in COMPRESSORS and c != "identity"}
    t0 = time.perf_counter()
    log(f"profiling {', '.join(comps)} under PS and Ring (the profile plan='auto' measures)")
    prof = profile_transport(tr, comps, sizes=sizes, link_sizes=LINK_SIZES, repeats=3,
                             timeout=300, engine_overhead=("ps", "ring"),
                             engine_grid=top_points(sizes[-1], tr.size), **_engine_extra(args))
    log(f"profiled in {time.perf_counter() - t0:.0f} s")
    return prof


def _engine_extra(args):
    """``profile_transport``'s engine settings (``raw_collective``, ``nonfinite``) as the
    rows run: ``EngineConfig``'s defaults, overridden by ``--engine``."""
    from hipress_like.casync.engine import EngineConfig

    cfg = EngineConfig(**json.loads(args.engine))
    return {"raw_collective": cfg.raw_collective, "nonfinite": cfg.nonfinite}


# --------------------------------------------------------------------------- parent
def _run_loopback(argv, n, timeout):
    from hipress_like.launch.launch import free_port
    port = str(free_port())
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(argv, env=env))
    rc = [p.wait(timeout=timeout) for p in procs]
    if any(rc):
        raise SystemExit(f"loopback workers failed with exit codes {rc}")


def _run_netem(argv, n, rate, timeout):
    sys.path.insert(0, HERE)
    import netem
    netem.up(n, rate)
    try:
        rc = netem.run_in_namespaces(n, argv, env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
        if rc:
            raise SystemExit(f"namespace workers failed (exit code {rc})")
    finally:
        netem.down()


def _goals(rows):
    def get(net, lst, cfg):
        for r in rows:
            if r["net"] == net and r["list"] == lst and r["config"] == cfg:
                return r["ratio"]
        return None
    out = []
    for lst in ("resnet50", "vgg19"):
        v = get("loopback", lst, "ps+identity")
        if v is not None:
            out.append((f"engine overhead, loopback, {lst}: ps+identity / allreduce", v,
                        "<= 1.15", v <= 1.15))
    v = get("1gbit", "vgg19", "ps+onebit")
    if v is not None:
        out.append(("1 Gbit/s, vgg19: ps+onebit / allreduce", v, "<= 0.15", v <= 0.15))
    thc, one = get("1gbit", "vgg19", "ps+thc"), get("1gbit", "vgg19", "ps+onebit")
    if thc is not None and one is not None:  # THC issue: within 1.2x of PS + onebit
        out.append(("1 Gbit/s, vgg19: ps+thc / ps+onebit", thc / one, "<= 1.2",
                    thc / one <= 1.2))
    ag = get("1gbit", "vgg19", "ps+topk_ag")  # issue 24: AR-Topk against Allgather top-k
    for c in ("star_topk", "star_ring", "star_tree", "star_select"):
        v = get("1gbit", "vgg19", f"ps+{c}")
        if ag is not None and v is not None:
            out.append((f"1 Gbit/s, vgg19: ps+{c} / ps+topk_ag (CR 0.01)", v / ag, "report",
                        True))
    nat = get("1gbit", "vgg19", "ps+natural2")
    for other in ("onebit", "terngrad"):  # reported, no goal: C_nat sends 9 bits a value
        v = get("1gbit", "vgg19", f"ps+{other}")
        if nat is not None and v is not None:
            out.append((f"1 Gbit/s, vgg19: ps+natural2 (C_nat both ways) / ps+{other}",
                        nat / v, "report", True))
    for net in ("loopback", "1gbit"):
        for c in ("identity", "onebit"):
            on, off = get(net, "resnet50", f"ps+{c}"), get(net, "resnet50",
                                                          f"ps+{c} (coordinator off)")
            if on is not None and off is not None:
                out.append((f"{net}, resnet50, ps+{c}: coordinator on / off", on / off, "< 1",
                            on < off))
    return out


def rank_memory(lists) -> int:
    """Bytes one rank needs, roughly: the largest list's gradients and pristine copy, the
    engine's buffers and payloads (about 6 copies in all) and 400 MB of interpreter and torch."""
    biggest = max(sum(4 * math.prod(s) for _, s in list_shapes(x)) for x in lists)
    return 6 * biggest + (400 << 20)


def _available_memory():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- the cost model
def link_of(rate: str, latency: float = 1e-4):
    """The alpha-beta ``Link`` of an emulated link: the tc rate's bytes per second and a
    per-message latency (the namespaces add no delay: 0.1 ms of TCP and kernel
    per message is assumed)."""
    from hipress_like.cost_model.model import Link
    from hipress_like.launch.netem import rate_bits

    return Link(latency=latency, bandwidth=rate_bits(rate) / 8)


_COSTS: dict = {}


def piece_costs(comp_name, params, x, n, repeats=5):
    """(encode s, decode s, payload bytes) of one partition ``x``, on one thread.

    The fastest of ``repeats`` calls: the operation's own cost, without the
    interference of a shared host (the model adds the cores' sharing itself).

    Encode sums every round's encode (PowerSGD's P and Q); decode is the final
    decode (``decode_div_`` / ``decode_rounds``); the payload counts every round's
    bytes, so ``payload / x's bytes`` is the compression rate r of HiPress Eq. 2.
    Cached per (compressor, shape, N).
    """
    import bound
    import torch

    from hipress_like.casync.choice import build_compressor
    from hipress_like.compressors.base import assume_finite

    key = (comp_name, json.dumps(params, sort_keys=True), tuple(x.shape), n)
    if key in _COSTS:
        return _COSTS[key]
    torch.set_num_threads(1)  # as one rank of the run
    comp = build_compressor(comp_name, params, "auto")
    rounds = comp.capabilities.rounds
    kw = {"world_size": n, "shared_seed": 1}
    times = bound.time_calls(comp, x, {("merge", r): n for r in range(rounds)}, n, kw, repeats)
    enc = sum(min(times[("encode", r)]) for r in range(rounds))
    dec = min(times[("decode", rounds - 1)])
    st, pay, merged = comp.init(x, seed=0, **kw), 0, None
    with assume_finite():
        if rounds > 1:
            for r in range(rounds):
                p, st = comp.encode_round(r, x, st, merged)
                merged = comp.merge_round(r, [p] * n)
                pay += p.numel()
        else:
            pay = comp.encode(x, st)[0].numel()
    _COSTS[key] = (enc, dec, pay)
    return _COSTS[key]


def predict_allreduce(shapes, n, link, cap=25 << 20) -> float:
    """DDP's bucketed allreduce: Table I's ring allreduce per 25 MB bucket, one after another."""
    from hipress_like.cost_model.collectives import ring_allreduce

    t, size = 0.0, 0
    for _, shape in reversed(shapes):
        size += 4 * math.prod(shape)
        if size >= cap:
            t += ring_allreduce(size, n, link.alpha, link.beta)
            size = 0
    if size:
        t += ring_allreduce(size, n, link.alpha, link.beta)
    return t


def _eq2(m, k, n, link, sp, enc, dec, pay, part, slow):
    """HiPress Eq. 2 for one gradient, T_enc and T_dec linear through one measured partition
    (``enc`` s for ``part`` bytes, ``dec`` s for ``pay`` payload bytes), times ``slow``."""
    from hipress_like.cost_model.model import t_sync_cpr

    return t_sync_cpr(m, k, n, pay / part, link, lambda b: slow * enc * b / part,
                      lambda y: slow * dec * y / pay, sp)


def predict_sync(shapes, strategy, comp_name, params, n, link, cores=None):
    """The cost model's sync time of a gradient list: (a core per rank, the host's cores).

    Each gradient as the engine's default plan decides (``SizeRule``): compressed
    ones by HiPress Eq. 2 (``t_sync_cpr``; alpha/beta/gamma of Table 3 / Sec. 6.1
    for the strategy and the compressor's category), except a multi-round
    compressor the engine sums on its collective lane (PowerSGD, whatever the
    strategy): Table I's ring allreduce of its payloads plus one encode and one
    decode of the whole gradient (Table 3's low-rank beta = gamma = 1); the rest by
    one ring allreduce of their bytes (the engine's fused lane; Table I); gradients
    one after another (they share the link). ``cores``: the host's cores; with more ranks than cores
    every encode and decode takes N / cores times as long (the second value).
    """
    import bound
    import torch

    from hipress_like.casync.choice import build_compressor
    from hipress_like.cost_model.collectives import ring_allreduce
    from hipress_like.cost_model.model import sync_params
    from hipress_like.cost_model.plan import SizeRule

    slow = max(1.0, n / cores) if cores else 1.0
    comp = None if comp_name in (None, "identity") else build_compressor(comp_name, params,
                                                                         "auto")
    rule, lane, ded, host = SizeRule(), 0, 0.0, 0.0
    for _, shape in shapes:
        m = 4 * math.prod(shape)
        d = rule.decide(m, n)
        if comp is None or not d.compress:
            lane += m
            continue
        if bound.lane_rounds(comp):  # PowerSGD: every round summed by one ring allreduce
            enc, dec, pay = piece_costs(comp_name, params, torch.randn(shape), n)
            rounds = comp.capabilities.rounds
            t = (ring_allreduce(pay, n, link.alpha, link.beta)
                 + (rounds - 1) * 2 * (n - 1) * link.alpha)  # Table I, the rounds' payloads
            ded, host = ded + t + enc + dec, host + t + slow * (enc + dec)
            continue
        sp = sync_params("ps-colocated" if strategy == "ps" else "ring",
                         comp.capabilities.category)
        x = bound.piece(torch.randn(shape), d.partitions).contiguous()
        enc, dec, pay = piece_costs(comp_name, params, x, n)
        part = 4 * x.numel()
        ded += _eq2(m, d.partitions, n, link, sp, enc, dec, pay, part, 1.0)
        host += _eq2(m, d.partitions, n, link, sp, enc, dec, pay, part, slow)
    if lane:
        t = ring_allreduce(lane, n, link.alpha, link.beta)
        ded, host = ded + t, host + t
    return ded, host


def row_link(r):
    """The link the model prices a row on: the one measured in its run (``measure_link``,
    every rank sending to its ring successor at once, as HiPress profiles ``T_send``), or
    the tc rate's nominal one (``link_of``) for a row without a measurement."""
    from hipress_like.cost_model.model import Link

    m = r.get("measured_link")
    if m:
        return Link(latency=m["latency"], bandwidth=m["bandwidth"]), "measured"
    return link_of(r["net"]), "nominal"


def step_model_predictions(profile: dict, shapes, n: int, cores: int) -> dict:
    """{row config: seconds} by the library's own model, from a profile measured in the run.

    The advisor's step model (``tuning/step_model.py``; ``advise`` with the
    engine's size rule, ``compressor_plans="rule"``, as the rows run) with no
    compute (a sync alone: ``ComputeTimeline(0, 0)``) and the host's cores
    shared by the N ranks (``cores_per_rank = cores / N``): the three servers
    (the engine's compute thread, the link, waits) and the host-CPU bound from
    the CPU seconds the profile measured per synchronisation. The uncompressed
    row ("none": every gradient in the engine's allreduce lane, 25 MB buckets in
    reverse order) prices DDP's bucketed allreduce.
    """
    from hipress_like.cost_model.profile import Profile
    from hipress_like.tuning.advise import advise
    from hipress_like.tuning.compute import ComputeTimeline

    prof = Profile.from_dict(profile)
    sizes = [(name, 4 * math.prod(shape)) for name, shape in shapes]
    adv = advise(sizes, n, prof, ComputeTimeline(0.0, 0.0), candidates=[],
                 compressor_plans="rule", cores_per_rank=cores / n)
    out = {}
    for r in adv.rows:
        if r.kind == "none":
            out[ALLREDUCE] = r.step_s
        else:
            out[f"{r.strategy}+{r.label.split('/')[0]}"] = r.step_s
    return out


def add_predictions(rows, cores=None, profiles=None) -> None:
    """Attach ``predicted_s``, ``predicted_host_s`` and ``model_error`` to every row over an
    emulated link whose configuration the model covers (allreduce; PS/Ring x a compressor),
    priced on ``row_link``; with ``profiles`` ({"N/net": profile dict}), also
    ``predicted_model_s`` and ``model_error_model`` (``step_model_predictions``)."""
    cores = cores or os.cpu_count() or 1
    by_model = {}
    for key, prof in (profiles or {}).items():
        n, net = key.split("/", 1)
        for lname in {r["list"] for r in rows if r["nprocs"] == int(n) and r["net"] == net}:
            by_model[(int(n), net, lname)] = step_model_predictions(
                prof, list_shapes(lname), int(n), cores)
    for r in rows:
        if r.get("cpu_s") is not None:  # the host's bend: N ranks' CPU on its cores
            r["cpu_bound_s"] = max(1.0, r["nprocs"] / cores) * r["cpu_s"]
        if r["net"] == "loopback":
            continue  # no link to model
        (link, source), n, shapes = row_link(r), r["nprocs"], list_shapes(r["list"])
        try:
            if r["config"] == ALLREDUCE:
                ded = host = predict_allreduce(shapes, n, link)
            elif r.get("coordinator") and r.get("raw_collective", True) \
                    and r.get("comp") in COMPRESSORS and r["comp"] not in NAMED \
                    and r["comp"] not in BACK:
                name, params = COMPRESSORS[r["comp"]]
                ded, host = predict_sync(shapes, r["strategy"], name, params, n, link, cores)
            else:
                continue
        except Exception as e:  # a compressor the model cannot price: say so, keep the row
            print(f"  no prediction for {r['config']} at N={n}: {e}", file=sys.stderr)
            continue
        r.update(predicted_s=ded, predicted_host_s=host, model_error=ded / r["seconds"] - 1,
                 model_error_host=host / r["seconds"] - 1, model_link=source)
        lib = by_model.get((n, r["net"], r["list"]), {}).get(r["config"])
        if lib is not None:
            r.update(predicted_model_s=lib, model_error_model=lib / r["seconds"] - 1)


def model_errors(rows):
    """{N: (median |error|, Eq. 2 with a core per rank; the same with the host's cores; the
    library's step model from the in-run profile, or None; rows)}."""
    out = {}
    for n in sorted({r["nprocs"] for r in rows if "model_error" in r}):
        rs = [r for r in rows if r["nprocs"] == n and "model_error" in r]
        lib = [abs(r["model_error_model"]) for r in rs if "model_error_model" in r]
        out[n] = (statistics.median(abs(r["model_error"]) for r in rs),
                  statistics.median(abs(r["model_error_host"]) for r in rs),
                  statistics.median(lib) if len(lib) == len(rs) else None, len(rs))
    return out


def scaling_png(rows, json_path: str) -> str:
    """Sync time against N per configuration: measured (solid), Eq. 2's prediction with a
    core per rank (dashed) and with the host's cores (dotted), the library's step model
    from the in-run profile (dash-dot); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for i, c in enumerate(configs):
        rs = sorted((r for r in rows if r["config"] == c), key=lambda r: r["nprocs"])
        color = f"C{i}"
        ax.plot([r["nprocs"] for r in rs], [r["seconds"] * 1e3 for r in rs], "o-",
                color=color, label=f"{c} measured")
        pr = [r for r in rs if "predicted_s" in r]
        if pr:
            ax.plot([r["nprocs"] for r in pr], [r["predicted_s"] * 1e3 for r in pr], "--",
                    color=color, label=f"{c} Eq. 2, a core per rank")
            ax.plot([r["nprocs"] for r in pr], [r["predicted_host_s"] * 1e3 for r in pr], ":",
                    color=color, label=f"{c} Eq. 2, {os.cpu_count()} cores shared")
        sm = [r for r in rs if "predicted_model_s" in r]
        if sm:
            ax.plot([r["nprocs"] for r in sm], [r["predicted_model_s"] * 1e3 for r in sm], "x-.",
                    color=color, label=f"{c} step model (in-run profile)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("sync time of the gradient list (ms)")
    lists = sorted({(r["list"], r["net"]) for r in rows})
    ax.set_title("bench/sync.py scaling: " + ", ".join(f"{a} over {b}" for a, b in lists),
                 fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    out = os.path.splitext(json_path)[0] + "_scaling.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    """Parse options, run the workers per world size and network, print the table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default=None,
                   help="comma list of loopback and/or a tc rate such as 1gbit (default "
                        "loopback,1gbit; 1gbit when scaling)")
    p.add_argument("--lists", default=None,
                   help=f"comma list of {', '.join(LISTS)} (default resnet50,vgg19; vggstyle "
                        "when scaling)")
    p.add_argument("--nprocs", default="4", help="world size, or several comma-separated "
                   "(2,4,8): a scaling run")
    p.add_argument("--scaling", action="store_true", help="the scaling rows (allreduce, "
                   f"{', '.join(SCALING_ONLY)}) and the model's predictions, also with one N")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="identity and onebit only")
    p.add_argument("--only", default=None, help="comma list of strategy+compressor to run, "
                   "e.g. ps+identity,ps+onebit (default: all; the scaling rows when scaling)")
    p.add_argument("--out", default=None, help="JSON path (default results/sync.json, "
                   "results/sync_scaling.json when scaling)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--engine", default="{}",
                   help="extra EngineConfig fields for every configuration, as JSON "
                        "(e.g. '{\"matching\": true}')")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="scaling: skip the in-run profile, so no prediction by the library's "
                        "step model (only HiPress Eq. 2's); saves minutes per N")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--net", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:
        sizes = [int(x) for x in a.nprocs.split(",") if x]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        p.error(f"--nprocs: expected world sizes >= 2, comma-separated, found {a.nprocs!r}")
    a.scaling = a.scaling or len(sizes) > 1
    a.lists = [x for x in (a.lists or ("vggstyle" if a.scaling else "resnet50,vgg19"))
               .split(",") if x]
    only = a.only if a.only is not None else (",".join(SCALING_ONLY) if a.scaling else "")
    a.only = [x for x in only.split(",") if x]
    nets = [x for x in (a.nets or ("1gbit" if a.scaling else "loopback,1gbit")).split(",") if x]
    out = a.out or os.path.join("results", "sync_scaling.json" if a.scaling else "sync.json")
    for x in a.lists:
        if x not in LISTS:
            p.error(f"unknown list {x!r}; known: {', '.join(LISTS)}")
    if a.worker:
        worker(a)
        return 0
    rows, profiles = [], {}
    for n in sizes:
        need = n * rank_memory(a.lists)
        free = _available_memory()
        if free is not None and need > free:
            print(f"== skipping N={n}: about {need / 2**30:.1f} GB needed ({n} ranks), "
                  f"{free / 2**30:.1f} GB available", flush=True)
            continue
        for net in nets:
            fd, res = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            wargv = [sys.executable, os.path.abspath(__file__), "--worker", "--net", net,
                     "--lists", ",".join(a.lists), "--reps", str(a.reps), "--result", res,
                     "--engine", a.engine, "--only", ",".join(a.only)]
            if a.quick:
                wargv.append("--quick")
            if a.scaling:
                wargv.append("--scaling")
            if not a.profile:
                wargv.append("--no-profile")
            print(f"== {net}: {n} ranks", flush=True)
            if net == "loopback":
                _run_loopback(wargv, n, a.timeout)
            else:
                _run_netem(wargv, n, net, a.timeout)
            with open(res) as f:
                got = json.load(f)
            for r in got["rows"]:
                rows.append(dict(r, net=net, nprocs=n))
            if got["profile"] is not None:
                profiles[f"{n}/{net}"] = got["profile"]
            os.unlink(res)
    if a.scaling:
        add_predictions(rows, profiles=profiles)
    print(f"\n{'N':>3s} {'net':9s} {'list':9s} {'configuration':36s} {'ms':>9s} "
          f"{'x allreduce':>12s} {'rounds':>7s} {'fused':>6s} {'model ms':>9s} {'err':>6s} "
          f"{'host ms':>8s} {'err':>6s} {'cpu ms':>7s} {'N/c*cpu':>8s} {'step ms':>8s} {'err':>6s}")
    for r in rows:
        pred = (f"{r['predicted_s'] * 1e3:9.1f} {r['model_error']:+6.0%} "
                f"{r['predicted_host_s'] * 1e3:8.1f} {r['model_error_host']:+6.0%}"
                if "predicted_s" in r else " " * 33)
        if r.get("cpu_s") is not None:
            pred += f" {r['cpu_s'] * 1e3:7.1f} {r['cpu_bound_s'] * 1e3:8.1f}"
        if "predicted_model_s" in r:
            pred += f" {r['predicted_model_s'] * 1e3:8.1f} {r['model_error_model']:+6.0%}"
        print(f"{r['nprocs']:3d} {r['net']:9s} {r['list']:9s} {r['config']:36s} "
              f"{r['seconds'] * 1e3:9.1f} {r['ratio']:12.3f} {r.get('rounds_last_step', ''):>7} "
              f"{r.get('buckets_last_step', ''):>6} {pred}")
    errors = model_errors(rows)
    for n, (e, eh, el, k) in errors.items():
        lib = "" if el is None else f"; the library's step model {el:.0%}"
        print(f"N={n}: median error of HiPress Eq. 2 {e:.0%} with a core per rank, {eh:.0%} "
              f"with {os.cpu_count()} cores shared{lib} ({k} rows; goal <= 20%)")
    goals = _goals(rows) if len(sizes) == 1 else []
    for n, (_, eh, el, _) in errors.items():
        if el is None:
            goals.append((f"sync scaling, N={n}: Eq. 2's median error (host's cores)", eh,
                          "<= 0.2", eh <= 0.2))
        else:
            goals.append((f"sync scaling, N={n}: the step model's median error (in-run profile)",
                          el, "<= 0.2", el <= 0.2))
    print("\ngoals:")
    for name, v, target, ok in goals:
        tag = "INFO" if target == "report" else ("PASS" if ok else "FAIL")
        print(f"  [{tag}] {name} = {v:.3f}" + ("" if target == "report" else f" (goal {target})"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"rows": rows, "goals": [dict(zip(("name", "value", "target", "pass"), g))
                                           for g in goals],
                   "nprocs": sizes if len(sizes) > 1 else sizes[0], "reps": a.reps,
                   "model_median_error": {str(n): {"core_per_rank": e, "host_cores": eh,
                                                   "step_model": el, "rows": k}
                                          for n, (e, eh, el, k) in errors.items()},
                   "profiles": profiles,
                   "time": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)
    print(f"wrote {out}")
    if a.scaling:
        print(f"picture: {scaling_png(rows, out)}")
    else:
        import _figures

        print(f"picture: {_figures.sync_png(rows, out)}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
