"""Tests of the CompLL operator library (ops.py): bit packing and the counter-based RNG."""
import pytest
import torch

from hipress_like.compressors import ops
from hipress_like.compressors._build import native as _native
from hipress_like.compressors.sparse import native as sparse_native

M32 = 0xFFFFFFFF


def _fmix32_reference(x: int) -> int:
    """MurmurHash3 fmix32, written straight from Appleby's reference C code."""
    x &= M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    x ^= x >> 16
    return x


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 1001])
def test_pack_unpack_round_trip(bits, n):
    g = torch.Generator().manual_seed(n * 10 + bits)
    codes = torch.randint(0, 1 << bits, (n,), generator=g)
    packed = ops.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == ops.packed_nbytes(n, bits)
    assert torch.equal(ops.unpack_bits(packed, bits, n), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_layout_is_little_endian_within_a_byte(bits):
    per = 8 // bits
    n = 3 * per + 1
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits))
    packed = ops.pack_bits(codes, bits).tolist()
    for i, c in enumerate(codes.tolist()):
        assert (packed[i // per] >> ((i % per) * bits)) & ((1 << bits) - 1) == c


def test_pack_rejects_bad_bits_and_short_input():
    with pytest.raises(ValueError, match="bits must be one of"):
        ops.pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="bits must be one of"):
        ops.packed_nbytes(4, 0)
    with pytest.raises(ValueError, match="need"):
        ops.unpack_bits(torch.zeros(1, dtype=torch.uint8), 1, 9)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_planar_pack_and_plane_codes_are_inverse(bits):
    per, m = 8 // bits, 37
    codes = torch.randint(0, 1 << bits, (per, m), generator=torch.Generator().manual_seed(bits))
    packed = ops._pack_planes(codes.to(torch.float32), bits)
    assert packed.shape == (m,)
    for k in range(per):
        assert torch.equal(ops._plane_codes(packed, bits, k * bits), codes[k].to(torch.int32))
    # a list of planes packs the same as the matrix
    assert torch.equal(ops._pack_planes(list(codes.to(torch.float32)), bits), packed)


def test_hash32_matches_reference_fmix32():
    counters = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 7, 2**40 + 3]
    for seed in [0, 1, 0xDEADBEEF, 2**32 - 1, -5]:
        got = ops.hash32(torch.tensor(counters, dtype=torch.int64), seed).tolist()
        want = [_fmix32_reference((c & M32) ^ (seed & M32)) for c in counters]
        assert got == want


def test_uniform_range_mean_and_reproducibility():
    n = 200_000
    u = ops.uniform(n, seed=7)
    assert u.dtype == torch.float32 and u.shape == (n,)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # mean of U[0,1) has standard error 1/sqrt(12 n) ~ 6.5e-4; allow 6 standard errors
    assert abs(float(u.mean()) - 0.5) < 6 / (12 * n) ** 0.5
    assert torch.equal(u, ops.uniform(n, seed=7))
    assert not torch.equal(u[:100], ops.uniform(100, seed=8))


def test_uniform_slices_are_consistent():
    full = ops.uniform(1000, seed=3)
    assert torch.equal(ops.uniform(10, seed=3, offset=5), full[5:15])
    assert torch.equal(ops.uniform(1, seed=3, offset=999), full[999:])
    # element i is defined by hash32(offset + i, mix_seed(seed))
    i = torch.arange(5, 15)
    h = ops.hash32(i, ops.mix_seed(3))
    assert torch.equal((h >> 8).to(torch.float32) / 2**24, full[5:15])


def test_uniform_large_offsets_wrap_modulo_2_32():
    a = ops.uniform(4, seed=1, offset=2**32 + 10)
    b = ops.uniform(4, seed=1, offset=10)
    assert torch.equal(a, b)


def _exact_topk_set(x, k):
    return set(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("dist", ["normal", "heavy", "sorted", "sparse"])
def test_prefiltered_topk_is_exact(dist):
    """Large tensors take the sampled prefilter; the selected set is still the exact top-k."""
    n = ops.PREFILTER_MIN_NUMEL * 2
    g = torch.Generator().manual_seed(11)
    x = {"normal": lambda: torch.randn(n, generator=g),
         "heavy": lambda: torch.randn(n, generator=g) ** 5,
         "sorted": lambda: torch.linspace(-1, 1, n),
         "sparse": lambda: torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.02),
         }[dist]()
    for k in (1, n // 1000, n // 100, n // 8):
        idx, vals = ops.topk_abs(x, k)
        assert idx.numel() == k and len(set(idx.tolist())) == k
        assert torch.equal(vals, x[idx])
        got = set(idx.tolist())
        want = _exact_topk_set(x, k)
        if dist == "sorted" and k > 1:  # |linspace| has mirror ties: compare magnitudes
            assert sorted(x[list(got)].abs().tolist()) == sorted(x[list(want)].abs().tolist())
        else:
            assert got == want, (dist, k)


def test_prefiltered_topk_falls_back_when_too_few_candidates(monkeypatch):
    n = ops.PREFILTER_MIN_NUMEL * 2
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    k = n // 100
    # a filter that lets almost nothing through: the prefilter must notice and fall back
    monkeypatch.setattr(_native, "usable", lambda *t: False)
    monkeypatch.setattr(ops, "abs_at_least", lambda x, t: x.abs() > 1e9)
    idx, _ = ops.topk_abs(x, k)
    assert set(idx.tolist()) == _exact_topk_set(x, k)


@pytest.mark.skipif(not _native.available(), reason="no C compiler for _native.c")
@pytest.mark.parametrize("n", [1, 17, 64, 4099, _native.PARALLEL_NUMEL + 37])
def test_native_filter_equals_the_torch_filter(n):
    """One native pass gives torch.nonzero(abs_at_least) exactly: order, NaN, inf, ties,
    the tail after the last block of 64, thread ranges, a cap that is too small, and
    thresholds that most blocks of 64 never reach (DGC's density: they are skipped)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    x[torch.randint(n, (max(1, n // 50),), generator=g)] = float("nan")
    x[torch.randint(n, (max(1, n // 70),), generator=g)] = float("inf")
    x[torch.randint(n, (max(1, n // 90),), generator=g)] = 2.0
    for t in (0.0, 2.0, 2.5, 3.5, 1e30):
        want = torch.nonzero(ops.abs_at_least(x, torch.tensor(t))).reshape(-1)
        got, total, nonfinite = sparse_native.abs_at_least_indices(x, t, n)
        assert total == want.numel() and torch.equal(got, want)
        assert nonfinite == bool((~torch.isfinite(x)).any())  # NaN/Inf told in the pass
        assert not sparse_native.abs_at_least_indices(torch.nan_to_num(x, 0.0, 1.0, -1.0),
                                                      t, n)[2]
        few, total, _ = sparse_native.abs_at_least_indices(x, t, max(0, want.numel() - 1))
        if want.numel():
            assert total == want.numel() and few.numel() == 0  # too small: call again
        assert torch.equal(ops.abs_at_least_indices(x, t), want)
        assert torch.equal(ops.abs_at_least_indices(x.double(), t), want)  # the torch path


def test_abs_at_least_matches_abs_and_never_selects_nan():
    x = torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.0, float("nan"), float("inf"), -float("inf")])
    t = torch.tensor(1.0)
    assert ops.abs_at_least(x, t).tolist() == [True, True, False, True, True, False, True, True]
