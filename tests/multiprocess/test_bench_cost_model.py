"""bench/cost_model.py end to end on 2 local ranks: calibration apart from validation.

No timing is asserted (shared machines are noisy); the test pins the
benchmark's protocol: the engine term is fitted to calibration points only,
none of which is a validation size, and every validation row carries a
prediction from that fit.
"""
import json

from bench_run import run_bench  # tests/multiprocess is on sys.path (rootdir import)


def test_cost_model_bench_fits_on_calibration_and_predicts_validation(tmp_path):
    out = tmp_path / "cm.json"
    p = run_bench("cost_model.py", ["--nprocs", 2, "--compressors", "onebit", "--min-size",
                                    16384, "--max-size", 131072, "--ks", "1,2", "--passes", 2,
                                    "--repeats", 1, "-o", out], tmp_path, timeout=600)
    assert "onebit: median |pred/meas-1|" in p.stdout
    report = json.loads(out.read_text())
    assert report["passes"] == 2 and report["nodes"] == 2
    prof = report["profile"]
    lane = {m for m, _ in prof["lane"]["samples"]}
    engine = {m for m, _, _ in prof["compressors"]["onebit"]["engine_samples"]}
    assert engine == {65536} and lane == {8192, 65536}  # engine_points up to the largest size
    calib = lane | engine
    rows = report["results"]["onebit"]["rows"]
    valid = {r["nbytes"] for r in rows}
    assert valid and not valid & calib
    assert {(r["compress"], r["partitions"]) for r in rows} == {(False, 1), (True, 1),
                                                               (True, 2)}
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)
    assert sum(r["planner_choice"] for r in rows) == len(valid)  # one choice per size
    for suffix in ("profile", "onebit"):  # inputs of hipress-profile report
        assert (tmp_path / f"cm.{suffix}.json").exists()
