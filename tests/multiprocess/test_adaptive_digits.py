"""Accuracy: digits with plan="adaptive" through two link changes matches a fixed plan.

Two real ranks (gloo on loopback) train ``hipress_like.demo.DigitsNet`` on
digits (the demo's data split, model and SGD with momentum and cosine decay)
with 1-bit compression available. The link estimate is injected on a
schedule (``Adaptive(estimate=...)``, the tests' link-change mechanism):
100 Gbit/s for the first third of the steps, 10 Mbit/s for the second,
100 Gbit/s again for the last. The adaptive run must switch twice (to a plan
that compresses, and back, the second switch resetting the error-feedback
memory it cannot carry), keep both ranks bitwise identical, and end within
0.5 points of test accuracy of the same job on the fixed plan chosen at
start (the fast link's plan, what ``plan="auto"`` would have kept). So must
the same job with exploration on (the plans tried on real loopback steps
at each change). The fixed slow-link plan runs too, for the record.
"""
import pytest
import torch
import torch.nn.functional as F
from test_adaptive_plan import FAST, SLOW

import hipress_like.torch as hpt
from hipress_like.cost_model import Link, Plan, Profile
from hipress_like.demo import DigitsNet, load_digits_split
from hipress_like.demo.cli_digits import evaluate
from hipress_like.launch.launch import run_workers
from hipress_like.tuning.online import profile_plan
from hipress_like.tuning.profiler import profile_compressor

pytestmark = pytest.mark.slow

N = 2
EPOCHS, BATCH, LR, HIDDEN = 6, 16, 0.05, 256


def digits_worker(ctx, profile_path, which):
    """Train digits with ``which``: "adaptive", or a fixed plan file path."""
    import hashlib

    torch.set_num_threads(1)
    hpt.init()
    xtr, ytr, xte, yte = load_digits_split(0)
    torch.manual_seed(0)
    model = DigitsNet(HIDDEN)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    steps = len(xtr) // (BATCH * N)
    total = EPOCHS * steps
    third = total // 3

    def link(step, rank):  # fast, slow for the middle third, fast again
        return Link(*SLOW) if third <= step < 2 * third else Link(*FAST)

    plan = hpt.Adaptive(check_every=max(1, third // 4), margin=0.1, profile=profile_path,
                        estimate=link, explore=which == "explore") \
        if which in ("adaptive", "explore") else which
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression="onebit", plan=plan)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
    for epoch in range(EPOCHS):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch))
        for s in range(steps):
            idx = order[(s * N + ctx.rank) * BATCH:(s * N + ctx.rank + 1) * BATCH]
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            sched.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = {"acc": evaluate(model, xte, yte), "total": total, "third": third,
           "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
           "history": opt.online.history if opt.online is not None else [],
           "compressed": sorted(n for n, d in opt.engine.layout().items() if d["compress"])}
    opt.close()
    return out


def test_adaptive_through_two_link_changes_matches_the_fixed_plan_accuracy(tmp_path):
    cp = profile_compressor("onebit", sizes=[4096, 65536, 1 << 20], repeats=3, min_time=0.0)
    prof = Profile(link=Link(*FAST), compressors={"onebit": cp}, meta={"ranks": N})
    prof_path = str(tmp_path / "profile.json")
    prof.save(prof_path)
    sizes = {n: p.numel() * 4 for n, p in DigitsNet(HIDDEN).named_parameters()}
    fixed = {}
    for name, link in (("fast", FAST), ("slow", SLOW)):
        plan = profile_plan(prof.with_link(Link(*link)), ["onebit"], sizes, N, "ps")
        fixed[name] = str(tmp_path / f"{name}.json")
        Plan.save(plan, fixed[name])
    runs = {"adaptive": run_workers(digits_worker, N, args=(prof_path, "adaptive"),
                                    timeout=900)}
    # the same schedule with exploration on: the plans tried on real (loopback) steps
    runs["explore"] = run_workers(digits_worker, N, args=(prof_path, "explore"), timeout=900)
    for name, path in fixed.items():
        runs[name] = run_workers(digits_worker, N, args=(prof_path, path), timeout=900)
    for name, res in runs.items():
        assert len({r["digest"] for r in res}) == 1, f"{name}: replicas diverged"
    acc = {name: res[0]["acc"] for name, res in runs.items()}
    print(f"digits accuracy: adaptive {acc['adaptive']:.2f} %, exploring {acc['explore']:.2f} "
          f"%, fixed fast-link plan {acc['fast']:.2f} %, fixed slow-link plan "
          f"{acc['slow']:.2f} %")
    a0 = runs["adaptive"][0]
    assert [h["step"] for h in a0["history"] if h["switched"]] and \
        len([h for h in a0["history"] if h["switched"]]) == 2, a0["history"]
    first, second = [h for h in a0["history"] if h["switched"]]
    third = a0["third"]
    assert third < first["step"] <= 2 * third < second["step"], (first, second, third)
    assert second["reset"], "the switch back kept error feedback it cannot carry"
    assert runs["slow"][0]["compressed"] and not runs["fast"][0]["compressed"]
    assert a0["compressed"] == runs["fast"][0]["compressed"]  # back on the fast plan
    assert acc["adaptive"] >= acc["fast"] - 0.5, acc
    explored = [h for h in runs["explore"][0]["history"] if h.get("exploring")]
    assert explored, "the link changes started no exploration"
    assert acc["explore"] >= acc["fast"] - 0.5, acc
