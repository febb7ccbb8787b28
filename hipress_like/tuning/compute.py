"""When a rank's gradients become final: the compute timeline the advisor overlaps.

``ComputeTimeline`` is one rank's step: forward, backward with the moment
each gradient is final, the optimizer's update. ``measure_compute`` times it
on a torch module with a post-accumulate-grad hook on every parameter (as
the adapters hook them); with R ranks sharing this host's cores, R copies
run at once so the timings carry the contention. ``ComputeTimeline.spread``
builds one from a compute time alone (F : B = 1 : 2, backward spread over
the gradients by bytes). ``load_module`` and ``infer_input_shape`` read a
``package.module:attr`` model and guess its input; ``host_busy`` says how much
of the host other work held just before a timing. ``advise.py`` uses them.
"""
from __future__ import annotations

import copy
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cost_model import presets

__all__ = ["ComputeTimeline", "ComputeLoad", "measure_compute", "load_module",
           "infer_input_shape", "host_busy"]

log = logging.getLogger(__name__)

# Busier than this before a timing (a share of all the host's cores), the timing
# carries other work's contention and the report says so.
BUSY_WARN = 0.25

Sizes = Sequence[Tuple[str, int]]

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


def _busy_share(before: str, after: str) -> Optional[float]:
    """The busy share of CPU time between two ``cpu`` lines of /proc/stat (all
    cores): 1 - (idle + iowait) / total. None when no time passed.

    Example:
        >>> _busy_share("cpu  100 0 100 800 0 0 0 0 0 0", "cpu  250 0 150 900 0 0 0 0 0 0")
        0.6667
    """
    # user nice system idle iowait irq softirq steal; guest time is already in user
    b = [int(x) for x in before.split()[1:9]]
    a = [int(x) for x in after.split()[1:9]]
    total = sum(a) - sum(b)
    if total <= 0:
        return None
    idle = (a[3] - b[3]) + (a[4] - b[4] if len(a) > 4 and len(b) > 4 else 0)
    return round(1.0 - idle / total, 4)


def host_busy(seconds: float = 0.3, stat_path: str = "/proc/stat") -> Optional[float]:
    """The share of this host's CPU time (all cores) that was busy over the next
    ``seconds``, read from Linux's ``/proc/stat``; None where it cannot be read.

    ``measure_compute`` calls it before it starts anything: a shared host's
    other work slows the timed steps, and every prediction scales with them
    (ResNet-18's step once timed at 1101 ms right after a profiling run, and
    582-637 ms on the same host at rest).
    """
    try:
        with open(stat_path) as f:
            before = f.readline()
        time.sleep(seconds)
        with open(stat_path) as f:
            after = f.readline()
        return _busy_share(before, after)
    except (OSError, ValueError, IndexError):
        return None


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

    Before any of it, ``host_busy`` reads how busy the host is. Above
    ``BUSY_WARN`` of its cores, other work would slow the timed steps: a
    warning is logged and the timeline's ``source`` says how busy it was.

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
    busy = host_busy()
    crowded = ""
    if busy is not None and busy > BUSY_WARN:
        crowded = f"; the host was {busy:.0%} busy with other work before timing"
        log.warning("this host was %.0f%% busy with other work before the module's steps "
                    "were timed: the compute timeline carries that contention. Time it on an "
                    "idle host, or give the compute time instead (--compute-time)", busy * 100)
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
                f"{ranks} rank(s) sharing this host, {threads} thread(s) each{crowded}"))


def load_module(spec: str) -> Any:
    """Import and build the torch module of ``"package.module:attr"``
    (``cost_model.presets.load_module``), with what to pass instead on failure.

    Raises:
        ValueError: the spec does not import or does not give a module (the
            message says what to pass instead).
    """
    hint = ("give a preset, sizes like 4MB,16MB, a JSON file, or an importable "
            "package.module:attr (its folder on PYTHONPATH)")
    try:
        return presets.load_module(spec)
    except ValueError as e:
        raise ValueError(f"{e}; {hint}") from e


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


class ComputeLoad:
    """A fixed amount of matmul work, sized to take ``seconds`` on this rank now.

    ``run()`` does that work; beside a synchronisation it takes longer when
    the engine's threads compete for the rank's CPU, as backward does.
    """

    def __init__(self, seconds: float, n: int = 128) -> None:
        import torch

        self._mm = torch.mm
        self.a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
        self.out = torch.empty(n, n)
        self.iterations = 0
        if seconds > 0:
            t0, k = time.perf_counter(), 0
            while time.perf_counter() - t0 < min(seconds, 0.05):
                self._mm(self.a, self.a, out=self.out)
                k += 1
            self.iterations = max(1, int(seconds * k / (time.perf_counter() - t0)))

    def run(self) -> None:
        """Do the work."""
        for _ in range(self.iterations):
            self._mm(self.a, self.a, out=self.out)
