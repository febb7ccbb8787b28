"""A checkpoint taken after a plan="adaptive" switch resumes with the switched plan.

Real ranks (gloo on loopback, ``run_workers``); the link estimate is injected on
a schedule (fast, slow from step 8, fast again from step 16), so the plan
switches at steps 10 and 20. One job runs 24 steps straight; the other saves a
checkpoint (``hpt.save_checkpoint``) at step 12, after the first switch, builds
a fresh model and optimizer (which start on their own first plan, the fast
link's), loads the checkpoint and runs the remaining 12 steps. The resumed job
must run on the saved plan at once, keep the controller's reference and switch
count (so it switches back at step 20, not at a re-measured reference), and its
parameters must equal the uninterrupted job's bitwise at every step after the
load. Without the recorded plan, loading the same compressor state into the
first plan is refused ("saved with another plan"): the record is what makes
the resume possible.
"""
import pytest
import torch
import torch.nn.functional as F
from test_adaptive_plan import _fast_slow_fast, _plan_digest, _profile
from test_torch_optimizer import _batch, _digest, _model

import hipress_like.torch as hpt
from hipress_like.launch.launch import run_workers

N = 2
STEPS, SAVE_AT = 24, 12


def _build(profile_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings = hpt.Adaptive(check_every=5, margin=0.1, max_switches=4, profile=profile_path,
                            estimate=_fast_slow_fast)
    return model, hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression="onebit", plan=settings)


def _train(ctx, model, opt, steps, out):
    for step in steps:
        x, y = _batch(ctx.rank, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out["digests"].append(_digest(model))
        out["plans"].append(_plan_digest(opt.engine.plan))


def straight_worker(ctx, profile_path):
    hpt.init()
    model, opt = _build(profile_path)
    out = {"digests": [], "plans": []}
    _train(ctx, model, opt, range(STEPS), out)
    out["switches"] = [h["step"] for h in opt.online.history if h["switched"]]
    opt.close()
    return out


def resumed_worker(ctx, profile_path, ckpt):
    hpt.init()
    model, opt = _build(profile_path)
    out = {"digests": [], "plans": []}
    _train(ctx, model, opt, range(SAVE_AT), out)
    hpt.save_checkpoint(ckpt, model, opt, step=SAVE_AT)
    saved_sd = opt.state_dict(all_ranks=True)
    opt.close()
    model, opt = _build(profile_path)  # a fresh job: its own first plan
    out["fresh_plan"] = _plan_digest(opt.engine.plan)
    # without the recorded plan, the compressor state does not fit the first plan
    bare = {k: v for k, v in saved_sd.items() if k != "hipress_adaptive"}
    try:
        opt.load_state_dict(bare)
        out["bare_error"] = None
    except ValueError as e:
        out["bare_error"] = str(e)
    model, opt = _build(profile_path) if out["bare_error"] is None else (model, opt)
    extra = hpt.load_checkpoint(ckpt, model, opt)
    out["extra"] = extra
    out["loaded_plan"] = _plan_digest(opt.engine.plan)
    out["loaded_switches"] = opt.online.switches
    out["loaded_reference"] = [opt.online.reference.latency, opt.online.reference.bandwidth]
    _train(ctx, model, opt, range(SAVE_AT, STEPS), out)
    out["switches"] = [h["step"] for h in opt.online.history if h["switched"]]
    opt.close()
    return out


@pytest.fixture
def profile_path(tmp_path):
    return _profile(tmp_path)[1]


def test_a_checkpoint_after_a_switch_resumes_with_the_switched_plan(tmp_path, profile_path):
    straight = run_workers(straight_worker, N, args=(profile_path,), timeout=300)
    resumed = run_workers(resumed_worker, N, args=(profile_path, str(tmp_path / "ck.pt")),
                          timeout=300)
    s0 = straight[0]
    assert s0["switches"] == [10, 20]
    for s, r in zip(straight, resumed):
        assert r["extra"] == {"step": SAVE_AT}
        # the fresh optimizer started on the fast link's plan, not the saved one
        assert r["fresh_plan"] == s["plans"][0] != s["plans"][SAVE_AT - 1]
        assert "saved with another plan" in (r["bare_error"] or ""), r["bare_error"]
        # loaded: the plan of the step saved, and the controller's state
        assert r["loaded_plan"] == s["plans"][SAVE_AT - 1]
        assert r["loaded_switches"] == 1
        # the same history of switches, the same plans and parameters at every step
        assert r["switches"] == s["switches"]
        assert r["plans"] == s["plans"]
        assert r["digests"] == s["digests"]
    assert resumed[1]["digests"] == resumed[0]["digests"]
    assert resumed[1]["loaded_reference"] == resumed[0]["loaded_reference"]
