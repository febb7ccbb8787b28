"""NaN/Inf steps (``casync/nonfinite.py``) over the in-process transport.

The property pinned here: a step in which one rank's gradient holds Inf
leaves no trace. With ``nonfinite="propagate"`` every rank gets non-finite
averages (NaN for compressed gradients, the exact Inf sums for uncompressed
ones); with "skip" every rank's ``synchronize`` returns False; either way
the compressor states (error-feedback memory, PowerSGD's Q and error, DGC's
momentum) and every later step are bitwise what they are in a run that never
had that step.
"""
import pytest
import torch

from hipress_like.casync.engine import Engine, EngineConfig
from hipress_like.casync.nonfinite import StateUndo, snapshot
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.compressors.base import STEP_SEED
from hipress_like.cost_model.plan import Plan, SizeRule

N = 3
SHAPES = {"w": (24, 16), "b": (40,)}


def _plan(comp, k=1, params=None):
    return Plan(compressor=comp, params=dict(params or {}),
                rule=SizeRule(min_compress_bytes=0, bytes_per_partition=1, max_partitions=k),
                gradients={})


def _grads(rank, step, shapes=SHAPES):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _run(comp, strategy, mode, steps, bad=None, plan=True, threads=True, collective=None,
         shapes=SHAPES, params=None):
    """Run ``steps`` (step numbers, fed to ``_grads``) on ``N`` ranks; ``bad=(rank,
    step)`` puts Inf in that rank's "w" at that step, ``bad=(rank, step, flat index,
    value)`` puts ``value`` there. Returns per rank: per step (ok, outputs), and the
    final compressor states. ``params``: the compressor's, in the plan. Shared by
    test_nonfinite_fused."""
    def body(tr):
        cfg = EngineConfig(compressor=comp, plan=_plan(comp, 2, params) if plan else None,
                           strategy=strategy, nonfinite=mode, timeout=30, threads=threads,
                           collective=collective)
        eng = Engine(tr, cfg)
        try:
            eng.register([(k, s, torch.float32) for k, s in shapes.items()])
            out = []
            for step in steps:
                g = _grads(tr.rank, step, shapes)
                if bad is not None and tuple(bad[:2]) == (tr.rank, step):
                    w = g["w"].view(-1)
                    if len(bad) == 2:
                        g["w"][3, 5] = float("inf")
                    else:
                        w[bad[2]] = bad[3]
                for k in shapes:
                    eng.submit(k, g[k])
                out.append((eng.synchronize(), g))
            return out, eng.state_dict()["states"]
        finally:
            eng.close()
    return run_threads(body, N, timeout=120)


def _same_states(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = snapshot(a[k]), snapshot(b[k])
        _same(x, y)


def _same(x, y):
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y)
    elif isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            if k != STEP_SEED:  # the engine's step count differs: the reference has no step 1
                _same(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        for u, v in zip(x, y, strict=True):
            _same(u, v)
    else:
        assert x == y


@pytest.mark.parametrize("comp,strategy", [("onebit", "ps"), ("powersgd", "ring"),
                                           ("dgc", "ps"), ("topk", "ring")])
@pytest.mark.parametrize("mode", ["propagate", "skip"])
def test_a_nonfinite_step_leaves_no_trace(comp, strategy, mode):
    with_bad = _run(comp, strategy, mode, [0, 1, 2, 3], bad=(1, 1))
    without = _run(comp, strategy, mode, [0, 2, 3])
    for r in range(N):
        steps, states = with_bad[r]
        ref_steps, ref_states = without[r]
        oks = [ok for ok, _ in steps]
        assert oks == [True, mode == "propagate", True, True]
        if mode == "propagate":  # compressed gradients are NaN on every rank
            assert all(torch.isnan(t).all() for t in steps[1][1].values())
        for (_, g), (_, ref) in zip([steps[0], steps[2], steps[3]], ref_steps, strict=True):
            for k in SHAPES:
                assert torch.equal(g[k], ref[k]), (r, k)
        _same_states(states, ref_states)


@pytest.mark.parametrize("comp,collective", [("star_topk", "tree"), ("var_topk", "ring"),
                                             ("topk", "allgather")])
def test_a_nonfinite_step_leaves_no_trace_on_named_collectives(comp, collective):
    """AR-Topk by a tree or a ring and top-k by allgather: the residuals and AR-Topk's
    step counter (its owner rotation) roll back as if the step never happened."""
    with_bad = _run(comp, "ps", "propagate", [0, 1, 2, 3], bad=(1, 1), collective=collective)
    without = _run(comp, "ps", "propagate", [0, 2, 3], collective=collective)
    for r in range(N):
        steps, states = with_bad[r]
        ref_steps, ref_states = without[r]
        assert [ok for ok, _ in steps] == [True, True, True, True]
        assert all(torch.isnan(t).all() for t in steps[1][1].values())
        for (_, g), (_, ref) in zip([steps[0], steps[2], steps[3]], ref_steps, strict=True):
            for k in SHAPES:
                assert torch.equal(g[k], ref[k]), (r, k)
        _same_states(states, ref_states)


def test_propagate_carries_the_exact_inf_through_uncompressed_gradients():
    """No compression: the allreduce lane sums Inf like DDP; the finite gradient
    and the other elements stay exact."""
    res = _run("identity", "ps", "propagate", [0, 1], bad=(2, 1), plan=False)
    for steps, _ in res:
        ok, g = steps[1]
        assert ok
        assert g["w"][3, 5] == float("inf")
        want = sum(_grads(r, 1)["b"] for r in range(N)) / N
        assert torch.allclose(g["b"], want)
        assert torch.isfinite(g["w"]).sum() == g["w"].numel() - 1
    for r in range(1, N):
        assert torch.equal(res[r][0][1][1]["w"], res[0][0][1][1]["w"])


def test_state_undo_restores_and_drops_states_created_in_the_step():
    undo = StateUndo()
    states = {"a": {"error": torch.ones(3), "step": 1}}
    undo.save("a", states["a"])
    undo.save("b", None)
    states["a"]["error"].add_(5)
    states["a"]["step"] = 2
    states["b"] = {"error": torch.zeros(2)}
    undo.end_step(states, restore=True)
    assert list(states) == ["a"] and states["a"]["step"] == 1
    assert states["a"]["error"].tolist() == [1.0, 1.0, 1.0]
    # the next step's copy reuses the discarded buffers, never the live ones
    undo.save("a", states["a"])
    assert undo.saved["a"]["error"] is not states["a"]["error"]
    states["a"]["error"].add_(1)
    undo.end_step(states, restore=False)
    assert states["a"]["error"].tolist() == [2.0, 2.0, 2.0]


def test_a_double_buffered_state_is_kept_by_reference_and_restored_whole():
    """PowerSGD double-buffers (``detach_state``): ``save`` keeps the state itself,
    no copy; a restored step gives back that state with its tensors untouched, and
    the step's buffers serve the next step (two error buffers in all)."""
    from hipress_like.compressors import get

    c = get("powersgd", rank=1)
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(12, 10, generator=gen)
    states = {"a": c.init(g, world_size=1, shared_seed=1)}
    undo, ptrs = StateUndo(), set()
    for step in range(5):
        start = states["a"]
        err = c.error(start) if isinstance(start.get("error"), torch.Tensor) else None
        st = states["a"] = undo.save("a", start, c)
        assert undo.saved["a"] is start and st is not start
        assert undo.save("a", st, c) is st  # once a step
        p0, st = c.encode_round(0, g * (step + 1), st, None)
        p1, st = c.encode_round(1, g, st, c.merge([p0]))
        _, states["a"] = c.decode_rounds(g, st, c.merge([p1]), average=True)
        ptrs.add(states["a"]["error"].data_ptr())
        undo.end_step(states, restore=step == 2)
        if step == 2:
            assert states["a"] is start and torch.equal(c.error(states["a"]), err)
    assert len(ptrs) == 2
