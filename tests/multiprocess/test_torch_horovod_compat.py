"""Horovod compatibility of hipress_like.torch on real ranks (issue 20, Build 0).

- every dtype Horovod's collectives take works in allgather, broadcast and
  allreduce, including int16/uint16, which gloo refuses;
- a frozen integer parameter does not stop ``DistributedOptimizer``;
- a loss-scale overflow under ``torch.amp.GradScaler`` reaches every rank as
  non-finite gradients (the scale drops, the step is skipped on every rank)
  while the compressor state (onebit's error feedback over PS, PowerSGD over
  Ring) keeps its values, and the ranks stay bitwise identical afterwards.
"""
import pytest
import torch
from torch import nn

import hipress_like.torch as hpt
from hipress_like.cost_model import Plan, SizeRule
from hipress_like.launch.launch import run_workers

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool]


def _values(dtype, r, rows):
    base = torch.arange(rows * 3).reshape(rows, 3) + 100 * r
    if dtype is torch.bool:
        return base % 2 == 0
    if dtype in (torch.int16, torch.uint16):
        base = base + 30000  # sums wrap around in the narrow type
    return base.to(dtype)


def dtypes_worker(ctx):
    hpt.init()
    r, n = hpt.rank(), hpt.size()
    out = {}
    for dt in DTYPES:
        name = str(dt)
        gathered = hpt.allgather(_values(dt, r, r + 1))
        want = torch.cat([_values(dt, q, q + 1) for q in range(n)])
        assert gathered.dtype == dt and torch.equal(gathered, want), name
        b = hpt.broadcast(_values(dt, r, 2), root_rank=1)
        assert b.dtype == dt and torch.equal(b, _values(dt, 1, 2)), name
        inplace = _values(dt, r, 2)
        hpt.broadcast_(inplace, root_rank=0)
        assert torch.equal(inplace, _values(dt, 0, 2)), name
        if dt is not torch.bool:
            s = hpt.allreduce(_values(dt, r, 2), op=hpt.Sum)
            # the narrow type's own sum, wrapping around (torch has no uint16 add)
            ref = sum(_values(dt, q, 2).to(torch.int64) for q in range(n)).to(dt)
            assert s.dtype == dt and torch.equal(s, ref), (name, s, ref)
            mx = hpt.allreduce(_values(dt, r, 2), op=hpt.Max)
            assert torch.equal(mx, _values(dt, n - 1, 2)), name
        out[name] = True
    # a frozen integer parameter next to trainable ones (Horovod's
    # test_broadcast_state_no_grad / dynamic requires_grad models hold such)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model.register_parameter("counts", nn.Parameter(torch.zeros(3, dtype=torch.int16),
                                                    requires_grad=False))
    opt = hpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    model(torch.full((2, 4), float(r))).sum().backward()
    opt.step()
    out["weight"] = model.weight.detach().clone()
    opt.close()
    return out


def test_every_horovod_dtype_and_a_frozen_integer_parameter():
    res = run_workers(dtypes_worker, 2, timeout=120)
    for out in res:
        assert all(out[str(dt)] for dt in DTYPES)
    assert torch.equal(res[0]["weight"], res[1]["weight"])


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(d.target)


def _state_tensors(engine):
    """Every tensor of the engine's compressor state, flattened, by key."""
    out = {}

    def walk(prefix, v):
        if isinstance(v, torch.Tensor):
            out[prefix] = v.detach().clone()
        elif isinstance(v, dict):
            for k, w in v.items():
                walk(f"{prefix}/{k}", w)
        elif isinstance(v, (list, tuple)):
            for i, w in enumerate(v):
                walk(f"{prefix}/{i}", w)
    walk("", engine.state_dict()["states"])
    return out


def scaler_worker(ctx, comp, strategy, overflow_step, steps):
    hpt.init()
    r = hpt.rank()
    x, y = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    plan = Plan(compressor=comp, strategy=strategy,
                rule=SizeRule(min_compress_bytes=0, bytes_per_partition=1024))
    opt = hpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, strategy=strategy, plan=plan)
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    log = []
    for step in range(steps):
        idx = torch.arange(step * 64 + r * 32, step * 64 + r * 32 + 32) % len(x)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        if step == overflow_step and r == 1:  # one rank's scaled loss overflows
            loss = loss * float("inf")
        before = _state_tensors(opt.engine)
        params_before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(loss).backward()
        opt.synchronize()  # Horovod's AMP recipe: average, then unscale and step
        scaler.unscale_(opt)
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        scale = scaler.get_scale()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        after = _state_tensors(opt.engine)
        unchanged = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before)
        moved = any(not torch.equal(a, p) for a, p in zip(params_before, model.parameters()))
        log.append({"finite": finite, "scale": scale, "next_scale": scaler.get_scale(),
                    "state_unchanged": unchanged, "params_moved": moved,
                    "state_keys": len(after)})
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt.close()
    return log, params


@pytest.mark.parametrize("comp,strategy", [
    ("onebit", "ps"), pytest.param("powersgd", "ring", marks=pytest.mark.slow)])
def test_gradscaler_overflow_skips_the_step_and_keeps_compressor_state(comp, strategy):
    overflow = 2
    res = run_workers(scaler_worker, 2, args=(comp, strategy, overflow, 5), timeout=180)
    for log, _ in res:
        for step, s in enumerate(log):
            if step == overflow:
                assert not s["finite"]  # GradScaler saw the overflow on every rank ...
                assert s["next_scale"] == s["scale"] / 2  # ... lowered its scale ...
                assert not s["params_moved"]  # ... and skipped the step
                assert s["state_unchanged"] and s["state_keys"] > 0  # compressor untouched
            else:
                assert s["finite"] and s["params_moved"]
                if step > 0:
                    assert not s["state_unchanged"]  # a normal step does move the state
    assert [s["scale"] for s in res[0][0]] == [s["scale"] for s in res[1][0]]
    assert torch.equal(res[0][1], res[1][1])  # ranks bitwise identical after
