"""What a black-box fault probe found (issue 19), pinned over real gloo processes.

- identical runs give identical bits for every compressor at 2, 3 and 4 ranks
  (PowerSGD's fused P and Q used to depend on timing at 3+ ranks);
- an exception on one rank reaches every rank within 2 s, and the survivors
  of a killed rank close their engines within 3 s of noticing it (they used
  to wait 10 s for peers that would never close);
- the rank blamed for a death is the dead one (a survivor that failed and
  left first used to be blamed);
- settings that differ between ranks are an error at register that names
  the setting and the ranks, before any data moves.

The time bounds are the issue's liveness contract (a failure must not hang or
linger), measured inside the workers from the moment of failure; they are far
below the timeouts a slow host would need to approach.
"""
import functools
import hashlib
import json
import os
import re
import tempfile
import time

import pytest
import torch

import hipress_like as hp
from hipress_like.casync.engine import Engine, EngineConfig
from hipress_like.cost_model.plan import GradientPlan, Plan, SizeRule
from hipress_like.launch.launch import WorkerError, run_workers

SHAPES = [(3,), (64, 33), (40, 40), (128, 20), (257,), (96, 64)]


def _plan(comp):
    rule = SizeRule(min_compress_bytes=0, bytes_per_partition=4096, max_partitions=3)
    if comp == "mixed":  # plan format 2: a compressor per gradient
        return Plan(compressor="onebit", rule=rule, gradients={
            "g1": GradientPlan(True, 1, "powersgd", {"rank": 2}),
            "g2": GradientPlan(True, 2, "terngrad", {"bitwidth": 2}),
            "g3": GradientPlan(True, 3, "topk", {"ratio": 0.05}),
            "g4": GradientPlan(False)})
    return Plan(compressor=comp, rule=rule)


def _digest(ts):
    h = hashlib.sha256()
    for t in ts:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _run_once(ctx, name, strategy, jitter_seed):
    """Three steps of ``name``; gradients submitted with random pauses, so the
    order in which payloads become ready differs between runs."""
    eng = Engine(ctx.transport, EngineConfig(compressor=None, plan=_plan(name),
                                             strategy=strategy, timeout=60))
    pause = torch.Generator().manual_seed(jitter_seed * 31 + ctx.rank)
    try:
        eng.register([(f"g{i}", s, torch.float32) for i, s in enumerate(SHAPES)])
        out = []
        for step in range(3):
            g = torch.Generator().manual_seed(1000 * step + ctx.rank)
            grads = [torch.randn(s, generator=g) for s in SHAPES]
            for i, t in enumerate(grads):
                time.sleep(float(torch.rand((), generator=pause)) * 0.004)
                eng.submit(f"g{i}", t)
            eng.synchronize()
            out.extend(grads)
        return _digest(out)
    finally:
        eng.close()


def _twice_every_compressor(ctx, names, strategies):
    """Each compressor and strategy twice (different pauses) in one launch."""
    return {f"{n}/{s}": (_run_once(ctx, n, s, 1), _run_once(ctx, n, s, 2))
            for n in names for s in strategies}


def _names():
    return [c for c in hp.compressors.available()
            if c not in ("none", "ef", "error_feedback")] + ["mixed"]


@functools.lru_cache(maxsize=None)
def _every_compressor_twice(n):
    """One launch of ``n`` ranks: {"name/strategy": (first run, second run)} per rank."""
    return run_workers(_twice_every_compressor, n, args=(_names(), ("ps", "ring")),
                       timeout=600)


# 2 and 3 ranks are slow-tier: the 4-rank case checks the same property of the same
# engine for every compressor in the default suite (the timing bug needed 3+ ranks;
# 4 ranks have 3+ peers, and an odd count is in the slow tier)
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow),
                               pytest.param(3, marks=pytest.mark.slow), 4])
def test_identical_runs_give_identical_bits_for_every_compressor(n):
    res = _every_compressor_twice(n)
    for key in res[0]:
        first, second = res[0][key]
        assert first == second, f"{key} at {n} ranks: two identical runs differ"
        assert all(r[key] == (first, second) for r in res), f"{key}: ranks differ"


@pytest.mark.parametrize("n", [pytest.param(3, marks=pytest.mark.slow), 4])
def test_powersgd_identical_across_launches(n):
    """Separate launches (other processes) of the same PowerSGD job agree bit for bit: the
    first is the every-compressor launch above (its first PowerSGD run, after the
    compressors before it), the second a fresh launch with other pauses."""
    a = [r["powersgd/ps"][0] for r in _every_compressor_twice(n)]
    b = run_workers(_run_once, n, args=("powersgd", "ps", 2), timeout=300)
    assert len(set(a)) == 1 and a == b


# -- failures --------------------------------------------------------------------

def _raises_on_rank1(ctx, workdir):
    eng = Engine(ctx.transport, EngineConfig(compressor="identity", timeout=60))
    try:
        eng.register([("w", (1000,), torch.float32)])
        eng.submit("w", torch.ones(1000))
        eng.synchronize()
        if ctx.rank == 1:
            with open(os.path.join(workdir, "raised"), "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError("the user's code failed on rank 1")
        try:
            eng.submit("w", torch.ones(1000))
            eng.synchronize()
        except Exception as e:  # the expected outcome: rank 1 is named
            t = time.time()
            with open(os.path.join(workdir, f"caught{ctx.rank}"), "w") as f:
                json.dump({"t": t, "msg": str(e)}, f)
            return None
        raise AssertionError("step 1 completed without rank 1")
    finally:
        eng.close()


def test_an_exception_on_one_rank_reaches_every_rank_within_2s():
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(WorkerError) as e:
            run_workers(_raises_on_rank1, 3, args=(d,), timeout=120, grace=30)
        assert set(e.value.failures) == {1}, e.value.failures
        raised = float(open(os.path.join(d, "raised")).read())
        for r in (0, 2):
            got = json.load(open(os.path.join(d, f"caught{r}")))
            assert re.search(r"rank(\(s\))? \[?1\b", got["msg"]), got["msg"]
            assert got["t"] - raised < 2.0, (r, got["t"] - raised, got["msg"])


def _killed_rank3(ctx, workdir):
    eng = Engine(ctx.transport, EngineConfig(compressor="onebit", plan=_plan("onebit"),
                                             timeout=60))
    eng.register([("w", (4096,), torch.float32), ("v", (64, 64), torch.float32)])
    for _ in range(2):
        eng.submit("w", torch.ones(4096))
        eng.submit("v", torch.ones(64, 64))
        eng.synchronize()
    if ctx.rank == 3:
        os._exit(3)  # killed between steps: no teardown, no goodbye
    try:
        eng.submit("w", torch.ones(4096))
        eng.submit("v", torch.ones(64, 64))
        eng.synchronize()
    except Exception as e:
        noticed = time.monotonic()
        eng.close()
        closed = time.monotonic()
        ranks = list(getattr(e, "ranks", ()))
        with open(os.path.join(workdir, f"survivor{ctx.rank}"), "w") as f:
            json.dump({"close_s": closed - noticed, "msg": str(e), "ranks": ranks}, f)
        return None
    raise AssertionError("step 2 completed without rank 3")


def test_survivors_of_a_killed_rank_blame_it_and_close_within_3s():
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(WorkerError) as e:
            run_workers(_killed_rank3, 4, args=(d,), timeout=120, grace=30)
        assert 3 in e.value.failures
        for r in (0, 1, 2):
            got = json.load(open(os.path.join(d, f"survivor{r}")))
            assert got["close_s"] < 3.0, (r, got)
            assert got["ranks"] == [3], (r, got)
            assert re.search(r"rank\(s\) \[3\] stopped heartbeating", got["msg"]), got["msg"]


# -- settings that differ between ranks ---------------------------------------------
# One 2-rank launch tries every case in turn: each engine's register raises on both
# ranks, and the worker keeps each case's traceback (what a failing launch would report).

def _differs(ctx, field):
    cfg = {"compressor": "onebit", "params": {}, "strategy": "ps", "timeout": 30}
    if ctx.rank == 1:
        cfg[field[0]] = field[1]
        if field[0] == "plan":  # a Plan cannot travel in the launch spec
            cfg["plan"] = Plan(compressor="onebit", rule=SizeRule(min_compress_bytes=1))
    return EngineConfig(**cfg)


def _powersgd_rank_differs(ctx, field):
    params = {"rank": 1 if ctx.rank == 0 else 2}
    return EngineConfig(compressor="powersgd", params=params, timeout=30)


def _every_mismatch(ctx, cases):
    """{case: this rank's traceback, or None when register did not raise}."""
    import traceback

    out = {}
    for key, maker, field in cases:
        eng = Engine(ctx.transport, globals()[maker](ctx, field))
        try:
            eng.register([("w", (100, 10), torch.float32)])
            out[key] = None
        except Exception:
            out[key] = traceback.format_exc()
        finally:
            eng.close()
    return out


DIFFERS = [
    (("compressor", "terngrad"), "compressor"),
    (("strategy", "ring"), "strategy"),
    (("compressor", "powersgd"), "compressor"),
    (("plan", None), "plan"),
    (("fusion_bytes", 1 << 20), "fusion_bytes"),
]


@functools.lru_cache(maxsize=None)
def _mismatches():
    """Each rank's tracebacks for every case below, from one launch."""
    cases = [(f"{f[0]}={f[1]}", "_differs", f) for f, _ in DIFFERS]
    cases.append(("powersgd rank", "_powersgd_rank_differs", None))
    return run_workers(_every_mismatch, 2, args=(cases,), timeout=180)


@pytest.mark.parametrize("field,name", DIFFERS)
def test_settings_that_differ_between_ranks_are_named_at_register(field, name):
    tbs = [r[f"{field[0]}={field[1]}"] for r in _mismatches()]
    assert all(tb is not None for tb in tbs), f"register did not raise on every rank: {tbs}"
    for tb in tbs:
        assert "ConfigMismatchError" in tb and f"{name}:" in tb and "rank(s) [1]" in tb, tb


def test_powersgd_rank_that_differs_is_named():
    tbs = [r["powersgd rank"] for r in _mismatches()]
    assert all(tb is not None for tb in tbs), f"register did not raise on every rank: {tbs}"
    for tb in tbs:
        assert "ConfigMismatchError" in tb and "rank=1" in tb and "rank=2" in tb, tb
