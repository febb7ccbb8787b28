"""Compressor state saved on N ranks, loaded on M (adapters.checkpoint.reshard / unpack).

Error-feedback memories become (1/N) sum_i e_i on every new rank, so the
averaged update still owes the same amount; shared state (PowerSGD's Q)
carries over; what cannot be resharded is reset and named in a
``CompressorStateReset`` warning. Real ranks: tests/multiprocess/test_checkpoint_resume.py.
"""
import pytest
import torch

from hipress_like.adapters import checkpoint
from hipress_like.compressors.base import mix_seed

LAYOUT = {"w": {"workflow": "rounds-allreduce", "partitions": [[0, 12]]},
          "b": {"workflow": "ps", "partitions": [[0, 3]]}}


def _engines(n):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 2, generator=g)
    out = []
    for r in range(n):
        states = {
            "w|0|rounds": {"error": torch.randn(3, 4, generator=g),
                           "error_p": torch.randn(3, 2, generator=g), "q": q.clone(),
                           "step": 7, "seed": 100 + r, "shared_seed": 42, "world_size": n,
                           "step_seed": 9},
            "b|0|push" if r else "b|0|pull": {"error": torch.randn(3, generator=g),
                                              "inner": {"seed": r, "step": 0}},
        }
        out.append({"format": "hipress-like-engine", "version": 1, "step": 7,
                    "compressor": "C", "compressors": {}, "states": states,
                    "replay_schedule": [1, 2]})
    return out


@pytest.mark.parametrize("n,m", [(4, 2), (2, 4), (3, 5)])
def test_error_feedback_is_averaged_shared_state_carried_and_ps_sites_reset(n, m):
    engines, news = _engines(n), []
    for j in range(m):
        new, reset = checkpoint.reshard(engines, LAYOUT, LAYOUT, j, m)
        st = new["states"]["w|0|rounds"]
        for f in ("error", "error_p"):
            # the same formula written out: a sum over the N saved ranks, divided by N
            want = sum((e["states"]["w|0|rounds"][f] for e in engines[1:]),
                       engines[0]["states"]["w|0|rounds"][f].clone()) / n
            assert torch.equal(st[f], want), f
        news.append(st["error"])
        assert torch.equal(st["q"], engines[0]["states"]["w|0|rounds"]["q"])
        assert (st["step"], st["shared_seed"], st["world_size"]) == (7, 42, m)
        assert st["seed"] == (100 + j if j < n else mix_seed(100 + j % n, j))
        assert set(new["states"]) == {"w|0|rounds"}
        assert new["replay_schedule"] is None and new["step"] == 7
        assert sorted(r.split(":")[0] for r in reset) == ["b|0|pull", "b|0|push"]
        assert all("PS/Ring" in r for r in reset)
    # (1/M) sum_j e'_j = (1/N) sum_i e_i: the averaged update owes the same amount
    owed = sum(e["states"]["w|0|rounds"]["error"] for e in engines) / n
    assert torch.allclose(sum(news) / m, owed, rtol=1e-6, atol=1e-7)


def test_a_layout_change_an_unknown_field_or_unequal_q_resets_that_state():
    engines = _engines(2)
    moved = {**LAYOUT, "w": {"workflow": "rounds-allreduce", "partitions": [[0, 6], [6, 12]]}}
    new, reset = checkpoint.reshard(engines, LAYOUT, moved, 0, 3)
    assert "w|0|rounds" not in new["states"]
    assert any(r.startswith("w|0|rounds: layout differs") for r in reset)

    engines[1]["states"]["w|0|rounds"]["q"] += 1
    new, reset = checkpoint.reshard(engines, LAYOUT, LAYOUT, 0, 3)
    assert any("'q' should be equal on every rank" in r for r in reset)

    engines = _engines(2)
    for e in engines:
        e["states"]["w|0|rounds"]["gain"] = [0.1, 0.2]
    new, reset = checkpoint.reshard(engines, LAYOUT, LAYOUT, 0, 3)
    assert any("'gain' has no resharding rule" in r for r in reset)


def test_unpack_reshards_an_all_ranks_envelope_and_names_what_it_resets():
    engines = _engines(4)
    hip = checkpoint.pack({}, 0, 4, engines, LAYOUT)
    with pytest.warns(checkpoint.CompressorStateReset, match=r"saved with 4 ranks, this run "
                      r"has 2: resharded, except 2 state\(s\) that cannot be and start fresh: "
                      r"b\|0\|pull \(site 'pull' .*\); b\|0\|push \(site 'push'"):
        st = checkpoint.unpack(hip, 1, 2, where="ck.pt", fix="", layout=LAYOUT)
    assert "w|0|rounds" in st["states"]


def test_one_ranks_state_with_another_world_size_starts_fresh_and_says_why():
    hip = checkpoint.pack(_engines(1)[0], 0, 4)
    with pytest.warns(checkpoint.CompressorStateReset, match="all_ranks=True"):
        assert checkpoint.unpack(hip, 0, 2, where="x", fix="", layout=LAYOUT) is None
    # same world size: this rank's own state, as before
    assert checkpoint.unpack(checkpoint.pack({"a": 1}, 1, 2), 1, 2, where="x",
                             fix="") == {"a": 1}
