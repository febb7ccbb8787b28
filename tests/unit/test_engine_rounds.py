"""Multi-round compressors in the engine: declared reductions (sum, max,
broadcast from an owner), partitions, CaSync-Ring, the collective lane, the
per-step shared seed and error feedback around them.

The compressors are ``tests/rounds_compressors.py``; each result is checked
against a hand computation of the same algorithm from every rank's
gradient, so a wrong reduction, a wrong partition or a seed that differs
between ranks fails here.
"""
import sys
import zlib
from pathlib import Path

import pytest
import torch

from hipress_like.casync.layout import part_view, row_chunks
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.compressors.base import Capabilities, mix_seed
from hipress_like.compressors.wrappers.error_feedback import ErrorFeedback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rounds_compressors as rc  # noqa: E402

LEVELS, SHAPES, OwnerTopk, RangeQuant = rc.LEVELS, rc.SHAPES, rc.OwnerTopk, rc.RangeQuant
grads_of, levels, run_rounds = rc.grads_of, rc.levels, rc.run_rounds

def _run(n, comp, strategy, k=1, steps=2, raw_collective=False, threads=True):
    return run_threads(lambda tr: run_rounds(tr, comp, strategy, k, steps, raw_collective,
                                             threads), n, timeout=120)


def _pieces(info, shape, n):
    """(state key, flat start, flat end) of every piece the compressor encoded."""
    out = []
    for p, (s, e, _) in enumerate(info["partitions"]):
        whole = torch.empty(shape).view(-1)
        pshape = part_view(whole, s, e, shape).shape if len(info["partitions"]) > 1 else shape
        if info["workflow"] == "rounds-ring":
            for c, (cs, ce) in enumerate(row_chunks(pshape, n)):
                out.append((f"|{p}|rounds{c}", s + cs, s + ce))
        else:
            out.append((f"|{p}|rounds", s, e))
    return out


def _check_rangequant(res, n, steps):
    all_g = [grads_of(r) for r in range(n)]
    layout = res[0][1]
    for name, shape in zip(all_g[0], SHAPES):
        info = layout[name]
        for step in range(steps):
            want = torch.empty(shape).view(-1)
            for suffix, s, e in _pieces(info, shape, n):
                key = name + suffix
                seed = mix_seed(zlib.crc32(key.encode()) & 0x7FFFFFFF, step)
                for r in range(n):  # every rank drew the same, documented step seed
                    assert res[r][2][key]["seen"][step] == seed
                rng = max(float(all_g[r][name].view(-1)[s:e].abs().max()) for r in range(n))
                total = sum(levels(all_g[r][name].view(-1)[s:e], rng, seed) for r in range(n))
                want[s:e] = total * (rng / LEVELS) / n
            for r in range(n):
                assert torch.equal(res[r][0][step][name].view(-1), want), (name, step, r)


@pytest.mark.parametrize("strategy,k", [("ps", 1), ("ps", 3), ("ring", 1), ("ring", 2)])
@pytest.mark.parametrize("n", [2, 3])
def test_max_then_sum_rounds_over_point_to_point(n, strategy, k):
    """A max-reduced range round, then summed levels: PS with K partitions and
    Ring, each piece exactly the hand-computed average on every rank."""
    res = _run(n, RangeQuant(), strategy, k=k)
    wf = "rounds-ring" if strategy == "ring" else "rounds"
    assert {v["workflow"] for v in res[0][1].values()} == {wf}
    if k > 1:
        assert len(res[0][1]["w0"]["partitions"]) == k
        assert res[0][1]["w0"]["partitions"][0][1] % 10 == 0  # whole rows
    _check_rangequant(res, n, 2)


@pytest.mark.parametrize("threads", [True, False])
def test_max_round_takes_the_collective_lane(threads):
    """Rounds that reduce elementwise by max or sum ride the fused allreduces."""
    res = _run(3, RangeQuant(), "ps", raw_collective=True, threads=threads)
    assert {v["workflow"] for v in res[0][1].values()} == {"rounds-allreduce"}
    _check_rangequant(res, 3, 2)


@pytest.mark.parametrize("strategy,k", [("ps", 1), ("ps", 2), ("ring", 1)])
def test_broadcast_round_sends_the_owners_indices(strategy, k):
    """The owner's top-k indices reach every rank; values are averaged there."""
    n = 3
    res = _run(n, OwnerTopk(0.25), strategy, k=k, raw_collective=True)
    # a broadcast round never takes the lane, even when the lane is on
    assert "rounds-allreduce" not in {v["workflow"] for v in res[0][1].values()}
    all_g = [grads_of(r) for r in range(n)]
    owners = set()
    for name, shape in zip(all_g[0], SHAPES):
        for step in range(2):
            want = torch.zeros(shape).view(-1)
            for suffix, s, e in _pieces(res[0][1][name], shape, n):
                seed = res[0][2][name + suffix]["seen"][step]
                assert all(res[r][2][name + suffix]["seen"][step] == seed for r in range(n))
                owner = seed % n
                owners.add(owner)
                piece = all_g[owner][name].view(-1)[s:e]
                idx = torch.topk(piece.abs(), max(1, -(-(e - s) // 4))).indices
                want[s + idx] = sum(all_g[r][name].view(-1)[s:e][idx] for r in range(n)) / n
            for r in range(n):
                got = res[r][0][step][name].view(-1)
                assert torch.equal(got, res[0][0][step][name].view(-1))
                assert torch.equal(got != 0, want != 0), (name, step)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(owners) > 1  # the owner moves with the step seed


@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_error_feedback_wraps_a_multi_round_compressor(strategy):
    """Error feedback around a max-then-sum compressor: the inner state gets the
    step seed, ranks agree bitwise, and the memory holds what the average missed."""
    ef = ErrorFeedback(RangeQuant())
    assert ef.capabilities.round_reductions == ("max", "sum")
    res = _run(2, ef, strategy, steps=3)
    for name in res[0][0][0]:
        for step in range(3):
            assert torch.equal(res[0][0][step][name], res[1][0][step][name])
    for key, st in res[0][2].items():
        assert len(st["inner"]["seen"]) == 3 and len(set(st["inner"]["seen"])) == 3, key
        assert st["inner"]["seen"] == res[1][2][key]["inner"]["seen"]
        assert float(st["error"].abs().max()) > 0


def test_a_broadcast_round_cannot_be_summable():
    with pytest.raises(ValueError, match="broadcast"):
        Capabilities("sparsification", aggregatable=True, rounds=2,
                     round_reductions=("broadcast", "sum"), summable=(True, True))


def test_row_chunks_keep_whole_rows():
    assert row_chunks((5, 3), 2) == [(0, 9), (9, 15)]
    assert row_chunks((2, 3), 3) == [(0, 2), (2, 4), (4, 6)]  # fewer rows than chunks
    assert part_view(torch.arange(15.0), 9, 15, (5, 3)).shape == (2, 3)
    assert part_view(torch.arange(15.0), 8, 15, (5, 3)).shape == (7,)
