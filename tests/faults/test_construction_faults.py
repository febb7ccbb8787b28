"""A rank failing inside ``DistributedOptimizer(...)``, or choosing another mode, is named
to every peer at once, instead of a bare ``DistStoreError`` after the rendezvous' 20 s.

Real ranks over gloo on loopback.
"""
import pytest
import torch
from torch import nn

import hipress_like.torch as hpt
from hipress_like.adapters.agreement import CollectiveMismatchError
from hipress_like.casync.errors import EngineError
from hipress_like.launch.launch import run_workers

pytestmark = pytest.mark.faults


def _build(case, rank):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    kw = {}
    if case == "bad_compressor" and rank == 1:
        kw["compression"] = "tpok"  # unknown: raises on rank 1 only
    if case == "quorum_on_some" and rank == 0:
        kw["stragglers"] = hpt.Quorum(fraction=0.5)
    opt = hpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kw)
    opt.close()


def construction_worker(ctx, case):
    hpt.init()
    try:
        _build(case, hpt.rank())
    except Exception as e:
        return {"type": type(e).__name__, "msg": str(e), "ranks": list(getattr(e, "ranks", ())),
                "engine_error": isinstance(e, EngineError),
                "mismatch": isinstance(e, CollectiveMismatchError)}
    return {"type": None}


def test_a_rank_failing_inside_the_constructor_is_named_to_its_peers():
    res = run_workers(construction_worker, 3, args=("bad_compressor",), timeout=120)
    assert res[1]["type"] == "ValueError" and "tpok" in res[1]["msg"]  # its own error
    for r in (0, 2):
        got = res[r]
        assert got["engine_error"] and got["ranks"] == [1], got
        assert "rank(s) [1] failed while building it" in got["msg"], got
        assert "tpok" in got["msg"], got  # the failing rank's reason travels too


def test_a_quorum_set_on_some_ranks_only_is_refused_on_every_rank():
    res = run_workers(construction_worker, 2, args=("quorum_on_some",), timeout=120)
    for got in res:
        assert got["mismatch"], got
        assert 'stragglers: "Quorum(fraction=0.5' in got["msg"], got
        assert "None on rank(s) [1]" in got["msg"], got
        assert "pass the same stragglers= on every rank" in got["msg"], got
    assert res[0]["msg"].split(":", 1)[1] == res[1]["msg"].split(":", 1)[1]


def test_agreeing_ranks_build_and_step():
    res = run_workers(construction_worker, 2, args=("fine",), timeout=120)
    assert res == [{"type": None}, {"type": None}]
