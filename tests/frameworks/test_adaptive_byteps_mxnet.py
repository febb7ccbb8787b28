"""plan="adaptive" on the BytePS-style MXNet face (``hipress_like.byteps.mxnet``), 2 real ranks.

``bps.DistributedTrainer(..., compression_params={...}, plan=bps.Adaptive(...))``
starts on BytePS's knobs' plan (``BYTEPS_MIN_COMPRESS_BYTES=65536``: nothing of
this small network is compressed; ``BYTEPS_PARTITION_BYTES=8192``) with the
compressor ``compression_params`` names (every key BytePS's examples pass;
``ef="vanilla"``: ``ef{'inner': 'onebit'}``), and the online planner re-plans from
there pricing that compressor alone. The link estimate is injected on the schedule
of tests/multiprocess/test_adaptive_plan.py (fast, slow from step 8, fast from
16) with a profile file holding that compressor's curves beside a bare onebit's.
What must hold:

- the start plan is the knobs' (their rule, the compressor, the profile's
  matching curves as the one candidate);
- every rank switches at steps 10 and 20 to the same plan, compressing with
  ``compression_params``' compressor, and the replicas are bitwise identical
  after every step;
- ``save_states`` at step 12 and ``load_states`` in a new job (which starts on
  the knobs' plan) resume on the switched plan and give the uninterrupted
  run's weights bitwise;
- without ``Adaptive(profile=...)`` the compressor is profiled at start (as
  ``plan="auto"`` profiles) and every rank decides alike.

Runs in MXNet's venv (``scripts/env_mxnet.sh --test``); elsewhere it skips
saying so. This file is also the job its tests start (``python
test_adaptive_byteps_mxnet.py job --steps N ...``).
"""
import argparse
import hashlib
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

import pytest

N, STEPS, SAVE_AT = 2, 24, 12
FAST = (2e-6, 12.5e9)  # 2 us + 100 Gbit/s
SLOW = (1e-3, 1.25e6)  # 1 ms + 10 Mbit/s
KNOBS = {"BYTEPS_MIN_COMPRESS_BYTES": "65536", "BYTEPS_PARTITION_BYTES": "8192"}
PARAMS = {"compressor": "onebit", "ef": "vanilla", "momentum": "", "scaling": True, "k": 1,
          "partition": "linear", "normalize": "max", "fp16": False}
SPEC = ["ef", {"inner": "onebit"}]  # what PARAMS choose (hipress_like.byteps.params)
BATCH, FEATURES, CLASSES = 6, 36, 3


# -- the job (run by the tests below as 2 real ranks) --------------------------------------------
def fast_slow_fast(step, rank):
    """The injected link: fast before step 8, slow for steps 8-15, fast again."""
    from hipress_like.cost_model import Link

    return Link(*SLOW) if 8 <= step < 16 else Link(*FAST)


def _plan_digest(plan):
    text = json.dumps({n: g.to_dict() for n, g in plan.gradients.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _job(argv) -> None:
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    import hipress_like.byteps.mxnet as bps

    p = argparse.ArgumentParser()
    p.add_argument("--profile", default=None)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--check-every", type=int, default=5)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)

    bps.init()
    mx.random.seed(7 + bps.rank())  # different weights: the trainer broadcasts rank 0's
    net = gluon.nn.HybridSequential()  # 36 -> 96 -> 3: one 13.8 KB weight, small ones
    net.add(gluon.nn.Dense(96, in_units=FEATURES, activation="relu"),
            gluon.nn.Dense(CLASSES, in_units=96))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    # verify=False without a profile: every check decides (as test_adaptive_plan's
    # measured jobs), alike on every rank
    settings = bps.Adaptive(check_every=args.check_every, margin=0.1, max_switches=4,
                            profile=args.profile, estimate=fast_slow_fast,
                            verify=None if args.profile else False)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.05, "momentum": 0.9},
                                     compression_params=PARAMS, plan=settings)
    plan = trainer.engine.plan
    start = {"rule": [plan.rule.min_compress_bytes, plan.rule.bytes_per_partition],
             "compressor": [plan.compressor, plan.params], "byteps": plan.meta.get("byteps"),
             "candidates": plan.meta.get("candidates"), "entries": len(plan.gradients),
             "profiled": "profile" in plan.meta, "digest": _plan_digest(plan)}
    states = os.path.join(args.ckpt or ".", "trainer.states")
    first = 0
    if args.resume:
        net.load_parameters(os.path.join(args.ckpt, "net.params"), ctx=mx.cpu())
        trainer.load_states(states)  # switches to the saved plan, then the compressor state
        first = args.save_at
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    out = {"rank": bps.rank(), "start": start, "digests": [], "plans": [], "compressed": [],
           "compressors": []}
    for step in range(first, args.steps):
        rng = np.random.default_rng([11, bps.rank(), step])
        x = mx.nd.array(rng.standard_normal((BATCH, FEATURES)).astype("float32"))
        y = mx.nd.array(rng.integers(0, CLASSES, BATCH).astype("float32"))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(BATCH)
        h = hashlib.sha256()
        for _, prm in sorted(net._collect_params_with_prefix().items()):
            h.update(prm.data().asnumpy().tobytes())
        out["digests"].append(h.hexdigest()[:16])
        plan = trainer.engine.plan
        out["plans"].append(_plan_digest(plan))
        out["compressed"].append(sorted(n for n, d in trainer.engine.layout().items()
                                        if d["compress"]))
        out["compressors"].append(sorted({json.dumps(plan.compressor_of(g), sort_keys=True)
                                          for g in plan.gradients.values() if g.compress}))
        if args.ckpt and not args.resume and step + 1 == args.save_at:
            os.makedirs(args.ckpt, exist_ok=True)
            trainer.save_states(states, all_ranks=True)
            if bps.rank() == 0:  # the resumed job is a later run: no barrier needed
                net.save_parameters(os.path.join(args.ckpt, "net.params"))
    online = trainer.online
    out.update(switches=online.switches,
               checks=[h["step"] for h in online.history if "judged" not in h],
               switched=[h["step"] for h in online.history if h.get("switched")])
    print("RESULT " + json.dumps(out), flush=True)
    bps.shutdown()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "job":
        _job(sys.argv[2:])
        sys.exit(0)


# -- running jobs -------------------------------------------------------------------------------
from . import adaptive_common  # noqa: E402 (as below)
from .test_mxnet import needs_mxnet, results, run  # noqa: E402 (the job above needs none)

pytestmark = [pytest.mark.frameworks, needs_mxnet]


@lru_cache(maxsize=None)
def _run(*args: str) -> dict:
    rc, out = run("env", Path(__file__), "job", *args, np=N, timeout=600, env=KNOBS)
    res = results(out)
    assert rc == 0 and sorted(res) == list(range(N)), f"job failed (rc {rc}):\n{out[-5000:]}"
    r0 = res[0]
    for r in range(1, N):  # every rank: the same start, weights, plans and checks
        for key in ("start", "digests", "plans", "compressed", "checks", "switched",
                    "switches"):
            assert res[r][key] == r0[key], f"rank {r} differs from rank 0 in {key}"
    return res


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """The compressor PARAMS choose, and a bare onebit beside it (not the candidate)."""
    from hipress_like.cost_model import Link, Profile
    from hipress_like.tuning.profiler import profile_compressor

    sizes = [4096, 16384, 65536]
    cps = {"onebit": profile_compressor("onebit", sizes=sizes, repeats=3, min_time=0.0),
           "ef-onebit": profile_compressor(*SPEC, sizes=sizes, repeats=3, min_time=0.0)}
    path = tmp_path_factory.mktemp("adaptive-bps-mx") / "profile.json"
    Profile(link=Link(*FAST), compressors=cps, meta={"ranks": N}).save(path)
    return str(path)


@pytest.fixture(scope="module")
def jobs(profile, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("bps-mx-ckpt"))
    common = ("--profile", profile, "--save-at", str(SAVE_AT), "--ckpt", ckpt)
    return _run(*common), _run(*common, "--resume")


@pytest.mark.timeout(900)
def test_byteps_mxnet_knobs_start_then_every_rank_switches_alike(jobs):
    r0 = jobs[0][0]
    s = r0["start"]
    assert s["rule"] == [65536, 8192] and s["entries"] == 0 and s["byteps"] == "knobs"
    assert s["compressor"] == SPEC and s["candidates"] == ["ef-onebit"]
    assert r0["compressed"][0] == []  # every gradient is under 64 KB
    assert r0["checks"] == [5, 10, 15, 20]
    assert r0["switched"] == [10, 20] and r0["switches"] == 2
    assert adaptive_common.changes(r0["plans"]) == [10, 20]
    assert r0["compressed"][8] == [] and r0["compressed"][9], "slow link: nothing compressed"
    assert r0["compressed"][19] == []  # fast again: back to nothing compressed
    assert r0["compressors"][9] == [json.dumps(SPEC, sort_keys=True)]
    assert len(set(r0["digests"])) == STEPS  # it learned at every step


@pytest.mark.timeout(900)
def test_byteps_mxnet_states_saved_after_a_switch_resume_on_the_switched_plan(jobs):
    full, resumed = jobs
    r0, f0 = resumed[0], full[0]
    assert r0["start"]["digest"] == f0["plans"][0] != f0["plans"][SAVE_AT - 1]  # knobs first
    assert r0["plans"][0] == f0["plans"][SAVE_AT - 1]  # then the switched plan
    assert r0["plans"] == f0["plans"][SAVE_AT:]
    assert r0["switched"] == [10, 20] and r0["switches"] == 2  # the saved history goes on
    for r in range(N):
        assert resumed[r]["digests"] == full[r]["digests"][SAVE_AT:], f"rank {r}"


@pytest.mark.timeout(900)
def test_byteps_mxnet_without_a_profile_profiles_at_start_and_decides_alike():
    r0 = _run("--steps", "9", "--check-every", "3")[0]  # _run checks the ranks agree
    s = r0["start"]
    assert s["rule"] == [65536, 8192] and s["byteps"] == "knobs" and s["profiled"]
    assert s["compressor"] == SPEC and s["candidates"] == ["ef"]
    assert r0["checks"] == [3, 6, 9]
