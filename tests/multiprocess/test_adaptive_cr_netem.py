"""Adaptive CR over emulated links: 4 ranks train digits with STAR-Topk while this test
lowers the tc rate of every link; the controller notices the bandwidth change at its
next link measurement, explores the candidate CRs from an in-memory checkpoint,
switches to a lower CR, and logs why (Sec. 3-E of the flexible-communication paper).
"""
import os
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

pytestmark = [pytest.mark.netem, pytest.mark.slow, pytest.mark.timeout(3600)]

FAST, SLOW = "1gbit", "10mbit"


def _wait_for(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)


def _train(ctx, flags, before, after):
    """Train ``before`` steps, let the parent slow the links, train ``after`` more."""
    import logging

    import torch
    import torch.nn.functional as F

    import hipress_like.torch as hpt
    from hipress_like.demo.cli_digits import (
        COMMUNICATION_KINDS,
        COMPRESSION_KINDS,
        DigitsNet,
        load_digits_split,
    )
    from hipress_like.tuning.adaptive_cr import (
        AdaptiveCR,
        AdaptiveCRConfig,
        StepStats,
        gain_of_states,
        set_ratio,
        snapshot_torch,
    )
    from hipress_like.tuning.link import measure_link

    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    hpt.init()
    rank, size = hpt.rank(), hpt.size()
    tr = ctx.transport
    xtr, ytr, _, _ = load_digits_split(0)
    torch.manual_seed(0)
    model = DigitsNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hpt.Compression.get("star_topk", ratio=0.1),
                                   plan=None, seed=0)
    eng = opt.engine
    comp = eng.compressor
    batch = 16
    pos = [0]

    def step():
        i = pos[0] % (len(xtr) // (batch * size))
        pos[0] += 1
        idx = slice((i * size + rank) * batch, (i * size + rank + 1) * batch)
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        # this step's engine events (a restored checkpoint rewinds the engine's step
        # count, so events are selected by time, not by step number)
        evs = [e for e in eng.timeline.events if e.start >= t0]
        busy = lambda kinds: sum(e.end - e.start for e in evs if e.kind in kinds)  # noqa: E731
        gain = gain_of_states(eng.state_dict()["states"])
        return StepStats(busy(COMPRESSION_KINDS), busy(COMMUNICATION_KINDS),
                         1.0 if gain is None else gain)

    def agree(xs):
        t = tr.allreduce(torch.tensor(list(xs), dtype=torch.float64), "sum", 120)
        return (t / size).tolist()

    def link():
        li, _ = measure_link(tr, sizes=(1 << 10, 1 << 16, 1 << 20), repeats=3, timeout=120,
                             steps=3)
        return li.alpha, li.beta

    checkpoint, restore = snapshot_torch(
        model, opt, extra=lambda: comp.ratio, load_extra=lambda r: set_ratio(comp, r))
    ctl = AdaptiveCR(AdaptiveCRConfig(explore_iters=3, check_every=8),
                     set_cr=lambda c: set_ratio(comp, c), checkpoint=checkpoint,
                     restore=restore, measure_link=link, agree=agree, initial_cr=0.1)

    def train(first, n):
        for s in range(first, first + n):
            ctl.observe(s, step())
            reason = ctl.should_search(s)
            if reason:
                ctl.search(s, reason, lambda k: [step() for _ in range(k)])

    train(0, before)
    tr.barrier(120)
    if rank == 0:
        open(os.path.join(flags, "ready"), "w").close()
        _wait_for(os.path.join(flags, "changed"), 300)
    tr.barrier(600)
    train(before, after)
    digest = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).sum().item()
    opt.close()
    return {"decisions": [(d.step, d.reason, d.cr_before, d.cr_after, d.pareto,
                           [(t.cr, t.t_comp, t.t_sync, t.gain) for t in d.trials])
                          for d in ctl.decisions], "cr": comp.ratio, "digest": digest}


def _set_rate(n, rate):
    """Every link of the emulated network to ``rate`` (both directions), as netem.up does."""
    from hipress_like.launch.netem import rate_bits

    burst = str(max(rate_bits(rate) // 4000, 32768))
    for i in range(n):
        for ns, dev in (("hsw", f"p{i}"), (f"h{i}", "eth0")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev,
                            "root", "tbf", "rate", rate, "burst", burst, "latency", "20ms"],
                           check=True)


def test_bandwidth_drop_switches_the_cr_and_says_why():
    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.skip("network emulation needs root and iproute2")
    from hipress_like.launch import netem
    from hipress_like.launch.launch import run_workers

    n = 4
    flags = tempfile.mkdtemp(prefix="adaptive-cr-")
    netem.up(n, FAST)
    out, err = {}, {}
    try:
        def go():
            try:
                out["res"] = run_workers(_train, n, args=(flags, 12, 18), timeout=1500,
                                         netns=True)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                err["e"] = e

        th = threading.Thread(target=go)
        th.start()
        _wait_for(os.path.join(flags, "ready"), 1200)
        _set_rate(n, SLOW)
        open(os.path.join(flags, "changed"), "w").close()
        th.join(1500)
    finally:
        netem.down()
        shutil.rmtree(flags, ignore_errors=True)
    if "e" in err:
        raise err["e"]
    res = out["res"]
    decisions = res[0]["decisions"]
    for r in res:
        assert r["decisions"] == decisions or [d[:4] for d in r["decisions"]] == \
            [d[:4] for d in decisions]
        assert r["digest"] == res[0]["digest"]
    for d in decisions:
        print(f"step {d[0]}: {d[2]} -> {d[3]} because {d[1]}; Pareto {d[4]}")
        for t in d[5]:
            print(f"    CR {t[0]:g}: t_comp {t[1] * 1e3:.1f} ms, t_sync {t[2] * 1e3:.1f} ms, "
                  f"gain {t[3]:.3f}")
    assert decisions[0][1] == "no CR chosen yet"
    last = decisions[-1]
    assert last[0] >= 12 and "bandwidth changed" in last[1], decisions
    assert last[3] < last[2], f"the CR did not drop after the bandwidth did: {decisions}"
