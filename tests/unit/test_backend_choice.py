"""Which torch.distributed backend ``hpt.init`` asks for (adapters/runtime.py ``_backend``).

NCCL needs a GPU per rank ("Duplicate GPU detected" otherwise), so with more local
ranks than GPUs gloo carries everything; HIPRESS_BACKEND always wins.
"""
import logging

import pytest
import torch

from hipress_like.adapters import runtime


@pytest.fixture
def gpus(monkeypatch):
    def set_(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    for v in ("HIPRESS_BACKEND", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
              "MPI_LOCALNRANKS"):
        monkeypatch.delenv(v, raising=False)
    return set_


def test_no_gpu_is_gloo(gpus):
    gpus(0)
    assert runtime._backend() == "gloo"


@pytest.mark.parametrize("env", ["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_a_gpu_per_local_rank_uses_nccl_for_cuda_tensors(gpus, monkeypatch, env):
    gpus(4)
    monkeypatch.setenv(env, "4")
    assert runtime._backend() == "cpu:gloo,cuda:nccl"


def test_more_local_ranks_than_gpus_falls_back_to_gloo_and_says_so(gpus, monkeypatch,
                                                                   caplog):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger=runtime.__name__):
        assert runtime._backend() == "gloo"
    assert "2 local ranks share 1 GPU(s)" in caplog.text and "HIPRESS_BACKEND" in caplog.text


def test_the_environment_wins(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("HIPRESS_BACKEND", "cpu:gloo,cuda:nccl")
    assert runtime._backend() == "cpu:gloo,cuda:nccl"
