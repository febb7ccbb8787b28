"""Cost-model formulas pinned against hand-computed numbers.

Every expected value below is worked out by hand in the comment next to it
(HiPress Eq. 1/2, Table 3, Sec. 6.1; flexible-communication Table I, Eq. 4),
so a formula cannot pass by agreeing with itself.
"""
import dataclasses
import json

import pytest
import torch

from hipress_like.cost_model import collectives as col
from hipress_like.cost_model.model import (
    Count,
    Curve,
    Link,
    concurrent_link,
    fit_link,
    n_batches,
    sync_params,
    t_sync_cpr,
    t_sync_orig,
)
from hipress_like.cost_model.presets import available, from_json, preset
from hipress_like.cost_model.profile import CompressorProfile, Profile, ProfileError, log_sizes
from hipress_like.tuning.profiler import measure_link, profile_compressor

MS = 1e-3
LINK = Link(latency=1e-3, bandwidth=1e9)  # T_send(b) = 1 ms + b ns


def lin(fixed, per_byte):
    return lambda b: fixed + per_byte * b


# -- Table 3 / Sec. 6.1 ---------------------------------------------------------
@pytest.mark.parametrize("strategy, category, expected", [
    # N=4, K=2
    ("ring", "quantization", (6, 4, 4)),         # 2(N-1), N, N
    ("ring", "sparsification", (6, 4, 4)),
    ("ring", "lowrank", (6, 1, 1)),               # 2(N-1), 1, 1
    ("ps", "quantization", (8, 3, 5)),           # 2N, K+1, N+1
    ("ps", "sparsification", (8, 3, 5)),
    ("ps", "lowrank", (8, 1, 1)),                 # 2N, 1, 1
    ("ps-colocated", "quantization", (6, 2, 4)),  # Sec. 6.1: 2(N-1), K, N
    ("ps-colocated", "lowrank", (6, 1, 1)),
    ("ring", "none", (6, 1, 1)),                  # aggregatable identity like low-rank
])
def test_sync_params_table(strategy, category, expected):
    assert sync_params(strategy, category).values(4, 2) == expected


def test_sync_params_unknown():
    with pytest.raises(ValueError, match="unknown strategy"):
        sync_params("tree", "quantization")
    with pytest.raises(ValueError, match="unknown compressor category"):
        sync_params("ring", "hashing")


def test_count_evaluates_and_prints():
    assert Count(n=2, c=-2)(16, 3) == 30
    assert Count(k=1, c=1)(16, 3) == 4
    assert str(Count(n=2, c=-2)) == "2N-2"
    assert str(Count(k=1)) == "K"
    assert str(Count(c=1)) == "1"


def test_n_batches():
    assert [n_batches(k, 4) for k in (1, 4, 5, 8, 9, 16)] == [1, 1, 2, 2, 3, 4]
    with pytest.raises(ValueError):
        n_batches(0, 4)
    with pytest.raises(ValueError):
        n_batches(1, 0)


# -- Eq. 1 -------------------------------------------------------------------------
def test_eq1_within_n():
    p = sync_params("ring", "quantization")
    # alpha = 6; T_send(8e6/2) = 1 ms + 4 ms = 5 ms -> 30 ms
    assert t_sync_orig(8e6, 2, 4, LINK, p) == pytest.approx(30 * MS)
    # K = 1: 6 * (1 + 8) ms = 54 ms
    assert t_sync_orig(8e6, 1, 4, LINK, p) == pytest.approx(54 * MS)


def test_eq1_beyond_n_batches():
    p = sync_params("ring", "quantization")
    # K = 8, N = 4: 2 batches, alpha(N, min(K, N)) = 6, T_send(1e6) = 2 ms -> 2 * 6 * 2 = 24 ms
    assert t_sync_orig(8e6, 8, 4, LINK, p) == pytest.approx(24 * MS)


def test_eq1_single_node_is_free():
    p = sync_params("ps-colocated", "quantization")
    assert t_sync_orig(8e6, 1, 1, LINK, p) == 0.0  # alpha = 2(N-1) = 0


# -- Eq. 2 -------------------------------------------------------------------------
def test_eq2_ring_quantization():
    p = sync_params("ring", "quantization")
    enc, dec = lin(0, 1e-9), lin(0, 2e-9)
    # m = 8e6, K = 1, N = 4, r = 1/32: r*m = 250 000 B
    # alpha*T_send = 6 * (1 ms + 0.25 ms) = 7.5 ms
    # beta*T_enc(8e6) = 4 * 8 ms = 32 ms; gamma*T_dec(250e3) = 4 * 0.5 ms = 2 ms -> 41.5 ms
    assert t_sync_cpr(8e6, 1, 4, 1 / 32, LINK, enc, dec, p) == pytest.approx(41.5 * MS)


def test_eq2_colocated_ps_beta_is_k():
    p = sync_params("ps-colocated", "quantization")
    enc, dec = lin(0, 1e-9), lin(0, 2e-9)
    # m = 8e6, K = 2, N = 4, r = 0.25: part 4e6, payload 1e6
    # 6 * (1 + 1) ms = 12 ms; beta = K = 2: 2 * 4 ms = 8 ms; gamma = N = 4: 4 * 2 ms = 8 ms
    assert t_sync_cpr(8e6, 2, 4, 0.25, LINK, enc, dec, p) == pytest.approx(28 * MS)


def test_eq2_table3_ps():
    p = sync_params("ps", "quantization")
    enc, dec = lin(1e-3, 0), lin(1e-3, 0)
    # N = 2, K = 1: alpha = 4, beta = 2, gamma = 3; m = 1e6, r = 0.5
    # 4 * (1 + 0.5) ms + 2 * 1 ms + 3 * 1 ms = 6 + 2 + 3 = 11 ms
    assert t_sync_cpr(1e6, 1, 2, 0.5, LINK, enc, dec, p) == pytest.approx(11 * MS)


def test_eq2_lowrank():
    p = sync_params("ring", "lowrank")
    enc, dec = lin(5e-3, 0), lin(1e-3, 0)
    # N = 4, K = 4, m = 4e6, r = 0.1: part 1e6, payload 1e5
    # 6 * (1 + 0.1) ms + 1 * 5 ms + 1 * 1 ms = 6.6 + 6 = 12.6 ms
    assert t_sync_cpr(4e6, 4, 4, 0.1, LINK, enc, dec, p) == pytest.approx(12.6 * MS)


def test_eq2_beyond_n_pipelines_batches():
    p = sync_params("ps-colocated", "quantization")
    enc, dec = lin(0, 1e-9), lin(0, 2e-9)
    # N = 2, K = 4 -> 2 batches; counts at min(K, N) = 2: alpha 2, beta 2, gamma 2
    # part = 2e6, payload 5e5: C = 2 * (1 + 0.5) = 3 ms; E = 2 * 2 + 2 * 1 = 6 ms
    # C + E + (2 - 1) * max(C, E) = 3 + 6 + 6 = 15 ms
    assert t_sync_cpr(8e6, 4, 2, 0.25, LINK, enc, dec, p) == pytest.approx(15 * MS)


def test_eq2_reduces_to_eq1_terms_without_compute():
    p = sync_params("ring", "quantization")
    zero = lin(0, 0)
    # r = 1, free encode/decode: Eq. 2 equals Eq. 1 for K <= N
    for k in (1, 2, 4):
        assert t_sync_cpr(8e6, k, 4, 1.0, LINK, zero, zero, p) == pytest.approx(
            t_sync_orig(8e6, k, 4, LINK, p))


def test_eq2_rejects_bad_rate():
    p = sync_params("ring", "quantization")
    with pytest.raises(ValueError, match="compression rate"):
        t_sync_cpr(1e6, 1, 4, 0.0, LINK, lin(0, 0), lin(0, 0), p)


# -- link and curves -------------------------------------------------------------
def test_link():
    lk = Link(latency=50e-6, bandwidth=1.25e8)  # 1 Gbit/s
    assert lk(1.25e6) == pytest.approx(50e-6 + 0.01)
    assert lk.alpha == 50e-6
    assert lk.beta == pytest.approx(8e-9)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(latency=0.0, bandwidth=0.0)
    with pytest.raises(ValueError, match="latency"):
        Link(latency=-1.0, bandwidth=1.0)


def test_fit_link_recovers_parameters():
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    times = [50e-6 + s / 1.25e8 for s in sizes]
    lk = fit_link(sizes, times)
    assert lk.latency == pytest.approx(50e-6, rel=1e-6)
    assert lk.bandwidth == pytest.approx(1.25e8, rel=1e-6)
    with pytest.raises(ValueError):
        fit_link([4096], [1e-3])


def test_curve_loglog_interpolation_and_extrapolation():
    c = Curve((1000, 4000), (1e-3, 16e-3))  # slope 2 in log-log
    assert c(2000) == pytest.approx(4e-3)  # 1 ms * (2000/1000)^2
    assert c(500) == pytest.approx(1e-3)  # held at the smallest time
    assert c(8000) == pytest.approx(32e-3)  # linear in bytes beyond the largest size
    assert c(4000) == pytest.approx(16e-3)


def test_curve_linear_and_validation():
    c = Curve.linear(1e-4, 1e-9, [1e3, 1e6])
    assert c.times == pytest.approx((1e-4 + 1e-6, 1e-4 + 1e-3))
    with pytest.raises(ValueError, match="increasing"):
        Curve((2.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError):
        Curve((1.0,), (0.0,))
    with pytest.raises(ValueError):
        Curve.from_dict({"sizes": [1]})


# -- Table I collectives -----------------------------------------------------------
# M = 1e6 B, N = 4, alpha = 1 ms, beta = 1 ns/B (M*beta = 1 ms), log2(4) = 2
def test_collectives_table1():
    a, b = 1e-3, 1e-9
    assert col.ps(1e6, 4, a, b) == pytest.approx(8 * MS)              # 2 + 2*3*1
    assert col.ring_allreduce(1e6, 4, a, b) == pytest.approx(7.5 * MS)  # 2*3 + 2*3/4
    assert col.tree_allreduce(1e6, 4, a, b) == pytest.approx(8 * MS)  # 2*2 + 2*2
    assert col.broadcast(1e6, 4, a, b) == pytest.approx(4 * MS)       # 2 + 2
    assert col.allgather(1e6, 4, a, b) == pytest.approx(5 * MS)       # 2 + 3


def test_collectives_topk_eq4():
    a, b, c = 1e-3, 1e-9, 0.01  # M*c*beta = 0.01 ms
    assert col.allgather_topk(1e6, 4, a, b, c) == pytest.approx(2.06 * MS)  # 2 + 3*2*0.01
    assert col.ar_topk_ring(1e6, 4, a, b, c) == pytest.approx(8.035 * MS)  # 8 + 0.01*3.5
    assert col.ar_topk_tree(1e6, 4, a, b, c) == pytest.approx(6.06 * MS)   # 6 + 3*0.01*2


def test_collectives_edge_cases():
    assert col.tree_allreduce(1e6, 1, 1e-3, 1e-9) == 0.0
    assert col.ring_allreduce(1e6, 1, 1e-3, 1e-9) == 0.0
    with pytest.raises(ValueError):
        col.ps(1e6, 0, 1e-3, 1e-9)
    with pytest.raises(ValueError):
        col.allgather(-1, 4, 1e-3, 1e-9)
    assert set(col.COLLECTIVES) == {"ps", "ring_allreduce", "tree_allreduce", "broadcast",
                                    "allgather"}


# -- profiles ------------------------------------------------------------------------
def _profile():
    sizes = (4096.0, 1 << 20, 64 << 20)
    cp = CompressorProfile(name="q", category="quantization", ratio=1 / 32, header_bytes=32,
                           encode=Curve.linear(2e-5, 1e-9, sizes),
                           decode=Curve.linear(1e-5, 5e-10, sizes))
    cp = dataclasses.replace(cp, engine_cpu_by={"ring": ((4096, 1, 0.0), (1 << 20, 4, 3e-3))})
    return Profile(link=Link(1e-4, 1.25e8), compressors={"q": cp},
                   link_samples=((4096, 1.3e-4), (1 << 20, 8.5e-3)), meta={"ranks": 4},
                   link_one=Link(8e-5, 1.3e8), link_one_samples=((4096, 1.1e-4),),
                   sync_overhead=2e-3, lane_cpu=((4096, 1e-4), (1 << 20, 2e-3)))


def test_profile_json_round_trip(tmp_path):
    p = _profile()
    path = tmp_path / "profile.json"
    p.save(path)
    q = Profile.load(path)
    assert q == p
    assert q.compressor("q").payload_bytes(1024) == 32 + 32
    assert q.compressor("q").rate(1 << 20) == pytest.approx((32 + (1 << 15)) / (1 << 20))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="x"), "not a profile file"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(extra=1), "unknown profile keys"),
    (lambda d: d["link"].update(bandwidth=-1), "bandwidth"),
    (lambda d: d["compressors"]["q"].update(category="magic"), "category"),
    (lambda d: d["compressors"]["q"].update(ratio=0), "ratio"),
    (lambda d: d["compressors"]["q"]["encode"].update(sizes=[2, 1, 3]), "increasing"),
    (lambda d: d["compressors"]["q"].pop("decode"), "missing keys"),
    (lambda d: d["link_one"].pop("latency"), "link_one"),
    (lambda d: d.update(sync_overhead=-1), "sync_overhead"),
    (lambda d: d.update(lane_cpu=[[4096, -1e-3]]), "lane_cpu"),
    (lambda d: d.update(lane_cpu=[[4096]]), "lane_cpu"),
    (lambda d: d["compressors"]["q"].update(engine_cpu_by={"tree": []}), "engine_cpu_by"),
    (lambda d: d["compressors"]["q"]["engine_cpu_by"]["ring"].append([4096, 1, -1.0]),
     "engine_samples"),
])
def test_profile_validation(tmp_path, mutate, message):
    d = _profile().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_profile_load_errors(tmp_path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read profile"):
        Profile.load(tmp_path / "x.json")
    with pytest.raises(ProfileError, match="has no compressor 'onebit'.*it has: q"):
        _profile().compressor("onebit")


def test_monotone_pools_violators():
    from hipress_like.tuning.profiler import monotone

    assert monotone([1.0, 2.0, 3.0]) == pytest.approx([1.0, 2.0, 3.0])
    # 4 then 1: pooled to their geometric mean 2
    assert monotone([1.0, 4.0, 1.0, 8.0]) == pytest.approx([1.0, 2.0, 2.0, 8.0])
    assert monotone([8.0, 1.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])


def test_log_sizes():
    assert log_sizes(4096, 65536) == [4096, 16384, 65536]
    assert log_sizes(4096, 4096) == [4096]
    s = log_sizes(4 << 10, 256 << 20)
    assert s[0] == 4 << 10 and s[-1] == 256 << 20 and len(s) == 9
    with pytest.raises(ValueError):
        log_sizes(100, 10)


@pytest.mark.parametrize("name, ratio", [("identity", 1.0), ("fp16", 0.5)])
def test_profile_compressor_payload_fit(name, ratio):
    c = profile_compressor(name, None, [4096, 16384, 65536], repeats=1, min_time=0.0)
    assert c.ratio == pytest.approx(ratio)
    # 16-byte fixed header + one int64 per dimension: the profile times (rows, cols)
    # matrices (32 x 32, 64 x 64, 128 x 128), as weight gradients are
    assert c.header_bytes == 16 + 8 * 2
    assert c.encode.sizes == (4096.0, 16384.0, 65536.0)
    assert c.decode.sizes == tuple(float(32 + ratio * s) for s in (4096, 16384, 65536))
    assert all(t > 0 for t in c.encode.times + c.decode.times)
    assert not c.error_feedback


def test_profile_compressor_error_feedback_auto():
    # fp16 is biased and stateless: the engine wraps it, so "auto" times the wrapper
    c = profile_compressor("fp16", None, [4096, 16384], repeats=1, min_time=0.0,
                           error_feedback="auto")
    assert c.error_feedback and c.ratio == pytest.approx(0.5)
    c = profile_compressor("identity", None, [4096, 16384], repeats=1, min_time=0.0,
                           error_feedback="auto")
    assert not c.error_feedback


@pytest.mark.parametrize("name", ["thc", "powersgd"])
def test_profile_multi_round_compressor_sends_every_round(name):
    """Multi-round compressors are timed through their rounds, as the engine runs them:
    the bytes are every round's payload (THC: range + indices; PowerSGD: P + Q)."""
    import torch

    import hipress_like as hp
    from hipress_like.tuning.engine_timing import profile_shape

    sizes = [1 << 16, 1 << 18, 1 << 20]
    c = profile_compressor(name, None, sizes, repeats=1, min_time=0.0)
    comp = hp.compressors.get(name)
    assert c.aggregatable and c.encode.sizes == tuple(float(s) for s in sizes)
    for s, paid in zip(sizes, c.decode.sizes):
        g = torch.randn(profile_shape(s // 4))  # the shape the profile times
        st, agg, want = comp.init(g, world_size=1), None, 0
        for r in range(comp.capabilities.rounds):  # the rounds by hand, a world of one
            payload, st = comp.encode_round(r, g, st, agg)
            agg, want = comp.merge_round(r, [payload]), want + payload.numel()
        assert paid == want
    assert all(t > 0 for t in c.encode.times + c.decode.times)


def test_profile_compressor_unknown():
    with pytest.raises(ValueError, match="unknown compressor"):
        profile_compressor("nosuch", None, [4096])


def test_measure_link_inproc_agrees_on_every_rank():
    from hipress_like.casync.transport.inproc import run_threads

    res = run_threads(lambda t: measure_link(t, [4096, 65536], repeats=1), 3, timeout=60)
    links = [lk for lk, _ in res]
    assert all(lk == links[0] for lk in links)
    assert [s for s, _ in res[0][1]] == [4096, 65536]
    assert links[0].bandwidth > 0 and links[0].latency >= 0


def test_measure_link_without_warmup_runs_only_the_timed_exchanges():
    # a probe in a running job (tuning/online.py) skips the warm-up, and every
    # repetition's slowest rank comes from one allreduce at the end
    from hipress_like.casync.transport.inproc import run_threads

    def body(t):
        calls = {"alltoallv": 0, "allreduce": 0}
        for name in calls:
            orig = getattr(t, name)

            def counted(*a, _orig=orig, _name=name, **kw):
                calls[_name] += 1
                return _orig(*a, **kw)
            setattr(t, name, counted)
        link, samples = measure_link(t, [4096, 65536], repeats=3, warmup=False)
        return link, calls

    res = run_threads(body, 3, timeout=60)
    assert all(lk == res[0][0] for lk, _ in res)
    assert res[0][1] == {"alltoallv": 6, "allreduce": 1}  # 2 sizes x 3 repetitions


def test_measure_link_one_busy_link_with_round_metadata():
    from hipress_like.casync.transport.inproc import run_threads

    res = run_threads(lambda t: measure_link(t, [4096, 65536], repeats=1, pattern="one",
                                             round_meta_bytes=1024), 3, timeout=60)
    assert all(lk == res[0][0] for lk, _ in res)
    with pytest.raises(ValueError, match="pattern"):
        run_threads(lambda t: measure_link(t, [4096], pattern="some"), 2, timeout=30)


def test_concurrent_link():
    one, every = Link(1e-3, 4e9), Link(2e-3, 1e9)
    assert concurrent_link(one, every, 4, 1) == one
    # 4 links at 1 GB/s = 4 GB/s in aggregate, split over c busy links, capped at one's 4 GB/s
    assert concurrent_link(one, every, 4, 2) == Link(2e-3, 2e9)
    assert concurrent_link(one, every, 4, 4) == Link(2e-3, 1e9)
    assert concurrent_link(one, every, 4, 8) == Link(2e-3, 1e9)  # never more than N busy
    # dedicated links: same bandwidth however many are busy
    same = Link(2e-3, 1e9)
    assert concurrent_link(same, same, 4, 3).bandwidth == 1e9


def test_measure_link_needs_two_ranks():
    from hipress_like.casync.transport.inproc import run_threads

    with pytest.raises(ValueError, match="at least 2 ranks"):
        run_threads(lambda t: measure_link(t, [4096]), 1, timeout=30)


# -- presets ---------------------------------------------------------------------------
def test_presets_match_table6():
    mib = 1 << 20
    vgg = preset("vgg19")
    assert len(vgg) == 38 and max(s for _, s in vgg) == 392 * mib
    assert round(sum(s for _, s in vgg) / mib, 2) == 548.05
    r50 = preset("resnet50")
    assert len(r50) == 155 and max(s for _, s in r50) == 9 * mib
    assert round(sum(s for _, s in r50) / mib, 2) == 97.46
    bert = preset("bert-base")
    assert round(max(s for _, s in bert) / mib, 2) == 89.42
    assert {"vgg19", "resnet50", "bert-base", "bert-large", "table7", "fig14"} <= set(available())


def test_preset_scale_and_errors(tmp_path):
    half = preset("table7", scale=0.5)
    assert [s for _, s in half] == [2 << 20, 8 << 20, 196 << 20]
    assert all(s % 4 == 0 and s >= 4 for _, s in preset("resnet50", scale=1e-6))
    with pytest.raises(ValueError, match="unknown preset 'vgg91'.*did you mean 'vgg19'"):
        preset("vgg91")
    with pytest.raises(ValueError, match="scale"):
        preset("vgg19", scale=0)
    (tmp_path / "m.json").write_text(json.dumps({"a": 4096, "b": 8}))
    assert from_json(str(tmp_path / "m.json")) == [("a", 4096), ("b", 8)]
    (tmp_path / "bad.json").write_text(json.dumps([4096, -1]))
    with pytest.raises(ValueError, match="integers >= 1"):
        from_json(str(tmp_path / "bad.json"))


def test_from_module_without_parameters():
    from hipress_like.cost_model.presets import from_module

    with pytest.raises(ValueError, match="no parameter"):
        from_module("torch.nn:Identity")


def test_from_module_errors_and_sizes(monkeypatch):
    import sys
    import types

    from hipress_like.cost_model.presets import from_module

    mod = types.ModuleType("_hp_test_models")
    mod.Net = lambda: torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.Linear(4, 2))
    mod.instance = torch.nn.Linear(3, 3, bias=False)
    mod.number = 3
    monkeypatch.setitem(sys.modules, "_hp_test_models", mod)
    assert from_module("_hp_test_models:Net") == [("0.weight", 160), ("0.bias", 16),
                                                  ("1.weight", 32), ("1.bias", 8)]
    assert from_module("_hp_test_models:instance") == [("weight", 36)]
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        from_module("_hp_test_models:number")
    with pytest.raises(ValueError, match="cannot import"):
        from_module("_hp_no_such_module:Net")
    with pytest.raises(ValueError, match="package.module:attr"):
        from_module("nocolon")
