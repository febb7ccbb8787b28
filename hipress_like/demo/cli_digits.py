"""The main job: 4 local workers learn handwritten digits, CaSync vs. no compression.

``python -m hipress_like.demo`` (or ``./run.sh``) trains the same small CNN
on scikit-learn's bundled digits (1797 real 8x8 images, 80/20 train/test
split, no download) twice with ``hipress_like.torch``:

1. with CaSync compression (default: onebit with error feedback, PS
   strategy, the cost model's ``plan="auto"``), then
2. the same run without compression (``Compression.none``),

printing per epoch the test accuracy and the throughput (images/s over all
workers), and at the end a table comparing accuracy and wall time.

The CNN has one large fully-connected layer (4096 x 512, 8 MB of float32
gradient) so that the plan has something worth compressing; the conv
layers' small gradients go uncompressed, as HiPress's selective
compression would send them.

The training function ``train_digits(ctx, cfg)`` is also what the accuracy
tests run; it uses only the Horovod-shaped public API.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["DigitsConfig", "DigitsNet", "load_digits_split", "train_digits", "main"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DigitsConfig:
    """One training run on digits.

    Attributes:
        compressor: registry name ("identity" for no compression).
        params: compressor parameters.
        compressor_back: a master compressor for the aggregates (bidirectional
            compression, ``DistributedOptimizer(compression_back=...)``), or None.
        params_back: its parameters.
        strategy: "ps" or "ring".
        plan: "auto", None, or a plan file path.
        compress_all: ignore the plan's size threshold and compress every
            gradient (tests use it to exercise the compressor everywhere).
        epochs: passes over the training split.
        batch_size: images per worker per step.
        lr: peak SGD learning rate (momentum 0.9, cosine decay to 0 over the run).
        seed: model init and shuffling seed (same on every rank).
        label: name shown in progress and tables.
        progress: rank 0 shows a progress bar and per-epoch lines.
    """

    compressor: str = "onebit"
    params: Dict[str, Any] = field(default_factory=dict)
    compressor_back: Optional[str] = None
    params_back: Dict[str, Any] = field(default_factory=dict)
    strategy: str = "ps"
    plan: Optional[str] = "auto"
    compress_all: bool = False
    epochs: int = 10
    batch_size: int = 16
    lr: float = 0.05
    seed: int = 0
    label: str = ""
    progress: bool = True


def load_digits_split(seed: int = 0):
    """scikit-learn's digits as float tensors: (x_train, y_train, x_test, y_test).

    Images are (N, 1, 8, 8) scaled to [0, 1]; the split is stratified 80/20.
    """
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.images.astype("float32") / 16.0
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.2, random_state=seed,
                                          stratify=d.target)
    f = lambda a: torch.from_numpy(a).unsqueeze(1)
    return f(xtr), torch.from_numpy(ytr).long(), f(xte), torch.from_numpy(yte).long()


def DigitsNet():  # noqa: N802 - a model factory reads like a class
    """Two 3x3 conv layers (32, 64 channels) and FC 4096 -> 512 -> 10 (2.1M parameters)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10))


def _plan_arg(cfg: DigitsConfig) -> Any:
    if not cfg.compress_all:
        return cfg.plan
    from hipress_like.cost_model import Plan, SizeRule

    # Every gradient compressed, small partitions so that PS/Ring partitioning is used too.
    return Plan(compressor=cfg.compressor, params=dict(cfg.params), strategy=cfg.strategy,
                rule=SizeRule(min_compress_bytes=0, bytes_per_partition=1 << 20))


def evaluate(model: Any, x: Any, y: Any) -> float:
    """Accuracy (percent) of ``model`` on (x, y)."""
    import torch

    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item() * 100.0
    model.train()
    return acc


def train_digits(ctx: Any, cfg_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Train on digits in one worker (``run_workers`` calls it on every rank).

    Args:
        ctx: the launcher's context (unused: ``hpt.init()`` adopts its group).
        cfg_dict: ``asdict(DigitsConfig)``.

    Returns:
        {"epochs": [{"epoch", "loss", "acc", "images_per_s", "seconds"}],
         "acc", "seconds", "param_digest", "rank"}.
    """
    import torch
    import torch.nn.functional as F

    import hipress_like.torch as hpt

    cfg = DigitsConfig(**cfg_dict)
    torch.set_num_threads(1)
    hpt.init()
    rank, size = hpt.rank(), hpt.size()
    xtr, ytr, xte, yte = load_digits_split(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = DigitsNet()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    hpt.broadcast_optimizer_state(opt, root_rank=0)
    compression = hpt.Compression.get(cfg.compressor, **cfg.params)
    back = (hpt.Compression.get(cfg.compressor_back, **cfg.params_back)
            if cfg.compressor_back else None)
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression, strategy=cfg.strategy,
                                   plan=_plan_arg(cfg), seed=cfg.seed, compression_back=back)
    # Each rank takes a disjoint shard of every epoch's shuffled order.
    steps = len(xtr) // (cfg.batch_size * size)
    # Cosine decay to zero: the last epochs settle instead of jittering, so runs
    # with and without compression compare at a stable accuracy.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, cfg.epochs * steps))
    show = cfg.progress and rank == 0
    bar = None
    if show:
        from tqdm import tqdm

        # disable=None: a live bar on a terminal, nothing in logs (epoch lines still print).
        bar = tqdm(total=cfg.epochs * steps, desc=cfg.label or cfg.compressor, unit="step",
                   leave=False, file=sys.stderr, dynamic_ncols=True, disable=None)
    history: List[Dict[str, float]] = []
    t_start = time.perf_counter()
    for epoch in range(cfg.epochs):
        g = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
        order = torch.randperm(len(xtr), generator=g)
        t0 = time.perf_counter()
        total = torch.zeros(1)
        for s in range(steps):
            idx = order[(s * size + rank) * cfg.batch_size:(s * size + rank + 1) * cfg.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            sched.step()
            total += loss.detach()
            if bar is not None:
                bar.update(1)
        secs = time.perf_counter() - t0
        avg_loss = hpt.allreduce(total / steps, name="loss").item()
        acc = evaluate(model, xte, yte)
        row = {"epoch": epoch + 1, "loss": avg_loss, "acc": acc,
               "images_per_s": steps * cfg.batch_size * size / secs, "seconds": secs}
        history.append(row)
        if bar is not None:
            tqdm.write(f"  [{cfg.label or cfg.compressor}] epoch {epoch + 1:2d}/{cfg.epochs}  "
                      f"loss {avg_loss:.4f}  test acc {acc:5.1f}%  "
                      f"{row['images_per_s']:7.0f} img/s")
    seconds = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    layout = opt.engine.layout()
    compressed = sorted(n for n, v in layout.items() if v["compress"])
    opt.close()
    return {"epochs": history, "acc": history[-1]["acc"] if history else 0.0,
            "seconds": seconds, "param_digest": digest, "rank": rank,
            "compressed": compressed}


def _run(cfg: DigitsConfig, workers: int, timeout: float) -> List[Dict[str, Any]]:
    import importlib

    from hipress_like.casync.launch import run_workers

    # By module name, so the workers import it even when this file runs as __main__.
    fn = importlib.import_module("hipress_like.demo.cli_digits").train_digits
    return run_workers(fn, workers, args=(asdict(cfg),), timeout=timeout)


def _table(rows: List[Dict[str, Any]], workers: int) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: plain text
        for r in rows:
            print(" | ".join(f"{k}: {v}" for k, v in r.items()))
        return
    t = Table(title=f"digits, {workers} workers: CaSync vs. no compression")
    for col in rows[0]:
        t.add_column(col, justify="left" if col == "configuration" else "right", no_wrap=True)
    for r in rows:
        t.add_row(*[str(v) for v in r.values()])
    console = Console()
    if not console.is_terminal:  # piped or logged: rich's 80 columns would wrap the cells
        console = Console(width=120)
    console.print(t)


def main(argv: Optional[List[str]] = None) -> int:
    """CLI of the main job (see the module docstring)."""
    ap = argparse.ArgumentParser(
        prog="python -m hipress_like.demo",
        description="Train a CNN on scikit-learn's digits with 4 local workers: CaSync "
                    "compression (auto plan) vs. the same run without compression.")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--compressor", default="onebit",
                    help="CompLL compressor for the CaSync run (default: onebit)")
    ap.add_argument("--strategy", default="ps", choices=["ps", "ring"])
    ap.add_argument("--plan", default="auto",
                    help="'auto' (the cost model decides per gradient), 'all' (compress every "
                         "gradient) or a plan JSON file")
    ap.add_argument("--epochs", type=int, default=DigitsConfig.epochs)
    ap.add_argument("--batch-size", type=int, default=DigitsConfig.batch_size)
    ap.add_argument("--lr", type=float, default=DigitsConfig.lr)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ns = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    common = dict(epochs=ns.epochs, batch_size=ns.batch_size, lr=ns.lr, seed=ns.seed)
    runs = [
        DigitsConfig(compressor=ns.compressor, strategy=ns.strategy,
                     plan=None if ns.plan == "all" else ns.plan, compress_all=ns.plan == "all",
                     label=f"CaSync {ns.compressor}", **common),
        DigitsConfig(compressor="identity", strategy=ns.strategy,
                     plan=None if ns.plan == "all" else ns.plan,
                     label="no compression", **common),
    ]
    print(f"digits: 1437 training / 360 test images, {ns.workers} workers, "
          f"{ns.epochs} epochs, batch {ns.batch_size} per worker; CaSync: {ns.compressor}, "
          f"strategy {ns.strategy}, plan {ns.plan}", flush=True)
    rows = []
    for cfg in runs:
        print(f"\n== {cfg.label}", flush=True)
        t0 = time.perf_counter()
        results = _run(cfg, ns.workers, ns.timeout)
        wall = time.perf_counter() - t0
        r0 = results[0]
        same = len({r["param_digest"] for r in results}) == 1
        comp = ", ".join(r0["compressed"]) if cfg.compressor != "identity" else ""
        print(f"   compressed gradients: {comp or 'none'}; replicas bitwise identical: {same}",
              flush=True)
        if cfg.compressor != "identity" and not comp and cfg.plan == "auto":
            print("   (the cost model measured these links and found compression does not pay "
                  "here, e.g. CPU-bound loopback; --plan all compresses every gradient)",
                  flush=True)
        ips = sum(e["images_per_s"] for e in r0["epochs"]) / max(1, len(r0["epochs"]))
        rows.append({"configuration": cfg.label, "test acc %": f"{r0['acc']:.1f}",
                     "train time s": f"{r0['seconds']:.1f}", "wall time s": f"{wall:.1f}",
                     "images/s": f"{ips:.0f}"})
    base = float(rows[-1]["train time s"])
    for r in rows:
        r["speed-up"] = f"{base / float(r['train time s']):.2f}x"
    print()
    _table(rows, ns.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
