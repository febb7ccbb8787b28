"""Checkpoints on real ranks (gloo on loopback): bit-exact resume, and N -> M resharding.

Resume: a job trains K steps, ``hpt.save_checkpoint``, trains K more; fresh
processes ``hpt.load_checkpoint`` and train the same last K steps. The
parameters, the optimizer state and the compressor state (everything in
``optimizer.state_dict()``, hashed canonically) end bitwise equal, on every
rank, for every built-in compressor family under PS and Ring, PowerSGD at
3 and 4 ranks, and partial aggregation (``stragglers=hpt.Quorum``). The
default tier runs a few representative cases; the full matrix is ``slow``.
(The loss-only resume test of test_torch_optimizer.py stays as it is; the
model, batches and plans are taken from there.)

Reshard: a checkpoint saved on 4 ranks is loaded on 2 and one from 2 on 4;
every new rank's error-feedback memory equals (1/N) sum_i e_i of the saved
ranks exactly, PowerSGD's Q is the saved one, the states that cannot be
resharded are named in a ``CompressorStateReset`` warning and absent, and
training goes on with bitwise-identical replicas.
"""
import copy
import hashlib
import io
import os
import re
import warnings

import pytest
import torch
from test_torch_optimizer import _model, _plan, _train  # the same model, batches, plans

import hipress_like as hp
import hipress_like.torch as hpt
from hipress_like.adapters.checkpoint_io import read_verified
from hipress_like.launch.launch import run_workers

K = 3


def _case_name(case):
    return "-".join(str(c) for c in case)


def _build(case):
    """(model, optimizer) for a case: (compressor, strategy) or ("quorum", compressor)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if case[0] == "quorum":  # partial aggregation through the public API; fraction 1.0
        # waits for every rank, so which ranks contribute is the same in both runs
        return model, hpt.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), compression=case[1],
            stragglers=hpt.Quorum(fraction=1.0))
    name, strategy = case
    return model, hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=name, strategy=strategy,
                                           plan=_plan(name, strategy))


def _walk(obj, h):
    """A canonical hash of nested dicts/lists/tensors/scalars (dict keys sorted)."""
    if isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=str):
            h.update(repr(k).encode())
            _walk(obj[k], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _walk(v, h)
        h.update(b"]")
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(obj).encode())


def _record(model, opt):
    """Digests of the parameters, the optimizer state and the compressor state."""
    sd = opt.state_dict()
    hip = sd.pop("hipress", None)
    # the partial-aggregation lane's counters (opt.stragglers()) count what this process
    # saw, and start at 0 in a resumed one: statistics, not state; everything else counts
    (hip.get("engine") or {}).pop("counters", None)
    out = {}
    for key, obj in (("params", list(model.parameters())), ("optimizer", sd),
                     ("compressor", hip)):
        h = hashlib.sha256()
        _walk(obj, h)
        out[key] = h.hexdigest()
    return out


def _path(tmpdir, case):
    return os.path.join(tmpdir, f"{_case_name(case)}.pt")


# -- workers (module level: run_workers imports them by name) ----------------------------

def straight_worker(ctx, cases, tmpdir):
    """Train K steps, checkpoint, train K more: the uninterrupted records."""
    hpt.init()
    out = {}
    for case in cases:
        model, opt = _build(case)
        _train(model, opt, ctx.rank, K)
        hpt.save_checkpoint(_path(tmpdir, case), model, opt, step=K)
        _train(model, opt, ctx.rank, K, start=K)
        out[_case_name(case)] = _record(model, opt)
        opt.close()
    return out


def resumed_worker(ctx, cases, tmpdir):
    """Fresh processes: load the checkpoint, train the last K steps."""
    hpt.init()
    out = {}
    for case in cases:
        model, opt = _build(case)
        extra = hpt.load_checkpoint(_path(tmpdir, case), model, opt)
        _train(model, opt, ctx.rank, K, start=extra["step"])
        out[_case_name(case)] = _record(model, opt)
        opt.close()
    return out


def _check_resume(cases, nprocs, tmp_path, timeout):
    missing = {c[1] if c[0] == "quorum" else c[0] for c in cases} - set(
        hp.compressors.available())
    assert not missing, f"built-in compressors not registered: {sorted(missing)}"
    straight = run_workers(straight_worker, nprocs, args=(cases, str(tmp_path)),
                           timeout=timeout)
    resumed = run_workers(resumed_worker, nprocs, args=(cases, str(tmp_path)),
                          timeout=timeout)
    for case in map(_case_name, cases):
        assert len({s[case]["params"] for s in straight}) == 1, f"{case}: replicas diverged"
        for r, (s, z) in enumerate(zip(straight, resumed)):
            for what in ("params", "optimizer", "compressor"):
                assert z[case][what] == s[case][what], \
                    f"{case}, rank {r}: {what} differ after the resume"


FAMILIES = ["onebit", "tbq", "terngrad", "dgc", "graddrop", "topk", "natural", "thc",
            "powersgd", "star_topk", "var_topk"]


def test_resume_is_bitwise_exact_representative_cases(tmp_path):
    _check_resume([("onebit", "ps"), ("powersgd", "ring"), ("quorum", "onebit")], 2,
                  tmp_path, timeout=240)


@pytest.mark.slow
def test_resume_is_bitwise_exact_every_family_ps_and_ring(tmp_path):
    cases = [(n, s) for n in FAMILIES for s in ("ps", "ring")]
    cases += [("quorum", n) for n in ("onebit", "topk", "terngrad", "natural")]
    _check_resume(cases, 2, tmp_path, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [3, 4])
def test_resume_is_bitwise_exact_powersgd_at_3_and_4_ranks(tmp_path, nprocs):
    _check_resume([("powersgd", "ps"), ("powersgd", "ring")], nprocs, tmp_path, timeout=600)


# -- N -> M ------------------------------------------------------------------------------

def save_worker(ctx, cases, tmpdir):
    hpt.init()
    for case in cases:
        model, opt = _build(case)
        _train(model, opt, ctx.rank, K)
        hpt.save_checkpoint(_path(tmpdir, case), model, opt, step=K)
        opt.close()


def reshard_worker(ctx, cases, src, dst):
    """Load ``src`` on another world size: the resharded states and the warnings; then
    K steps, saved to ``dst`` (the next leg of the test loads it on yet another size)."""
    hpt.init()
    out = {}
    for case in cases:
        model, opt = _build(case)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = hpt.load_checkpoint(_path(src, case), model, opt)
        # a copy: training reuses the state's buffers in place (PowerSGD's error)
        loaded = copy.deepcopy(opt.state_dict()["hipress"]["engine"]["states"])
        _train(model, opt, ctx.rank, K, start=extra["step"])
        hpt.save_checkpoint(_path(dst, case), model, opt, step=extra["step"] + K)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[_case_name(case)] = {
            "states": loaded, "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}
        opt.close()
    return out


def _saved_engines(path):
    blob = torch.load(io.BytesIO(read_verified(path)), weights_only=True)
    return blob["optimizer"]["hipress"]["engines"]


def _mean_of(old, n):
    """e'_j = (1/N) sum_i e_i, summed in rank order (written out here, not imported)."""
    want = old[0].clone()
    for o in old[1:]:
        want.add_(o)
    return want.div_(n)


def _check_fields(got, old, n, m, where):
    """Every field of a resharded state against the N saved ones."""
    assert set(got) == set(old[0]), where
    for f, v in got.items():
        vals = [o[f] for o in old]
        if isinstance(v, dict):
            _check_fields(v, vals, n, m, f"{where}.{f}")
        elif f in ("error", "error_p", "residual", "u", "v"):  # error-feedback memories
            if vals[0] is None:
                assert v is None, (where, f)
            else:
                assert torch.equal(v, _mean_of(vals, n)), (where, f)
        elif f == "q":  # PowerSGD's warm start: equal on every saved rank, carried over
            assert all(torch.equal(x, vals[0]) for x in vals) and torch.equal(v, vals[0])
        elif f == "world_size":
            assert v == m, (where, f)


def _check_resharded(res, src, n, m, *, all_resharded, none_resharded):
    """What ``reshard_worker`` reported on M ranks, against the N-rank files in ``src``:
    every saved state is either resharded by the rule or named in the warning."""
    for case in RESHARD_CASES:
        name = _case_name(case)
        assert len({r[name]["digest"] for r in res}) == 1, f"{name}: replicas diverged"
        saved = _saved_engines(_path(src, case))
        every = sorted(set().union(*(e["states"] for e in saved)))
        assert every, f"{name}: nothing was saved"
        for j, r in enumerate(res):
            got = r[name]
            for k in every:
                if k in got["states"]:
                    _check_fields(got["states"][k], [e["states"][k] for e in saved], n, m,
                                  f"{name} {n}->{m} rank {j} {k}")
                else:
                    (w,) = got["warnings"]
                    assert w.startswith("CompressorStateReset: ")
                    assert f"saved with {n} ranks" in w and re.search(re.escape(k) + "[, ]", w), \
                        f"{name}: reset state {k} is not named"
            if name in all_resharded:  # every rank encodes every gradient whole
                assert set(got["states"]) == set(every) and not got["warnings"], name
            if name in none_resharded:  # PS memories depend on which rank aggregates what
                assert got["states"] == {}, f"{name}: a PS memory was loaded on {m} ranks"


RESHARD_CASES = [("powersgd", "ring"), ("onebit", "ps"), ("thc", "ps")]


EXPECT = {"all_resharded": {"powersgd-ring"}, "none_resharded": {"onebit-ps"}}


def test_reshard_4_to_2_to_4_averages_error_feedback_keeps_q_and_names_what_it_resets(
        tmp_path):
    legs = [str(tmp_path / d) for d in ("n4", "m2", "m4")]
    for d in legs:
        os.mkdir(d)
    run_workers(save_worker, 4, args=(RESHARD_CASES, legs[0]), timeout=240)
    res = run_workers(reshard_worker, 2, args=(RESHARD_CASES, legs[0], legs[1]), timeout=240)
    _check_resharded(res, legs[0], 4, 2, **EXPECT)
    res = run_workers(reshard_worker, 4, args=(RESHARD_CASES, legs[1], legs[2]), timeout=240)
    _check_resharded(res, legs[1], 2, 4, **EXPECT)


def quorum_reshard_worker(ctx, src):
    """A per-rank (partial aggregation) checkpoint on another world size: the model
    loads, the compressor state starts fresh with a warning saying why, training goes on."""
    hpt.init()
    case = ("quorum", "onebit")
    model, opt = _build(case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = hpt.load_checkpoint(_path(src, case), model, opt)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    loaded = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    _train(model, opt, ctx.rank, K, start=extra["step"])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt.close()
    return {"loaded": loaded, "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


@pytest.mark.slow
def test_partial_aggregation_checkpoint_on_another_world_size_starts_fresh_and_says_why(
        tmp_path):
    run_workers(save_worker, 2, args=([("quorum", "onebit")], str(tmp_path)), timeout=240)
    assert sorted(os.listdir(tmp_path)) == ["quorum-onebit.rank0.pt", "quorum-onebit.rank1.pt"]
    res = run_workers(quorum_reshard_worker, 4, args=(str(tmp_path),), timeout=240)
    assert len({r["loaded"] for r in res}) == 1 and len({r["digest"] for r in res}) == 1
    for r in res:
        (w,) = r["warnings"]
        assert w.startswith("CompressorStateReset: ") and "saved with 2 ranks" in w
        assert "one rank's state only" in w
