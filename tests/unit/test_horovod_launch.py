"""hpt.init() under horovodrun: bad installs and bad environments are errors that name the fix.

Each case runs ``hpt.init()`` in a fresh interpreter with a crafted
environment (the variables horovodrun sets), so no test depends on Horovod
being installed here: a missing Horovod is made by hiding the package
(``sys.modules["horovod"] = None``), and a Horovod built without PyTorch
support by a package on ``PYTHONPATH`` whose ``horovod.torch`` raises the
ImportError Horovod's own unbuilt extension raises.
"""
import os
import subprocess
import sys
import textwrap

import pytest

GLOO = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "9", "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_HOSTNAME": "localhost"}
# what horovodrun --mpi's ranks see: Open MPI's variables and the MCA flags it always passes
MPI = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
       "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
       "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib", "OMPI_MCA_orte_tag_output": "1"}


def _init(env, prelude="", pythonpath=None):
    code = prelude + textwrap.dedent("""
        import hipress_like.torch as hpt
        try:
            hpt.init()
        except Exception as e:
            print(type(e).__name__, e)
        else:
            print("size", hpt.size())
    """)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "HOROVOD_", "DMLC_", "OMPI_", "PMI",
                                 "MASTER_", "HIPRESS_TRANSPORT"))}
    if pythonpath:
        base["PYTHONPATH"] = os.pathsep.join([pythonpath, base.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env={**base, **env}, text=True,
                         capture_output=True, timeout=120)
    return res.stdout + res.stderr


@pytest.mark.parametrize("mode, env", [("gloo", GLOO), ("MPI", MPI)])
def test_horovodrun_without_horovod_names_the_install_script(mode, env):
    out = _init(env, prelude="import sys; sys.modules['horovod'] = None\n")
    assert out.startswith("LaunchError"), out
    assert f"horovodrun ({mode} mode)" in out and "not installed" in out, out
    assert "scripts/env_horovod.sh" in out, out


def test_horovod_built_without_pytorch_names_the_rebuild(tmp_path):
    pkg = tmp_path / "horovod"
    (pkg / "torch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.28.1'\n")
    # what horovod/torch/__init__.py raises when its extension was not built
    (pkg / "torch" / "__init__.py").write_text(
        "raise ImportError('Extension horovod.torch has not been built: mpi_lib_v2 not found. '\n"
        "                  'If this is not expected, reinstall Horovod with "
        "HOROVOD_WITH_PYTORCH=1 to debug the build error.')\n")
    out = _init(GLOO, pythonpath=str(tmp_path))
    assert out.startswith("LaunchError"), out
    assert "built without PyTorch support" in out and "pip uninstall -y horovod" in out, out
    assert "scripts/env_horovod.sh" in out, out


@pytest.mark.parametrize("missing", [("HOROVOD_GLOO_RENDEZVOUS_ADDR",),
                                     ("HOROVOD_GLOO_RENDEZVOUS_PORT",),
                                     ("HOROVOD_GLOO_RENDEZVOUS_ADDR",
                                      "HOROVOD_GLOO_RENDEZVOUS_PORT")])
def test_horovod_variables_without_the_rendezvous_server_are_refused(missing):
    """HOROVOD_RANK/SIZE left in a shell would make Horovod start a world of one."""
    env = {k: v for k, v in GLOO.items() if k not in missing}
    out = _init(env)
    assert out.startswith("LaunchError"), out
    assert all(m in out for m in missing) and "horovodrun -np N" in out, out


@pytest.mark.parametrize("env, message", [
    ({**GLOO, "RANK": "0", "WORLD_SIZE": "2"}, "disagree about the rank"),
    ({**GLOO, "RANK": "1", "WORLD_SIZE": "4"}, "disagree about the size"),
    ({**GLOO, "DMLC_WORKER_ID": "0", "DMLC_NUM_WORKER": "2"}, "disagree about the rank"),
])
def test_mismatched_launchers_are_refused(env, message):
    out = _init(env)
    assert out.startswith("LaunchError") and message in out, out
    assert "unset the outer one's variables" in out, out


def test_plain_mpirun_is_not_taken_for_horovodrun(monkeypatch):
    """Only horovodrun's marker selects Horovod under Open MPI; plain mpirun keeps mpi4py."""
    from hipress_like.adapters import runtime

    for k in runtime._HOROVODRUN_MPI_MARKERS:
        monkeypatch.delenv(k, raising=False)
    assert not runtime._horovodrun_mpi()
    monkeypatch.setenv("OMPI_MCA_pml", "ob1")
    assert not runtime._horovodrun_mpi()  # one flag a user may pass by hand is not enough
    monkeypatch.setenv("OMPI_MCA_btl", "^openib")
    assert runtime._horovodrun_mpi()


def test_unknown_transport_name_lists_the_known_ones():
    from hipress_like.casync.transport import make_transport

    with pytest.raises(ValueError, match="available: gloo, horovod, mpi, nccl, torch"):
        make_transport("horovd")


class TestCycleTimeHint:
    """No spare core on a host: the advice on HOROVOD_CYCLE_TIME, only then."""

    @staticmethod
    def hint(*args):
        from hipress_like.adapters.horovod_rendezvous import cycle_time_hint

        return cycle_time_hint(*args)

    @staticmethod
    def launch(local_size):
        from hipress_like.adapters.launcher import Launch

        return Launch("horovodrun-gloo", 0, 8, 0, local_size)

    def test_no_spare_core_gets_the_measured_advice(self):
        text = self.hint(self.launch(4), {}, 2)
        assert text.startswith("horovodrun started 4 ranks on this host, which has 2 cores: "
                               "no core is spare")
        assert "horovodrun --cycle-time-ms 5" in text and "HOROVOD_CYCLE_TIME=5" in text
        assert self.hint(self.launch(4), {}, 4).startswith("horovodrun started 4 ranks")
        assert "which has 1 core:" in self.hint(self.launch(1), {}, 1)

    @pytest.mark.parametrize("local_size, env, cores", [
        (4, {"HOROVOD_CYCLE_TIME": "1"}, 2),   # the user chose, even Horovod's default
        (4, {"HOROVOD_CYCLE_TIME": "5"}, 2),
        (4, {}, 5),                            # a core to spare
        (None, {}, 1),                         # the launcher did not say
    ])
    def test_no_advice_when_chosen_not_needed_or_unknown(self, local_size, env, cores):
        assert self.hint(self.launch(local_size), env, cores) is None
