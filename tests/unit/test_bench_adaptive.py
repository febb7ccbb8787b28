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


def test_a_void_exploration_and_the_one_begun_at_its_end_settle_after_the_second():
    hist = [{"step": 5, "reference": True},
            {"step": 30, "exploring": "link moved"}, {"step": 30, "trying": "m"},
            {"step": 45, "chose": "nothing: the link moved during it", "voided": True},
            {"step": 45, "exploring": "link moved during an exploration"},
            {"step": 45, "trying": "m"}, {"step": 60, "chose": "m"}]
    got = _bench().settle_starts({"history": hist, "after_steps": 5}, 40, 2, 5)
    assert got == [40, 20]  # phase 1: decided past its end; phase 2: from step 60


def test_the_phase_ratio_is_the_median_of_the_repeats_with_a_settled_window(tmp_path,
                                                                             capsys):
    import argparse
    import json

    steps = 20

    def row(t, hist):
        return {"steps_s": [[t] * steps], "phase_s": [t * steps], "total_s": t * steps,
                "identical": True, "history": hist, "after_steps": 5}

    busy = [{"step": 8, "exploring": "link moved"}, {"step": 8, "trying": "m"},
            {"step": 20, "chose": "m"}]  # decided until the phase's end: no window
    rows = {"adaptive": [row(0.010, []), row(0.5, busy), row(0.012, [])],
            "start": [row(0.011, []), row(0.011, []), row(0.010, [])]}
    a = argparse.Namespace(repeats=3, steps=steps, check_every=5, ranks=2, hidden=64,
                           hog_rank=0, out=str(tmp_path / "a.json"), plot=None)
    assert _bench().summarize(rows, a, ["1gbit"], [False], ("adaptive", "start")) == 0
    goals = {g["name"]: g for g in json.load(open(a.out))["goals"]}
    name = next(n for n in goals if n.startswith("phase 1 settled"))
    assert "2 of 3 repeats" in name
    assert abs(goals[name]["value"] - 0.011 / 0.0105) < 1e-9 and goals[name]["pass"]
    assert "2 of 3 repeats" in capsys.readouterr().out


def test_each_repeat_rotates_the_job_order_keeping_start_after_adaptive():
    order = _bench().job_order
    configs = ("adaptive", "start", "none", "onebit")
    assert order(configs, 0) == ["adaptive", "start", "none", "onebit"]
    assert order(configs, 1) == ["none", "onebit", "adaptive", "start"]
    assert order(configs, 2) == ["onebit", "adaptive", "start", "none"]
    assert order(configs, 3) == order(configs, 0)
    assert order(("adaptive", "none"), 1) == ["none", "adaptive"]


def test_jobs_of_one_plan_are_pooled_and_each_window_counts_by_its_mean_step(tmp_path):
    """``summarize``'s phase ratio: the mean step of each repeat's settled window (windows
    of different lengths are not summed), and "start" and "none" pooled when both
    compressed nothing in the phase (one plan: the faster of their two medians would be
    a biased estimate of it); a configuration that compressed something stays alone."""
    import argparse
    import json

    steps = 20

    def row(t, hist=(), compressed=()):
        return {"steps_s": [[t] * steps], "phase_s": [t * steps], "total_s": t * steps,
                "identical": True, "history": list(hist), "after_steps": 5,
                "compressed": [list(compressed)]}

    late = [{"step": 8, "exploring": "link moved"}, {"step": 8, "trying": "m"},
            {"step": 15, "chose": "m"}]  # a window of 5 steps, against 10 in the others
    rows = {"adaptive": [row(0.010), row(0.010, late), row(0.010)],
            "start": [row(0.008), row(0.012), row(0.012)],
            "none": [row(0.009), row(0.010), row(0.0095)],
            "onebit": [row(0.02, compressed=["w"])] * 3}
    a = argparse.Namespace(repeats=3, steps=steps, check_every=5, ranks=2, hidden=64,
                           hog_rank=0, out=str(tmp_path / "a.json"), plot=None)
    assert _bench().summarize(rows, a, ["1gbit"], [False],
                              ("adaptive", "start", "none", "onebit")) == 0
    goals = {g["name"]: g for g in json.load(open(a.out))["goals"]}
    name = next(n for n in goals if n.startswith("phase 1 settled ("))
    assert "(start+none)" in name
    # pooled per-step medians: start and none's six repeats -> 0.00975
    assert abs(goals[name]["value"] - 0.010 / 0.00975) < 1e-9
    alone = next(n for n in goals if "alone" in n)
    assert "none alone" in alone and abs(goals[alone]["value"] - 0.010 / 0.0095) < 1e-9
    # the medians of the windows' sums mix repeat 2's 5 steps with the others' 10: start's
    # sums 0.08, 0.06, 0.12 -> 0.08 against adaptive's 0.1, 0.05, 0.1 -> 0.1
    sums = next(n for n in goals if "sums" in n)
    assert abs(goals[sums]["value"] - 0.1 / 0.08) < 1e-9
