"""Bloom-filter index codec (hipress_like/compressors/bloom.py; thesis Sec. 2.3.2, 3)."""
from __future__ import annotations

import doctest
import math
import struct

import pytest
import torch

import hipress_like.compressors as C
from hipress_like.compressors import PayloadError
from hipress_like.compressors._build import native as _native
from hipress_like.compressors.base import header_nbytes, unpack_payload
from hipress_like.compressors.params import ParamError, ParamTypeError
from hipress_like.compressors.sparse import bloom
from hipress_like.compressors.sparse.bloom import (
    BLOCK_LOG2,
    BloomIndex,
    block_starts,
    bloom_bits,
    bloom_hashes,
    layout,
)

native = pytest.mark.skipif(not _native.available(), reason="no C compiler for _native.c")


def _topk(n, ratio, seed):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, math.ceil(ratio * n))
    return g, torch.sort(torch.topk(g.abs(), k).indices).values


def test_docstring_examples():
    assert doctest.testmod(bloom).failed == 0


def _layout(idx, n, eps):
    nb = -(-n >> BLOCK_LOG2)
    return layout(torch.diff(block_starts(idx, BLOCK_LOG2, nb)), eps)


def test_filter_size_and_hashes_follow_the_thesis_formulas():
    # m = -r ln(eps) / (ln 2)^2, k = -ln(eps) / ln 2 (Sec. 2.3.2.1, 3.2)
    assert bloom_bits(1000, 0.01) == math.ceil(1000 * 9.585058377367439)
    assert bloom_hashes(0.01) == 7 and bloom_hashes(0.5) == 1 and bloom_hashes(0.001) == 10
    assert bloom_bits(0, 0.01) == 0
    counts = torch.tensor([0, 1, 1000, 12345])
    lay = layout(counts, 0.01)  # every block sized by the formula for its own count
    assert lay.bits.tolist() == [bloom_bits(int(c), 0.01) for c in counts]
    assert lay.offsets.tolist() == [0, 0, 2, 2 + 1199, 2 + 1199 + 14791]


def test_a_small_tensor_is_one_filter_as_in_the_thesis():
    n = 1 << BLOCK_LOG2
    _, idx = _topk(n, 0.01, 0)
    code = BloomIndex(eps=0.01).encode(idx, n, seed=1)
    fields = BloomIndex.fields.unpack(code.fields)
    assert fields[2] == (bloom_bits(idx.numel(), 0.01) + 7) // 8  # one filter's bytes


@pytest.mark.parametrize("n", [100_000, 1 << 20])
def test_bits_per_index_within_5_percent_of_the_formula_plus_the_header(n):
    g, idx = _topk(n, 0.01, 0)
    c = C.get("topk", ratio=0.01, index_codec="bloom", eps=0.01)
    payload, _ = c.encode(g, {})
    r = idx.numel()
    header = 8 * header_nbytes(1, 16 + BloomIndex.fields.size)
    bits = 8 * payload.numel() - 32 * r - header  # counts and filters: all but values, header
    formula = -math.log(0.01) / math.log(2) ** 2  # 9.585 bits per index
    assert formula <= bits / r <= 1.05 * formula
    if r >= 10_000:  # the header is then a rounding error
        assert (bits + header) / r <= 1.05 * formula


def test_measured_false_positive_rate_is_eps():
    n = 1 << 20
    _, idx = _topk(n, 0.01, 1)
    code = BloomIndex(eps=0.01).encode(idx, n, seed=5)
    positives = BloomIndex.fields.unpack(code.fields)[4]
    fpr = (positives - idx.numel()) / (n - idx.numel())
    assert 0.0085 < fpr < 0.0115  # ~10k expected false positives: +-15% is ~15 sigma


@pytest.mark.parametrize("policy", bloom.POLICIES)
@pytest.mark.parametrize("second", [None, 0.2])
def test_fpaware_places_every_value_at_the_index_the_encoder_intended(policy, second):
    n = 50_000
    g, idx = _topk(n, 0.01, 2)
    codec = BloomIndex(eps=0.05, policy=policy, second_eps=second)
    code = codec.encode(idx, n, seed=9)
    got = BloomIndex.decode(codec.fields.unpack(code.fields), code.section, n, idx.numel())
    assert torch.equal(got, code.sent)
    c = C.get("topk", ratio=0.01, index_codec="bloom", eps=0.05, policy=policy,
              second_eps=second)
    out = c.decode(c.encode(g, {"seed": 1})[0])
    nz = torch.nonzero(out).reshape(-1)
    assert nz.numel() == idx.numel() and torch.equal(out[nz], g[nz])


@pytest.mark.parametrize("policy", bloom.POLICIES)
def test_lossy_policies_map_the_sorted_values_to_the_drawn_positions(policy):
    """Without fp-awareness the values of S are sent sorted by position and placed on the
    drawn positions in order (Sec. 3.3, Alg. 4): a false positive shifts them."""
    n = 50_000
    g, idx = _topk(n, 0.01, 3)
    c = C.get("topk", ratio=0.01, index_codec="bloom", eps=0.05, policy=policy,
              fpaware=False)
    out = c.decode(c.encode(g, {})[0])
    nz = torch.nonzero(out).reshape(-1)
    assert nz.numel() == idx.numel()
    assert torch.equal(out[nz], g[idx])
    assert not torch.equal(nz, idx)  # eps = 0.05 over 50k positions: false positives drawn


def test_leftmost_draws_the_smallest_positives_and_random_follows_the_seed():
    cand = torch.arange(0, 100, 3)
    lay5, lay10 = layout(torch.tensor([5]), 0.1), layout(torch.tensor([10]), 0.1)
    assert torch.equal(bloom.select("leftmost", cand, lay5, None, 0), cand[:5])
    a = bloom.select("random", cand, lay10, None, 1)
    assert torch.equal(a, bloom.select("random", cand, lay10, None, 1))
    assert not torch.equal(a, bloom.select("random", cand, lay10, None, 2))
    pre = torch.zeros(cand.numel(), dtype=torch.bool)
    pre[-3:] = True
    got = bloom.select("leftmost", cand, lay5, pre, 0)
    assert torch.equal(got, torch.cat([cand[:2], cand[-3:]]))


def test_each_block_draws_its_own_count():
    u = 1 << BLOCK_LOG2
    cand = torch.tensor([1, 2, 3, u + 5, u + 6, 2 * u + 1])
    lay = layout(torch.tensor([2, 1, 0]), 0.1)
    for policy in ("leftmost", "random"):
        got = bloom.select(policy, cand, lay, None, 3)
        assert torch.diff(block_starts(got, BLOCK_LOG2, 3)).tolist() == [2, 1, 0]


def test_policy_error_rate_of_the_thesis_example():
    # Sec. 3.7: S = {0, 3, 4, 8}, drawn {0, 3, 6, 9}: half are false positives
    assert bloom.policy_error_rate(torch.tensor([0, 3, 6, 9]), torch.tensor([0, 3, 4, 8])) == 0.5
    assert bloom.policy_errors(torch.tensor([1, 2]), torch.tensor([1, 2, 5])) == (0, 2)
    assert bloom.policy_error_rate(torch.zeros(0, dtype=torch.long), torch.tensor([1])) == 0.0


def test_conflict_sets_and_a_second_filter_draw_fewer_false_positives():
    n = 1 << 18
    _, idx = _topk(n, 0.01, 4)
    per = {}
    for name, kw in [("leftmost", {"policy": "leftmost"}), ("random", {"policy": "random"}),
                     ("conflict", {}), ("second", {"second_eps": 0.1})]:
        codec = BloomIndex(eps=0.01, **kw)
        code = codec.encode(idx, n, seed=3)
        per[name] = bloom.policy_error_rate(code.sent, idx)
    assert per["leftmost"] > 0.35 and per["random"] > 0.35
    assert per["conflict"] < 0.6 * per["random"]
    assert per["second"] < per["conflict"]


@native
@pytest.mark.parametrize("n,ratio,eps,seed", [(1 << 14, 0.01, 0.01, 1), (1 << 16, 0.05, 0.1, 2),
                                              (3000, 0.3, 0.3, 4), (1 << 18, 0.01, 0.001, 5),
                                              (3 << 18, 0.01, 0.02, 6), ((1 << 19) + 77, 0.002,
                                                                         0.05, 7)])
def test_native_loops_equal_the_torch_ones(n, ratio, eps, seed):
    _, idx = _topk(n, ratio, seed)
    r = idx.numel()
    lay, nh = _layout(idx, n, eps), bloom_hashes(eps)
    s1, s2 = bloom._seeds(seed, 0)
    f = bloom.build_filter(idx, lay, nh, s1, s2, native=True)
    assert torch.equal(f, bloom.build_filter(idx, lay, nh, s1, s2, native=False))
    c1, t1 = bloom.query(f, lay, nh, s1, s2, n, n, native=True)
    c2, t2 = bloom.query(f, lay, nh, s1, s2, n, n, native=False)
    assert t1 == t2 and torch.equal(c1, c2) and bool(torch.isin(idx, c1).all())
    assert bool(bloom.contains(f, lay, nh, s1, s2, c1).all())
    negatives = torch.arange(n)[~torch.isin(torch.arange(n), c1)]
    assert not bool(bloom.contains(f, lay, nh, s1, s2, negatives).any())
    for pre in (None, torch.isin(c1, idx[::3])):
        for policy in bloom.POLICIES:
            a = bloom.select(policy, c1, lay, pre, seed, nh, s1, s2, native=True)
            b = bloom.select(policy, c1, lay, pre, seed, nh, s1, s2, native=False)
            assert torch.equal(a, b) and a.numel() == r


@native
def test_a_rank_without_the_native_loops_decodes_the_same(monkeypatch):
    g, _ = _topk(40_000, 0.01, 6)
    c = C.get("topk", ratio=0.01, index_codec="bloom", second_eps=0.3)
    payload, _ = c.encode(g, {"seed": 2})
    want = c.decode(payload)
    monkeypatch.setattr(_native, "available", lambda: False)
    assert torch.equal(c.decode(payload), want)


def test_query_returns_at_most_cap_and_the_total():
    _, idx = _topk(10_000, 0.05, 7)
    lay, nh = _layout(idx, 10_000, 0.1), bloom_hashes(0.1)
    f = bloom.build_filter(idx, lay, nh, 1, 2)
    full, total = bloom.query(f, lay, nh, 1, 2, 10_000, 10_000)
    some, total2 = bloom.query(f, lay, nh, 1, 2, 10_000, 10)
    assert total == total2 == full.numel() and torch.equal(some, full[:10])


def test_an_empty_selection_round_trips():
    codec = BloomIndex()
    code = codec.encode(torch.zeros(0, dtype=torch.int64), 1000, 0)
    fields = codec.fields.unpack(code.fields)
    assert code.section.numel() == BloomIndex.section_nbytes(fields, 1000, 0) == 8 + 1
    assert not bool(code.section.any())
    assert BloomIndex.decode(fields, code.section, 1000, 0).numel() == 0
    c = C.get("dgc", ratio=0.01, index_codec="bloom")
    z = torch.zeros(500)
    payload, _ = c.encode(z, c.init(z))
    assert torch.equal(c.decode(payload), z)


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [0, 1, -0.1, 1.5, float("nan"), float("inf"), 1e-300])
def test_eps_outside_0_1_is_refused(eps):
    with pytest.raises(ParamError, match="eps"):
        C.get("topk", index_codec="bloom", eps=eps)
    with pytest.raises(ParamError, match="second_eps"):
        C.get("topk", index_codec="bloom", second_eps=eps)


def test_bad_parameter_types_and_policies_are_refused():
    with pytest.raises(ParamTypeError):
        C.get("topk", index_codec="bloom", eps="0.01")
    with pytest.raises(ParamError, match="policy must be one of"):
        C.get("topk", index_codec="bloom", policy="rightmost")
    with pytest.raises(ParamTypeError):
        C.get("topk", index_codec="bloom", fpaware=1)


def test_tensors_past_2_to_32_elements_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="index_codec='plain'"):
        BloomIndex().encode(torch.tensor([1, 2]), 1 << 32, 0)


def _bloom_payload(n=20_000, **kw):
    g, _ = _topk(n, 0.01, 8)
    c = C.get("topk", ratio=0.01, index_codec="bloom", **kw)
    return c, c.encode(g, {})[0]


def _extra_offset(payload):
    return header_nbytes(len(unpack_payload(payload).shape), 0) + 16


def _section_offset(payload):
    h = unpack_payload(payload)
    return payload.numel() - h.body.numel()


def test_an_encoders_own_payload_is_decoded_from_its_memo_exactly():
    """A false-positive-aware encoder ran the decoder; decoding its own payload (error
    feedback, a PS server's aggregate) reuses that result, and equals a fresh decode."""
    g, _ = _topk(300_000, 0.01, 9)
    for params in ({}, {"second_eps": 0.2}):
        c = C.get("topk", ratio=0.01, index_codec="bloom", **params)
        payload, _ = c.encode(g, {"seed": 4})
        hits = bloom.DECODED.hits
        mine = c.decode(payload)
        assert bloom.DECODED.hits == hits + 1
        bloom.DECODED.clear()
        assert torch.equal(c.decode(payload), mine)  # decoded from the bytes alone
        assert bloom.DECODED.hits == hits + 1


def test_a_truncated_filter_is_refused():
    c, payload = _bloom_payload()
    for cut in (1, 100, payload.numel() - 200):
        with pytest.raises(PayloadError):
            c.decode(payload[:-cut])


@pytest.mark.parametrize("byte", [8, 15, 100])
def test_a_corrupted_filter_is_refused_not_decoded(byte):
    c, payload = _bloom_payload()
    bad = payload.clone()
    bad[_section_offset(payload) + byte] ^= 0xFF  # past the 8 bytes of the block count
    with pytest.raises(PayloadError, match="positives"):
        c.decode(bad)


def test_corrupted_block_counts_and_padding_are_refused():
    c, payload = _bloom_payload(n=600_000)  # three blocks
    off = _section_offset(payload)
    bad = payload.clone()
    bad[off] ^= 1  # the first block's count
    with pytest.raises(PayloadError, match="block counts"):
        c.decode(bad)
    bad = payload.clone()
    bad[-(4 * 6000) - 1] = 0x5A  # the zeros after the filters, before the values
    with pytest.raises(PayloadError, match="after its filters"):
        c.decode(bad)


@pytest.mark.parametrize("field,value,match", [(0, 0.02, "body has|filter bytes"), (0, 1.5, "eps"),
                                               (8, 7, "policy"), (9, 0x40, "flags"),
                                               (4, 10**9, "positives"), (10, 3, "blocks")])
def test_inconsistent_filter_fields_are_refused(field, value, match):
    c, payload = _bloom_payload()
    off = _extra_offset(payload)
    fields = list(BloomIndex.fields.unpack(bytes(payload[off: off + BloomIndex.fields.size]
                                                 .tolist())))
    fields[field] = value
    bad = payload.clone()
    bad[off: off + BloomIndex.fields.size] = torch.frombuffer(
        bytearray(BloomIndex.fields.pack(*fields)), dtype=torch.uint8)
    with pytest.raises(PayloadError, match=match):
        c.decode(bad)


def test_fields_struct_size_is_stable():
    # what other ranks read: eps, eps2, filter bytes, second filter bytes, positives, seed,
    # k, k2, policy, flags, log2 block size
    assert BloomIndex.fields.size == 52 and struct.calcsize("<ddQQQIBBBBB3x") == 52
