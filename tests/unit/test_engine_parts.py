"""The engine's parts alone: task manager, coordinated rounds, replay, communicator.

Each part gets a small ``StepContext`` (``casync/context.py``) and a scripted
transport, with no engine and no threads: the computing executor is a
``SyncExecutor`` and the communicator runs inline. The transport plays a
peer (rank 1 of 2) that mirrors this rank: it reports what this rank
reports and holds the same tensors, so a sum doubles, unless a test edits
what the peer says.
"""
from typing import Callable, List, Optional

import pytest
import torch

from hipress_like.casync.comm import Communicator
from hipress_like.casync.config import EngineConfig
from hipress_like.casync.context import LayoutView, Life, StepContext
from hipress_like.casync.coordinator import (
    COLLECTIVE,
    FLAG_ERROR,
    FLAG_NONFINITE,
    RoundPlan,
    decode_report,
    encode_report,
    report_len,
)
from hipress_like.casync.engine import Engine
from hipress_like.casync.errors import EngineError, GradientMismatchError, WireError
from hipress_like.casync.executors import SyncExecutor
from hipress_like.casync.layout import msg_key
from hipress_like.casync.manager import TaskManager
from hipress_like.casync.replay import Replayer, Schedule
from hipress_like.casync.rounds import Rounds
from hipress_like.casync.step import Handle, StepState
from hipress_like.casync.tasks import Kind, Task, TaskGraph, TaskState
from hipress_like.casync.transport.base import PeerError, Transport
from hipress_like.casync.wire import frame, frame_nbytes, unframe
from hipress_like.cost_model.plan import Plan, SizeRule

CFG = EngineConfig(threads=False, timeout=5.0, idle_wait=0.0, idle_wait_max=0.0)


class MirrorPeer(Transport):
    """Rank 0 of 2; rank 1 sends back what rank 0 sends, unless ``edit_report`` or
    ``recv`` say otherwise. Records every call."""

    def __init__(self, edit_report: Optional[Callable] = None):
        self.rank, self.size = 0, 2
        self.calls: List[str] = []
        self.edit_report = edit_report
        self.sent: List = []  # alltoallv's send lists
        self.recv: List = [None, None]  # what rank 1 sends this rank in an alltoallv

    def allgather(self, tensor, timeout=0.0):
        self.calls.append("allgather")
        peer = tensor.clone()
        if self.edit_report is not None and tensor.dtype == torch.int64 \
                and tensor.numel() == report_len(CFG.report_capacity):
            peer = encode_report(self.edit_report(decode_report(tensor)), CFG.report_capacity)
        return [tensor.clone(), peer]

    def allreduce(self, tensor, op="sum", timeout=0.0):
        self.calls.append(f"allreduce:{op}")
        if op == "sum":
            tensor.mul_(2)
        return tensor

    def alltoallv(self, send, recv_nbytes, timeout=0.0, tag=None):
        self.calls.append("alltoallv")
        self.sent.append(list(send))
        return list(self.recv)

    def broadcast(self, tensor, root, timeout=0.0):
        self.calls.append(f"broadcast:{root}")
        return tensor

    def barrier(self, timeout=0.0):
        self.calls.append("barrier")


class Failing(MirrorPeer):
    def allgather(self, tensor, timeout=0.0):
        self.calls.append("allgather")
        raise PeerError("rank 1 stopped answering", ranks=[1])


def make_ctx(transport=None, layout=None):
    """A context with a task graph routed to a task manager (a SyncExecutor)."""
    box = {}
    graph = TaskGraph(lambda t: box["tm"].on_ready(t))
    errors = []

    def fail(err, idx):
        errors.append((err, idx))
        with ctx.cv:
            ctx.record_error(err, idx)
    ctx = StepContext(config=CFG, rank=0, size=2, transport=transport or MirrorPeer(),
                      graph=graph, layout=layout or LayoutView(), fail=fail,
                      deliver=lambda key, buf: box["tm"].deliver(key, buf))
    box["tm"] = TaskManager(ctx, SyncExecutor())
    return ctx, box["tm"], errors


def add_collective(ctx, key, values, root=None, grad="w"):
    """An encode task and the collective that sums (or broadcasts) its payload."""
    x = torch.tensor(values, dtype=torch.float32)
    enc = ctx.graph.add(Task(Kind.ENCODE, grad, 0, lambda: x))
    coll = ctx.graph.add(Task(Kind.ALLREDUCE, grad, 0, lambda p: p, msg=(key, COLLECTIVE),
                              root=root), [enc])
    ctx.st.coll_keys.add(key)
    return x, coll


# -- the task manager -------------------------------------------------------------

def test_a_ready_send_waits_in_the_outbox_and_is_reported():
    ctx, _, _ = make_ctx()
    payload = torch.arange(6, dtype=torch.uint8)
    enc = ctx.graph.add(Task(Kind.ENCODE, "w", 0, lambda: payload))
    send = ctx.graph.add(Task(Kind.SEND, "w", 0, lambda p: p, msg=(11, 1)), [enc])
    assert enc.state is TaskState.DONE  # the sync executor ran it inline
    assert ctx.st.outbox[(11, 1)] == (payload, send)
    assert ctx.st.unreported == [(11, 1, 6)] and send.nbytes == 6


def test_a_collective_with_a_root_records_the_root_once_its_payload_exists():
    ctx, _, _ = make_ctx()
    y, coll = add_collective(ctx, 22, [3.0], root=lambda: 1)
    assert ctx.st.collective == {22: (coll, y)}
    assert ctx.st.roots == {22: 1}
    assert ctx.st.unreported == [(22, COLLECTIVE, 4)]


def test_a_root_that_cannot_be_named_fails_the_gradient():
    ctx, _, errors = make_ctx(layout=LayoutView(index={"w": 2}))
    owner = {}  # the encode did not say who owns the round
    add_collective(ctx, 21, [1.0, 2.0], root=lambda: owner["rank"])
    assert isinstance(errors[0][0], KeyError) and errors[0][1] == 2
    assert ctx.st.collective == {} and ctx.st.roots == {}


def test_a_message_that_arrives_early_waits_for_its_recv():
    ctx, tm, _ = make_ctx()
    buf = torch.arange(4, dtype=torch.uint8)
    tm.deliver(7, buf)
    assert ctx.st.early[7] is buf
    recv = ctx.graph.add(Task(Kind.RECV, "w", 0, None, msg=(7, 1)))
    assert recv.state is TaskState.DONE and recv.result is buf and recv.nbytes == 4
    assert ctx.st.early == {} and ctx.st.expect == {}


def test_a_failing_task_calls_fail_with_its_gradient_index():
    ctx, _, errors = make_ctx(layout=LayoutView(index={"w": 5}))

    def boom():
        raise ValueError("bad payload")
    t = ctx.graph.add(Task(Kind.ENCODE, "w", 0, boom))
    assert [(str(e), i) for e, i in errors] == [("bad payload", 5)]
    assert t.state is TaskState.RUNNING and isinstance(ctx.error, ValueError)
    later = ctx.graph.add(Task(Kind.ENCODE, "w", 1, lambda: 1))
    assert later.state is TaskState.READY  # after an error no compute task runs


def test_a_write_task_completes_its_owners_handle():
    ctx, _, _ = make_ctx()
    out = torch.zeros(2)
    h = Handle("w", out, out, timeout=1.0, check=lambda: None)
    h.hold()
    ctx.graph.add(Task(Kind.WRITE, "w", 0, lambda: out.fill_(3.0), owner=h))
    assert not h.done()
    h.release()  # the building token
    assert h.done() and h.wait().tolist() == [3.0, 3.0]


# -- coordinated rounds -------------------------------------------------------------

def test_rounds_fuse_a_collective_every_rank_has_ready_and_finish_it():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr)
    x, coll = add_collective(ctx, 31, [1.0, 2.0, 3.0])
    ctx.become(Life.SEALED)
    assert Rounds(ctx).step() is False
    assert x.tolist() == [2.0, 4.0, 6.0]  # summed with the mirrored peer
    assert coll.state is TaskState.DONE and coll.result is x
    assert tr.calls == ["allgather", "allreduce:sum"]  # the closing round is skipped
    assert ctx.st.collective == {}


def test_rounds_say_a_step_is_skipped_when_a_peer_saw_nan():
    def nonfinite(r):
        r.flags |= FLAG_NONFINITE
        return r
    ctx, _, _ = make_ctx(MirrorPeer(nonfinite))
    add_collective(ctx, 31, [1.0])
    ctx.become(Life.SEALED)
    assert Rounds(ctx).step() is True


def test_rounds_name_the_rank_and_gradient_of_a_peers_error():
    def erred(r):
        r.flags |= FLAG_ERROR
        r.error_arg = 4
        return r
    ctx, _, _ = make_ctx(MirrorPeer(erred), layout=LayoutView(names={4: "fc.weight"}))
    add_collective(ctx, 31, [1.0])
    with pytest.raises(EngineError, match=r"rank 1 \(gradient 'fc.weight'\)") as e:
        Rounds(ctx).step()
    assert e.value.ranks == (1,) or list(e.value.ranks) == [1]


def test_rounds_raise_a_mismatch_when_sealed_ranks_submitted_different_sets():
    def other(r):
        r.digest ^= 1
        return r
    ctx, _, _ = make_ctx(MirrorPeer(other))
    ctx.st.submitted.add("w")
    ctx.become(Life.SEALED)
    with pytest.raises(GradientMismatchError, match="step 0"):
        Rounds(ctx).step()


def test_a_round_sends_its_links_batch_and_delivers_what_arrives():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr)
    payload = torch.arange(5, dtype=torch.uint8)
    enc = ctx.graph.add(Task(Kind.ENCODE, "w", 0, lambda: payload))
    send = ctx.graph.add(Task(Kind.SEND, "w", 0, lambda p: p, msg=(40, 1)), [enc])
    recv = ctx.graph.add(Task(Kind.RECV, "w", 0, None, msg=(41, 1)))
    # the peer's 3 bytes, framed (wire.py) as rank 1 sends them to rank 0 in step 0
    tr.recv = [None, frame([torch.arange(3, dtype=torch.uint8)], src=1, dst=0, step=0)]
    Rounds(ctx).run_round(RoundPlan({(0, 1): [(40, 5)], (1, 0): [(41, 3)]}), 0.0, tr)
    sent, = unframe(tr.sent[0][1], [5], src=0, dst=1, step=0)
    assert sent.tolist() == [0, 1, 2, 3, 4]
    assert send.state is TaskState.DONE and recv.state is TaskState.DONE
    assert recv.result.tolist() == [0, 1, 2]


def test_a_short_message_from_a_peer_is_an_error_naming_it():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr)
    ctx.graph.add(Task(Kind.RECV, "w", 0, None, msg=(41, 1)))
    tr.recv = [None, torch.zeros(3, dtype=torch.uint8)]
    with pytest.raises(EngineError, match=f"rank 1 sent 3 bytes, expected {frame_nbytes([3])}"):
        Rounds(ctx).run_round(RoundPlan({(1, 0): [(41, 3)]}), 0.0, tr)


def test_a_flipped_bit_in_a_peers_message_is_a_wire_error_naming_it_and_the_gradient():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr, layout=LayoutView(names={0: "fc.weight"}))
    key = msg_key(0, 2, 0, 1)
    recv = ctx.graph.add(Task(Kind.RECV, "fc.weight", 0, None, msg=(key, 1)))
    msg = frame([torch.arange(16, dtype=torch.uint8)], src=1, dst=0, step=0)
    msg[-1] ^= 4
    tr.recv = [None, msg]
    with pytest.raises(WireError, match=r"from rank 1 .*gradient 'fc.weight' partition 2") as e:
        Rounds(ctx).run_round(RoundPlan({(1, 0): [(key, 16)]}), 0.0, tr)
    assert e.value.ranks == (1,) and recv.state is not TaskState.DONE


# -- replay -------------------------------------------------------------------------

def _sched(*keys_sizes):
    return Schedule.of([[(k, n, torch.float32)] for k, n in keys_sizes])


def test_replay_runs_the_schedule_with_no_metadata_round():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr)
    x, coll = add_collective(ctx, 51, [1.0, 2.0])
    y, coll2 = add_collective(ctx, 52, [5.0])
    ctx.become(Life.SEALED)
    assert Replayer(ctx, tr).step(_sched((51, 2), (52, 1))) is False
    assert x.tolist() == [2.0, 4.0] and y.tolist() == [10.0]
    assert tr.calls == ["allreduce:sum", "allreduce:sum"]  # status words ride along
    assert coll.state is TaskState.DONE and coll2.state is TaskState.DONE


def test_replay_carries_a_skip_in_the_status_words():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr)
    add_collective(ctx, 51, [1.0])
    ctx.st.nonfinite = True
    ctx.become(Life.SEALED)
    assert Replayer(ctx, tr).step(_sched((51, 1))) is True


def test_replay_of_a_step_with_other_gradients_misses_and_leaves_them_unchanged():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr)
    x, coll = add_collective(ctx, 51, [1.0, 2.0])
    ctx.become(Life.SEALED)
    assert Replayer(ctx, tr).step(_sched((99, 2))) is None  # 51 is not in the schedule
    assert x.tolist() == [1.0, 2.0] and coll.state is TaskState.READY
    assert 51 in ctx.st.collective  # left for the coordinated rounds


def test_replay_after_an_error_stops_before_touching_the_members():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr)
    x, _ = add_collective(ctx, 51, [1.0])
    ctx.fail(RuntimeError("encode failed"), 0)
    assert Replayer(ctx, tr).step(_sched((51, 1))) is None
    assert x.tolist() == [1.0]


# -- the communicator -----------------------------------------------------------------

def test_a_coordinated_step_records_a_schedule_that_the_next_step_replays():
    tr = MirrorPeer()
    ctx, _, _ = make_ctx(tr)
    comm = Communicator(ctx, threaded=False)
    comm.replayable = True
    for step in range(2):
        x, _ = add_collective(ctx, 61, [1.0, 1.0])
        ctx.become(Life.SEALED)
        comm.run_step()
        assert x.tolist() == [2.0, 2.0] and ctx.error is None
        ctx.st = StepState(step + 1)
        ctx.become(Life.OPEN)
    assert comm.schedule is not None and comm.schedule.keys == {61}
    assert comm.replayed == 1
    assert tr.calls == ["allgather", "allreduce:sum", "allreduce:sum"]


def test_a_failed_step_breaks_the_communicator_and_becomes_the_error():
    tr = Failing()
    ctx, _, errors = make_ctx(tr)
    comm = Communicator(ctx, threaded=False)
    ctx.become(Life.SEALED)
    comm.run_step()
    assert ctx.life is Life.BROKEN and isinstance(ctx.error, PeerError)
    assert errors[0][1] == -1
    comm.run_step()  # broken: the transport is not used again
    assert tr.calls == ["allgather"]


# -- the lifecycle --------------------------------------------------------------------

def test_the_lifecycle_refuses_a_transition_it_does_not_draw():
    ctx, _, _ = make_ctx()
    ctx.become(Life.STEPPING)
    assert not ctx.sealed
    ctx.become(Life.SEALED)
    assert ctx.sealed
    with pytest.raises(RuntimeError, match="from sealed to one of"):
        ctx.become(Life.STEPPING)
    ctx.broken()
    assert ctx.life is Life.BROKEN
    with pytest.raises(RuntimeError):
        ctx.become(Life.OPEN)


def test_a_closing_engine_that_told_its_peers_is_closed():
    ctx, _, _ = make_ctx()
    ctx.become(Life.CLOSING)
    ctx.broken()
    assert ctx.life is Life.CLOSED


def test_tasks_are_built_whole():
    h = Handle("w", torch.zeros(1), torch.zeros(1), timeout=1.0, check=lambda: None)
    t = Task(Kind.WRITE, "w", 0, None, msg=(3, 1), owner=h, root=lambda: 2)
    assert t.msg == (3, 1) and t.owner is h and t.root() == 2
    assert Task(Kind.ENCODE, "w", 0, None).msg is None


# -- the engine takes its executor ------------------------------------------------------

class Solo(MirrorPeer):
    """One rank alone: every collective returns its input."""

    def __init__(self):
        super().__init__()
        self.size = 1

    def allgather(self, tensor, timeout=0.0):
        return [tensor.clone()]

    def allreduce(self, tensor, op="sum", timeout=0.0):
        return tensor


class Counting(SyncExecutor):
    def __init__(self):
        super().__init__()
        self.submitted = 0
        self.stopped = False

    def submit(self, fn):
        self.submitted += 1
        super().submit(fn)

    def shutdown(self):
        self.stopped = True


def test_the_engine_runs_compute_tasks_on_the_executor_it_is_given():
    ex = Counting()
    plan = Plan(compressor="onebit", rule=SizeRule(min_compress_bytes=0))
    eng = Engine(Solo(), EngineConfig(threads=False, compressor="onebit", plan=plan),
                 executor=ex)
    eng.register([("w", (64,), torch.float32)])
    g = torch.ones(64)
    eng.submit("w", g)
    assert eng.synchronize() is True
    assert ex.submitted >= 2  # at least an encode and a write ran on it
    assert torch.allclose(g, torch.ones(64))  # one rank: onebit of a constant is exact
    eng.close()
    assert ex.stopped
