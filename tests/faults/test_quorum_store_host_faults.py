"""Under partial aggregation, the death of rank 0 (the rendezvous store's host) is named.

The quorum lane agrees on each step's contributors through the transport's
store, which global rank 0 hosts. When rank 0's process dies, a survivor's
next store call finds the connection gone; its error used to read
"partial aggregation failed: Connection reset by peer", naming neither rank 0
nor the store. Ranks are started as torchrun starts them (env://) and run a
plain training loop on ``hipress_like.torch`` with ``stragglers=Quorum(...)``;
rank 0 exits without any teardown once a few steps are applied.
"""
import textwrap

import pytest
from env_ranks import result, run_env_ranks

pytestmark = pytest.mark.faults

TIMEOUT = 20  # the job's timeout (hpt.init and the lane), seconds
_SCRIPT = textwrap.dedent("""
    import json, os, time
    import torch
    import hipress_like.torch as hpt

    hpt.init(timeout=TIMEOUT)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = hpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   stragglers=hpt.Quorum(fraction=0.5, deadline=0.02),
                                   timeout=TIMEOUT)
    last = time.monotonic()
    try:
        while opt.steps < 500:
            if opt.steps >= 5 and hpt.rank() == 0:
                os._exit(9)  # the store's host dies: no teardown, no goodbye
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).sum().backward()
            opt.step()
            last = time.monotonic()
    except Exception as e:
        print("RESULT " + json.dumps({
            "rank": hpt.rank(), "type": type(e).__name__, "ranks": list(getattr(e, "ranks", ())),
            "msg": str(e)[:3000], "after": time.monotonic() - last, "steps": opt.steps}),
            flush=True)
        raise
    print("RESULT " + json.dumps({"rank": hpt.rank(), "type": None, "steps": opt.steps}))
""")


def test_every_survivor_of_the_store_hosts_death_names_rank_0_and_the_store():
    rcs, outs = run_env_ranks(f"TIMEOUT = {TIMEOUT}\n" + _SCRIPT, 3, timeout=180)
    assert rcs[0] == 9, outs[0][-3000:]
    for r in (1, 2):
        got = result(outs[r])
        assert rcs[r] != 0, (r, outs[r][-3000:])
        assert got["type"] == "QuorumError", (r, got)
        assert got["steps"] >= 5, (r, got)  # it trained with rank 0 before
        assert 0 in got["ranks"], (r, got)
        assert "global rank 0" in got["msg"] and "store" in got["msg"], (r, got)
        assert f"rank {r}: partial aggregation failed because rank(s) [0]" in got["msg"], got
        # noticed within the job's timeout (plus start-up margin), not never
        assert got["after"] < TIMEOUT + 15, (r, got)
