"""The compressor-state envelope every front end puts in its checkpoints, and resharding.

Compressor state (error-feedback residuals, PowerSGD's Q, DGC's momentum)
belongs to one rank. The PyTorch optimizer's ``"hipress"`` entry, the
TensorFlow face's ``compressor_state()`` and the Gluon trainer's side file
all wrap ``Engine.state_dict()`` in the same envelope::

    {"format": FORMAT, "version": VERSION, "world_size": N,
     "layout": {...},                     # optional: per gradient, workflow and partitions
     "rank": r, "engine": {...}}          # one rank's own state, or
     "engines": [{...}, ... N of them]}   # every rank's, gathered by a collective

and read it back by the same rules (``unpack``): another rank's state is
refused, since it would resume this rank with someone else's residuals.
With ``plan="adaptive"`` the faces whose checkpoint is this envelope alone
(TensorFlow's, the Gluon trainer's) add the online planner's state under
``"adaptive"`` (``tuning.online.OnlinePlanner.state_dict``: the active plan
and the controller, ``ADAPTIVE``); the PyTorch optimizer keeps it beside the
envelope, under ``"hipress_adaptive"``.

**Another world size (N -> M).** An envelope with every rank's state and
the saved layout is *resharded* (``reshard``); otherwise the compressor
state starts fresh with a ``CompressorStateReset`` warning. The rule for an
error-feedback memory (Seide et al. 2014, "1-bit SGD"; Karimireddy et al.
2019, "Error feedback fixes SignSGD", Alg. 2): rank i transmits
``C(g_i + e_i)`` and keeps ``e_i <- g_i + e_i - C(g_i + e_i)``, so the
averaged update still owes ``(1/N) sum_i e_i``: what the compressors held
back. On M ranks every new rank gets

    e'_j = (1/N) sum_i e_i        (j = 0 .. M-1)

and the update owes ``(1/M) sum_j e'_j = (1/N) sum_i e_i``, the same
amount, so no held-back gradient is lost or counted twice. The same holds
for every memory that enters the average linearly (GradDrop's and
AR-Topk's residuals, DGC's momentum ``u`` and accumulation ``v``, and
PowerSGD's factored error ``error - error_p @ q^T``, linear in
``(error, error_p)`` because ``q`` is equal on every rank). State equal on
every rank (PowerSGD's warm-start ``q``, the shared seeds, the step count)
carries over as it is; ``world_size`` and ``rank`` take the new values;
a rank's private RNG seed is kept by ranks that existed (``j < N``) and
derived as ``mix_seed(seed of rank j mod N, j)`` for new ones.

What cannot be resharded is reset (the engine initialises it afresh at
the next step) and named in a ``CompressorStateReset`` warning:

* state at a PS or Ring site (``push``, ``pull``, ``own``, ``final``,
  ``hop``...): which rank aggregates a partition (PS) and where the ring's
  chunks fall (Ring) depend on N, and the aggregating rank keeps no
  worker memory (it adds its own gradient uncompressed, unless
  ``EngineConfig.own_push``), so
  ``(1/N) sum_i e_i`` cannot be put back by giving every rank the same
  memory. Only the symmetric ``rounds`` site (every rank encodes the whole
  partition each step: PowerSGD, THC, AR-Topk) is resharded;
* a gradient whose workflow or partition bounds differ between the two
  layouts, or whose state is missing on some rank;
* a field whose meaning depends on N or on one rank (onebit's ``pending``
  means, AR-Topk's per-rank ``gain`` list and ``owner``), and a "shared"
  field that is not equal on every saved rank.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..compressors.base import mix_seed
from ..errors import HipressError

__all__ = ["FORMAT", "VERSION", "ADAPTIVE", "CompressorStateReset", "pack", "check_format",
           "unpack", "restore", "layout_of", "reshard"]

FORMAT = "hipress-like-optimizer-state"
VERSION = 1
ADAPTIVE = "adaptive"  # the envelope's optional plan="adaptive" entry (module docstring)

# Fields that enter the averaged update linearly: resharded as (1/N) sum_i (module docstring).
_LINEAR = frozenset({"error", "error_p", "residual", "u", "v"})
# Fields equal on every rank (checked): carried over as they are.
_SHARED = frozenset({"q", "shared_seed", "step_seed", "step"})
# The only site every rank encodes symmetrically, whatever N is.
_SYMMETRIC_SITES = frozenset({"rounds"})


class CompressorStateReset(HipressError, UserWarning):
    """Compressor state could not be carried over (another world size) and starts fresh."""


def pack(local: Dict[str, Any], rank: int, size: int,
         engines: Optional[List[Dict[str, Any]]] = None,
         layout: Optional[Dict[str, Any]] = None,
         adaptive: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The envelope of this rank's engine state ``local``, or of every rank's
    (``engines``, index = rank, from an ``allgather_object`` the caller ran).

    Args:
        local: this rank's ``Engine.state_dict()``.
        rank, size: this process's rank and world size.
        engines: every rank's state (``state_dict(all_ranks=True)``).
        layout: ``layout_of(engine)``; with ``engines`` it lets another
            world size reshard the state (``reshard``).
        adaptive: ``OnlinePlanner.state_dict(engine)`` with ``plan="adaptive"``
            (kept under ``ADAPTIVE``; its agreed fields are equal on every rank).
    """
    hip: Dict[str, Any] = {"format": FORMAT, "version": VERSION, "world_size": size}
    if layout is not None:
        hip["layout"] = layout
    if adaptive is not None:
        hip[ADAPTIVE] = adaptive
    if engines is not None:
        hip["engines"] = engines
    else:
        hip.update(rank=rank, engine=local)
    return hip


def layout_of(engine: Any) -> Dict[str, Any]:
    """Per gradient, its workflow and partition bounds (``Engine.layout``), as saved
    in the envelope: what ``reshard`` compares between the saving and loading runs."""
    return {n: {"workflow": d["workflow"],
                "partitions": [[int(p[0]), int(p[1])] for p in d["partitions"]]}
            for n, d in engine.layout().items()}


def check_format(hip: Any, where: str) -> None:
    """Raise ValueError unless ``hip`` is an envelope of this ``FORMAT`` and ``VERSION``."""
    get = hip.get if isinstance(hip, dict) else (lambda _k: None)
    if get("format") != FORMAT or get("version") != VERSION:
        raise ValueError(f"{where} is not a compressor state this version reads: format "
                         f"{get('format')!r} version {get('version')!r}; expected {FORMAT!r} "
                         f"version {VERSION}")


def unpack(hip: Any, rank: int, size: int, *, where: str, fix: str,
           foreign_empty_ok: bool = False,
           layout: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """This rank's engine state from an envelope, or None to start fresh.

    Args:
        hip: the envelope (``pack`` output).
        rank, size: this process's rank and world size.
        where: what held it, for messages ("this state dict", a file name).
        fix: the sentence telling the user how to save it right.
        foreign_empty_ok: accept another rank's state when it holds no
            compressor state (nothing rank-specific would be restored).
        layout: this run's ``layout_of(engine)``; with it, an all-ranks
            envelope saved with another world size is resharded.

    Raises:
        ValueError: not an envelope of this version, or another rank's state.
    """
    check_format(hip, where)
    saved_n = hip.get("world_size")
    if saved_n != size:
        if "engines" in hip and "layout" in hip and layout is not None:
            state, reset = reshard(hip["engines"], hip["layout"], layout, rank, size)
            if reset:
                warnings.warn(CompressorStateReset(
                    f"compressor state in {where} was saved with {saved_n} ranks, this run "
                    f"has {size}: resharded, except {len(reset)} state(s) that cannot be and "
                    f"start fresh: {_grouped(reset)}"), stacklevel=3)
            return state
        how = ("it holds one rank's state only (a per-rank state dict; partial aggregation "
               "saves no other), which cannot be resharded; a DistributedOptimizer's "
               "state_dict(all_ranks=True), as hpt.save_checkpoint saves it, can be"
               if "engines" not in hip else
               "it was saved without the gradients' layout (an older version or another "
               "front end), which resharding needs")
        warnings.warn(CompressorStateReset(
            f"compressor state in {where} was saved with {saved_n} ranks, this run has "
            f"{size}; starting compressor state fresh: {how}"), stacklevel=3)
        return None
    if "engines" in hip:
        return hip["engines"][rank]
    saved = hip.get("engine") or {}
    if hip.get("rank") == rank or (foreign_empty_ok and not any(saved.get("states", {}).values())):
        return saved
    raise ValueError(f"the compressor state in {where} belongs to rank {hip.get('rank')}, not "
                     f"rank {rank}: loading it would resume rank {rank} with another rank's "
                     f"error-feedback residuals. {fix}")


def _grouped(reset: List[str]) -> str:
    """"key: why" lines as "key, key (why); ..." (one group per reason)."""
    by: Dict[str, List[str]] = {}
    for line in reset:
        key, _, why = line.partition(": ")
        by.setdefault(why, []).append(key)
    return "; ".join(f"{', '.join(keys)} ({why})" for why, keys in by.items())


def reshard(engines: Sequence[Dict[str, Any]], old_layout: Dict[str, Any],
            new_layout: Dict[str, Any], rank: int, size: int
            ) -> Tuple[Dict[str, Any], List[str]]:
    """Rank ``rank`` of ``size``'s engine state from the N saved ranks' states.

    1. For every state key ``gradient|partition|site`` saved by any rank,
       decide whether it can be resharded (symmetric site, on every rank,
       same workflow and partition bounds in both layouts, every field of a
       known kind, shared fields equal);
    2. if so, build it field by field (module docstring: linear memories
       ``(1/N) sum_i``, shared fields carried, ``world_size``/``rank`` new);
    3. if not, leave it out (the engine initialises it at the next step) and
       say why in the returned list.

    Args:
        engines: the N ranks' ``Engine.state_dict()``, index = rank.
        old_layout, new_layout: ``layout_of`` of the saving and loading engines.
        rank, size: the loading rank and world size M.

    Returns:
        (this rank's engine state, one "key: why" line per state reset).
    """
    n = len(engines)
    states = [e.get("states", {}) for e in engines]
    reset: List[str] = []
    out: Dict[str, Any] = {}
    for key in sorted(set().union(*states)):
        why = _why_not(key, states, old_layout, new_layout)
        vals = [s[key] for s in states] if why is None else []
        try:
            if why is None:
                out[key] = _merge(vals, "", rank, size, n)
        except _Cannot as e:
            why = str(e)
        if why is not None:
            reset.append(f"{key}: {why}")
    steps = {int(e.get("step", 0)) for e in engines}
    new = {k: v for k, v in engines[0].items() if k not in ("states", "replay_schedule")}
    # a replay schedule records this world size's communication: the new run records its own
    new.update(states=out, replay_schedule=None, step=min(steps))
    if len(steps) > 1:
        reset.append(f"step count: differs between the saved ranks ({sorted(steps)})")
    return new, reset


class _Cannot(HipressError):
    """A field that cannot be resharded (the message says why)."""


def _why_not(key: str, states: List[Dict[str, Any]], old: Dict[str, Any],
             new: Dict[str, Any]) -> Optional[str]:
    grad, _part, site = (key.rsplit("|", 2) + ["", ""])[:3]
    if site not in _SYMMETRIC_SITES:
        return (f"site {site!r} belongs to a PS/Ring exchange whose aggregators and chunks "
                f"depend on the world size")
    missing = [r for r, s in enumerate(states) if key not in s]
    if missing:
        return f"not saved by rank(s) {missing}"
    if grad not in old or grad not in new:
        return "gradient missing from the saved or the current layout"
    if (old[grad]["workflow"], old[grad]["partitions"]) != (new[grad]["workflow"],
                                                            new[grad]["partitions"]):
        return (f"layout differs: saved {old[grad]['workflow']} partitions "
                f"{old[grad]['partitions']}, now {new[grad]['workflow']} partitions "
                f"{new[grad]['partitions']}")
    return None


def _merge(vals: List[Any], field: str, rank: int, size: int, n: int) -> Any:
    """One field (or a nested state) of the new rank's state from the N saved values."""
    v0 = vals[0]
    if isinstance(v0, dict):
        if any(not isinstance(v, dict) or v.keys() != v0.keys() for v in vals):
            raise _Cannot(f"field {field!r} has different keys on different ranks")
        return {f: _merge([v[f] for v in vals], f, rank, size, n) for f in v0}
    if field in _LINEAR:
        if all(v is None for v in vals):
            return None
        if not all(isinstance(v, torch.Tensor) and v.shape == v0.shape for v in vals):
            raise _Cannot(f"field {field!r} is not a tensor of one shape on every rank")
        acc = v0.clone()
        for v in vals[1:]:
            acc.add_(v)
        return acc.div_(n)
    if field in _SHARED:
        if not all(_equal(v, v0) for v in vals):
            raise _Cannot(f"field {field!r} should be equal on every rank and is not")
        return v0.clone() if isinstance(v0, torch.Tensor) else v0
    if field == "world_size":
        return size
    if field == "rank":
        return rank
    if field == "seed":
        return int(vals[rank]) if rank < n else mix_seed(int(vals[rank % n]), rank)
    raise _Cannot(f"field {field!r} has no resharding rule (it may depend on the world "
                  f"size or on one rank)")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    return a == b


def restore(engine: Any, state: Optional[Dict[str, Any]]) -> None:
    """Put what ``unpack`` returned into ``engine``: None (another world size, no
    resharding possible) starts its compressor state fresh, a dict is loaded."""
    if state is None:
        engine.reset_state()
    else:
        engine.load_state_dict(state)
