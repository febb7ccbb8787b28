"""plan="adaptive" while the link changes under a running job: adaptive against fixed plans.

Issue 49, item 4. Ranks train digits (``hipress_like.demo``'s ``DigitsNet``,
the hidden width set by ``--hidden``) over an emulated network
(``hipress_like.launch.netem``: one namespace per rank, every link shaped
with ``tc tbf``; root needed). The job runs in phases of ``--steps`` steps;
between phases the bench changes the rate of every link (``netem.set_rate``,
default 10 Gbit/s -> 1 Gbit/s -> 200 Mbit/s -> 10 Gbit/s, issue 49's example)
while the ranks wait at the boundary (rank 0 says it is there with a flag
file; every rank goes on once the bench's flag says the rate changed), so
each phase runs wholly at its rate. Configurations, each a whole job, run
in the same run and alternated (repeat 1 of every configuration, then
repeat 2, ..., each repeat's order rotated: ``job_order``), so that a
drifting load on a shared host falls on all of them alike:

    adaptive  plan=hpt.Adaptive(check_every, margin): profiled at start as
              plan="auto", then re-planned from the engine's own timings
    start     the plan the adaptive job of the same repeat started with (its
              rank 0 saves it after the first step, before any check), kept:
              both start from one profile (two profiles of a link on a shared
              host may pick different plans)
    none      nothing compressed (Compression.none)
    onebit    1-bit on every gradient of 64 KB or more (a fixed plan)

Every step's wall time is recorded on every rank (the loop iteration:
forward, backward, ``opt.step()``; the wait at a phase boundary is not in
it), and its CPU time (``time.process_time``: every thread of the rank's
process; kept as the mean over ranks, ``cpu_s``), which tells a step that
worked more from one that waited more on a host whose ranks share cores.
A phase's time is rank 0's sum over the phase; its *settled* time
leaves out the steps in which the adaptive job has yet to notice the change
and decide (below). Printed: the table of
phase times, the adaptive job's switches, and the ratios issue 49 asks for:

    total      start's total time / adaptive's total time (goal >= 1.3)
    phase k    adaptive's settled time / the best fixed plan's (goal <= 1.10),
               as the median over repeats of the mean step in each repeat's
               settled window (the windows differ in length from repeat to
               repeat; the medians of their sums are printed too);
               fixed configurations that ran one plan in the phase (``start``
               and ``none`` when both compress nothing) are pooled: their
               repeats give one median (``plan_groups``), and the faster of
               their separate medians is printed beside it

and every job checks that its ranks end bitwise identical. Written as JSON
(``--out``), with every step's time and wall clock for a plot.

    sudo python bench/adaptive.py                               # 4 ranks, 40 steps a phase
    sudo python bench/adaptive.py --ranks 2 --steps 12 --hidden 256 --repeats 1   # smoke

A compute slowdown (``--hog 0,1,0``: a CPU hog in phase 2): the bench starts
a process that spins on the core of rank ``--hog-rank`` at the phase
boundary and stops it at the next, while the link stays as ``--rates`` says
(e.g. ``--rates 1gbit,1gbit,1gbit``). With ``--pin`` (the default with a
hog) rank r runs on core ``r % cores``, so the hog slows that rank's
compute (and its compressors) and not the others'; with two ranks on two
cores each rank has a core of its own, as on a host with a core per rank.

    sudo python bench/adaptive.py --ranks 2 --rates 1gbit,1gbit,1gbit --hog 0,1,0

A phase's *settled* window starts once the adaptive job of the same repeat
has decided: after its last exploration (or switch trial) that started in
the phase ended, and no sooner than ``check_every + AFTER_STEPS`` steps in;
every configuration's settled time is summed over the same window, and the
whole phase's ratio is printed beside it.

Plotted (``--plot``, beside the JSON by default): step time against training
time, the adaptive job's switches and reverts marked.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CONFIGS = ("adaptive", "start", "none", "onebit")
FIXED = ("start", "none", "onebit")


def _wait_file(path: str, timeout: float, alive=None) -> bool:
    """Wait for ``path``; False when ``alive()`` turns false or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or (alive is not None and not alive()):
            return False
        time.sleep(0.02)
    return True


def adaptive_job(ctx, cfg):
    """One rank of one configuration's job (``run_workers(..., netns=True)``)."""
    import hashlib

    import torch
    import torch.nn.functional as F

    import hipress_like.torch as hpt
    from hipress_like.cost_model import Plan, SizeRule
    from hipress_like.demo.cli_digits import setup_worker
    from hipress_like.tuning.online import AFTER_STEPS

    t0 = time.time()
    if cfg.get("pin"):  # a core per rank (rank r on core r % cores): a hog slows one
        os.sched_setaffinity(0, {int(os.environ.get("RANK", "0")) % os.cpu_count()})
    rank, size, (xtr, ytr, _, _), model, opt = setup_worker(cfg["hidden"], cfg["lr"], 0)
    name = cfg["config"]
    compression, plan = "onebit", None
    if name == "adaptive":
        plan = hpt.Adaptive(check_every=cfg["check_every"], margin=cfg["margin"])
    elif name == "start":  # the plan the adaptive job of this repeat started with
        plan = cfg["start_plan"] if os.path.exists(cfg["start_plan"]) else "auto"
    elif name == "none":
        compression = "none"
    elif name == "onebit":
        plan = Plan(compressor="onebit", rule=SizeRule(min_compress_bytes=1 << 16))
    else:
        raise ValueError(f"unknown configuration {name!r}; expected one of {CONFIGS}")
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression, plan=plan)
    start_s = time.time() - t0  # init, data, profiling (auto, adaptive)
    gen = torch.Generator().manual_seed(rank)
    phases, cpus, walls, layouts = [], [], [], []
    step = 0
    for k, n in enumerate(cfg["phases"]):
        if k > 0:  # the bench changes the link between phases
            if rank == 0:
                open(os.path.join(cfg["flags"], f"ready-{k}"), "w").close()
            if not _wait_file(os.path.join(cfg["flags"], f"rate-{k}"), cfg["wait_s"]):
                raise TimeoutError(f"rank {rank}: the bench did not change the link for "
                                   f"phase {k} within {cfg['wait_s']} s")
        times, cpu = [], []
        for _ in range(n):
            idx = torch.randint(0, len(xtr), (cfg["batch"],), generator=gen)
            t, c = time.perf_counter(), time.process_time()
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            walls.append(time.time())
            step += 1
            if step == 1 and name == "adaptive" and rank == 0:  # before any check
                opt.engine.plan.save(cfg["start_plan"])
        phases.append(times)
        cpus.append(cpu)
        layouts.append(sorted(g for g, d in opt.engine.layout().items() if d["compress"]))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    online = opt.online
    keep = ("step", "switched", "gain", "current_s", "best_s", "bandwidth_Bps", "latency_s",
            "judged", "verdict", "step_s_old", "step_s_new", "refused_since", "exploring",
            "candidates", "trying", "explored", "chose", "step_s", "voided")
    history = [{k: v for k, v in h.items() if k in keep}
               for h in (online.history if online is not None else [])]
    out = {"phases": phases, "cpu": cpus, "wall": walls, "start_s": start_s, "compressed": layouts,
           "history": history, "after_steps": AFTER_STEPS,
           "explore_steps": online.settings.explore_steps if online is not None else 0,
           "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
    opt.close()
    return out


class Hog:
    """A process spinning on one core (``start``/``stop``): a neighbour's busy job."""

    def __init__(self, core: int) -> None:
        self.core, self.proc = core, None

    def set(self, on: bool) -> None:
        """Start (on) or stop the hog; a no-op when it already is so."""
        import subprocess

        if on and self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{self.core}}})\n"
                 "while True: pass"])
        elif not on and self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def run_job(config: str, a: argparse.Namespace, rates, start_plan: str, hogs) -> dict:
    """One configuration's job over the emulated network, the link (and the hog)
    changed between phases; rank 0's step times, the switches, whether the ranks
    agree."""
    from hipress_like.launch import netem
    from hipress_like.launch.launch import run_workers

    netem.set_rate(a.ranks, rates[0])
    hog = Hog(a.hog_rank % (os.cpu_count() or 1))
    hog.set(bool(hogs[0]))
    flags = tempfile.mkdtemp(prefix="hipress-adaptive-")
    cfg = {"config": config, "hidden": a.hidden, "lr": 0.05, "batch": a.batch,
           "check_every": a.check_every, "margin": a.margin, "flags": flags,
           "phases": [a.steps] * len(rates), "wait_s": a.timeout, "start_plan": start_plan,
           "pin": a.pin}
    box: dict = {}

    def go():
        try:
            box["res"] = run_workers(adaptive_job, a.ranks, args=(cfg,), timeout=a.timeout,
                                     netns=True)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["err"] = e

    th = threading.Thread(target=go)
    t0 = time.time()
    th.start()
    try:
        for k in range(1, len(rates)):
            if not _wait_file(os.path.join(flags, f"ready-{k}"), a.timeout, th.is_alive):
                break
            netem.set_rate(a.ranks, rates[k])
            hog.set(bool(hogs[k]))
            open(os.path.join(flags, f"rate-{k}"), "w").close()
        th.join()
    finally:
        hog.set(False)
        shutil.rmtree(flags, ignore_errors=True)
    if "err" in box:
        raise box["err"]
    res = box["res"]
    r0 = res[0]
    return {"phase_s": [sum(p) for p in r0["phases"]],
            "total_s": sum(sum(p) for p in r0["phases"]),
            "after_steps": r0["after_steps"],
            "start_s": r0["start_s"], "job_s": time.time() - t0,
            "switches": [h["step"] for h in r0["history"]
                         if h.get("switched") and "judged" not in h and "trying" not in h],
            "explorations": [h["step"] for h in r0["history"] if h.get("exploring")],
            "reverts": [h["step"] for h in r0["history"] if h.get("verdict") == "reverted"],
            "restores": [h["step"] for h in r0["history"] if h.get("verdict") == "restored"],
            "history": r0["history"], "compressed": r0["compressed"],
            "identical": len({r["digest"] for r in res}) == 1,
            "steps_s": r0["phases"], "wall": r0["wall"],
            # every step's CPU time (the process's threads), the mean over ranks
            "cpu_s": [[statistics.mean(xs) for xs in zip(*(r["cpu"][k] for r in res))]
                      for k in range(len(r0["cpu"]))]}


def main(argv=None) -> int:
    """Run every configuration through the link changes; print the ratios; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rates", default="10gbit,1gbit,200mbit,10gbit",
                    help="the link's rate in each phase, comma-separated (tc syntax)")
    ap.add_argument("--steps", type=int, default=40, help="steps per phase")
    ap.add_argument("--hidden", type=int, default=512, help="DigitsNet's hidden width")
    ap.add_argument("--batch", type=int, default=16, help="images per rank per step")
    ap.add_argument("--check-every", type=int, default=5, help="Adaptive(check_every=...)")
    ap.add_argument("--margin", type=float, default=0.1, help="Adaptive(margin=...)")
    ap.add_argument("--hog", default=None,
                    help="per phase, 1 where a CPU hog runs beside rank --hog-rank "
                         "(comma-separated, e.g. 0,1,0; default: none)")
    ap.add_argument("--hog-rank", type=int, default=1, help="the rank whose core the hog takes")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                    help="rank r on core r %% cores (default: with --hog)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    ap.add_argument("--out", default="results/adaptive.json")
    ap.add_argument("--summarize", default=None, metavar="JSON",
                    help="no run: read an earlier run's JSON (its rows and arguments), print "
                         "its tables and ratios again and write them to --out")
    ap.add_argument("--plot", default=None,
                    help="the plot's path (default: --out with .png; '' for none)")
    a = ap.parse_args(argv)
    if a.plot is None:
        a.plot = os.path.splitext(a.out)[0] + ".png"
    if a.summarize:  # the arguments and rows of the run read, the outputs of this call
        with open(a.summarize) as f:
            old = json.load(f)
        old = old.get("data", old)  # a bench JSON, or a docs/results record of one
        keep = {k: getattr(a, k) for k in ("out", "plot", "summarize")}
        a = argparse.Namespace(**{**old["args"], "hog": old["args"].get("hog"),
                                  "hog_rank": old["args"].get("hog_rank", 1),
                                  "pin": old["args"].get("pin", False), **keep})
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    hogs = [0] * len(rates) if a.hog is None else [int(x) for x in a.hog.split(",")]
    if len(hogs) != len(rates) or any(h not in (0, 1) for h in hogs):
        ap.error(f"--hog takes a 0 or 1 per phase ({len(rates)} phases), found {a.hog!r}")
    if a.pin is None:
        a.pin = any(hogs)
    if a.summarize:
        return summarize(old["rows"], a, rates, hogs, configs)
    if os.geteuid() != 0 or shutil.which("tc") is None:
        print("bench/adaptive.py needs root and iproute2's tc (network namespaces shaped with "
              "tc tbf): run it as root on a host with iproute2", file=sys.stderr)
        return 2
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or "adaptive" not in configs:
        ap.error(f"--configs takes 'adaptive' and any of {FIXED}, found {configs}")
    configs = ["adaptive"] + [c for c in configs if c != "adaptive"]  # start needs its plan
    from hipress_like.launch import netem

    rows: dict = {c: [] for c in configs}
    netem.up(a.ranks, rates[0])
    plans = tempfile.mkdtemp(prefix="hipress-adaptive-plans-")
    try:
        for rep in range(a.repeats):
            start_plan = os.path.join(plans, f"start-{rep}.json")  # written by adaptive
            for c in job_order(configs, rep):
                r = run_job(c, a, rates, start_plan, hogs)
                rows[c].append(r)
                print(f"[{rep + 1}/{a.repeats}] {c:8s} phases "
                      + " ".join(f"{s:7.2f}" for s in r["phase_s"])
                      + f"  total {r['total_s']:7.2f} s  start-up {r['start_s']:5.1f} s  "
                      f"switches at {r['switches']} reverted at {r['reverts']} restored at "
                      f"{r['restores']}  identical {r['identical']}", flush=True)
    finally:
        netem.down()
        shutil.rmtree(plans, ignore_errors=True)
    return summarize(rows, a, rates, hogs, configs)


def job_order(configs, rep: int) -> list:
    """The order of repeat ``rep``'s jobs: the adaptive job with "start" right after it
    (it runs the plan the adaptive job saved) as one block, every other configuration a
    block of its own, the blocks rotated by ``rep``, so that no configuration always
    runs in the same place of a repeat. On the test host the job run first in every
    repeat, the adaptive one, measured 5-7 % slower per step than "start" on the same
    plan (phase 1, 4 ranks, steps without a check: 82.6 ms against 77.5); with the
    order rotated, 80.5 against 81.7."""
    blocks = [[c for c in ("adaptive", "start") if c in configs]]
    blocks += [[c] for c in configs if c not in ("adaptive", "start")]
    k = rep % len(blocks)
    return [c for b in blocks[k:] + blocks[:k] for c in b]


def summarize(rows: dict, a: argparse.Namespace, rates, hogs, configs) -> int:
    """The settled windows, the tables and issue 49's ratios of ``rows`` (every
    configuration's repeats); printed, written as JSON to ``--out``, plotted."""
    # the settled windows: per repeat and phase, from the adaptive job's decisions
    for rep in range(a.repeats):
        starts = settle_starts(rows["adaptive"][rep], a.steps, len(rates), a.check_every)
        for c in configs:
            r = rows[c][rep]
            r["settle_from"] = starts
            r["settled_s"] = [sum(p[k0:]) if k0 < len(p) else math.nan
                              for p, k0 in zip(r["steps_s"], starts)]
            # the mean step of the settled window: repeats' windows differ in length, so
            # a median of their sums would compare a mix of lengths
            r["settled_step_s"] = [statistics.mean(p[k0:]) if k0 < len(p) else math.nan
                                   for p, k0 in zip(r["steps_s"], starts)]

    def med(c, key, k=None):
        return pooled(rows, (c,), key, k)

    print(f"\n{a.ranks} ranks, {a.steps} steps a phase at {' -> '.join(rates)}"
          + (f", CPU hog beside rank {a.hog_rank} in phases "
             f"{[k + 1 for k, h in enumerate(hogs) if h]}" if any(hogs) else "")
          + f", DigitsNet(hidden={a.hidden}); seconds (median of {a.repeats}):")
    head = "config    " + "".join(f"  phase {k + 1} ({rates[k]})" for k in range(len(rates)))
    print(head + "      total")
    for c in configs:
        print(f"{c:8s}  " + "".join(f"  {med(c, 'phase_s', k):18.2f}" for k in range(len(rates)))
              + f"  {med(c, 'total_s'):9.2f}")
    goals = []
    if "start" in rows:
        ratio = med("start", "total_s") / med("adaptive", "total_s")
        goals.append(("total: start / adaptive", ratio, ">= 1.3", ratio >= 1.3))
    fixed = [c for c in configs if c in FIXED]
    for k in range(len(rates)):
        if not fixed:
            break
        groups = plan_groups(rows, fixed, k)
        key = "settled_step_s"
        best = min(groups, key=lambda g: pooled(rows, g, key, k))
        ratio = med("adaptive", key, k) / max(pooled(rows, best, key, k), 1e-9)
        froms = sorted({r["settle_from"][k] for r in rows["adaptive"]})
        have = sum(not math.isnan(r["settled_s"][k]) for r in rows["adaptive"])
        of = "" if have == a.repeats else f", {have} of {a.repeats} repeats"
        goals.append((f"phase {k + 1} settled (from step {'/'.join(map(str, froms))}{of}): "
                      f"adaptive / best fixed plan ({'+'.join(best)})", ratio, "<= 1.10",
                      ratio <= 1.10))
        if len(best) > 1:  # the same plan's jobs pooled: the luckier one alone, for the record
            lucky = min(best, key=lambda c: med(c, key, k))
            goals.append((f"phase {k + 1} settled: adaptive / {lucky} alone (the faster of the "
                          "jobs of one plan)", med("adaptive", key, k)
                          / max(med(lucky, key, k), 1e-9), "(info)", None))
        lucky = min(fixed, key=lambda c: med(c, "settled_s", k))
        goals.append((f"phase {k + 1} settled, medians of the windows' sums: adaptive / "
                      f"{lucky}", med("adaptive", "settled_s", k)
                      / max(med(lucky, "settled_s", k), 1e-9), "(info)", None))
        whole = min(fixed, key=lambda c: med(c, "phase_s", k))
        ratio = med("adaptive", "phase_s", k) / max(med(whole, "phase_s", k), 1e-9)
        goals.append((f"phase {k + 1} whole: adaptive / best fixed ({whole})", ratio,
                      "(info)", None))
    identical = all(r["identical"] for v in rows.values() for r in v)
    goals.append(("ranks bitwise identical", identical, "True", identical))
    print("\nratios (issue 49's goals):")
    for name, value, target, ok in goals:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        verdict = "" if ok is None else ("met" if ok else "NOT met")
        print(f"  {name:64s} {shown:>6s}  goal {target:7s} {verdict}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "rates": rates, "rows": rows,
                   "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "goals": [dict(zip(("name", "value", "target", "pass"), g)) for g in goals]},
                  f, indent=1)
    print(f"wrote {a.out}")
    if a.plot:
        plot(rows, rates, a.steps, a.plot)
        print(f"wrote {a.plot}")
    return 0


def plan_groups(rows: dict, fixed, k: int) -> list:
    """The fixed configurations grouped by the plan they ran in phase ``k``: those that
    compressed nothing there in every repeat (``start`` whose profile chose to send
    everything as it is, and ``none``) ran one plan, and are one group; every other
    configuration is a group of its own. Two jobs of one plan differ by the host's noise
    alone (on the 2-core host by up to 25 % within a repeat), and the faster of two such
    medians is a biased estimate of that plan's time: the pooled median is not."""
    bare = [c for c in fixed
            if all("compressed" in r and not r["compressed"][k] for r in rows[c])]
    return ([tuple(bare)] if bare else []) + [(c,) for c in fixed if c not in bare]


def pooled(rows: dict, group, key: str, k: Optional[int] = None) -> float:
    """The median of ``key`` (in phase ``k``; None: a whole-job figure) over every repeat
    of every configuration in ``group``. A repeat whose adaptive job decided until the
    phase's end has no settled window (NaN in every configuration alike): the median is
    of the repeats that have one."""
    vals = [r[key] if k is None else r[key][k] for c in group for r in rows[c]]
    vals = [v for v in vals if not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def settle_starts(adaptive: dict, steps: int, phases: int, check_every: int) -> list:
    """Per phase, the first step (0-based, in the phase) of its settled window: after
    every decision the adaptive job began in the phase, before its last step, ended
    (an exploration ends at its "chose" entry, a switch's trial at its last "judged"
    one), and no sooner than ``check_every + AFTER_STEPS`` steps in; the whole phase
    when a decision ran past its end."""
    hist = adaptive["history"]
    floor = check_every + adaptive["after_steps"]
    began = sorted(h["step"] for h in hist if h.get("exploring") or (
        h.get("switched") and not ({"trying", "chose", "judged"} & set(h))))
    ends = sorted(h["step"] for h in hist if "chose" in h or "judged" in h)
    out = []
    for k in range(phases):
        lo, hi = k * steps, (k + 1) * steps
        last = lo
        for b in (b for b in began if lo <= b < hi):  # begun at hi: runs in the next
            nxt = min((x for x in began if x > b), default=math.inf)
            # (a void exploration ends where the next one begins: ``<= nxt``)
            last = max(last, max((e for e in ends if b <= e <= nxt), default=b))
        out.append(min(steps, max(floor, last - lo)))
    return out


def plot(rows: dict, rates, steps: int, path: str) -> None:
    """Step time against training time (the sum of step times, link changes left
    out), first repeat of every configuration; the adaptive job's phase
    boundaries, switches (dashed), reverts (dotted) and explorations marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for c, reps in rows.items():
        r = reps[0]
        ts = [t for p in r["steps_s"] for t in p]
        xs, acc = [], 0.0
        for t in ts:
            acc += t
            xs.append(acc)
        ax.plot(xs, [1e3 * t for t in ts], lw=1.6 if c == "adaptive" else 1.0,
                label=c, zorder=3 if c == "adaptive" else 2)
        if c != "adaptive":
            continue
        for k in range(1, len(rates)):
            ax.axvline(xs[k * steps - 1], color="grey", lw=0.8)
            ax.text(xs[k * steps - 1], 1.0, f" {rates[k]}", transform=ax.get_xaxis_transform(),
                    va="top", fontsize=8, color="grey")
        ax.text(0, 1.0, f" {rates[0]}", transform=ax.get_xaxis_transform(), va="top",
                fontsize=8, color="grey")
        for key, style, name in (("switches", "--", "switch"), ("reverts", ":", "revert"),
                                 ("restores", "-.", "restore"),
                                 ("explorations", (0, (1, 4)), "exploration starts")):
            for i, st in enumerate(r.get(key, [])):  # a check at step st follows step st's
                ax.axvline(xs[min(st, len(xs)) - 1], color="C0", ls=style, lw=1.0,
                           label=name if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("training time, s (sum of step times)")
    ax.set_ylabel("step time, ms")
    ax.set_title("plan='adaptive' while tc changes the link (first repeat)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
