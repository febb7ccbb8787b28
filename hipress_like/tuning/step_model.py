"""The step-time model: one plan's synchronisation time and step time with backward overlap.

HiPress's cost model (Sec. 3.3, Eq. 1 and 2) prices one gradient's
synchronisation; a training step also computes, and CaSync starts
synchronising a gradient as soon as backward produces it (Sec. 5, Fig. 8b).
What a plan costs per step is therefore how far synchronisation runs past
the end of backward. ``predict_step`` predicts it; ``advise`` (advise.py)
runs it for every configuration a user can run and ranks them.

The step-time model of one configuration:

1. Compute timeline (``ComputeTimeline``): forward F, then backward, in
   which gradient g becomes final at ``F + ready(g)``; backward ends at
   ``F + B``; the optimizer's update U runs after synchronisation. Measured
   (``measure_compute``) by running the torch module's forward and backward
   with a post-accumulate-grad hook on every parameter, as the adapters
   hook them; with R ranks sharing this host's cores, R copies run at once
   so the timings carry the contention. Without a module, a given compute
   time is split F : B = 1 : 2 (backward costs about twice the forward's
   FLOPs) and B is spread over the gradients in reverse registration order
   in proportion to their bytes (``ComputeTimeline.spread``).
2. Synchronisation jobs, from the plan's decision per gradient
   (``Plan.decide``). Uncompressed gradients fill the engine's static lane
   buckets (``casync.lane.plan_lane_buckets``: reverse registration order,
   closing at ``fusion_bytes``); a bucket is released when its last member
   is final and occupies the link for ``Planner.t_orig`` of its bytes (the
   profile's timed lane, else Table I's Ring-AR). A compressed gradient is
   released when it is final and costs ``Planner.t_cpr`` at its K: HiPress
   Eq. 2 with the alpha, beta, gamma of Table 3 / Sec. 6.1, partitions
   beyond N batched (Sec. 3.3), plus the engine's measured cost beyond
   Eq. 2 (``cost_model.engine_term.EngineTerm``). That whole is split into phases: the
   encodes of its K partitions on the engine's compute thread, then the
   link (transfers and coordination rounds), then the rest of its CPU work
   (Eq. 2's decodes, the per-byte part of the engine's extra cost:
   ``_job_phases``).
3. Three servers (``_simulate``): the caller's thread runs forward and
   backward, the engine's single compute thread runs CPU phases and the
   link runs link phases, each in the order jobs reach it, so one
   gradient's transfers overlap the next one's encode (CaSync's pipeline,
   Sec. 3.1). On hosts where a rank's threads share its CPU (``cpu_share``
   below 1: one torch thread per rank and fewer than two cores per rank),
   backward and compression slow each other while both run, and the
   transport moves bytes at that share while backward runs. Latency and
   coordination rounds (a synchronisation's time beyond its CPU work and
   its bytes on the wire, ``Planner.wire_time``) delay it without keeping
   the link from other gradients' bytes.
   ``step = time when backward and every job are done + U``. The
   synchronisation time reported beside it is the sum of all phases
   (nothing overlapped).
4. The host's cores (``host_bound``). The profile's engine timings each
   held the host alone; in training a rank's compute, its engine threads
   (compute, communication, rounds) and the transport's threads all need
   its cores. When the profile recorded the CPU seconds of each
   synchronisation (``CompressorProfile.engine_cpu_by``,
   ``Profile.lane_cpu``), the step is at least the rank's compute CPU plus
   its synchronisations' CPU over its cores (``cores_per_rank``); each
   profiled synchronisation held a whole engine step, so the step's own
   CPU (the smallest fixed cost among the fits used) is counted once. With
   more ranks than cores this bound decides most compressed rows (a step
   then takes about its rank's CPU time times ranks over cores, which the
   three servers alone under-predict; docs/design.md has the numbers).

5. Aggregation inside a node (``LocalStage``), for machines of several
   GPUs each (HiPress's testbed: 8 V100s per node). The node's GPUs first
   reduce-scatter a gradient over the node's own links (NVLink), the node
   synchronises it with the other nodes as one worker of the model above,
   and the GPUs then all-gather the result: each a ring over the node's G
   GPUs, ``(G-1)`` steps of ``m/G`` bytes (Patarasuk and Yuan, "Bandwidth
   optimal all-reduce algorithms for clusters of workstations", JPDC 2009,
   Sec. 3; together ``2(G-1)/G m`` bytes, the ring's volume law). The two
   rings occupy a fourth server, the node's local link, in arrival order
   (HiPress's "local aggregation", Sec. 6.2.1).

Steps 1, 3, 4 and 5 and the lane buckets are not in HiPress, which measures
throughput rather than predicting it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cost_model.model import Link
from ..cost_model.plan import Plan
from ..cost_model.planner import Planner
from ..cost_model.profile import ProfileError
from .compute import ComputeTimeline

__all__ = ["predict_step", "host_bound", "cpu_share_of", "LocalStage"]

Sizes = Sequence[Tuple[str, int]]


def _lane_buckets(sizes: Sizes, lane: Sequence[str], fusion_bytes: int) -> List[List[str]]:
    """The engine's static lane buckets (``casync.lane.plan_lane_buckets``'s rule for
    one dtype): reverse registration order, a bucket closing at ``fusion_bytes``."""
    inlane, buckets, cur, held = set(lane), [], [], 0
    for name, nbytes in reversed(list(sizes)):
        if name in inlane:
            cur.append(name)
            held += nbytes
            if held >= fusion_bytes:
                buckets.append(cur)
                cur, held = [], 0
    return buckets + ([cur] if cur else [])


@dataclass(frozen=True)
class LocalStage:
    """Aggregation among the GPUs of one node around the network synchronisation
    (module doc, step 5).

    Attributes:
        gpus: GPUs per node G (>= 1; 1: no local stage).
        link: the node's local link (``Link``: latency per ring step, bytes per
            second each GPU sends to its ring neighbour).

    Example:
        >>> st = LocalStage(4, Link(0.0, 1e9))
        >>> [round(t, 6) for t in st.times(8e6)]  # 3 steps of 2 MB each way
        [0.006, 0.006]
    """

    gpus: int
    link: Link

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise ValueError(f"gpus per node must be an integer >= 1, found {self.gpus!r}")

    def times(self, nbytes: float) -> Tuple[float, float]:
        """Seconds of the reduce-scatter before and the all-gather after the network
        synchronisation of ``nbytes``: each ``(G-1) (latency + nbytes/G / bandwidth)``."""
        g = self.gpus
        if g == 1 or nbytes <= 0:
            return 0.0, 0.0
        each = (g - 1) * (self.link.latency + nbytes / g / self.link.bandwidth)
        return each, each


@dataclass
class _Job:
    """One synchronisation in the step simulation: released when its gradients are
    final (``ready``: seconds of forward and backward work), then its phases in
    order, each on the engine's compute thread ("cpu"), the link ("link"), the
    node's local link ("local", ``LocalStage``) or none ("wait")."""

    ready: float
    phases: List[List[Any]]  # [resource, seconds left]


def _job_phases(planner: Planner, fast: Planner, m: int, k: int) -> List[List[Any]]:
    """A compressed synchronisation split into CPU and link phases (module doc, step 2).

    The whole is ``Planner.t_cpr``. Its CPU work: Eq. 2's encodes and decodes
    (Eq. 2 on an instant link, ``fast``) plus the engine's per-byte cost
    beyond Eq. 2 (the aggregator's re-encode, final decodes, copies, error
    feedback: ``EngineTerm.per_byte``); the encodes of this rank's K
    partitions come before any transfer, the rest after. What remains of the
    whole is communication: the payload bytes occupy the link
    (``Planner.wire_time``); the rest (latency, coordination rounds, waiting
    on peers) delays this synchronisation without keeping the link from
    others' bytes."""
    total = planner.t_cpr(m, k)
    extra = max(0.0, planner.engine_term.per_byte * m) if planner.engine_term else 0.0
    cpu = min(total, fast.eq2(m, k) + extra)
    pre = min(cpu, planner.cp.encode(m / k) * k)
    wire = min(total - cpu, planner.wire_time(m, k))
    return [["cpu", pre], ["link", wire], ["wait", total - cpu - wire], ["cpu", cpu - pre]]


def _lane_phases(planner: Planner, nbytes: int) -> List[List[Any]]:
    """A lane bucket's phases: its bytes on the link (``Planner.wire_time_orig``),
    then the rest of its time (the timed lane's latency) as a wait."""
    total, wire = planner.t_orig(nbytes, 1), planner.wire_time_orig(nbytes)
    return [["link", wire], ["wait", total - wire]]


def _simulate(timeline: ComputeTimeline, jobs: List[_Job], cpu_share: float) -> float:
    """Seconds until backward and every job are done (the update not included).

    A fluid simulation of servers: the caller's thread runs forward and
    backward (releasing jobs as it passes their ready points), the engine's
    one compute thread runs CPU phases in arrival order, the link runs link
    phases in arrival order, and the node's local link (``LocalStage``; at
    full speed, GPU copies need no CPU) runs local phases in arrival order;
    wait phases (latency, rounds) run all at once. While the caller's thread
    and the compute thread both have work, each runs at ``cpu_share`` of its
    speed alone (0.5: they split one rank's CPU; 1.0: a core each). While
    the caller's thread computes, the link too moves bytes at ``cpu_share``:
    the transport's threads copy and reduce them on the same cores (4 ranks
    on 2 cores, 1 Gbit/s: a 40 MB lane synchronisation took 581 ms alone, a
    matmul load 544 ms alone, and
    both started together 1108 ms).
    """
    work = timeline.forward_s + timeline.backward_s
    pending = sorted(jobs, key=lambda j: j.ready)
    queues: Dict[str, List[_Job]] = {"cpu": [], "link": [], "local": [], "wait": []}
    t, done, eps = 0.0, 0.0, 1e-12

    def route(job: _Job) -> None:
        while job.phases and job.phases[0][1] <= eps:
            job.phases.pop(0)
        if job.phases:
            queues[job.phases[0][0]].append(job)

    while True:
        while pending and pending[0].ready <= done + eps:
            route(pending.pop(0))
        main = done < work - eps
        if not (main or pending or any(queues.values())):
            return t
        rate = cpu_share if main and queues["cpu"] else 1.0
        lrate = cpu_share if main else 1.0
        steps = []
        if main:
            stop = min(pending[0].ready, work) if pending else work
            steps.append((stop - done) / rate)
        if queues["cpu"]:
            steps.append(queues["cpu"][0].phases[0][1] / rate)
        if queues["link"]:
            steps.append(queues["link"][0].phases[0][1] / lrate)
        if queues["local"]:
            steps.append(queues["local"][0].phases[0][1])
        steps.extend(j.phases[0][1] for j in queues["wait"])
        dt = max(0.0, min(steps))
        t += dt
        if main:
            done = min(work, done + dt * rate)
        waiting, queues["wait"] = queues["wait"], []  # those that waited through dt
        # the jobs each server ran through dt, taken before any moves on: a job that
        # finishes a phase here starts its next one after dt, not within it
        heads = [(res, speed, queues[res][0]) for res, speed in
                 (("cpu", rate), ("link", lrate), ("local", 1.0)) if queues[res]]
        for res, speed, head in heads:
            head.phases[0][1] -= dt * speed
            if head.phases[0][1] <= eps:
                queues[res].pop(0)
                head.phases.pop(0)
                route(head)
        for job in waiting:  # every wait runs at once: it occupies nothing
            job.phases[0][1] -= dt
            if job.phases[0][1] <= eps:
                job.phases.pop(0)
                route(job)
            else:
                queues["wait"].append(job)


def host_bound(timeline: ComputeTimeline, sync_cpu: float, cores_per_rank: float) -> float:
    """The shortest step the host's cores allow (seconds; module doc, step 4).

    A rank's cores must run its compute and its synchronisation's CPU work
    (``sync_cpu``). With ``c = cores_per_rank`` a step takes at least
    ``(compute CPU + sync_cpu) / c``, the compute's CPU being
    ``floor_s * min(1, c)``: a timeline measured with the ranks sharing the
    host (``measure_compute``) ran at the rank's share of the cores.

    Example:
        >>> t = ComputeTimeline(0.1, 0.2, {}, 0.0)
        >>> round(host_bound(t, 0.2, 0.5), 3), round(host_bound(t, 0.2, 2.0), 3)
        (0.7, 0.25)
    """
    if not cores_per_rank > 0:
        raise ValueError(f"cores_per_rank must be > 0, found {cores_per_rank!r}")
    return (timeline.floor_s * min(1.0, cores_per_rank) + sync_cpu) / cores_per_rank


def predict_step(plan: Plan, sizes: Sizes, n: int, planners: Mapping[str, Planner],
                 timeline: ComputeTimeline, *, fusion_bytes: int = 25 << 20,
                 cpu_share: Optional[float] = None,
                 cores_per_rank: Optional[float] = None,
                 local: Optional[LocalStage] = None) -> Tuple[float, float]:
    """Predict (synchronisation seconds, step seconds) of one plan (see the module doc).

    Args:
        plan: what the engine runs (``Plan.decide`` per gradient).
        sizes: (name, bytes) in registration order.
        n: number of nodes N.
        planners: a ``Planner`` per compressor name the plan may use, all for
            the plan's strategy and N; any of them prices the lane.
        timeline: the compute timeline.
        fusion_bytes: the engine's lane bucket size (``EngineConfig.fusion_bytes``).
        cpu_share: speed of backward and of the engine's compression work
            while both run, relative to each alone (default
            ``cpu_share_of(cores_per_rank)``, 1.0 without it).
        cores_per_rank: cores each rank may use; with it the step is at least
            ``host_bound`` of the synchronisation's CPU seconds (when the
            profile recorded them). None: the host's cores are not modelled.
        local: aggregation inside each node around every synchronisation
            (module doc, step 5); ``n`` then counts nodes, each one worker of
            the model. None: one GPU (or process) per worker.

    Raises:
        ProfileError: the plan compresses with a compressor not in ``planners``.
    """
    sync, step, _ = _predict(plan, sizes, n, planners, timeline, fusion_bytes, cpu_share,
                             cores_per_rank, local)
    return sync, step


def _predict(plan: Plan, sizes: Sizes, n: int, planners: Mapping[str, Planner],
             timeline: ComputeTimeline, fusion_bytes: int, cpu_share: Optional[float],
             cores_per_rank: Optional[float], local: Optional[LocalStage] = None
             ) -> Tuple[float, float, Optional[float]]:
    """``predict_step`` and the synchronisation's CPU seconds per rank (None when
    the profile lacks them for some part of the plan)."""
    if cpu_share is None:
        cpu_share = 1.0 if cores_per_rank is None else cpu_share_of(cores_per_rank)
    if (n == 1 and (local is None or local.gpus == 1)) or not sizes:
        return 0.0, timeline.floor_s, 0.0
    if not 0 < cpu_share <= 1:
        raise ValueError(f"cpu_share must be in (0, 1], found {cpu_share!r}")
    if cores_per_rank is not None and not cores_per_rank > 0:
        raise ValueError(f"cores_per_rank must be > 0, found {cores_per_rank!r}")
    cpus: List[Optional[float]] = []
    fixed: List[float] = []  # each used CPU fit's cost per synchronisation
    size_of = dict(sizes)
    jobs: List[_Job] = []
    job_bytes: List[int] = []  # each job's gradient bytes (the local stage moves them)
    lane, fast = [], {}
    any_planner = next(iter(planners.values()))
    for name, nbytes in reversed(list(sizes)):
        dec = plan.decide(name, nbytes, n)
        if not dec.compress:
            lane.append(name)
            continue
        comp = plan.compressor_of(dec)[0]
        if comp not in planners:
            have = ", ".join(sorted(planners)) or "none"
            raise ProfileError(f"the plan compresses {name!r} with {comp!r}, which the profile "
                               f"lacks (it has: {have}); profile it with: hipress-profile "
                               f"profile --compressors {comp}")
        pl = planners[comp]
        if comp not in fast:  # Eq. 2 on an instant link: its compute terms alone
            fast[comp] = Planner(pl.profile.with_link(Link(0.0, 1e30)), comp, n, pl.strategy,
                                 model_strategy=pl.model_strategy, back=pl.back and pl.back.name)
        jobs.append(_Job(timeline.ready(name),
                         _job_phases(pl, fast[comp], nbytes, dec.partitions)))
        job_bytes.append(nbytes)
        cpus.append(pl.cpu_cpr(nbytes, dec.partitions))
        if pl.cpu_term is not None:
            fixed.append(pl.cpu_term.fixed)
    for bucket in _lane_buckets(sizes, lane, fusion_bytes):
        held = sum(size_of[g] for g in bucket)
        jobs.append(_Job(max(timeline.ready(g) for g in bucket),
                         _lane_phases(any_planner, held)))
        job_bytes.append(held)
        cpus.append(any_planner.cpu_orig(held))
        if any_planner.lane_cpu_term is not None:
            fixed.append(any_planner.lane_cpu_term.fixed)
    if local is not None and local.gpus > 1:
        for job, held in zip(jobs, job_bytes):
            before, after = local.times(held)
            job.phases = [["local", before]] + job.phases + [["local", after]]
    sync = sum(p[1] for j in jobs for p in j.phases)
    step = _simulate(timeline, jobs, cpu_share) + timeline.update_s
    cpu = None
    if cpus and all(c is not None for c in cpus):
        # every profiled sync held a whole engine step, whose own CPU (opening and
        # closing the step, its rounds) a real step pays once: the smallest fixed
        # cost among the fits used stands for it
        shared = max(0.0, min(fixed)) if fixed else 0.0
        cpu = max(0.0, sum(cpus) - (len(cpus) - 1) * shared)  # type: ignore[arg-type]
    if cpu is not None and cores_per_rank is not None:
        step = max(step, host_bound(timeline, cpu, cores_per_rank))
    return sync, step, cpu


def cpu_share_of(cores_per_rank: float) -> float:
    """``predict_step``'s ``cpu_share`` for ranks of one torch thread each.

    A rank runs backward on its thread and compression on the engine's
    compute thread. With two cores or more per rank both run at full speed
    (1.0); with one core or less they split the rank's share (0.5); in
    between, ``cores_per_rank / 2``.

    Example:
        >>> cpu_share_of(0.5), cpu_share_of(1.5), cpu_share_of(8)
        (0.5, 0.75, 1.0)
    """
    return min(1.0, max(1.0, cores_per_rank) / 2)
