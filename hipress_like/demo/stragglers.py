"""Digits training with a straggling rank: the workload of THC Sec. 8.3's straggler study.

``train_straggling`` runs on every rank (``run_workers``): one rank sleeps
``sleep`` seconds before the backward of every ``every``-th step, the way a
slow or preempted worker would, and the job trains ``steps`` steps with or
without partial aggregation (``DistributedOptimizer(stragglers=Quorum(...))``).
``bench/stragglers.py`` times it; the multiprocess tests check that replicas
end bitwise identical and that late gradients are dropped and counted.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

__all__ = ["StragglerConfig", "train_straggling"]


@dataclass
class StragglerConfig:
    """One run.

    Attributes:
        compressor, params: the compressor (registry name and parameters).
        fraction: the quorum fraction; None trains without partial
            aggregation (the CaSync engine, every rank waited for).
        deadline, missing, resync_every: the rest of ``Quorum``.
        steps: optimizer steps to train and time, after ``warmup`` steps
            (kernel compilation, the automatic deadline's first estimates).
        straggler: the rank that sleeps (-1: none).
        every: it sleeps before the backward of timed step k when k % every == every - 1.
        sleep: seconds it sleeps.
        hidden, batch_size, lr, seed: the model (``DigitsNet``), images per rank
            per step, SGD's learning rate (momentum 0.9), the seed.
        strategy: the engine's strategy when ``fraction`` is None.
    """

    compressor: str = "thc"
    params: Dict[str, Any] = field(default_factory=lambda: {"bits": 4})
    fraction: Optional[float] = 0.75
    deadline: Optional[float] = None
    missing: str = "rescale"
    resync_every: int = 0
    steps: int = 50
    warmup: int = 5
    straggler: int = -1
    every: int = 5
    sleep: float = 0.0
    hidden: int = 512
    batch_size: int = 32
    lr: float = 0.05
    seed: int = 0
    strategy: str = "ps"


def train_straggling(ctx: Any, cfg_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``cfg.steps`` steps on this rank; returns timings, accuracy and counters.

    Returns:
        {"rank", "start" and "end" (wall clock of the timed steps: the job
        took max(end) - min(start)), "step_seconds" (per loop iteration),
        "acc", "param_digest", "stragglers" (counters, or None
        without partial aggregation)}.
    """
    import torch
    import torch.nn.functional as F

    import hipress_like.torch as hpt

    from .cli_digits import evaluate, setup_worker

    cfg = StragglerConfig(**cfg_dict)
    rank, size, (xtr, ytr, xte, yte), model, opt = setup_worker(cfg.hidden, cfg.lr, cfg.seed)
    quorum = None
    if cfg.fraction is not None:
        quorum = hpt.Quorum(fraction=cfg.fraction, deadline=cfg.deadline, missing=cfg.missing,
                            resync_every=cfg.resync_every)
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hpt.Compression.get(cfg.compressor, **cfg.params),
                                   strategy=cfg.strategy, plan=None, seed=cfg.seed,
                                   stragglers=quorum)
    per_step = cfg.batch_size * size
    g = torch.Generator().manual_seed(cfg.seed)
    order = torch.cat([torch.randperm(len(xtr), generator=g)
                       for _ in range((cfg.warmup + cfg.steps) * per_step // len(xtr) + 1)])

    def applied() -> int:
        return opt.steps if quorum is not None else done

    done, times = 0, []
    total = cfg.warmup + cfg.steps
    t_start = None
    while applied() < total:
        s = applied()
        if s >= cfg.warmup and t_start is None:
            hpt.barrier()  # the timed steps start together
            t_start = time.time()
        t0 = time.perf_counter()
        lo = s * per_step + rank * cfg.batch_size
        idx = order[lo:lo + cfg.batch_size]
        opt.zero_grad()
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        k = s - cfg.warmup
        if rank == cfg.straggler and k >= 0 and k % cfg.every == cfg.every - 1:
            time.sleep(cfg.sleep)
        loss.backward()
        opt.step()
        done += 1
        if k >= 0:
            times.append(time.perf_counter() - t0)
    t_end = time.time()
    acc = evaluate(model, xte, yte)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    counters = opt.stragglers() if quorum is not None else None
    hpt.barrier()
    return {"rank": rank, "start": t_start, "end": t_end, "step_seconds": times, "acc": acc,
            "param_digest": digest, "stragglers": counters}
