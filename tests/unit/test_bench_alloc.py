"""bench/alloc.py: the settings it compares and its refusal of empty runs (timing lives in
the benchmark; here only what does not depend on the host)."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_alloc", os.path.join(ROOT, "bench", "alloc.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_default_is_compared_with_both_process_wide_settings():
    s = _bench().SETTINGS
    assert list(s) == ["default", "thp", "glibc-heap"] and s["default"] == {}
    assert s["thp"] == {"THP_MEM_ALLOC_ENABLE": "1"}
    tun = dict(kv.split("=") for kv in s["glibc-heap"]["GLIBC_TUNABLES"].split(":"))
    # above the VGG-style model's largest gradient (84 MB), the trim threshold above that
    assert int(tun["glibc.malloc.mmap_threshold"]) > 84 << 20
    assert int(tun["glibc.malloc.trim_threshold"]) > int(tun["glibc.malloc.mmap_threshold"])


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--steps", "0"]])
def test_empty_runs_are_refused(args, capsys):
    with pytest.raises(SystemExit):
        _bench().main(args)
    assert "must be at least 1" in capsys.readouterr().err
