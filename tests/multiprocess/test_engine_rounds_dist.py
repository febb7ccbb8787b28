"""Multi-round compressors across real processes (gloo over loopback).

The point-to-point workflows merge in the engine's fixed order, so a run
over gloo gives the bits of the in-process run that
``tests/unit/test_engine_rounds.py`` checks against a hand computation;
the lane's allreduce may sum in another order, so there every rank must
agree and the range round (a max) must be exact. One 3-rank launch runs every
case below in turn (fresh engines on the same ranks); each test reads its own.
"""
import functools
import sys
from pathlib import Path

import pytest
import torch

from hipress_like.casync.transport.inproc import run_threads
from hipress_like.launch.launch import run_workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rounds_compressors import OwnerTopk, RangeQuant, run_rounds  # noqa: E402


def _worker(ctx, comp_name, strategy, k, raw_collective):
    comp = RangeQuant() if comp_name == "range" else OwnerTopk(0.25)
    outs, layout, states = run_rounds(ctx.transport, comp, strategy, k, 2, raw_collective)
    return outs, layout, {key: st.get("seen") for key, st in states.items()}


def _thc_worker(ctx, strategy, k):
    from hipress_like.compressors.thc.thc import THC

    outs, layout, _ = run_rounds(ctx.transport, THC(), strategy, k, 2, False)
    return outs, layout


ROUNDS = [("range", "ps", 2, False), ("range", "ring", 1, False), ("range", "ps", 1, True),
          ("owner", "ring", 1, True)]
THC_CASES = [("ps", 2)]
N = 3


def _every_case(ctx, rounds, thc_cases):
    return ([_worker(ctx, *c) for c in rounds], [_thc_worker(ctx, *c) for c in thc_cases])


@functools.lru_cache(maxsize=None)
def _over_gloo():
    """{case: each rank's result} for ROUNDS and THC_CASES, from one launch of N ranks."""
    res = run_workers(_every_case, N, args=(ROUNDS, THC_CASES), timeout=300)
    out = {c: [r[0][i] for r in res] for i, c in enumerate(ROUNDS)}
    out.update({("thc", *c): [r[1][i] for r in res] for i, c in enumerate(THC_CASES)})
    return out


@pytest.mark.parametrize("comp,strategy,k,raw", ROUNDS)
def test_multi_round_compressors_over_gloo(comp, strategy, k, raw):
    n = N
    got = _over_gloo()[(comp, strategy, k, raw)]

    def local(tr):
        c = RangeQuant() if comp == "range" else OwnerTopk(0.25)
        return run_rounds(tr, c, strategy, k, 2, raw)
    ref = run_threads(local, n, timeout=120)
    for r in range(n):
        assert got[r][1] == ref[r][1]  # same layout
        assert got[r][2] == {key: st.get("seen") for key, st in ref[r][2].items()}  # seeds
        for step in range(2):
            for name, v in got[r][0][step].items():
                assert torch.equal(v, got[0][0][step][name])  # ranks agree bitwise
                if not raw or comp == "owner":  # point-to-point: the in-process bits
                    assert torch.equal(v, ref[r][0][step][name]), (name, step)
                else:
                    torch.testing.assert_close(v, ref[r][0][step][name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy,k", THC_CASES)
def test_thc_over_gloo_gives_the_in_process_bits(strategy, k):
    """THC's range round (max) and integer sums cross real processes: every rank holds
    the bytes the in-process run computes (its merges are exact integers)."""
    from hipress_like.compressors.thc.thc import THC

    n = N
    got = _over_gloo()[("thc", strategy, k)]
    ref = run_threads(lambda tr: run_rounds(tr, THC(), strategy, k, 2, False), n, timeout=120)
    for r in range(n):
        assert got[r][1] == ref[r][1]
        for step in range(2):
            for name, v in got[r][0][step].items():
                assert torch.equal(v, got[0][0][step][name])
                assert torch.equal(v, ref[r][0][step][name]), (name, step)
