"""``hpt.elastic`` in one process: what a commit keeps, what a restore brings back, and
when ``run`` leaves the process for torchrun to re-form the world.

The re-formed worlds themselves (real torchrun agents, a killed rank) are in
tests/multiprocess/test_elastic.py.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hipress_like.torch as hpt
from hipress_like.casync.errors import ConfigMismatchError, EngineError

elastic = hpt.elastic


def _model_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def _step(model, opt):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_restore_goes_back_to_the_last_commit_in_memory():
    model, opt = _model_opt(0)
    state = elastic.TorchState(model, opt, epoch=0, step=0)
    _step(model, opt)
    state.step = 1
    state.commit()
    kept, momentum = _params(model), [opt.state[p]["momentum_buffer"].clone()
                                      for p in model.parameters()]
    for _ in range(3):
        _step(model, opt)
    state.step, state.epoch = 4, 1
    assert state.restore()
    assert (state.step, state.epoch) == (1, 0)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), kept))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m)
               for p, m in zip(model.parameters(), momentum))


def test_a_fresh_process_restores_the_checkpointed_commit(tmp_path):
    path = str(tmp_path / "ck.pt")
    model, opt = _model_opt(0)
    state = elastic.TorchState(model, opt, checkpoint=path, step=0)
    _step(model, opt)
    state.step = 1
    state.commit()
    kept = _params(model)
    # what a process torchrun starts after a failure sees: other initial values, no commit
    model2, opt2 = _model_opt(1)
    state2 = elastic.TorchState(model2, opt2, checkpoint=path, step=0)
    assert not all(torch.equal(a, b) for a, b in zip(_params(model2), kept))
    assert state2.restore()
    assert state2.step == 1 and state2.commits == 1 and state2.restored_from == path
    assert state2.restored_world_size == 1
    assert all(torch.equal(a, b) for a, b in zip(_params(model2), kept))
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_nothing_to_restore_on_a_first_start(tmp_path):
    model, opt = _model_opt(0)
    before = _params(model)
    state = elastic.TorchState(model, opt, checkpoint=str(tmp_path / "none.pt"), step=0)
    assert not state.restore()
    assert state.restored_from is None and state.step == 0
    assert all(torch.equal(a, b) for a, b in zip(_params(model), before))


def test_checkpoint_every_k_commits_writes_the_file_on_the_kth(tmp_path):
    path = str(tmp_path / "ck.pt")
    model, opt = _model_opt(0)
    state = elastic.TorchState(model, opt, checkpoint=path, checkpoint_every=3, step=0)
    for i in range(1, 3):
        state.step = i
        state.commit()
        assert not os.path.exists(path)
    state.step = 3
    state.commit()
    fresh = elastic.TorchState(*_model_opt(1), checkpoint=path, step=0)
    assert fresh.restore() and fresh.step == 3


def test_checkpoint_path_and_interval_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(elastic.ENV_CHECKPOINT, str(tmp_path / "env.pt"))
    monkeypatch.setenv(elastic.ENV_CHECKPOINT_EVERY, "2")
    state = elastic.TorchState(*_model_opt(0), step=0)
    assert state.checkpoint == str(tmp_path / "env.pt") and state.checkpoint_every == 2


@pytest.mark.parametrize("every", [0, -1, "x"])
def test_a_bad_checkpoint_interval_is_refused(every):
    with pytest.raises(ValueError, match="checkpoint_every"):
        elastic.TorchState(None, None, checkpoint_every=every)


def test_run_calls_the_reset_callbacks_only_after_reading_a_checkpoint(tmp_path):
    path = str(tmp_path / "ck.pt")
    calls = []

    @elastic.run
    def train(state):
        return state.step

    first = elastic.TorchState(*_model_opt(0), checkpoint=path, step=0)
    first.register_reset_callbacks([lambda: calls.append("reset")])
    assert train(first) == 0 and calls == []
    first.step = 7
    first.commit()
    again = elastic.TorchState(*_model_opt(0), checkpoint=path, step=0)
    again.register_reset_callbacks([lambda: calls.append("reset")])
    assert train(again) == 7 and calls == ["reset"]


@pytest.mark.parametrize("error", [ValueError("a bug"), ConfigMismatchError("settings differ")])
def test_run_raises_what_is_not_a_peer_failure(error, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")

    @elastic.run
    def train(state):
        raise error

    with pytest.raises(type(error)):
        train(elastic.TorchState(None, None))


def test_run_raises_a_peer_failure_when_torchrun_will_not_restart(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")

    @elastic.run
    def train(state):
        raise EngineError("rank 1 died", ranks=(1,))

    with pytest.raises(EngineError):
        train(elastic.TorchState(None, None))


def test_run_leaves_the_process_on_a_peer_failure_for_torchrun_to_restart():
    script = textwrap.dedent("""
        import logging
        import hipress_like.torch as hpt
        from hipress_like.casync.errors import EngineError
        logging.basicConfig()

        @hpt.elastic.run
        def train(state):
            raise EngineError("rank 1: peer closed the connection", ranks=(1,))

        train(hpt.elastic.TorchState(None, None))
        print("not reached")
    """)
    env = dict(os.environ, TORCHELASTIC_MAX_RESTARTS="3", TORCHELASTIC_RESTART_COUNT="1")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == elastic.RESTART_EXIT_CODE, p.stdout + p.stderr
    assert "not reached" not in p.stdout
    assert "peer closed the connection" in p.stderr and "2 restart(s) left" in p.stderr
