"""User-facing collectives whose ranks disagree raise on every rank, naming what differs.

Real ranks over gloo on loopback. Before the check, an allgather of int32 on
one rank and float32 on another returned reinterpreted bytes on both.
"""
import pytest
import torch

import hipress_like.torch as hpt
from hipress_like.adapters.agreement import CollectiveMismatchError
from hipress_like.launch.launch import run_workers

pytestmark = pytest.mark.faults


def _try(fn):
    try:
        out = fn()
    except CollectiveMismatchError as e:
        return {"error": str(e), "fields": list(e.fields), "ranks": list(e.ranks)}
    return {"result": out.tolist()}


def mismatch_worker(ctx):
    hpt.init()
    r = hpt.rank()
    out = {}
    # the case: int32 [7, 7] on rank 0, float32 [1.5, 1.5] on rank 1
    x = torch.tensor([7, 7], dtype=torch.int32) if r == 0 else torch.tensor([1.5, 1.5])
    out["gather_dtype"] = _try(lambda: hpt.allgather(x))
    out["gather_shape"] = _try(lambda: hpt.allgather(torch.zeros(2, 2 + r)))
    out["gather_rows_ok"] = _try(lambda: hpt.allgather(torch.full((r + 1, 2), r)))
    out["reduce_shape"] = _try(lambda: hpt.allreduce(torch.ones(3 + r)))
    out["reduce_op"] = _try(lambda: hpt.allreduce(torch.ones(2),
                                                  op=hpt.Sum if r == 0 else hpt.Max))
    out["reduce_name"] = _try(lambda: hpt.allreduce(torch.ones(2), name=f"loss{r}"))
    out["reduce_lossy_dtype"] = _try(lambda: hpt.allreduce(
        torch.ones(8, dtype=torch.float64 if r else torch.float32), compression="topk"))
    out["bcast_root"] = _try(lambda: hpt.broadcast(torch.ones(2), root_rank=r))
    out["bcast_dtype"] = _try(lambda: hpt.broadcast(
        torch.ones(2, dtype=torch.int64 if r else torch.int32), root_rank=0))
    out["drift"] = _try(lambda: hpt.allgather(torch.ones(2)) if r == 0
                        else hpt.allreduce(torch.ones(2)))
    out["after_ok"] = _try(lambda: hpt.allreduce(torch.tensor([float(r)]), op=hpt.Sum))
    hpt.barrier()
    return out


def test_disagreeing_collectives_raise_on_every_rank():
    res = run_workers(mismatch_worker, 2, timeout=120)
    expected = {
        "gather_dtype": (["dtype"], ["torch.int32", "torch.float32"]),
        "gather_shape": (["trailing_shape"], ["[2]", "[3]"]),
        "reduce_shape": (["shape"], ["[3]", "[4]"]),
        "reduce_op": (["op"], ["'sum'", "'max'"]),
        "reduce_name": (["name"], ["'loss0'", "'loss1'"]),
        "reduce_lossy_dtype": (["dtype"], ["torch.float32", "torch.float64"]),
        "bcast_root": (["root_rank"], ["0 on rank(s) [0]", "1 on rank(s) [1]"]),
        "bcast_dtype": (["dtype"], ["torch.int32", "torch.int64"]),
        "drift": (["collective"], ["'allgather' on rank(s) [0]", "'allreduce' on rank(s) [1]"]),
    }
    for key, (fields, words) in expected.items():
        texts = []
        for r, out in enumerate(res):
            got = out[key]
            assert "error" in got, (key, r, got)  # raised, not reinterpreted bytes
            assert got["fields"] == fields, (key, r, got)
            assert got["ranks"], (key, r, got)
            for w in words:
                assert w in got["error"], (key, r, w, got["error"])
            texts.append(got["error"].split(":", 1)[1])
        assert texts[0] == texts[1], key  # every rank names the same disagreement
    for out in res:  # uneven first dims are allgather's contract; ranks still in step
        assert out["gather_rows_ok"] == {"result": [[0, 0], [1, 1], [1, 1]]}
        assert out["after_ok"] == {"result": [1.0]}
