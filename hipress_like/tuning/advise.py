"""Predicted step times of the ways to run one model, ranked (``hipress-profile advise``).

The idea: HiPress's cost model (Sec. 3.3, Eq. 1 and 2) prices one
gradient's synchronisation; a training step also computes, and CaSync starts
synchronising a gradient as soon as backward produces it (Sec. 5, Fig. 8b).
What a configuration costs per step is therefore how far synchronisation
runs past the end of backward. ``advise`` predicts that for every
configuration a user can run, and ranks them:

- no compression (every gradient in the engine's allreduce lane);
- each profiled compressor under CaSync-PS and CaSync-Ring, with the
  engine's default size rule (``plan=None``; ``compressor_plans="rule"``)
  or with the cost model's plan for that compressor alone ("model");
- the per-gradient plan (``planner.plan_per_gradient``): per gradient the
  cheapest of the candidate compressors or none, under PS and under Ring.

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
   Eq. 2 (``planner.EngineTerm``). That whole is split into phases: the
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
   backward and compression slow each other while both run.
   ``step = time when backward and every job are done + U``. The
   synchronisation time reported beside it is the sum of all phases
   (nothing overlapped).

Steps 1 and 3 and the lane buckets are not in HiPress, which measures
throughput rather than predicting it. ``paper_profile`` is the built-in
``--profile paper``: Table 3's alpha/beta/gamma (which the model always
uses) driven by curves taken from the paper's own figures.

Example:
    >>> from hipress_like.cost_model.model import Link
    >>> from hipress_like.cost_model.presets import preset
    >>> sizes = preset("vgg19")
    >>> adv = advise(sizes, 4, paper_profile(Link(10e-6, 1.25e9)),
    ...              ComputeTimeline.spread(sizes, 0.3))
    >>> adv.best.label != "none"
    True
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cost_model.model import Curve, Link
from ..cost_model.plan import GradientPlan, Plan, SizeRule
from ..cost_model.planner import NEVER, Planner, plan_per_gradient
from ..cost_model.profile import CompressorProfile, Profile, ProfileError

__all__ = ["ComputeTimeline", "Row", "Advice", "advise", "predict_step", "paper_profile",
           "measure_compute", "optimizer_line", "cpu_share_of", "with_link", "load_module",
           "infer_input_shape", "PAPER_COMPRESSORS"]

Sizes = Sequence[Tuple[str, int]]

# -- the paper's values (--profile paper) ---------------------------------------------
# HiPress Sec. 6.4: CompLL-TBQ encodes 256 MB >12x faster than OSS-TBQ's 38.17 ms.
_PAPER_BYTES_PER_S = 256 * 2**20 / (38.17e-3 / 12)
# Payload bytes per input byte of the paper's quantizers: onebit (Table 7's
# algorithm) 1 bit of 32, TBQ at Fig. 14's r = 1/16, TernGrad's 2 bits.
PAPER_COMPRESSORS: Mapping[str, float] = {"onebit": 1 / 32, "tbq": 1 / 16, "terngrad": 1 / 16}


def _paper_fixed_cost() -> float:
    """Seconds per encode or decode beyond the bytes, so that Eq. 2 breaks even with
    Eq. 1 at 1 MB as HiPress Fig. 14a finds (N = 16, r = 1/16, K = 1, 56 Gbit/s,
    co-located CaSync-PS: alpha = 2(N-1), beta = K, gamma = N, Sec. 6.1). The
    latencies cancel (same alpha on both sides): alpha * (m - r m) / bw =
    (beta + gamma) * c + beta * m / v + gamma * m / v."""
    n, m, r, bw = 16, float(1 << 20), 1 / 16, 56e9 / 8
    alpha, beta, gamma = 2 * (n - 1), 1, n
    saved = alpha * (m - r * m) / bw
    return (saved - (beta + gamma) * m / _PAPER_BYTES_PER_S) / (beta + gamma)


def paper_profile(link: Link) -> Profile:
    """The built-in profile of ``--profile paper``: HiPress's published values.

    The alpha, beta, gamma of Table 3 (and Sec. 6.1 for the co-located PS)
    are the cost model's own (``cost_model.model.SYNC_PARAMS``); this adds
    the curves they multiply, from the paper's figures, for the quantizers of
    ``PAPER_COMPRESSORS``: encode and decode at the speed of CompLL-TBQ
    (Sec. 6.4) plus a fixed cost per operator chosen so that compression
    starts to pay at 1 MB as in Fig. 14a; headers are ignored as the paper
    does. The link is the caller's (the paper's clusters ran 56 and 100
    Gbit/s). GPU kernels, so not this machine's costs.

    Args:
        link: the link to price transfers with.

    Returns:
        A ``Profile`` whose meta names its source.
    """
    fixed = _paper_fixed_cost()
    sizes = [float(4 << (2 * i)) for i in range(1, 15)]  # 16 B .. 1 GB, every 4x
    comps = {}
    for name, r in PAPER_COMPRESSORS.items():
        comps[name] = CompressorProfile(
            name=name, category="quantization", ratio=r, header_bytes=0,
            encode=Curve.linear(fixed, 1 / _PAPER_BYTES_PER_S, sizes),
            # a decode writes m = payload / r bytes
            decode=Curve.linear(fixed, 1 / (r * _PAPER_BYTES_PER_S), [s * r for s in sizes]))
    return Profile(link=link, compressors=comps,
                   meta={"source": "HiPress Table 3 / Sec. 6.1 counts; curves from Sec. 6.4 "
                         "(TBQ speed) and Fig. 14a (1 MB break-even)", "link_source": "given"})


# -- the compute timeline ---------------------------------------------------------------
@dataclass(frozen=True)
class ComputeTimeline:
    """When each gradient of one rank's step is final, and the compute around it.

    Attributes:
        forward_s: seconds from the step's start to the start of backward.
        backward_s: seconds of backward.
        ready_s: per gradient name, seconds after backward starts when it is
            final (the post-accumulate-grad hook fires). Missing names: at
            the end of backward.
        update_s: seconds of the optimizer's update after synchronisation.
        source: how it was obtained (for the report).
    """

    forward_s: float
    backward_s: float
    ready_s: Mapping[str, float] = field(default_factory=dict)
    update_s: float = 0.0
    source: str = "given"

    @property
    def floor_s(self) -> float:
        """The step with no communication at all."""
        return self.forward_s + self.backward_s + self.update_s

    def ready(self, name: str) -> float:
        """Seconds from the step's start until gradient ``name`` is final."""
        return self.forward_s + min(self.ready_s.get(name, self.backward_s), self.backward_s)

    @classmethod
    def spread(cls, sizes: Sizes, compute_s: float, update_s: float = 0.0) -> "ComputeTimeline":
        """A given compute time: forward : backward = 1 : 2, backward spread over the
        gradients in reverse registration order in proportion to their bytes.

        Raises:
            ValueError: a negative time.

        Example:
            >>> t = ComputeTimeline.spread([("a", 1), ("b", 3)], 0.3)
            >>> round(t.ready("b"), 3), round(t.ready("a"), 3)
            (0.25, 0.3)
        """
        if not (compute_s >= 0 and update_s >= 0):
            raise ValueError(f"compute times must be >= 0 seconds, found {compute_s!r} and "
                             f"{update_s!r}")
        total = sum(b for _, b in sizes) or 1
        fwd, bwd = compute_s / 3, compute_s * 2 / 3
        ready, done = {}, 0
        for name, nbytes in reversed(list(sizes)):
            done += nbytes
            ready[name] = bwd * done / total
        src = (f"given {compute_s * 1e3:.0f} ms, spread by bytes" if compute_s
               else "none given: synchronisation alone")
        return cls(fwd, bwd, ready, update_s, src)


def _scalar(out: Any) -> Any:
    """A scalar to call backward on, whatever the module returns."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, Mapping):
        out = next(iter(out.values()))
    return out.float().square().mean()


def _steps(module: Any, shape: Sequence[int], count: int, stop: Any = None
           ) -> List[Tuple[float, float, float, Dict[str, float]]]:
    """Run ``count`` training steps (or until ``stop`` is set); per step
    (forward, backward, update, {name: ready after backward start})."""
    import torch

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in params], lr=1e-4, momentum=0.9)  # as bench/train.py
    marks: Dict[str, float] = {}
    hooks = [p.register_post_accumulate_grad_hook(
        lambda _p, _n=n: marks.__setitem__(_n, time.perf_counter())) for n, p in params]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = []
    try:
        i = 0
        while (stop is None and i < count) or (stop is not None and not stop.is_set()):
            marks.clear()
            opt.zero_grad()
            t0 = time.perf_counter()
            loss = _scalar(module(x))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            out.append((t1 - t0, t2 - t1, t3 - t2, {n: t - t1 for n, t in marks.items()}))
            i += 1
    finally:
        for h in hooks:
            h.remove()
    return out


def _busy(module: Any, shape: Sequence[int], threads: int, started: Any, stop: Any) -> None:
    """A helper process: train steps like the timed rank until told to stop."""
    import torch

    torch.set_num_threads(threads)
    _steps(module, shape, 1)
    started.set()
    _steps(module, shape, 0, stop)


def measure_compute(module: Any, input_shape: Sequence[int], *, ranks: int = 1,
                    repeats: int = 5, warmup: int = 2, threads: int = 1) -> ComputeTimeline:
    """Time a torch module's step on this machine: forward, per-gradient ready times, update.

    1. ``ranks - 1`` helper processes (spawned) run the same steps
       continuously, so the timed process shares the cores as each of
       ``ranks`` co-located ranks would (4 ranks on a 2-core host: about
       half a core each).
    2. On a private copy of the module, ``warmup`` steps then ``repeats``
       timed steps: ``zero_grad``, forward on a standard-normal input of
       ``input_shape``, backward of the output's mean square with a
       post-accumulate-grad hook on every parameter (when the adapters
       hand the gradient to the engine), then an SGD-with-momentum update.
    3. Each quantity is the median over the timed steps.

    Args:
        module: a ``torch.nn.Module``.
        input_shape: the batch's shape, batch dimension first.
        ranks: ranks sharing this host's cores while training (>= 1).
        repeats: timed steps (>= 1).
        warmup: untimed steps first.
        threads: torch threads per process (ranks launched by this library's
            launchers run with 1).

    Returns:
        The measured ``ComputeTimeline``.

    Raises:
        ValueError: the module does not run on such an input (the message
            says to pass the input shape or a compute time instead).
    """
    import multiprocessing

    import torch

    if ranks < 1 or repeats < 1:
        raise ValueError(f"ranks and repeats must be >= 1, found {ranks} and {repeats}")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    mod = copy.deepcopy(module)
    try:
        _steps(mod, input_shape, 1)
    except Exception as e:  # a wrong shape or dtype surfaces as any of torch's errors
        raise ValueError(f"the model does not run on a float input of shape "
                         f"{tuple(input_shape)}: {str(e).splitlines()[0] if str(e) else e!r}; "
                         f"give --input-shape (batch first) or --compute-time") from e
    ctx = multiprocessing.get_context("spawn")
    stop, helpers = ctx.Event(), []
    try:
        for _ in range(ranks - 1):
            ev = ctx.Event()
            p = ctx.Process(target=_busy, args=(module, tuple(input_shape), threads, ev, stop),
                            daemon=True)
            p.start()
            helpers.append((p, ev))
        for p, ev in helpers:
            while not ev.wait(0.5):
                if not p.is_alive():
                    raise RuntimeError(f"a helper process timing the module exited with "
                                       f"{p.exitcode}")
        runs = _steps(mod, input_shape, warmup + repeats)[warmup:]
    finally:
        stop.set()
        for p, _ in helpers:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        torch.set_num_threads(old)
    names = {n for r in runs for n in r[3]}
    ready = {n: statistics.median(r[3].get(n, r[1]) for r in runs) for n in names}
    return ComputeTimeline(
        forward_s=statistics.median(r[0] for r in runs),
        backward_s=statistics.median(r[1] for r in runs), ready_s=ready,
        update_s=statistics.median(r[2] for r in runs),
        source=(f"measured: {repeats} steps on input {tuple(input_shape)}, "
                f"{ranks} rank(s) sharing this host, {threads} thread(s) each"))


# -- predicting one configuration -------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One configuration's prediction.

    Attributes:
        label: e.g. "none", "onebit/ps", "per-gradient/ring".
        kind: "none", "compressor" or "per-gradient".
        strategy: "ps" or "ring".
        plan: the plan the engine would run.
        plan_source: "rule" (the engine's size rule, ``plan=None``) or
            "model" (a cost-model plan to write and pass as a file).
        sync_s: sum of every synchronisation job's time (no overlap).
        step_s: predicted step time with backward overlap.
        compressed: gradients compressed.
        compressed_bytes: their bytes.
        speedup: the no-compression step time over this one.
    """

    label: str
    kind: str
    strategy: str
    plan: Plan
    plan_source: str
    sync_s: float
    step_s: float
    compressed: int
    compressed_bytes: int
    speedup: float = 1.0


@dataclass(frozen=True)
class Advice:
    """``advise``'s answer: rows ranked by predicted step time, fastest first.

    Attributes:
        rows: the ranked rows.
        nodes: N.
        timeline: the compute timeline used.
        baseline: the no-compression row.
    """

    rows: Tuple[Row, ...]
    nodes: int
    timeline: ComputeTimeline
    baseline: Row

    @property
    def best(self) -> Row:
        """The recommended configuration (the fastest predicted)."""
        return self.rows[0]

    def row(self, label: str) -> Row:
        """The row called ``label``; KeyError lists the labels."""
        for r in self.rows:
            if r.label == label:
                return r
        raise KeyError(f"no row {label!r}; rows: {', '.join(r.label for r in self.rows)}")


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


@dataclass
class _Job:
    """One synchronisation in the step simulation: released when its gradients are
    final (``ready``: seconds of forward and backward work), then its phases in
    order, each on the engine's compute thread ("cpu") or the link ("link")."""

    ready: float
    phases: List[List[Any]]  # [resource, seconds left]


def _job_phases(planner: Planner, fast: Planner, m: int, k: int) -> List[List[Any]]:
    """A compressed synchronisation split into CPU and link phases (module doc, step 2).

    The whole is ``Planner.t_cpr``. Its CPU work: Eq. 2's encodes and decodes
    (Eq. 2 on an instant link, ``fast``) plus the engine's per-byte cost
    beyond Eq. 2 (the aggregator's re-encode, final decodes, copies, error
    feedback: ``EngineTerm.per_byte``); the encodes of this rank's K
    partitions come before any transfer, the rest after. What remains of the
    whole is the link's (transfers, coordination rounds)."""
    total = planner.t_cpr(m, k)
    extra = max(0.0, planner.engine_term.per_byte * m) if planner.engine_term else 0.0
    cpu = min(total, fast.eq2(m, k) + extra)
    pre = min(cpu, planner.cp.encode(m / k) * k)
    return [["cpu", pre], ["link", total - cpu], ["cpu", cpu - pre]]


def _simulate(timeline: ComputeTimeline, jobs: List[_Job], cpu_share: float) -> float:
    """Seconds until backward and every job are done (the update not included).

    A fluid simulation of three servers: the caller's thread runs forward
    and backward (releasing jobs as it passes their ready points), the
    engine's one compute thread runs CPU phases in arrival order, the link
    runs link phases in arrival order. While the caller's thread and the
    compute thread both have work, each runs at ``cpu_share`` of its speed
    alone (0.5: they split one rank's CPU; 1.0: a core each).
    """
    work = timeline.forward_s + timeline.backward_s
    pending = sorted(jobs, key=lambda j: j.ready)
    queues: Dict[str, List[_Job]] = {"cpu": [], "link": []}
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
        if not (main or queues["cpu"] or queues["link"] or pending):
            return t
        rate = cpu_share if main and queues["cpu"] else 1.0
        steps = []
        if main:
            stop = min(pending[0].ready, work) if pending else work
            steps.append((stop - done) / rate)
        if queues["cpu"]:
            steps.append(queues["cpu"][0].phases[0][1] / rate)
        if queues["link"]:
            steps.append(queues["link"][0].phases[0][1])
        dt = max(0.0, min(steps))
        t += dt
        if main:
            done = min(work, done + dt * rate)
        for res, speed in (("cpu", rate), ("link", 1.0)):
            if queues[res]:
                head = queues[res][0]
                head.phases[0][1] -= dt * speed
                if head.phases[0][1] <= eps:
                    queues[res].pop(0)
                    head.phases.pop(0)
                    route(head)


def predict_step(plan: Plan, sizes: Sizes, n: int, planners: Mapping[str, Planner],
                 timeline: ComputeTimeline, *, fusion_bytes: int = 25 << 20,
                 cpu_share: float = 1.0) -> Tuple[float, float]:
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
            while both run, relative to each alone (``cpu_share_of``).

    Raises:
        ProfileError: the plan compresses with a compressor not in ``planners``.
    """
    if n == 1 or not sizes:
        return 0.0, timeline.floor_s
    if not 0 < cpu_share <= 1:
        raise ValueError(f"cpu_share must be in (0, 1], found {cpu_share!r}")
    size_of = dict(sizes)
    jobs: List[_Job] = []
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
            fast[comp] = Planner(with_link(pl.profile, Link(0.0, 1e30)), comp, n, pl.strategy,
                                 model_strategy=pl.model_strategy, back=pl.back and pl.back.name)
        jobs.append(_Job(timeline.ready(name),
                         _job_phases(pl, fast[comp], nbytes, dec.partitions)))
    for bucket in _lane_buckets(sizes, lane, fusion_bytes):
        cost = any_planner.t_orig(sum(size_of[g] for g in bucket), 1)
        jobs.append(_Job(max(timeline.ready(g) for g in bucket), [["link", cost]]))
    sync = sum(p[1] for j in jobs for p in j.phases)
    return sync, _simulate(timeline, jobs, cpu_share) + timeline.update_s


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


def _row(label: str, kind: str, strategy: str, plan: Plan, source: str, sizes: Sizes, n: int,
         planners: Mapping[str, Planner], timeline: ComputeTimeline, fusion_bytes: int,
         cpu_share: float) -> Row:
    sync, step = predict_step(plan, sizes, n, planners, timeline, fusion_bytes=fusion_bytes,
                              cpu_share=cpu_share)
    decs = [(plan.decide(name, b, n), b) for name, b in sizes]
    return Row(label, kind, strategy, plan, source, sync, step,
               sum(d.compress for d, _ in decs), sum(b for d, b in decs if d.compress))


def advise(sizes: Sizes, n: int, profile: Profile, timeline: ComputeTimeline, *,
           compressors: Optional[Sequence[str]] = None,
           candidates: Optional[Sequence[str]] = None,
           strategies: Sequence[str] = ("ps", "ring"), compressor_plans: str = "model",
           max_partitions: Optional[int] = None, fusion_bytes: int = 25 << 20,
           cpu_share: float = 1.0, meta: Optional[Mapping[str, Any]] = None) -> Advice:
    """Predict and rank every configuration (see the module doc).

    1. No compression: a plan that compresses nothing (every gradient in
       the lane).
    2. For each compressor and strategy: the engine's size rule
       (``compressor_plans="rule"``) or ``Planner.plan`` ("model").
    3. For each strategy: ``plan_per_gradient`` over ``candidates``.
    4. Each plan's step time by ``predict_step``; rows sorted by it, the
       speed-up taken against the no-compression row.

    Args:
        sizes: (gradient name, bytes) in registration order.
        n: number of nodes N (>= 1).
        profile: measured (or ``paper_profile``) costs.
        timeline: the compute timeline (``measure_compute`` or ``spread``).
        compressors: compressors to predict alone (default: all profiled).
        candidates: compressors the per-gradient plan chooses from
            (default: ``compressors``).
        strategies: strategies to predict.
        compressor_plans: "model" or "rule" (step 2).
        max_partitions: the planner's largest K (default 4N).
        fusion_bytes: the engine's lane bucket size.
        cpu_share: see ``predict_step`` (``cpu_share_of`` derives it).
        meta: provenance stored in every plan.

    Returns:
        The ranked ``Advice``.

    Raises:
        ValueError: bad N, an empty model, an unknown strategy or plan kind;
            ``ProfileError``: a compressor the profile lacks.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the number of nodes must be an integer >= 1, found {n!r}; "
                         "give --nodes 4 (for example)")
    if not sizes:
        raise ValueError("the model has no gradients")
    if compressor_plans not in ("model", "rule"):
        raise ValueError(f"compressor_plans must be 'model' or 'rule', found "
                         f"{compressor_plans!r}")
    names = list(compressors) if compressors is not None else sorted(profile.compressors)
    cands = list(candidates) if candidates is not None else names
    if not names and not cands:
        raise ProfileError("the profile has no compressor; profile some with: hipress-profile "
                           "profile --compressors onebit,terngrad")
    for c in dict.fromkeys(names + cands):
        profile.compressor(c)  # raises naming the fix
    info = dict(meta or {})
    rows: List[Row] = []
    for s in strategies:
        planners = {c: Planner(profile, c, n, s, max_partitions=max_partitions)
                    for c in dict.fromkeys(names + cands)}
        if not rows:
            first = next(iter(planners))
            none = Plan(compressor=first, params=dict(profile.compressor(first).params),
                        strategy=s, world_size=n, rule=SizeRule(min_compress_bytes=NEVER),
                        gradients={g: GradientPlan(False, 1) for g, _ in sizes}, meta=info)
            rows.append(_row("none", "none", s, none, "model", sizes, n, planners, timeline,
                             fusion_bytes, cpu_share))
        for c in names:
            pl = planners[c]
            if compressor_plans == "model":
                plan = pl.plan(sizes, meta=info)
            else:
                plan = Plan(compressor=c, params=dict(pl.cp.params), strategy=s, world_size=n,
                            meta=info)
            rows.append(_row(f"{c}/{s}", "compressor", s, plan, compressor_plans, sizes, n,
                             planners, timeline, fusion_bytes, cpu_share))
        if cands:
            plan = plan_per_gradient([planners[c] for c in cands], sizes, meta=info)
            rows.append(_row(f"per-gradient/{s}", "per-gradient", s, plan, "model", sizes, n,
                             planners, timeline, fusion_bytes, cpu_share))
    base = rows[0]
    rows = [dataclasses.replace(r, speedup=base.step_s / r.step_s if r.step_s > 0 else 1.0)
            for r in rows]
    ranked = tuple(sorted(rows, key=lambda r: (r.step_s, r.kind != "none")))
    return Advice(ranked, n, timeline, rows[0])


def optimizer_line(row: Row, plan_path: str = "plan.json") -> str:
    """The ``DistributedOptimizer(...)`` call that runs ``row`` (``import
    hipress_like.torch as hpt``; ``opt`` and ``model`` are the user's).

    Example:
        >>> r = Row("onebit/ps", "compressor", "ps", Plan(), "rule", 0.0, 0.0, 1, 4)
        >>> optimizer_line(r)  # doctest: +NORMALIZE_WHITESPACE
        'hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
         compression=hpt.Compression.onebit, strategy="ps", plan=None)'
    """
    head = "hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), "
    if row.kind == "none":
        return head + "compression=hpt.Compression.none)"
    plan = f'plan="{plan_path}"' if row.plan_source == "model" else "plan=None"
    if row.kind == "per-gradient":  # the plan names each gradient's compressor
        return head + f'strategy="{row.strategy}", {plan})'
    ps = ", ".join(f"{k}={v!r}" for k, v in sorted(row.plan.params.items()))
    spec = f"hpt.Compression.{row.plan.compressor}" + (f"({ps})" if ps else "")
    return head + f'compression={spec}, strategy="{row.strategy}", {plan})'


# -- inputs --------------------------------------------------------------------------------
def with_link(profile: Profile, link: Link) -> Profile:
    """``profile`` priced on another link: its link fits are replaced by ``link``.

    What was timed on the profiled network goes: the one-link and allreduce
    fits, the timed lane and the compressors' whole-engine timings (the
    planner then uses Table I's Ring-AR and Eq. 2 plus the measured constant
    overheads, which are CPU work). Compressor curves stay.
    """
    comps = {k: dataclasses.replace(v, engine_samples=()) for k, v in profile.compressors.items()}
    return dataclasses.replace(profile, link=link, link_samples=(), link_one=None,
                               link_one_samples=(), allreduce=None, allreduce_samples=(),
                               lane=None, lane_samples=(), compressors=comps,
                               meta={**profile.meta, "link_source": "given"})


def load_module(spec: str) -> Any:
    """Import and build the torch module of ``"package.module:attr"``.

    ``attr`` may be a module instance, or a class or function called without
    arguments (as ``cost_model.presets.from_module`` reads it).

    Raises:
        ValueError: the spec does not import or does not give a module (the
            message says what to pass instead).
    """
    import importlib

    import torch

    hint = ("give a preset, sizes like 4MB,16MB, a JSON file, or an importable "
            "package.module:attr (its folder on PYTHONPATH)")
    mod_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import model {spec!r} ({e}); {hint}") from e
    if not isinstance(obj, torch.nn.Module) and callable(obj):
        try:
            obj = obj()
        except TypeError as e:
            raise ValueError(f"{spec!r} must build a module without arguments ({e}); "
                             f"{hint}") from e
    if not isinstance(obj, torch.nn.Module):
        raise ValueError(f"{spec!r} is a {type(obj).__name__}, not a torch.nn.Module; {hint}")
    return obj


def infer_input_shape(module: Any, batch: int) -> Tuple[int, ...]:
    """A float input the module accepts, guessed from its first layer.

    A convolution's input channels with square sides of 224, 64, 32 or 28
    (ImageNet, CIFAR, MNIST sizes); a linear layer's input features. The
    first shape a forward pass accepts wins.

    Raises:
        ValueError: none works (the message says to give ``--input-shape``).
    """
    import torch

    first = next((m for m in module.modules()
                  if not list(m.children()) and any(True for _ in m.parameters(False))), None)
    cands: List[Tuple[int, ...]] = []
    if isinstance(first, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
        dims = {torch.nn.Conv1d: 1, torch.nn.Conv2d: 2, torch.nn.Conv3d: 3}[type(first)]
        cands = [(batch, first.in_channels) + (side,) * dims for side in (224, 64, 32, 28)]
    elif isinstance(first, torch.nn.Linear):
        cands = [(batch, first.in_features)]
    probe = copy.deepcopy(module).eval()
    for shape in cands:
        try:
            with torch.no_grad():
                probe(torch.zeros(*shape))
            return shape
        except Exception:  # noqa: BLE001 - any failure means "not this shape"
            continue
    tried = ", ".join(map(str, cands)) or "nothing: its first layer is neither a " \
        "convolution nor a linear layer"
    raise ValueError(f"cannot guess an input for {type(module).__name__} (tried {tried}); "
                     "give --input-shape, e.g. 32,3,224,224, or --compute-time")
