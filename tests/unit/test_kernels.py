"""The kernels protocol: every compressor's fast paths give the bits of the default,
written in terms of decode; wrappers reach their inner kernels without forwarding."""
import pytest
import torch

from hipress_like import compressors as C
from hipress_like.compressors.kernels import InnerKernels, Kernels

SINGLE = sorted(n for n in set(C.available()) if C.get(n).capabilities.rounds == 1)


def _payload(c, g):
    return c.encode(g, c.init(g, seed=3, world_size=2))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", SINGLE)
def test_fast_paths_give_the_bits_of_decode(name, dtype):
    c = C.get(name)
    k = c.kernels
    assert isinstance(k, Kernels) and k is c.kernels  # built once
    gen = torch.Generator().manual_seed(5)
    gs = [torch.randn(257, generator=gen, dtype=dtype) for _ in range(3)]
    ps = [_payload(c, g) for g in gs]
    acc0 = torch.randn(257, generator=gen, dtype=dtype)

    acc = acc0.clone()
    assert torch.equal(k.decode_add_(ps[0], acc), acc0 + c.decode(ps[0]))
    ref = acc0.clone()
    for p in ps:
        ref = ref + c.decode(p)
    assert torch.equal(k.decode_add_many_(ps, acc0.clone()), ref)
    assert torch.equal(k.decode_div_(ps[1], torch.empty(257, dtype=dtype), 3),
                       c.decode(ps[1]) / 3)
    x = gs[2].clone()
    p = _payload(c, x)
    assert torch.equal(k.subtract_decoded_(x.clone(), p), x - c.decode(p))
    tok = k.deferred_residual(p, x)
    if tok is not None:
        assert torch.equal(k.apply_residual_(x.clone(), tok), x - c.decode(p))
    # the compatibility methods are the kernels
    assert not hasattr(c, "decode_add_")  # the fast paths are reached as c.kernels only
    assert k.merged_nbytes(p.numel(), 4) == p.numel()


@pytest.mark.parametrize("name", SINGLE)
def test_encode_accumulated_is_add_then_encode(name):
    c = C.get(name)
    g = torch.randn(100, generator=torch.Generator().manual_seed(1))
    mem = torch.randn(100, generator=torch.Generator().manual_seed(2))
    st = c.init(g, seed=1, world_size=1)
    fused = c.kernels.encode_accumulated_(mem.clone(), g, dict(st))
    if fused is None:
        return
    ref, _ = c.encode(mem + g, dict(st))
    assert torch.equal(fused[0], ref)


@pytest.mark.parametrize("name", SINGLE)
def test_error_feedback_reaches_the_inner_kernels_without_forwarding(name):
    inner = C.get(name)
    if isinstance(inner, C.ErrorFeedback):
        pytest.skip("ef of ef is refused")
    ef = C.ErrorFeedback(inner)
    assert isinstance(ef.kernels, InnerKernels)
    g = torch.randn(64, generator=torch.Generator().manual_seed(7))
    p = _payload(inner, g)
    acc = torch.ones(64)
    assert torch.equal(ef.kernels.decode_add_(p, acc.clone()),
                       inner.kernels.decode_add_(p, acc.clone()))
    assert torch.equal(ef.kernels.decode_div_(p, torch.empty(64), 2),
                       inner.kernels.decode_div_(p, torch.empty(64), 2))
    for hook in ("decode_add_", "decode_add_many_", "decode_div_", "summable_view"):
        assert hook not in vars(C.ErrorFeedback), hook  # nothing forwarded by hand


def test_powersgd_summable_view_is_a_kernel():
    c = C.get("powersgd", rank=2)
    g = torch.randn(6, 4)
    p0, _ = c.encode_round(0, g, c.init(g, world_size=1, shared_seed=1), None)
    v = c.kernels.summable_view(p0)
    assert v is not None and v.data_ptr() >= p0.data_ptr()
    assert torch.equal(c.kernels.summable_view(p0), v)
    assert C.ErrorFeedback(c).kernels.summable_view(p0) is not None


def test_sparse_kernels_touch_only_the_payload_entries():
    """Top-k's decode-add is ``acc[idx] += vals``: a -0.0 outside the payload's indices
    stays -0.0 (documented; decode-then-add gives +0.0, an equal value); a buffer the
    fast path cannot take (strided) gets the default's bits."""
    c = C.get("topk", ratio=0.1)
    g = torch.randn(100, generator=torch.Generator().manual_seed(3))
    p = _payload(c, g)
    dec = c.decode(p)
    out = c.kernels.decode_add_(p, torch.full((100,), -0.0))
    assert torch.equal(out, dec)
    assert bool(torch.signbit(out[dec == 0]).all())
    strided = torch.full((200,), -0.0)[::2]
    assert not bool(torch.signbit(c.kernels.decode_add_(p, strided)[dec == 0]).any())
    assert torch.equal(c.kernels.decode_div_(p, torch.full((100,), 7.0), 4), dec / 4)
