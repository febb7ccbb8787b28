"""Horovod's calls beyond the compressed collectives, on real ranks without Horovod.

Outside horovodrun, ``hipress_like.torch`` runs ``reducescatter``,
``alltoall``, the grouped forms and sparse allreduce over torch.distributed
(``adapters/horovod_calls.py``), with Horovod's semantics: the split of
rows (the first ``rows % size`` ranks get one more), the received splits,
any dtype, and the gradients Horovod defines (also for allreduce, allgather
and broadcast). The calls only Horovod's runtime provides (join, the
timeline, SyncBatchNorm) raise an error naming how to get them; process
sets are torch.distributed groups, and one that differs across ranks is an
error on every rank.
3 ranks, so splits are uneven.
"""
import torch

import hipress_like.torch as hpt
from hipress_like.launch.launch import run_workers


def calls_worker(ctx):
    hpt.init()
    r, n = hpt.rank(), hpt.size()
    out = {}
    # reducescatter: 7 rows over 3 ranks -> 3, 2, 2 (Horovod's split)
    x = (torch.arange(7 * 2, dtype=torch.float32).reshape(7, 2) * (r + 1)).requires_grad_()
    rs = hpt.reducescatter(x, op=hpt.Sum)
    out["rs"] = rs.tolist()
    rs.backward(torch.ones_like(rs))
    out["rs_grad"] = x.grad.tolist()
    out["rs_avg_int"] = hpt.reducescatter(torch.full((n, 2), r + 1, dtype=torch.int32)).tolist()
    h = hpt.reducescatter_async(torch.ones(n * 2), op=hpt.Sum)
    out["rs_async"] = (hpt.poll(h), hpt.synchronize(h).tolist())
    out["grs"] = [t.tolist() for t in hpt.grouped_reducescatter(
        [torch.ones(n), torch.full((n, 2), float(r))], op=hpt.Sum)]
    try:
        hpt.reducescatter(torch.tensor(1.0))
        out["rs_scalar"] = "no error"
    except ValueError as e:
        out["rs_scalar"] = str(e)
    # alltoall: rank r sends q+1 rows of value 10*r+q to rank q, int16 (gloo lacks it)
    rows = torch.cat([torch.full((q + 1, 2), 10 * r + q, dtype=torch.int16) for q in range(n)])
    got, recv = hpt.alltoall(rows, torch.tensor([q + 1 for q in range(n)], dtype=torch.int32))
    out["a2a"] = (got.dtype == torch.int16, got[:, 0].tolist(), recv.tolist())
    y = torch.arange(2 * n, dtype=torch.float64).requires_grad_()
    eq = hpt.alltoall(y)
    (eq * (r + 1)).sum().backward()
    out["a2a_eq"] = (eq.tolist(), y.grad.tolist())
    try:
        hpt.alltoall(torch.ones(n + 1))
        out["a2a_bad"] = "no error"
    except ValueError as e:
        out["a2a_bad"] = str(e)
    # grouped forms
    out["gag"] = [t.tolist() for t in hpt.grouped_allgather(
        [torch.tensor([r]), torch.full((r + 1, 2), r)])]
    ts = [torch.ones(2) * r, torch.ones(3) * r]
    back = hpt.grouped_allreduce_(ts, op=hpt.Sum)
    out["gar_"] = (back[0] is ts[0], [t.tolist() for t in ts])
    out["gar_async"] = [t.tolist() for t in hpt.synchronize(
        hpt.grouped_allreduce_async([torch.ones(2) * r], op=hpt.Max))]
    # gradients of the compressed-path collectives, as Horovod defines them
    a = torch.ones(3, requires_grad=True)
    hpt.allreduce(a, op=hpt.Sum).backward(torch.ones(3))
    g = torch.ones(r + 1, 2, requires_grad=True)
    ga = hpt.allgather(g)
    ga.backward(torch.arange(ga.numel(), dtype=torch.float32).reshape(ga.shape))
    b = torch.ones(2, requires_grad=True)
    hpt.broadcast(b, root_rank=1).backward(torch.ones(2) * 3)
    out["grads"] = (a.grad.tolist(), g.grad.tolist(), b.grad.tolist())
    # sparse allreduce: Horovod's allgather of indices and values
    sp = torch.sparse_coo_tensor(torch.tensor([[r], [0]]), torch.tensor([float(r + 1)]), (n, 2))
    out["sparse"] = hpt.synchronize(hpt.sparse_allreduce_async(sp, "sp", hpt.Sum)).to_dense()\
        .tolist()
    # the Horovod-only calls name what to do
    refused = {}
    for call, fn in (("join", hpt.join),
                     ("start_timeline", lambda: hpt.start_timeline("/tmp/x.json")),
                     ("SyncBatchNorm", lambda: hpt.SyncBatchNorm(4))):
        try:
            fn()
            refused[call] = "no error"
        except hpt.HorovodRequiredError as e:
            refused[call] = str(e)
    out["refused"] = refused
    out["ccl"] = (hpt.ccl_built(), hpt.global_process_set.size())
    # a process set (a torch.distributed group): ranks 0 and 2
    ps = hpt.add_process_set([0, 2])
    out["ps"] = (ps.included(), ps.size(), ps.rank())
    if ps.included():
        out["ps_sum"] = hpt.allreduce(torch.tensor([float(r)]), op=hpt.Sum,
                                      process_set=ps).tolist()
        out["ps_gather"] = hpt.allgather(torch.tensor([r]), process_set=ps).tolist()
        out["ps_bcast"] = hpt.broadcast(torch.tensor([r]), root_rank=2, process_set=ps).tolist()
        out["ps_rs"] = hpt.reducescatter(torch.arange(4.), op=hpt.Sum, process_set=ps).tolist()
        out["ps_a2a"] = hpt.alltoall(torch.tensor([10 * r, 10 * r + 1]), process_set=ps).tolist()
        out["ps_obj"] = hpt.broadcast_object({"from": r} if r == 0 else None, root_rank=0,
                                             process_set=ps)
        hpt.barrier(process_set=ps)
    try:
        hpt.add_process_set([2, 0])
        out["ps_dup"] = "no error"
    except ValueError as e:
        out["ps_dup"] = str(e)
    out["ps_removed"] = (hpt.remove_process_set(ps), hpt.remove_process_set(ps))
    hpt.barrier(process_set=hpt.global_process_set)
    return out


def test_horovod_calls_over_torch_distributed():
    res = run_workers(calls_worker, 3, timeout=180)
    n = 3
    base = torch.arange(14, dtype=torch.float32).reshape(7, 2) * 6  # sum of (r+1)
    own = {0: base[0:3], 1: base[3:5], 2: base[5:7]}
    for r, out in enumerate(res):
        assert out["rs"] == own[r].tolist(), r
        assert out["rs_grad"] == [[float(n)] * 2] * 7  # Sum: the gathered grad times size
        assert out["rs_avg_int"] == [[2, 2]]  # (1+2+3)/3
        assert out["rs_async"][1] == [3.0, 3.0]
        assert out["grs"] == [[3.0], [[3.0, 3.0]]]
        assert "scalar" in out["rs_scalar"]
        same_dtype, values, recv = out["a2a"]
        assert same_dtype and recv == [r + 1] * n
        assert values == sum(([10 * q + r] * (r + 1) for q in range(n)), [])
        got, grad = out["a2a_eq"]
        # rank r receives element pair r of each rank's arange: values 2r, 2r+1 from each
        assert got == [float(2 * r), float(2 * r + 1)] * n
        # the gradient goes back along the splits: rank q's rows carry rank q's (q+1)
        assert grad == [float(q + 1) for q in range(n) for _ in range(2)]
        assert "cannot be split equally" in out["a2a_bad"]
        assert out["gag"] == [[0, 1, 2], [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]]
        assert out["gar_"] == (True, [[3.0, 3.0], [3.0, 3.0, 3.0]])
        assert out["gar_async"] == [[2.0, 2.0]]
        a_grad, g_grad, b_grad = out["grads"]
        assert a_grad == [float(n)] * 3
        start = sum(q + 1 for q in range(r)) * 2  # this rank's rows of the (equal) grads
        assert g_grad == torch.arange(start, start + 2 * (r + 1), dtype=torch.float32)\
            .reshape(r + 1, 2).tolist()
        assert b_grad == ([3.0, 3.0] if r == 1 else [0.0, 0.0])
        assert out["sparse"] == [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]
        for call, msg in out["refused"].items():
            assert f"hvd.{call}" in msg and "horovodrun" in msg and "install" in msg, msg
        assert out["ccl"] == (False, n)
        assert out["ps"] == ((True, 2, r // 2) if r != 1 else (False, 2, -1))
        if r != 1:  # the set's collectives span ranks 0 and 2 only
            assert out["ps_sum"] == [2.0] and out["ps_gather"] == [0, 2]
            assert out["ps_bcast"] == [2] and out["ps_obj"] == {"from": 0}
            assert out["ps_rs"] == ([0.0, 2.0] if r == 0 else [4.0, 6.0])
            assert out["ps_a2a"] == ([0, 20] if r == 0 else [1, 21])
        assert "duplicate process set" in out["ps_dup"]
        assert out["ps_removed"] == (True, False)


def ps_mismatch_worker(ctx):
    hpt.init()
    try:
        hpt.add_process_set([0] if hpt.rank() == 0 else [1])
    except ValueError as e:  # CollectiveMismatchError, on every rank
        return str(e)
    return "no error"


def test_a_process_set_that_differs_across_ranks_is_an_error_not_a_hang():
    for msg in run_workers(ps_mismatch_worker, 2, timeout=120):
        assert "add_process_set" in msg and "ranks" in msg, msg


def mismatch_worker(ctx):
    hpt.init()
    t = torch.ones(2, dtype=torch.float32 if hpt.rank() else torch.int32)
    try:
        hpt.alltoall(t)
    except ValueError as e:
        return str(e)
    return "no error"


def test_alltoall_dtype_mismatch_is_an_error_on_every_rank():
    for msg in run_workers(mismatch_worker, 2, timeout=120):
        assert "alltoall" in msg and "dtype" in msg, msg
