"""THC's transform in C (``_native.thc_rht``/``thc_fwht``) against its torch definition.

The forward transform must give the floats of the radix-2 butterflies
(``thc_kernels._fwht_rows``' path for small tensors) on ``D (x * s)``; the decode's
inverse runs on exact integers, so there C and the torch GEMM path agree bit
for bit, and a THC decode is the same whichever path a rank takes.
"""
from __future__ import annotations

import pytest
import torch

from hipress_like.compressors._build import native as _native
from hipress_like.compressors.ops import _as_i32
from hipress_like.compressors.thc import kernels as thc_kernels
from hipress_like.compressors.thc import native as thc_native
from hipress_like.compressors.thc import thc

pytestmark = pytest.mark.skipif(not _native.available(), reason="no C compiler here")


def _butterflies(v: torch.Tensor, size: int) -> torch.Tensor:
    y, h = v.reshape(-1), 1
    while h < size:
        w = y.view(-1, 2, h)
        y = torch.stack((w[:, 0] + w[:, 1], w[:, 0] - w[:, 1]), 1).reshape(-1)
        h *= 2
    return y


@pytest.mark.parametrize("size, rows, first", [(1, 3, 0), (2, 5, 7), (8, 4, 0), (512, 3, 40),
                                               (4096, 9, 0), (4096, 2, 12288)])
def test_rht_is_the_butterflies_on_flipped_scaled_rows(size, rows, first):
    gen = torch.Generator().manual_seed(size + rows)
    x = torch.randn(rows * size, generator=gen) * 3
    scale = torch.rand(rows, generator=gen) + 0.25
    key = 0x5EED1234
    y = torch.empty_like(x)
    thc_native.thc_rht(x, y, size, scale, key, first)
    v = x.view(rows, size) * scale.view(-1, 1)
    i = torch.arange(rows * size, dtype=torch.int32) + first
    v = torch.where(thc_kernels._rademacher(i, _as_i32(key)).view(v.shape), -v, v)
    assert torch.equal(y, _butterflies(v, size))


def test_fwht_on_integers_equals_the_gemm_path():
    gen = torch.Generator().manual_seed(3)
    y = torch.randint(-240, 241, (6 * thc.BLOCK,), generator=gen).float()
    ref = thc_kernels._fwht_rows(y.clone(), thc.BLOCK, (torch.empty_like(y), torch.empty_like(y)))
    thc_native.thc_fwht(y, thc.BLOCK)
    assert torch.equal(y, ref)


def _rounds(c, grads, shared=11):
    sts = [c.init(g, seed=r, world_size=len(grads), shared_seed=shared)
           for r, g in enumerate(grads)]
    rng = c.merge_round(0, [c.encode_round(0, g, s, None)[0] for g, s in zip(grads, sts)])
    enc = [c.encode_round(1, g, s, rng) for g, s in zip(grads, sts)]
    return enc, c.merge_round(1, [p for p, _ in enc])


def test_decode_is_the_same_on_either_path(monkeypatch):
    """One aggregate, decoded through C and through torch: the same floats (exact sums)."""
    n = 3 * thc.BLOCK + 2570  # full blocks and tails of 2048 + 512 + 8 + 2
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    c = thc.THC()
    enc, total = _rounds(c, grads)
    native, _ = c.decode_rounds(grads[0], enc[0][1], total, average=True)
    monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    torch_path, _ = c.decode_rounds(grads[0], enc[0][1], total, average=True)
    assert torch.equal(native.view(torch.int32), torch_path.view(torch.int32))


def test_encode_differs_from_torch_only_by_float_rounding(monkeypatch):
    """The GEMM path adds in another order than the butterflies: an index may move by one
    where a value sits on a rounding boundary, nowhere else."""
    n = 8 * thc.BLOCK + 100
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    c = thc.THC(table="uniform", bits=4)
    a = _rounds(c, grads)[1]
    monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    b = _rounds(c, grads)[1]
    sa, sb = a[-4 * (n // 8):].view(torch.uint8), b[-4 * (n // 8):].view(torch.uint8)
    assert (sa != sb).float().mean().item() < 1e-3


@pytest.mark.parametrize("n", [64, 8 * 37 + 5, 3 * thc.BLOCK + 2570])
@pytest.mark.parametrize("table", [None, "uniform"])
def test_native_merge_gives_the_kernels_bytes(n, table, monkeypatch):
    """4-bit indices into 8-bit sums through the C lookup (vector words, scalar words past
    the last multiple of 8, the kernel's tail word): the bytes of the torch kernels, for a
    PS aggregator's N index payloads and for Ring's [partial sum, indices] hops."""
    gen = torch.Generator().manual_seed(n)
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    c = thc.THC(table=table) if table else thc.THC()
    enc, _ = _rounds(c, grads)
    idx = [p for p, _ in enc]

    def merges():
        ps = c.merge_round(1, idx)
        ring = c.merge_round(1, [c.merge_round(1, [c.merge_round(1, idx[:2]), idx[2]]), idx[3]])
        return ps, ring

    native = merges()
    monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    for a, b in zip(native, merges()):
        assert torch.equal(a, b)
    assert torch.equal(native[0], native[1])  # any grouping, the same exact sums
