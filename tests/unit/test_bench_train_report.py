"""bench/train.py's verdicts: the goals of issue 4 judged from a run's rows.

The step times here are made up; what is pinned is the arithmetic of the
ratios and that an accuracy gap is only judged once the DDP reference has
learned something (a model at chance matches any other model at chance).
"""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_train", os.path.join(ROOT, "bench", "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(ddp_acc, hp_acc):
    row = {"params_m": 26.6}
    return [dict(row, config="floor", ms_per_step=300.0, accuracy=13.0),
            dict(row, config="ddp", ms_per_step=1800.0, accuracy=ddp_acc),
            dict(row, config="ddp-powersgd1", ms_per_step=780.0, accuracy=ddp_acc),
            dict(row, config="hp-ps-powersgd1", ms_per_step=600.0, accuracy=hp_acc),
            dict(row, config="hp-ps-onebit", ms_per_step=900.0, accuracy=ddp_acc)]


def _goal_lines(capsys, rows):
    _bench()._report("vgg", rows, "test budget")
    out = capsys.readouterr().out
    return {line.split("  ")[1].strip(): line for line in out.splitlines()
            if line.startswith("  ")}


def test_ratios_name_the_best_configurations(capsys):
    lines = _goal_lines(capsys, _rows(90.0, 89.5))
    assert "1.30  met" in lines["vs best DDP hook >= 1.3x"]  # 780 / 600
    assert "3.00  met" in lines["vs DDP without hook >= 3x"]  # 1800 / 600
    assert "2.00  NOT met" in lines["within 1.3x of the floor"]  # 600 / 300
    assert lines["accuracy loss vs DDP <= 1pt"].endswith("met")
    assert "NOT" not in lines["accuracy loss vs DDP <= 1pt"]


def test_an_accuracy_gap_beyond_one_point_is_not_met(capsys):
    lines = _goal_lines(capsys, _rows(90.0, 88.0))
    assert "2.0  NOT met" in lines["accuracy loss vs DDP <= 1pt"]


def test_accuracy_is_not_judged_while_ddp_is_at_chance(capsys):
    lines = _goal_lines(capsys, _rows(10.0, 10.0))
    line = lines["accuracy loss vs DDP <= 1pt"]
    assert "not judged" in line and "raise --steps" in line
    assert " met" not in line
