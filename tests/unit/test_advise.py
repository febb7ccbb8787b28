"""``hipress-profile advise``: the shape of its answer, the step model, bad input.

No test checks a timing: predictions come from given profiles and given
compute times (measured timelines are only checked for their order).
"""
import ast
import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from hipress_like.cost_model import CompressorProfile, Curve, Link, Plan, Profile
from hipress_like.cost_model.plan import GradientPlan, SizeRule
from hipress_like.cost_model.planner import NEVER, Planner
from hipress_like.cost_model.presets import preset
from hipress_like.tuning.advise import (
    CLOSE,
    ComputeTimeline,
    advise,
    host_bound,
    measure_compute,
    optimizer_line,
    paper_profile,
    predict_step,
)
from hipress_like.tuning.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER = ["advise", "--profile", "paper", "--bandwidth", "56gbit", "--latency", "10us",
         "--compute-time", "300ms"]


def one_line_error(capsys, fragment):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hipress-profile") and "error:" in err[0], err
    assert fragment in err[0], err[0]


# -- the answer's shape ---------------------------------------------------------------------
@pytest.mark.parametrize("nodes", ["4", "16"])
def test_paper_values_leave_small_gradients_and_split_the_largest(tmp_path, capsys, nodes):
    """vgg19 on the paper's values: HiPress Table 7's shape, whatever N."""
    out = tmp_path / "plan.json"
    assert main(PAPER + ["--model", "vgg19", "--nodes", nodes, "--write-plan", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "recommended:" in stdout and "hpt.DistributedOptimizer(" in stdout
    plan = Plan.load(out)
    sizes = dict(preset("vgg19"))
    decide = {name: plan.decide(name, b, int(nodes)) for name, b in sizes.items()}
    small = [n for n, b in sizes.items() if b < 64 << 10]  # biases and the first convs
    assert small and not any(decide[n].compress for n in small)
    largest = max(sizes, key=sizes.get)  # classifier.0.weight, 392 MB
    # the engine's Ring runs each of its K partitions as N chunks: K * N pieces
    pieces = decide[largest].partitions * (int(nodes) if plan.strategy == "ring" else 1)
    assert decide[largest].compress and pieces > 1
    # the printed table says the same: its last (largest) line is compressed, split
    table = [ln.split() for ln in stdout.splitlines()
             if ln.strip().endswith(">") and "<compress, K>" not in ln]
    assert table[0][-2] == "<no," and table[-1][-2] != "<no,"
    assert table[-1][-1] != "1>" or f"ring allreduce of {nodes} chunks" in stdout


def test_compression_ranks_above_none_when_the_link_is_slow():
    sizes = preset("vgg19")
    adv = advise(sizes, 4, paper_profile(Link(10e-6, 1.25e8)),
                 ComputeTimeline.spread(sizes, 0.3))
    assert adv.best.kind != "none" and adv.best.speedup > 1
    assert adv.row("none").speedup == 1.0
    assert [r.step_s for r in adv.rows] == sorted(r.step_s for r in adv.rows)
    labels = {r.label for r in adv.rows}
    assert {"onebit/ps", "onebit/ring", "per-gradient/ps", "per-gradient/ring"} <= labels


def test_rows_closer_than_the_model_error_are_named_beside_the_pick(capsys):
    """Rows predicted within ``CLOSE`` of the best are listed with the pick (the
    model's error on a shared host is larger than their gap), and only they."""
    sizes = preset("vgg19")
    adv = advise(sizes, 4, paper_profile(Link(10e-6, 1.25e8)),
                 ComputeTimeline.spread(sizes, 0.3))
    close = adv.close_to_best()
    assert close and adv.best not in close
    assert all(adv.best.step_s <= r.step_s <= adv.best.step_s * (1 + CLOSE) for r in close)
    labels = [r.label for r in close]
    within = [r for r in adv.rows[1:] if r.step_s <= adv.best.step_s * (1 + CLOSE)]
    # a per-gradient plan that chose one compressor throughout runs like that row:
    # it is named once (as the faster-ranked twin), never as a contender of its own
    twins = {r.label: adv.same_as(r) for r in within}
    assert labels == [r.label for r in within if twins[r.label] is None]
    assert any(t is not None for t in twins.values())
    for label, t in twins.items():
        if t is not None:
            r = adv.row(label)
            assert r.strategy == t.strategy and r.decisions == t.decisions
            assert r.step_s == t.step_s and adv.rows.index(t) < adv.rows.index(r)
    assert adv.same_as(adv.best) is None
    assert adv.same_as(adv.row("none")) is None
    assert all(t is None for t in (adv.same_as(r) for r in adv.close_to_best(0.0)))
    assert main(PAPER[:3] + ["--bandwidth", "1gbit", "--latency", "10us", "--compute-time", "300ms",
                             "--model", "vgg19", "--nodes", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    line = [ln for ln in out if "closer than" in ln]
    assert len(line) == 1 and "time them too" in line[0]
    assert all(f"{r.label} +" in line[0] for r in close[:4])
    same = [ln for ln in out if ln.startswith("(the same decision for every gradient")]
    assert len(same) == 1 and "per-gradient/ps = onebit/ps" in same[0]
    assert "per-gradient/ps +" not in line[0]


def test_write_plan_round_trips_through_the_plan_loaders(tmp_path, capsys):
    from hipress_like.adapters.engine_builder import resolve_plan

    out = tmp_path / "plan.json"
    assert main(PAPER + ["--model", "4KB,64MB,256MB", "--nodes", "4", "--write-plan",
                         str(out), "--compressors", "onebit", "--strategies", "ring"]) == 0
    stdout = capsys.readouterr().out
    assert f'plan="{out}"' in stdout and f"wrote {out}" in stdout
    plan = Plan.load(out)
    assert resolve_plan(str(out)) == plan  # what DistributedOptimizer(plan=path) reads
    assert plan.strategy == "ring" and plan.world_size == 4
    assert set(plan.gradients) == {"grad0", "grad1", "grad2"}
    assert not plan.gradients["grad0"].compress and plan.gradients["grad2"].compress
    assert plan.to_dict() == Plan.from_dict(json.loads(out.read_text())).to_dict()


def test_recommended_line_is_valid_code_for_this_library():
    from hipress_like.adapters.torch.optimizer import DistributedOptimizer

    sizes = preset("table7")
    adv = advise(sizes, 4, paper_profile(Link(10e-6, 1.25e8)),
                 ComputeTimeline.spread(sizes, 0.1), compressor_plans="rule")
    known = set(inspect.signature(DistributedOptimizer).parameters)
    for r in adv.rows:
        call = ast.parse(optimizer_line(r)).body[0].value
        assert ast.unparse(call.func) == "hpt.DistributedOptimizer"
        assert {k.arg for k in call.keywords} <= known
        kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
        if r.kind == "compressor":
            assert kw["compression"] == f"hpt.Compression.{r.plan.compressor}"
            assert kw["plan"] == "None"  # the engine's size rule, as predicted
        if r.kind == "per-gradient":
            assert "compression" not in kw and kw["plan"] == "'plan.json'"


# -- the step model -------------------------------------------------------------------------
def _lane_profile():
    pts = [float(4 << e) for e in range(10, 30, 2)]
    cp = CompressorProfile(name="onebit", category="quantization", ratio=1 / 32,
                           header_bytes=0, encode=Curve.linear(1e-3, 0.0, pts),
                           decode=Curve.linear(1e-3, 0.0, pts))
    # the timed lane: 1 ms + 10 ms per MB
    return Profile(link=Link(1e-3, 1e8), lane=Link(1e-3, 1e8), compressors={"onebit": cp},
                   meta={"ranks": 2})


def test_sync_overlaps_backward_and_serialises_on_the_link():
    prof, mb = _lane_profile(), 1_000_000
    sizes = [("a", 10 * mb), ("b", 10 * mb)]
    # forward 100 ms; backward 200 ms: b final after 50 ms, a at its end; update 5 ms
    tl = ComputeTimeline(0.1, 0.2, {"b": 0.05, "a": 0.2}, 0.005)
    planners = {"onebit": Planner(prof, "onebit", 2)}
    none = Plan(rule=SizeRule(min_compress_bytes=NEVER))
    # one 25 MB lane bucket: ready with its last member (a, 300 ms), then 201 ms
    sync, step = predict_step(none, sizes, 2, planners, tl)
    assert sync == pytest.approx(0.201) and step == pytest.approx(0.3 + 0.201 + 0.005)
    # 8 MB buckets: b goes at 150 ms (ends 251 ms), a at 300 ms after it (ends 401 ms)
    sync, step = predict_step(none, sizes, 2, planners, tl, fusion_bytes=8 * mb)
    assert sync == pytest.approx(0.202) and step == pytest.approx(0.401 + 0.005)
    # a late job waits for the link: b compressed is long, a's bucket queues behind it
    cpr = Plan(gradients={"b": GradientPlan(True, 1), "a": GradientPlan(False, 1)})
    t_b = planners["onebit"].t_cpr(10 * mb, 1)
    sync, step = predict_step(cpr, sizes, 2, planners, tl)
    assert sync == pytest.approx(t_b + 0.101)
    assert step == pytest.approx(max(0.15 + t_b, 0.3) + 0.101 + 0.005)
    # one rank: no communication, the floor
    assert predict_step(none, sizes, 1, planners, tl) == (0.0, pytest.approx(0.305))


def test_compression_work_slows_backward_when_they_share_a_core():
    pts = [float(4 << e) for e in range(10, 30, 2)]
    heavy = CompressorProfile(name="onebit", category="quantization", ratio=1 / 32,
                              header_bytes=0, encode=Curve.linear(0.05, 0.0, pts),  # 50 ms
                              decode=Curve.linear(1e-6, 0.0, pts))
    prof = Profile(link=Link(1e-3, 1e8), lane=Link(1e-3, 1e8), compressors={"onebit": heavy})
    mb = 1_000_000
    sizes = [("a", 4 * mb), ("b", 10 * mb)]
    tl = ComputeTimeline(0.1, 0.2, {"b": 0.0, "a": 0.2}, 0.005)  # b final as backward starts
    plan = Plan(gradients={"b": GradientPlan(True, 1), "a": GradientPlan(False, 1)})
    planners = {"onebit": Planner(prof, "onebit", 2)}
    # a core each: b's 50 ms encode runs beside backward, which ends at 300 ms; then a's
    # bucket (41 ms) and the update
    _, alone = predict_step(plan, sizes, 2, planners, tl, cpu_share=1.0)
    assert alone == pytest.approx(0.3 + 0.041 + 0.005, abs=1e-4)
    # one core: both run at half speed until the encode is done, so backward ends 50 ms later
    _, shared = predict_step(plan, sizes, 2, planners, tl, cpu_share=0.5)
    assert shared == pytest.approx(alone + 0.05, abs=1e-4)


def test_latency_delays_a_sync_without_holding_the_link():
    """A lane bucket's time is its bytes on the link plus its latency; two buckets released
    together queue only for their bytes: 2 x 10 MB at 10 ms per MB with 50 ms latency each
    end at 200 + 50 ms, not 2 x 150."""
    mb = 1_000_000
    prof = Profile(link=Link(1e-3, 1e8), lane=Link(0.05, 1e8),
                   compressors=_lane_profile().compressors, meta={"ranks": 2})
    sizes = [("a", 10 * mb), ("b", 10 * mb)]
    tl = ComputeTimeline(0.0, 0.0, {}, 0.0)
    planners = {"onebit": Planner(prof, "onebit", 2)}
    none = Plan(rule=SizeRule(min_compress_bytes=NEVER))
    sync, step = predict_step(none, sizes, 2, planners, tl, fusion_bytes=8 * mb)
    assert sync == pytest.approx(0.3) and step == pytest.approx(0.25)


def test_bytes_move_at_the_cpu_share_while_backward_runs():
    """With the rank's cores shared, the transport's threads move bytes at cpu_share while
    backward computes (a lane sync and a compute load on 4 ranks / 2 cores barely
    overlapped). A 10 MB bucket final 100 ms before backward ends: 50 ms of its 100 ms
    done by then, 50 ms after."""
    prof, mb = _lane_profile(), 1_000_000
    sizes = [("a", 10 * mb)]
    tl = ComputeTimeline(0.1, 0.2, {"a": 0.1}, 0.0)
    planners = {"onebit": Planner(prof, "onebit", 2)}
    none = Plan(rule=SizeRule(min_compress_bytes=NEVER))
    _, alone = predict_step(none, sizes, 2, planners, tl, cpu_share=1.0)
    _, shared = predict_step(none, sizes, 2, planners, tl, cpu_share=0.5)
    assert alone == pytest.approx(0.2 + 0.101)  # 1 ms latency after the bytes
    assert shared == pytest.approx(0.3 + 0.05 + 0.001)


def test_more_ranks_than_cores_bound_the_step_by_their_cpu_work():
    """With CPU figures in the profile, the step is at least the rank's compute CPU plus its
    synchronisations' CPU over its cores (step_model.host_bound): 4 ranks on 2 cores ran
    Ring + onebit on the VGG-style model in 2x its CPU time per rank."""
    prof, mb = _lane_profile(), 1_000_000
    cpu = {"ps": ((mb, 1, 0.010), (10 * mb, 1, 0.100), (10 * mb, 2, 0.110))}
    comp = dataclasses.replace(prof.compressors["onebit"], engine_cpu_by=cpu)
    prof = dataclasses.replace(prof, compressors={"onebit": comp},
                               lane_cpu=((mb, 0.002), (10 * mb, 0.020)))
    sizes = [("a", 10 * mb), ("b", 10 * mb)]
    tl = ComputeTimeline(0.1, 0.2, {"b": 0.05, "a": 0.2}, 0.005)
    planners = {"onebit": Planner(prof, "onebit", 2)}
    plan = Plan(gradients={"b": GradientPlan(True, 1), "a": GradientPlan(False, 1)})
    pl = planners["onebit"]
    assert pl.cpu_cpr(10 * mb, 1) == pytest.approx(0.100, rel=1e-6)
    assert pl.cpu_orig(10 * mb) == pytest.approx(0.020, rel=1e-6)
    _, free = predict_step(plan, sizes, 2, planners, tl)
    _, roomy = predict_step(plan, sizes, 2, planners, tl, cores_per_rank=2.0)
    assert roomy == pytest.approx(free)  # (305 + 120) / 2 ms does not bind
    # half a core each: (305 ms * 0.5 + 120 ms) / 0.5 = 545 ms, beyond the three servers
    _, tight = predict_step(plan, sizes, 2, planners, tl, cpu_share=1.0, cores_per_rank=0.5)
    assert tight == pytest.approx(0.305 + 0.120 / 0.5) and tight > free
    assert host_bound(tl, 0.120, 0.5) == pytest.approx(tight)
    # the advisor reports the CPU; without CPU figures it says so (None) and adds no bound
    row = advise(sizes, 2, prof, tl, compressors=["onebit"], strategies=["ps"],
                 compressor_plans="rule", cores_per_rank=0.5).row("none")
    assert row.cpu_s == pytest.approx(0.040, rel=1e-6)  # two 10 MB lane buckets
    bare = advise(sizes, 2, _lane_profile(), tl, compressors=["onebit"], strategies=["ps"],
                  compressor_plans="rule", cores_per_rank=0.5).row("onebit/ps")
    assert bare.cpu_s is None
    with pytest.raises(ValueError, match="cores_per_rank"):
        predict_step(plan, sizes, 2, planners, tl, cores_per_rank=0.0)


def test_a_step_pays_the_engines_own_cpu_once():
    """Every profiled sync held a whole engine step, so each CPU fit carries the step's own
    cost; a step of three syncs pays it once: the smallest fixed cost among the fits used
    (the lane's 3 ms) is taken off all but one (ResNet-18, 7 PowerSGD gradients: 106 ms
    predicted before this, 58 ms measured)."""
    prof, mb = _lane_profile(), 1_000_000
    cpu = {"ps": ((mb, 1, 0.015), (10 * mb, 1, 0.105), (10 * mb, 2, 0.105))}  # 5 ms + 10 ns/B
    comp = dataclasses.replace(prof.compressors["onebit"], engine_cpu_by=cpu)
    prof = dataclasses.replace(prof, compressors={"onebit": comp},
                               lane_cpu=((mb, 0.013), (10 * mb, 0.103)))  # 3 ms + 10 ns/B
    sizes = [("a", mb), ("b", mb), ("c", mb)]
    plan = Plan(gradients={"a": GradientPlan(False, 1), "b": GradientPlan(True, 1),
                           "c": GradientPlan(True, 1)})
    tl = ComputeTimeline(0.1, 0.2, {}, 0.0)
    adv = advise(sizes, 2, prof, tl, compressors=["onebit"], strategies=["ps"],
                 compressor_plans="rule", cores_per_rank=0.5)
    pl = Planner(prof, "onebit", 2)
    assert pl.cpu_term.fixed == pytest.approx(0.005, rel=1e-6)
    assert pl.lane_cpu_term.fixed == pytest.approx(0.003, rel=1e-6)
    _, step = predict_step(plan, sizes, 2, {"onebit": pl}, tl, cpu_share=1.0,
                           cores_per_rank=0.5)
    # 2 x 15 ms + 13 ms, less the step's own 3 ms twice: 37 ms of CPU
    assert step == pytest.approx(host_bound(tl, 0.037, 0.5))
    assert adv.row("none").cpu_s == pytest.approx(0.033, rel=1e-6)  # one 3 MB bucket


def test_spread_puts_gradients_in_reverse_order_by_bytes():
    tl = ComputeTimeline.spread([("first", 100), ("mid", 100), ("last", 200)], 0.3)
    assert tl.forward_s == pytest.approx(0.1) and tl.backward_s == pytest.approx(0.2)
    assert [round(tl.ready(n), 6) for n in ("last", "mid", "first")] == [0.2, 0.25, 0.3]
    assert tl.floor_s == pytest.approx(0.3)


def test_measured_ready_times_follow_backward_order():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    tl = measure_compute(net, (16, 64), repeats=2, warmup=1)
    assert set(tl.ready_s) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert tl.ready_s["2.weight"] <= tl.ready_s["0.weight"] <= tl.backward_s
    assert tl.forward_s > 0 and tl.update_s > 0 and "measured" in tl.source
    assert net[0].weight.grad is None  # timed on a copy: the caller's module is untouched


def test_a_busy_host_is_named_in_the_timing_and_warned_about(monkeypatch, caplog):
    from hipress_like.tuning import compute

    net = torch.nn.Linear(8, 2)
    monkeypatch.setattr(compute, "host_busy", lambda: 0.9)  # as /proc/stat would say
    with caplog.at_level("WARNING", logger="hipress_like.tuning.compute"):
        tl = measure_compute(net, (4, 8), repeats=1, warmup=0)
    assert "90% busy with other work" in tl.source
    assert "--compute-time" in caplog.text
    monkeypatch.setattr(compute, "host_busy", lambda: 0.1)
    caplog.clear()
    with caplog.at_level("WARNING", logger="hipress_like.tuning.compute"):
        tl = measure_compute(net, (4, 8), repeats=1, warmup=0)
    assert "busy" not in tl.source and not caplog.text


def test_host_busy_reads_proc_stat_or_says_it_cannot(tmp_path):
    from hipress_like.tuning.compute import _busy_share, host_busy

    assert host_busy(0.0, str(tmp_path / "missing")) is None
    frozen = tmp_path / "stat"
    frozen.write_text("cpu  10 0 10 80 0 0 0 0 0 0\n")
    assert host_busy(0.0, str(frozen)) is None  # no time passed between the reads
    # iowait counts as idle: a host waiting on its disk is not busy computing
    assert _busy_share("cpu  0 0 0 0 0", "cpu  10 0 0 50 40") == 0.1
    if os.path.exists("/proc/stat"):
        share = host_busy(0.05)
        assert share is None or 0.0 <= share <= 1.0


def test_measure_compute_names_the_fix_for_a_wrong_input():
    with pytest.raises(ValueError, match="--input-shape"):
        measure_compute(torch.nn.Linear(4, 2), (3, 5))


def test_a_torch_module_is_timed_with_a_guessed_input(tmp_path, monkeypatch, capsys):
    (tmp_path / "tinynet.py").write_text(
        "from torch import nn\n"
        "def Net():\n"
        "    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Flatten(),\n"
        "                         nn.Linear(4 * 32 * 32, 10))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    prof = _lane_profile()
    prof.save(tmp_path / "p.json")
    assert main(["advise", "--profile", str(tmp_path / "p.json"), "--model", "tinynet:Net",
                 "-N", "2", "--batch", "4", "--repeats", "2", "--cores-per-rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured: 2 steps on input (4, 1, 32, 32)" in out  # 224 and 64 did not fit
    assert "4 gradients" in out and "1 cores per rank" in out


def test_a_given_link_replaces_the_measured_one(tmp_path, capsys):
    _lane_profile().save(tmp_path / "p.json")
    argv = ["advise", "--profile", str(tmp_path / "p.json"), "--model", "1MB,64MB", "-N", "2"]
    assert main(argv) == 0
    assert "(the profile's, given)" in capsys.readouterr().out
    assert main(argv + ["--bandwidth", "10gbit", "--latency", "20us"]) == 0
    out = capsys.readouterr().out
    assert "20.0 us + bytes / 10.000 Gbit/s (given, replacing the profile's)" in out


# -- bad input ------------------------------------------------------------------------------
@pytest.fixture
def old_profile(tmp_path):
    d = paper_profile(Link(1e-4, 1.25e8)).to_dict()
    d["version"] = 0
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("args, fragment", [
    (["--model", "vgg91", "--nodes", "4"], "is not a preset (bert-base"),
    (["--model", "nosuchmod:Net", "--nodes", "4"], "on PYTHONPATH"),
    (["--model", "vgg19", "--nodes", "4", "--bandwidth", "fast"], "cannot read a bandwidth"),
    (["--model", "vgg19", "--nodes", "4", "--compressors", "dgc"], "profile it with"),
])
def test_bad_input_gives_one_line_naming_the_fix(capsys, args, fragment):
    argv = PAPER + args if "--bandwidth" not in args else \
        ["advise", "--profile", "paper", "--latency", "10us"] + args
    assert main(argv) == 2
    one_line_error(capsys, fragment)


def test_zero_nodes_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(PAPER + ["--model", "vgg19", "--nodes", "0"])
    assert e.value.code == 2
    one_line_error(capsys, "expected an integer >= 1, found 0")


def test_a_profile_from_another_version_says_to_re_profile(capsys, old_profile):
    assert main(["advise", "--profile", str(old_profile), "--model", "vgg19", "-N", "4"]) == 2
    one_line_error(capsys, "re-run hipress-profile profile")


def test_paper_profile_needs_the_link(capsys):
    assert main(["advise", "--profile", "paper", "--model", "vgg19", "-N", "4"]) == 2
    one_line_error(capsys, "give --bandwidth and --latency")


def test_subprocess_bad_rate_is_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "hipress_like.tuning", "advise", "--profile",
                        "paper", "--model", "vgg19", "-N", "4", "--bandwidth", "1gbits",
                        "--latency", "10us"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot read a bandwidth '1gbits'" in lines[0]
    assert "1gbit, 10gbps, 125MB/s" in lines[0]  # the fix: a unit it reads


def test_docstring_examples_run():
    import doctest

    import hipress_like.tuning.advise as advise_module

    result = doctest.testmod(advise_module,
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
