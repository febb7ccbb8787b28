"""Bidirectional compression in the engine (Natural Compression, Alg. 1).

A master compressor C_M encodes each aggregate on its way back: the PS
aggregator's pull, the Ring chunk owner's result after the last reduce hop.
Pinned here over the in-process transport (ranks as threads): the values
equal C_M applied to the exact sum (PS: rank order; Ring: each chunk summed
around the ring from its first rank), ranks stay bitwise identical, plans
carry ``compressor_back`` per entry, and every setup error names its cause.
"""
import pytest
import torch
from test_engine_inproc import run_engine  # tests/unit is on sys.path (rootdir imports)

import hipress_like.compressors as C
from hipress_like.casync.engine import Engine, EngineConfig
from hipress_like.casync.errors import ConfigMismatchError
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.casync.workflows import chunk_bounds
from hipress_like.cost_model.plan import GradientPlan, Plan, PlanError, SizeRule

SIZES = {"a": (1000,), "b": (33,), "w": (40, 25)}


def grads(rank):
    g = torch.Generator().manual_seed(77 + rank)
    return {k: torch.randn(*s, generator=g) for k, s in SIZES.items()}


def plan_all(comp="identity", k=1, gradients=None):
    return Plan(compressor=comp, rule=SizeRule(min_compress_bytes=0, bytes_per_partition=1,
                                               max_partitions=k), gradients=gradients or {})


def run(n, plan, strategy="ps", steps=1, **cfg):
    """Each rank's (outputs per step, layout) (``test_engine_inproc.run_engine``)."""
    return [(outs, layout) for outs, layout, _ in
            run_engine(n, plan, strategy, steps=steps, cfg=cfg, grads=grads)]


def master_of(x):
    """C_M applied to a summed tensor, divided by N afterwards (the final write)."""
    m = C.get("onebit")
    return m.decode(m.encode(x.contiguous(), m.init(x))[0])


@pytest.mark.parametrize("n", [2, 3])
def test_ps_sends_the_exact_sum_back_encoded_by_the_master(n):
    """identity workers (sums exact, in rank order) and a onebit master: every
    rank gets onebit(sum) / N, the worker compressor never touching the result."""
    res = run(n, plan_all("identity"), compressor_back="onebit", error_feedback=False)
    all_g = [grads(r) for r in range(n)]
    for k in SIZES:
        total = all_g[0][k].clone()
        for r in range(1, n):
            total += all_g[r][k]
        want = master_of(total) / n
        for outs, _ in res:
            torch.testing.assert_close(outs[0][k], want, rtol=1e-6, atol=0)
    assert {g["back"] for g in res[0][1].values()} == {"OneBit()"}


def test_ring_sends_each_chunk_sum_back_encoded_by_the_master():
    n = 3
    res = run(n, plan_all("identity"), strategy="ring", compressor_back="onebit",
              error_feedback=False)
    all_g = [grads(r) for r in range(n)]
    for k in ("a", "w"):  # ring-eligible sizes (numel >= N)
        flat = [all_g[r][k].reshape(-1) for r in range(n)]
        want = torch.empty_like(flat[0])
        for c, (s, e) in enumerate(chunk_bounds(flat[0].numel(), n)):
            acc = flat[c][s:e].clone()
            for i in range(1, n):
                acc += flat[(c + i) % n][s:e]
            want[s:e] = master_of(acc) / n
        for outs, layout in res:
            assert layout[k]["workflow"] == "ring"
            torch.testing.assert_close(outs[0][k].reshape(-1), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("strategy", ["ps", "ring"])
@pytest.mark.parametrize("worker,master", [("terngrad", "onebit"), ("onebit", "identity"),
                                           ("topk", "terngrad")])
def test_ranks_stay_bitwise_identical_over_steps(strategy, worker, master):
    res = run(3, plan_all(worker, k=2), strategy=strategy, steps=3, compressor_back=master)
    for step in range(3):
        for k in SIZES:
            ref = res[0][0][step][k]
            assert torch.isfinite(ref).all()
            for outs, _ in res[1:]:
                assert torch.equal(outs[step][k], ref), (step, k)


def test_identity_master_sends_the_decoded_sum_back_unchanged():
    """C_M = identity: the aggregator's sum of its own values and the other
    ranks' terngrad decodes goes back exactly, so each element is off the true
    mean by at most the other rank's quantization step / N (terngrad 8 bits:
    step = (max - min) / 255), far inside a second quantization's error."""
    n = 2
    plan = Plan(compressor="terngrad", params={"bitwidth": 8},
                rule=SizeRule(min_compress_bytes=0, bytes_per_partition=1, max_partitions=1))
    res = run(n, plan, compressor_back="identity")
    all_g = [grads(r) for r in range(n)]
    for k in SIZES:
        mean = (all_g[0][k] + all_g[1][k]) / n
        step = max(float(g[k].max() - g[k].min()) for g in all_g) / 255
        err = (res[0][0][0][k] - mean).abs().max()
        assert err <= step / n * (1 + 1e-5)


def test_a_plan_entry_sets_the_master_per_gradient():
    plan = plan_all("terngrad", gradients={
        "a": GradientPlan(True, 1, "identity", compressor_back="onebit"),
        "w": GradientPlan(True, 1, "terngrad")})
    res = run(2, plan, error_feedback=False)
    layout = res[0][1]
    assert layout["a"]["back"] == "OneBit()" and layout["w"]["back"] is None
    all_g = [grads(r) for r in range(2)]
    want = master_of(all_g[0]["a"] + all_g[1]["a"]) / 2
    torch.testing.assert_close(res[0][0][0]["a"], want, rtol=1e-6, atol=0)


def test_plan_entries_round_trip_with_a_master(tmp_path):
    plan = plan_all("onebit", gradients={
        "a": GradientPlan(True, 2, "terngrad", {"bitwidth": 4}, "onebit", {}),
        "b": GradientPlan(False)})
    path = tmp_path / "p.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.gradients["a"].compressor_back == "onebit"
    assert back.gradients["a"].to_dict()["params_back"] == {}
    assert ("onebit", {}) in back.compressors()


@pytest.mark.parametrize("entry,match", [
    (dict(compress=False, compressor_back="onebit"), "does not compress"),
    (dict(compress=True, params_back={"bitwidth": 2}), "without a compressor_back"),
    (dict(compress=True, compressor_back=""), "compressor_back must be"),
])
def test_bad_plan_entries_are_refused(entry, match):
    with pytest.raises(PlanError, match=match):
        GradientPlan(**entry)


def _register(n, **cfg):
    def body(tr):
        eng = Engine(tr, EngineConfig(timeout=10, **cfg))
        try:
            eng.register([("w", (64, 8), torch.float32)])
        finally:
            eng.close()
    return run_threads(body, n, timeout=60)


def test_a_multi_round_master_cannot_encode_an_aggregate():
    with pytest.raises(ValueError, match="cannot encode an aggregate"):
        _register(1, compressor="onebit", compressor_back="powersgd", plan=plan_all("onebit"))


def test_a_master_for_a_multi_round_worker_is_refused():
    with pytest.raises(ValueError, match="reduced, not re-encoded"):
        _register(1, compressor="powersgd", compressor_back="onebit",
                  plan=plan_all("powersgd"))


def test_params_back_without_a_master_is_refused():
    with pytest.raises(ValueError, match="without a compressor_back"):
        EngineConfig(compressor="onebit", params_back={"bitwidth": 2})


def test_a_master_that_differs_between_ranks_is_named_at_register():
    def body(tr):
        back = "onebit" if tr.rank == 0 else "terngrad"
        eng = Engine(tr, EngineConfig(compressor="onebit", compressor_back=back, timeout=10,
                                      plan=plan_all("onebit")))
        try:
            eng.register([("w", (64,), torch.float32)])
        except BaseException as e:  # noqa: B036
            return e
        finally:
            eng.close()
        return None
    errs = run_threads(body, 2, timeout=60)
    for e in errs:
        assert isinstance(e, ConfigMismatchError) and "compressor_back" in str(e)


def test_a_state_saved_without_a_master_is_refused_with_one():
    def body(tr):
        saved = None
        for back in (None, "terngrad"):
            eng = Engine(tr, EngineConfig(compressor="onebit", compressor_back=back,
                                          plan=plan_all("onebit"), timeout=10))
            try:
                eng.register([("w", (100,), torch.float32)])
                if saved is not None:
                    eng.load_state_dict(saved)
                eng.submit("w", torch.randn(100))
                eng.synchronize()
                saved = eng.state_dict()
            finally:
                eng.close()
    with pytest.raises(Exception, match="gradient .w. was compressed by"):
        run_threads(body, 2, timeout=60)
