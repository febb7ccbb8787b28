"""The hipress-profile CLI: each subcommand end to end, and bad input -> one line, exit 2.

Subprocess tests run the real entry point (``python -m hipress_like.tuning``);
the many bad-input cases also run in-process through ``main()`` to stay fast.
Sizes are tiny and no test checks a timing.
"""
import json
import os
import subprocess
import sys

import pytest

from hipress_like.cost_model import Plan, Planner, Profile
from hipress_like.tuning.cli import main, parse_bandwidth, parse_bytes, parse_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hipress_like.tuning", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_clean_error(proc, fragment):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("hipress-profile"), lines
    assert "error:" in lines[0]
    assert fragment in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    p = run_cli("profile", "--compressors", "identity,fp16", "--min-size", "4KB",
                "--max-size", "64KB", "--repeats", "1", "--bandwidth", "1gbit",
                "--latency", "100us", "-q", "-o", d / "profile.json", cwd=d)
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout
    return d / "profile.json"


def test_profile_writes_a_valid_profile(profile_path):
    prof = Profile.load(profile_path)
    assert set(prof.compressors) == {"identity", "fp16"}
    assert prof.link.bandwidth == pytest.approx(1.25e8)
    assert prof.link.latency == pytest.approx(1e-4)
    assert prof.compressors["fp16"].ratio == pytest.approx(0.5)
    assert prof.compressors["fp16"].encode.sizes == (4096.0, 16384.0, 65536.0)


def test_profile_over_local_ranks(tmp_path):
    # the collective path: link fits over gloo, engine overhead, compressors timed on all ranks
    p = run_cli("profile", "--compressors", "fp16", "--nprocs", "2", "--min-size", "4KB",
                "--max-size", "16KB", "--link-max-size", "16KB", "--repeats", "1", "-q",
                "-o", tmp_path / "p.json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    prof = Profile.load(tmp_path / "p.json")
    assert prof.meta["ranks"] == 2 and prof.meta["link_source"] == "measured"
    assert prof.link_one is not None and len(prof.link_samples) == 2
    assert prof.compressors["fp16"].error_feedback  # as the engine runs it
    assert prof.sync_overhead >= 0 and prof.compressors["fp16"].sync_overhead >= 0
    # whole synchronisations timed through the engine: the lane at each link size,
    # the compressed path at K = 1, N and 3N (sizes capped by --max-size)
    assert [m for m, _ in prof.lane_samples] == [4096, 16384]
    assert [(m, k) for m, k, _ in prof.compressors["fp16"].engine_samples] == \
        [(16384, 1), (16384, 2), (16384, 6)]
    assert Planner(prof, "fp16", 2, "ps").engine_term is not None
    # and the CPU seconds a rank spent in each, under both strategies, as training runs
    # the engine (nonfinite="propagate": state copied each step)
    assert prof.meta["nonfinite"] == "propagate"
    cpu = prof.compressors["fp16"].engine_cpu_by
    assert set(cpu) == {"ps", "ring"}
    for st, samples in cpu.items():
        assert [(m, k) for m, k, _ in samples] == [(16384, 1), (16384, 2), (16384, 6)]
        assert all(c >= 0 for _, _, c in samples) and any(c > 0 for _, _, c in samples)
        assert Planner(prof, "fp16", 2, st).cpu_cpr(16384, 2) >= 0
    assert [m for m, _ in prof.lane_cpu] == [4096, 16384]
    assert Planner(prof, "fp16", 2, "ps").cpu_orig(16384) >= 0
    assert Planner(prof, "fp16", 4, "ps").cpu_cpr(16384, 2) is None  # timed with N = 2


def test_plan_prints_table_and_writes_plan(profile_path, tmp_path):
    out = tmp_path / "plan.json"
    p = run_cli("plan", "--profile", profile_path, "--compressor", "fp16", "--model",
                "4KB,1MB,64MB", "--nodes", "4", "--strategy", "ring", "-o", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "<compress, K>" in p.stdout and "wrote" in p.stdout
    plan = Plan.load(out)
    assert set(plan.gradients) == {"grad0", "grad1", "grad2"}
    assert plan.strategy == "ring" and plan.world_size == 4 and plan.compressor == "fp16"


def test_plan_with_preset_and_scale(profile_path, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(profile_path), "--compressor", "fp16", "--model",
                 "resnet50", "--scale", "0.01", "-N", "8", "-o", str(out)]) == 0
    assert len(Plan.load(out).gradients) == 155


def test_plan_with_json_sizes(profile_path, tmp_path):
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"fc.weight": 1 << 20, "fc.bias": 64}))
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(profile_path), "--compressor", "fp16", "--model",
                 str(sizes), "-N", "2", "-o", str(out)]) == 0
    assert set(Plan.load(out).gradients) == {"fc.weight", "fc.bias"}


def test_report_draws_pngs(profile_path, tmp_path):
    meas = tmp_path / "measured.json"
    meas.write_text(json.dumps({
        "format": "hipress-like-sync-measurements", "version": 1, "nodes": 4,
        "strategy": "ps", "compressor": "fp16",
        "rows": [{"nbytes": 1 << 15, "compress": False, "partitions": 1, "measured_s": 1e-3},
                 {"nbytes": 1 << 15, "compress": True, "partitions": 1, "measured_s": 2e-3},
                 {"nbytes": 1 << 15, "compress": True, "partitions": 2, "measured_s": 1.5e-3}]}))
    p = run_cli("report", "--profile", profile_path, "--compressor", "fp16", "--nodes", "4",
                "--measured", meas, "--min-size", "32KB", "--max-size", "1MB", "--out-dir",
                tmp_path / "plots", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    for name in ("sync_time.png", "partitions.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert "median |predicted/measured - 1| over 3" in p.stdout


def test_console_script_is_declared():
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert "hipress-profile=hipress_like.tuning.cli:main" in f.read()


# -- bad input ------------------------------------------------------------------------
def test_subprocess_missing_profile(tmp_path):
    p = run_cli("plan", "--profile", tmp_path / "nope.json", "--model", "vgg19", "-N", "4",
                cwd=tmp_path)
    assert_clean_error(p, "cannot read profile")


def test_subprocess_unknown_compressor(tmp_path):
    p = run_cli("profile", "--compressors", "nosuch", "--bandwidth", "1gbit", "--latency",
                "1ms", cwd=tmp_path)
    assert_clean_error(p, "unknown compressor 'nosuch'")


def test_subprocess_bad_nodes(profile_path, tmp_path):
    p = run_cli("plan", "--profile", profile_path, "--model", "vgg19", "-N", "0", cwd=tmp_path)
    assert_clean_error(p, "expected an integer >= 1")


@pytest.mark.parametrize("args, fragment", [
    (["plan", "--profile", "{bad}", "--model", "vgg19", "-N", "4"], "cannot read profile"),
    (["plan", "--profile", "{profile}", "--model", "vgg91", "-N", "4", "--compressor", "fp16"],
     "not a preset"),
    (["plan", "--profile", "{profile}", "--model", "vgg19", "-N", "4"], "choose one with"),
    (["plan", "--profile", "{profile}", "--model", "vgg19", "-N", "4", "--compressor", "tbq"],
     "no compressor 'tbq'"),
    (["plan", "--profile", "{profile}", "--model", "4KB,12XB", "-N", "4", "--compressor",
      "fp16"], "cannot read a size"),
    (["plan", "--profile", "{profile}", "--model", "nosuchmod:Net", "-N", "4", "--compressor",
      "fp16"], "cannot import"),
    (["plan", "--profile", "{profile}", "--model", "vgg19", "-N", "4", "--compressor", "fp16",
      "--scale", "0"], "--scale must be > 0"),
    (["profile", "--compressors", "fp16", "--bandwidth", "1gbit"], "give both"),
    (["profile", "--compressors", "fp16"], "the link is unknown"),
    (["profile", "--compressors", "fp16", "--bandwidth", "fast", "--latency", "1ms"],
     "cannot read a bandwidth"),
    (["profile", "--compressors", "fp16", "--min-size", "1MB", "--max-size", "4KB",
      "--bandwidth", "1gbit", "--latency", "1ms"], "larger than --max-size"),
    (["profile", "--compressors", "fp16:level", "--bandwidth", "1gbit", "--latency", "1ms"],
     "key=value"),
    (["report", "--profile", "{profile}", "-N", "4", "--compressor", "fp16", "--measured",
      "{bad}"], "cannot read measurements"),
    (["report", "--profile", "{profile}", "-N", "4", "--compressor", "fp16", "--measured",
      "{wrongfmt}"], "not a version-1"),
])
def test_bad_input_in_process(profile_path, tmp_path, capsys, args, fragment):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "other"}))
    argv = [a.format(profile=profile_path, bad=bad, wrongfmt=wrong) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hipress-profile: error:"), err
    assert fragment in err[0]


def test_argparse_errors_exit_2_with_one_line(capsys):
    for argv in (["plan", "--model", "vgg19"],  # --profile and --nodes missing
                 ["frobnicate"], ["report", "--profile", "p.json", "-N", "x"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hipress-profile") and "error:" in err[0]


# -- units ------------------------------------------------------------------------------
def test_units():
    assert parse_bytes("4KB") == 4096
    assert parse_bytes("1.5MB") == 3 << 19
    assert parse_bytes("256") == 256
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bandwidth("1gbit") == pytest.approx(1.25e8)
    assert parse_bandwidth("10Gbps") == pytest.approx(1.25e9)
    assert parse_bandwidth("125MB/s") == pytest.approx(1.25e8)
    assert parse_seconds("50us") == pytest.approx(5e-5)
    assert parse_seconds("2ms") == pytest.approx(2e-3)
    assert parse_seconds("0") == 0.0
    for bad in ("", "12XB", "-4KB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_plan_with_several_compressors_names_one_per_gradient(tmp_path):
    """--compressor a,b (or all) chooses per gradient; the table names the choice."""
    from hipress_like.cost_model import CompressorProfile, Curve, Link

    pts = [float(4 << e) for e in range(10, 30, 2)]
    prof = Profile(link=Link(latency=1e-4, bandwidth=1.25e8), compressors={
        "fast": CompressorProfile(name="fast", category="quantization", ratio=1 / 8,
                                  header_bytes=16, encode=Curve.linear(2e-5, 2e-10, pts),
                                  decode=Curve.linear(1e-5, 1e-10, pts)),
        "tight": CompressorProfile(name="tight", category="lowrank", ratio=1 / 512,
                                   header_bytes=64, encode=Curve.linear(4e-3, 1.5e-9, pts),
                                   decode=Curve.linear(1e-3, 1e-10, pts))})
    prof.save(tmp_path / "p.json")
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"bias": 1024, "mid": 1 << 20, "huge": 256 << 20}))
    out = tmp_path / "plan.json"
    p = run_cli("plan", "--profile", tmp_path / "p.json", "--compressor", "all", "--model",
                sizes, "-N", "4", "-o", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln[:4] in ("bias", "mid ",
                                                                          "huge")}
    assert "<no, " in rows["bias"] and "<fast, " in rows["mid"] and "<tight, " in rows["huge"]
    plan = Plan.load(out)
    assert [plan.gradients[n].compressor for n in ("bias", "mid", "huge")] == \
        [None, "fast", "tight"]


def test_plan_with_a_master_compressor_names_it_per_gradient(tmp_path):
    """--back prices bidirectional compression and writes compressor_back."""
    from hipress_like.cost_model import CompressorProfile, Curve, Link

    pts = [float(4 << e) for e in range(10, 30, 2)]
    prof = Profile(link=Link(latency=1e-4, bandwidth=1.25e8), compressors={
        name: CompressorProfile(name=name, category="quantization", ratio=r, header_bytes=16,
                                encode=Curve.linear(2e-5, 2e-10, pts),
                                decode=Curve.linear(1e-5, 1e-10, pts))
        for name, r in (("w", 1 / 32), ("m", 9 / 32))})
    prof.save(tmp_path / "p.json")
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"bias": 1024, "huge": 256 << 20}))
    out = tmp_path / "plan.json"
    p = run_cli("plan", "--profile", tmp_path / "p.json", "--compressor", "w", "--back", "m",
                "--model", sizes, "-N", "4", "-o", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "<w/m, " in p.stdout
    g = Plan.load(out).gradients["huge"]
    assert (g.compress, g.compressor, g.compressor_back) == (True, "w", "m")
    bad = run_cli("plan", "--profile", tmp_path / "p.json", "--compressor", "w", "--back",
                  "nope", "--model", sizes, "-N", "4", "-o", out, cwd=tmp_path)
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_a_labelled_compressor_is_profiled_and_planned_under_its_label(tmp_path):
    """Plain and Bloom-coded top-k side by side (issue 25 item 6): the label names the
    compressor, the profile keeps both, and on a slow link the plan gives the large
    gradient the Bloom-coded one, with its codec in the entry's parameters."""
    prof_path, out = tmp_path / "p.json", tmp_path / "plan.json"
    p = run_cli("profile", "--compressors",
                "topk:ratio=0.01,topk-bloom:compressor=topk:ratio=0.01:index_codec=bloom",
                "--min-size", "64KB", "--max-size", "1MB", "--repeats", "1", "--bandwidth",
                "800kbit", "--latency", "100us", "-q", "-o", prof_path, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    prof = Profile.load(prof_path)
    assert set(prof.compressors) == {"topk", "topk-bloom"}
    assert prof.compressors["topk-bloom"].name == "topk"
    p = run_cli("plan", "--profile", prof_path, "--compressor", "all", "--model", "1MB",
                "-N", "4", "-o", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (entry,) = Plan.load(out).gradients.values()
    assert entry.compress and entry.compressor == "topk"
    assert entry.params["index_codec"] == "bloom"
