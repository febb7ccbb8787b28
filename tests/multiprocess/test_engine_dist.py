"""The CaSync engine across real processes: gloo over loopback, and MPI.

Each test runs real ranks; the workers below are module-level so the launcher
can import them in the child processes. The tests that expect every rank to
return share one launch per world size (``shared_launch``: ``_shared(n)`` runs
each of ``GROUPS[n]``'s workers in turn, fresh engines each); those that make a
rank fail launch their own.
"""
import functools
import os
import re
import shutil

import pytest
import torch
from shared_launch import ranks, run_shared  # tests/multiprocess is on sys.path (rootdir)

import hipress_like as hp
from hipress_like.casync.engine import Engine, EngineConfig
from hipress_like.casync.workflows import chunk_bounds
from hipress_like.cost_model.plan import Plan, SizeRule
from hipress_like.launch.launch import WorkerError, run_workers

# the first test of a world size runs every worker of GROUPS[n] in its launch
pytestmark = pytest.mark.timeout(1200)
SIZES = [1, 7, 8, 1001, 65537, 250_003]


def _grads(rank, sizes):
    g = torch.Generator().manual_seed(99 + rank)
    return {f"g{i}": torch.randn(s, generator=g) for i, s in enumerate(sizes)}


def _plan(comp, k, min_bytes=0):
    return Plan(compressor=comp, rule=SizeRule(min_compress_bytes=min_bytes,
                                               bytes_per_partition=1, max_partitions=k))


def _sync(ctx, comp, strategy, sizes, k, steps=1, min_bytes=0, coordinator=True):
    eng = Engine(ctx.transport, EngineConfig(compressor=None, plan=_plan(comp, k, min_bytes),
                                             strategy=strategy, timeout=60,
                                             coordinator=coordinator))
    try:
        gs = _grads(ctx.rank, sizes)
        eng.register([(n, tuple(v.shape), v.dtype) for n, v in gs.items()])
        out = []
        for _ in range(steps):
            work = {n: v.clone() for n, v in gs.items()}
            for n, v in work.items():
                eng.submit(n, v)
            eng.synchronize()
            out.append(work)
        return out[-1], eng.layout()
    finally:
        eng.close()


def _expected(all_g, name, info, n):
    if info["workflow"] != "ring":
        return sum(all_g[r][name] for r in range(n)) / n
    out = torch.empty_like(all_g[0][name])
    for s, e, _ in info["partitions"]:
        for c, (cs, ce) in enumerate(chunk_bounds(e - s, n)):
            acc = all_g[c][name][s + cs: s + ce].clone()
            for i in range(1, n):
                acc += all_g[(c + i) % n][name][s + cs: s + ce]
            out[s + cs: s + ce] = acc / n
    return out


IDENTITY = [(2, "ps", 1), (3, "ring", 2), (4, "ps", 8), (4, "ring", 3)]


@pytest.mark.parametrize("n,strategy,k", IDENTITY)
def test_identity_exact_average_gloo(n, strategy, k):
    res = ranks(_shared(n)[("identity", strategy, k)])
    all_g = [_grads(r, SIZES) for r in range(n)]
    for name in all_g[0]:
        exp = _expected(all_g, name, res[0][1][name], n)
        for r in range(n):
            assert torch.equal(res[r][0][name], exp), (name, r)


def _all_compressors(ctx, names, strategy):
    """Every compressor, two steps each, in one launch (process start-up is costly)."""
    sizes = [1, 100, 4099, 70_000]
    return {name: _two_steps(ctx, _plan(name, 3), strategy, sizes) for name in names}


def _two_steps(ctx, plan, strategy, sizes):
    """This rank's gradients of ``sizes`` after two synchronised steps under ``plan``."""
    eng = Engine(ctx.transport, EngineConfig(compressor=None, plan=plan, strategy=strategy,
                                             timeout=60))
    try:
        gs = _grads(ctx.rank, sizes)
        eng.register([(n, tuple(v.shape), v.dtype) for n, v in gs.items()])
        for _ in range(2):
            for n, v in gs.items():
                eng.submit(n, v)
            eng.synchronize()
        return gs
    finally:
        eng.close()


def _compressor_names():
    return [c for c in hp.compressors.available() if c not in ("none", "ef", "error_feedback")]


@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_every_compressor_bitwise_identical_gloo(strategy):
    names = _compressor_names()
    res = ranks(_shared(4)[("every", strategy)])
    for name in names:
        for g in res[0][name]:
            assert torch.isfinite(res[0][name][g]).all()
            for r in range(1, 4):
                assert torch.equal(res[r][name][g], res[0][name][g]), (name, g, r)


def _big(ctx, strategy):
    n = 16 << 20  # 64 MB of float32
    g = torch.full((n,), float(ctx.rank + 1))
    g[::1000] = -1.0
    eng = Engine(ctx.transport, EngineConfig(compressor=None, plan=_plan("identity", 4, 1 << 40),
                                             strategy=strategy, timeout=120))
    try:
        eng.register([("big", (n,), torch.float32)])
        eng.submit("big", g)
        eng.synchronize()
        mean = sum(range(1, ctx.size + 1)) / ctx.size
        return bool(torch.all(g[1:1000] == mean)) and bool(torch.all(g[::1000] == -1.0))
    finally:
        eng.close()


@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_64mb_gradient(strategy):
    assert ranks(_shared(3)[("64mb", strategy)]) == [True] * 3


def _dies(ctx):
    eng = Engine(ctx.transport, compressor="identity", timeout=8)
    eng.register([("w", (1000,), torch.float32)])
    eng.submit("w", torch.ones(1000))
    eng.synchronize()
    if ctx.rank == 1:
        os._exit(3)  # a crash between steps: no teardown, no goodbye
    eng.submit("w", torch.ones(1000))
    eng.synchronize()


def test_dead_rank_fails_everyone_with_its_name():
    with pytest.raises(WorkerError) as e:
        run_workers(_dies, 3, timeout=120, grace=30)
    failures = e.value.failures
    for r in (0, 2):
        assert r in failures, failures
        assert re.search(r"rank(\(s\))? \[?1\b", failures[r]), failures[r]


def _mismatch(ctx):
    eng = Engine(ctx.transport, compressor="identity", timeout=20)
    shape = (10,) if ctx.rank == 0 else (11,)
    eng.register([("w", shape, torch.float32)])


def test_gradient_mismatch_reported_on_every_rank():
    with pytest.raises(WorkerError) as e:
        run_workers(_mismatch, 2, timeout=120)
    assert set(e.value.failures) == {0, 1}
    for tb in e.value.failures.values():
        assert "GradientMismatchError" in tb and "shape (11,)" in tb


def _have_mpi():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mpirun") is not None


@pytest.mark.mpi
@pytest.mark.skipif(not _have_mpi(), reason="needs mpi4py and mpirun (./test.sh installs them)")
def test_identity_exact_and_onebit_identical_over_mpi():
    res = run_workers(_sync, 3, backend="mpi", args=("identity", "ring", SIZES, 2),
                      timeout=300)
    all_g = [_grads(r, SIZES) for r in range(3)]
    for name in all_g[0]:
        exp = _expected(all_g, name, res[0][1][name], 3)
        for r in range(3):
            assert torch.equal(res[r][0][name], exp)
    res = run_workers(_all_compressors, 3, backend="mpi", args=(["onebit"], "ps"), timeout=300)
    for g in res[0]["onebit"]:
        for r in range(1, 3):
            assert torch.equal(res[r]["onebit"][g], res[0]["onebit"][g])


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(not _have_mpi(), reason="needs mpi4py and mpirun (./test.sh installs them)")
@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_every_compressor_over_mpi(strategy):
    res = run_workers(_sync, 3, backend="mpi", args=("identity", strategy, SIZES, 2),
                      timeout=600)
    all_g = [_grads(r, SIZES) for r in range(3)]
    for name in all_g[0]:
        exp = _expected(all_g, name, res[0][1][name], 3)
        for r in range(3):
            assert torch.equal(res[r][0][name], exp)
    names = _compressor_names()
    res = run_workers(_all_compressors, 3, backend="mpi", args=(names, strategy), timeout=900)
    for name in names:
        for g in res[0][name]:
            for r in range(1, 3):
                assert torch.equal(res[r][name][g], res[0][name][g]), (name, g, r)


def _many_small(ctx, coordinator, raw_collective=False):
    sizes = [64] * 200 + [10_000] * 5
    eng = Engine(ctx.transport, EngineConfig(compressor=None,
                                             plan=_plan("identity", 1, 1 << 40),
                                             timeout=60, coordinator=coordinator,
                                             raw_collective=raw_collective))
    try:
        gs = _grads(ctx.rank, sizes)
        eng.register([(n, tuple(v.shape), v.dtype) for n, v in gs.items()])
        for n, v in gs.items():
            eng.submit(n, v)
        eng.synchronize()
        kind = "bucket" if raw_collective else "round"
        rounds = sum(1 for e in eng.timeline.events if e.kind == kind)
        return gs, rounds
    finally:
        eng.close()


def test_coordinator_batches_hundreds_of_small_gradients():
    """Raw bytes through PS links (raw_collective=False): batching cuts the rounds."""
    on = ranks(_shared(4)[("many_small", True, False)])
    off = ranks(_shared(4)[("many_small", False, False)])
    sizes = [64] * 200 + [10_000] * 5
    all_g = [_grads(r, sizes) for r in range(4)]
    for name in all_g[0]:
        exp = sum(all_g[r][name] for r in range(4)) / 4
        for r in range(4):
            assert torch.equal(on[r][0][name], exp) and torch.equal(off[r][0][name], exp)
    assert on[0][1] < off[0][1] / 5  # batching: far fewer rounds for the same messages


def test_collective_lane_fuses_hundreds_of_small_gradients_over_gloo():
    """The default lane for uncompressed gradients: gloo allreduce of fused buckets.
    Gloo's ring sums in its own order, so the average is exact up to rounding and
    bitwise identical on every rank."""
    res = ranks(_shared(4)[("many_small", True, True)])
    sizes = [64] * 200 + [10_000] * 5
    all_g = [_grads(r, sizes) for r in range(4)]
    for name in all_g[0]:
        exp = sum(all_g[r][name] for r in range(4)) / 4
        torch.testing.assert_close(res[0][0][name], exp, rtol=1e-6, atol=1e-6)
        for r in range(1, 4):
            assert torch.equal(res[r][0][name], res[0][0][name])
    assert 1 <= res[0][1] < 205 / 10  # a handful of fused allreduces for 205 gradients


def _replay_vs_coordinated(ctx, strategy):
    """PowerSGD matrices plus lane buckets, 3 steps with replay and 3 without."""
    shapes = {"w0": (300, 200), "w1": (64, 500), "b0": (200,), "b1": (7,)}
    plan = Plan(compressor="powersgd", params={"rank": 2},
                rule=SizeRule(min_compress_bytes=4096, bytes_per_partition=1 << 30))
    out = {}
    for replay in (True, False):
        eng = Engine(ctx.transport, EngineConfig(plan=plan, strategy=strategy, timeout=60,
                                                 replay=replay))
        try:
            out[replay] = (_three_steps(ctx, eng, shapes), eng.replayed_steps)
        finally:
            eng.close()
    return out


def _three_steps(ctx, eng, shapes):
    """Register ``shapes`` with ``eng`` and synchronise 3 steps of seeded gradients;
    each step's averaged gradients."""
    eng.register([(n, s, torch.float32) for n, s in shapes.items()])
    steps = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + ctx.rank)
        work = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        for n, v in work.items():
            eng.submit(n, v)
        eng.synchronize()
        steps.append(work)
    return steps


def _powersgd_error_dtypes(ctx, strategy):
    """PowerSGD rank 2 with its error memory in float32 and in bfloat16: 3 steps each."""
    shapes = {"w0": (300, 200), "w1": (64, 500), "w2": (4099,)}  # w2: the padded path
    out = {}
    for extra in ({}, {"error_dtype": "bfloat16"}):
        plan = Plan(compressor="powersgd", params={"rank": 2, **extra},
                    rule=SizeRule(min_compress_bytes=4096, bytes_per_partition=1 << 30))
        eng = Engine(ctx.transport, EngineConfig(plan=plan, strategy=strategy, timeout=60))
        try:
            steps = _three_steps(ctx, eng, shapes)
            dtypes = {k: str(st["error"].dtype) for k, st in eng.state_dict()["states"].items()
                      if isinstance(st.get("error"), torch.Tensor)}
            out[extra.get("error_dtype", "float32")] = (steps, dtypes)
        finally:
            eng.close()
    return out


@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_powersgd_bfloat16_error_memory_over_gloo(strategy):
    """Every rank gets the same bits with the error memory in bfloat16; the first
    step (no error yet) differs from float32's by M's rounding alone."""
    res = ranks(_shared(3)[("psgd_bf16", strategy)])
    for r in range(3):
        steps, dtypes = res[r]["bfloat16"]
        assert dtypes and set(dtypes.values()) == {"torch.bfloat16"}
        assert set(res[r]["float32"][1].values()) == {"torch.float32"}
        for s, work in enumerate(steps):
            for n, v in work.items():
                assert torch.isfinite(v).all()
                assert torch.equal(v, res[0]["bfloat16"][0][s][n]), (strategy, r, s, n)
    for n, v in res[0]["bfloat16"][0][0].items():
        ref = res[0]["float32"][0][0][n]
        assert (v - ref).norm() <= 2e-2 * ref.norm(), n


@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_replayed_steps_match_coordinated_ones_over_gloo(strategy):
    """Every rank gets the same bits either way. Between the two runs only the last
    bits may differ: the coordinator fuses P's and Q's that are ready in the same
    round, so their offsets in a fused allreduce, and with them gloo's summation
    order, depend on timing (in both runs; the in-process tests pin exact bits)."""
    res = ranks(_shared(3)[("replay", strategy)])
    for r in range(3):
        assert res[r][True][1] == 2 and res[r][False][1] == 0
        for step in range(3):
            for n, v in res[r][True][0][step].items():
                for replay in (True, False):
                    assert torch.equal(res[r][replay][0][step][n], res[0][replay][0][step][n])
                torch.testing.assert_close(v, res[r][False][0][step][n], rtol=1e-4, atol=1e-5)


def _coded_topk(ctx, params):
    """Two steps of top-k with the given codecs, PS then Ring, over gloo."""
    out = {}
    for strategy in ("ps", "ring"):
        plan = Plan(compressor="topk", params=params,
                    rule=SizeRule(min_compress_bytes=0, bytes_per_partition=1, max_partitions=2))
        out[strategy] = _two_steps(ctx, plan, strategy, [4099, 70_000])
    return out


CODECS = {"bloom-fpaware": {"ratio": 0.01, "index_codec": "bloom", "eps": 0.01},
          "rle-curvefit": {"ratio": 0.01, "index_codec": "rle", "value_codec": "curvefit"}}


@pytest.mark.parametrize("codecs", CODECS)
def test_sparse_codecs_cross_ranks_bitwise_identical(codecs):
    """Issue 25: Bloom-, RLE- and curve-fit-coded top-k through the engine on 3 real
    ranks (PS, and Ring with its re-selection through the codecs): every rank ends
    with the same finite tensors."""
    res = ranks(_shared(3)[("codecs", codecs)])
    for strategy in ("ps", "ring"):
        for g, v in res[0][strategy].items():
            assert torch.isfinite(v).all() and v.abs().sum() > 0, (strategy, g)
            for r in (1, 2):
                assert torch.equal(res[r][strategy][g], v), (strategy, g, r)


# -- the shared launches: every returning worker above, per world size ------------------

GROUPS = {n: {} for n in (2, 3, 4)}
for _n, _strategy, _k in IDENTITY:
    GROUPS[_n][("identity", _strategy, _k)] = (_sync, ("identity", _strategy, SIZES, _k))
for _strategy in ("ps", "ring"):
    GROUPS[4][("every", _strategy)] = (_all_compressors, (_compressor_names(), _strategy))
    GROUPS[3][("64mb", _strategy)] = (_big, (_strategy,))
    GROUPS[3][("replay", _strategy)] = (_replay_vs_coordinated, (_strategy,))
    GROUPS[3][("psgd_bf16", _strategy)] = (_powersgd_error_dtypes, (_strategy,))
for _coordinator, _raw in ((True, False), (False, False), (True, True)):
    GROUPS[4][("many_small", _coordinator, _raw)] = (_many_small, (_coordinator, _raw))
for _id, _params in CODECS.items():
    GROUPS[3][("codecs", _id)] = (_coded_topk, (_params,))


@functools.lru_cache(maxsize=None)
def _shared(n):
    """{key of GROUPS[n]: each rank's ("returned"|"raised", ...)}: one launch of n ranks."""
    return dict(zip(GROUPS[n], run_shared(n, list(GROUPS[n].values()), timeout=900)))
