"""The Horovod surface this project promises, under horovodrun, in its own words.

``surface_job.py`` runs on 2 ranks started by ``horovodrun`` (gloo and MPI
modes) and exercises, through ``hipress_like.torch`` only: rank and size
(equal to Horovod's own), allreduce (sum, average, in place), allgather
(equal and variable sizes), broadcast (and in place), broadcast_object,
broadcast of model and optimizer state with a frozen parameter, fp16
compression, duplicate and missing parameter names refused, parameters
left unnamed, clipping between ``synchronize()`` and ``step()``, and the
warning when ``step()`` follows ``synchronize()`` outside
``skip_synchronize()``, and that these collectives travel over Horovod
itself. Every check must pass on both ranks.

The same behaviours are checked by Horovod's own test_torch.py through
``tests/frameworks/horovod_suite.py``.
"""
import re
from pathlib import Path

import pytest

from .test_horovodrun import _env, command, needs_horovod

pytestmark = pytest.mark.frameworks

JOB = Path(__file__).with_name("surface_job.py")
CHECKS = ("rank_and_size", "allreduce_sum_average_and_in_place",
          "allgather_equal_and_variable_size", "broadcast_and_in_place",
          "broadcast_object_from_root", "broadcast_state_with_a_frozen_parameter",
          "compression_fp16_round_trip", "duplicate_names_are_refused",
          "clip_between_synchronize_and_step", "step_after_synchronize_warns",
          "missing_and_absent_named_parameters", "collectives_ride_horovod")


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def outcome(request):
    import subprocess

    proc = subprocess.run(command(request.param, 2, JOB), env=_env(HIPRESS_TIMEOUT="60"),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    found = {}
    for m in re.finditer(r"\[(?:\d+,)?(\d+)\]<stdout>:CHECK (\w+) (ok|FAIL.*)", out):
        found.setdefault(m.group(2), {})[int(m.group(1))] = m.group(3)
    return request.param, found, out


@needs_horovod
@pytest.mark.parametrize("name", CHECKS)
def test_horovod_surface_under_horovodrun(outcome, name):
    mode, found, out = outcome
    got = found.get(name, {})
    assert got == {0: "ok", 1: "ok"}, f"horovodrun --{mode}: {name}: {got}\n{out[-3000:]}"
