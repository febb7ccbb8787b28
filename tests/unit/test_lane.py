"""The collective lane's static buckets (``casync/lane.py``) and their edge cases.

Bucket layout follows DDP's rule (reverse registration order, one dtype per
bucket, close at ``fusion_bytes``); in the engine, a bucket some of whose
gradients were not submitted still completes at ``synchronize``, NaN/Inf is
caught per bucket (``raise`` names the gradient, ``skip`` skips everywhere),
and non-contiguous gradients get their averages written back.
"""
import pytest
import torch
from test_engine_inproc import _collect_errors  # tests/unit is on sys.path (rootdir import)

from hipress_like.casync.engine import Engine, EngineError
from hipress_like.casync.lane import plan_lane_buckets
from hipress_like.casync.transport.inproc import run_threads

F32, F16 = torch.float32, torch.float16


def test_buckets_follow_ddp_rule_reverse_order_per_dtype():
    grads = [(0, 4, F32), (1, 4, F16), (2, 4, F32), (3, 1, F32), (4, 4, F16)]
    buckets = plan_lane_buckets(grads, fusion_bytes=20)
    # reverse order: 4 (f16) opens an f16 bucket, 3 and 2 fill an f32 one to 20 bytes
    # (closed), 1 joins the f16 bucket (16 bytes, under the cap), 0 opens a new f32 one
    assert [(b.dtype, list(b.slots)) for b in buckets] == [
        (F16, [4, 1]), (F32, [3, 2]), (F32, [0])]
    assert buckets[1].slots == {3: (0, 1), 2: (1, 5)} and buckets[1].numel == 5
    assert [list(b.slots) for b in plan_lane_buckets(grads, 20, fuse=False)] == [
        [4], [3], [2], [1], [0]]
    # a gradient above the cap goes alone; the next one opens a new bucket
    assert [list(b.slots) for b in plan_lane_buckets([(0, 2, F32), (1, 100, F32)], 16)] == [
        [1], [0]]


def _lane_engine(tr, **cfg):
    # identity with the default size rule: these small gradients stay uncompressed (lane)
    return Engine(tr, compressor="identity", timeout=20, **cfg)


def test_unsubmitted_gradient_leaves_its_bucket_partial_and_the_rest_averaged():
    """Every rank skips "b" (it shares a bucket with "a" and "c"): the bucket goes at
    synchronize with two of its members; "b" keeps its own values."""
    def body(tr):
        eng = _lane_engine(tr)
        try:
            eng.register([(k, (5,), F32) for k in "abc"])
            assert len(eng._layout.lane) == 1  # all three share one bucket
            out = []
            for step in range(2):
                g = {k: torch.full((5,), float(tr.rank + 10 * i + step))
                     for i, k in enumerate("abc")}
                for k in "ac":
                    eng.submit(k, g[k])
                eng.synchronize()
                out.append(g)
            return out
        finally:
            eng.close()
    res = run_threads(body, 3, timeout=60)
    for r in range(3):
        for step in range(2):
            g = res[r][step]
            assert torch.equal(g["a"], torch.full((5,), 1.0 + step))  # mean of 0, 1, 2
            assert torch.equal(g["c"], torch.full((5,), 21.0 + step))
            assert torch.equal(g["b"], torch.full((5,), float(r + 10 + step)))


def test_noncontiguous_gradient_gets_its_average():
    def body(tr):
        eng = _lane_engine(tr)
        try:
            eng.register([("w", (3, 4), F32)])
            base = torch.arange(12.0).reshape(4, 3) * (tr.rank + 1)
            g = base.t()  # (3, 4), not contiguous
            eng.submit("w", g)
            eng.synchronize()
            return g.clone(), base.t().clone()
        finally:
            eng.close()
    res = run_threads(body, 2, timeout=60)
    expected = torch.arange(12.0).reshape(4, 3).t() * 1.5
    for got, _ in res:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("partial", [False, True])
def test_nan_in_a_bucket_names_the_gradient_on_every_rank(partial):
    """Found when the bucket fills (in submit) or when a partial bucket goes (in
    synchronize); the bad rank raises ValueError, its peers EngineError naming it."""
    def body(tr):
        eng = _lane_engine(tr)
        try:
            eng.register([(k, (6,), F32) for k in "abc"])
            g = {k: torch.ones(6) for k in "abc"}
            if tr.rank == 1:
                g["b"][2] = float("nan")
            for k in ("ab" if partial else "abc"):
                eng.submit(k, g[k])
            eng.synchronize()
        finally:
            eng.close()

    errs = _collect_errors(3, body)
    assert isinstance(errs[1], ValueError) and "'b'" in str(errs[1]) and "NaN" in str(errs[1])
    for r in (0, 2):
        assert isinstance(errs[r], EngineError) and "rank 1" in str(errs[r]) and "'b'" in str(
            errs[r])


def test_inf_with_skip_skips_the_step_and_the_next_step_is_exact():
    def body(tr):
        eng = _lane_engine(tr, nonfinite="skip")
        try:
            eng.register([(k, (4,), F32) for k in "ab"])
            g = {k: torch.full((4,), float(tr.rank)) for k in "ab"}
            if tr.rank == 2:
                g["a"][0] = float("inf")
            for k in "ab":
                eng.submit(k, g[k])
            first = eng.synchronize()
            g = {k: torch.full((4,), float(tr.rank)) for k in "ab"}
            for k in "ab":
                eng.submit(k, g[k])
            return first, eng.synchronize(), g["a"].clone()
        finally:
            eng.close()
    for first, second, a in run_threads(body, 3, timeout=60):
        assert (first, second) == (False, True)
        assert torch.equal(a, torch.full((4,), 1.0))



def test_static_buckets_are_never_fused_again_at_run_time(monkeypatch):
    """The engine hands its static buckets to the coordinator as ``solo``
    collectives. Fused again with whatever was ready in the same round, a
    bucket's elements moved to other offsets of the allreduce, and with gloo
    their summation order changed from run to run (ResNet-18, 4 ranks: the
    averaged gradients differed in their last bits between two runs)."""
    from hipress_like.casync import rounds as engine_mod

    seen = []

    class Recording(engine_mod.Coordinator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.solo)

    monkeypatch.setattr(engine_mod, "Coordinator", Recording)

    def body(tr):
        eng = _lane_engine(tr, fusion_bytes=64)
        try:
            eng.register([("x0", (2,), torch.float32), ("x1", (100,), torch.float32)])
            eng.submit("x0", torch.ones(2))
            eng.submit("x1", torch.ones(100))
            eng.synchronize()
            steps = [e.step for e in eng.timeline.events if e.kind == "bucket"]
            return {b.key for b in eng._layout.lane}, len(steps)
        finally:
            eng.close()
    res = run_threads(body, 2, timeout=60)
    keys = res[0][0]
    assert len(keys) == 2 and all(r == (keys, 2) for r in res)  # one allreduce per bucket
    assert seen and all(s == keys for s in seen)
