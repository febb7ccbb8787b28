"""Options that used to be ignored without a word are refused at construction.

Real ranks: every rank raises, before any collective, naming the option.
"""
import pytest
import torch
from torch import nn

import hipress_like.torch as hpt
from hipress_like.cost_model import Plan
from hipress_like.launch.launch import run_workers

pytestmark = pytest.mark.faults


def _refused(build):
    try:
        opt = build()
    except ValueError as e:
        return str(e)
    opt.close()
    return None


def options_worker(ctx):
    hpt.init()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)

    def opt(**kw):
        return hpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **kw)

    q = hpt.Quorum(fraction=0.5)
    out = {
        "ring": _refused(lambda: opt(stragglers=q, strategy="ring")),
        "plan": _refused(lambda: opt(stragglers=q, plan=Plan(compressor="onebit"))),
        "nonfinite": _refused(lambda: opt(stragglers=q, nonfinite="raise")),
        "timeout": _refused(lambda: opt(timeout="x")),
        "timeout_neg": _refused(lambda: opt(timeout=-1)),
        "quorum_default_ok": _refused(lambda: opt(stragglers=q)),
    }
    # Compression.get("auto") is the string "auto": the cost model picks per gradient
    o = opt(compression=hpt.Compression.get("auto"))
    model(torch.ones(3, 4)).sum().backward()
    o.step()
    out["auto_step"] = model.weight.detach().reshape(-1).tolist()
    o.close()
    hpt.barrier()
    return out


def test_ignored_options_are_refused_on_every_rank():
    res = run_workers(options_worker, 2, timeout=300)
    for out in res:
        assert "strategy='ring'" in out["ring"] and "stragglers" in out["ring"]
        assert "plan" in out["plan"] and "stragglers" in out["plan"]
        assert "nonfinite='raise'" in out["nonfinite"]
        assert out["timeout"].startswith("timeout must be") and "'x'" in out["timeout"]
        assert "timeout" in out["timeout_neg"] and "-1" in out["timeout_neg"]
        assert out["quorum_default_ok"] is None
        assert out["auto_step"] == res[0]["auto_step"]
