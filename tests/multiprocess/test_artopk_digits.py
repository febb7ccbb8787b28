"""Accuracy on real data: STAR-Topk and VAR-Topk at CR 0.01 train digits to within 1.5
points of uncompressed training, with every rank's parameters bitwise identical.

The main job's training function (``hipress_like.demo.train_digits``) runs on 4
ranks for the same epochs with and without compression (360 held-out images).
"""
import functools
from dataclasses import asdict

import pytest

from hipress_like.demo import DigitsConfig, train_digits
from hipress_like.launch.launch import run_workers

EPOCHS = 10


@functools.lru_cache(maxsize=None)
def _run(compressor, ratio=None, collective=None):
    params = {} if ratio is None else {"ratio": ratio}
    cfg = DigitsConfig(compressor=compressor, params=params, plan=None, epochs=EPOCHS,
                       progress=False, collective=collective)
    res = run_workers(train_digits, 4, args=(asdict(cfg),), timeout=1500)
    assert len({r["param_digest"] for r in res}) == 1, "replicas diverged"
    return res[0]


@pytest.mark.slow
@pytest.mark.parametrize("compressor,collective", [("star_topk", None), ("var_topk", None),
                                                   ("star_topk", "tree")])
def test_artopk_digits_accuracy_at_cr_001(compressor, collective):
    """PS rounds, and ART-Tree (indices down a binomial tree, values summed by a tree
    allreduce over point-to-point messages)."""
    base = _run("identity")["acc"]
    got = _run(compressor, 0.01, collective)
    print(f"digits {compressor} CR 0.01 ({collective or 'PS rounds'}): {got['acc']:.1f}% "
          f"(uncompressed {base:.1f}%), compressed {got['how']}")
    cls = {"star_topk": "STARTopk", "var_topk": "VARTopk"}[compressor]
    assert got["compressed"], "no gradient was compressed"
    assert all(how.startswith(f"{cls}(ratio=0.01)") for how in got["how"].values()), got["how"]
    assert got["acc"] >= base - 1.5, f"{compressor}: {got['acc']:.1f}% vs {base:.1f}%"
