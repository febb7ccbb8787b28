"""Eq. 4a/4b/5a-5c of the flexible-communication paper on hand-computed cases, the
selection against the argmin of the costs, and the point-to-point collectives
(casync/collectives.py) on in-process ranks against exact sums; the link measurement
the selection reads (tuning/link.py)."""
import math
import random

import pytest
import torch

from hipress_like.casync import collectives as col
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.cost_model import collectives as cm
from hipress_like.tuning.link import collective_links, measure_link

# M = 1 MB, N = 4, alpha = 1 ms, beta = 1 ns/B (8 Gbit/s), c = 0.1: Mc beta = 0.1 ms.
CASE = dict(m=1e6, n=4, alpha=1e-3, beta=1e-9, c=0.1)


def test_eq4_costs_by_hand():
    # AG: alpha log N + 2 M c beta (N-1) = 2 ms + 2 * 0.1 ms * 3 = 2.6 ms
    # Eq. 4a: alpha [2(N-1) + log N] + M c beta [2(N-1)/N + log N] = 8 ms + 0.1 ms * 3.5
    # Eq. 4b: 3 alpha log N + 3 M c beta log N = 6 ms + 0.6 ms
    got = cm.topk_costs(**CASE)
    assert got["allgather"] == pytest.approx(2.6e-3, rel=1e-12)
    assert got["art_ring"] == pytest.approx(8.35e-3, rel=1e-12)
    assert got["art_tree"] == pytest.approx(6.6e-3, rel=1e-12)
    assert cm.ar_topk_ring(1e6, 8, 0.0, 1e-9, 0.1) == pytest.approx(1e-4 * (14 / 8 + 3))
    assert cm.ar_topk_tree(1e6, 8, 2e-3, 0.0, 0.5) == pytest.approx(3 * 2e-3 * 3)


@pytest.mark.parametrize("n,a,b,c", [
    (4, 1.25, 5 / 12, 0.0),              # 5a: (2 - 3/4) / (3 - 2); 5b: 1 - 1/4 - 2/6; 5c: 3/2 - 3/2
    (8, 2.125 / 4, 1 - 1 / 8 - 3 / 14, 7 / 3 - 1.5),
    (2, math.inf, 0.0, -0.5),            # N = 2: both AR-Topk pay 3 alpha
])
def test_eq5_thresholds_by_hand(n, a, b, c):
    mc = 1e6 * 0.01
    assert cm.eq5a_threshold(1e6, n, 0.01) == pytest.approx(a * mc)
    assert cm.eq5b_threshold(1e6, n, 0.01) == pytest.approx(b * mc, abs=1e-9)
    assert cm.eq5c_threshold(1e6, n, 0.01) == pytest.approx(c * mc, abs=1e-9)


def test_selection_by_hand():
    # N=4, Mc = 100 kB: ART-Ring beats AG iff alpha/beta < 41.67 kB.
    assert cm.select_collective(1e6, 4, 1e-3, 1e-9, 0.1) == "allgather"  # 1 MB/s^-1 >> 41.67 kB
    assert cm.select_collective(1e6, 4, 4e-5, 1e-9, 0.1) == "art_ring"   # 40 kB
    assert cm.select_collective(1e6, 4, 4.2e-5, 1e-9, 0.1) == "allgather"  # 42 kB
    # N=16, Mc = 100 kB: 5a's bound 3.0625/11 Mc = 27.8 kB, 5c's 2.25 Mc = 225 kB
    assert cm.select_collective(1e6, 16, 1e-4, 1e-9, 0.1) == "art_tree"   # 100 kB: between
    assert cm.select_collective(1e6, 16, 1e-3, 1e-9, 0.1) == "allgather"  # 1 MB: above 5c
    assert cm.select_collective(1e6, 16, 2e-5, 1e-9, 0.1) == "art_ring"   # 20 kB: under 5a
    assert cm.select_collective(1e6, 2, 0.0, 1e-9, 0.5) == "allgather"  # 5b's bound is 0
    assert cm.select_per_gradient({"a": 1e6, "b": 1e8}, 16, 1e-4, 1e-9, 0.1) == {
        "a": "art_tree", "b": "art_ring"}


def test_selection_is_the_argmin_of_the_costs():
    rnd = random.Random(0)
    checked = 0
    for _ in range(3000):
        m = 10 ** rnd.uniform(3, 9)
        n = rnd.randint(2, 64)
        alpha = 10 ** rnd.uniform(-6, -1)
        beta = 10 ** rnd.uniform(-11, -7)
        c = 10 ** rnd.uniform(-3, 0)
        costs = cm.topk_costs(m, n, alpha, beta, c)
        best = sorted(costs.values())
        if best[1] - best[0] < 1e-9 * best[0]:
            continue  # a tie: either answer is right
        assert cm.select_collective(m, n, alpha, beta, c) == min(costs, key=costs.get)
        checked += 1
    assert checked > 2900


@pytest.mark.parametrize("kw,match", [(dict(n=1), "n >= 2"), (dict(c=0.0), "compression ratio"),
                                      (dict(c=1.5), "compression ratio"),
                                      (dict(alpha=-1.0), ">= 0")])
def test_bad_selection_input(kw, match):
    with pytest.raises(ValueError, match=match):
        cm.select_collective(**{**CASE, **kw})


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="available: allgather, art_ring, art_tree"):
        cm.check_collective("ring")
    with pytest.raises(ValueError, match="available: backend, ring, tree"):
        run_threads(lambda tr: col.allreduce_by("butterfly", tr, torch.ones(3)), 2)


def _data(rank, numel):
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-50, 50, (numel,), generator=g).float()  # integer sums are exact


@pytest.mark.parametrize("n,numel", [(1, 7), (2, 7), (3, 10), (4, 3), (5, 33)])
def test_p2p_allreduces_broadcast_allgather_are_exact(n, numel):
    want = sum(_data(r, numel) for r in range(n))

    def work(tr):
        out = {"ring": col.ring_allreduce(tr, _data(tr.rank, numel).clone(), 10),
               "bcast": col.tree_broadcast(tr, _data(tr.rank, numel).clone(), n - 1, 10),
               "gather": col.bruck_allgather(tr, _data(tr.rank, numel), 10)}
        if n > 1:
            out["tree"] = col.tree_allreduce(tr, _data(tr.rank, numel).clone(), 10)
        return out

    res = run_threads(work, n, timeout=60)
    for r in range(n):
        assert torch.equal(res[r]["ring"], want)
        assert torch.equal(res[r]["bcast"], _data(n - 1, numel))
        assert all(torch.equal(g, _data(j, numel)) for j, g in enumerate(res[r]["gather"]))
        if n > 1:
            assert torch.equal(res[r]["tree"], want)


def test_a_tree_over_one_rank_is_an_error():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        run_threads(lambda tr: col.tree_allreduce(tr, torch.ones(3)), 1)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        run_threads(lambda tr: col.topk_sync(tr, torch.ones(3), 0.5, "art_tree"), 1)


@pytest.mark.parametrize("collective", cm.SELECTABLE)
def test_topk_sync_by_hand(collective):
    n, numel, ratio, owner = 3, 40, 0.1, 2
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(9 + r))
             for r in range(n)]
    res = run_threads(lambda tr: col.topk_sync(tr, grads[tr.rank], ratio, collective,
                                               owner=owner, timeout=10), n)
    want = torch.zeros(numel)
    if collective == "allgather":
        for g in grads:
            idx = g.abs().topk(4).indices
            want.index_add_(0, idx, g[idx])
    else:
        idx = grads[owner].abs().topk(4).indices
        want[idx] = sum(g[idx] for g in grads)
    for r in range(n):
        assert torch.equal(res[r], res[0])
        torch.testing.assert_close(res[r], want / n, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad,match", [(dict(ratio=0.0), "ratio"), (dict(ratio=2.0), "ratio"),
                                       (dict(collective="tree"), "unknown collective"),
                                       (dict(owner=5), "owner")])
def test_topk_sync_bad_input(bad, match):
    kw = {"ratio": 0.1, "collective": "art_ring", "owner": 0, **bad}
    with pytest.raises(ValueError, match=match):
        run_threads(lambda tr: col.topk_sync(tr, torch.ones(8), kw["ratio"], kw["collective"],
                                             owner=kw["owner"]), 2)


def test_measure_link_agrees_on_every_rank():
    res = run_threads(lambda tr: measure_link(tr, sizes=(1 << 10, 1 << 16), repeats=2,
                                              timeout=10, steps=3)[0], 3)
    assert res[0] == res[1] == res[2]
    assert res[0].alpha >= 0 and res[0].beta > 0
    with pytest.raises(ValueError, match="at least 2 ranks"):
        run_threads(lambda tr: measure_link(tr), 1)


def test_one_way_beta_by_hand():
    """The refinement (module docstring): tree and broadcast terms at beta_one_way.
    CASE with beta_one_way = 0.5 ns/B: Mc bo = 0.05 ms."""
    bo = 0.5e-9
    # Eq. 4a: 8 ms + Mc (beta 2(N-1)/N + bo log N) = 8 ms + 0.15 + 0.1 ms
    assert math.isclose(cm.ar_topk_ring(**CASE, beta_one_way=bo), 8.25e-3)
    # Eq. 4b: 3 alpha log N + 3 Mc bo log N = 6 ms + 0.3 ms
    assert math.isclose(cm.ar_topk_tree(**CASE, beta_one_way=bo), 6.3e-3)
    costs = cm.topk_costs(**CASE, beta_one_way=bo)
    assert math.isclose(costs["allgather"], 2.6e-3)  # no tree step: unchanged
    # beta_one_way = beta is the paper, everywhere
    assert cm.topk_costs(**CASE, beta_one_way=CASE["beta"]) == cm.topk_costs(**CASE)
    with pytest.raises(ValueError, match="beta_one_way must be >= 0"):
        cm.topk_costs(**CASE, beta_one_way=-1.0)


def test_one_way_beta_can_pick_the_tree_that_eq5c_never_picks_at_four_ranks():
    big = dict(m=100e6, n=4, alpha=1e-6, beta=1e-9, c=0.1)
    assert cm.select_collective(**big) == "art_ring"  # Eq. 5c's bound is <= 0 at N = 4
    assert cm.select_collective(**big, beta_one_way=1e-9) == "art_ring"
    # ring 8 us + 1e7 (1.5 + 0.6) ns = 21 ms; tree 6 us + 3e7 * 0.3 ns * 2 = 18 ms
    assert cm.select_collective(**big, beta_one_way=0.3e-9) == "art_tree"
    for bo in (0.1e-9, 0.3e-9, 0.7e-9, 2e-9):
        costs = cm.topk_costs(**big, beta_one_way=bo)
        assert cm.select_collective(**big, beta_one_way=bo) == min(costs, key=costs.get)


def test_measure_link_one_way_pairs_ranks():
    """Rank 2i sends to 2i+1 (an odd world's last rank idles); every rank agrees."""
    res = run_threads(lambda tr: measure_link(tr, sizes=(1 << 10, 1 << 16), repeats=2,
                                              timeout=10, pattern="one_way", steps=3)[0], 3)
    assert res[0] == res[1] == res[2] and res[0].beta > 0
    with pytest.raises(ValueError, match="pattern must be one of"):
        run_threads(lambda tr: measure_link(tr, pattern="star"), 2)


def test_collective_links_is_the_engines_link_source():
    """The front ends' link source: ring then one-way links, equal on every rank."""
    res = run_threads(lambda tr: collective_links(tr, 10, sizes=(1 << 10, 1 << 16),
                                                  repeats=2, steps=2), 3)
    assert res[0] == res[1] == res[2]
    ring, one_way = res[0]
    assert ring.beta > 0 and one_way.beta > 0


def test_docstring_examples():
    import doctest

    r = doctest.testmod(cm, optionflags=doctest.ELLIPSIS)
    assert r.attempted > 0 and r.failed == 0

