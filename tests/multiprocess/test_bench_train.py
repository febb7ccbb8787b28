"""bench/train.py end to end on 2 local ranks over loopback: the floor, DDP, a DDP hook and
one CaSync configuration, a few steps each; and a row that runs a plan file.

No timing is asserted (shared machines are noisy); the test pins that the
benchmark launches real ranks for each kind of configuration, that every
row carries its step times and accuracy, that the CaSync row records which
gradients its plan compressed, that the accuracy runs follow for DDP and the
fastest CaSync configuration, and that the verdict lines are printed.
"""
import json

from bench_run import run_bench  # tests/multiprocess is on sys.path (rootdir import)


def test_train_bench_runs_each_kind_of_configuration(tmp_path):
    out = tmp_path / "train.json"
    p = run_bench("train.py", ["--model", "vgg", "--nprocs", 2, "--configs",
                               "floor,ddp,ddp-powersgd1,hp-ps-onebit", "--steps", 2, "--warmup", 1,
                               "--batch", 2, "--timeout", 300, "--acc-steps", 3,
                               "--acc-configs", "ddp,best", "--out", out], tmp_path, timeout=900)
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"floor", "ddp", "ddp-powersgd1", "hp-ps-onebit"}
    for r in rows.values():
        assert r["size"] == 2 and len(r["ms_steps"]) == 2 and 0 <= r["accuracy"] <= 100
        assert r["cpu_ms_per_step"] > 0
    # the VGG-style model's large fully-connected weights are what the plan compresses
    assert "6.weight" in rows["hp-ps-onebit"]["compressed"]
    assert "best of this project: hp-ps-onebit" in p.stdout
    assert "within 1.3x of the floor" in p.stdout
    # the accuracy runs: DDP and the fastest configuration of this project, 3 steps each
    acc = {r["config"]: r for r in json.loads(out.read_text())["accuracy_rows"]}
    assert set(acc) == {"ddp", "hp-ps-onebit"}
    assert all(r["steps_total"] == 3 and len(r["ms_steps"]) == 2 for r in acc.values())
    assert "3 steps on loopback" in p.stdout


def test_a_plan_row_runs_the_plan_file_it_is_given(tmp_path):
    """hp-ps-plan runs ``DistributedOptimizer(..., plan=PATH)``: the engine compresses the
    gradients the file names, with the file's compressor, and no other."""
    from hipress_like.cost_model.plan import GradientPlan, Plan, SizeRule

    plan = tmp_path / "plan.json"
    Plan(compressor="onebit", strategy="ps", world_size=2,
         rule=SizeRule(min_compress_bytes=1 << 40),
         gradients={"6.weight": GradientPlan(True, 2)}).save(plan)
    out = tmp_path / "train.json"
    run_bench("train.py", ["--model", "vgg", "--nprocs", 2, "--configs", "hp-ps-plan",
                           "--plan", f"ps={plan}", "--steps", 2, "--warmup", 1, "--batch", 2,
                           "--timeout", 300, "--acc-steps", 0, "--out", out], tmp_path, timeout=600)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["config"] == "hp-ps-plan" and row["compressed"] == ["6.weight"]
    assert "OneBit()" in row["compressors"]["6.weight"]  # maybe inside ErrorFeedback(...)
