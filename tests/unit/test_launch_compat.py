"""The launcher moved to hipress_like.launch (issue 44); the old names still import,
as the same module objects, and ``python -m`` under the old name still runs."""
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["launch", "cli_launch", "netem", "procs"])
def test_old_name_is_the_new_module(name):
    old = importlib.import_module(f"hipress_like.casync.{name}")
    new = importlib.import_module(f"hipress_like.launch.{name}")
    assert old is new


def test_from_import_of_an_old_name():
    from hipress_like.casync.launch import WorkerError, run_workers

    from hipress_like.launch import launch
    assert run_workers is launch.run_workers and WorkerError is launch.WorkerError


def test_unrelated_missing_names_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hipress_like.casync.no_such_module")


def test_python_m_old_cli_name_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "hipress_like.casync.cli_launch", "--help"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--nprocs" in out.stdout
