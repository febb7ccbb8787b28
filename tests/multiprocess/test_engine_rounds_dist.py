"""Multi-round compressors across real processes (gloo over loopback).

The point-to-point workflows merge in the engine's fixed order, so a run
over gloo gives the bits of the in-process run that
``tests/unit/test_engine_rounds.py`` checks against a hand computation;
the lane's allreduce may sum in another order, so there every rank must
agree and the range round (a max) must be exact.
"""
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


@pytest.mark.parametrize("comp,strategy,k,raw", [("range", "ps", 2, False),
                                                 ("range", "ring", 1, False),
                                                 ("range", "ps", 1, True),
                                                 ("owner", "ring", 1, True)])
def test_multi_round_compressors_over_gloo(comp, strategy, k, raw):
    n = 3
    got = run_workers(_worker, n, args=(comp, strategy, k, raw), timeout=180)

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


def _thc_worker(ctx, strategy, k):
    from hipress_like.compressors.thc.thc import THC

    outs, layout, _ = run_rounds(ctx.transport, THC(), strategy, k, 2, False)
    return outs, layout


@pytest.mark.parametrize("strategy,k", [("ps", 2)])
def test_thc_over_gloo_gives_the_in_process_bits(strategy, k):
    """THC's range round (max) and integer sums cross real processes: every rank holds
    the bytes the in-process run computes (its merges are exact integers)."""
    from hipress_like.compressors.thc.thc import THC

    n = 3
    got = run_workers(_thc_worker, n, args=(strategy, k), timeout=180)
    ref = run_threads(lambda tr: run_rounds(tr, THC(), strategy, k, 2, False), n, timeout=120)
    for r in range(n):
        assert got[r][1] == ref[r][1]
        for step in range(2):
            for name, v in got[r][0][step].items():
                assert torch.equal(v, got[0][0][step][name])
                assert torch.equal(v, ref[r][0][step][name]), (name, step)
