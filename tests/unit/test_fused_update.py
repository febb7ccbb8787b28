"""The fused decode-and-SGD sweep (``native.psgd_lowrank_sgd``), the deferred decodes'
registry (``compressors/powersgd/deferred.py``) and which optimizers may use them
(``adapters/torch/fused_update.py``). The multi-rank check (fused ``step()`` against
``synchronize()`` + ``skip_synchronize()``) is in tests/multiprocess/test_torch_optimizer.py."""
import pytest
import torch

from hipress_like.adapters.torch import fused_update
from hipress_like.compressors._build import native
from hipress_like.compressors.powersgd import PowerSGD, deferred
from hipress_like.compressors.powersgd import native as c

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")

SETTINGS = [dict(momentum=0.9), dict(momentum=0.9, dampening=0.1, weight_decay=1e-4),
            dict(momentum=0.9, weight_decay=1e-3, nesterov=True), dict(momentum=0.0),
            dict(momentum=0.5, maximize=True), dict(momentum=0.0, weight_decay=1e-2)]


@pytest.mark.parametrize("shape", [(64, 1003, 2), (257, 77, 1), (33, 8192, 4), (5, 3, 3)])
@pytest.mark.parametrize("kw", SETTINGS)
@pytest.mark.parametrize("first", [True, False])
def test_the_sweep_has_the_bits_of_decode_then_torch_sgd(shape, kw, first):
    rows, cols, r = shape
    torch.manual_seed(rows * cols + r)
    p, qt = torch.randn(rows, r), torch.randn(r, cols)
    w, buf = torch.randn(rows, cols), torch.randn(rows, cols)
    g = torch.empty(rows, cols)
    c.psgd_lowrank(p, qt, g)  # the decode as PowerSGD writes it
    ref = torch.nn.Parameter(w.clone())
    ref.grad = g.clone()
    opt = torch.optim.SGD([ref], lr=0.0437, **kw)
    if not first and kw["momentum"]:
        opt.state[ref]["momentum_buffer"] = buf.clone()
    opt.step()
    w2, b2, g2 = w.clone(), buf.clone(), torch.full((rows, cols), float("nan"))
    c.psgd_lowrank_sgd(p, qt, g2, w2, b2 if kw["momentum"] else None, lr=0.0437,
                       init=first, **kw)
    assert torch.equal(g2, g)
    assert torch.equal(w2, ref.detach())
    if kw["momentum"]:
        assert torch.equal(b2, opt.state[ref]["momentum_buffer"])


def _decode(out):
    """One PowerSGD step (one rank) whose decode targets ``out``; returns the value."""
    comp = PowerSGD(rank=2)
    g = torch.randn(out.shape)
    st = comp.init(g, world_size=1)
    p0, st = comp.encode_round(0, g, st, None)
    p1, st = comp.encode_round(1, g, st, comp.merge([p0]))
    res, _ = comp.decode_rounds(g, st, comp.merge([p1]), out=out, average=True)
    return res


def test_a_decode_into_an_armed_gradient_waits_and_is_written_on_release():
    torch.manual_seed(0)
    grad = torch.zeros(48, 40)
    plain = _decode(torch.zeros(48, 40)).clone()
    keys = deferred.arm([grad])
    torch.manual_seed(0)
    _decode(grad)
    assert torch.count_nonzero(grad) == 0  # deferred: not written
    deferred.release(keys)  # e.g. synchronize raised: written as before
    assert torch.equal(grad, plain)
    torch.manual_seed(0)
    _decode(grad.zero_())  # disarmed: written at once
    assert torch.equal(grad, plain)


def test_take_hands_over_only_its_own_keys():
    a, b = torch.zeros(16, 8), torch.zeros(16, 8)
    ka, kb = deferred.arm([a]), deferred.arm([b])
    _decode(a)
    _decode(b)
    got = deferred.take(ka)
    assert set(got) == set(ka)
    assert torch.count_nonzero(b) == 0
    deferred.release(kb)
    assert torch.count_nonzero(b) > 0
    assert not deferred.take(ka + kb)  # nothing left behind


def _wrapped(opt):
    """``opt`` as DistributedOptimizer's class layout has it: (mixin, the class)."""
    mixin = type("Mixin", (), {})
    cls = type(type(opt).__name__, (mixin, type(opt)), {})
    new = cls.__new__(cls)
    new.__dict__.update(opt.__dict__)
    return new


def _params():
    ps = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(2)]
    for p in ps:
        p.grad = torch.randn(8, 4)
    return ps


def test_only_plain_sgd_is_eligible():
    ps = _params()
    assert len(fused_update.eligible(_wrapped(torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                                     ps)) == 2

    class MySGD(torch.optim.SGD):
        pass

    assert not fused_update.eligible(_wrapped(MySGD(ps, lr=0.1)), ps)  # may step otherwise
    assert not fused_update.eligible(_wrapped(torch.optim.Adam(ps, lr=0.1)), ps)
    for kw in (dict(foreach=True), dict(differentiable=True), dict(lr=torch.tensor(0.1))):
        opt = torch.optim.SGD(ps, **dict(dict(lr=0.1), **kw))
        assert not fused_update.eligible(_wrapped(opt), ps), kw
    hooked = _wrapped(torch.optim.SGD(ps, lr=0.1))
    handle = hooked.register_step_pre_hook(lambda *a: None)  # would run after the sweep
    assert not fused_update.eligible(hooked, ps)
    handle.remove()
    assert fused_update.eligible(hooked, ps)


def test_tensors_the_sweep_cannot_take_are_left_to_the_step():
    ps = _params()
    ps[0].grad = ps[0].grad.t().contiguous().t()  # not contiguous
    ps[1] = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.float64))
    ps[1].grad = torch.randn(8, 4, dtype=torch.float64)
    assert not fused_update.eligible(_wrapped(torch.optim.SGD(ps, lr=0.1)), ps)
    q = torch.nn.Parameter(torch.randn(8, 4))
    assert not fused_update.eligible(_wrapped(torch.optim.SGD([q], lr=0.1)), [q])  # no grad
