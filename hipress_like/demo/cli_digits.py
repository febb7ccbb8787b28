"""The main job: 4 local workers learn handwritten digits, CaSync vs. no compression.

``python -m hipress_like.demo`` (or ``./run.sh``) trains the same small CNN
on scikit-learn's bundled digits (1797 real 8x8 images, 80/20 train/test
split, no download) twice with ``hipress_like.torch``, its workers in network
namespaces over emulated 1 Gbit/s links (``launch/netem``; ``--net``; as
root, else on loopback, said in one line):

1. with CaSync compression (default: PowerSGD rank 4 with its error
   feedback, PS strategy, the cost model's ``plan="auto"``), then
2. the same run without compression (``Compression.none``),

printing per epoch the test accuracy and the throughput (images/s over all
workers), and at the end a table comparing accuracy, step time and which
gradients were compressed, and a picture (``report.py``: accuracy against
wall time, and where a step's time goes) next to the JSON under ``--out``.

The CNN has one large fully-connected layer (4096 x 2048 in the main job,
33.5 MB of float32 gradient; ``--hidden``) so that at 1 Gbit/s its
synchronisation, not its arithmetic, bounds a step, the situation this
library is for; the conv layers' small gradients go uncompressed, as
HiPress's selective compression would send them. PowerSGD is the default
because, with ranks sharing cores, its few matrix products cost less CPU
than a quantizer's passes over 33.5 MB (docs/design.md has the run that
compared them).

The training function ``train_digits(ctx, cfg)`` is also what the accuracy
tests run; it uses only the Horovod-shaped public API.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..casync.timeline import COMMUNICATION_KINDS, COMPRESSION_KINDS  # the picture's groups
from ..cost_model.plan import COLLECTIVES

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
        collective: how compressed gradients travel
            (``DistributedOptimizer(collective=...)``), or None.
        plan: "auto", None, or a plan file path.
        compress_all: ignore the plan's size threshold and compress every
            gradient (tests use it to exercise the compressor everywhere).
        epochs: passes over the training split.
        hidden: width of the model's hidden fully-connected layer (``DigitsNet``).
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
    collective: Optional[str] = None
    plan: Optional[str] = "auto"
    compress_all: bool = False
    epochs: int = 10
    hidden: int = 512
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


def DigitsNet(hidden: int = 512):  # noqa: N802 - a model factory reads like a class
    """Two 3x3 conv layers (32, 64 channels) and FC 4096 -> ``hidden`` -> 10.

    ``hidden`` = 512: 2.1M parameters (the tests' model); 2048: 8.4M, one
    33.5 MB gradient, which takes about 0.4 s to allreduce over 4 ranks at
    1 Gbit/s against about 0.1 s of computation per step (the main job's).
    """
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 8 * 8, hidden), nn.ReLU(), nn.Linear(hidden, 10))


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


def setup_worker(hidden: int, lr: float, seed: int) -> Tuple[int, int, Tuple[Any, ...], Any,
                                                              Any]:
    """One worker's start: ``hpt.init()``, the digits split, ``DigitsNet(hidden)`` with
    rank 0's initial parameters, and SGD (momentum 0.9) over it.

    Returns:
        (rank, size, (x_train, y_train, x_test, y_test), model, optimizer).
    """
    import torch

    import hipress_like.torch as hpt

    torch.set_num_threads(1)
    hpt.init()
    data = load_digits_split(seed)
    torch.manual_seed(seed)
    model = DigitsNet(hidden)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    return hpt.rank(), hpt.size(), data, model, opt


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
    rank, size, (xtr, ytr, xte, yte), model, opt = setup_worker(cfg.hidden, cfg.lr, cfg.seed)
    hpt.broadcast_optimizer_state(opt, root_rank=0)
    compression = hpt.Compression.get(cfg.compressor, **cfg.params)
    back = (hpt.Compression.get(cfg.compressor_back, **cfg.params_back)
            if cfg.compressor_back else None)
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression, strategy=cfg.strategy,
                                   plan=_plan_arg(cfg), seed=cfg.seed, compression_back=back,
                                   collective=cfg.collective)
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
    spent = {"compute": 0.0, "waiting": 0.0}
    t_start = time.perf_counter()
    for epoch in range(cfg.epochs):
        g = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
        order = torch.randperm(len(xtr), generator=g)
        t0 = time.perf_counter()
        total = torch.zeros(1)
        for s in range(steps):
            idx = order[(s * size + rank) * cfg.batch_size:(s * size + rank + 1) * cfg.batch_size]
            t_a = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()  # the engine synchronises gradients as backward produces them
            t_b = time.perf_counter()
            opt.step()  # waits for what synchronisation backward did not hide
            sched.step()
            spent["compute"] += t_b - t_a
            spent["waiting"] += time.perf_counter() - t_b
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
    how = {n: f"{v['compressor']} x{len(v['partitions'])} ({v['workflow']})"
           for n, v in layout.items() if v["compress"]}
    breakdown = step_breakdown(spent, opt.engine.timeline.summary(), cfg.epochs * steps)
    opt.close()
    return {"epochs": history, "acc": history[-1]["acc"] if history else 0.0,
            "seconds": seconds, "param_digest": digest, "rank": rank,
            "compressed": compressed, "how": how, "gradients": len(layout),
            "breakdown": breakdown}




def step_breakdown(spent: Dict[str, float], summary: Dict[str, Dict[str, float]],
                   steps: int) -> Dict[str, float]:
    """Milliseconds per step: the training loop's wall time split into ``compute``
    (forward and backward, during which the engine already synchronises) and
    ``waiting`` (``opt.step()`` blocked on what backward did not hide), and the
    engine's busy time from its timeline (``summary``: seconds per task kind) in
    ``compression`` (encode, decode, merge, write back) and ``communication``
    (bulk rounds, fused buckets, allreduces). The last two overlap the first two."""
    n = max(1, steps)
    busy = lambda kinds: sum(summary.get(k, {}).get("seconds", 0.0) for k in kinds)
    return {"compute": 1e3 * spent["compute"] / n, "waiting": 1e3 * spent["waiting"] / n,
            "compression": 1e3 * busy(COMPRESSION_KINDS) / n,
            "communication": 1e3 * busy(COMMUNICATION_KINDS) / n}


def _run(cfg: DigitsConfig, workers: int, timeout: float, netns: bool = False
         ) -> List[Dict[str, Any]]:
    import importlib

    from hipress_like.launch.launch import run_workers

    # By module name, so the workers import it even when this file runs as __main__.
    fn = importlib.import_module("hipress_like.demo.cli_digits").train_digits
    return run_workers(fn, workers, args=(asdict(cfg),), timeout=timeout, netns=netns)


LOOPBACK = ("none", "loopback", "lo")
# The main job's model: wide enough that its gradient exchange, not its arithmetic,
# bounds a step at 1 Gbit/s (the situation this library is for; issue 26).
MAIN_HIDDEN = 2048


def emulation_blocker() -> Optional[str]:
    """Why this process cannot emulate links (None when it can): root and iproute2."""
    if os.geteuid() != 0:
        return "emulating links needs root (network namespaces and tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "emulating links needs iproute2 (apt-get install -y iproute2)"
    return None


def _network(net: str, workers: int) -> Tuple[bool, str]:
    """Bring up ``workers`` hosts on emulated ``net`` links (``netem``) when this process
    can; else say why in one line and use loopback. Returns (in namespaces?, where)."""
    if net.lower() in LOOPBACK:
        return False, "loopback (--net none)"
    from hipress_like.launch import netem

    why = emulation_blocker()
    if why is None:
        try:
            netem.up(workers, net)
            return True, f"{net} links (network namespaces h0..h{workers - 1})"
        except (netem.NetemError, OSError) as e:
            why = f"setting up {net} links failed ({e})"
    print(f"note: {why}; training on loopback instead, where links run at memory speed "
          f"and compression pays little (run as root for {net} links)", flush=True)
    return False, "loopback"


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
        prog="./run.sh",
        description="Train a CNN on scikit-learn's digits with local workers over emulated "
                    "links: CaSync compression (auto plan) vs. the same run without "
                    "compression.")
    ap.add_argument("--net", default="1gbit",
                    help="each worker's emulated link rate in tc syntax (1gbit, 100mbit, "
                         "10gbit), or 'none' for loopback; emulation needs root")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--compressor", default="powersgd",
                    help="compressor for the CaSync run (default: powersgd, rank 4)")
    ap.add_argument("--strategy", default="ps", choices=["ps", "ring"])
    ap.add_argument("--collective", default=None, choices=list(COLLECTIVES),
                    help="how the compressed gradients travel (default: the strategy's "
                         "PS or Ring; 'auto' picks per top-k gradient among Allgather, "
                         "ART-Ring and ART-Tree)")
    ap.add_argument("--plan", default="auto",
                    help="'auto' (the cost model decides per gradient), 'all' (compress every "
                         "gradient) or a plan JSON file")
    ap.add_argument("--epochs", type=int, default=DigitsConfig.epochs)
    ap.add_argument("--hidden", type=int, default=MAIN_HIDDEN,
                    help="width of the model's hidden layer (default %(default)s: a 33.5 MB "
                         "gradient, so synchronisation matters at 1 Gbit/s; 512 is 4x smaller)")
    ap.add_argument("--batch-size", type=int, default=DigitsConfig.batch_size)
    ap.add_argument("--lr", type=float, default=DigitsConfig.lr)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--out", default=os.path.join("results", "demo"),
                    help="directory for the result JSON and the picture (PNG)")
    ns = ap.parse_args(argv)
    import hipress_like as hp

    if ns.workers < 1:
        ap.error(f"--workers must be at least 1, found {ns.workers}")
    if ns.hidden < 1:
        ap.error(f"--hidden must be at least 1, found {ns.hidden}")
    if ns.epochs < 1:
        ap.error(f"--epochs must be at least 1, found {ns.epochs}")
    if ns.compressor not in hp.compressors.available():
        ap.error(f"unknown compressor {ns.compressor!r}; choose one of "
                 f"{', '.join(sorted(hp.compressors.available()))}")
    if ns.plan not in ("auto", "all") and not os.path.isfile(ns.plan):
        ap.error(f"--plan must be 'auto', 'all' or a plan file; {ns.plan!r} is none of them")
    if ns.net.lower() not in LOOPBACK:
        from hipress_like.launch import netem

        try:
            netem.rate_bits(ns.net)
        except ValueError:
            ap.error(f"--net {ns.net!r} is not a link rate; write it as tc does (1gbit, "
                     "100mbit, 10gbit) or 'none' for loopback")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    common = dict(epochs=ns.epochs, hidden=ns.hidden, batch_size=ns.batch_size, lr=ns.lr,
                  seed=ns.seed)
    runs = [
        DigitsConfig(compressor=ns.compressor, strategy=ns.strategy, collective=ns.collective,
                     plan=None if ns.plan == "all" else ns.plan, compress_all=ns.plan == "all",
                     label=f"CaSync {ns.compressor}", **common),
        DigitsConfig(compressor="identity", strategy=ns.strategy,
                     plan=None if ns.plan == "all" else ns.plan,
                     label="no compression", **common),
    ]
    netns, where = _network(ns.net, ns.workers)
    print(f"digits: 1437 training / 360 test images, {ns.workers} workers on {where}, "
          f"{ns.epochs} epochs, batch {ns.batch_size} per worker, hidden layer {ns.hidden}; "
          f"CaSync: {ns.compressor}, "
          f"strategy {ns.strategy}, plan {ns.plan}", flush=True)
    rows, results0 = [], []
    try:
        for cfg in runs:
            print(f"\n== {cfg.label}", flush=True)
            t0 = time.perf_counter()
            results = _run(cfg, ns.workers, ns.timeout, netns)
            wall = time.perf_counter() - t0
            r0 = results[0]
            results0.append((cfg.label, r0))
            same = len({r["param_digest"] for r in results}) == 1
            if cfg.compressor != "identity":
                for name, how in sorted(r0["how"].items()):
                    print(f"   compressed: {name}: {how}", flush=True)
            print(f"   {len(r0['compressed'])} of {r0['gradients']} gradients compressed; "
                  f"replicas bitwise identical: {same}", flush=True)
            if cfg.compressor != "identity" and not r0["compressed"] and cfg.plan == "auto":
                print("   (the cost model measured these links and found compression does not "
                      "pay here, e.g. CPU-bound loopback; --plan all compresses every "
                      "gradient)", flush=True)
            ips = sum(e["images_per_s"] for e in r0["epochs"]) / max(1, len(r0["epochs"]))
            bd = r0["breakdown"]
            rows.append({"configuration": cfg.label, "test acc %": f"{r0['acc']:.1f}",
                         "train time s": f"{r0['seconds']:.1f}", "wall time s": f"{wall:.1f}",
                         "images/s": f"{ips:.0f}",
                         "ms/step": f"{bd['compute'] + bd['waiting']:.0f}",
                         "compressed": f"{len(r0['compressed'])}/{r0['gradients']}"})
    finally:
        if netns:
            from hipress_like.launch import netem

            netem.down()
    base = float(rows[-1]["train time s"])
    for r in rows:
        r["speed-up"] = f"{base / float(r['train time s']):.2f}x"
    print()
    _table(rows, ns.workers)
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "digits.json"), "w") as f:
        json.dump({"net": where, "workers": ns.workers, "rows": rows,
                   "runs": {label: r for label, r in results0}}, f, indent=1)
    from .report import plot_runs

    png = plot_runs(os.path.join(ns.out, "digits.png"), results0,
                    f"digits, {ns.workers} workers on {where}")
    print(f"picture: {png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
