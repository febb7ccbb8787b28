"""bench/bound.py's pure parts: the operations one rank does per step, and the run statistics.

What is pinned: per rank, every strategy encodes each value once per round,
decodes each aggregate value once, and sums the others' payloads of a 1/N
share (HiPress's operators per rank, byte-balanced aggregators); the counts
agree with the cost model's beta (HiPress Table 3 / Sec. 6.1) where the two
count the same thing; the median/spread helpers; and that the timing runs
each operation of a real compressor (single and multi-round).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_modules  # noqa: E402


@pytest.fixture(scope="module")
def bound():
    return bench_modules.load("bound")


def _fraction(ops, kind):
    return sum(o.fraction for o in ops if o.kind == kind)


@pytest.mark.parametrize("strategy", ["ps", "ring"])
@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("k", [1, 2, 4, 7, 32])
def test_each_value_encoded_and_decoded_once_per_rank(bound, strategy, n, k):
    ops = bound.rank_ops(strategy, n, k)
    assert _fraction(ops, "encode") == pytest.approx(1.0)
    assert _fraction(ops, "decode") == pytest.approx(1.0)
    assert _fraction(ops, "decode_add") == pytest.approx((n - 1) / n)
    assert _fraction(ops, "merge") == 0
    pieces = {o.pieces for o in ops}
    assert pieces == ({k} if strategy == "ps" else {k * n})


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_aggregatable_payloads_merge_instead_of_decoding(bound, n, k):
    ps = bound.rank_ops("ps", n, k, aggregatable=True)
    ring = bound.rank_ops("ring", n, k, aggregatable=True)
    for ops in (ps, ring):
        assert _fraction(ops, "decode_add") == 0
        assert _fraction(ops, "encode") == pytest.approx(1.0)
        assert _fraction(ops, "decode") == pytest.approx(1.0)
    # PS: the aggregator sums N payloads of each of its K/N partitions
    (m,) = [o for o in ps if o.kind == "merge"]
    assert (m.fan_in, m.calls) == (n, pytest.approx(k / n))
    # Ring: N-1 hops per partition, each merging the received payload with its own
    (m,) = [o for o in ring if o.kind == "merge"]
    assert (m.fan_in, m.calls) == (2, k * (n - 1))


@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_multi_round_encodes_every_round_and_decodes_once(bound, strategy):
    ops = bound.rank_ops(strategy, 4, 2, aggregatable=True, rounds=2)
    assert _fraction(ops, "encode") == pytest.approx(2.0)
    assert [o.round for o in ops if o.kind == "encode"] == [0, 1]
    assert [o.round for o in ops if o.kind == "merge"] == [0, 1]
    (dec,) = [o for o in ops if o.kind == "decode"]
    assert dec.round == 1 and dec.fraction == pytest.approx(1.0)


def test_master_compressor_reencodes_the_aggregators_share(bound):
    plain = bound.rank_ops("ps", 4, 4, aggregatable=True)
    bidi = bound.rank_ops("ps", 4, 4, aggregatable=True, back=True)
    for kind in ("encode", "decode"):
        assert _fraction(bidi, kind) - _fraction(plain, kind) == pytest.approx(1 / 4)
    ring = bound.rank_ops("ring", 4, 1, aggregatable=True, back=True)
    assert _fraction(ring, "encode") == pytest.approx(1 + 1 / 4)  # the last hop's chunk


@pytest.mark.parametrize("n", [2, 4, 8])
def test_encode_counts_match_the_cost_models_beta(bound, n):
    """HiPress Sec. 6.1 (co-located PS): K encodes; Table 3 (Ring, K = 1): N encodes."""
    from hipress_like.cost_model.model import sync_params

    for k in (1, 2, n, 2 * n):
        ps = [o for o in bound.rank_ops("ps", n, k) if o.kind == "encode"]
        assert sum(o.calls for o in ps) == sync_params("ps-colocated",
                                                       "quantization").beta(n, k)
    ring = [o for o in bound.rank_ops("ring", n, 1) if o.kind == "encode"]
    assert sum(o.calls for o in ring) == sync_params("ring", "quantization").beta(n, 1)


def test_rank_ops_rejects_what_cannot_run(bound):
    with pytest.raises(ValueError, match="strategy"):
        bound.rank_ops("tree", 4, 1)
    with pytest.raises(ValueError, match=">= 2"):
        bound.rank_ops("ps", 1, 1)
    with pytest.raises(ValueError, match="partitions"):
        bound.rank_ops("ring", 4, 0)
    with pytest.raises(ValueError, match="aggregatable"):
        bound.rank_ops("ps", 4, 1, rounds=2)


def test_lane_passes(bound):
    assert bound.lane_fraction(2) == {"copy": 1.0, "add": 0.5, "div": 1.0}
    with pytest.raises(ValueError):
        bound.lane_fraction(1)


def test_median_and_spread(bound):
    assert bound.median_spread([5.0, 1.0, 3.0]) == (3.0, 1.0, 5.0)
    assert bound.median_spread([2, 4]) == (3.0, 2.0, 4.0)
    with pytest.raises(ValueError, match="at least one"):
        bound.median_spread([])
    # run i against run i: the host's drift cancels in each pair
    assert bound.paired_ratio([10.0, 20.0, 30.0, 99.0], [5.0, 10.0, 10.0]) == (2.0, 2.0, 3.0)
    with pytest.raises(ValueError):
        bound.paired_ratio([], [])
    with pytest.raises(ValueError, match="0 ms"):
        bound.paired_ratio([1.0], [0.0])


def test_spec_of_train_rows(bound):
    assert bound.spec_of("hp-ring-powersgd1").params == {"rank": 1}
    assert bound.spec_of("hp-ps-powersgd").params == {}
    s = bound.spec_of("hp-ps-natural2")
    assert (s.compressor, s.back) == ("natural", "natural")
    assert bound.spec_of("ddp").compressor is None
    for name in ("hp-ps-auto", "hp-ring-plan", "ddp-powersgd1", "hp-art-ring", "hvd-none",
                 "hp-tree-onebit"):
        assert bound.spec_of(name) is None


@pytest.mark.parametrize("name,params,aggregatable,rounds",
                         [("onebit", {}, False, 1), ("powersgd", {"rank": 1}, True, 2)])
def test_time_ops_times_each_operation(bound, name, params, aggregatable, rounds):
    import torch

    from hipress_like.casync.choice import build_compressor

    comp = build_compressor(name, params, "auto")
    assert (comp.capabilities.aggregatable, comp.capabilities.rounds) == (aggregatable, rounds)
    g = torch.randn(64, 128)
    ops = bound.rank_ops("ring", 2, 2, aggregatable=aggregatable, rounds=rounds)
    got = bound.time_ops(comp, g, ops, 2, repeats=2)
    kinds = {o.kind for o in ops}
    assert all(got[k] > 0 for k in kinds)
    assert all(got[k] == 0 for k in set(bound.KINDS) - kinds)


def test_train_headline_ratios_are_paired_medians_with_their_spread(bound, capsys):
    train = bench_modules.load("train", "bench_train_b")
    row = {"params_m": 26.6, "accuracy": 50.0}
    rows = [dict(row, config="floor", ms_per_step=100.0, runs_ms=[100.0, 90.0, 120.0]),
            dict(row, config="ddp", ms_per_step=900.0, runs_ms=[900.0, 900.0, 900.0]),
            dict(row, config="ddp-powersgd1", ms_per_step=400.0, runs_ms=[400.0, 360.0, 300.0]),
            dict(row, config="hp-ps-powersgd1", ms_per_step=200.0, runs_ms=[200.0, 180.0, 100.0],
                 ms_spread=[100.0, 200.0], bound_ms=150.0)]
    headline = train._report("vgg", rows, "test", None)
    out = capsys.readouterr().out
    by = {h["goal"]: h for h in headline}
    # run by run 400/200, 360/180, 300/100: median 2.0, spread 2.0-3.0
    hook = by["vs best DDP hook >= 1.3x"]
    assert (hook["value"], hook["spread"]) == (2.0, [2.0, 3.0])
    assert "(runs 2.00-3.00)" in out
    assert by["best row within 1.10x of its bound"]["value"] == pytest.approx(200 / 150)
    line = next(x for x in out.splitlines() if x.startswith("hp-ps-powersgd1"))
    assert "100-200" in line and "1.33" in line and "0.50" in line  # spread, step/bound, eff.


@pytest.fixture(scope="module")
def sync(bound):
    return bench_modules.load("sync")


def test_sync_prediction_of_ddp_buckets_and_model_error(sync):
    from hipress_like.cost_model.collectives import ring_allreduce

    link = sync.link_of("1gbit")
    assert link.bandwidth == 125e6
    # reverse order: 16 MB + 12 MB close a 25 MB bucket, 8 MB is the last one
    shapes = [("a", (2 << 20,)), ("b", (3 << 20,)), ("c", (4 << 20,))]
    want = (ring_allreduce(28 << 20, 4, link.alpha, link.beta)
            + ring_allreduce(8 << 20, 4, link.alpha, link.beta))
    assert sync.predict_allreduce(shapes, 4, link) == pytest.approx(want)
    rows = [{"nprocs": 2, "model_error": e, "model_error_host": 2 * e}
            for e in (0.1, -0.3, 0.2)] + [{"nprocs": 4, "seconds": 1.0}]
    assert sync.model_errors(rows) == {2: (pytest.approx(0.2), pytest.approx(0.4), None, 3)}
    for r, e in zip(rows, (0.05, 0.5, -0.1)):
        r["model_error_model"] = e
    assert sync.model_errors(rows)[2][2] == pytest.approx(0.1)


def test_the_step_model_prices_every_scaling_row_from_a_profile(sync):
    """``step_model_predictions`` names its predictions as the rows are named (DDP's
    buckets, strategy+compressor), and a host with fewer cores than ranks is slower."""
    from hipress_like.cost_model.model import Link
    from hipress_like.cost_model.profile import CompressorProfile, Profile
    from hipress_like.tuning.advise import paper_profile

    base = paper_profile(Link(1e-4, 125e6))
    onebit = base.compressor("onebit")
    # 0.2 s of CPU per synchronisation, whatever its size: the host bound decides
    cpu = {st: ((1 << 20, 1, 0.2), (8 << 20, 1, 0.2), (8 << 20, 4, 0.2)) for st in ("ps", "ring")}
    prof = Profile(link=base.link, compressors={"onebit": CompressorProfile(
        **{**{f: getattr(onebit, f) for f in onebit.__dataclass_fields__},
           "engine_cpu_by": cpu})}, lane_cpu=((1 << 20, 0.2), (8 << 20, 0.2)),
        meta={"ranks": 4})
    shapes = [("w", (2048, 2048)), ("b", (2048,))]
    wide = sync.step_model_predictions(prof.to_dict(), shapes, 4, cores=8)
    assert set(wide) == {sync.ALLREDUCE, "ps+onebit", "ring+onebit"}
    shared = sync.step_model_predictions(prof.to_dict(), shapes, 4, cores=2)
    # one compressed sync and one lane bucket: 0.2 s of CPU each, the step's own counted
    # once (0.2 s), on half a core per rank
    assert shared["ps+onebit"] == pytest.approx(0.2 / 0.5)
    assert wide["ps+onebit"] < shared["ps+onebit"]


def test_sync_prediction_slows_compression_when_ranks_outnumber_cores(sync):
    link = sync.link_of("1gbit")
    shapes = [("w", (512, 2048))]  # 4 MB: compressed by the default plan, one partition
    ded, host = sync.predict_sync(shapes, "ps", "onebit", {}, 4, link, cores=2)
    assert host > ded > 0
    ded8, host8 = sync.predict_sync(shapes, "ps", "onebit", {}, 4, link, cores=8)
    assert host8 == pytest.approx(ded8)  # a core per rank: nothing shared


def test_lane_rounds_sum_the_payload_by_allreduce(bound):
    ops = bound.rank_ops("allreduce", 4, 1, aggregatable=True, rounds=2)
    assert {o.pieces for o in ops} == {1}
    assert _fraction(ops, "encode") == pytest.approx(2.0)
    assert _fraction(ops, "merge") == pytest.approx(2 * 3 / 4)  # (N-1)/N added per round
    assert _fraction(ops, "decode") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="multi-round"):
        bound.rank_ops("allreduce", 4, 1)


def test_powersgd_takes_the_lane_as_the_engine_lays_it_out(bound):
    from hipress_like.casync.choice import build_compressor

    assert bound.lane_rounds(build_compressor("powersgd", {"rank": 1}, "auto"))
    assert not bound.lane_rounds(build_compressor("onebit", {}, "auto"))


def test_sync_rows_are_priced_on_the_link_measured_in_their_run(sync):
    """A scaling row carries the link its N ranks measured (``measure_link``); the model
    prices it on that, and on the tc rate's nominal link only without a measurement."""
    shapes = sync.list_shapes("vggstyle")
    slow = {"latency": 2e-4, "bandwidth": 60e6, "samples": []}
    rows = [{"net": "1gbit", "nprocs": 2, "list": "vggstyle", "config": sync.ALLREDUCE,
             "seconds": 1.0, "measured_link": m} for m in (slow, None)]
    sync.add_predictions(rows, cores=2)
    measured, nominal = rows
    assert measured["model_link"] == "measured" and nominal["model_link"] == "nominal"
    link, _ = sync.row_link(measured)
    assert measured["predicted_s"] == pytest.approx(sync.predict_allreduce(shapes, 2, link))
    assert measured["predicted_s"] > nominal["predicted_s"] * 1.9  # 60 MB/s against 125
