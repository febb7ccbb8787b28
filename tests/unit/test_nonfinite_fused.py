"""The NaN/Inf scan fused into each compressor's first pass (``Capabilities.checks_finite``).

Two properties are pinned. (1) Each compressor that declares the
capability raises ``NonFiniteError`` (a ``ValueError``) from its own encode
pass even inside ``assume_finite`` (where ``check_gradient`` scans
nothing), for a NaN, +Inf or -Inf at the first, a middle and the last
element (vectorised loops have a head, a body and a tail), and leaves the
state it was given bitwise as it was. (2) The engine, in the modes that
undo a step ("propagate", "skip"), does not scan such a gradient itself
and still undoes the step on every rank, as ``test_nonfinite.py`` pins for
the pre-scanned path; "raise" still raises from ``submit``.
"""
import pytest
import test_nonfinite as nf  # the engine-run helper, beside this file
import torch

import hipress_like.casync.engine as engine_mod
from hipress_like.casync.engine import Engine
from hipress_like.casync.nonfinite import snapshot
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.compressors import compll, get
from hipress_like.compressors.base import (
    STEP_SEED,
    Capabilities,
    NonFiniteError,
    assume_finite,
)
from hipress_like.compressors.compll import program_path
from hipress_like.compressors.wrappers.error_feedback import ErrorFeedback

BAD = [float("nan"), float("inf"), float("-inf")]
# 67 x 61 = 4087 elements: not a multiple of 8, 32 or THC's block, so the last
# element falls in each kernel's scalar tail and the middle one in its vector body
SHAPE = (67, 61)
WHERE = [0, (SHAPE[0] * SHAPE[1]) // 2 + 3, SHAPE[0] * SHAPE[1] - 1]

# DGC at ratio 0.05 and GradDrop sample their thresholds on SHAPE, so float32
# takes their one pass (sparse/accumulators.py); DGC at its default ratio
# thresholds exactly, in torch, after a scan
FUSED = [("onebit", {}), ("tbq", {}), ("terngrad", {}), ("thc", {}),
         ("thc", {"transform": False}), ("natural", {}), ("dithering", {}),
         ("powersgd", {"rank": 1}), ("powersgd", {"rank": 2}),
         ("dgc", {"ratio": 0.05}), ("dgc", {}), ("graddrop", {"ratio": 0.1}), ("graddrop", {}),
         ("topk", {}), ("star_topk", {}), ("var_topk", {})]


def _same(x, y):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y) or (x.is_floating_point() and torch.equal(
            torch.nan_to_num(x, 1.0, 2.0, 3.0), torch.nan_to_num(y, 1.0, 2.0, 3.0)))
    elif isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            _same(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            _same(u, v)
    else:
        assert x == y


def _warm_state(c, g):
    """A state after one finite step (error memory, Q, step counters all set)."""
    st = c.init(g, seed=3, world_size=1)
    if c.capabilities.shared_randomness:
        st[STEP_SEED] = 11
    if c.capabilities.rounds == 1:
        _, st = c.encode(g, st)
        return st
    agg = None
    for r in range(c.capabilities.rounds):  # one rank's own step: its payloads as the sums
        p, st = c.encode_round(r, g, st, agg)
        agg = c.merge_round(r, [p]) if c.capabilities.aggregatable else p
    _, st = c.decode_rounds(g.clone(), st, agg, out=g.clone())
    return st


def _encode_first(c, g, st):
    if c.capabilities.rounds == 1:
        return c.encode(g, st)
    return c.encode_round(0, g, st, None)


@pytest.mark.parametrize("name,params", FUSED)
def test_the_capability_is_declared(name, params):
    c = get(name, **params)
    assert c.capabilities.checks_finite
    assert ErrorFeedback(c).capabilities.checks_finite  # the wrapper's inner pass checks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name,params", FUSED)
def test_the_first_pass_finds_nan_and_inf_and_leaves_the_state(name, params, where, bad, dtype):
    c = get(name, **params)
    gen = torch.Generator().manual_seed(where)
    g = torch.randn(SHAPE, generator=gen, dtype=dtype)
    st = _warm_state(c, g)
    before = snapshot(st)
    # the state as the engine hands it over: double buffered where the compressor
    # can (PowerSGD writes M into a second buffer; nonfinite.py)
    use = c.detach_state(st, None) or st
    x = torch.randn(SHAPE, generator=gen, dtype=dtype)
    x.view(-1)[where] = bad
    with assume_finite(), pytest.raises(NonFiniteError, match="NaN or Inf"):
        _encode_first(c, x, use)
    _same(st, before)
    x.view(-1)[where] = 0.5  # the state then encodes a finite gradient
    with assume_finite():
        _encode_first(c, x, st)


@pytest.mark.parametrize("interp", [False, True], ids=["c", "interp"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("program", ["onebit", "tbq", "terngrad", "dgc", "graddrop"])
def test_compll_programs_find_nan_and_inf_in_their_c_or_scan_without_it(program, where,
                                                                         interp):
    """The generated C tests NaN/Inf in its sweep over the gradient; the interpreter
    (no C) scans, inside ``assume_finite`` too, since the engine leaves it the scan."""
    cls = compll.register_dsl(program_path(program), name=f"{program}_scanfuse_test",
                              replace=True)
    if interp:
        cls.native = False
    c = get(f"{program}_scanfuse_test")
    assert c.capabilities.checks_finite
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(where))
    _, st = c.encode(g, c.init(g, seed=2))
    before = snapshot(st)
    for bad in BAD:
        x = g.clone()
        x.view(-1)[where] = bad
        with assume_finite(), pytest.raises(NonFiniteError):
            c.encode(x, st)
        _same(st, before)


@pytest.mark.parametrize("where", WHERE)
def test_error_feedback_over_a_fused_kernel_raises_inside_assume_finite(where):
    """onebit's fused compensation sweep (``mem += g`` while packing) finds it too;
    the memory it touched is what the engine's undo copy puts back."""
    c = ErrorFeedback(get("onebit"))
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    _, st = c.encode(g, c.init(g))
    x = g.clone()
    x.view(-1)[where] = float("inf")
    with assume_finite(), pytest.raises(NonFiniteError):
        c.encode(x, st)


def test_a_product_overflow_of_finite_values_is_not_reported_as_nan():
    """PowerSGD reads NaN/Inf off P = M Q; a finite M whose P overflows takes the
    exact scan, which lets it pass (as the engine's scan did)."""
    c = get("powersgd", rank=1)
    g = torch.full((8, 8), 3e38)
    st = c.init(g, seed=0, world_size=1)
    st["q"] = torch.full((8, 1), 1.0)
    with assume_finite():
        p, _ = c.encode_round(0, g, st, None)
    assert p.numel() > 0


# -- the engine ---------------------------------------------------------------
N = 3
SHAPES = {"w": SHAPE, "b": (40,)}


def _plan(comp):
    return nf._plan(comp, 2)


def _run(comp, strategy, mode, steps, bad=None, params=None):
    """The engine run of test_nonfinite on this file's shapes; ``bad = (rank, step,
    flat index, value)`` puts ``value`` into that rank's "w"."""
    return nf._run(comp, strategy, mode, steps, bad=bad, shapes=SHAPES, params=params)


@pytest.fixture
def scans(monkeypatch):
    """The gradients the engine's ``submit`` scans itself."""
    seen = []
    real = engine_mod.all_finite

    def counting(x):
        seen.append(x.numel())
        return real(x)
    monkeypatch.setattr(engine_mod, "all_finite", counting)
    return seen


@pytest.mark.parametrize("comp,strategy,mode,where,value,params", [
    ("onebit", "ps", "propagate", WHERE[0], float("nan"), None),
    ("thc", "ps", "skip", WHERE[2], float("-inf"), None),
    ("natural", "ring", "propagate", WHERE[1], float("inf"), None),
    ("powersgd", "ring", "skip", WHERE[2], float("nan"), None),
    ("powersgd", "ps", "propagate", WHERE[0], float("inf"), None),
    ("terngrad", "ring", "skip", WHERE[1], float("nan"), None),
    ("dgc", "ps", "propagate", WHERE[1], float("nan"), {"ratio": 0.05}),  # one pass, detached
    ("dgc", "ps", "skip", WHERE[2], float("inf"), None),  # its own scan
    ("graddrop", "ps", "propagate", WHERE[2], float("-inf"), {"ratio": 0.1}),
    ("star_topk", "ring", "skip", WHERE[0], float("nan"), None),  # step kept: one owner
    ("var_topk", "ring", "propagate", WHERE[1], float("inf"), None),
])
def test_the_engine_leaves_the_scan_to_the_compressor_and_undoes_the_step(
        scans, monkeypatch, comp, strategy, mode, where, value, params):
    """The same run with the engine's scan (the capability hidden) is the reference:
    every step but the bad one, and the final states, are bitwise the same."""
    bad = (1, 1, where, value)
    fused = _run(comp, strategy, mode, [0, 1, 2], bad=bad, params=params)
    assert scans == []  # no gradient was scanned by the engine
    # every compressor reads as one without the capability (the frozen dataclass's
    # __init__ still stores its value through the setter)
    monkeypatch.setattr(Capabilities, "checks_finite", property(
        lambda self: False, lambda self, v: self.__dict__.__setitem__("checks_finite", v)))
    scanned = _run(comp, strategy, mode, [0, 1, 2], bad=bad, params=params)
    assert scans  # the reference took the engine's scan
    for r in range(N):
        steps, states = fused[r]
        ref_steps, ref_states = scanned[r]
        assert [ok for ok, _ in steps] == [True, mode == "propagate", True]
        assert [ok for ok, _ in ref_steps] == [ok for ok, _ in steps]
        if mode == "propagate":  # compressed gradients are NaN on every rank
            assert all(torch.isnan(t).all() for t in steps[1][1].values())
        for (_, g), (_, ref) in zip([steps[0], steps[2]], [ref_steps[0], ref_steps[2]]):
            for k in SHAPES:
                assert torch.equal(g[k], ref[k]), (r, k)
        assert ref_states.keys() == states.keys()
        for k in states:
            _same(snapshot(states[k]), snapshot(ref_states[k]))


def test_raise_still_raises_from_submit(scans):
    """"raise" keeps the engine's scan, so ``submit`` itself raises, as before."""
    def body(tr):
        eng = Engine(tr, compressor="onebit", plan=_plan("onebit"), timeout=10,
                     nonfinite="raise")
        try:
            eng.register([("w", (64,), torch.float32)])
            g = torch.ones(64)
            if tr.rank == 1:
                g[63] = float("nan")
            try:
                eng.submit("w", g)
            except ValueError as e:
                return ("submit", str(e))
            try:
                eng.synchronize()
            except Exception as e:  # noqa: BLE001 - the peers' error is what is checked
                return ("sync", str(e))
            return ("ok", "")
        finally:
            eng.close()
    res = run_threads(body, N, timeout=60)
    assert res[1][0] == "submit" and "NaN" in res[1][1]
    assert all(res[r][0] == "sync" and "rank 1" in res[r][1] for r in (0, 2))
    assert scans  # the engine scanned


@pytest.mark.parametrize("name,params", FUSED)
def test_outside_assume_finite_nan_raises_before_the_state_changes(name, params):
    """A caller that vouched for nothing (no engine) gets the error before its state,
    updated in place, is written: the pass's own check serves the engine only."""
    c = get(name, **params)
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(SHAPE, generator=gen)
    st = _warm_state(c, g)
    before = snapshot(st)
    x = torch.randn(SHAPE, generator=gen)
    x.view(-1)[WHERE[1]] = float("nan")
    with pytest.raises(NonFiniteError):
        _encode_first(c, x, st)
    _same(st, before)
