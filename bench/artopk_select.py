"""Does Eq. 5a-5c pick the fastest way to synchronise top-k? Measured on shaped links.

For each network (tc tbf rate, optionally with added one-way delay) and each
world size N, ranks run in network namespaces (``hipress_like.launch.netem``)
and:

1. measure alpha and beta of their own transport and beta of one-way steps
   (rank 2i to 2i+1) as ``collective="auto"`` does (``tuning.link.
   collective_links``: timed exchanges, fitted, agreed by every rank);
2. for each (gradient size M, compression ratio c) of the grid, time the three
   ways of the paper, as ``casync.collectives`` runs them over point-to-point
   messages: Allgather of k values and k indices (``bruck_allgather``),
   ART-Ring (``tree_broadcast`` of the owner's indices + ``ring_allreduce`` of
   the values) and ART-Tree (the broadcast + ``tree_allreduce``), interleaved,
   each the median over repetitions of the slowest rank's time;
3. compare the measured fastest with ``cost_model.collectives.
   select_collective(M, N, alpha, beta, c)``: the paper's Eq. 5a-5c, and the
   library's selection (what ``collective="auto"`` runs), which prices the
   tree and broadcast steps with the one-way beta (``beta_one_way``; the
   module docstring of ``cost_model/collectives.py`` says why).

The grid, the choices and the hit rate are printed; JSON goes to
``results/artopk_select.json``. With ``--speed`` it also times the VGG-like
gradient list (``cost_model.presets``, as bench/sync.py) synchronised
layer-wise with top-k at one CR by Allgather and by AR-Topk with the selected
collective per gradient, in the same run.

The kernel here has no ``sch_netem``: delay comes from ../shared/netem's
userspace NFQUEUE tool (``nfq_delay.py`` on each host's ingress; needs
``iptables``), started and stopped by this script inside the namespaces.

    python bench/artopk_select.py                          # the full grid (root)
    python bench/artopk_select.py --nets 1gbit --ns 4 --sizes 4 --crs 0.01
    python bench/artopk_select.py --nets 1gbit --ns 4 --speed --crs 0.01

Goal (issue 24): the selection hits the measured fastest in >= 80% of cases
(judged on the library's selection; the paper's is printed beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

NFQ_DELAY = os.environ.get("HIPRESS_NFQ_DELAY",
                           os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared",
                                        "netem", "nfq_delay.py"))
if not os.path.exists(NFQ_DELAY):
    NFQ_DELAY = "/work/shared/netem/nfq_delay.py"
WAYS = ("allgather", "art_ring", "art_tree")


# --------------------------------------------------------------------------- worker
def worker(a) -> None:
    """One rank: measure the link, time the three ways per case; rank 0 writes JSON."""
    import torch
    import torch.distributed as dist

    from hipress_like.casync import collectives as col
    from hipress_like.casync.transport.torch_dist import TorchDistTransport
    from hipress_like.cost_model.collectives import select_collective, topk_costs
    from hipress_like.tuning.link import collective_links

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tr = TorchDistTransport()
    n, rank = tr.size, tr.rank
    timeout = 120.0

    def log(msg):
        if rank == 0:
            print(f"[{a.net} N={n}] {msg}", file=sys.stderr, flush=True)

    link, one_way = collective_links(tr, timeout, repeats=a.reps)
    bo = one_way.beta
    log(f"alpha {link.alpha * 1e3:.3f} ms, beta {link.beta * 1e9:.3f} ns/B "
        f"({8e-9 / link.beta:.3f} Gbit/s); one-way steps {8e-9 / bo:.3f} Gbit/s")

    def once(fn):
        tr.barrier(timeout)
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        return tr.allreduce(t, "max", timeout).item()  # the slowest rank's time

    def ways(k):
        """The three communications of one top-k step with k entries (owner: rank 0)."""
        idx = torch.arange(k, dtype=torch.int32) * 3
        vals = torch.randn(k)
        both = torch.cat([idx.view(torch.uint8), vals.view(torch.uint8)])
        out = {"allgather": lambda: col.bruck_allgather(tr, both, timeout)}
        out["art_ring"] = lambda: (col.tree_broadcast(tr, idx.clone(), 0, timeout),
                                   col.ring_allreduce(tr, vals.clone(), timeout))
        out["art_tree"] = lambda: (col.tree_broadcast(tr, idx.clone(), 0, timeout),
                                   col.tree_allreduce(tr, vals.clone(), timeout))
        return out

    rows = []
    for mb in a.sizes:
        m = int(mb * (1 << 20))
        for c in a.crs:
            k = max(1, round(c * m / 4))
            fns = ways(k)
            for fn in fns.values():
                fn()  # warm-up
            times = {w: [] for w in WAYS}
            for _ in range(a.reps):  # interleaved: drifting load weighs on all alike
                for w in WAYS:
                    times[w].append(once(fns[w]))
            med = {w: statistics.median(ts) for w, ts in times.items()}
            fastest = min(med, key=med.get)
            paper = select_collective(float(m), n, link.alpha, link.beta, c)
            chosen = select_collective(float(m), n, link.alpha, link.beta, c, bo)
            pred = topk_costs(float(m), n, link.alpha, link.beta, c, bo)
            rows.append({"net": a.net, "n": n, "mb": mb, "cr": c, "k": k,
                         "alpha": link.alpha, "beta": link.beta, "beta_one_way": bo,
                         "measured_s": med, "predicted_s": pred, "fastest": fastest,
                         "selected": chosen, "hit": chosen == fastest,
                         "regret": med[chosen] / med[fastest],
                         "selected_paper": paper, "hit_paper": paper == fastest})
            log(f"M={mb:g} MB c={c:g}: " + ", ".join(f"{w} {med[w] * 1e3:.1f} ms" for w in WAYS)
                + f" -> fastest {fastest}, selected {chosen} (paper: {paper})")
    a.beta_one_way = bo
    speed = speed_rows(a, tr, link, log) if a.speed else []
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump({"rows": rows, "speed": speed,
                       "link": {"alpha": link.alpha, "beta": link.beta, "beta_one_way": bo}}, f)
    tr.close()
    dist.barrier()
    dist.destroy_process_group()


def speed_rows(a, tr, link, log):
    """The VGG-like list synchronised layer-wise with top-k: Allgather vs AR-Topk with the
    selected collective per gradient (and vs ART-Ring everywhere), same run."""
    import torch

    from hipress_like.casync import collectives as col
    from hipress_like.cost_model.collectives import select_per_gradient
    from hipress_like.cost_model.presets import preset

    sizes = preset("vgg19", 0.25)
    gen = torch.Generator().manual_seed(tr.rank)
    grads = {name: torch.randn(max(1, nb // 4), generator=gen) for name, nb in sizes}
    out = []
    for c in a.crs:
        pick = select_per_gradient({k: v.numel() * 4 for k, v in grads.items()}, tr.size,
                                   link.alpha, link.beta, c, a.beta_one_way)
        step = 0

        def run(way, grads=grads, c=c, pick=pick):
            nonlocal step
            step += 1
            for name, g in grads.items():
                w = pick[name] if way == "selected" else way
                col.topk_sync(tr, g, c, w, owner=step % tr.size, timeout=120)

        res = {}
        for way in ("allgather", "art_ring", "selected"):
            run(way)  # warm-up
        for way in ("allgather", "art_ring", "selected"):
            res[way] = []
        for _ in range(a.reps):
            for way in res:
                tr.barrier(120)
                t0 = time.perf_counter()
                run(way)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                res[way].append(tr.allreduce(t, "max", 120).item())
        med = {w: statistics.median(v) for w, v in res.items()}
        counts = {w: sum(1 for v in pick.values() if v == w) for w in WAYS}
        out.append({"net": a.net, "n": tr.size, "cr": c, "seconds": med, "picked": counts,
                    "ratio_selected_vs_allgather": med["selected"] / med["allgather"],
                    "ratio_art_ring_vs_allgather": med["art_ring"] / med["allgather"]})
        log(f"vgg19 top-k c={c:g}: allgather {med['allgather'] * 1e3:.0f} ms, art_ring "
            f"{med['art_ring'] * 1e3:.0f} ms, selected {med['selected'] * 1e3:.0f} ms {counts}")
    return out


# --------------------------------------------------------------------------- parent
def _delay_up(n: int, delay: str, rundir: str):
    """NFQUEUE delay on each host's ingress (../shared/netem/netem.sh's fallback)."""
    if shutil.which("iptables") is None:
        raise SystemExit("added delay needs iptables (apt-get install -y iptables) and "
                         f"{NFQ_DELAY}")
    procs = []
    for i in range(n):
        subprocess.run(["ip", "netns", "exec", f"h{i}", "iptables", "-w", "-A", "INPUT", "-i",
                        "eth0", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"],
                       check=True)
        logf = open(os.path.join(rundir, f"nfq.h{i}.log"), "w")
        procs.append(subprocess.Popen(["ip", "netns", "exec", f"h{i}", sys.executable,
                                       NFQ_DELAY, "0", delay], stdout=logf,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    time.sleep(0.5)
    dead = [i for i, p in enumerate(procs) if p.poll() is not None]
    if dead:
        _delay_down(procs)
        raise SystemExit(f"nfq_delay did not start in hosts {dead}; see {rundir}")
    return procs


def _delay_down(procs) -> None:
    for p in procs:  # only the processes this script started, by their handles
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_net(a, net: str, n: int) -> dict:
    """Bring up n hosts at the net's rate (+ delay), run the workers, return rank 0's JSON."""
    sys.path.insert(0, HERE)
    import netem

    rate, _, delay = net.partition("+")
    fd, res = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    rundir = tempfile.mkdtemp(prefix="artopk-nfq-")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--net", net,
            "--sizes", ",".join(map(str, a.sizes)), "--crs", ",".join(map(str, a.crs)),
            "--reps", str(a.reps), "--result", res] + (["--speed"] if a.speed else [])
    netem.up(n, rate)
    procs = []
    try:
        if delay:
            procs = _delay_up(n, delay, rundir)
        rc = netem.run_in_namespaces(n, argv, env={"OMP_NUM_THREADS": "1"}, timeout=a.timeout)
        if rc:
            raise SystemExit(f"namespace workers failed (exit code {rc})")
    finally:
        _delay_down(procs)
        netem.down()
    with open(res) as f:
        out = json.load(f)
    os.unlink(res)
    shutil.rmtree(rundir, ignore_errors=True)
    return out


def _floats(s: str):
    return [float(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    """Parse options, run every (net, N), print the grid and the hit rate, write JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default="1gbit,1gbit+5ms,100mbit,100mbit+5ms",
                   help="comma list of RATE or RATE+DELAY (tc syntax)")
    p.add_argument("--ns", default="2,3,4", help="world sizes")
    p.add_argument("--sizes", default="4,32", help="gradient sizes M in MB")
    p.add_argument("--crs", default="0.1,0.01,0.001", help="compression ratios")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--speed", action="store_true",
                   help="also time the VGG-like list: Allgather vs AR-Topk top-k")
    p.add_argument("--out", default=os.path.join("results", "artopk_select.json"))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--net", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sizes, a.crs = _floats(a.sizes), _floats(a.crs)
    if a.worker:
        worker(a)
        return 0
    rows, speed, links = [], [], []
    for net in [x for x in a.nets.split(",") if x]:
        for n in [int(x) for x in a.ns.split(",") if x]:
            print(f"== {net}, {n} ranks", flush=True)
            got = run_net(a, net, n)
            rows += got["rows"]
            speed += got["speed"]
            links.append({"net": net, "n": n, **got["link"]})
    print(f"\n{'net':13s} {'N':>2s} {'M MB':>5s} {'CR':>6s} {'AG ms':>8s} {'ring ms':>8s} "
          f"{'tree ms':>8s}  {'fastest':9s} {'selected':9s} hit  regret  {'paper':9s} hit")
    for r in rows:
        ms = r["measured_s"]
        print(f"{r['net']:13s} {r['n']:2d} {r['mb']:5g} {r['cr']:6g} "
              f"{ms['allgather'] * 1e3:8.1f} {ms['art_ring'] * 1e3:8.1f} "
              f"{ms['art_tree'] * 1e3:8.1f}  {r['fastest']:9s} {r['selected']:9s} "
              f"{'yes' if r['hit'] else 'no ':3s}  {r['regret']:6.2f}  "
              f"{r['selected_paper']:9s} {'yes' if r['hit_paper'] else 'no'}")
    print("\nmeasured links:")
    for li in links:
        print(f"  {li['net']:13s} N={li['n']}: alpha {li['alpha'] * 1e3:.3f} ms, "
              f"{8e-9 / li['beta']:.3f} Gbit/s (ring steps), "
              f"{8e-9 / li['beta_one_way']:.3f} Gbit/s (one-way steps)")
    hits = sum(r["hit"] for r in rows)
    rate = hits / len(rows) if rows else 0.0
    paper = sum(r["hit_paper"] for r in rows)
    near = sum(r["regret"] <= 1.1 for r in rows)
    print(f"\nhit rate: {hits}/{len(rows)} = {rate:.0%} (goal >= 80%): "
          f"{'PASS' if rate >= 0.8 else 'FAIL'}; the paper's Eq. 5a-5c alone: "
          f"{paper}/{len(rows)} = {paper / max(1, len(rows)):.0%}")
    print(f"selected within 10% of the fastest: {near}/{len(rows)}; the fastest was ART-Tree in "
          f"{sum(r['fastest'] == 'art_tree' for r in rows)} cases (Eq. 5c alone never picks it "
          f"for N <= 4: its bound (N-1)/log N - 3/2 is <= 0 there)")
    if speed:
        print("\nVGG-like list, layer-wise top-k (median ms of the slowest rank):")
        for s in speed:
            sec = s["seconds"]
            print(f"  {s['net']:13s} N={s['n']} CR {s['cr']:g}: allgather "
                  f"{sec['allgather'] * 1e3:.0f}, art_ring {sec['art_ring'] * 1e3:.0f} "
                  f"({s['ratio_art_ring_vs_allgather']:.2f}x), selected "
                  f"{sec['selected'] * 1e3:.0f} ({s['ratio_selected_vs_allgather']:.2f}x) "
                  f"picked {s['picked']}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "speed": speed, "links": links, "hits": hits,
                   "cases": len(rows), "hit_rate": rate, "within_10pct": near,
                   "hits_paper": paper,
                   "reps": a.reps}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
