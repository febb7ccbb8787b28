"""What the frameworks' plan="adaptive" tests share (TensorFlow and Gluon alike): the
profiles they plan from and the checks of a job's switches and of its resume.

The compressor curves are measured here, on the machine that runs the test, and put
on the fast link the injected schedule starts from (``Adaptive(profile=...)``: every
rank then plans from the same file without profiling). The schedule is fast, slow
from step 8, fast from step 16, checked every 5 steps: both faces' jobs must switch
at the checks of steps 10 and 20.
"""
from pathlib import Path
from typing import Dict, List, Sequence

FAST = (2e-6, 12.5e9)  # 2 us + 100 Gbit/s: the reference link of the schedules
SLOW = (1e-3, 1.25e6)  # 1 ms + 10 Mbit/s: the ratio search's link (the kernel compressed)
RATIOS = (0.1, 0.02)  # the ratio search's candidates, two steps each (the jobs' --ratio)
AUTO = ("dgc", "onebit", "powersgd", "terngrad")  # compression="auto"'s candidates here


def profile_file(path: Path, labels: Sequence[str], n: int) -> str:
    """A profile of ``labels`` (curves measured here) on ``FAST``, saved to ``path``."""
    from hipress_like.cost_model import Link, Profile
    from hipress_like.tuning.auto import DEFAULT_CANDIDATES
    from hipress_like.tuning.profiler import candidate, profile_compressor

    comps = {c: profile_compressor(*candidate(c, DEFAULT_CANDIDATES[c]),
                                   sizes=[4096, 16384, 65536], repeats=3, min_time=0.0)
             for c in labels}
    Profile(link=Link(*FAST), compressors=comps, meta={"ranks": n}).save(path)
    return str(path)


def profiles(folder: Path, n: int) -> Dict[str, str]:
    """{"onebit": a onebit profile, "auto": one of ``AUTO``}, saved under ``folder``."""
    return {"onebit": profile_file(folder / "onebit.json", ["onebit"], n),
            "auto": profile_file(folder / "auto.json", list(AUTO), n)}


def ratio_profile(path: Path, n: int) -> str:
    """A profile of ``star_topk`` (ratio 0.1, measured here) on ``SLOW``, saved to ``path``:
    the plan compresses the large kernel, so AR-Topk's ratio search has a compressor."""
    from hipress_like.cost_model import Link, Profile
    from hipress_like.tuning.profiler import profile_compressor

    cp = profile_compressor("star_topk", sizes=[4096, 16384, 65536], repeats=3, min_time=0.0,
                            params={"ratio": 0.1})
    Profile(link=Link(*SLOW), compressors={"star_topk": cp}, meta={"ranks": n}).save(path)
    return str(path)


def check_ratio_search(r0: Dict, rewinds: bool = True) -> None:
    """Rank 0's outcome of a ``--ratio`` job (the ranks already agreed): the search began
    after step 1 (no ratio chosen yet), ran each of ``RATIOS`` for two steps, put the
    snapshot back (the weights after it are those after step 1, bitwise; with
    ``opt_digests`` the optimizer's state too) or, with ``rewinds=False``, trained on
    through it, and set the chosen ratio on the compressors, where it stays."""
    began = [h for h in r0["ratio_history"] if "ratio_search" in h]
    ended = [h for h in r0["ratio_history"] if "ratio_chosen" in h]
    assert began and began[0]["step"] == 1, r0["ratio_history"]
    assert "no CR chosen yet" in began[0]["ratio_search"]
    end = 1 + 2 * len(RATIOS)
    assert ended and ended[0]["step"] == end, r0["ratio_history"]
    assert ended[0]["trials"] == len(RATIOS)
    if not rewinds:
        assert len(set(r0["digests"])) == len(r0["digests"]), "it learns at every step"
    else:
        assert r0["digests"][end - 1] == r0["digests"][0], "the search did not rewind"
    if rewinds and r0.get("opt_digests"):  # the optimizer's state (momentum, count) too
        assert r0.get("opt_variables", 1) > 1, "no optimizer variables were recorded"
        assert r0["opt_digests"][end - 1] == r0["opt_digests"][0], "the optimizer's state"
    chosen = ended[0]["ratio_chosen"]
    assert chosen in RATIOS and r0["ratios"][end - 1] == [chosen]
    assert r0["ratios"][-1] == [chosen]
    assert len(set(r0["digests"][end - 1:])) == len(r0["digests"]) - end + 1  # learns on
    assert r0["ratio_history"][0].get("rewinds", True) == rewinds


def ratio_history(online) -> List[Dict]:
    """The planner's ratio entries, JSON-able (a trial count in place of the trials)."""
    out = []
    for h in online.history:
        if "ratio_search" in h or "ratio_chosen" in h:
            e = {k: v for k, v in h.items() if k not in ("trials", "pareto")}
            if "trials" in h:
                e["trials"] = len(h["trials"])
            out.append(e)
    return out


def changes(plans: Sequence[str]) -> List[int]:
    """The engine steps after which the plan digest changed (entry i: after step i + 1)."""
    return [i + 1 for i in range(1, len(plans)) if plans[i] != plans[i - 1]]


def check_switches(r0: Dict, steps: int) -> None:
    """Rank 0's outcome of the onebit job: checks at 5, 10, 15, 20, switches at 10 (to a
    compressed plan) and 20 (back), and learning at every step."""
    assert r0["checks"] == [5, 10, 15, 20]
    assert r0["switched"] == [10, 20] and r0["switches"] == 2
    assert changes(r0["plans"]) == [10, 20]
    assert r0["compressed"][8] == [] and r0["compressed"][9], "slow link: nothing compressed"
    assert r0["compressed"][19] == []  # fast again: back to nothing compressed
    assert len(set(r0["digests"])) == steps  # it learned at every step


def check_resume(full: Dict, resumed: Dict, r0: Dict, save_at: int, n: int) -> None:
    """A job resumed from the state saved after step ``save_at`` goes on with the
    switched plan, its history and the uninterrupted job's parameters, on every rank."""
    f0 = full[0]
    assert r0["plans"][0] == f0["plans"][save_at - 1] != f0["plans"][0]  # the switched plan
    assert r0["plans"] == f0["plans"][save_at:]
    assert r0["switched"] == [10, 20] and r0["switches"] == 2  # the saved history goes on
    for r in range(n):
        assert resumed[r]["digests"] == full[r]["digests"][save_at:], f"rank {r}"


def agree(res: Dict, n: int) -> Dict:
    """Every rank of a job's outcome ``res``: the same weights after every step, the same
    plan, the same checks; rank 0's outcome."""
    r0 = res[0]
    for r in range(1, n):
        for key in ("digests", "plans", "compressed", "checks", "switched", "switches",
                    "ratios", "ratio_history", "opt_digests"):
            assert res[r].get(key) == r0.get(key), f"rank {r} differs from rank 0 in {key}"
    return r0
