"""The CaSync engine: the task manager plus the coordinated bulk communication loop.

What happens to a gradient (DESIGN.md, "How one gradient flows"):

1. ``register`` (collective) checks that every rank has the same gradients
   (names, shapes, dtypes) and fixes a *layout*: per gradient, compress or
   not, K partitions (views, never copies), the aggregator of each
   partition (byte-balanced across ranks) and the workflow (PS, Ring or
   multi-round).
2. ``submit(name, tensor)`` adds the gradient's tasks to the task graph
   (``workflows``). Ready compute tasks (encode/decode/merge/write) go to the
   computing executor; ready sends go to the outbox; recvs wait for their
   message. A gradient left uncompressed is instead copied into its static
   bucket of the collective lane (``lane``), which becomes one fused
   allreduce once its last member arrives.
3. The communication loop (its own thread) runs rounds: every rank reports
   its new sends (``coordinator.Report``) in one allgather; every rank runs
   the same deterministic ``Coordinator`` on the same reports, so all agree
   on the round's links and batches without a central node; then one
   ``alltoallv`` moves the round's bytes and finishes its send/recv tasks.
4. ``synchronize()`` closes the step. When every rank has closed, nothing is
   queued and no task is outstanding anywhere, every rank leaves the loop in
   the same round. Errors travel in the reports, so a failure on one rank
   (bad gradient, compressor error) becomes an error on every rank, and a
   dead peer becomes a ``PeerError`` from the transport's timeout.
5. When every gradient travels by allreduce (no PS or Ring links), the
   buckets of a coordinated step are recorded and the next steps replay
   them with no metadata round (``replay.py``); status words inside the
   replayed allreduces carry errors and NaN/Inf skips, and a step with
   other gradients goes back to coordinated rounds.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import msgpack
import torch

from .. import compressors as _comp
from ..compressors.base import Compressor, all_finite, check_gradient
from ..cost_model.plan import GradientPlan, Plan, SizeRule
from .coordinator import (
    COLLECTIVE,
    FLAG_CLOSED,
    FLAG_ERROR,
    FLAG_NONFINITE,
    Coordinator,
    Report,
    decode_report,
    encode_report,
)
from .executors import SyncExecutor, ThreadExecutor
from .lane import LaneBucket, plan_lane_buckets
from .replay import STATUS_LEN, Schedule, dtype_groups, read_status, status_tensor
from .tasks import DeadlockError, Task, TaskGraph
from .timeline import Event, Timeline
from .transport.base import DEFAULT_TIMEOUT, Transport
from .workflows import (
    CompressorCodec,
    RawCodec,
    chunk_bounds,
    ps_workflow,
    ring_workflow,
    rounds_collective_workflow,
    rounds_workflow,
)

__all__ = ["EngineConfig", "Engine", "Handle", "EngineError", "GradientMismatchError"]

_log = logging.getLogger(__name__)
_KEY_LIMITS = {"gradients": 1 << 20, "partitions": 1 << 12, "phases": 1 << 12, "ranks": 1 << 10}


class EngineError(RuntimeError):
    """Synchronisation failed (on this rank or a peer); the engine is unusable after it."""


class GradientMismatchError(EngineError, ValueError):
    """Ranks registered or submitted different gradients."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine synchronises. Unknown keys are an error (keyword-only).

    Attributes:
        compressor: registry name or instance for compressed gradients; None
            takes the plan's compressor (``onebit`` without a plan).
        params: the compressor's parameters.
        strategy: "ps" (co-located aggregators) or "ring".
        plan: None (default size rule; with a compressor that saves no bytes,
            such as identity, nothing is compressed), a ``Plan``, a path to a
            plan JSON, or "auto" (profile the first steps, then fix the plan).
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
        nonfinite: "raise" (error on every rank), "skip" (every rank skips the
            step; ``synchronize`` returns False) or "ignore" (no check).
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
    """

    compressor: Any = None
    params: Mapping[str, Any] = field(default_factory=dict)
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

    def __post_init__(self) -> None:
        if self.strategy not in ("ps", "ring"):
            raise ValueError(f"strategy must be 'ps' or 'ring', found {self.strategy!r}")
        if self.nonfinite not in ("raise", "skip", "ignore"):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or 'ignore', "
                             f"found {self.nonfinite!r}")
        if self.error_feedback not in ("auto", True, False):
            raise ValueError(f"error_feedback must be 'auto', True or False, "
                             f"found {self.error_feedback!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, found {self.timeout!r}")
        if self.batch_bytes < 1 or self.report_capacity < 1 or self.fusion_bytes < 1 \
                or self.idle_wait < 0 \
                or self.idle_wait_max < self.idle_wait:
            raise ValueError("batch_bytes, fusion_bytes and report_capacity must be >= 1, and "
                             "0 <= idle_wait <= idle_wait_max")
        if not (self.plan is None or self.plan == "auto" or isinstance(self.plan, (Plan, str,
                                                                                    os.PathLike))):
            raise ValueError(f"plan must be None, 'auto', a Plan or a path, found {self.plan!r}")


@dataclass
class _GradInfo:
    idx: int
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    numel: int
    compress: bool
    workflow: str  # "ps", "ring", "rounds", or on the collective lane "allreduce"
    #                and "rounds-allreduce"
    parts: List[Tuple[int, int, int]]  # (start, end, aggregator)


class Handle:
    """Completion of one submitted gradient; ``wait`` raises the step's error."""

    def __init__(self, engine: "Engine", name: str, tensor: torch.Tensor,
                 work: torch.Tensor):
        self._engine = engine
        self.name = name
        self._tensor = tensor
        self._work = work
        self._pending = 1  # the building token, released after all tasks are added
        self._event = threading.Event()
        self._lock = threading.Lock()

    def _release(self, n: int = 1) -> None:
        with self._lock:
            self._pending -= n
            if self._pending == 0:
                if self._work is not self._tensor:
                    self._tensor.copy_(self._work)
                self._event.set()

    def done(self) -> bool:
        """True once the averaged gradient is written."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        """Block until the averaged gradient is written; return the tensor.

        Raises:
            EngineError / PeerError: the synchronisation failed.
            TimeoutError: not done within ``timeout`` seconds.
        """
        t = self._engine.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        while not self._event.wait(0.05):
            self._engine._raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"gradient {self.name!r} not synchronised within {t:.1f} s")
        self._engine._raise_if_failed()
        return self._tensor


def _digest_of(idx: int) -> int:
    return (idx * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 62) - 1)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class Engine:
    """One rank's CaSync engine over a ``Transport``.

    Args:
        transport: the collectives (all ranks build an engine over theirs).
        config: an ``EngineConfig``; keyword overrides are applied on top.

    Example:
        eng = Engine(transport, EngineConfig(compressor="onebit"))
        eng.register([(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()])
        for n, p in model.named_parameters():
            eng.submit(n, p.grad)
        eng.synchronize()   # every p.grad now holds the average over ranks
    """

    def __init__(self, transport: Transport, config: Optional[EngineConfig] = None,
                 **overrides: Any):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            from dataclasses import replace
            config = replace(config, **overrides)
        self.config = config
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        if self.size > _KEY_LIMITS["ranks"]:
            raise ValueError(f"at most {_KEY_LIMITS['ranks']} ranks are supported")
        self.plan = self._resolve_plan(config.plan)
        self.compressor = self._build_compressor()
        self.timeline = Timeline(self.rank)
        self.timeline.enabled = config.timeline
        self._states: Dict[str, Dict[str, Any]] = {}
        self._layout: Dict[str, _GradInfo] = {}
        self._lane: List[LaneBucket] = []  # static buckets of the collective lane
        self._lane_of: Dict[int, LaneBucket] = {}  # gradient index -> its bucket
        self._lane_by_key: Dict[int, LaneBucket] = {}  # collective key -> bucket
        self._cv = threading.Condition()
        self._graph = TaskGraph(self._on_ready)
        self._exec = ThreadExecutor() if config.threads else SyncExecutor()
        self._reset_step()
        self._step = 0
        self._error: Optional[BaseException] = None
        self._error_arg = -1
        self._closed_engine = False
        self._dead = False  # the comm loop failed; the transport is not used again
        self._step_start = threading.Event()
        self._step_done = threading.Event()
        self._skipped = False
        self._replayable = False  # the layout has collectives only (set by register)
        self._replayed = 0
        self._device = torch.device("cpu")  # of the gradients (a replay's stand-in zeros)
        self._schedule: Optional[Schedule] = None  # recorded by the last coordinated step
        self._record: Optional[List[List[Tuple[int, int, torch.dtype]]]] = None
        self._comm_thread: Optional[threading.Thread] = None
        self._data: Optional[Transport] = None
        self._round_thread: Optional[threading.Thread] = None
        if config.threads and config.pipeline:
            try:
                self._data = transport.split()
            except NotImplementedError:
                _log.info("transport %s has no split(); rounds are planned and executed "
                          "back to back", type(transport).__name__)
        if self._data is not None:
            self._round_q: "queue.Queue" = queue.Queue(maxsize=1)  # plan one round ahead
            self._rounds_busy = 0  # rounds handed over and not finished (guarded by _cv)
            self._round_thread = threading.Thread(target=self._round_main, daemon=True,
                                                  name=f"hipress-rounds-{self.rank}")
            self._round_thread.start()
        if config.threads:
            self._comm_thread = threading.Thread(target=self._comm_main, daemon=True,
                                                 name=f"hipress-comm-{self.rank}")
            self._comm_thread.start()

    # -- setup -------------------------------------------------------------
    def _resolve_plan(self, plan: Any) -> Optional[Plan]:
        if plan is None or plan == "auto":
            return None
        if isinstance(plan, Plan):
            return plan
        return Plan.load(plan)

    def _build_compressor(self) -> Compressor:
        cfg = self.config
        name = cfg.compressor
        params = dict(cfg.params)
        if name is None:
            name = self.plan.compressor if self.plan else "onebit"
            if self.plan and not params:
                params = dict(self.plan.params)
        comp = _comp.get(name, **params)
        caps = comp.capabilities
        wrap = cfg.error_feedback
        if wrap == "auto":
            wrap = caps.category not in ("none",) and not caps.unbiased and not caps.stateful \
                and caps.rounds == 1
        if wrap:
            from ..compressors.error_feedback import ErrorFeedback
            comp = ErrorFeedback(comp)
        if caps.rounds > 1 and not caps.aggregatable:
            raise ValueError(f"compressor {comp.name!r} has {caps.rounds} rounds but its "
                             "payloads are not aggregatable; CaSync cannot run it")
        return comp

    def _decide(self, name: str, nbytes: int) -> GradientPlan:
        if self.plan is not None:
            return self.plan.decide(name, nbytes, self.size)
        dec = SizeRule().decide(nbytes, self.size)
        if self._saves_no_bytes:
            # the rule's "compress" would only send the raw bytes through PS/Ring
            # instead of the allreduce lane (the path of Horovod's default,
            # Compression.none). A Plan can still ask for it.
            dec = GradientPlan(compress=False, partitions=dec.partitions)
        return dec

    @property
    def _saves_no_bytes(self) -> bool:
        """The compressor sends values as they are (category "none": identity)."""
        return self.compressor.capabilities.category == "none"

    def register(self, specs: Sequence[Tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Declare the gradients (collective; every rank, same list).

        Raises:
            GradientMismatchError: on every rank, if the ranks' lists differ
                (the message names the first differing gradient and ranks).
            ValueError: duplicate names, non-float dtypes, empty tensors.
        """
        self._raise_if_failed()
        specs = [(str(n), tuple(int(s) for s in shape), dt) for n, shape, dt in specs]
        names = [n for n, _, _ in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate gradient names: {dup}")
        if 2 * len(specs) >= _KEY_LIMITS["gradients"]:  # keys for gradients, then buckets
            raise ValueError(f"at most {_KEY_LIMITS['gradients'] // 2 - 1} gradients are "
                             "supported")
        for n, _, dt in specs:
            if dt not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
                raise ValueError(f"gradient {n!r} has dtype {dt}; only floating dtypes can be "
                                 "synchronised")
        mine = msgpack.packb([[n, list(s), str(d)] for n, s, d in specs])
        theirs = self.transport.allgather_bytes(mine, self.config.timeout)
        if any(t != mine for t in theirs):
            raise GradientMismatchError(self._describe_mismatch(
                [msgpack.unpackb(t) for t in theirs]))
        if self.config.plan == "auto" and self.plan is None:
            if self._saves_no_bytes:
                # nothing to decide: every gradient takes the allreduce lane
                # (``_decide``), so profiling is skipped
                _log.info("plan='auto' with %s: nothing to compress, no profile",
                          self.compressor.name)
            else:
                self.plan = self._auto_plan(specs)
        self._build_layout(specs)

    def _auto_plan(self, specs) -> Plan:
        """``plan="auto"``: profile compressor and link on every rank, then fix a plan.

        Collective (inside ``register``, the transport idle); rank 0 plans and
        broadcasts, so every rank gets the identical ``Plan`` (HiPress Sec. 3.3
        profiles on the target cluster before planning).
        """
        from ..cost_model.auto import AutoPlanner
        from .coordinator import report_len

        comp = self.compressor
        inner = getattr(comp, "inner", comp)  # profile the algorithm, not the EF wrapper
        sizes = {n: int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size()
                 for n, s, d in specs}
        t0 = time.perf_counter()
        auto = AutoPlanner(inner.name, params=inner.params(), strategy=self.config.strategy,
                           round_meta_bytes=8 * report_len(self.config.report_capacity),
                           raw_collective=self.config.raw_collective,
                           timeout=self.config.timeout, repeats=2,
                           # a quick profile: curves are interpolated beyond these sizes
                           max_profile_bytes=16 << 20, max_link_bytes=4 << 20)
        plan = auto.finalize(self.transport, sizes)
        _log.info("rank %d: plan='auto' fixed in %.1f s: %d of %d gradients compressed",
                  self.rank, time.perf_counter() - t0,
                  sum(1 for n in sizes if plan.decide(n, sizes[n], self.size).compress),
                  len(sizes))
        return plan

    def _describe_mismatch(self, lists: List[list]) -> str:
        ref = lists[0]
        for r, lst in enumerate(lists[1:], start=1):
            if lst == ref:
                continue
            if len(lst) != len(ref):
                a, b = {x[0] for x in ref}, {x[0] for x in lst}
                return (f"gradient sets differ across ranks: rank 0 has {len(ref)} gradients, "
                        f"rank {r} has {len(lst)} (only on rank 0: {sorted(a - b)[:5]}, only on "
                        f"rank {r}: {sorted(b - a)[:5]}); every rank must register the same "
                        "parameters in the same order")
            for x, y in zip(ref, lst):
                if x != y:
                    return (f"gradient sets differ across ranks: rank 0 has {x[0]!r} "
                            f"shape {tuple(x[1])} {x[2]}, rank {r} has {y[0]!r} shape "
                            f"{tuple(y[1])} {y[2]}; every rank must register the same "
                            "parameters in the same order")
        return "gradient sets differ across ranks"

    def _build_layout(self, specs) -> None:
        n = self.size
        caps = self.compressor.capabilities
        load = [0] * n
        layout: Dict[str, _GradInfo] = {}
        for idx, (name, shape, dt) in enumerate(specs):
            numel = 1
            for s in shape:
                numel *= s
            if numel == 0:
                raise ValueError(f"gradient {name!r} is empty (shape {shape})")
            nbytes = numel * torch.empty((), dtype=dt).element_size()
            dec = self._decide(name, nbytes)
            compress = dec.compress
            k = max(1, min(dec.partitions, numel, _KEY_LIMITS["partitions"] - 1))
            if not compress and self.config.raw_collective and n > 1:
                workflow, k = "allreduce", 1
            elif compress and caps.rounds > 1:
                workflow, k = "rounds", 1
                if self.config.raw_collective and n > 1 and \
                        type(self.compressor).summable_view is not Compressor.summable_view:
                    workflow = "rounds-allreduce"
            elif self.config.strategy == "ring" and numel // k >= n and n > 1:
                workflow = "ring"
            else:
                workflow = "ps"
            parts = []
            if workflow in ("allreduce", "rounds-allreduce"):  # no aggregator: all reduce
                layout[name] = _GradInfo(idx, name, shape, dt, numel, compress, workflow,
                                         [(0, numel, -1)])
                continue
            for s, e in chunk_bounds(numel, k):
                agg = min(range(n), key=lambda r: (load[r], r))
                load[agg] += e - s
                parts.append((s, e, agg))
            layout[name] = _GradInfo(idx, name, shape, dt, numel, compress, workflow, parts)
        if n >= _KEY_LIMITS["phases"] // 2:
            raise ValueError(f"ring phases need world size < {_KEY_LIMITS['phases'] // 2}")
        self._layout = layout
        lane = [(i.idx, i.numel, i.dtype) for i in layout.values() if i.workflow == "allreduce"]
        self._lane = plan_lane_buckets(lane, self.config.fusion_bytes,
                                       fuse=self.config.coordinator)
        for b in self._lane:
            b.key = _StepBuilder._key(len(specs) + b.index, 0, 0, 0)
        self._lane_of = {idx: b for b in self._lane for idx in b.slots}
        self._lane_by_key = {b.key: b for b in self._lane}
        cfg = self.config
        self._replayable = (cfg.replay and cfg.coordinator and n > 1 and all(
            i.workflow in ("allreduce", "rounds-allreduce") for i in layout.values()))
        self._schedule = None
        _log.debug("rank %d: layout for %d gradients", self.rank, len(layout))

    # -- submission ----------------------------------------------------------
    def _reset_step(self) -> None:
        self._unreported: List[Tuple[int, int, int]] = []
        self._outbox: Dict[Tuple[int, int], Tuple[torch.Tensor, Task]] = {}
        self._collective: Dict[int, Tuple[Task, torch.Tensor]] = {}
        self._planned: List[Task] = []  # collectives in planned rounds, not yet seen done
        self._expect: Dict[int, Task] = {}
        self._early: Dict[int, torch.Tensor] = {}
        self._handles: List[Handle] = []
        self._submitted: set = set()
        self._coll_keys: set = set()  # keys of this step's collectives (replay.py)
        self._digest = 0
        self._closed = False
        self._nonfinite = False
        self._active = False
        for b in self._lane:
            b.reset()

    def submit(self, name: str, tensor: torch.Tensor) -> Handle:
        """Start synchronising gradient ``name``; the average is written into ``tensor``.

        Raises:
            KeyError: ``name`` was not registered.
            ValueError / TypeError: wrong shape or dtype, empty, NaN/Inf
                (with ``nonfinite="raise"``), submitted twice in one step.
        """
        self._raise_if_failed()
        info = self._layout.get(name)
        if info is None:
            raise KeyError(f"gradient {name!r} was not registered; registered: "
                           f"{list(self._layout)[:10]}{' ...' if len(self._layout) > 10 else ''}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gradient {name!r}: expected a tensor, found {type(tensor).__name__}")
        if tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
            raise ValueError(f"gradient {name!r}: registered as {info.shape} {info.dtype}, "
                             f"submitted {tuple(tensor.shape)} {tensor.dtype}")
        self._device = tensor.device
        with self._cv:
            if self._closed:
                raise RuntimeError("submit() after synchronize() began; call it in the next step")
            if name in self._submitted:
                raise ValueError(f"gradient {name!r} submitted twice in one step")
        lane = self._lane_of.get(info.idx)
        if lane is not None:
            return self._submit_to_lane(lane, info, tensor)
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self.config.nonfinite != "ignore" and not all_finite(work):
            self._on_nonfinite(info.idx, name)
            work.zero_()  # keep NaN out of compressor state; the step is skipped everywhere
        check_gradient(work, nonfinite="ignore", name=name)
        handle = Handle(self, name, tensor, work)
        with self._cv:
            self._submitted.add(name)
            self._digest ^= _digest_of(info.idx)
            self._handles.append(handle)
        self._build_tasks(info, work, handle)
        self._start_step()
        handle._release()
        return handle

    def _on_nonfinite(self, idx: int, name: str) -> None:
        """Gradient ``name`` holds NaN/Inf: with ``nonfinite="raise"`` fail the step on
        every rank (the next report tells the peers) and raise here; with "skip"
        mark the step skipped (the caller zeroes what it sends)."""
        if self.config.nonfinite == "raise":
            err = ValueError(f"gradient {name!r} contains NaN or Inf (rank {self.rank}); lower "
                             "the learning rate, or use nonfinite='skip' to skip such steps "
                             "on every rank")
            self._fail(err, idx)
            self._flush_error()
            raise err
        self._nonfinite = True

    def _submit_to_lane(self, lane: LaneBucket, info: _GradInfo, tensor: torch.Tensor) -> Handle:
        """``submit`` for a gradient of the collective lane: copy it into its bucket's
        slot; the bucket's last member checks it and reports it (``lane.py``).
        (``submit`` matched the tensor to its registered shape and dtype, which
        ``register`` checked: no ``check_gradient`` here.)"""
        lane.slot(info.idx, tensor).view(info.shape).copy_(tensor)
        handle = Handle(self, info.name, tensor, tensor)
        handle._pending += 1  # released by the bucket's write_mean
        with self._cv:
            self._submitted.add(info.name)
            self._digest ^= _digest_of(info.idx)
            self._handles.append(handle)
            lane.arrived.append((info.idx, info.name, tensor, handle))
            full = lane.complete()
        if full:
            self._flush_lane(lane)
        self._start_step()
        handle._release()
        return handle

    def _flush_lane(self, lane: LaneBucket) -> None:
        """Check a bucket for NaN/Inf (per ``nonfinite``) and report it as one
        collective (a sum; ``_run_buckets`` then writes the means)."""
        if self.config.nonfinite != "ignore":
            bad = lane.first_nonfinite()
            if bad is not None:
                self._on_nonfinite(*bad)
                lane.buf.zero_()  # the step is skipped everywhere; keep the sum finite
        lane.flushed = True
        t = Task("allreduce", f"bucket{lane.index}", 0, lambda: lane.buf, info="sum")
        t.msg = (lane.key, COLLECTIVE)
        self._coll_keys.add(lane.key)
        self._graph.add(t, ())

    def _lane_partial(self) -> bool:
        """Some lane bucket got only part of its gradients this step (frozen parameters)."""
        return any(lane.arrived and not lane.complete() for lane in self._lane)

    def _build_tasks(self, info: _GradInfo, work: torch.Tensor, handle: Handle) -> None:
        b = _StepBuilder(self, info, handle)
        flat = work.view(-1)
        # submit() scanned the gradient for NaN/Inf (or zeroed it): compressors skip theirs
        vouched = self.config.nonfinite != "ignore"
        if info.workflow in ("rounds", "rounds-allreduce"):
            codec = CompressorCodec(self.compressor, self._states, f"{info.name}|0",
                                    self._seed_of, self.size, vouched)
            if info.workflow == "rounds":
                rounds_workflow(b, info.idx, work, codec, info.parts[0][2])
            else:
                rounds_collective_workflow(b, info.idx, work, codec)
            return
        for p, (s, e, agg) in enumerate(info.parts):
            x = flat[s:e]
            if info.compress:
                codec = CompressorCodec(self.compressor, self._states, f"{info.name}|{p}",
                                        self._seed_of, self.size, vouched)
            else:
                codec = RawCodec(info.dtype)
            if info.workflow == "ring":
                ring_workflow(b, info.idx, p, x, codec)
            else:
                ps_workflow(b, info.idx, p, x, codec, agg)

    def _seed_of(self, key: str) -> int:
        return zlib.crc32(f"{self.config.seed}|{self.rank}|{key}".encode()) & 0x7FFFFFFF

    def _start_step(self) -> None:
        with self._cv:
            if not self._active:
                self._active = True
                self._step_start.set()

    # -- task manager --------------------------------------------------------
    def _on_ready(self, task: Task) -> None:
        if task.kind == "send":
            try:
                payload = task.fn()
            except BaseException as e:  # a bug in a workflow: fail loudly everywhere
                self._fail(e, -1)
                return
            key, dst = task.msg
            task.nbytes = payload.numel()
            with self._cv:
                self._outbox[(key, dst)] = (payload, task)
                self._unreported.append((key, dst, task.nbytes))
                self._cv.notify_all()
        elif task.kind == "allreduce":
            key = task.msg[0]
            try:
                x = task.fn()
            except BaseException as e:  # a bug in a workflow: fail loudly everywhere
                self._fail(e, -1)
                return
            task.nbytes = x.numel() * x.element_size()
            with self._cv:
                self._collective[key] = (task, x)
                self._unreported.append((key, COLLECTIVE, task.nbytes))
                self._cv.notify_all()
        elif task.kind == "recv":
            key = task.msg[0]
            with self._cv:
                buf = self._early.pop(key, None)
                if buf is None:
                    self._expect[key] = task
            if buf is not None:
                self._deliver_to(task, buf)
        else:
            self._exec.submit(lambda: self._run(task))

    def _run(self, task: Task) -> None:
        if self._error is not None:
            return
        try:
            self._graph.start(task)
            task.fn()
        except BaseException as e:
            _log.error("rank %d: task %s failed: %s", self.rank, task.label, e)
            info = self._layout.get(task.grad)
            self._fail(e, info.idx if info else -1)
            return
        self._graph.finish(task)
        if task.owner is not None:
            task.owner._release()

    def _deliver_to(self, task: Task, buf: torch.Tensor) -> None:
        task.nbytes = buf.numel()
        task.fn(buf)
        self._graph.finish(task)

    def _deliver(self, key: int, buf: torch.Tensor) -> None:
        with self._cv:
            task = self._expect.pop(key, None)
            if task is None:
                self._early[key] = buf
                return
        self._deliver_to(task, buf)

    def _fail(self, err: BaseException, grad_idx: int) -> None:
        """Record the first error; the next report round tells every peer."""
        with self._cv:
            if self._error is None:
                self._error = err
                self._error_arg = grad_idx
            self._cv.notify_all()
        self._start_step()

    def _flush_error(self) -> None:
        """Run (or wait for) the round that reports this rank's error to its peers."""
        if self.config.threads:
            self._step_done.wait(self.config.timeout)
        elif not self._dead:
            try:
                self._sync_rounds()
            except BaseException:  # the local error is what the caller raises
                pass
            self._dead = True

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, EngineError) or not isinstance(err, Exception):
                raise err
            raise EngineError(f"synchronisation failed on rank {self.rank}: {err}") from err
        if self._closed_engine:
            raise EngineError("the engine is closed")

    # -- communication -------------------------------------------------------
    def _comm_main(self) -> None:
        while True:
            self._step_start.wait()
            self._step_start.clear()
            # A rank that failed and is closing still reports its error first (one
            # round, or one replayed bucket and one round), so its peers fail naming
            # it instead of seeing its transport close under them.
            if self._closed_engine and (self._error is None or self._dead):
                return
            if not self._dead:  # after a failure the transport is not used again
                try:
                    self._skipped = self._sync_rounds()
                except BaseException as e:
                    self._dead = True
                    self._fail(e, -1)
            self._step_done.set()
            if self._closed_engine:
                return

    def _sync_rounds(self) -> bool:
        """One step's communication: replay the recorded schedule when there is one
        (``replay.py``), else coordinated rounds, recording a schedule when the
        layout allows one. A replay that some rank cannot finish (an error, other
        gradients) hands the rest of the step to coordinated rounds.

        Returns: whether the step is skipped (NaN/Inf with ``nonfinite="skip"``).
        """
        sched = self._schedule
        if sched is not None:
            skipped = self._replay_step(sched)
            if skipped is not None:
                self._replayed += 1
                return skipped
            self._schedule = None  # the next step records afresh
            return self._comm_step()
        if not self._replayable:
            return self._comm_step()
        self._record = []
        try:
            skipped = self._comm_step()
            # a step with lane buckets missing members (parameters without gradients)
            # would miss again: keep coordinating such steps
            if self._record and not self._lane_partial():
                self._schedule = Schedule.of(self._record)
        finally:
            self._record = None
        return skipped

    def _replay_step(self, sched: Schedule) -> Optional[bool]:
        """Run ``sched``'s fused allreduces in order, with no metadata round.

        Each bucket runs once this rank's members are ready (the last one also
        waits for ``synchronize``); its first dtype group carries the status
        words (``replay.py``) that tell every rank the same thing at once.

        Returns:
            Whether the step is skipped, or None when some rank could not run
            the schedule: the bucket in hand was discarded (its members are as
            before) and the caller coordinates the rest of the step.
        """
        channel = self._data if self._data is not None else self.transport
        last = len(sched.buckets) - 1
        skipped = False
        for i, bucket in enumerate(sched.buckets):
            state = self._await_bucket(sched, i, i == last)
            t0 = time.perf_counter()
            with self._cv:
                items = [self._collective[k] for k, _, _ in bucket] if state == "ok" else []
                skip = self._nonfinite and i == last
            xs = {k: x for (k, _, _), (_, x) in zip(bucket, items)}
            groups = dtype_groups(bucket)
            erred, missed, skipped = self._status_allreduce(
                groups[0][1], xs, (state == "error", state == "miss", skip), channel)
            if erred or missed:
                _log.debug("rank %d: replay of step %d stopped at bucket %d (%s); "
                           "coordinating the rest", self.rank, self._step, i,
                           "an error" if erred else "other gradients")
                return None
            for _, members in groups[1:]:
                self._sum_fused([xs[k] for k, _, _ in members], channel)
            with self._cv:
                for k in xs:
                    del self._collective[k]
                self._unreported = [m for m in self._unreported if m[0] not in xs]
            self._finish_bucket([t for t, _ in items], t0,
                                sum(m[1] * m[2].itemsize for m in bucket))
        return skipped

    def _status_allreduce(self, members, xs: Dict[int, torch.Tensor],
                          status: Tuple[bool, bool, bool],
                          channel: Transport) -> Tuple[bool, bool, bool]:
        """Sum a replayed bucket's first dtype group with this rank's ``status`` (error,
        miss, skip) behind it (``replay.py``); return the summed words, read as flags.

        ``xs`` maps keys to the members' tensors, empty when this rank cannot run
        the bucket (it sends zeros). A lane bucket alone is summed in place, in
        its buffer's spare room, and rebuilt if the result is discarded; other
        members are summed in a copy, written back only if the result is kept.
        """
        dtype = members[0][2]
        total = sum(m[1] for m in members)
        lane = self._lane_by_key.get(members[0][0]) if len(members) == 1 and xs else None
        if lane is not None and lane.store is not None:
            flat = lane.store
        else:
            lane = None
            dev = next(iter(xs.values())).device if xs else self._device
            flat = torch.zeros(total + STATUS_LEN, dtype=dtype, device=dev)
            if xs:
                torch.cat([xs[k] for k, _, _ in members], out=flat[:total])
        flat[total:] = status_tensor(*status, dtype, flat.device)
        channel.allreduce(flat, "sum", self.config.timeout)
        words = read_status(flat[total:])
        if words[0] or words[1]:
            if lane is not None:
                lane.restore()
        elif xs and lane is None:
            _scatter(flat, [xs[k] for k, _, _ in members])
        return words

    def _sum_fused(self, xs: List[torch.Tensor], channel: Transport) -> None:
        """Sum ``xs`` (one dtype) across ranks with one allreduce, in place."""
        flat = xs[0] if len(xs) == 1 else torch.cat(xs)
        channel.allreduce(flat, "sum", self.config.timeout)
        if len(xs) > 1:
            _scatter(flat, xs)

    def _finish_bucket(self, tasks: List[Task], t0: float, nbytes: int) -> None:
        """After a bucket's allreduce: a static lane bucket writes its means (``lane.py``),
        a summed payload (PowerSGD's P or Q) goes on to its next task as it is."""
        grads = 0
        for t in tasks:
            lane = self._lane_by_key.get(t.msg[0])
            if lane is not None:
                lane.write_mean(self.size)
                grads += len(lane.arrived)
            else:
                grads += 1
            self._graph.finish(t)
        # the event's "part" counts the gradients the fused allreduce carried
        self.timeline.add(Event("bucket", "", grads, t0, time.perf_counter(), nbytes,
                                "comm", self._step))

    def _await_bucket(self, sched: Schedule, i: int, last: bool) -> str:
        """Wait until this rank can run replayed bucket ``i``: "ok" (its members are
        ready; for the last bucket, also ``synchronize`` was called), "error" (this
        rank failed) or "miss" (this rank closed a step whose gradients are not the
        schedule's: a member will never come, or a collective outside it exists)."""
        keys = [k for k, _, _ in sched.buckets[i]]
        deadline = time.monotonic() + self.config.timeout
        with self._cv:
            while True:
                if self._error is not None:
                    return "error"
                if self._closed and (self._lane_partial() or not self._coll_keys <= sched.keys
                                     or any(k not in self._coll_keys for k in keys)):
                    return "miss"
                if (self._closed or not last) and all(k in self._collective for k in keys):
                    return "ok"
                if time.monotonic() > deadline:
                    raise DeadlockError([], f"replayed bucket {i} of step {self._step} not "
                                            f"ready on rank {self.rank} within "
                                            f"{self.config.timeout:.0f} s")
                self._cv.wait(0.05)

    def _comm_step(self) -> bool:
        """Run coordinated bulk rounds until the step is complete on every rank."""
        cfg, n = self.config, self.size
        coord = Coordinator(n, cfg.batch_bytes, matching=cfg.matching, batching=cfg.coordinator,
                            fusion_bytes=cfg.fusion_bytes, solo=self._lane_by_key)
        idle, idle_rounds, last_progress = False, 0, time.monotonic()
        while True:
            with self._cv:
                wait = min(cfg.idle_wait * (1 << min(idle_rounds, 20)), cfg.idle_wait_max)
                deadline = time.monotonic() + (wait if idle else 0.0)
                while (idle and not self._closed and self._error is None
                       and sum(m[2] for m in self._unreported) < cfg.batch_bytes):
                    rest = deadline - time.monotonic()
                    if rest <= 0:
                        break
                    self._cv.wait(rest)
                msgs = self._unreported[: cfg.report_capacity]
                del self._unreported[: cfg.report_capacity]
                flags = (FLAG_CLOSED if self._closed else 0) | \
                    (FLAG_ERROR if self._error is not None else 0) | \
                    (FLAG_NONFINITE if self._nonfinite else 0)
                closed_here = self._closed
                rep = Report(flags=flags, outstanding=self._unplanned_outstanding(),
                             error_arg=self._error_arg, digest=self._digest, msgs=msgs)
            t0 = time.perf_counter()
            got = self.transport.allgather(encode_report(rep, cfg.report_capacity), cfg.timeout)
            reports = [decode_report(t) for t in got]
            self._check_peer_errors(reports)
            coord.add_reports(reports)
            closed = all(r.flags & FLAG_CLOSED for r in reports)
            if closed and len({r.digest for r in reports}) > 1:
                self._submitted_mismatch()
            if closed and coord.empty() and all(r.outstanding == 0 for r in reports):
                self._last_round(None, t0)  # lets the executor finish its bookkeeping
                return any(r.flags & FLAG_NONFINITE for r in reports)
            plan = coord.plan_round(final=closed)
            moved = bool(plan.links or plan.buckets) or any(r.msgs for r in reports)
            if plan.buckets:
                with self._cv:
                    self._planned.extend(self._collective[key][0]
                                         for b in plan.buckets for key, _ in b)
            if closed and plan.buckets and not plan.links and coord.empty():
                # Every rank has closed, and every task still outstanding on every
                # rank (collectives of earlier rounds aside) is a collective of
                # this round: once the rounds run, the step is complete
                # everywhere, so the closing metadata round is skipped.
                nkeys = sum(len(b) for b in plan.buckets)
                if all(r.outstanding == nkeys for r in reports):
                    self._last_round(plan, t0)
                    return any(r.flags & FLAG_NONFINITE for r in reports)
            if plan.links or plan.buckets:
                if self._data is None:
                    self._execute(plan, t0, self.transport)
                else:
                    self._hand_over(("round", plan))
                    # A held tail of collectives after this rank closed flushes as soon
                    # as every rank has closed: keep the metadata rounds going for it.
                    if not coord.links_pending() and not (coord.held() and closed_here):
                        # No queued link message to plan ahead: let the round run
                        # alone instead of polling peers with metadata rounds that
                        # compete for the cores (4 ranks on 2 cores measured ~40%
                        # slower fused allreduces with polling alongside). Work that
                        # arrives meanwhile is reported, and batched, right after.
                        self._wait_rounds_idle(closed_here)
            now = time.monotonic()
            if moved:
                last_progress = now
            elif closed and now - last_progress > cfg.timeout:
                self._graph.check_progress()
                raise DeadlockError([], f"no progress for {cfg.timeout:.0f} s with every rank "
                                        "closed; outstanding tasks per rank: "
                                        f"{[r.outstanding for r in reports]}")
            # A round that only held arriving collectives waits the base idle
            # time (or until a batch of new work is reported) before the next,
            # so the held bucket grows instead of paying a metadata round per
            # arriving gradient.
            held = coord.held() and not plan.links
            idle = not moved or held
            idle_rounds = idle_rounds + 1 if not moved else 0

    def _last_round(self, plan, t0: float) -> None:
        """Run the step's last round (``plan``, or none), then wait until the round
        executor has finished every round handed to it."""
        if self._data is None:
            if plan is not None:
                self._execute(plan, t0, self.transport)
            return
        if plan is not None:
            self._hand_over(("round", plan))
        fence = threading.Event()
        self._hand_over(("fence", fence))
        fence.wait(self.config.timeout)

    def _unplanned_outstanding(self) -> int:
        """Tasks not done, less the collectives already planned into a round (they
        complete without further coordination). Call with ``self._cv`` held.

        The graph is read first: a planned collective finishing in between is then
        counted, not missed, so the figure can only be too high (one more
        metadata round), never too low."""
        n = self._graph.outstanding()
        self._planned = [t for t in self._planned if t.state != "done"]
        return n - len(self._planned)

    def _wait_rounds_idle(self, reported_closed: bool) -> None:
        """Block until the round executor has finished every handed-over round, or
        until this rank has news worth one metadata round: it closed its step since
        its last report (the planner can then flush every remaining bucket behind
        the running one), or it has a full fusion bucket of newly ready work."""
        deadline = time.monotonic() + self.config.timeout
        with self._cv:
            while self._rounds_busy and self._error is None:
                if time.monotonic() > deadline:
                    return  # the executor's own transport timeout reports the failure
                if (self._closed and not reported_closed) or \
                        sum(m[2] for m in self._unreported) >= self.config.fusion_bytes:
                    return
                self._cv.wait(0.05)

    def _hand_over(self, item: Tuple[str, Any]) -> None:
        """Queue work for the round executor; at most one round waits (backpressure)."""
        if item[0] == "round":
            with self._cv:
                self._rounds_busy += 1
        while True:
            try:
                self._round_q.put(item, timeout=0.05)
                return
            except queue.Full:
                if self._error is not None:
                    raise self._error from None

    def _round_main(self) -> None:
        """The round executor: runs planned rounds in order on the data channel."""
        while True:
            item = self._round_q.get()
            if item is None:
                return
            kind, arg = item
            if kind == "fence":
                arg.set()
            else:
                if self._error is None:
                    try:
                        self._execute(arg, time.perf_counter(), self._data)
                    except BaseException as e:
                        self._fail(e, -1)
                with self._cv:
                    self._rounds_busy -= 1
                    self._cv.notify_all()

    def _check_peer_errors(self, reports: List[Report]) -> None:
        bad = [(r, rep) for r, rep in enumerate(reports) if rep.flags & FLAG_ERROR]
        if not bad:
            return
        if self._error is not None:
            raise self._error
        names = {i.idx: i.name for i in self._layout.values()}
        parts = [f"rank {r}" + (f" (gradient {names[rep.error_arg]!r})"
                                if rep.error_arg in names else "") for r, rep in bad]
        raise EngineError(f"synchronisation aborted: an error occurred on {', '.join(parts)}; "
                          "see that rank's log for the cause")

    def _submitted_mismatch(self) -> None:
        mine = msgpack.packb(sorted(self._submitted))
        lists = [set(msgpack.unpackb(b)) for b in
                 self.transport.allgather_bytes(mine, self.config.timeout)]
        union = set().union(*lists)
        missing = {r: sorted(union - s)[:5] for r, s in enumerate(lists) if union - s}
        desc = "; ".join(f"rank {r} did not submit {m}" for r, m in missing.items())
        raise GradientMismatchError(
            f"ranks submitted different gradients in step {self._step}: {desc}. Every rank "
            "must submit the same gradients each step (submit zeros for unused parameters)")

    def _execute(self, plan, t0: float, channel: Transport) -> None:
        if plan.buckets:
            self._run_buckets(plan.buckets, channel)
        if plan.links:
            self._exchange(plan, time.perf_counter() if plan.buckets else t0, channel)

    def _run_buckets(self, buckets, channel: Transport) -> None:
        """The collective lane: one fused allreduce (a sum) per bucket and dtype; a
        static bucket of whole gradients then writes their means (``lane.py``), a
        summed payload (PowerSGD's P or Q) goes on to its next task as it is.

        Every rank runs the same buckets in the same order (the replicated
        coordinator planned them), so the allreduce calls match up.
        """
        for bucket in buckets:
            t0 = time.perf_counter()
            with self._cv:
                items = [self._collective.pop(key) for key, _ in bucket]
            members = [(key, x.numel(), x.dtype) for (key, _), (_, x) in zip(bucket, items)]
            if self._record is not None:
                self._record.append(members)
            xs = {key: x for (key, _), (_, x) in zip(bucket, items)}
            for _, group in dtype_groups(members):
                self._sum_fused([xs[k] for k, _, _ in group], channel)
            self._finish_bucket([t for t, _ in items], t0, sum(nb for _, nb in bucket))

    def _exchange(self, plan, t0: float, channel: Transport) -> None:
        me, n = self.rank, self.size
        send: List[Optional[torch.Tensor]] = [None] * n
        recv_nbytes = [0] * n
        sent_tasks: List[Task] = []
        with self._cv:
            outgoing = {d: [self._outbox.pop((k, d)) for k, _ in msgs]
                        for d, msgs in plan.sends_of(me).items()}
        total = 0
        for dst, items in outgoing.items():
            sizes = [p.numel() for p, _ in items]
            if len(items) == 1 and sizes[0] % 8 == 0:
                buf = items[0][0].reshape(-1)
            else:
                buf = torch.empty(sum(_pad8(s) for s in sizes), dtype=torch.uint8)
                off = 0
                for (p, _), s in zip(items, sizes):
                    buf[off: off + s] = p.reshape(-1)
                    off += _pad8(s)
            send[dst] = buf
            total += buf.numel()
            sent_tasks.extend(t for _, t in items)
        recvs = plan.recvs_of(me)
        for src, msgs in recvs.items():
            recv_nbytes[src] = sum(_pad8(nb) for _, nb in msgs)
        out = channel.alltoallv(send, recv_nbytes, self.config.timeout)
        for t in sent_tasks:
            self._graph.finish(t)
        for src, msgs in recvs.items():
            buf, off = out[src], 0
            if buf is None or buf.numel() != recv_nbytes[src]:
                raise EngineError(f"rank {src} sent {0 if buf is None else buf.numel()} bytes, "
                                  f"expected {recv_nbytes[src]}")
            for key, nb in msgs:
                self._deliver(key, buf[off: off + nb])
                off += _pad8(nb)
        self.timeline.add(Event("round", "", len(plan.links), t0, time.perf_counter(),
                                total + sum(recv_nbytes), "comm", self._step))

    # -- step boundary -------------------------------------------------------
    def synchronize(self, timeout: Optional[float] = None) -> bool:
        """Close this step's submissions and wait until every gradient is averaged.

        Returns:
            True, or False when the step was skipped because some rank saw
            NaN/Inf with ``nonfinite="skip"`` (every rank returns False).

        Raises:
            EngineError, PeerError, GradientMismatchError: on every rank.
        """
        self._raise_if_failed()
        for lane in self._lane:  # buckets some of whose gradients were not submitted
            if lane.arrived and not lane.flushed:
                self._flush_lane(lane)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._start_step()
        if self.config.threads:
            t = self.config.timeout if timeout is None else timeout
            if not self._step_done.wait(t + 5.0):
                self._fail(TimeoutError(f"step {self._step} not done within {t:.0f} s"), -1)
        elif not self._dead:
            self._step_start.clear()
            try:
                self._skipped = self._sync_rounds()
            except BaseException as e:
                self._dead = True
                self._fail(e, -1)
        self._raise_if_failed()
        for h in self._handles:
            h.wait()
        done = self._graph.clear_done()
        if self.timeline.enabled:
            self.timeline.extend(Event(t.kind, t.grad, t.part, t.start, t.end, t.nbytes, t.queue,
                                       self._step) for t in done)
        skipped = self._skipped
        with self._cv:
            self._reset_step()
        self._step_done.clear()
        self._skipped = False
        self._step += 1
        return not skipped

    @property
    def step(self) -> int:
        """Number of completed synchronisation steps."""
        return self._step

    @property
    def replayed_steps(self) -> int:
        """Steps whose communication replayed a recorded schedule, with no metadata
        round (``EngineConfig.replay``); the others were coordinated."""
        return self._replayed

    def layout(self) -> Dict[str, Dict[str, Any]]:
        """Per gradient: compress?, workflow, partitions and their aggregators."""
        return {n: {"compress": i.compress, "workflow": i.workflow,
                    "partitions": [(s, e, a) for s, e, a in i.parts]}
                for n, i in self._layout.items()}

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Compressor states (error feedback, warm starts, momenta) and the step count."""
        return {"format": "hipress-like-engine", "version": 1, "step": self._step,
                "compressor": repr(self.compressor),
                "states": {k: dict(v) for k, v in self._states.items()}}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (same compressor and gradients).

        Raises:
            ValueError: not an engine state, or saved with another compressor.
        """
        if not isinstance(d, Mapping) or d.get("format") != "hipress-like-engine":
            raise ValueError("not a hipress-like engine state_dict")
        if d.get("version") != 1:
            raise ValueError(f"engine state version {d.get('version')!r} is not supported")
        if d.get("compressor") != repr(self.compressor):
            raise ValueError(f"state was saved with compressor {d.get('compressor')}, this "
                             f"engine uses {self.compressor!r}")
        self._states.clear()
        self._states.update({k: dict(v) for k, v in d["states"].items()})
        self._step = int(d.get("step", 0))

    def close(self) -> None:
        """Stop the background threads and free the engine's own data channel.

        Call it on every rank: the channel from ``transport.split()`` (a
        process group of its own on torch.distributed) is destroyed once every
        rank has closed it, waiting up to 10 s for them (then it is left to
        process exit). The transport passed in is left open.
        """
        if self._closed_engine:
            return
        self._closed_engine = True
        self._step_start.set()
        if self._comm_thread is not None:
            self._comm_thread.join(timeout=5)
        if self._round_thread is not None:
            self._round_q.put(None)
            self._round_thread.join(timeout=5)
        self._exec.shutdown()
        if self._data is not None:  # the engine's own channel from transport.split()
            try:
                if not self._data.free(min(self.config.timeout, 10.0)):
                    _log.debug("rank %d: a peer did not close its engine within 10 s; "
                               "the data channel is left to process exit", self.rank)
            except Exception as e:  # closing must not mask the caller's error
                _log.debug("rank %d: closing the data channel failed: %s", self.rank, e)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _scatter(flat: torch.Tensor, xs: List[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into the tensors it concatenates."""
    off = 0
    for x in xs:
        x.copy_(flat[off: off + x.numel()].view_as(x))
        off += x.numel()


class _StepBuilder:
    """The interface workflows use to add tasks for one gradient."""

    def __init__(self, engine: Engine, info: _GradInfo, handle: Handle):
        self.engine = engine
        self.info = info
        self.handle = handle
        self.rank, self.size = engine.rank, engine.size

    @staticmethod
    def _key(g: int, p: int, phase: int, src: int) -> int:
        """A message key, identical on every rank: gradient, partition, phase, source."""
        return (((g << 12) | p) << 12 | phase) << 10 | src

    def compute(self, kind: str, g: int, p: int, fn, deps=()) -> Task:
        """Add a compute task (encode, decode, merge, write)."""
        t = Task(kind, self.info.name, p, fn)
        if kind == "write":
            t.owner = self.handle
            with self.handle._lock:
                self.handle._pending += 1
        return self.engine._graph.add(t, deps)

    def send(self, g: int, p: int, phase: int, dst: int, get, deps) -> Task:
        """Add a send of the payload ``get()`` returns, to rank ``dst``."""
        t = Task("send", self.info.name, p, get, info=f"->{dst} ph{phase}")
        t.msg = (self._key(g, p, phase, self.rank), dst)
        return self.engine._graph.add(t, deps)

    def collective(self, g: int, get, phase: int = 0, deps=()) -> Task:
        """Add a collective-lane task: the tensor ``get()`` returns (when the task is
        ready) is summed in place by a fused allreduce once every rank has it ready,
        an intermediate payload (e.g. PowerSGD's P) for the next task. (Whole
        uncompressed gradients take the lane's static buckets instead, ``lane.py``.)"""
        t = Task("allreduce", self.info.name, 0, get, info="sum")
        t.msg = (self._key(g, 0, phase, 0), COLLECTIVE)
        self.engine._coll_keys.add(t.msg[0])
        return self.engine._graph.add(t, deps)

    def recv(self, g: int, p: int, phase: int, src: int, box: Dict[str, Any], slot: str) -> Task:
        """Add a receive from ``src``; the bytes land in ``box[slot]``."""
        t = Task("recv", self.info.name, p, lambda buf: box.__setitem__(slot, buf),
                 info=f"<-{src} ph{phase}")
        t.msg = (self._key(g, p, phase, src), src)
        return self.engine._graph.add(t, ())
