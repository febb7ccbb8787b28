"""One rank of the Horovod-surface checks (run by test_horovod_surface.py under horovodrun).

Each check exercises one behaviour a Horovod script relies on, through
``hipress_like.torch`` only, and prints ``CHECK <name> ok`` or
``CHECK <name> FAIL <why>``; a failing check does not stop the others
(every check is collective, so all ranks run them in the same order).
"""
import itertools
import warnings

import torch
import torch.nn.functional as F
from check_runner import run_checks

import hipress_like.torch as hvd

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def rank_and_size():
    import horovod.torch as real

    assert 0 <= hvd.rank() < hvd.size() == 2, (hvd.rank(), hvd.size())
    assert (real.rank(), real.size()) == (hvd.rank(), hvd.size())


@check
def allreduce_sum_average_and_in_place():
    r, n = hvd.rank(), hvd.size()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1)
    expect = torch.arange(6, dtype=torch.float32).reshape(2, 3) * sum(range(1, n + 1))
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), expect)
    assert torch.allclose(hvd.allreduce(t), expect / n)  # Average is the default
    u = t.clone()
    out = hvd.allreduce_(u, op=hvd.Sum)
    assert out.data_ptr() == u.data_ptr() and torch.equal(u, expect)


@check
def allgather_equal_and_variable_size():
    r, n = hvd.rank(), hvd.size()
    same = hvd.allgather(torch.full((2, 3), float(r)))
    assert torch.equal(same, torch.cat([torch.full((2, 3), float(k)) for k in range(n)]))
    var = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int32))
    assert torch.equal(var, torch.cat([torch.full((k + 1, 2), k, dtype=torch.int32)
                                       for k in range(n)]))


@check
def broadcast_and_in_place():
    r = hvd.rank()
    t = torch.full((4,), float(r))
    assert torch.equal(hvd.broadcast(t, root_rank=1), torch.full((4,), 1.0))
    assert torch.equal(t, torch.full((4,), float(r)))  # the out-of-place form leaves t
    hvd.broadcast_(t, root_rank=1)
    assert torch.equal(t, torch.full((4,), 1.0))


@check
def broadcast_object_from_root():
    obj = {"hello": 123, 0: [1, 2]} if hvd.rank() == 0 else {}
    assert hvd.broadcast_object(obj, root_rank=0) == {"hello": 123, 0: [1, 2]}


@check
def broadcast_state_with_a_frozen_parameter():
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 2)
    model.bias.requires_grad_(False)  # frozen (float: frozen ints are issue 20 part 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    w = hvd.allgather(model.weight.detach().reshape(1, -1))
    assert torch.equal(w[0], w[1]) and model.bias.grad is None
    opt.close()


@check
def compression_fp16_round_trip():
    t = torch.ones(17, dtype=torch.float32)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(c, ctx)
    assert back.dtype == torch.float32 and torch.equal(back, t)


@check
def duplicate_names_are_refused():
    a, b = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD(itertools.chain(a.parameters(), b.parameters()), lr=0.1)
    try:
        hvd.DistributedOptimizer(opt, named_parameters=itertools.chain(
            a.named_parameters(), b.named_parameters()))
    except ValueError:
        return
    raise AssertionError("duplicate parameter names were accepted")


def _linear_step():
    model = torch.nn.Linear(1, 1)
    model.weight = torch.nn.Parameter(torch.zeros(1, 1) + 0.5)
    model.bias = torch.nn.Parameter(torch.zeros(1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    loss = F.mse_loss(model(torch.ones(1, 1) * (hvd.rank() + 1)), torch.ones(1, 1))
    opt.zero_grad()
    loss.backward()
    opt.synchronize()
    return model, opt


@check
def clip_between_synchronize_and_step():
    model, opt = _linear_step()
    before = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert abs(model.weight.grad.item()) < abs(before)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    assert not [w for w in ws if "skip_synchronize" in str(w.message)]
    opt.close()


@check
def step_after_synchronize_warns():
    model, opt = _linear_step()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        opt.step()
    msgs = [str(w.message) for w in ws]
    assert any("optimizer.step() called without optimizer.skip_synchronize()" in m
               for m in msgs), msgs
    opt.close()


@check
def missing_and_absent_named_parameters():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 1), torch.nn.Conv2d(8, 1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        hvd.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[:1])
        raise AssertionError("half the parameters named was accepted")
    except ValueError:
        pass
    opt = hvd.DistributedOptimizer(opt)  # no names at all: generated, identical on all ranks
    loss = model(torch.rand(1, 1, 16, 16)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    g = hvd.allgather(model[0].weight.grad.reshape(1, -1))
    assert torch.equal(g[0], g[1])
    opt.close()


@check
def collectives_ride_horovod():
    # under horovodrun the user-facing collectives go through Horovod itself:
    # Horovod's own handle counter moves when ours run
    import horovod.torch as real

    from hipress_like.adapters.collectives import _Wire

    assert _Wire().hvd is real
    h = real.allreduce_async(torch.zeros(1), name="probe.before")
    real.synchronize(h)
    hvd.allreduce(torch.ones(3))
    hvd.allgather(torch.ones(1, 2) * hvd.rank())
    h2 = real.allreduce_async(torch.zeros(1), name="probe.after")
    real.synchronize(h2)
    assert h2 - h >= 3, (h, h2)  # our three calls took Horovod handles in between


def main():
    run_checks(hvd, CHECKS)


if __name__ == "__main__":
    main()
