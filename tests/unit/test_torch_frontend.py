"""hipress_like.torch in one process (size 1): API shape, ordering errors, edge cases.

With one rank and no compression the average is the gradient itself, so a
wrapped optimizer must reproduce the plain optimizer bitwise; that is the
reference every optimizer is checked against.
"""
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hipress_like as hp
import hipress_like.torch as hpt


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hpt.init()
    yield
    hpt.shutdown()


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _loss(m, seed=1):
    x, y = _batch(seed)
    return F.cross_entropy(m(x), y)


def _wrap(m, opt, **kw):
    return hpt.DistributedOptimizer(opt, named_parameters=m.named_parameters(), **kw)


def test_init_rank_size():
    assert hpt.is_initialized()
    assert (hpt.rank(), hpt.size(), hpt.local_rank(), hpt.local_size()) == (0, 1, 0, 1)


def test_wrapper_is_instance_of_wrapped_class():
    m = _model()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    try:
        assert isinstance(opt, torch.optim.SGD)
        assert type(opt).__name__ == "SGD"
        with pytest.raises(ValueError, match="already"):
            hpt.DistributedOptimizer(opt)
    finally:
        opt.close()


@pytest.mark.parametrize("make", [
    lambda m: [("a", p) for p in m.parameters()],                      # duplicates
    lambda m: list(m.named_parameters())[:2],                            # partial
    lambda m: [p for p in m.parameters()],                               # not tuples
])
def test_named_parameters_validation(make):
    m = _model()
    with pytest.raises(ValueError, match="named_parameters|duplicates|Parameter names"):
        hpt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=make(m))


def test_named_parameters_none_uses_positional_names():
    m = _model()
    opt = hpt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    try:
        assert sorted(opt.engine.layout()) == [f"allreduce.noname.0.{j}" for j in range(4)]
        # Horovod's attribute of the same name and layout (parameter -> name)
        assert opt._parameter_names == {p: f"allreduce.noname.0.{j}"
                                        for j, p in enumerate(m.parameters())}
        _loss(m).backward()
        opt.step()
    finally:
        opt.close()


def test_zero_grad_between_backward_and_step_raises():
    m = _model()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    try:
        _loss(m).backward()
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
        opt.step()
        opt.zero_grad()  # fine after step
    finally:
        opt.close()


def test_second_backward_without_accumulation_raises():
    m = _model()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    try:
        _loss(m).backward()
        with pytest.raises(hpt.OrderingError, match="backward_passes_per_step"):
            _loss(m).backward()
    finally:
        opt.close()


def test_gradient_accumulation_equals_local_sum():
    m, ref = _model(), _model()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), backward_passes_per_step=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        for step in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            for k in range(3):
                _loss(m, seed=10 * step + k).backward()
                _loss(ref, seed=10 * step + k).backward()
            opt.step()
            ref_opt.step()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    finally:
        opt.close()


def test_step_after_synchronize_warns_unless_skipped():
    m = _model()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    try:
        _loss(m).backward()
        opt.synchronize()
        with pytest.warns(UserWarning, match="skip_synchronize"):
            opt.step()
        opt.zero_grad()
        _loss(m).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        clipped = [p.grad.clone() for p in m.parameters()]
        before = [p.detach().clone() for p in m.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with opt.skip_synchronize():
                opt.step()
        for p, b, g in zip(m.parameters(), before, clipped):
            assert torch.allclose(p, b - 0.1 * g)  # the clipped gradient was applied
    finally:
        opt.close()


def _all_optimizers():
    names = ["SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
             "RMSprop", "Rprop", "LBFGS", "Adafactor"]
    return [n for n in names if hasattr(torch.optim, n)]


@pytest.mark.parametrize("name", _all_optimizers())
def test_every_optimizer_matches_plain_one(name):
    cls = getattr(torch.optim, name)
    kw = {"lr": 0.05} if name not in ("LBFGS",) else {"lr": 0.5, "max_iter": 4}
    m, ref = _model(), _model()
    opt = _wrap(m, cls(m.parameters(), **kw))
    ref_opt = cls(ref.parameters(), **kw)
    try:
        for step in range(3):
            if name == "LBFGS":
                def closure(model=m, o=opt, s=step):
                    o.zero_grad()
                    loss = _loss(model, seed=s)
                    loss.backward()
                    return loss

                def ref_closure(model=ref, o=ref_opt, s=step):
                    o.zero_grad()
                    loss = _loss(model, seed=s)
                    loss.backward()
                    return loss
                opt.step(closure)
                ref_opt.step(ref_closure)
            else:
                opt.zero_grad()
                ref_opt.zero_grad()
                _loss(m, seed=step).backward()
                _loss(ref, seed=step).backward()
                opt.step()
                ref_opt.step()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p, q), name
    finally:
        opt.close()


def test_sparse_gradients_sparse_adam():
    torch.manual_seed(0)
    emb, ref = nn.Embedding(10, 4, sparse=True), nn.Embedding(10, 4, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt = _wrap(emb, torch.optim.SparseAdam(emb.parameters(), lr=0.1))
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    try:
        idx = torch.tensor([1, 3, 3, 7])
        for _ in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            emb(idx).sum().backward()
            ref(idx).sum().backward()
            opt.step()
            ref_opt.step()
        assert torch.equal(emb.weight, ref.weight)
    finally:
        opt.close()


def test_requires_grad_toggling_gan_style():
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    disc.weight.requires_grad_(False)  # frozen at construction, switched on later
    disc.bias.requires_grad_(False)
    params = [("g." + n, p) for n, p in gen.named_parameters()] + \
             [("d." + n, p) for n, p in disc.named_parameters()]
    opt = hpt.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                                   named_parameters=params)
    try:
        x = torch.randn(3, 4)
        d_before = disc.weight.detach().clone()
        opt.zero_grad()
        disc(gen(x)).sum().backward()
        opt.step()
        assert torch.equal(disc.weight, d_before)  # frozen: not updated
        for p in disc.parameters():
            p.requires_grad_(True)
        for p in gen.parameters():
            p.requires_grad_(False)
        g_before = gen.weight.detach().clone()
        for _ in range(2):
            opt.zero_grad()
            disc(gen(x)).sum().backward()
            opt.step()
        assert not torch.equal(disc.weight, d_before)  # switched on: updated
        assert torch.equal(gen.weight, g_before)
    finally:
        opt.close()


def test_parameter_without_gradient_gets_zeros():
    m = _model()
    extra = nn.Parameter(torch.ones(3))
    named = list(m.named_parameters()) + [("extra", extra)]
    opt = hpt.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                                   named_parameters=named)
    try:
        _loss(m).backward()
        opt.step()
        assert torch.equal(extra.grad, torch.zeros(3))
        assert torch.equal(extra, torch.ones(3))
    finally:
        opt.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_parameters(dtype):
    m = _model().to(dtype)
    ref = _model().to(dtype)
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        x, y = _batch()
        for model, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            F.cross_entropy(model(x.to(dtype)).float(), y).backward()
            o.step()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert p.dtype == dtype and p.grad.dtype == dtype
            assert torch.equal(p, q)
    finally:
        opt.close()


def test_complex_parameters_refused():
    p = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex"):
        hpt.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("c", p)])


def test_unsupported_options():
    m = _model()
    with pytest.raises(NotImplementedError, match="Adasum"):
        _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), op=hpt.Adasum)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="strategy"):
        _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), strategy="tree")
    with pytest.raises(ValueError, match="unknown compressor"):
        _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), compression="tpok")


def test_state_dict_round_trip_weights_only():
    m = _model()
    opt = _wrap(m, torch.optim.Adam(m.parameters(), lr=0.01), compression="topk")
    try:
        _loss(m).backward()
        opt.step()
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        assert sd["hipress"]["rank"] == 0
        opt.load_state_dict(sd)
        assert opt.engine.step == 1
    finally:
        opt.close()


def test_state_dict_of_another_rank_is_refused():
    """It used to warn that the rank 'starts fresh' while keeping its state: now
    another rank's residuals are an error that says how to save them."""
    m = _model()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    try:
        sd = opt.state_dict()
        sd["hipress"]["rank"] = 3
        with pytest.raises(ValueError, match=r"belongs to rank 3.*all_ranks=True"):
            opt.load_state_dict(sd)
    finally:
        opt.close()


def test_state_dict_of_another_world_size_starts_fresh_for_real():
    m = _model()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), compression="topk")
    try:
        _loss(m).backward()
        opt.step()
        # one process compresses nothing this small: stand in for a residual
        opt.engine._states["w|0|push"] = {"residual": torch.ones(3)}
        sd = opt.state_dict()
        sd["hipress"]["world_size"] = 8
        with pytest.warns(UserWarning, match="starting compressor state fresh"):
            opt.load_state_dict(sd)
        assert not opt.engine.state_dict()["states"]
    finally:
        opt.close()


def test_compression_namespace():
    assert hpt.Compression.none.name == "identity"
    assert hpt.Compression.fp16.name == "fp16"
    spec = hpt.Compression.topk(ratio=0.1)
    assert (spec.name, spec.params) == ("topk", {"ratio": 0.1})
    assert hpt.Compression.get("dgc").name == "dgc"
    with pytest.raises(AttributeError, match="available"):
        hpt.Compression.tpok  # noqa: B018
    t = torch.randn(10)
    wire, ctx = hpt.Compression.fp16.compress(t)
    assert wire.dtype == torch.float16
    assert hpt.Compression.fp16.decompress(wire, ctx).dtype == torch.float32

    class Custom:  # Horovod-style user compressor: refused with a way out
        @staticmethod
        def compress(t):
            return t, None

    m = _model()
    with pytest.raises(TypeError, match="register"):
        _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), compression=Custom)


def test_functional_collectives_single_rank():
    t = torch.arange(4.0)
    assert torch.equal(hpt.allreduce(t), t)
    assert torch.equal(hpt.allreduce(t, op=hpt.Sum, compression=hpt.Compression.fp16), t)
    assert torch.equal(hpt.allgather(t.reshape(2, 2)), t.reshape(2, 2))
    assert torch.equal(hpt.broadcast(t, 0), t)
    h = hpt.allreduce_async(t)
    assert torch.equal(hpt.synchronize(h), t)
    assert hpt.broadcast_object({"a": [1, (2, "x")], "t": t})["a"] == [1, (2, "x")]
    with pytest.raises(TypeError, match="weights_only"):
        hpt.broadcast_object(object())
    with pytest.raises(NotImplementedError):
        hpt.allreduce(t, op=hpt.Adasum)


def test_lr_scheduler_created_before_and_after_wrapping():
    m = _model()
    base = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = _wrap(m, base)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    try:
        _loss(m).backward()
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
        assert base.param_groups[0]["lr"] == pytest.approx(0.05)  # shared groups
    finally:
        opt.close()


def test_gradients_are_registered_in_model_order_for_the_lane():
    # The lane's buckets follow reverse registration order, as DDP's do, since
    # backward produces gradients roughly in reverse model order. Registered
    # by name, "stem" sorted after "layers", so the first bucket waited for the
    # stem's gradient, the last one backward produces.
    m = nn.Sequential()
    m.add_module("stem", nn.Linear(6, 8))
    m.add_module("layers", nn.Linear(8, 3))
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), compression=hpt.Compression.none,
                plan=None)
    try:
        assert list(opt._hp_engine.layout()) == [n for n, _ in m.named_parameters()]
    finally:
        opt.close()


def test_hipress_replay_environment_variable(monkeypatch):
    m = _model()
    monkeypatch.setenv("HIPRESS_REPLAY", "0")
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), plan=None)
    try:
        assert opt._hp_engine.config.replay is False
    finally:
        opt.close()
    monkeypatch.setenv("HIPRESS_REPLAY", "off")
    with pytest.raises(ValueError, match="HIPRESS_REPLAY must be 0 or 1"):
        _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), plan=None)
    monkeypatch.delenv("HIPRESS_REPLAY")
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), plan=None)
    try:
        assert opt._hp_engine.config.replay is True
    finally:
        opt.close()


def test_a_wrapped_compressor_instance_is_taken_as_it_is():
    """DistributedOptimizer(compression=<an ErrorFeedback instance>) used to fail
    inside the engine; the instance is used as given, never wrapped twice."""
    from hipress_like.compressors.wrappers.error_feedback import ErrorFeedback

    m = _model()
    inst = ErrorFeedback(hp.compressors.get("topk", ratio=0.1))
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), compression=inst)
    try:
        _loss(m).backward()
        opt.step()
        assert opt.engine.compressor is inst
    finally:
        opt.close()
