"""Launcher detection (adapters/launcher.py): every launcher's variables, and every
incomplete or contradictory environment refused with the variables named."""
import subprocess
import sys

import pytest

from hipress_like.adapters.launcher import Launch, LaunchError, detect


@pytest.mark.parametrize("env, expected", [
    ({}, Launch("single", 0, 1, 0, 1)),
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
     Launch("torchrun", 2, 4, 0, 2)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
     Launch("mpirun", 1, 3, 1, 3)),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, Launch("mpirun", 0, 2, None, None)),
    ({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "3",
      "HOROVOD_LOCAL_SIZE": "4", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
      "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234"}, Launch("horovodrun-gloo", 3, 4, 3, 4)),
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
      "OMPI_COMM_WORLD_SIZE": "2"}, Launch("horovodrun-mpi", 1, 2, None, None)),
    ({"DMLC_WORKER_ID": "1", "DMLC_NUM_WORKER": "2"}, Launch("bpslaunch", 1, 2, 1, 2)),
    # torchrun inside horovodrun with consistent numbers: torchrun's view wins
    ({"RANK": "1", "WORLD_SIZE": "2", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"},
     Launch("torchrun", 1, 2, None, None)),
])
def test_each_launcher_is_recognised(env, expected):
    assert detect(env) == expected


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "no WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "no RANK"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside a world of 2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0"),
    ({"HOROVOD_RANK": "0"}, "only one of HOROVOD_RANK and HOROVOD_SIZE"),
    ({"HOROVOD_RANK": "5", "HOROVOD_SIZE": "4"}, "rank 5 is outside a world of 4"),
    ({"DMLC_NUM_WORKER": "2"}, "only one of DMLC_WORKER_ID and DMLC_NUM_WORKER"),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "2"}, "outside a world of 2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"},
     "disagree about the rank"),
    ({"RANK": "0", "WORLD_SIZE": "4", "DMLC_WORKER_ID": "0", "DMLC_NUM_WORKER": "2"},
     "disagree about the size"),
])
def test_an_incomplete_or_contradictory_environment_is_refused(env, message):
    with pytest.raises(LaunchError, match=message):
        detect(env)


@pytest.mark.parametrize("env, name", [
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovodrun in gloo mode"),
    ({"DMLC_WORKER_ID": "0", "DMLC_NUM_WORKER": "2"}, "bpslaunch-style"),
])
def test_init_never_trains_alone_under_a_launcher_it_cannot_join(env, name):
    """Under horovodrun's gloo mode every rank used to train alone as a world of one."""
    code = ("import hipress_like.torch as hpt\n"
            "try:\n    hpt.init()\nexcept Exception as e:\n"
            "    print(type(e).__name__, e)\nelse:\n    print('size', hpt.size())\n")
    base = {k: v for k, v in __import__("os").environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "HOROVOD_", "DMLC_", "OMPI_", "PMI"))}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, text=True,
                         capture_output=True, timeout=120).stdout
    assert out.startswith("LaunchError") and name in out and "torchrun" in out, out
