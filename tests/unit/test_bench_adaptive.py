"""bench/adaptive.py's pure parts: the plot of step time against training time, and the
settled windows read from the adaptive job's decisions.

The bench itself needs root (tc in network namespaces) and runs whole jobs;
here the plot is drawn from rows shaped as ``run_job`` returns them, with a
switch, a revert and a restore, and the file is checked to be a PNG.
"""
import importlib
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench")


def _bench():
    if BENCH not in sys.path:  # bench/report.py imports it the same way
        sys.path.insert(0, BENCH)
    return importlib.import_module("adaptive")


def test_plot_marks_switches_reverts_and_restores(tmp_path):
    steps = 6
    row = {"steps_s": [[0.01] * steps, [0.05] * steps, [0.01] * steps],
           "switches": [3, 8], "reverts": [13], "restores": [17]}
    fixed = {"steps_s": [[0.01] * steps, [0.2] * steps, [0.01] * steps],
             "switches": [], "reverts": [], "restores": []}
    path = tmp_path / "plots" / "adaptive.png"
    _bench().plot({"adaptive": [row], "start": [fixed]}, ["1gbit", "100mbit", "1gbit"],
                  steps, str(path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_a_phase_settles_after_the_decisions_begun_in_it_end():
    hist = [{"step": 5, "reference": True},
            {"step": 45, "exploring": "link moved"}, {"step": 45, "trying": "m", "switched": True},
            {"step": 50, "trying": "x", "switched": True},
            {"step": 55, "chose": "m", "switched": True},   # phase 2's exploration: to 55
            {"step": 118, "exploring": "step time moved"},
            {"step": 118, "trying": "m", "switched": True},
            {"step": 128, "chose": "in force"},              # phase 3's: past its end
            {"step": 150, "switched": True}, {"step": 152, "judged": "new"},
            {"step": 155, "judged": "old"}]                 # phase 4's trial: to 155
    hist.sort(key=lambda h: h["step"])
    got = _bench().settle_starts({"history": hist, "after_steps": 5}, 40, 4, 5)
    assert got == [10, 15, 40, 35]
    assert _bench().settle_starts({"history": [], "after_steps": 5}, 40, 2, 5) == [10, 10]
    # an exploration begun at a phase's last step runs in the next phase only
    late = [{"step": 40, "exploring": "link moved"}, {"step": 40, "trying": "m"},
            {"step": 55, "chose": "m"}]
    assert _bench().settle_starts({"history": late, "after_steps": 5}, 40, 2, 5) == [10, 15]
