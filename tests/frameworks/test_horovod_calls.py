"""The calls this project hands to Horovod, under horovodrun, in its own words.

``horovod_calls_job.py`` runs on 2 ranks started by ``horovodrun --gloo``
and, through ``hipress_like.torch`` only, checks that ``reducescatter``,
``alltoall``, their async and grouped forms give Horovod's own results, that
they appear in Horovod's timeline (``start_timeline``/``stop_timeline``
handed over too; Horovod needs HOROVOD_TIMELINE=DYNAMIC for them), and
that process sets (``add_process_set``, collectives and ``barrier`` on a
set, ``remove_process_set``) are Horovod's. Every check
must pass on both ranks. Horovod's own test_torch.py is the cross-check
(``horovod_suite.py``).
"""
import re
import subprocess
from pathlib import Path

import pytest

from .test_horovodrun import _env, command, needs_horovod

pytestmark = pytest.mark.frameworks

JOB = Path(__file__).with_name("horovod_calls_job.py")
CHECKS = ("reducescatter_and_alltoall_are_horovods",
          "handed_calls_appear_in_horovods_timeline", "process_sets_are_horovods")


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeline")
    proc = subprocess.run(command("gloo", 2, JOB, str(tmp)),
                          env=_env(HIPRESS_TIMEOUT="60", HOROVOD_DYNAMIC_PROCESS_SETS="1",
                                     HOROVOD_TIMELINE="DYNAMIC"),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    found = {}
    for m in re.finditer(r"\[(?:\d+,)?(\d+)\]<stdout>:CHECK (\w+) (ok|FAIL.*)", out):
        found.setdefault(m.group(2), {})[int(m.group(1))] = m.group(3)
    return found, out


@needs_horovod
@pytest.mark.parametrize("name", CHECKS)
def test_handed_calls_under_horovodrun(outcome, name):
    found, out = outcome
    got = found.get(name, {})
    assert got == {0: "ok", 1: "ok"}, f"{name}: {got}\n{out[-3000:]}"
