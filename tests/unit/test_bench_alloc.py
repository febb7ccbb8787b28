"""bench/alloc.py: the settings it compares and its refusal of empty runs (timing lives in
the benchmark; here only what does not depend on the host)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_modules  # noqa: E402


def _bench():
    return bench_modules.load("alloc")


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
