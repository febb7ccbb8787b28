"""Elastic training under horovodrun's elastic driver (``--min-np``, ``--max-np``, a host
discovery script), with ``hipress_like.torch`` as ``hvd`` (issue 46, Build item 5).

Two "hosts" on this machine, as Horovod's own elastic tests use them: ``localhost`` and
``127.0.0.1`` (both local to horovodrun, so no ssh), one slot each. The job is
``tests/multiprocess/elastic_job.py`` (digits, PowerSGD, a commit every 10 steps), whose
global batch does not depend on the world size.

- A worker killed: its host is blacklisted by the driver; the survivor re-forms a world
  of one in its own process (``runtime.reform``), goes back to its last commit in memory
  and trains to the end. Measured: the kill to the re-formed world's first step, and the
  steps lost (no more than since the last commit).
- A host added: the discovery script lists ``127.0.0.1`` once rank 0 asks for it; at the
  next commit every rank raises ``HostsUpdatedInterrupt`` together, the world re-forms
  with the new worker, ``state.sync()`` gives it rank 0's state, and both end bitwise
  identical.

Needs Horovod built with PyTorch and gloo: ``scripts/env_horovod.sh``.
"""
import json
import subprocess
from pathlib import Path

import pytest

from .test_horovodrun import BIN, ROOT, _env, needs_horovod

pytestmark = pytest.mark.frameworks

JOB = ROOT / "tests" / "multiprocess" / "elastic_job.py"


def _discovery(tmp: Path, flag: Path = None) -> Path:
    """A discovery script: ``localhost:1``, plus ``127.0.0.1:1`` (always, or once ``flag``
    exists)."""
    script = tmp / "discover.sh"
    second = 'echo "127.0.0.1:1"' if flag is None else \
        f'[ -e "{flag}" ] && echo "127.0.0.1:1"'
    script.write_text(f'#!/bin/bash\necho "localhost:1"\n{second}\nexit 0\n')
    script.chmod(0o755)
    return script


def _run(tmp: Path, np: int, discovery: Path, timeout: float = 600, name: str = "out", **env):
    out = tmp / name
    out.mkdir()
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", str(np), "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(discovery), "--elastic-timeout", "60",
           # one host at the start: horovodrun cannot compare two hosts' interfaces
           "--network-interface", "lo",
           str(BIN / "python"), str(JOB)]
    proc = subprocess.run(cmd, env=_env(JOB_OUT=str(out), JOB_TIMEOUT="20", **env), text=True,
                          capture_output=True, timeout=timeout, cwd=str(ROOT))
    log = proc.stdout + proc.stderr
    events = []
    if (out / "events.jsonl").exists():
        events = [json.loads(ln) for ln in (out / "events.jsonl").read_text().splitlines()]
    return proc.returncode, events, log


@needs_horovod
def test_a_killed_worker_shrinks_the_world_in_place_and_training_resumes(tmp_path):
    hosts = _discovery(tmp_path)
    rc, ev, log = _run(tmp_path, 2, hosts, JOB_STEPS="150", JOB_COMMIT_EVERY="10",
                       JOB_KILL_HOST="15:127.0.0.1")
    kill = next((e for e in ev if e["what"] == "kill"), None)
    assert kill is not None, log[-5000:]
    ends = [e for e in ev if e["what"] == "end"]
    assert rc == 0 and len(ends) == 1 and ends[0]["size"] == 1, log[-5000:]
    assert ends[0]["step"] == 150
    # the survivor's first step in the world of one, after the kill
    first = [e for e in ev if e["what"] == "first_step" and e["t"] > kill["t"]]
    assert first and first[0]["size"] == 1, log[-5000:]
    resumed = first[0]["step"] - 1
    lost = kill["step"] - resumed
    took = first[0]["t"] - kill["t"]
    # the same job uninterrupted, on both hosts throughout
    rc0, ev0, log0 = _run(tmp_path, 2, hosts, name="uninterrupted", JOB_STEPS="150",
                          JOB_COMMIT_EVERY="10")
    ref = [e for e in ev0 if e["what"] == "end"]
    assert rc0 == 0 and len(ref) == 2, log0[-5000:]
    print(f"kill at step {kill['step']} -> resumed at {resumed} ({lost} lost), first step "
          f"{took:.1f} s after the kill; accuracy {ends[0]['acc']:.2f}% (uninterrupted "
          f"{ref[0]['acc']:.2f}%)")
    assert 0 <= lost <= 10, (kill, first[0])  # no more than since the last commit
    # the process that trained before the kill is the one that finished: in place
    starts = [e for e in ev if e["what"] == "start"]
    assert ends[0]["pid"] in {e["pid"] for e in starts if e["t"] < kill["t"]}
    assert abs(ends[0]["acc"] - ref[0]["acc"]) <= 0.5, (ends[0]["acc"], ref[0]["acc"])


@needs_horovod
def test_an_added_host_joins_at_the_next_commit_and_replicas_agree(tmp_path):
    flag = tmp_path / "add-host"
    rc, ev, log = _run(tmp_path, 1, _discovery(tmp_path, flag), JOB_STEPS="80",
                       JOB_COMMIT_EVERY="10", JOB_ADD_HOST=f"15:{flag}")
    ends = [e for e in ev if e["what"] == "end"]
    assert rc == 0 and len(ends) == 2, log[-5000:]
    assert {e["size"] for e in ends} == {2} and {e["step"] for e in ends} == {80}
    assert len({e["digest"] for e in ends}) == 1, f"replicas differ: {ends}"
    grown = [e for e in ev if e["what"] == "first_step" and e["size"] == 2]
    assert grown, log[-5000:]
    print(f"the world grew to 2 at step {min(e['step'] for e in grown) - 1}; accuracy "
          f"{ends[0]['acc']:.2f}%")
