"""``EngineConfig``: how an engine synchronises (frozen, keyword-only, validated)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence

from ..cost_model.plan import STRATEGIES, Plan, check_collective_name
from .errors import ConfigMismatchError
from .transport.base import DEFAULT_TIMEOUT

__all__ = ["EngineConfig", "fingerprint", "check_same_config", "SHARED_FIELDS"]

# Settings every rank must share: they fix the layout, or the replicated
# coordinator's plan, or what a step means (timeouts and threads stay local).
SHARED_FIELDS = ("strategy", "error_feedback", "coordinator", "matching", "batch_bytes",
                 "raw_collective", "fusion_bytes", "report_capacity", "nonfinite", "seed",
                 "replay", "collective", "wire_check", "own_push")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine synchronises. Unknown keys are an error (keyword-only).

    Attributes:
        compressor: registry name or instance for compressed gradients; None
            takes the plan's compressor (``onebit`` without a plan).
        params: the compressor's parameters.
        compressor_back: the master compressor (Natural Compression Alg. 1's
            C_M): registry name or instance that encodes each aggregate on
            its way back to the workers (PS aggregators re-encode with it;
            Ring's gather forwards its payloads). None (default): the
            aggregate is encoded with the worker's compressor, as HiPress
            does. A plan entry's ``compressor_back`` overrides it. Only for
            single-round worker and master compressors.
        params_back: the master compressor's parameters.
        strategy: "ps" (co-located aggregators) or "ring".
        plan: None (default size rule; with a compressor that saves no bytes,
            such as identity, nothing is compressed), a ``Plan``, a path to a
            plan JSON, or a plan source: a callable ``source(transport,
            sizes, config) -> Plan`` called once, collectively, in
            ``register`` (with ``shapes={name: shape}`` too when it takes
            that keyword; ``hipress_like.tuning.auto_plan()`` profiles,
            then plans: what the front ends' ``plan="auto"`` passes).
        error_feedback: "auto" wraps biased, stateless compressors (onebit,
            TBQ, top-k, ...) in error feedback; True/False force it.
        timeout: seconds any collective may take before peers are blamed.
        coordinator: batch messages per link (HiPress Sec. 3.2); False sends
            one message per link per round, for comparison.
        matching: restrict each round to non-conflicting links (each rank
            sends to one peer and receives from one), as HiPress does. Off by
            default: a round is one bulk all-to-all, so letting every link go
            moves the same bytes through each host's link in fewer rounds
            (VGG-like list, 4 ranks, 1 Gbit/s, CaSync-PS + onebit: 9 rounds
            and 0.17x of allreduce off, 12-21 rounds and 0.20-0.21x on).
        batch_bytes: most bytes batched on one link per round.
        raw_collective: uncompressed gradients (the plan says "do not
            compress") are averaged by the transport's allreduce, fused
            per round into buckets of up to ``fusion_bytes`` as Horovod
            fuses tensors, and multi-round compressors whose payloads merge
            by plain summation (PowerSGD's P and Q, ``summable_view``) sum
            each round with a fused allreduce; False sends both through the
            PS or Ring workflow (raw bytes / aggregator merges), as HiPress
            does.
        fusion_bytes: a fused allreduce bucket closes once it holds this many
            bytes (DDP's ``bucket_cap_mb`` rule, 25 MB by default).
        idle_wait: seconds a rank with nothing to do waits for local work
            before joining the next round after an idle one; the batching
            timeout. Doubles per consecutive idle round up to ``idle_wait_max``.
        report_capacity: most new sends one rank reports per round.
        nonfinite: what a step does when a gradient on some rank holds NaN or
            Inf (``nonfinite.py``). "propagate" (the front ends' default, as
            DDP and Horovod): every rank's compressed gradients become NaN,
            uncompressed ones carry the exact Inf/NaN sums, and every
            compressor state is rolled back to before the step, so
            ``torch.amp.GradScaler`` skips the step and lowers its scale;
            "skip": the same roll-back, and ``synchronize`` returns False
            on every rank; "raise" (the engine's default): an error on every
            rank naming the gradient; "ignore": no scan, no roll-back (NaN
            reaches compressors and may corrupt their state).
        collective: how compressed gradients whose plan entry names none
            travel (``cost_model.plan.COLLECTIVES``). None (default): the
            strategy's PS or Ring workflow, or the allreduce lane for
            summable rounds. "backend", "ring", "tree": every round on the
            collective lane (sums by the transport's allreduce, or by this
            library's ring or tree over point-to-point messages; broadcast
            rounds, such as AR-Topk's indices, by a binomial tree from their
            owner). "allgather": each rank's payload is gathered by every
            rank and decoded in rank order (LWTopk). "auto": the
            flexible-communication paper's selector (Eq. 5a-5c) picks per
            top-k gradient between Allgather (``topk``), ART-Ring and
            ART-Tree (``star_topk``/``var_topk``), from alpha and beta this
            transport measures at ``register`` (``link_source``).
        link_source: what measures the links for ``collective="auto"``: a
            callable ``source(transport, timeout) -> (ring Link, one-way
            Link)`` called once, collectively, in ``register``. The engine
            never imports a measurement: the front ends pass
            ``hipress_like.tuning.collective_links``, as they pass a plan
            source for ``plan="auto"``.
        seed: base of every compressor's RNG seed.
        threads: run compute and communication on background threads
            (overlap); False runs everything inside ``synchronize``
            (deterministic, for tests and debugging).
        pipeline: plan round r+1 while round r executes (needs threads and
            a transport with ``split``; otherwise rounds run back to back).
        timeline: record task and round times (``Engine.timeline``).
        replay: when every gradient travels by allreduce (no PS or Ring
            links), record the fused buckets of a coordinated step and
            replay them in the next steps without metadata rounds, as DDP
            fixes its bucket order after the first iteration (``replay.py``).
            A step that submits other gradients falls back to coordinated
            rounds by itself; False coordinates every step.
        wire_check: checksum every payload of the bulk exchange (``wire.py``);
            a flipped bit then raises ``WireError`` naming the sender and the
            payload. False still checks each message's header, version,
            sender and length. Every rank must agree (it sets the message
            sizes).
        own_push: a CaSync-PS aggregator compresses its own partition as a
            push too (``decode(encode(x))`` with the push site's state)
            before it adds the other ranks' payloads, as a BytePS server
            receives every worker's push compressed, the co-located worker's
            included. Off (default): the aggregator adds its partition as it
            is (it never crosses the network), one encode and one decode
            less per aggregated partition and nothing lost to the
            compressor. The BytePS-style faces turn it on, so their results
            follow BytePS's ``C(sum_r C(g_r))``. It changes only
            single-round compressors whose payloads do not merge compressed
            (onebit, top-k, random-k, dithering): aggregatable ones already
            encode the aggregator's partition.
    """

    compressor: Any = None
    params: Mapping[str, Any] = field(default_factory=dict)
    compressor_back: Any = None
    params_back: Mapping[str, Any] = field(default_factory=dict)
    strategy: str = "ps"
    plan: Any = None
    error_feedback: Any = "auto"
    timeout: float = DEFAULT_TIMEOUT
    coordinator: bool = True
    matching: bool = False
    # 8 MB: 64 ms on a 1 Gbit/s link, long enough to amortise a round's
    # metadata exchange (~1 ms), short enough to keep the pipeline moving.
    batch_bytes: int = 8 << 20
    # An allreduce moves 2(N-1)/N of the bytes in N-1 pipelined steps with
    # no incast and no metadata per partition: for bytes that stay
    # uncompressed it beats a PS exchange (two rounds, N-to-1 incast) and
    # matches the all_reduce DDP uses (bench/sync.py measures both).
    raw_collective: bool = True
    fusion_bytes: int = 25 << 20
    # 1 ms, doubling per consecutive idle round up to idle_wait_max: a rank
    # with news waits at most that long for idle peers, and idle polling
    # during the framework's backward pass stays rare (2 cores, 4 ranks).
    idle_wait: float = 0.001
    idle_wait_max: float = 0.016
    report_capacity: int = 512
    nonfinite: str = "raise"
    seed: int = 0
    threads: bool = True
    # Exchange round r+1's metadata while round r's data moves (HiPress Sec.
    # 3.2), on a second channel from ``transport.split()`` when it has one.
    pipeline: bool = True
    timeline: bool = True
    # ~15 metadata allgathers per step at ~1.5 ms of CPU each (4 ranks, 2 cores)
    # become none for VGG-style + Ring/PS + PowerSGD (replay.py)
    replay: bool = True
    collective: Optional[str] = None
    link_source: Any = None
    # On: a 64-bit word sum per payload costs a fraction of a copy of its bytes,
    # under 1% of a compressing encode (docs/reliability.md); off saves it where a
    # link already checks its frames and the encode is a copy (identity).
    wire_check: bool = True
    own_push: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be 'ps' or 'ring', found {self.strategy!r}")
        if self.nonfinite not in ("propagate", "skip", "raise", "ignore"):
            raise ValueError(f"nonfinite must be 'propagate', 'skip', 'raise' or 'ignore', "
                             f"found {self.nonfinite!r}")
        if self.error_feedback not in ("auto", True, False):
            raise ValueError(f"error_feedback must be 'auto', True or False, "
                             f"found {self.error_feedback!r}")
        if not isinstance(self.wire_check, bool):
            raise ValueError(f"wire_check must be True or False, found {self.wire_check!r}")
        if not isinstance(self.own_push, bool):
            raise ValueError(f"own_push must be True or False, found {self.own_push!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, found {self.timeout!r}")
        if self.batch_bytes < 1 or self.report_capacity < 1 or self.fusion_bytes < 1 \
                or self.idle_wait < 0 \
                or self.idle_wait_max < self.idle_wait:
            raise ValueError("batch_bytes, fusion_bytes and report_capacity must be >= 1, and "
                             "0 <= idle_wait <= idle_wait_max")
        if self.collective is not None:
            check_collective_name(self.collective)
        if self.compressor_back is None and self.params_back:
            raise ValueError(f"params_back {dict(self.params_back)} given without a "
                             "compressor_back")
        if self.link_source is not None and not callable(self.link_source):
            raise ValueError(f"link_source must be a callable source(transport, timeout) -> "
                             f"(ring Link, one-way Link), found {self.link_source!r}; pass "
                             "hipress_like.tuning.collective_links")
        if self.plan == "auto":
            raise ValueError("EngineConfig(plan='auto'): the engine takes a plan source, not "
                             "the string; pass plan=hipress_like.tuning.auto_plan() (what the "
                             "front ends' plan='auto' does)")
        if not (self.plan is None or callable(self.plan)
                or isinstance(self.plan, (Plan, str, os.PathLike))):
            raise ValueError(f"plan must be None, a Plan, a path to a plan file or a plan "
                             f"source (a callable), found {self.plan!r}")


def fingerprint(config: EngineConfig, compressor: Any, plan: Optional[Plan]) -> Dict[str, Any]:
    """What every rank's engine must agree on, as msgpack-able values: the shared
    settings, the compressor with its parameters, and the plan (each of a fixed
    plan's fields, so a difference is named by its field, or how it will be made)."""
    fp: Dict[str, Any] = {f: repr(getattr(config, f)) for f in SHARED_FIELDS}
    fp["compressor"] = repr(compressor)
    fp["compressor_back"] = repr((config.compressor_back, sorted(config.params_back.items())))
    if plan is not None:
        fp["plan"] = _flatten(plan.to_dict())
    else:
        fp["plan"] = "from a plan source" if config.plan is not None else "size rule"
    return fp


def _flatten(d: Mapping[str, Any], prefix: str = "") -> Dict[str, str]:
    """A nested dict as paths to reprs of its leaves.

    Example: ``{"gradients": {"fc.w": {"partitions": 4}}}`` becomes
    ``{"gradients['fc.w'].partitions": "4"}``.
    """
    out: Dict[str, str] = {}
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix and k.isidentifier() else (
            f"{prefix}[{k!r}]" if prefix else str(k))
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, path))
        else:
            out[path] = repr(v)
    return out


def _groups(values: Sequence[Any]) -> Dict[Any, list]:
    """value -> the ranks holding it (unhashable values by their repr)."""
    out: Dict[Any, list] = {}
    for r, v in enumerate(values):
        out.setdefault(v if not isinstance(v, (dict, list)) else repr(v), []).append(r)
    return out


def _describe(key: str, values: Sequence[Any], most: int = 6) -> list:
    """The differences of one setting: one line per differing field of a plan."""
    if all(isinstance(v, Mapping) for v in values):  # fixed plans: name the fields
        fields = sorted({f for v in values for f in v})
        lines = []
        for f in fields:
            groups = _groups([v.get(f, "(absent)") for v in values])
            if len(groups) > 1:
                lines.append(f"{key}.{f}: " + "; ".join(
                    f"{g} on rank(s) {rs}" for g, rs in groups.items()))
        if len(lines) > most:
            lines = lines[:most] + [f"{key}: {len(lines) - most} more fields differ"]
        return lines
    shown = ["a fixed Plan" if isinstance(v, Mapping) else v for v in values]
    return [f"{key}: " + "; ".join(f"{g} on rank(s) {rs}" for g, rs in _groups(shown).items())]


def check_same_config(prints: Sequence[Mapping[str, Any]]) -> None:
    """Raise ``ConfigMismatchError`` naming each setting that differs, and the ranks.

    A fixed plan's difference is named by its field (``plan.gradients['w'].
    partitions``, ``plan.compressor``, ...), not by a digest.

    Example:
        >>> try:
        ...     check_same_config([{"strategy": "'ps'"}, {"strategy": "'ring'"}])
        ... except ConfigMismatchError as e:
        ...     print(str(e).split("moved): ")[1].split(". Build")[0])
        strategy: 'ps' on rank(s) [0]; 'ring' on rank(s) [1]
    """
    diffs = []
    for key in prints[0]:
        values = [fp.get(key) for fp in prints]
        if len(_groups(values)) > 1:
            diffs.extend(_describe(key, values))
    if diffs:
        raise ConfigMismatchError(
            "engine settings differ between ranks (found at register, before any data "
            "moved): " + " | ".join(diffs) + ". Build every rank's optimizer with the same "
            "compression, strategy, plan and engine settings")
