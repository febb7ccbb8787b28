"""End-to-end training benchmark: this project vs. PyTorch DDP (and its hooks) vs. the floor.

Every configuration runs the same job: 4 ranks train a model on
scikit-learn's digits (upsampled to 32x32, a disjoint random batch per rank
and step, SGD with momentum) for a fixed number of steps. Reported per
configuration: the median step time over the timed steps (after warm-up),
its ratio to the no-communication floor and to the DDP baselines, and the
test accuracy reached after the fixed budget, and the CPU time one rank
spends per timed step (all its threads: autograd, the engine, gloo). With
more ranks than cores the step is CPU-bound, and that column says where a
configuration's time goes. The learning rate decays to 0
(cosine) over each run's steps.

The timed runs are short (45 steps), too short for the VGG-style model to
learn digits, so accuracy is judged by separate accuracy runs that follow
them: ``--acc-configs`` (DDP and the fastest configuration of this project
by default) for ``--acc-steps`` (300) steps each, on loopback even under
``--netem``: the arithmetic, and so the accuracy, does not depend on the link,
and loopback is the fastest place to run it.

Configurations:
  floor            each rank steps its own optimizer, no communication
  ddp              DistributedDataParallel, no hook (25 MB buckets)
  ddp-fp16         DDP + fp16_compress_hook
  ddp-powersgd1/4  DDP + powerSGD_hook rank 1 / 4 (one 512 MB bucket: several
                   buckets in flight abort on gloo in torch 2.13)
  ddp-powersgd1f/4f  the same with torch's fused SGD (``fused=True``): the hook
                   with the fastest update torch has on a CPU
  hp-<strategy>-<compressor>  hipress_like.torch.DistributedOptimizer, PS or
                   Ring x onebit, terngrad, dgc, powersgd (rank 4, the default),
                   powersgd1 (rank 1, as the fastest hook), powersgd2 (rank 2),
                   powersgd1bf and powersgd2bf (ranks 1 and 2 with the error
                   memory in bfloat16, error_dtype="bfloat16"; powersgd2bf is
                   what compression="auto" chooses among), natural (C_nat
                   workers, the aggregate re-encoded with the worker's C_nat)
                   and natural2 (C_nat both ways, compression_back=natural:
                   Natural Compression Alg. 1) (engine default plan)
  hp-<strategy>-auto          the same with compression="auto", plan="auto": a
                   compressor per gradient (onebit, TernGrad, DGC, PowerSGD or
                   none) chosen from a profile taken when the optimizer is built
  hp-<strategy>-plan          the same with a plan file (``--plan STRATEGY=PATH``,
                   e.g. ``hipress-profile advise --write-plan``), run as the
                   advisor's ``DistributedOptimizer(..., strategy=..., plan=PATH)``
  hp-none          the same with Compression.none: every gradient in the
                   engine's allreduce lane, the engine's overhead against DDP
  hvd-...          over Horovod (bench/_horovod_rows.py): Horovod's own optimizer
                   (hvd-none, hvd-fp16) and this project on the Horovod transport;
                   a -cycle<MS> suffix (hvd-none-cycle5) sets HOROVOD_CYCLE_TIME

Links: loopback by default; ``--netem`` runs rank i inside network namespace
``h<i>`` over emulated 1 Gbit/s links (bench/netem.py; created and removed
by this script unless they already exist; needs root).

    python bench/train.py --model vgg --netem --repeats 5   # the headline run
    python bench/train.py --model resnet18 --steps 20 --configs floor,ddp,hp-ps-onebit \\
        --acc-steps 0                                    # timing only
    python bench/train.py --model vgg --netem --configs hp-ring-powersgd1,hvd-hp-ring-powersgd1 \\
        --repeats 3 --acc-steps 0             # alternated three times, medians reported

Each row also carries its bound (``bench/bound.py``: the floor plus the
compressor arithmetic one rank does at this world size plus the NaN/Inf
scans, less what a fused update saves, timed on one thread in this process
after the runs and scaled to this run's floor row), ``step/bound`` and the
scaling efficiency ``floor / step``
(HiPress's measure: throughput on N workers over N times one worker's, with
the floor as the one worker). The headline ratios are medians over the
``--repeats`` alternated runs (pass 5 for figures to judge), paired run by
run, with their spread (min-max) printed and in the JSON (``headline``; each
row's ``ms_spread``). The bounds are timed when the floor row runs.

Writes results/train_<model>.json. Timing lives here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, HERE)  # netem.py

# "powersgd" is the compressor's default rank (4); "powersgd1" is rank 1, the
# rank of the fastest DDP hook, so the two PowerSGDs are compared like for like;
# "powersgd2" is rank 2, the lowest rank plan="auto" chooses among; "powersgd1bf" and
# "powersgd2bf" keep PowerSGD's error memory in bfloat16 (error_dtype="bfloat16").
HP_COMPRESSORS = ("onebit", "terngrad", "dgc", "powersgd", "powersgd1", "powersgd2",
                  "powersgd1bf", "powersgd2bf", "natural", "natural2", "thc")
# issue 24: top-k at CR 0.01 by an Allgather of values and indices (LWTopk), against
# AR-Topk (STAR-Topk: one rank's indices broadcast, values summed by a ring or a tree
# allreduce), and the alpha-beta selector's pick per gradient (collective="auto")
ARTOPK_ROWS = {"hp-ag-topk": ("topk", "allgather"), "hp-art-ring": ("star_topk", "ring"),
               "hp-art-tree": ("star_topk", "tree"), "hp-art-select": ("star_topk", "auto")}
ARTOPK_RATIO = 0.01
# rows that send the aggregate back with a master compressor (compression_back)
BACK = {"natural2": "natural"}
DDP_CONFIGS = ("ddp", "ddp-fp16", "ddp-powersgd1", "ddp-powersgd4", "ddp-powersgd1f",
               "ddp-powersgd4f")
# rows that run a plan file given with --plan STRATEGY=PATH (not in "all")
PLAN_CONFIGS = {"hp-ps-plan": "ps", "hp-ring-plan": "ring"}
# The plan leaves small gradients uncompressed, so momentum must stay in the
# optimizer for all of them: DGC runs as a sparsifier with its own momentum
# off, its sparsity ramped up over the first 5 steps (DGC Sec. 3.4).
PARAMS = {"dgc": {"momentum": 0.0, "warmup_steps": 5}, "powersgd1": {"rank": 1},
          "powersgd2": {"rank": 2}, "powersgd1bf": {"rank": 1, "error_dtype": "bfloat16"},
          "powersgd2bf": {"rank": 2, "error_dtype": "bfloat16"}}
# the registry name of a row compressor that is another's with other parameters
REGISTRY_NAME = {"powersgd1": "powersgd", "powersgd2": "powersgd", "powersgd1bf": "powersgd",
                 "powersgd2bf": "powersgd", "natural2": "natural"}
# digits has 10 balanced classes: a model that has learned nothing scores ~10%.
CHANCE = 100.0 / 10


def all_configs():
    cfgs = ["floor", *DDP_CONFIGS, "hp-none"]
    for s in ("ps", "ring"):
        cfgs += [f"hp-{s}-{c}" for c in HP_COMPRESSORS] + [f"hp-{s}-auto"]
    cfgs += list(ARTOPK_ROWS)
    import _horovod_rows

    return cfgs + list(_horovod_rows.CONFIGS)


# -- one rank ------------------------------------------------------------------------------

def _digits(seed=0):
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.from_numpy(d.images.astype("float32") / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=32, mode="bilinear", align_corners=False)
    y = torch.from_numpy(d.target).long()
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed,
                                          stratify=d.target)
    return xtr, ytr, xte, yte


def worker(cfg):
    """Run one configuration on this rank (env:// rendezvous); rank 0 writes the result."""
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from models import MODELS

    import hipress_like.torch as hpt

    torch.set_num_threads(1)
    name = cfg["config"]
    if name.startswith("hvd-"):  # the rows over Horovod: join as under horovodrun
        import _horovod_rows

        _horovod_rows.enter_horovod_job(_horovod_rows.split_cycle(name)[1])
        name = _horovod_rows.hp_name(name)  # hvd-hp-ps-onebit runs as hp-ps-onebit
    hpt.init()
    rank, size = hpt.rank(), hpt.size()
    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(0)
    model = MODELS[cfg["model"]](num_classes=10, in_channels=1)
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    net, hook_state, opt = model, None, None
    fused_sgd = name.startswith("ddp-powersgd") and name.endswith("f")  # ddp-powersgd1f
    base = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9,
                           fused=True if fused_sgd else None)
    if name.startswith("ddp"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel as DDP

        cap = 512 if "powersgd" in name else 25
        net = DDP(model, bucket_cap_mb=cap)
        if name == "ddp-fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name.startswith("ddp-powersgd"):
            hook_state = psgd.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=int(
                                                name.rstrip("f")[-1]),
                                            start_powerSGD_iter=2)
            net.register_comm_hook(hook_state, psgd.powerSGD_hook)
        opt = base
    elif name in ARTOPK_ROWS:
        comp, coll = ARTOPK_ROWS[name]
        opt = hpt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=hpt.Compression.get(comp,
                                                                       ratio=ARTOPK_RATIO),
                                       plan=None, collective=coll)
    elif name in PLAN_CONFIGS:  # a plan file naming each gradient's compressor
        opt = hpt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       strategy=PLAN_CONFIGS[name], plan=cfg["plan"])
    elif name.startswith("hp-"):
        _, strategy, comp = name.split("-", 2) if name != "hp-none" else ("hp", "ps", "none")
        plan = "auto" if comp == "auto" else None
        params = PARAMS.get(comp, {})
        back = BACK.get(comp)
        comp = REGISTRY_NAME.get(comp, comp)
        # "auto": the cost model picks a compressor per gradient (or none)
        spec = "auto" if comp == "auto" else hpt.Compression.get(comp, **params)
        opt = hpt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=spec, strategy=strategy, plan=plan,
                                       compression_back=back)
    elif name.startswith("hvd-"):  # Horovod's own DistributedOptimizer
        opt = _horovod_rows.horovod_optimizer(base, model, name)
    else:  # floor: the same compute, no communication at all
        opt = base
    times, losses, phases = [], [], []
    # this project's and Horovod's optimizers average in synchronize(), which step()
    # calls: its return is marked, splitting step() into the averaging's tail and the
    # update without calling the two apart (step() alone may fuse them: fused_update.py)
    synced = hasattr(opt, "synchronize") and hasattr(opt, "skip_synchronize")
    synced_at = []
    if synced:
        def _marked(real=opt.synchronize):
            ok = real()
            synced_at.append(time.perf_counter())
            return ok
        opt.synchronize = _marked
    total = cfg["warmup"] + cfg["steps"]
    # Cosine decay to 0 over the budget: the end-of-budget accuracy then settles
    # instead of moving with the last steps' noise (every configuration alike).
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
    for step in range(total):
        if step == cfg["warmup"]:
            cpu0 = time.process_time()  # every thread of this rank: engine, gloo, autograd
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        g = torch.Generator().manual_seed(cfg["seed"] * 100003 + step * size + rank)
        idx = torch.randint(0, len(xtr), (cfg["batch"],), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
        loss.backward()
        t1 = time.perf_counter()
        synced_at.clear()
        opt.step()
        t2 = synced_at[-1] if synced_at else t1  # the tail of the averaging ends
        times.append(time.perf_counter() - t0)
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        sched.step()
        losses.append(loss.item())
    timed = times[cfg["warmup"]:]
    # the training steps' CPU only (the test-set evaluation below is not a step)
    # page faults too: a buffer allocated afresh each step is faulted in page by page
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    cpu = torch.tensor([(time.process_time() - cpu0) / max(1, len(timed)) * 1e3,
                        faults / max(1, len(timed))], dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        acc = sum((model(xte[i:i + 120]).argmax(1) == yte[i:i + 120]).sum().item()
                  for i in range(0, len(xte), 120)) / len(xte) * 100
    dist.all_reduce(cpu)  # the mean over ranks
    cpu_ms, faults_per_step = (v / size for v in cpu.tolist())
    result = {"config": cfg["config"], "model": cfg["model"], "rank": rank, "size": size,
              "ms_per_step": statistics.median(timed) * 1e3,
              "ms_steps": [t * 1e3 for t in timed], "accuracy": acc,
              "cpu_ms_per_step": cpu_ms, "minflt_per_step": faults_per_step,
              # medians over the timed steps: forward + backward (DDP's hooks and this
              # project's submits run inside it), the averaging's tail after backward
              # (synchronize; 0 for the rows without one), and the optimizer's update
              "phases_ms": {k: statistics.median(ph[i] for ph in phases[cfg["warmup"]:]) * 1e3
                            for i, k in enumerate(("backward", "tail", "update"))},
              "final_loss": statistics.mean(losses[-5:]), "steps_total": total,
              "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    if name.startswith("hp-"):
        layout = opt.engine.layout()
        result["compressed"] = sorted(n for n, v in layout.items() if v["compress"])
        result["compressors"] = {n: v.get("compressor") for n, v in layout.items()
                                 if v["compress"]}
        result["collectives"] = opt.engine.collectives
        # what a bound depends on, per compressed gradient (add_bounds matches rows by it)
        result["layout"] = {n: [v["compressor"], v["workflow"], v["partitions"]]
                            for n, v in layout.items() if v["compress"]}
        plan = opt.engine.plan
        if plan is not None and "trials" in plan.meta:  # plan="auto": what it measured
            result["plan_trials"] = dict(plan.meta["trials"], chosen=plan.meta["trial_chosen"])
        opt.close()
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(result, f)
    # DDP teardown gotcha (ENVIRONMENT.md): drop DDP, collect, barrier, destroy.
    del net, opt
    gc.collect()
    dist.barrier()
    hpt.shutdown()


# -- the parent ----------------------------------------------------------------------------

def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg, nprocs, netem, timeout):
    """Start ``nprocs`` ranks of ``worker(cfg)``; return rank 0's result dict.

    Loopback: plain subprocesses with env:// variables. ``netem``: rank i in
    namespace h<i> through ``bench/netem.py``'s ``run_in_namespaces``.
    """
    fd, path = tempfile.mkstemp(prefix="hp-train-", suffix=".json")
    os.close(fd)
    cfg = dict(cfg, result=path)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)]
    pypath = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    try:
        if netem:
            import netem as nm

            rcs = [nm.run_in_namespaces(nprocs, cmd, env={"PYTHONPATH": pypath},
                                        port=_free_port(), timeout=timeout)]
        else:
            rcs = _run_local(cmd, nprocs, pypath, timeout)
        with open(path) as f:
            text = f.read()
        if not text:
            raise RuntimeError(f"{cfg['config']}: ranks exited with {rcs} and no result")
        return json.loads(text)
    finally:
        os.unlink(path)


def _run_local(cmd, nprocs, pypath, timeout):
    from hipress_like.launch.launch import own_process_group

    port = str(_free_port())
    procs = []
    for r in range(nprocs):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1", PYTHONPATH=pypath)
        procs.append(subprocess.Popen(cmd, env=env, **own_process_group()))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if time.monotonic() > deadline or failed:
            time.sleep(5 if failed else 0)  # let the others report their own errors
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    return [p.wait() for p in procs]


def _ensure_netem(nprocs, rate):
    """Bring the namespaces up for this run. Never reuse running ones: another benchmark's
    hosts share the links and the CPU; ``up`` waits for that session to end instead."""
    import netem as nm

    nm.up(nprocs, rate)
    return True


def _print_goals(goals, headline=None):
    """Print each goal; a goal may carry a fifth item, the (min, max) of its ratio over the
    alternated runs, printed beside it and kept in ``headline`` (a list) for the JSON."""
    for label, v, target, higher, *spread in goals:
        met = v >= target if higher else v <= target
        extra = f"  (runs {spread[0][0]:.2f}-{spread[0][1]:.2f})" if spread and spread[0] else ""
        print(f"  {label:<32} {v:5.2f}  {'met' if met else 'NOT met'}{extra}")
        if headline is not None:
            headline.append({"goal": label, "value": v, "target": target, "met": met,
                             "spread": list(spread[0]) if spread and spread[0] else None})


def _ratio(num_row, den_row):
    """(median, (min, max)) of ``num / den`` ms per step: paired run by run over the
    alternated runs where both rows have them (``runs_ms``), else the rows' medians."""
    import bound

    a, b = num_row.get("runs_ms"), den_row.get("runs_ms")
    if a and b and min(len(a), len(b)) > 1:
        med, lo, hi = bound.paired_ratio(a, b)
        return med, (lo, hi)
    return num_row["ms_per_step"] / den_row["ms_per_step"], None


def is_auto_candidate(comp: str) -> bool:
    """Whether the row compressor ``comp`` (``HP_COMPRESSORS``) is one that plan="auto"
    chooses among on the CPU (``tuning.auto.DEFAULT_CANDIDATES``): PowerSGD with the
    candidates' rank and error memory.

    Example:
        >>> is_auto_candidate("powersgd2bf"), is_auto_candidate("powersgd1bf")
        (True, False)
        >>> is_auto_candidate("powersgd2")
        False
    """
    from hipress_like.compressors.powersgd import PowerSGD
    from hipress_like.tuning.auto import DEFAULT_CANDIDATES

    name = REGISTRY_NAME.get(comp, comp)
    if name not in DEFAULT_CANDIDATES:
        return False
    if name == "powersgd":  # a parameter left out is the compressor's default
        default = PowerSGD().params()
        return ({**default, **PARAMS.get(comp, {})}
                == {**default, **DEFAULT_CANDIDATES[name]})
    return comp not in BACK  # natural2 sends the aggregate back compressed: another row


def _floor_and_auto_goals(by, best_hp, floor, rows, headline=None):
    """Issue 19's goals, judged where this host can judge them: the floor by wall
    time with a core per rank (2 ranks), by CPU time per rank with 4 ranks on 2
    cores (a step's wall time is then about twice one rank's CPU time); and
    plan="auto" (a compressor per gradient) against the fastest fixed row."""
    if not (best_hp and floor):
        return
    nprocs = rows[0].get("size", 0)
    v, spread = _ratio(best_hp, by["floor"])
    goals = [("within 1.3x of the floor", v, 1.3, False, spread)]
    if best_hp.get("bound_ms"):
        goals.append(("best row within 1.10x of its bound", best_hp["ms_per_step"] /
                      best_hp["bound_ms"], 1.10, False))
    if best_hp.get("bound"):  # the default non-finite mode's scans, timed with the bound
        b = best_hp["bound"]
        goals.append(("NaN/Inf scan / floor < 0.01", b["scan"] / b["floor_ms"], 0.01, False))
    f_cpu, b_cpu = by["floor"].get("cpu_ms_per_step"), best_hp.get("cpu_ms_per_step")
    if f_cpu and b_cpu:
        goals.append(("CPU/rank within 1.3x of floor's", b_cpu / f_cpu, 1.3, False))
        if best_hp.get("bound_x_floor"):
            goals.append(("CPU/rank within 1.10x of bound's",
                          b_cpu / (f_cpu * best_hp["bound_x_floor"]), 1.10, False))
    per_gradient = ("-auto", "-plan")  # plan="auto" and the advisor's plan files
    fixed = [r for r in rows if r["config"].startswith("hp-") and
             not r["config"].endswith(per_gradient) and r["config"] != "hp-none"]
    # plan="auto" chooses among tuning.auto.DEFAULT_CANDIDATES only (rank-1 PowerSGD is
    # left out for accuracy): its ratio to the fastest fixed row of those is shown too
    candidates = [r for r in fixed if is_auto_candidate(r["config"].split("-", 2)[-1])]
    for auto in (r for r in rows if r["config"].endswith(per_gradient)):
        if fixed:
            best = min(fixed, key=lambda r: r["ms_per_step"])
            v, spread = _ratio(auto, best)
            goals.append((f"{auto['config']} vs {best['config']} <= 1.05", v, 1.05, False,
                          spread))
            cand = min(candidates, key=lambda r: r["ms_per_step"]) if candidates else best
            if auto["config"].endswith("-auto") and cand is not best:
                v, spread = _ratio(auto, cand)
                goals.append((f"{auto['config']} vs {cand['config']} (its candidates' "
                               "fastest) <= 1.05", v, 1.05, False, spread))
    _print_goals(goals, headline)
    if nprocs > (os.cpu_count() or 1):
        print(f"  ({nprocs} ranks share {os.cpu_count()} cores: judge the floor by CPU/rank "
              "here, by wall time with a core per rank, --nprocs 2)")


def _report(model, rows, budget, acc_rows=None):
    """Print the table and the goals; return the headline ratios (median, spread) for the JSON."""
    headline = []
    by = {r["config"]: r for r in rows}
    floor = by.get("floor", {}).get("ms_per_step")
    ddp = by.get("ddp", {}).get("ms_per_step")
    hooks = [by[c] for c in DDP_CONFIGS[1:] if c in by]
    best_hook = min(hooks, key=lambda r: r["ms_per_step"]) if hooks else None
    hp = [r for r in rows if r["config"].startswith("hp-")]
    best_hp = min(hp, key=lambda r: r["ms_per_step"]) if hp else None
    print(f"\n{model}: {rows[0]['params_m']:.1f}M parameters, {budget}")
    print(f"{'configuration':<20} {'ms/step':>9} {'spread':>11} {'x floor':>8} {'DDP/this':>9} "
          f"{'best hook/this':>15} {'test acc %':>11} {'CPU ms/rank':>12} {'bound':>7} "
          f"{'step/bound':>11} {'efficiency':>11} {'faults/step':>12}")
    for r in rows:
        ms = r["ms_per_step"]
        xf = f"{ms / floor:.2f}" if floor else "-"
        vd = f"{ddp / ms:.2f}" if ddp else "-"
        vh = f"{best_hook['ms_per_step'] / ms:.2f}" if best_hook else "-"
        acc = "-" if r["config"] == "floor" else f"{r['accuracy']:.1f}"
        cpu = f"{r['cpu_ms_per_step']:.0f}" if "cpu_ms_per_step" in r else "-"
        sp = "{:.0f}-{:.0f}".format(*r["ms_spread"]) if r.get("ms_spread") else "-"
        bd = f"{r['bound_ms']:.0f}" if r.get("bound_ms") else "-"
        sb = f"{ms / r['bound_ms']:.2f}" if r.get("bound_ms") else "-"
        ef = f"{floor / ms:.2f}" if floor else "-"
        pf = f"{r['minflt_per_step']:.0f}" if "minflt_per_step" in r else "-"
        print(f"{r['config']:<20} {ms:9.0f} {sp:>11} {xf:>8} {vd:>9} {vh:>15} {acc:>11} "
              f"{cpu:>12} {bd:>7} {sb:>11} {ef:>11} {pf:>12}")
    if best_hp and floor and ddp and best_hook:
        ms = best_hp["ms_per_step"]
        print(f"\nbest of this project: {best_hp['config']} ({ms:.0f} ms/step); best DDP hook: "
              f"{best_hook['config']} ({best_hook['ms_per_step']:.0f} ms/step)")
        if model != "vgg":
            print("  (issue 4 sets these goals for the VGG-style model only)")
        (vh, sh), (vd, sd) = _ratio(best_hook, best_hp), _ratio(by["ddp"], best_hp)
        goals = [
            ("vs best DDP hook >= 1.3x", vh, 1.3, True, sh),
            ("vs DDP without hook >= 3x", vd, 3.0, True, sd),
        ]
        _print_goals(goals, headline)
    _floor_and_auto_goals(by, best_hp, floor, rows, headline)
    if "hp-ag-topk" in by:
        ag = by["hp-ag-topk"]["ms_per_step"]
        for c in (c for c in ARTOPK_ROWS if c != "hp-ag-topk" and c in by):
            picks = sorted(set(by[c].get("collectives", {}).values()))
            print(f"  {c} vs hp-ag-topk (Allgather top-k, same CR): "
                  f"{ag / by[c]['ms_per_step']:.2f}x faster ({', '.join(picks) or '-'})")
    if best_hp and floor and ddp and best_hook:
        # the accuracy runs' budget when they cover DDP and the best, else the timed runs'
        acc_by = {r["config"]: r for r in acc_rows or ()}
        judged = acc_by if {"ddp", best_hp["config"]} <= acc_by.keys() else by
        where = (f"after {acc_by['ddp']['steps_total']} steps" if judged is acc_by
                 else "after the timed runs' budget")
        if "ddp" in judged:
            acc_ref = judged["ddp"]["accuracy"]
            d = acc_ref - judged[best_hp["config"]]["accuracy"]
            if acc_ref < 2 * CHANCE:  # nothing learned yet: a 0-point gap proves nothing
                print(f"  {'accuracy loss vs DDP <= 1pt':<28} {d:5.1f}  not judged: DDP is at "
                      f"{acc_ref:.1f}% (chance {CHANCE:.0f}%) {where}; raise --acc-steps")
            else:
                print(f"  {'accuracy loss vs DDP <= 1pt':<28} {d:5.1f}  "
                      f"{'met' if d <= 1.0 else 'NOT met'} ({where})")

    return headline

def _report_accuracy(acc_rows):
    if not acc_rows:
        return
    print(f"\naccuracy runs: {acc_rows[0]['steps_total']} steps on loopback, the same "
          f"configurations (accuracy does not depend on the link)")
    print(f"{'configuration':<20} {'test acc %':>11} {'final loss':>11} {'ms/step':>9}")
    for r in acc_rows:
        print(f"{r['config']:<20} {r['accuracy']:11.1f} {r['final_loss']:11.4f} "
              f"{r['ms_per_step']:9.0f}")


def _accuracy_runs(ns, rows):
    """Train the ``--acc-configs`` for ``--acc-steps`` steps on loopback; their rows."""
    hp = [r for r in rows if r["config"].startswith("hp-")]
    names = all_configs() if ns.acc_configs == "all" else ns.acc_configs.split(",")
    if "best" in names:
        names.remove("best")
        if hp:
            names.append(min(hp, key=lambda r: r["ms_per_step"])["config"])
    names = [c for c in dict.fromkeys(names) if c != "floor"]
    print(f"\naccuracy runs: {', '.join(names)}, {ns.acc_steps} steps each on loopback",
          flush=True)
    return _run_configs(ns, names, ns.acc_steps - ns.warmup, False)


def _run_configs(ns, names, steps, netem):
    """Launch each configuration in turn (``steps`` after ``ns.warmup``); their rows.

    A failing configuration is reported and skipped: it must not hide the others.
    """
    rows = []
    for c in names:
        cfg = dict(config=c, model=ns.model, steps=steps, warmup=ns.warmup, batch=ns.batch,
                   lr=ns.lr, seed=ns.seed)
        if c in PLAN_CONFIGS:
            cfg["plan"] = ns.plans[PLAN_CONFIGS[c]]
        t0 = time.perf_counter()
        try:
            r = launch(cfg, ns.nprocs, netem, ns.timeout)
        except Exception as e:
            print(f"  {c:<20} FAILED: {e}", flush=True)
            continue
        rows.append(r)
        print(f"  {c:<20} {r['ms_per_step']:8.0f} ms/step  acc {r['accuracy']:5.1f}%  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def round_order(names, rep):
    """The list as round ``rep`` (from 0) runs it: rotated by ``rep``, so that over the
    rounds no configuration always runs at the same place in the list (first after
    the namespaces come up, or right after the same neighbour), which a fixed order
    confounds with the configuration itself.

        >>> round_order(["a", "b", "c"], 0), round_order(["a", "b", "c"], 1)
        (['a', 'b', 'c'], ['b', 'c', 'a'])
        >>> round_order(["a", "b"], 3)
        ['b', 'a']
    """
    k = rep % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def _run_alternating(ns, names, steps, netem):
    """``_run_configs`` ``ns.repeat`` times over the whole list (so drifting host load
    weighs on every configuration alike), each round in ``round_order``; per
    configuration, the median run's row, with every run's ms/step in ``runs_ms``
    (in the order the rounds ran)."""
    runs = {}
    for rep in range(ns.repeat):
        if ns.repeat > 1:
            print(f"round {rep + 1} of {ns.repeat}", flush=True)
        for r in _run_configs(ns, round_order(names, rep), steps, netem):
            runs.setdefault(r["config"], []).append(r)
    rows = []
    for c in names:
        if c in runs:
            got = sorted(runs[c], key=lambda r: r["ms_per_step"])
            runs_ms = [r["ms_per_step"] for r in runs[c]]
            rows.append({**got[(len(got) - 1) // 2], "runs_ms": runs_ms,
                         "ms_spread": [min(runs_ms), max(runs_ms)]})
    return rows


def add_bounds(rows, model, nprocs, batch, repeats=5):
    """Attach each row's bound (``bench/bound.py``), step/bound and scaling efficiency.

    The bound's ratio to the floor is timed on one thread here; ``bound_ms`` is that
    ratio times this run's floor row (so host load weighs on both alike), or the
    bound's own milliseconds when there is no floor row. Rows without a bound
    (DDP hooks, plan="auto", Horovod) get none.
    """
    import bound

    by = {r["config"]: r for r in rows}
    floor = by.get("floor", {}).get("ms_per_step")
    b = bound.Bounds(model, repeats, batch)
    for r in rows:
        got = None if r["config"].startswith("hvd-") else b.bound(r["config"], nprocs)
        if floor:
            r["scaling_efficiency"] = floor / r["ms_per_step"]
        if got is None:
            continue
        r["bound_x_floor"] = got["bound_x_floor"]
        r["bound_ms"] = got["bound_x_floor"] * floor if floor else got["bound_ms"]
        r["step_over_bound"] = r["ms_per_step"] / r["bound_ms"]
        r["bound"] = {k: got[k] for k in (*bound.KINDS, "floor_ms", "arith_ms", "bound_ms")}
    bounds_by_layout(rows)
    return rows


def _layout_key(r):
    """What a row's bound depends on: its strategy and, per compressed gradient, the
    compressor (with its parameters), workflow and partitions; None without a record."""
    parts = r["config"].split("-")
    if len(parts) < 3 or parts[0] != "hp" or r.get("compressors") is None:
        return None
    per = r.get("layout") or {n: [c] for n, c in r["compressors"].items()}
    return parts[1], tuple(sorted((n, json.dumps(v)) for n, v in per.items()))


def bounds_by_layout(rows):
    """Give each row chosen at run time (plan="auto", a plan file) that has no bound the
    bound of a fixed row of this run whose engine laid the gradients out alike: the same
    strategy, and per compressed gradient the same compressor, workflow and partitions
    (then they do the same arithmetic). Such a row names it in ``bound_of``.

    Example:
        >>> same = {"compressors": {"w": "PowerSGD(rank=2)"}}
        >>> rows = [dict(same, config="hp-ring-powersgd2", ms_per_step=100.0,
        ...              bound_ms=90.0, bound_x_floor=1.2),
        ...         dict(same, config="hp-ring-auto", ms_per_step=99.0)]
        >>> bounds_by_layout(rows)[1]["bound_of"], rows[1]["step_over_bound"]
        ('hp-ring-powersgd2', 1.1)
    """
    bounded = {}
    for r in rows:
        key = _layout_key(r)
        if key is not None and r.get("bound_ms") and not r.get("bound_of"):
            bounded.setdefault(key, r)
    for r in rows:
        twin = bounded.get(_layout_key(r)) if not r.get("bound_ms") else None
        if twin is None:
            continue
        r.update({k: twin[k] for k in ("bound_x_floor", "bound_ms", "bound") if k in twin},
                 bound_of=twin["config"])
        r["step_over_bound"] = r["ms_per_step"] / r["bound_ms"]
    return rows


def report_saved(path, out=None):
    """Print the table and goals of the run saved at ``path`` (rows chosen at run time
    get a bound by layout, ``bounds_by_layout``); write it with them to ``out``."""
    with open(path) as f:
        saved = json.load(f)
    rows = bounds_by_layout(saved["rows"])
    saved["headline"] = _report(saved["model"], rows, saved["budget"],
                                saved.get("accuracy_rows"))
    _report_accuracy(saved.get("accuracy_rows"))
    if out:
        with open(out, "w") as f:
            json.dump(saved, f, indent=1)
        print(f"\nwrote {out}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="vgg", choices=["vgg", "resnet18"])
    ap.add_argument("--configs", default="all",
                    help=f"comma-separated subset of: {', '.join(all_configs())}")
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="timed steps (the table's accuracy "
                    "column is after warmup + steps; the goal uses --acc-steps)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="images per rank per step")
    ap.add_argument("--lr", type=float, default=0.05, help="peak learning rate (cosine "
                    "decay to 0 over each run's steps)")
    ap.add_argument("--acc-steps", type=int, default=300,
                    help="budget of the accuracy runs, which follow the timed ones on loopback "
                    "(the math does not depend on the link); 0 skips them")
    ap.add_argument("--acc-configs", default="ddp,best",
                    help="configurations given the accuracy budget: a comma-separated list; "
                    "'best' is the fastest hp- configuration of the timed runs; 'all'")
    ap.add_argument("--seed", type=int, default=0, help="seed of the batches each rank draws "
                    "(the model's initial weights are the same for every seed)")
    ap.add_argument("--netem", nargs="?", const="1gbit", default=None,
                    help="run in namespaces h0..h{N-1} over emulated links (default 1gbit)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--repeat", "--repeats", dest="repeat", type=int, default=1,
                    help="run the list this many times, alternating, and report each "
                    "configuration's median run and the headline ratios' median and spread "
                    "(a shared host's load drifts; issue 50 judges the ratios on 5)")
    ap.add_argument("--no-bound", action="store_true", help="skip timing each row's bound "
                    "(bench/bound.py) after the runs (timed only when the floor row runs)")
    ap.add_argument("--plan", action="append", default=[], metavar="STRATEGY=PATH",
                    help="a plan file for the hp-<strategy>-plan row (repeatable: ps=..., "
                    "ring=...)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", metavar="JSON", help="judge a saved run again (its rows, "
                    "bounds and accuracy runs; no new runs) and print the table and goals; "
                    "with --out, write the run with the new verdicts there")
    ns = ap.parse_args(argv)
    if ns.worker:
        worker(json.loads(ns.worker))
        return 0
    if ns.report:
        return report_saved(ns.report, ns.out)
    ns.plans = {}
    for item in ns.plan:
        strategy, sep, path = item.partition("=")
        if not sep or strategy not in PLAN_CONFIGS.values() or not os.path.isfile(path):
            ap.error(f"--plan {item!r}: give STRATEGY=PATH with STRATEGY ps or ring and an "
                     "existing plan file (hipress-profile advise --write-plan PATH)")
        ns.plans[strategy] = os.path.abspath(path)
    import _horovod_rows

    configs = all_configs() if ns.configs == "all" else ns.configs.split(",")
    known = set(all_configs()) | {c for c, s in PLAN_CONFIGS.items() if s in ns.plans}
    unknown = {c for c in set(configs) - known if not _horovod_rows.is_horovod_row(c)}
    if unknown:
        hint = "; hp-<strategy>-plan needs --plan STRATEGY=PATH" if unknown & set(
            PLAN_CONFIGS) else ""
        ap.error(f"unknown configs {sorted(unknown)}; known: {', '.join(sorted(known))}{hint}")
    if ns.acc_configs != "all":
        unknown = set(ns.acc_configs.split(",")) - known - {"best"}
        if unknown:
            ap.error(f"unknown --acc-configs {sorted(unknown)}; known: best, "
                     f"{', '.join(sorted(known))}")
    if ns.repeat < 1:
        ap.error(f"--repeat must be at least 1, found {ns.repeat}")
    if 0 < ns.acc_steps <= ns.warmup:
        ap.error(f"--acc-steps must exceed --warmup ({ns.warmup}), or be 0")
    created = _ensure_netem(ns.nprocs, ns.netem) if ns.netem else False
    if ns.netem and any(c.startswith("hvd-") for c in configs):
        import _horovod_rows

        _horovod_rows.netns_hosts(ns.nprocs)  # Horovod's gloo needs it (see there)
    link = f"namespaces over {ns.netem} links" if ns.netem else "loopback"
    budget = (f"{ns.nprocs} ranks on {link}, batch {ns.batch}/rank, {ns.warmup} warm-up + "
              f"{ns.steps} timed steps (median), accuracy after {ns.warmup + ns.steps} steps"
              + (f", the list run {ns.repeat} times alternating (median run)"
                 if ns.repeat > 1 else ""))
    print(f"bench/train.py: {ns.model}, {budget}", flush=True)
    try:
        rows = _run_alternating(ns, configs, ns.steps, bool(ns.netem))
    finally:
        if created:
            import netem as nm

            nm.down(ns.nprocs)
    acc_rows = _accuracy_runs(ns, rows) if rows and ns.acc_steps > 0 else []
    if rows and not ns.no_bound and any(r["config"] == "floor" for r in rows):
        add_bounds(rows, ns.model, ns.nprocs, ns.batch)  # scaled to this run's floor row
    headline = []
    if rows:
        headline = _report(ns.model, rows, budget, acc_rows)
        if ns.repeat < 5:
            print(f"\n(headline ratios from {ns.repeat} run(s) per configuration; a single "
                  "run moves by 15-20% on a shared host: --repeats 5 for ratios to judge)")
        import _horovod_rows

        _horovod_rows.report(rows)
        _report_accuracy(acc_rows)
        out = ns.out or os.path.join(ROOT, "results", f"train_{ns.model}"
                                     f"{'_netem' if ns.netem else ''}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"model": ns.model, "budget": budget, "rows": rows,
                       "accuracy_rows": acc_rows, "repeats": ns.repeat,
                       "headline": headline}, f, indent=1)
        print(f"\nwrote {out}")
        import _figures

        print(f"picture: {_figures.train_png(rows, out, f'bench/train.py: {ns.model}, {budget}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
