"""The main job's network: emulated links as root, a one-line fallback otherwise, bad options.

``./run.sh`` puts its workers in network namespaces over emulated links
(``--net``, default 1gbit). Run by a user who cannot (not root), it trains on
loopback and says why in one line; options that cannot work stop it with
one line naming the fix.
"""
import os
import shutil
import subprocess
import sys

import pytest

from hipress_like.demo.cli_digits import emulation_blocker, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("argv, says", [
    (["--net", "fast"], "not a link rate"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--compressor", "nosuch"], "unknown compressor 'nosuch'"),
    (["--plan", "/no/such/plan.json"], "--plan must be 'auto', 'all' or a plan file"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--hidden", "0"], "--hidden must be at least 1"),
    (["--collective", "butterfly"], "invalid choice: 'butterfly'"),
])
def test_bad_options_stop_with_one_line_naming_the_fix(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1]


_AS_USER = """
import sys
sys.path.insert(0, {root!r})
from hipress_like.demo.cli_digits import _network
print("result:", _network("1gbit", 2))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to run a child as an unprivileged user (setpriv)")
def test_an_unprivileged_user_falls_back_to_loopback_in_one_line(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         _AS_USER.format(root=ROOT)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    notes = [x for x in lines if x.startswith("note:")]
    assert len(notes) == 1 and "needs root" in notes[0] and "loopback" in notes[0]
    assert lines[-1] == "result: (False, 'loopback')"


def test_root_can_emulate_and_others_are_told_why():
    why = emulation_blocker()
    if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc"):
        assert why is None
    else:
        assert why is not None and ("root" in why or "iproute2" in why)


@pytest.mark.netem
def test_root_brings_the_workers_links_up_and_down():
    from hipress_like.demo.cli_digits import _network
    from hipress_like.launch import netem

    if emulation_blocker() is not None:
        pytest.skip(emulation_blocker())
    netns, where = _network("100mbit", 2)
    try:
        assert netns and "100mbit" in where
        assert {"h0", "h1", "hsw"} <= set(netem._namespaces())
    finally:
        netem.down()
    assert netem._namespaces() == []
