"""Horovod-style functional collectives of hipress_like.torch on real ranks."""
import torch
from torch import nn

import hipress_like.torch as hpt
from hipress_like.launch.launch import run_workers


def collectives_worker(ctx):
    hpt.init()
    r, n = hpt.rank(), hpt.size()
    assert (r, n) == (ctx.rank, ctx.size)
    out = {}
    t = torch.tensor([float(r), 1.0])
    out["avg"] = hpt.allreduce(t).tolist()
    out["sum"] = hpt.allreduce(t, op=hpt.Sum).tolist()
    out["max"] = hpt.allreduce(t, op=hpt.Max).tolist()
    out["fp16"] = hpt.allreduce(t, compression=hpt.Compression.fp16).tolist()
    assert t.tolist() == [float(r), 1.0]  # allreduce returns a new tensor
    inplace = t.clone()
    hpt.allreduce_(inplace, op=hpt.Sum)
    out["inplace"] = inplace.tolist()
    h = hpt.allreduce_async(torch.full((3,), float(r)))
    out["async"] = hpt.synchronize(h).tolist()
    out["grouped"] = [x.tolist() for x in hpt.grouped_allreduce([t, 2 * t])]
    out["gather"] = hpt.allgather(torch.full((r + 1, 2), r)).tolist()  # uneven first dims
    out["bcast"] = hpt.broadcast(torch.tensor([r * 10]), root_rank=n - 1).tolist()
    out["obj"] = hpt.broadcast_object({"epoch": 7, "name": f"r{r}", "t": torch.ones(2) * r},
                                      root_rank=1)
    out["obj"]["t"] = out["obj"]["t"].tolist()
    out["gather_obj"] = hpt.allgather_object((r, f"x{r}"))
    g = torch.Generator().manual_seed(r)
    lossy = hpt.allreduce(torch.randn(1000, generator=g), compression="topk")
    out["lossy"] = lossy.sum().item()  # bitwise identical on every rank
    torch.manual_seed(r)  # different init per rank, then rank 0's wins
    m = nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.01 * (r + 1))
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    hpt.broadcast_parameters(m.state_dict(), root_rank=0)
    hpt.broadcast_optimizer_state(opt, root_rank=0)
    out["params"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()
    out["lr"] = opt.param_groups[0]["lr"]
    out["exp_avg"] = opt.state[m.weight]["exp_avg"].reshape(-1).tolist()
    # a fresh optimizer (no state yet) with a frozen integer parameter: zero
    # grads appear where gradients will (as after Horovod's call), nothing steps
    fresh = nn.Module()
    fresh.idx = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    fresh.w = nn.Parameter(torch.full((4,), float(r)))
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
    hpt.broadcast_optimizer_state(opt2, root_rank=0)
    out["fresh"] = (fresh.idx.grad is None, fresh.w.grad.tolist(), fresh.w.tolist(),
                    len(opt2.state))
    hpt.barrier()
    return out


def test_functional_collectives():
    res = run_workers(collectives_worker, 3, timeout=120)
    n = 3
    for out in res:
        assert out["avg"] == [1.0, 1.0]
        assert out["sum"] == [3.0, 3.0]
        assert out["max"] == [2.0, 1.0]
        assert out["fp16"] == [1.0, 1.0]
        assert out["inplace"] == [3.0, 3.0]
        assert out["async"] == [1.0] * 3
        assert out["grouped"] == [[1.0, 1.0], [2.0, 2.0]]
        assert out["gather"] == [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]
        assert out["bcast"] == [(n - 1) * 10]
        assert out["obj"] == {"epoch": 7, "name": "r1", "t": [1.0, 1.0]}
        assert out["gather_obj"] == [(0, "x0"), (1, "x1"), (2, "x2")]
        for key in ("lossy", "params", "lr", "exp_avg"):
            assert out[key] == res[0][key], key
    assert res[0]["lr"] == 0.01
    for r, out in enumerate(res):
        assert out["fresh"] == (True, [0.0] * 4, [float(r)] * 4, 0)
