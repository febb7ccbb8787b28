"""Partial aggregation's pieces without a job: the settings, the lane's refusal
of compressors that cannot sit a step out and of transports without a store, the
torch store's naming of its dead host (a store server in a subprocess), and THC's
(and error feedback's) decode of a step a rank sat out (``absent_round``), which
must give the contributors' result bit for bit. The protocol itself runs across
processes in tests/multiprocess/test_stragglers.py.
"""
import pytest
import torch

from hipress_like.compressors.base import CONTRIBUTORS
from hipress_like.compressors.payload import PayloadError
from hipress_like.compressors.registry import get
from hipress_like.compressors.thc.thc import BLOCK, THC
from hipress_like.compressors.wrappers.error_feedback import ErrorFeedback
from hipress_like.partial import Quorum, QuorumLane

D = BLOCK + 1234


@pytest.mark.parametrize("kw, match", [
    ({"fraction": 0}, "fraction"), ({"fraction": 1.5}, "fraction"),
    ({"fraction": True}, "fraction"), ({"fraction": "3/4"}, "fraction"),
    ({"deadline": -1.0}, "deadline"), ({"deadline": float("inf")}, "deadline"),
    ({"missing": "drop"}, "missing"), ({"resync_every": -1}, "resync_every"),
    ({"resync_every": 2.5}, "resync_every"), ({"poll": 0}, "poll"),
])
def test_bad_settings_are_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        Quorum(**kw)


@pytest.mark.parametrize("fraction, n, q", [(0.75, 4, 3), (0.9, 10, 9), (1.0, 4, 4),
                                            (0.5, 3, 2), (0.01, 4, 1), (0.7, 10, 7)])
def test_the_quorum_is_the_ceiling_of_the_fraction(fraction, n, q):
    assert Quorum(fraction=fraction).needed(n) == q


def test_a_multi_round_compressor_that_cannot_sit_out_is_refused_before_any_exchange():
    with pytest.raises(ValueError, match="absent_rounds"):
        QuorumLane(get("powersgd"), 100, torch.float32, transport=None, rank=0,
                   size=4, quorum=Quorum())


def test_a_transport_without_a_store_is_refused_with_what_to_use_instead():
    from hipress_like.casync.transport import InProcGroup, NoStoreError

    t = InProcGroup(1).transports[0]
    with pytest.raises(NoStoreError, match="partial aggregation .*HIPRESS_TRANSPORT=torch"):
        QuorumLane(get("identity"), 100, torch.float32, transport=t, rank=0, size=1,
                   quorum=Quorum())


def test_a_store_whose_host_died_names_global_rank_0():
    """The torch transport's store (``C10dStore``) turns a lost connection into a
    ``PeerError`` naming the store's host; its server runs in a process killed here."""
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from hipress_like.casync.transport import PeerError
    from hipress_like.casync.transport.c10d_store import C10dStore

    host = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, torch.distributed as d\n"
         "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
         "print(s.port, flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=30))
        store = C10dStore(dist.PrefixStore("p/", client), host_rank=0, where=f"127.0.0.1:{port}")
        assert store.add("m/0", 3) == 3 and store.add("m/0", 0) == 3
        assert store.compare_set("c/0", "", "5") == b"5"
        assert store.compare_set("c/0", "", "6") == b"5"  # the first writer wins
        assert store.check(["c/0"]) and not store.check(["c/1"])
        assert store.get("c/0") == b"5" and store.delete_key("c/0")
    finally:
        host.kill()
        host.wait()
    with pytest.raises(PeerError, match=r"127\.0\.0\.1:\d+, hosted by global rank 0.*add") as e:
        store.add("m/0", 0)
    assert e.value.ranks == (0,)


def _step(c, grads, members):
    """One step of the lane's rounds by hand: members encode, the others sit out;
    returns every rank's decoded sum and final state."""
    n = len(grads)
    sts = [c.init(g, seed=r, world_size=n, shared_seed=5) for r, g in enumerate(grads)]
    for s in sts:
        if len(members) < n:
            s[CONTRIBUTORS] = len(members)
    agg = None
    for r in range(c.capabilities.rounds):
        pays = {}
        for i in range(n):
            if i in members:
                pays[i], sts[i] = c.encode_round(r, grads[i], sts[i], agg)
            else:
                sts[i] = c.absent_round(r, grads[i], sts[i], agg)
        agg = c.merge_round(r, [pays[i] for i in members])
    done = [c.decode_rounds(grads[i], sts[i], agg) for i in range(n)]
    return [o for o, _ in done], [s for _, s in done]


@pytest.mark.parametrize("make", [lambda: THC(), lambda: THC(transform=False),
                                  lambda: ErrorFeedback(THC())])
def test_a_rank_that_sat_out_decodes_the_contributors_sum_bit_for_bit(make):
    c = make()
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(D, generator=g) for _ in range(4)]
    outs, _ = _step(c, grads, members=(0, 2, 3))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    # the partial sum estimates the three contributors' sum, not all four
    want = grads[0] + grads[2] + grads[3]
    err = float(((outs[0] - want) ** 2).sum() / (want ** 2).sum())
    assert err < 0.1


def test_error_feedback_keeps_the_memory_of_a_rank_that_sat_out():
    c = ErrorFeedback(THC())
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(D, generator=g) for _ in range(4)]
    _, sts = _step(c, grads, members=(0, 1, 2))
    assert torch.count_nonzero(sts[3]["error"]) == 0  # it sent nothing, so lost nothing
    assert torch.count_nonzero(sts[0]["error"]) > 0  # contributors keep their residual
    assert "absent" not in sts[3]  # the next step encodes as usual


def test_a_range_merging_other_than_the_contributors_is_refused():
    c = THC()
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(D, generator=g) for _ in range(4)]
    sts = [c.init(x, seed=r, world_size=4, shared_seed=5) for r, x in enumerate(grads)]
    rng = c.merge_round(0, [c.encode_round(0, x, s, None)[0] for x, s in zip(grads[:3], sts)])
    with pytest.raises(PayloadError, match="merges 3 ranks"):
        c.encode_round(1, grads[0], sts[0], rng)  # no CONTRIBUTORS: all 4 expected
    with pytest.raises(PayloadError, match="merges 3 ranks"):
        c.absent_round(1, grads[3], sts[3], rng)
    sts[0][CONTRIBUTORS] = 3
    c.encode_round(1, grads[0], sts[0], rng)  # declared: accepted


# -- the optimizer face in one process (size 1) ----------------------------------------

@pytest.fixture(scope="module")
def runtime():
    import hipress_like.torch as hpt

    hpt.init()
    yield hpt
    hpt.shutdown()


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _train(opt, model, until):
    """Train until ``until`` steps were applied (``opt.steps``, or counted here for a
    plain optimizer); batch k is the same whichever optimizer applies step k."""
    done = 0
    while (opt.steps if hasattr(opt, "steps") else done) < until:
        k = opt.steps if hasattr(opt, "steps") else done
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        done += 1


def test_one_rank_without_compression_reproduces_the_plain_optimizer_bitwise(runtime):
    hpt = runtime
    ref = _model()
    _train(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), ref, 4)
    m = _model()
    opt = hpt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=m.named_parameters(),
                                   stragglers=hpt.Quorum(deadline=0.0))
    assert isinstance(opt, torch.optim.SGD)
    _train(opt, m, 4)
    assert opt.steps == 4
    for a, b in zip(ref.parameters(), m.parameters()):
        assert torch.equal(a, b)
    c = opt.stragglers()
    assert (c["applied"], c["contributed"], c["dropped"], c["partial"]) == (4, 4, 0, 0)
    sd = opt.state_dict()
    opt.close()
    again = hpt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=m.named_parameters(), stragglers=True)
    again.load_state_dict(sd)
    assert again.steps == 4  # the loop resumes where it stopped
    _train(again, m, 6)
    assert again.steps == 6
    again.close()


def test_bad_options_are_refused_before_any_exchange(runtime):
    hpt = runtime
    m = _model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="absent_rounds"):
        hpt.DistributedOptimizer(sgd, compression=hpt.Compression.powersgd,
                                 stragglers=hpt.Quorum())
    with pytest.raises(TypeError, match="Quorum"):
        hpt.DistributedOptimizer(sgd, stragglers="yes")
    with pytest.raises(ValueError, match="compression_back"):
        hpt.DistributedOptimizer(sgd, stragglers=True, compression_back=hpt.Compression.natural)
    with pytest.raises(ValueError, match="Average"):
        hpt.DistributedOptimizer(sgd, stragglers=True, op=hpt.Sum)
    opt = hpt.DistributedOptimizer(sgd, stragglers=True, compression=hpt.Compression.thc)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(NotImplementedError, match="step"):
        opt.synchronize()
    with pytest.raises(ValueError, match="already"):
        hpt.DistributedOptimizer(opt, stragglers=True)
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


def test_a_step_no_rank_can_contribute_to_is_skipped_not_waited_for(runtime):
    hpt = runtime
    m = _model()
    opt = hpt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=m.named_parameters(),
                                   stragglers=hpt.Quorum(), timeout=30)
    _train(opt, m, 2)
    before = [p.detach().clone() for p in m.parameters()]
    state = {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.state.values())}
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    m[0].weight.grad[0, 0] = float("inf")
    opt.step()  # the only rank abstains: the step closes at once, empty, and is skipped
    assert opt.steps == 3
    for a, b in zip(before, m.parameters()):
        assert torch.equal(a, b)
    for k, v in enumerate(opt.state.values()):
        assert torch.equal(v["momentum_buffer"], state[k])
    c = opt.stragglers()
    assert (c["nonfinite"], c["sat_out"], c["contributed"]) == (1, 1, 2)
    _train(opt, m, 4)  # and training goes on
    assert opt.steps == 4
    opt.close()
