"""plan="adaptive" with AR-Topk: the ratio search runs inside the same mechanism.

Two ranks (gloo on loopback) train test_torch_optimizer's model with ``star_topk``
under ``plan=hpt.Adaptive(ratio=AdaptiveCRConfig(...))``, on a profile of a slow link
(the plan compresses the large gradients). No CR is chosen at start, so a search
begins after the first step: each candidate ratio runs two real steps from the
snapshot the optimizer gives, the snapshot is put back and the ratio on NSGA-II's
Pareto set with the least time per unit of gain is set on the compressors. Every
rank tries and chooses alike, the parameters and the optimizer's momenta after the
search are the snapshot's (bitwise), the replicas stay identical, and a state dict
saved after the search gives a fresh optimizer the chosen ratio.
"""
import torch
import torch.nn.functional as F
from shared_launch import ranks, run_shared  # tests/multiprocess is on sys.path (rootdir)
from test_adaptive_plan import SLOW, N
from test_torch_optimizer import _batch, _digest, _model

import hipress_like.torch as hpt
from hipress_like.cost_model import Link, Profile
from hipress_like.tuning.adaptive_cr import AdaptiveCRConfig
from hipress_like.tuning.profiler import profile_compressor
from hipress_like.tuning.ratio_search import searchable

CANDIDATES = (0.1, 0.02)


def _slow(step, rank):
    return Link(*SLOW)


def ratio_worker(ctx, profile_path):
    hpt.init()
    model = _model()

    def build():
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        cfg = AdaptiveCRConfig(candidates=CANDIDATES, explore_iters=2, check_every=50)
        return hpt.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(),
            compression=hpt.Compression.get("star_topk", ratio=0.1),
            plan=hpt.Adaptive(check_every=4, profile=profile_path, estimate=_slow, ratio=cfg))

    opt = build()
    out = {"digests": [], "ratios": [], "momenta": []}
    for step in range(9):
        x, y = _batch(ctx.rank, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out["digests"].append(_digest(model))
        out["momenta"].append(torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                                         for p in model.parameters()]).sum().item())
        out["ratios"].append(sorted({c.ratio for c in searchable(opt.engine)}))
    out["history"] = [{k: v for k, v in h.items() if k != "trials"}
                      for h in opt.online.history]
    out["trials"] = [len(h["trials"]) for h in opt.online.history if "trials" in h]
    sd = opt.state_dict()
    opt.close()
    fresh = build()  # starts at ratio 0.1; the state dict's ratio is set on load
    fresh.load_state_dict(sd)
    out["loaded"] = sorted({c.ratio for c in searchable(fresh.engine)})
    fresh.close()
    return out


def test_the_ratio_search_runs_from_a_snapshot_and_every_rank_chooses_alike(tmp_path):
    cp = profile_compressor("star_topk", sizes=[4096, 16384, 65536], repeats=3, min_time=0.0,
                            params={"ratio": 0.1})
    path = tmp_path / "profile.json"
    Profile(link=Link(*SLOW), compressors={"star_topk": cp}, meta={"ranks": N}).save(path)
    res = ranks(run_shared(N, [(ratio_worker, (str(path),))], timeout=600)[0])
    r0 = res[0]
    for r in res[1:]:
        assert r["digests"] == r0["digests"] and r["ratios"] == r0["ratios"]
        assert r["history"] == r0["history"]
    began = [h for h in r0["history"] if "ratio_search" in h]
    ended = [h for h in r0["history"] if "ratio_chosen" in h]
    assert began and began[0]["step"] == 1 and "no CR chosen yet" in began[0]["ratio_search"]
    assert ended[0]["step"] == 1 + 2 * len(CANDIDATES)
    assert r0["trials"][0] == len(CANDIDATES)
    # after the search the parameters and the momenta are the snapshot's, taken after step 1
    assert r0["digests"][ended[0]["step"] - 1] == r0["digests"][0]
    assert r0["momenta"][ended[0]["step"] - 1] == r0["momenta"][0] != r0["momenta"][1]
    chosen = ended[0]["ratio_chosen"]
    assert chosen in CANDIDATES and r0["ratios"][ended[0]["step"] - 1] == [chosen]
    assert r0["ratios"][-1] == [chosen] and r0["loaded"] == [chosen]
