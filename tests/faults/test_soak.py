"""A short soak (``bench/soak.py``): 4 real ranks, plan switches, delays, compressor changes.

The bench's own CLI runs (gloo on loopback, the project's launcher) and the
test reads its JSON. What must hold:

- **Exact** for threads (``/proc`` and Python's), open fds and the ``/dev/shm``
  files a rank maps or holds: equal at the first sample after the warm-up and
  the last one of every run. These are counts, not measurements: a loop that
  leaks one thread or socket every so many steps shows as a difference, and a
  correct one shows none, however loaded the host.
- **Bounded** for live ``torch.Tensor`` objects: at most 5 more at any sample
  of a run than at the first one taken under the same plan (a switch changes
  how many state tensors the compressor keeps, one per partition). Samples are
  taken at the same point of the loop, so the count mostly repeats exactly; the
  5 leave room for the few tensors still held by engine threads finishing their
  round (3 were seen once, with the exchange's waiter thread). A leak of one per
  step would be hundreds, one per sample interval 15 or more.
- **Generous** for RSS: the median of the last quarter of the samples at most
  20% above the second quarter's. RSS is a measurement: glibc's arenas and
  torch's allocator grow in steps and give memory back late, and each rank here
  holds some 400 MB, of which a few MB come and go. 20% (about 80 MB) stays
  clear of that noise on any host; it catches a gross leak (activations or a
  copy of the model kept every step), not a slow one: this model's gradients
  are ~20 KB, so keeping one per step adds ~8 MB in 400 steps. The bench's
  slope in MB per 1000 steps over a long soak is the finer measure; it is
  printed and written, not asserted.
- The replicas end every run bitwise identical.

Across engine rebuilds (one ``DistributedOptimizer`` per compressor, each
``close()``d) threads and fds stay flat too: ``close_engine`` frees the transport
it opened (its process group: gloo's 3 threads and 7 sockets at 4 ranks, which
the first soak found left behind at every rebuild).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "bench" / "soak.py"


def _soak(out: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SOAK), "--out", str(out), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    # 1: a check failed (the cross-rebuild one does today); the JSON says which
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_within_runs(d: dict, ranks: int) -> None:
    v = d["verdict"]
    assert len(v["ranks"]) == ranks
    for r in v["ranks"]:
        assert r["within_runs_flat"], r
        assert not r["new_own_shm"], r
    assert v["shm_clean"]
    assert v["identical"], [r["digests"] for r in d["results"]]
    assert v["tensor_growth_max"] <= 5, v["tensor_growth_max"]
    assert sum(r["delays"] for r in v["ranks"]) > 0  # the soak injected something
    assert v["ranks"][0]["switches"] > 0
    assert os.path.getsize(Path(d["args"]["out"]).with_suffix(".png")) > 0


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    return _soak(out, "--steps", "400", "--warmup", "100", "--every", "20", "--seed", "7",
                 "--compressors", "onebit,powersgd,thc", "--switch-prob", "0.05",
                 "--delay-prob", "0.05")


@pytest.mark.slow
def test_threads_fds_shm_are_exactly_flat_within_every_run(short_soak):
    _check_within_runs(short_soak, 4)


@pytest.mark.slow
def test_rss_grows_less_than_20_percent_after_warmup(short_soak):
    v = short_soak["verdict"]
    assert v["rss_q4_over_q2_max"] < 1.20, [(r["rank"], r["rss_q2_mb"], r["rss_q4_mb"])
                                            for r in v["ranks"]]


@pytest.mark.slow
def test_threads_and_fds_do_not_grow_across_engine_rebuilds(short_soak):
    v = short_soak["verdict"]
    assert v["closed_flat"], [(r["rank"], r["closed_threads"], r["closed_fds"])
                              for r in v["ranks"]]
    assert v["threads_flat"] and v["fds_flat"], [(r["rank"], r["threads"], r["fds"])
                                                 for r in v["ranks"]]


@pytest.mark.slow
def test_tiny_soak_is_flat_within_its_runs(tmp_path):
    """100 steps, two compressors (one rebuild): the cheapest soak that still checks.

    Slow tier: it took 94 s here (42 s of CPU in all) on a shared 2-core host,
    over the 40 s a default-tier test may take; on an idle host it may fit.
    """
    d = _soak(tmp_path / "soak.json", "--steps", "100", "--warmup", "20", "--every", "10",
              "--seed", "3", "--compressors", "onebit,terngrad", "--switch-prob", "0.1",
              "--delay-prob", "0.1")
    _check_within_runs(d, 4)
