"""DistributedOptimizer and the DDP hook on real ranks (gloo on loopback, run_workers).

Reference checks: after every step all ranks hold bitwise-identical
parameters (every compressor, PS and Ring); with no compression the
averaged gradient equals an exact allreduce average; a checkpointed run
resumed at step k reproduces the uninterrupted losses exactly; a rank that
dies makes the others fail with an error naming it. The 3-rank tests whose ranks
all return share one launch (``shared_launch``: ``_shared()`` runs each of
``SHARED``'s workers in turn, each building and closing its own optimizers); the
checkpoint tests share one 2-rank launch; a crash launches its own.
"""
import functools
import hashlib
import os

import pytest
import torch
import torch.nn.functional as F
from shared_launch import ranks, run_shared  # tests/multiprocess is on sys.path (rootdir)
from torch import nn

import hipress_like as hp
import hipress_like.torch as hpt
from hipress_like.cost_model import Plan, SizeRule
from hipress_like.launch.launch import WorkerError, run_workers

# the first test of the shared launch runs every worker of SHARED in it
pytestmark = pytest.mark.timeout(1200)
_ALIASES = {"none", "ef", "error_feedback"}


def _compressors():
    return [n for n in hp.compressors.available() if n not in _ALIASES]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 24), nn.ReLU(), nn.Linear(24, 3))


def _batch(rank, step, n=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _plan(name, strategy):
    # Compress every gradient, in several partitions, so every code path runs.
    return Plan(compressor=name, strategy=strategy,
                rule=SizeRule(min_compress_bytes=0, bytes_per_partition=256))


def _digest(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _build(name, strategy="ps", **kw):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=name, strategy=strategy,
                                   plan=_plan(name, strategy), **kw)
    return model, opt


def _train(model, opt, rank, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(hpt.allreduce(loss.detach(), name="loss").item())
    return losses


# -- workers (module level: run_workers imports them by name) ----------------------------

def identical_worker(ctx, names):
    hpt.init()
    out = {}
    init = _digest(_model())
    for name in names:
        for strategy in ("ps", "ring"):
            model, opt = _build(name, strategy)
            _train(model, opt, ctx.rank, steps=3)
            out[f"{name}/{strategy}"] = _digest(model)
            assert out[f"{name}/{strategy}"] != init, f"{name}/{strategy}: nothing was learned"
            opt.close()
    for worker, master in _bidirectional():  # compression_back: the aggregate's own codec
        for strategy in ("ps", "ring"):
            model, opt = _build(worker, strategy, compression_back=master)
            _train(model, opt, ctx.rank, steps=3)
            out[f"{worker}/{master}/{strategy}"] = _digest(model)
            opt.close()
    return out


def _bidirectional():
    return [("terngrad", "onebit"), ("natural", "natural")]


def collective_worker(ctx):
    """DistributedOptimizer(collective=...): ART-Tree, Allgather top-k, and the selector's
    picks (collective="auto", measured on these ranks' own links)."""
    hpt.init()
    out = {}
    for name, coll in (("star_topk", "tree"), ("topk", "allgather"), ("star_topk", "auto")):
        model, opt = _build(name, collective=coll)
        _train(model, opt, ctx.rank, steps=3)
        picked = tuple(sorted(set(opt.engine.collectives.values())))
        out[f"{name}/{coll}"] = (_digest(model), picked)
        opt.close()
    return out


def exact_average_worker(ctx):
    """Identity compression: p.grad equals the exact allreduce average of local grads."""
    import torch.distributed as dist

    hpt.init()
    model, opt = _build("identity", "ring")
    ref = _model()
    for step in range(2):
        x, y = _batch(ctx.rank, step)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        expected = []
        for p in ref.parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            expected.append(g / ctx.size)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-7)
        with opt.skip_synchronize():
            opt.step()
    opt.close()
    return _digest(model)


def scenarios_worker(ctx):
    """Accumulation, rank-dependent unused branches, requires_grad toggling, LBFGS."""
    hpt.init()
    r = ctx.rank
    out = {}
    # 1. gradient accumulation over 2 passes
    model, opt = _build("topk", backward_passes_per_step=2)
    for step in range(3):
        opt.zero_grad()
        for k in range(2):
            x, y = _batch(r, 10 * step + k)
            F.cross_entropy(model(x), y).backward()
        opt.step()
    out["accumulate"] = _digest(model)
    opt.close()

    # 2. a branch only rank 0 uses: the others submit zeros for it
    torch.manual_seed(0)
    trunk, branch = nn.Linear(4, 4), nn.Linear(4, 4)
    named = [("trunk." + n, p) for n, p in trunk.named_parameters()] + \
            [("branch." + n, p) for n, p in branch.named_parameters()]
    opt = hpt.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                                   named_parameters=named, compression="identity")
    before = branch.weight.detach().clone()
    for step in range(2):
        opt.zero_grad()
        h = trunk(torch.randn(3, 4, generator=torch.Generator().manual_seed(step * 7 + r)))
        if r == 0:
            h = branch(h)
        h.sum().backward()
        opt.step()
    assert not torch.equal(branch.weight, before)  # rank 0's gradient reached everyone
    out["branch"] = hashlib.sha256(torch.cat([trunk.weight.reshape(-1),
                                              branch.weight.reshape(-1)]).detach()
                                   .numpy().tobytes()).hexdigest()
    opt.close()

    # 3. GAN-style: two optimizers, alternating requires_grad
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    g_opt = hpt.DistributedOptimizer(torch.optim.Adam(gen.parameters(), lr=0.01),
                                     named_parameters=gen.named_parameters(),
                                     compression="dgc")
    d_opt = hpt.DistributedOptimizer(torch.optim.Adam(disc.parameters(), lr=0.01),
                                     named_parameters=disc.named_parameters(),
                                     compression="topk")
    for step in range(3):
        z = torch.randn(5, 4, generator=torch.Generator().manual_seed(step * 11 + r))
        for p in disc.parameters():
            p.requires_grad_(True)
        d_opt.zero_grad()
        disc(gen(z).detach()).mean().backward()
        d_opt.step()
        for p in disc.parameters():
            p.requires_grad_(False)
        g_opt.zero_grad()
        (-disc(gen(z)).mean()).backward()
        g_opt.step()
    out["gan"] = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in
                                           [*gen.parameters(), *disc.parameters()]])
                                .numpy().tobytes()).hexdigest()
    g_opt.close()
    d_opt.close()

    # 4. LBFGS: closures synchronised and losses averaged, so line searches agree
    model = _model()
    opt = hpt.DistributedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5),
                                   named_parameters=model.named_parameters())
    x, y = _batch(r, 0)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    for _ in range(2):
        opt.step(closure)
    out["lbfgs"] = _digest(model)
    opt.close()
    return out


def resume_worker(ctx, name, tmpdir, k, n):
    hpt.init()
    r = ctx.rank
    model, opt = _build(name)
    uninterrupted = _train(model, opt, r, k)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
               os.path.join(tmpdir, f"{name}.rank{r}.pt"))
    everyone = opt.state_dict(all_ranks=True)  # collective: one file resumes every rank
    if r == 0:
        torch.save({"model": model.state_dict(), "opt": everyone},
                   os.path.join(tmpdir, f"{name}.all.pt"))
    uninterrupted += _train(model, opt, r, n - k, start=k)
    opt.close()
    resumed = {}
    for kind in ("rank", "all"):
        hpt.barrier()
        path = os.path.join(tmpdir, f"{name}.rank{r}.pt" if kind == "rank" else f"{name}.all.pt")
        ck = torch.load(path, weights_only=True)
        model, opt = _build(name)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        resumed[kind] = _train(model, opt, r, n - k, start=k)
        opt.close()
    return uninterrupted[k:], resumed


def resume_every_worker(ctx, names, tmpdir, k, n):
    """``resume_worker`` for each of ``names`` in turn: one launch serves every compressor."""
    return {name: resume_worker(ctx, name, tmpdir, k, n) for name in names}


def crash_worker(ctx, collective=None):
    hpt.init()
    name = "star_topk" if collective else "onebit"
    model, opt = _build(name, timeout=20.0, collective=collective)
    for step in range(100):
        if ctx.rank == 1 and step == 3:
            os._exit(7)  # a hard crash: no exception, no goodbye
        _train(model, opt, ctx.rank, 1, start=step)
    return "finished"


def ddp_worker(ctx, names):
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    hpt.init()
    out = {}
    for name in [None, *names]:
        model = _model()
        ddp = DDP(model)
        state = None
        if name is not None:
            state = hpt.CaSyncHookState(ddp, compression=name, plan=_plan(name, "ps"))
            ddp.register_comm_hook(state, hpt.casync_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            x, y = _batch(ctx.rank, step)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        out[str(name)] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if state is not None:
            state.close()
        del ddp
        gc.collect()
    return out


def fused_worker(ctx):
    """step() with PowerSGD layers: the fused decode-and-SGD sweep against the same steps
    taken through synchronize() + skip_synchronize() (which arm nothing): parameters,
    momentum buffers and gradients bit for bit, for plain, Nesterov-with-decay and
    ``maximize`` groups and a step skipped for NaN; and how many sweeps ran."""
    from hipress_like.adapters.torch import fused_update

    hpt.init()
    calls = []
    real = fused_update._c.psgd_lowrank_sgd

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    fused_update._c.psgd_lowrank_sgd = counting
    out = {}
    groups = {"plain": {}, "nesterov+decay": dict(nesterov=True, weight_decay=1e-3),
              "maximize+dampening": dict(maximize=True, dampening=0.1),
              "skip": {}}  # step 2 is NaN on rank 0 and skipped: the gradients stay written
    try:
        for tag, kw in groups.items():
            skip = dict(nonfinite="skip") if tag == "skip" else {}
            digests = []
            for by_hand in (False, True):
                model = _model()
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **kw)
                opt = hpt.DistributedOptimizer(
                    opt, named_parameters=model.named_parameters(), compression="powersgd",
                    strategy="ring",
                    plan=Plan(compressor="powersgd", strategy="ring",
                              rule=SizeRule(min_compress_bytes=0)), **skip)
                del calls[:]
                for step in range(5):
                    x, y = _batch(ctx.rank, step)
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    if skip and step == 2 and ctx.rank == 0:
                        loss = loss * float("nan")
                    loss.backward()
                    if by_hand:
                        opt.synchronize()
                        with opt.skip_synchronize():
                            opt.step()
                    else:
                        opt.step()
                bufs = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                                  for p in model.parameters()])
                grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                digests.append((_digest(model), hashlib.sha256(bufs.numpy().tobytes()).hexdigest(),
                                hashlib.sha256(grads.numpy().tobytes()).hexdigest(), len(calls)))
                opt.close()
            out[tag] = digests
    finally:
        fused_update._c.psgd_lowrank_sgd = real
    return out


# -- tests -------------------------------------------------------------------------------

def _ddp_names():
    return [n for n in ("identity", "topk", "dgc", "powersgd", "onebit")
            if n in hp.compressors.available()]


SHARED = {"identical": (identical_worker, (_compressors(),)),
          "collective": (collective_worker, ()),
          "exact average": (exact_average_worker, ()),
          "scenarios": (scenarios_worker, ()),
          "ddp": (ddp_worker, (_ddp_names(),)),
          "fused": (fused_worker, ())}


@functools.lru_cache(maxsize=None)
def _shared():
    """{key of SHARED: each rank's ("returned"|"raised", ...)}: one launch of 3 ranks."""
    return dict(zip(SHARED, run_shared(3, list(SHARED.values()), timeout=900)))


def test_replicas_bitwise_identical_every_compressor():
    names = _compressors()
    res = ranks(_shared()["identical"])
    for key in res[0]:
        assert len({r[key] for r in res}) == 1, f"{key}: replicas diverged"
    assert len(res[0]) == 2 * len(names) + 2 * len(_bidirectional())


def test_collective_option_reaches_the_engine_and_keeps_replicas_identical():
    res = ranks(_shared()["collective"])
    for key in res[0]:
        assert len({r[key] for r in res}) == 1, f"{key}: replicas diverged or picked apart"
    assert res[0]["star_topk/tree"][1] == ("tree",)
    assert res[0]["topk/allgather"][1] == ("allgather",)
    assert set(res[0]["star_topk/auto"][1]) <= {"allgather", "ring", "tree"}
    assert res[0]["star_topk/auto"][1], "collective='auto' picked nothing"


def test_fused_update_gives_the_bits_of_decode_then_step():
    res = ranks(_shared()["fused"])
    for tag, (fused, by_hand) in res[0].items():
        assert fused[:3] == by_hand[:3], f"{tag}: the fused step changed a value"
        assert by_hand[3] == 0, f"{tag}: synchronize() by hand armed the fused sweep"
        # four PowerSGD matrices a step (20 in 5 steps here, 16 with the skipped
        # step); a decode may finish before step() arms its gradient, so some, not all
        assert fused[3] >= 5, f"{tag}: only {fused[3]} fused sweeps in 5 steps"
    for r in res[1:]:
        assert r == res[0], "replicas diverged"


def test_identity_equals_exact_average():
    res = ranks(_shared()["exact average"])
    assert len(set(res)) == 1


def test_accumulation_unused_branches_requires_grad_toggling_lbfgs():
    res = ranks(_shared()["scenarios"])
    for key in res[0]:
        assert len({r[key] for r in res}) == 1, f"{key}: replicas diverged"


RESUMED = ["onebit", "terngrad", "dgc", "powersgd"]


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """Each rank's {name: (uninterrupted losses, resumed losses)}, from one 2-rank launch."""
    names = [n for n in RESUMED if n in hp.compressors.available()]
    return run_workers(resume_every_worker, 2,
                       args=(names, str(tmp_path_factory.mktemp("resume")), 3, 6),
                       timeout=300)


@pytest.mark.parametrize("name", RESUMED)
def test_checkpoint_resume_reproduces_losses(name, resumed_runs):
    if name not in hp.compressors.available():
        pytest.skip(f"compressor {name} is not registered in this build")
    for uninterrupted, resumed in (r[name] for r in resumed_runs):
        assert resumed["rank"] == uninterrupted, "per-rank checkpoint"
        assert resumed["all"] == uninterrupted, "state_dict(all_ranks=True) checkpoint"


@pytest.mark.parametrize("collective", [None, "tree"])
def test_crashing_rank_fails_the_others_with_a_clear_error(collective):
    """PS + onebit, and STAR-Topk by ART-Tree (a point-to-point tree over the lane)."""
    with pytest.raises(WorkerError) as info:
        run_workers(crash_worker, 3, args=(collective,), timeout=120, grace=60)
    failures = info.value.failures
    assert "rank 1" in failures[1] or "exit" in failures[1]
    for r in (0, 2):
        text = failures[r]
        assert "[1]" in text or "rank 1" in text, text  # the culprit is named
        assert any(w in text for w in ("PeerError", "EngineError", "TransportError")), text


def test_ddp_hook_matches_ddp_and_keeps_replicas_identical():
    res = ranks(_shared()["ddp"])
    for key in res[0]:
        assert all(torch.equal(res[0][key], r[key]) for r in res), f"{key}: replicas diverged"
    torch.testing.assert_close(res[0]["identity"], res[0]["None"], rtol=1e-5, atol=1e-6)
