"""Replayed collective schedules (``casync/replay.py``) over the in-process transport.

A layout whose gradients all travel by allreduce records its fused buckets in
a coordinated step and replays them afterwards without metadata rounds. These
tests pin that replay changes no bit of the result, that a step submitting
other gradients (GAN-style alternation) falls back by itself, and that the
failures the metadata rounds used to report (a mismatch, an error, NaN/Inf,
a dead rank) are still reported on every rank during a replay.
"""
import pytest
import torch

from hipress_like.casync.engine import Engine, EngineConfig, EngineError, GradientMismatchError
from hipress_like.casync.replay import (
    SHARE_UNIT,
    Schedule,
    dtype_groups,
    read_shared,
    read_status,
    status_tensor,
)
from hipress_like.casync.transport.base import PeerError
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.cost_model.plan import Plan, SizeRule

# two matrices PowerSGD compresses and small tensors the lane fuses (size rule: 4 KB)
SHAPES = {"w0": (64, 48), "w1": (40, 30), "b0": (48,), "b1": (30,), "b2": (7,)}
PLAN = Plan(compressor="powersgd", params={"rank": 2},
            rule=SizeRule(min_compress_bytes=4096, bytes_per_partition=1 << 30))


def grads(rank, step, names=SHAPES):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {k: torch.randn(SHAPES[k], generator=g) for k in names}


def run(n, script, *, threads=True, strategy="ring", cfg=None, plan=PLAN, hook=None):
    """Run the steps of ``script(rank, step) -> names`` on n thread-ranks; per rank,
    return (outputs per step, synchronize results, replayed_steps), or the error."""
    def body(tr):
        eng = Engine(tr, EngineConfig(plan=plan, strategy=strategy, threads=threads,
                                      **{"timeout": 10, **(cfg or {})}))
        outs, oks, step = [], [], 0
        try:
            eng.register([(k, s, torch.float32) for k, s in SHAPES.items()])
            step = 0
            while True:
                names = script(tr.rank, step)
                if names is None:
                    return outs, oks, eng.replayed_steps
                if hook is not None:
                    hook(eng, tr.rank, step)
                work = grads(tr.rank, step, names)
                for k in names:
                    eng.submit(k, work[k])
                oks.append(eng.synchronize())
                outs.append(work)
                step += 1
        except BaseException as e:  # noqa: B036 - the test inspects it
            e.failed_step = step
            return e
        finally:
            eng.close()
    return run_threads(body, n, timeout=120)


def steps(k, names=tuple(SHAPES)):
    return lambda rank, step: list(names) if step < k else None


def assert_same(a, b):
    for r, (ra, rb) in enumerate(zip(a, b)):
        assert not isinstance(ra, BaseException), ra
        assert not isinstance(rb, BaseException), rb
        assert ra[1] == rb[1]
        for s, (sa, sb) in enumerate(zip(ra[0], rb[0])):
            assert sa.keys() == sb.keys()
            for k in sa:
                assert torch.equal(sa[k], sb[k]), (r, s, k)


@pytest.mark.parametrize("threads", [True, False])
@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_replay_gives_the_coordinated_bits(threads, strategy):
    rep = run(3, steps(4), threads=threads, strategy=strategy)
    coord = run(3, steps(4), threads=threads, strategy=strategy, cfg={"replay": False})
    assert_same(rep, coord)
    assert [r[2] for r in rep] == [3, 3, 3]  # step 0 records, steps 1-3 replay
    assert [r[2] for r in coord] == [0, 0, 0]
    for r in range(3):  # and all ranks agree bit for bit
        for k in SHAPES:
            assert torch.equal(rep[r][0][3][k], rep[0][0][3][k])


def test_uncompressed_model_replays_and_matches():
    plan = Plan(compressor="identity", rule=SizeRule(min_compress_bytes=1 << 40))
    rep = run(4, steps(3), plan=plan)
    coord = run(4, steps(3), plan=plan, cfg={"replay": False})
    assert_same(rep, coord)
    assert [r[2] for r in rep] == [2] * 4


def test_layouts_with_links_are_coordinated_every_step():
    plan = Plan(compressor="onebit", rule=SizeRule(min_compress_bytes=4096))
    res = run(3, steps(3), plan=plan)
    assert [r[2] for r in res] == [0, 0, 0]


def test_gan_style_alternation_falls_back_by_itself():
    """Steps 2 and 5 leave out a compressed matrix and part of a lane bucket on every
    rank (its parameters froze): the replay misses, coordinates the rest of the step,
    and the results equal coordinating every step."""
    def script(rank, step):
        if step >= 7:
            return None
        return ["w0", "b0", "b2"] if step in (2, 5) else list(SHAPES)
    rep = run(3, script)
    coord = run(3, script, cfg={"replay": False})
    assert_same(rep, coord)
    # steps 0, 3 and 6 record, 1 and 4 replay, 2 and 5 miss and coordinate the rest
    assert [r[2] for r in rep] == [2, 2, 2]


def test_extra_gradient_in_a_replayed_step_falls_back():
    """Steps 0-1 leave out w1 (whole lane buckets, so step 0 records); step 2 brings it
    back on every rank: a collective outside the schedule, so the replay misses."""
    def script(rank, step):
        return None if step >= 3 else (["w0", "b0", "b1", "b2"] if step < 2 else list(SHAPES))
    rep = run(3, script)
    assert_same(rep, run(3, script, cfg={"replay": False}))
    assert [r[2] for r in rep] == [1, 1, 1]


@pytest.mark.parametrize("rank,name", [(1, "w1"), (2, "b1")])  # compressed; lane member
def test_gradient_sets_differing_across_ranks_raise_on_every_rank(rank, name):
    def script(r, step):
        if step >= 3:
            return None
        return [k for k in SHAPES if not (step == 2 and r == rank and k == name)]
    res = run(3, script)
    for r in range(3):
        assert isinstance(res[r], GradientMismatchError), res[r]
        assert f"rank {rank} did not submit ['{name}']" in str(res[r])


@pytest.mark.parametrize("threads", [True, False])
def test_compressor_error_during_replay_is_named_on_every_rank(threads):
    def hook(eng, rank, step):
        if rank == 1 and step == 2:
            def boom(*a, **k):
                raise RuntimeError("injected encode failure")
            eng.compressor.encode_round = boom
    res = run(3, steps(4), threads=threads, hook=hook)
    assert isinstance(res[1], EngineError) and "injected encode failure" in str(res[1])
    for r in (0, 2):
        assert isinstance(res[r], EngineError), res[r]
        assert res[r].failed_step == 2 and "rank 1" in str(res[r])
        if threads:  # from the coordinated round the replay fell back to; without threads
            # the failing rank raises at its next submit and its peers see it leave
            assert "an error occurred on rank 1" in str(res[r])


@pytest.mark.parametrize("threads", [True, False])
def test_nan_during_replay_raises_on_every_rank(threads):
    def hook(eng, rank, step):
        if rank == 1 and step == 2:
            orig = eng.submit

            def submit(name, t):
                if name == "b1":
                    t[0] = float("nan")
                return orig(name, t)
            eng.submit = submit
    res = run(3, steps(4), threads=threads, hook=hook)
    assert isinstance(res[1], ValueError) and "NaN" in str(res[1])
    for r in (0, 2):
        assert isinstance(res[r], EngineError), res[r]
        assert "an error occurred on rank 1 (gradient 'b1')" in str(res[r])
        assert res[r].failed_step == 2


def test_nan_skip_during_replay_skips_the_step_everywhere():
    def hook(eng, rank, step):
        if rank == 2 and step == 2:
            orig = eng.submit

            def submit(name, t):
                if name == "w1":
                    t[3, 3] = float("inf")
                return orig(name, t)
            eng.submit = submit
        elif step == 3:
            eng.submit = type(eng).submit.__get__(eng)
    res = run(3, steps(5), cfg={"nonfinite": "skip"}, hook=hook)
    for r in range(3):
        assert not isinstance(res[r], BaseException), res[r]
        assert res[r][1] == [True, True, False, True, True]
        assert res[r][2] == 4  # the skipped step was replayed too


def test_dead_rank_during_replay_is_named_by_every_survivor():
    def script(rank, step):
        if step >= 4 or (rank == 2 and step == 2):
            return None  # rank 2 stops taking part after two steps
        return list(SHAPES)
    res = run(3, script, cfg={"timeout": 3})
    for r in (0, 1):
        assert isinstance(res[r], (PeerError, EngineError)), res[r]
        assert "rank 2" in str(res[r])


def test_schedule_and_status_words():
    s = Schedule.of([[(5, 3, torch.float32), (6, 2, torch.float16), (7, 1, torch.float32)]])
    assert [(dt, [m[0] for m in ms]) for dt, ms in dtype_groups(s.buckets[0])] == [
        (torch.float32, [5, 7]), (torch.float16, [6])]
    words = sum(status_tensor(e, m, k, torch.bfloat16, torch.device("cpu"))
                for e, m, k in [(False, False, False)] * 300 + [(False, True, False)])
    assert read_status(words) == (False, True, False)


def test_shared_words_give_every_rank_the_same_means_or_none():
    """``status_tensor``'s shared words summed over ranks: ``read_shared`` gives the
    means (to ``SHARE_UNIT``), exactly, in any order of summation; None when a rank
    shared nothing, shared a value out of range (0 .. ``SHARE_MAX``), or the words are
    bfloat16."""
    cpu = torch.device("cpu")
    shares = [(0.0712345, 0.08), (0.069, 0.0801), (0.2, 0.07), (0.0650001, 0.09)]

    def words(shares, dtype=torch.float32):
        return [status_tensor(False, False, False, dtype, cpu, s) for s in shares]

    fwd = sum(words(shares))
    back = sum(reversed(words(shares)))
    assert torch.equal(fwd, back) and read_status(fwd) == (False, False, False)
    got = read_shared(fwd, 4)
    want = [sum(round(s[i] / SHARE_UNIT) for s in shares) * SHARE_UNIT / 4 for i in (0, 1)]
    assert got == tuple(want) and got[0] == pytest.approx(0.1013087, abs=1e-6)
    assert read_shared(sum(words(shares[:3] + [None])), 4) is None  # one rank shared nothing
    assert read_shared(sum(words(shares[:3] + [(float("nan"), 0.1)])), 4) is None
    assert read_shared(sum(words(shares[:3] + [(-0.1, 0.1)])), 4) is None
    assert read_shared(sum(words(shares, torch.bfloat16)), 4) is None  # too narrow to carry
    assert read_shared(sum(words([(5.0, 12.5)] * 4)), 4) == (5.0, 12.5)  # seconds-long steps
    assert read_shared(sum(words([(20.0, 0.1)] * 4)), 4) is None  # past SHARE_MAX
    assert read_shared(sum(words(shares[:2] + [(0.1, 0.1, 0.1)] + shares[3:])), 4) is None


def test_engine_share_rides_a_replayed_step_and_is_the_same_on_every_rank():
    """``Engine.share`` before a step, ``Engine.shared`` after it: the ranks' means
    when the step replayed its schedule, None after the coordinated first step (it
    records the schedule) and when some rank shared nothing."""
    seen = {}

    def hook(eng, rank, step):
        seen.setdefault(rank, []).append(eng.shared())  # what the step before carried
        eng.share(None if (step == 3 and rank == 1) else (0.01 * (rank + 1), 0.5))

    def script(rank, step):
        return list(SHAPES) if step < 6 else None

    res = run(3, script, hook=hook)
    for r in res:
        assert not isinstance(r, BaseException), r
    assert seen[0] == seen[1] == seen[2]
    got = seen[0]
    # step 0: nothing before; step 1: the first step was coordinated; from step 2 on the
    # step before replayed; step 4 sees step 3's, where rank 1 shared nothing
    assert got[0] is None and got[1] is None and got[4] is None
    for s in (2, 3, 5):
        assert got[s] == pytest.approx((0.02, 0.5), abs=1e-6), (s, got[s])
