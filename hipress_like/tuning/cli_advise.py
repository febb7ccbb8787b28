"""``hipress-profile advise``: rank every configuration by predicted step time.

The subcommand's reading of its arguments (profile or the paper's values, a
model as sizes or a torch module, the compute timeline) and its report; the
model of a step is ``tuning/step_model.py``, the ranking ``tuning/advise.py``.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..cost_model.model import Link
from ..cost_model.presets import PRESETS
from ..cost_model.profile import Profile
from .cli_common import CLIError, format_bytes, model_sizes, parse_bandwidth, parse_seconds

__all__ = ["cmd_advise"]


def _names(text: Optional[str]) -> Optional[List[str]]:
    return None if text is None else [c.strip() for c in text.split(",") if c.strip()]


def _input_shape(text: str) -> Tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise CLIError(f"--input-shape {text!r} must be positive integers, batch first, "
                       "e.g. 32,3,224,224")
    return shape


def _advise_profile(a: argparse.Namespace) -> Tuple[Profile, str]:
    """The profile (a file or ``paper``) and where its link comes from."""
    from .advise import paper_profile

    if (a.bandwidth is None) != (a.latency is None):
        raise CLIError("give both --bandwidth and --latency (or neither, to use the "
                       "profile's measured link)")
    link = (Link(parse_seconds(a.latency), parse_bandwidth(a.bandwidth))
            if a.bandwidth is not None else None)
    if a.profile == "paper":
        if link is None:
            raise CLIError("--profile paper needs the link: give --bandwidth and --latency "
                           "(e.g. --bandwidth 56gbit --latency 10us)")
        return paper_profile(link), "given"
    prof = Profile.load(a.profile)
    if link is not None:
        return prof.with_link(link), "given, replacing the profile's"
    return prof, f"the profile's, {prof.meta.get('link_source', 'given')}"


def _advise_model(a: argparse.Namespace) -> Tuple[List[Tuple[str, int]], Any]:
    """(sizes, torch module or None) of --model."""
    s = a.model.strip()
    if s.lower() in PRESETS or os.path.isfile(s) or ":" not in s or s[0].isdigit():
        return model_sizes(s, a.scale), None
    from .advise import load_module

    module = load_module(s)
    sizes = [(n, p.numel() * p.element_size()) for n, p in module.named_parameters()
             if p.requires_grad and p.numel() > 0]
    if not sizes:
        raise CLIError(f"{s!r} has no parameter that requires a gradient")
    if a.scale != 1.0:
        sizes = [(n, max(4, int(round(b * a.scale / 4)) * 4)) for n, b in sizes]
    return sizes, module


def cmd_advise(a: argparse.Namespace) -> int:
    """Run ``hipress-profile advise`` (see ``cli.py``'s docstring); returns the exit code."""
    from .advise import (
        CLOSE,
        ComputeTimeline,
        advise,
        infer_input_shape,
        measure_compute,
        optimizer_line,
    )

    prof, link_from = _advise_profile(a)
    sizes, module = _advise_model(a)
    names, cands = _names(a.compressors), _names(a.candidates)
    if a.compute_time is not None:
        timeline = ComputeTimeline.spread(sizes, parse_seconds(a.compute_time))
    elif module is not None:
        shape = _input_shape(a.input_shape) if a.input_shape else infer_input_shape(
            module, a.batch)
        timeline = measure_compute(module, shape, ranks=a.ranks_per_host, repeats=a.repeats)
    else:
        timeline = ComputeTimeline.spread(sizes, 0.0)
    cores = a.cores_per_rank
    if cores is None:  # HiPress runs compression on spare GPU cores (Sec. 5): no contention
        cores = 2.0 if a.profile == "paper" else (os.cpu_count() or 1) / a.ranks_per_host
    if not cores > 0:
        raise CLIError(f"--cores-per-rank must be > 0, found {cores}")
    adv = advise(sizes, a.nodes, prof, timeline, compressors=names, candidates=cands,
                 strategies=_names(a.strategies) or ["ps", "ring"],
                 compressor_plans=a.compressor_plans, max_partitions=a.max_partitions,
                 cores_per_rank=cores,
                 meta={"model": a.model, "profile": os.fspath(a.profile)})
    lk = prof.link
    print(f"advise: {a.model}, {len(sizes)} gradients, "
          f"{format_bytes(sum(b for _, b in sizes))}, N={a.nodes}; link "
          f"{lk.latency * 1e6:.1f} us + bytes / {lk.bandwidth * 8 / 1e9:.3f} Gbit/s ({link_from})")
    ranks = prof.meta.get("ranks")
    if isinstance(ranks, int) and ranks > 1 and ranks != a.nodes:
        print(f"note: the profile timed the engine with {ranks} ranks, not {a.nodes}: "
              "engine costs beyond Eq. 2 are constants here")
    t = adv.timeline
    print(f"compute ({t.source}): forward {t.forward_s * 1e3:.1f} ms, backward "
          f"{t.backward_s * 1e3:.1f} ms, update {t.update_s * 1e3:.1f} ms "
          f"(no communication: {t.floor_s * 1e3:.1f} ms/step); {cores:.3g} cores per rank")
    print(f"{'rank':>4}  {'configuration':<22}{'compressed':>18}{'sync ms':>10}{'CPU ms':>9}"
          f"{'step ms':>10}{'speed-up':>10}")
    for i, r in enumerate(adv.rows, 1):
        comp = f"{r.compressed} ({format_bytes(r.compressed_bytes)})" if r.compressed else "0"
        cpu = "-" if r.cpu_s is None else f"{r.cpu_s * 1e3:.1f}"
        print(f"{i:>4}  {r.label:<22}{comp:>18}{r.sync_s * 1e3:>10.1f}{cpu:>9}"
              f"{r.step_s * 1e3:>10.1f}{r.speedup:>9.2f}x")
    best = adv.best
    print("(sync: every synchronisation back to back; CPU: a rank's CPU time in them, '-' "
          "when the profile lacks it; step: overlapped with backward and within the cores' "
          "room, speed-up against none)")
    twins = [(r, adv.same_as(r)) for r in adv.rows]
    twins = [f"{r.label} = {t.label}" for r, t in twins if t is not None]
    if twins:
        print(f"(the same decision for every gradient as a row above: {', '.join(twins)})")
    print(f"recommended: {best.label}, {best.step_s * 1e3:.1f} ms/step predicted, "
          f"{best.speedup:.2f}x no compression")
    close = adv.close_to_best()
    if close:
        others = ", ".join(f"{r.label} +{(r.step_s / best.step_s - 1) * 100:.1f}%"
                           for r in close[:4]) + (" ..." if len(close) > 4 else "")
        print(f"  within {CLOSE:.0%} of it, closer than the model's error (time them too): "
              f"{others}")
    _print_decisions(best, sizes, a.nodes)
    print("  import hipress_like.torch as hpt")
    print(f"  {optimizer_line(best, a.write_plan or 'plan.json')}")
    if a.write_plan:
        best.plan.save(a.write_plan)
        print(f"wrote {a.write_plan} ({best.label})")
    elif best.plan_source == "model":
        print("  (write the plan with --write-plan plan.json)")
    return 0


def _print_decisions(row: Any, sizes: Sequence[Tuple[str, int]], n: int) -> None:
    """The recommended plan's <compress, K> per gradient size (HiPress Table 7's shape)."""
    groups: Dict[Tuple[int, str, int], int] = {}
    for name, nbytes in sizes:
        d = row.plan.decide(name, nbytes, n)
        comp = row.plan.compressor_of(d)[0] if d.compress else "no"
        groups[(nbytes, comp, d.partitions)] = groups.get((nbytes, comp, d.partitions), 0) + 1
    ring = row.plan.strategy == "ring"
    print(f"  {'gradient size':>14} {'count':>6}  <compress, K>"
          + (f"  (the Ring runs each partition as a ring allreduce of {n} chunks)"
             if ring else ""))
    for (nbytes, comp, k), count in sorted(groups.items()):
        print(f"  {format_bytes(nbytes):>14} {count:>6}  <{comp}, {k}>")
