"""The consistency guard: replicas that diverge are named, on every rank.

Real ranks over gloo. A rank changes its parameters or optimizer state on its
own (what a bug, a bit flip or a rank resumed from another checkpoint does);
the guard must raise on every rank, naming the first entry that differs and
the rank that diverged. Replicas that stay identical must pass.
"""
import pytest
import torch
from torch import nn

import hipress_like.torch as hpt
from hipress_like.adapters.consistency import ConsistencyError
from hipress_like.launch.launch import run_workers

pytestmark = pytest.mark.faults


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))


def _train(opt, model, steps, start=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * hpt.rank() + s)
        x = torch.randn(5, 6, generator=g)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()


def guard_worker(ctx, case):
    hpt.init()
    model = _model()
    kw = {"stragglers": hpt.Quorum(fraction=1.0)} if case == "quorum_param" else {}
    opt = hpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   check_consistency_every=2, **kw)
    out = {}
    try:
        _train(opt, model, 4)  # checks after steps 2 and 4: identical replicas pass
        out["clean"] = True
        if hpt.rank() == 2:
            with torch.no_grad():
                if case in ("param", "quorum_param"):
                    model[2].bias.add_(1e-6)  # one rank's parameter drifts
                elif case == "state":
                    opt.state[model[2].weight]["momentum_buffer"].mul_(1.0001)
                elif case == "lr":
                    opt.param_groups[0]["lr"] = 0.06
        if case == "state":
            opt.check_consistency()  # by hand, before any step spreads the difference
        else:
            _train(opt, model, 2, start=4)  # the check after step 6 must catch it
    except ConsistencyError as e:
        out.update(msg=str(e), entry=e.entry, ranks=list(e.ranks), differing=list(e.differing))
    opt.close()
    return out


@pytest.mark.parametrize("case,entry", [
    ("param", "2.bias"),
    ("state", "2.weight (optimizer state 'momentum_buffer')"),
    ("quorum_param", "2.bias"),
])
def test_a_diverged_rank_is_named_on_every_rank(case, entry):
    res = run_workers(guard_worker, 3, args=(case,), timeout=180)
    for out in res:
        assert out.get("clean"), out
        assert out.get("entry") == entry, out
        assert out["ranks"] == [2], out
        assert f"the first entry that differs is {entry!r}" in out["msg"], out
    assert res[0]["msg"] == res[1]["msg"] == res[2]["msg"]


def test_a_learning_rate_changed_on_one_rank_is_named():
    res = run_workers(guard_worker, 3, args=("lr",), timeout=180)
    for out in res:
        assert out["ranks"] == [2], out
        assert "param_groups[0]['lr']" in out["differing"], out
