"""AR-Topk (STAR/VAR) and MSTopk: owner selection, residuals of Alg. 1, the engine's
rounds against a hand computation of Alg. 1, and bad input.

``reference_steps`` replays Alg. 1 (flexible-communication paper) on every
rank's gradient with plain torch; the engine's result must match it piece by
piece (partition or Ring chunk): the same owner, the owner's top-k indices
as the only non-zeros, and there the average of every rank's error-fed
gradient. The multiprocess test imports it.
"""
import doctest
import sys
from pathlib import Path

import pytest
import torch

import hipress_like as hp
from hipress_like.casync.layout import part_view, row_chunks
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.compressors.ops import topk_abs
from hipress_like.compressors.params import ParamError
from hipress_like.compressors.payload import PayloadError
from hipress_like.compressors.sparse import artopk
from hipress_like.compressors.sparse.artopk import MSTopk, STARTopk, VARTopk, fuse, unfuse
from hipress_like.compressors.sparse.topk import num_selected

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rounds_compressors as rc  # noqa: E402

RATIO = 0.25


def pieces(info, shape, n):
    """(state key suffix, flat start, flat end) of every piece the compressor encoded."""
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


def reference_steps(variant, grads, ratio, steps):
    """Alg. 1 by hand for one piece: ``grads[r]`` is rank r's flat gradient (the same
    every step). Returns [(owner, sorted indices, average)] per step; the values
    are summed in rank order, as a CaSync-PS aggregator sums them."""
    n = len(grads)
    res = [torch.zeros_like(g) for g in grads]
    out = []
    for i in range(1, steps + 1):
        big = [g + m for g, m in zip(grads, res)]  # line 5
        k = num_selected(ratio, big[0].numel())
        tops = [torch.sort(topk_abs(b, k)[0]).values for b in big]  # line 6
        if variant == "star":
            owner = i % n  # line 8
        else:
            norms = torch.tensor([float(torch.dot(b[t], b[t])) for b, t in zip(big, tops)],
                                 dtype=torch.float64)
            owner = int(torch.argmax(norms))  # lines 11-14
        idx = tops[owner]
        acc = big[0][idx].clone()
        for b in big[1:]:
            acc.add_(b[idx])
        avg = torch.zeros_like(grads[0])
        avg[idx] = acc / n
        for b in big:  # lines 17-18: residual = G - G[ix]
            b[idx] = 0.0
        res = big
        out.append((owner, idx, avg))
    return out


def check_against_reference(results, variant, n, steps, exact):
    """``results[r] = (outs, layout, states)`` of ``rounds_compressors.run_rounds``."""
    all_g = [rc.grads_of(r) for r in range(n)]
    layout = results[0][1]
    owners = set()
    for name, shape in zip(all_g[0], rc.SHAPES):
        for suffix, s, e in pieces(layout[name], shape, n):
            ref = reference_steps(variant, [all_g[r][name].reshape(-1)[s:e] for r in range(n)],
                                  RATIO, steps)
            for step, (owner, idx, avg) in enumerate(ref):
                owners.add(owner)
                for r in range(n):
                    got = results[r][0][step][name].reshape(-1)[s:e]
                    assert torch.equal(got, results[0][0][step][name].reshape(-1)[s:e])
                    mask = torch.zeros(e - s, dtype=torch.bool)
                    mask[idx] = True
                    assert torch.equal(got != 0, mask & (avg != 0)), (name, step, suffix)
                    if exact:
                        assert torch.equal(got, avg), (name, step, suffix)
                    else:  # a Ring sums in ring order: the last bit may differ
                        torch.testing.assert_close(got, avg, rtol=1e-6, atol=1e-7)
    return owners


def _run(n, comp, strategy, k=1, steps=3):
    return run_threads(lambda tr: rc.run_rounds(tr, comp, strategy, k, steps,
                                                raw_collective=True), n, timeout=120)


@pytest.mark.parametrize("variant,cls", [("star", STARTopk), ("var", VARTopk)])
@pytest.mark.parametrize("strategy,k", [("ps", 1), ("ps", 2), ("ring", 1)])
def test_engine_result_is_alg1_by_hand(variant, cls, strategy, k):
    """Three ranks, three steps (residuals carried over): every piece holds the average
    of the error-fed gradients at the owner's top-k indices and zeros elsewhere."""
    n = 3
    res = _run(n, cls(RATIO), strategy, k)
    wf = {v["workflow"] for v in res[0][1].values()}
    assert wf == {"rounds-ring" if strategy == "ring" else "rounds"}  # never the sum lane
    owners = check_against_reference(res, variant, n, 3, exact=strategy == "ps")
    if variant == "star":
        assert owners == {0, 1, 2}  # i mod N visits every rank in three steps


def test_star_owner_is_i_mod_n():
    c = STARTopk(0.5)
    st = c.init(torch.zeros(4), world_size=3, rank=0)
    seen = []
    for _ in range(6):
        seen.append(c.owner(st, None))
        st = {**st, "step": st["step"] + 1}
    assert seen == [1, 2, 0, 1, 2, 0]


def test_var_owner_is_the_largest_topk_norm():
    """Rank 2's top-k values are the largest: it owns the indices, and the summed
    one-hot vectors are exactly each rank's ||g_topk||^2 in any summation order."""
    c = VARTopk(0.25)
    grads = [torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([0.0, 3.0, -1.0, 0.1]),
             torch.tensor([-4.0, 0.0, 0.0, 1.0])]
    sts = [c.init(g, world_size=3, rank=r) for r, g in enumerate(grads)]
    p0 = []
    for r, g in enumerate(grads):
        p, sts[r] = c.encode_round(0, g, sts[r], None)
        p0.append(p)
    agg = c.merge_round(0, p0)
    other = c.merge_round(0, [c.merge_round(0, [p0[2], p0[0]]), p0[1]])
    assert torch.equal(agg, other)
    assert c.kernels.summable_view(agg).tolist() == [4.0, 9.0, 16.0]
    p1 = []
    for r, g in enumerate(grads):
        p, sts[r] = c.encode_round(1, g, sts[r], agg)
        p1.append(p)
        assert sts[r]["owner"] == 2
    idx = c._unpack(c.merge_round(1, p1), artopk._INDICES)[1]
    assert idx.tolist() == [0]


@pytest.mark.parametrize("cls", [STARTopk, VARTopk])
def test_residual_is_g_minus_what_was_sent(cls):
    """Alg. 1 lines 17-18 over steps: grad + old residual == sent values + new residual,
    and the new residual is zero exactly at the owner's indices."""
    torch.manual_seed(0)
    c = cls(0.1)
    g = torch.randn(50, 4)
    st = c.init(g, world_size=1, rank=0)
    for _ in range(4):
        before = st["residual"].clone()
        agg = None
        for r in range(c.capabilities.rounds):
            p, st = c.encode_round(r, g, st, agg)
            agg = c.merge_round(r, [p])
        out, st = c.decode_rounds(g, st, agg, average=True)
        torch.testing.assert_close(out + st["residual"], g + before, rtol=0, atol=1e-6)
        assert int((out != 0).sum()) == 20
        assert bool((st["residual"][out != 0] == 0).all())
        sent, total = st["gain"]
        assert 0 < sent <= total
    assert st["step"] == 4


def test_the_engine_declarations():
    for name, reds in (("star_topk", ("broadcast", "sum")),
                       ("var_topk", ("sum", "broadcast", "sum"))):
        c = hp.compressors.get(name, ratio=0.01)
        caps = c.capabilities
        assert caps.round_reductions == reds
        assert caps.keeps_memory and caps.stateful and caps.aggregatable
        assert not hp.compressors.needs_error_feedback(c)  # its residual is its own
    assert hp.compressors.needs_error_feedback(hp.compressors.get("mstopk"))


@pytest.mark.parametrize("name", ["star_topk", "var_topk", "mstopk"])
@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan"), "0.1"])
def test_bad_ratio_is_a_clear_error(name, ratio):
    with pytest.raises(ParamError, match="ratio"):
        hp.compressors.get(name, ratio=ratio)


def test_two_owners_and_foreign_payloads_are_rejected():
    c = STARTopk(0.5)
    g = torch.arange(4.0)
    a = c.init(g, world_size=2, rank=0)
    b = c.init(g, world_size=2, rank=1)
    a["step"] = 1  # rank 0 believes it owns step 2, rank 1 owns step 1
    pa, _ = c.encode_round(0, g, a, None)
    pb, _ = c.encode_round(0, g, b, None)
    with pytest.raises(ValueError, match="owners"):
        c.merge_round(0, [pa, pb])
    vals_payload, _ = c.encode_round(1, g, c.encode_round(0, g, b, None)[1], pb)
    with pytest.raises(PayloadError, match="indices"):
        c.encode_round(1, g, c.encode_round(0, g, b, None)[1], vals_payload)
    with pytest.raises(ValueError, match="round 1 before round 0"):
        c.encode_round(1, g, c.init(g, world_size=2, rank=1), pb)
    with pytest.raises(ValueError, match="rank 2 outside"):
        c.init(g, world_size=2, rank=2)


def test_mstopk_keeps_exactly_k_and_the_large_ones():
    """Exactly k entries; everything above the found threshold t1 is kept; on Gaussian
    data the kept mass is within a few percent of the exact top-k's (MSTopk's claim)."""
    torch.manual_seed(1)
    c = MSTopk(ratio=0.01)
    x = torch.randn(100_000)
    st = c.init(x, seed=3)
    p, st = c.encode(x, st)
    out = c.decode(p)
    k = 1000
    assert int((out != 0).sum()) == k
    t1, k1, _, _ = artopk.ms_threshold(x, k)
    assert k1 <= k and bool((out[x.abs() >= t1] != 0).all())
    exact = x.abs().topk(k).values.sum()
    assert float(out.abs().sum()) >= 0.97 * float(exact)
    p2, _ = c.encode(x, c.init(x, seed=3))
    assert torch.equal(p, p2)  # reproducible from (seed, step)
    assert st["step"] == 1


def test_fuse_round_trip():
    ts = [torch.randn(3, 2), torch.randn(5), torch.randn(1, 1, 4)]
    flat = fuse(ts)
    assert flat.numel() == 15
    back = [torch.empty_like(t) for t in ts]
    unfuse(flat, back)
    assert all(torch.equal(a, b) for a, b in zip(ts, back))
    with pytest.raises(ValueError, match="elements"):
        unfuse(flat[:-1], back)


def test_docstring_examples():
    res = doctest.testmod(artopk, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


@pytest.mark.parametrize("cls", [STARTopk, VARTopk])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_double_buffered_step_gives_the_in_place_bits_and_keeps_the_state(cls, dtype):
    """Round 0 forms G = grad + residual in one checked pass (float32 on the CPU:
    sparse/accumulate.c), in place or into a second buffer (detach_state): the
    same payloads and states step after step, and the state the double-buffered
    step was given stays as it was (the engine keeps it to undo the step)."""
    c, n = cls(ratio=0.05), 5000
    gen = torch.Generator().manual_seed(3)
    a = c.init(torch.zeros(n, dtype=dtype), world_size=1, rank=0)
    b = c.init(torch.zeros(n, dtype=dtype), world_size=1, rank=0)
    spare = None
    for _ in range(4):
        g = torch.randn(n, generator=gen, dtype=dtype)
        kept = b["residual"].clone()
        use = c.detach_state(b, spare)
        agg_a = agg_b = None
        for r in range(c.capabilities.rounds):
            pa, a = c.encode_round(r, g, a, agg_a)
            pb, use = c.encode_round(r, g, use, agg_b)
            assert torch.equal(pa, pb)
            agg_a, agg_b = c.merge_round(r, [pa]), c.merge_round(r, [pb])
        out_a, a = c.decode_rounds(g, a, agg_a)
        out_b, use = c.decode_rounds(g, use, agg_b)
        assert torch.equal(out_a, out_b) and torch.equal(a["residual"], use["residual"])
        assert torch.equal(b["residual"], kept) and "residual_buffer" not in use
        spare, b = b, use
