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
        for key in ("digests", "plans", "compressed", "checks", "switched", "switches"):
            assert res[r][key] == r0[key], f"rank {r} differs from rank 0 in {key}"
    return r0
