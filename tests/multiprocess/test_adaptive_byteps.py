"""plan="adaptive" on the BytePS-style PyTorch face, on real ranks (gloo on loopback).

``hipress_like.byteps.torch.DistributedOptimizer(..., compression_params={...},
plan=bps.Adaptive(...))`` starts on BytePS's knobs' plan (``BYTEPS_MIN_COMPRESS_BYTES``,
``BYTEPS_PARTITION_BYTES``, read by ``bps.init``) with the compressor
``compression_params`` names, here shaped as BytePS's PyTorch examples build it
(``ef="vanilla"``: error feedback around onebit, so the compressor is
``ef{'inner': 'onebit'}``), and the online planner re-plans from there pricing
that compressor alone. The link estimate is injected on the schedule of
``test_adaptive_plan`` (fast, slow from step 8, fast from step 16) with a profile
file holding the compressor's curves (beside a bare onebit's, which must not be
chosen): every rank switches at steps 10 and 20 to the same plan, replicas stay
bitwise identical at every step, and the compressed gradients run the compressor
``compression_params`` chose. A job that saves ``opt.state_dict()`` after the
first switch and loads it into a fresh optimizer (which starts on the knobs'
plan) goes on with the switched plan and equals the uninterrupted job bitwise.
Without ``Adaptive(profile=...)`` the start plan's source profiles that
compressor as ``plan="auto"`` does, keeps the knobs' plan, and every rank decides
alike. The three jobs share one launch of 2 ranks (``shared_launch``); an integer
``k`` and a profile without the compressor's curves are refused on one process.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from shared_launch import ranks, run_shared  # tests/multiprocess is on sys.path (rootdir)
from test_adaptive_plan import FAST, _decisions, _fast_slow_fast, _plan_digest
from test_torch_optimizer import _batch, _digest, _model

from hipress_like.cost_model import Link, Profile
from hipress_like.tuning.profiler import profile_compressor

N = 2
STEPS, SAVE_AT = 24, 12
# every key BytePS's examples pass, whatever the compressor (as
# tests/frameworks/test_byteps_mxnet.py passes them), the unused ones at their defaults
PARAMS = {"compressor": "onebit", "ef": "vanilla", "momentum": "", "scaling": True, "k": 1,
          "partition": "linear", "normalize": "max", "fp16": False}
SPEC = ("ef", {"inner": "onebit"})  # what PARAMS choose (hipress_like.byteps.params)
# BytePS's default threshold (nothing of this small model is compressed at the start)
# and a partition size of our own, to see the knobs read
KNOBS = {"BYTEPS_MIN_COMPRESS_BYTES": "65536", "BYTEPS_PARTITION_BYTES": "8192"}


def _build(settings):
    import hipress_like.byteps.torch as bps

    os.environ.update(KNOBS)
    bps.init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression_params=PARAMS, plan=settings)


def _train(ctx, model, opt, steps, out):
    for step in steps:
        x, y = _batch(ctx.rank, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out["digests"].append(_digest(model))
        out["plans"].append(_plan_digest(opt.engine.plan))
        out["compressed"].append(sorted(n for n, d in opt.engine.layout().items()
                                        if d["compress"]))
        plan = opt.engine.plan
        out["compressors"].append(sorted({(plan.compressor_of(g)[0],
                                           str(sorted(plan.compressor_of(g)[1].items())))
                                          for g in plan.gradients.values() if g.compress}))


def _start(opt):
    plan = opt.engine.plan
    return {"rule": [plan.rule.min_compress_bytes, plan.rule.bytes_per_partition],
            "compressor": [plan.compressor, plan.params], "byteps": plan.meta.get("byteps"),
            "candidates": plan.meta.get("candidates"), "entries": len(plan.gradients),
            "profiled": sorted((k, c.name, c.params) for k, c in Profile.from_dict(
                plan.meta["profile"]).compressors.items()) if "profile" in plan.meta else None,
            "digest": _plan_digest(plan)}


def _out():
    return {"digests": [], "plans": [], "compressed": [], "compressors": []}


def _settings(profile_path):
    import hipress_like.byteps.torch as bps

    return bps.Adaptive(check_every=5, margin=0.1, max_switches=4, profile=profile_path,
                        estimate=_fast_slow_fast)


def straight_worker(ctx, profile_path):
    model, opt = _build(_settings(profile_path))
    out = _out()
    out["start"] = _start(opt)
    _train(ctx, model, opt, range(STEPS), out)
    out["history"] = opt.online.history
    out["switch_events"] = [e.step for e in opt.engine.timeline.events
                            if e.kind == "plan_switch"]
    opt.close()
    return out


def resumed_worker(ctx, profile_path, ckpt_dir):
    model, opt = _build(_settings(profile_path))
    out = _out()
    _train(ctx, model, opt, range(SAVE_AT), out)
    path = os.path.join(ckpt_dir, f"rank{ctx.rank}.pt")  # every rank its own state
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    opt.close()
    model, opt = _build(_settings(profile_path))  # a fresh job: the knobs' plan first
    out["fresh"] = _start(opt)
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    out["loaded_plan"] = _plan_digest(opt.engine.plan)
    out["loaded_switches"] = opt.online.switches
    _train(ctx, model, opt, range(SAVE_AT, STEPS), out)
    out["switches"] = [h["step"] for h in opt.online.history if h["switched"]]
    opt.close()
    return out


def profiled_worker(ctx):
    import hipress_like.byteps.torch as bps

    # no profile: the compressor is profiled at start (as plan="auto"); verify=False, as
    # test_adaptive_plan's measured jobs: every check decides, alike on every rank
    model, opt = _build(bps.Adaptive(check_every=3, estimate=_fast_slow_fast, verify=False))
    out = _out()
    out["start"] = _start(opt)
    out["link_source"] = opt.engine.plan.meta["profile"]["meta"].get("link_source")
    _train(ctx, model, opt, range(12), out)
    out["history"] = opt.online.history
    opt.close()
    return out


def _profile(tmp_path):
    """The compressor PARAMS choose, and a bare onebit beside it (not the candidate)."""
    sizes = [4096, 16384, 65536]
    cps = {"onebit": profile_compressor("onebit", sizes=sizes, repeats=3, min_time=0.0),
           "ef-onebit": profile_compressor(*SPEC, sizes=sizes, repeats=3, min_time=0.0)}
    path = tmp_path / "profile.json"
    Profile(link=Link(*FAST), compressors=cps, meta={"ranks": N}).save(path)
    return str(path)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{job: each rank's outcome}: straight, resumed and profiled-at-start, on one
    launch of N ranks."""
    tmp = tmp_path_factory.mktemp("adaptive_byteps")
    path = _profile(tmp)
    entries = run_shared(N, [(straight_worker, (path,)), (resumed_worker, (path, str(tmp))),
                             (profiled_worker, ())], timeout=600)
    return dict(zip(("straight", "resumed", "profiled"), entries))


def test_byteps_knobs_start_then_every_rank_switches_alike_with_identical_replicas(jobs):
    res = ranks(jobs["straight"])
    r0 = res[0]
    for r in res[1:]:  # the same parameters and plan on every rank, at every step
        assert r["digests"] == r0["digests"]
        assert r["plans"] == r0["plans"]
        assert _decisions(r["history"]) == _decisions(r0["history"])
        assert r["switch_events"] == r0["switch_events"]
    # the start: BytePS's knobs, the compressor compression_params chose, and the
    # profile's curves of that compressor as the one candidate
    s = r0["start"]
    assert s["rule"] == [65536, 8192] and s["entries"] == 0 and s["byteps"] == "knobs"
    assert s["compressor"] == list(SPEC) and s["candidates"] == ["ef-onebit"]
    assert r0["compressed"][0] == []  # every gradient is under 64 KB
    # re-planned: switched at the slow link and back
    assert [h["step"] for h in r0["history"]] == [5, 10, 15, 20]
    assert [h["switched"] for h in r0["history"]] == [False, True, False, True]
    assert r0["switch_events"] == [10, 20]
    changes = [i + 1 for i in range(1, STEPS) if r0["plans"][i] != r0["plans"][i - 1]]
    assert changes == [10, 20]
    assert r0["compressed"][8] == [] and r0["compressed"][9], "slow link: nothing compressed"
    assert r0["compressed"][19] == []
    # what the switched plan compresses, it compresses with compression_params' compressor
    assert r0["compressors"][9] == [("ef", str(sorted(SPEC[1].items())))]
    assert sorted(r0["history"][3]["reset"]) == r0["compressed"][9]  # EF memories dropped


def test_byteps_state_dict_saved_after_a_switch_resumes_with_the_switched_plan(jobs):
    straight, resumed = ranks(jobs["straight"]), ranks(jobs["resumed"])
    for s, r in zip(straight, resumed):
        # the fresh optimizer started on the knobs' plan, not the saved one
        assert r["fresh"]["digest"] == s["plans"][0] != s["plans"][SAVE_AT - 1]
        assert r["loaded_plan"] == s["plans"][SAVE_AT - 1]
        assert r["loaded_switches"] == 1
        assert r["switches"] == [10, 20]
        assert r["plans"] == s["plans"]
        assert r["digests"] == s["digests"]
    assert resumed[1]["digests"] == resumed[0]["digests"]


def test_byteps_without_a_profile_profiles_the_compressor_at_start_and_decides_alike(jobs):
    res = ranks(jobs["profiled"])
    r0 = res[0]
    s = r0["start"]
    assert s["rule"] == [65536, 8192] and s["entries"] == 0 and s["byteps"] == "knobs"
    assert s["candidates"] == ["ef"] and s["profiled"] == [("ef", *SPEC)]
    assert r0["link_source"] == "measured"
    assert [h["step"] for h in r0["history"]] == [3, 6, 9, 12]
    for r in res[1:]:
        assert r["start"] == s  # rank 0's profile on every rank
        assert r["digests"] == r0["digests"] and r["plans"] == r0["plans"]
        assert _decisions(r["history"]) == _decisions(r0["history"])


@pytest.fixture
def one_process():
    import hipress_like.byteps.torch as bps

    bps.init()
    yield bps
    bps.shutdown()


def test_byteps_adaptive_refuses_a_count_of_k(one_process):
    bps = one_process
    m = torch.nn.Linear(6, 3)
    with pytest.raises(ValueError, match=r"k'\] = 10 keeps a count.*pass 'k' as a ratio"):
        bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=m.named_parameters(), plan="adaptive",
                                 compression_params={"compressor": "topk", "k": 10})


def test_byteps_adaptive_refuses_a_profile_without_the_compressors_curves(one_process,
                                                                          tmp_path):
    bps = one_process
    cp = profile_compressor("onebit", sizes=[4096], repeats=1, min_time=0.0)
    path = tmp_path / "onebit.json"
    Profile(link=Link(*FAST), compressors={"onebit": cp}).save(path)
    m = torch.nn.Linear(6, 3)
    with pytest.raises(ValueError) as e:
        bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=m.named_parameters(),
                                 compression_params=PARAMS, plan=bps.Adaptive(profile=path))
    msg = str(e.value)
    assert "no curves for" in msg and "ef{'inner': 'onebit'}" in msg, msg
    assert "onebit: onebit{}" in msg and "profile_compressor('ef'" in msg, msg
