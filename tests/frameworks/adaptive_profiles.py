"""Profiles for the frameworks' plan="adaptive" tests (TensorFlow and Gluon alike).

The compressor curves are measured here, on the machine that runs the test, and put
on the fast link the injected schedule starts from (``Adaptive(profile=...)``: every
rank then plans from the same file without profiling).
"""
from pathlib import Path
from typing import Dict, Sequence

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
