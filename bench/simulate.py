"""Past this machine, by simulation: step time and scaling efficiency on HiPress's testbeds.

Issue 50, item 6. This host has two cores and no GPU, so how the engine's
configurations scale to 128 GPUs cannot be measured here; it can be
predicted. The project's step model (``hipress_like.tuning.step_model``)
already predicts one rank's step from a plan, a profile of the compressors
and the link, and a compute timeline. Fed with the hardware of HiPress's
testbed (Sec. 6.1: 16 nodes of 8 V100 GPUs, 100 Gbit/s; and 25 Gbit/s,
Sec. 6.5) and the compression speeds the paper reports, it predicts:

1. Gradients: the published layer shapes of VGG19 (torchvision's layout) and
   BERT-large (24 layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30522,
   a 2-class head), float32; each layer's forward FLOPs set when its
   gradients are final in backward (``simulate_models``).
2. Workers: up to 8 GPUs share one node and its NVLink, so for N <= 8 the
   workers are the GPUs and the link is NVLink; beyond, each node is one
   worker of the model (``N / 8`` of them) over the network link, its GPUs
   reduce-scattering each gradient before and all-gathering it after
   (``step_model.LocalStage``), each GPU compressing its eighth of it (so
   a node encodes 8 times as fast as one GPU).
3. Plans: "no compression" averages every gradient by a ring allreduce
   (the Ring baseline, Horovod/NCCL); the three compressed rows use the
   cost model's planner (``cost_model.Planner``: HiPress Eq. 1-2 with its
   selective compression and partitioning, Sec. 3.3) with CaSync-Ring or
   co-located CaSync-PS, and onebit or PowerSGD.
4. Steps: ``predict_step`` on that plan; scaling efficiency is throughput
   on N over N times one worker's, which for weak scaling (the paper keeps
   the per-GPU batch: Sec. 6.1) is the step without communication over the
   step on N (HiPress footnote 1).

Every input is in ``ASSUMPTIONS`` (with its source) and in the JSON; the
paper's reported figures are in ``PAPER`` and printed beside the
predictions. Run:

    python bench/simulate.py                 # print; results/simulate.json and .png
    python bench/simulate.py --publish       # also its record, page and figure in docs/results
    python bench/simulate.py --check         # the committed record and page are current

The record (``docs/results/simulation.json``) is a ``bench/report.py`` record
of kind "simulation": ``report.py render`` gives it a section of the results
index and checks it like the measured ones; its own page
(``docs/results/simulation.md``) and figure come from ``simulate_page.py``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from simulate_models import (  # noqa: E402
    MODELS,
    bert_large_layers,
    flop_timeline,
    powersgd_ratio,
    sizes_of,
)

from hipress_like.cost_model import Planner, Profile  # noqa: E402
from hipress_like.cost_model.model import Curve, Link  # noqa: E402
from hipress_like.cost_model.plan import GradientPlan, Plan  # noqa: E402
from hipress_like.cost_model.profile import CompressorProfile  # noqa: E402
from hipress_like.tuning.compute import ComputeTimeline  # noqa: E402
from hipress_like.tuning.step_model import LocalStage, predict_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
PAGE = os.path.join(RESULTS, "simulation.md")
RECORD = os.path.join(RESULTS, "simulation.json")  # a bench/report.py record, kind "simulation"
FIGURE = os.path.join(RESULTS, "img", "simulation.png")
COMMAND = "python bench/simulate.py --publish"
SOURCE = "simulated by the step model from the paper's figures and stated assumptions; not measured"

WORKERS = (2, 4, 8, 16, 32, 64, 128)
CONFIGS = ("none", "ring-onebit", "ps-onebit", "ring-powersgd")

# ---------------------------------------------------------------- the inputs

#: Every number the simulation assumes: key -> (value, unit, source). The docs page
#: prints this table; nothing below uses a number that is not here.
ASSUMPTIONS: Dict[str, Tuple[float, str, str]] = {
    "gpus_per_node": (8, "GPUs", "HiPress Sec. 6.1: p3dn.24xlarge, 8 V100 per node, NVLink"),
    "nodes": (16, "nodes", "HiPress Sec. 6.1"),
    "net_fast_gbit": (100, "Gbit/s", "HiPress Sec. 6.1 (EC2, RDMA over EFA)"),
    "net_slow_gbit": (25, "Gbit/s", "HiPress Sec. 6.5, Fig. 15a (EC2's low-bandwidth network)"),
    "local_net_gbit": (56, "Gbit/s", "HiPress Sec. 6.1: the local cluster's InfiniBand "
                       "(RDMA), the testbed of Fig. 11"),
    "local_gpus_per_node": (2, "GPUs", "HiPress Sec. 6.1: 2 GTX 1080 Ti per node behind a "
                            "PCIe switch, 16 nodes"),
    "pcie_gbyte": (10, "GB/s per GPU", "assumed: PCIe 3.0 x16 through a switch, the local "
                   "nodes' link between their two GPUs"),
    "gtx1080ti_slowdown": (1.39, "x the V100's compute time", "assumed: the ratio of fp32 "
                           "peaks, 15.7 / 11.3 TFLOP/s"),
    "net_latency_us": (10, "us per message", "assumed (RDMA; HiPress gives none)"),
    "nvlink_gbyte": (130, "GB/s per GPU", "assumed: NCCL's bus bandwidth on an 8-V100 "
                     "NVLink node (HiPress gives none)"),
    "nvlink_latency_us": (5, "us per ring step", "assumed"),
    "quantizer_gbyte": (84.4, "GB/s per GPU", "HiPress Sec. 6.4: CompLL-TBQ encodes 256 MB "
                        "over 12x faster than OSS-TBQ's 38.17 ms, so <= 3.18 ms (1080 Ti); "
                        "taken for onebit's encode and decode on a V100"),
    "powersgd_passes": (4, "passes over the gradient", "assumed: PowerSGD's encode reads the "
                        "gradient for M Q and for M^T P and reads and writes the error "
                        "(Vogels et al. 2019, Alg. 1); each pass at the quantizer's speed"),
    "powersgd_rank": (4, "", "assumed: PowerSGD paper's rank for language models; HiPress "
                      "Sec. 6.1 keeps each algorithm's own settings"),
    "kernel_launch_us": (20, "us per encode or decode", "assumed (CUDA launches and a "
                         "stream synchronisation)"),
    "vgg19_compute_ms": (168, "ms per step", "HiPress Sec. 6.5: the VGG19 DNN computation of "
                         "one iteration in its Nsight trace (GPU and batch not stated; taken "
                         "as one V100's at 32 images, the batch of the authors' published "
                         "VGG19 scripts)"),
    "bert_tokens": (32 * 128, "tokens per GPU per step", "assumed: batch 32, 128 tokens "
                    "(GluonNLP's fine-tuning defaults; Fig. 9's batch is in the figure only)"),
    "v100_sustained_tflops": (9.4, "TFLOP/s", "assumed: 60% of a V100's 15.7 TFLOP/s fp32 "
                              "peak (HiPress Table 1 trains fp32)"),
    "update_ms": (0, "ms", "assumed: the optimizer's update, the same with and without "
                  "communication, left out"),
}


def _a(key: str) -> float:
    return float(ASSUMPTIONS[key][0])


#: What HiPress reports (Sec. 1, 2.3, 6.2.1, 6.3, 6.5, 7), as the docs page quotes it.
#: Each row: id, the claim, the paper's value, what the simulation compares it with.
PAPER: List[Dict[str, Any]] = [
    {"id": "vgg-ps-over-ring", "claim": "VGG19, 128 GPUs, 100 Gbit/s: CaSync-PS + onebit "
     "over Ring (throughput)", "paper": 1.604, "source": "Sec. 6.2.1 (Fig. 9a): +60.4%",
     "model": ("vgg19", "fast", 128, "ps-onebit", "none")},
    {"id": "bert-ps-over-ring", "claim": "BERT-large, 128 GPUs, 100 Gbit/s: CaSync-PS + onebit "
     "over Ring", "paper": 1.441, "source": "Sec. 6.2.1 (Fig. 9d): +44.1%",
     "model": ("bert-large", "fast", 128, "ps-onebit", "none")},
    {"id": "vgg-ring-vs-ps", "claim": "VGG19, 128 GPUs: CaSync-Ring + onebit against "
     "CaSync-PS + onebit", "paper": 1.0, "source": "Sec. 6.2.1: \"performs similarly\"",
     "model": ("vgg19", "fast", 128, "ring-onebit", "ps-onebit")},
    {"id": "bert-ring-vs-ps", "claim": "BERT-large, 128 GPUs: CaSync-Ring + onebit against "
     "CaSync-PS + onebit", "paper": 1.0, "source": "Sec. 6.2.1: \"performs similarly\"",
     "model": ("bert-large", "fast", 128, "ring-onebit", "ps-onebit")},
    {"id": "vgg-best-eff", "claim": "VGG19, 128 GPUs: HiPress's scaling efficiency",
     "paper": 0.92, "source": "Sec. 7: \"up to 0.92\" (best of six models; Sec. 6.3: 0.90 "
     "for VGG19 on the 32-GPU local cluster)", "model": ("vgg19", "fast", 128, "ps-onebit", None)},
    {"id": "bert-best-eff", "claim": "BERT-large, 128 GPUs: HiPress's scaling efficiency "
     "(implied)", "paper": 0.94, "source": "0.71 (Table 1, BytePS) x 1.323 (Sec. 6.2.1: "
     "+32.3% over BytePS); two runs, two Horovod versions",
     "model": ("bert-large", "fast", 128, "ps-onebit", None)},
    {"id": "vgg-ring-eff", "claim": "VGG19, 128 GPUs: Ring's scaling efficiency (implied)",
     "paper": 0.57, "source": "0.92 (Sec. 7, if VGG19 reached it) / 1.604 (Sec. 6.2.1)",
     "model": ("vgg19", "fast", 128, "none", None)},
    {"id": "bert-ring-eff", "claim": "BERT-large, 128 GPUs: Ring's scaling efficiency "
     "(implied)", "paper": 0.65, "source": "0.71 (Table 1, BytePS) / 1.089 (Sec. 6.2.1: BytePS "
     "up to 8.9% faster than Ring)", "model": ("bert-large", "fast", 128, "none", None)},
    {"id": "bert-25-vs-100", "claim": "BERT, 128 GPUs: CaSync-PS + onebit's speed-up over no "
     "compression at 25 Gbit/s against at 100 Gbit/s", "paper": 1.0,
     "source": "Sec. 6.5 (Fig. 15a, BERT-base): \"similar speedups\"",
     "model": ("bert-large", "slow", 128, "ps-onebit", "none", "fast")},
    {"id": "vgg-local-eff", "claim": "VGG19, 32 GPUs of the local cluster (56 Gbit/s): "
     "HiPress's scaling efficiency", "paper": 0.90, "source": "Sec. 6.3 (Fig. 12, the setup "
     "of Fig. 11): \"up to 0.90\"", "model": ("vgg19", "local", 32, "ps-onebit", None)},
    {"id": "vgg-local-over-default", "claim": "VGG19, 32 GPUs, 56 Gbit/s: HiPress over no "
     "compression", "paper": 2.331, "source": "Sec. 6.3: 0.90 is 133.1% above the Default "
     "(BytePS for VGG19; the model's baseline is a ring allreduce)",
     "model": ("vgg19", "local", 32, "ps-onebit", "none")},
]

# ---------------------------------------------------------------- the models


def compute_seconds(model: str) -> float:
    """One GPU's forward and backward seconds per step (``ASSUMPTIONS``).

    VGG19: the paper's own figure. BERT-large: training FLOPs (forward, and
    backward at twice the forward: 3x) of ``bert_tokens`` tokens at the
    assumed sustained rate.
    """
    if model == "vgg19":
        return _a("vgg19_compute_ms") / 1e3
    if model == "bert-large":
        fwd = sum(x.flops for x in bert_large_layers()) * _a("bert_tokens")
        return 3 * fwd / (_a("v100_sustained_tflops") * 1e12)
    raise ValueError(f"unknown model {model!r}; expected one of {', '.join(MODELS)}")


def timeline(model: str, compute_s: Optional[float] = None) -> ComputeTimeline:
    """The model's compute timeline (``simulate_models.flop_timeline``) for ``compute_s``
    seconds of compute (default ``compute_seconds``) and the assumed update."""
    total = compute_s if compute_s is not None else compute_seconds(model)
    return flop_timeline(model, total, _a("update_ms") / 1e3)


# ---------------------------------------------------------------- the hardware


@dataclass(frozen=True)
class Testbed:
    """A cluster: ``nodes`` nodes of ``gpus`` GPUs joined inside by a local link of
    ``local_gbyte`` GB/s (NVLink, PCIe), between by ``net_gbit`` Gbit/s; its GPUs
    compute ``slowdown`` times as long as a V100."""

    name: str
    net_gbit: float
    gpus: int
    nodes: int
    local_gbyte: float
    slowdown: float = 1.0

    @property
    def size(self) -> int:
        """GPUs in all."""
        return self.gpus * self.nodes

    def workers(self, n: int) -> Tuple[int, Link, Optional[LocalStage], int]:
        """(workers of the model, their link, the local stage, GPUs per worker) for n GPUs
        (module doc, step 2).

        Raises:
            ValueError: n outside 1..size, or beyond one node not a whole number of nodes.
        """
        if n < 1 or n > self.size:
            raise ValueError(f"{self.name}: N must be in 1..{self.size}, found {n}")
        local = Link(_a("nvlink_latency_us") * 1e-6, self.local_gbyte * 1e9)
        if n <= self.gpus:
            return n, local, None, 1
        if n % self.gpus:
            raise ValueError(f"{self.name}: beyond one node N must fill whole nodes of "
                             f"{self.gpus} GPUs, found {n}")
        net = Link(_a("net_latency_us") * 1e-6, self.net_gbit * 1e9 / 8)
        return n // self.gpus, net, LocalStage(self.gpus, local), self.gpus


def testbeds() -> Dict[str, Testbed]:
    """HiPress's EC2 testbed at its two network speeds, and its local cluster (Fig. 11)."""
    g, m, nv = int(_a("gpus_per_node")), int(_a("nodes")), _a("nvlink_gbyte")
    return {"fast": Testbed(f"EC2, 8 V100 per node, {_a('net_fast_gbit'):g} Gbit/s",
                            _a("net_fast_gbit"), g, m, nv),
            "slow": Testbed(f"EC2, 8 V100 per node, {_a('net_slow_gbit'):g} Gbit/s",
                            _a("net_slow_gbit"), g, m, nv),
            "local": Testbed(f"local, 2 GTX 1080 Ti per node, {_a('local_net_gbit'):g} Gbit/s",
                             _a("local_net_gbit"), int(_a("local_gpus_per_node")), m,
                             _a("pcie_gbyte"), _a("gtx1080ti_slowdown"))}


#: (model, testbed) pairs simulated: the paper ran BERT-base, not BERT-large, on the
#: local cluster (GPU memory, Sec. 6.2.2), so BERT-large is simulated on EC2 only.
PAIRS = (("vgg19", "fast"), ("vgg19", "slow"), ("vgg19", "local"),
         ("bert-large", "fast"), ("bert-large", "slow"))


def profile(model: str, link: Link, gpus: int) -> Profile:
    """A cost-model profile from the assumptions: the link, and onebit's and PowerSGD's
    encode/decode curves for a worker of ``gpus`` GPUs, each compressing its share.

    Encode of m bytes: ``launch + m / (gpus * speed)``; decode of a payload:
    ``launch + gradient bytes / (gpus * speed)`` (it writes the whole gradient).
    """
    launch = _a("kernel_launch_us") * 1e-6
    q = _a("quantizer_gbyte") * 1e9 * gpus
    sizes = [float(1 << e) for e in range(8, 33)]

    def curves(ratio: float, header: int, enc_speed: float) -> Tuple[Curve, Curve]:
        enc = Curve.linear(launch, 1.0 / enc_speed, sizes)
        dec_sizes = [header + ratio * s for s in sizes]
        dec = Curve(tuple(dec_sizes), tuple(launch + s / q for s in sizes))
        return enc, dec

    one_enc, one_dec = curves(1 / 32, 8, q)
    r = powersgd_ratio(model, int(_a("powersgd_rank")))
    p_enc, p_dec = curves(r, 0, q / _a("powersgd_passes"))
    comps = {
        "onebit": CompressorProfile("onebit", "quantization", 1 / 32, 8, one_enc, one_dec,
                                    error_feedback=True),
        "powersgd": CompressorProfile("powersgd", "lowrank", r, 0, p_enc, p_dec,
                                      params={"rank": int(_a("powersgd_rank"))},
                                      aggregatable=True),
    }
    return Profile(link=link, compressors=comps, meta={"source": "bench/simulate.py "
                                                       "assumptions (not measured)"})


# ---------------------------------------------------------------- the predictions


def _never(sizes: Sequence[Tuple[str, int]], n: int) -> Plan:
    """Every gradient by the collective lane (a ring allreduce)."""
    return Plan(compressor="onebit", strategy="ring", world_size=n,
                gradients={name: GradientPlan(False, 1) for name, _ in sizes})


def predict(model: str, bed: Testbed, config: str, n: int,
            compute_s: Optional[float] = None) -> Dict[str, float]:
    """Predict one configuration on ``n`` GPUs of ``bed``.

    Returns:
        ``{"step_s", "sync_s", "efficiency", "compressed_bytes"}``: the step,
        the sum of its synchronisation phases (nothing overlapped), the
        scaling efficiency (the step without communication over the step)
        and the bytes the plan compresses.
    """
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; expected one of {CONFIGS}")
    sizes = sizes_of(model)
    tl = timeline(model, (compute_s if compute_s is not None else compute_seconds(model))
                  * bed.slowdown)
    if n == 1:
        return {"step_s": tl.floor_s, "sync_s": 0.0, "efficiency": 1.0, "compressed_bytes": 0}
    workers, link, local, gpus = bed.workers(n)
    prof = profile(model, link, gpus)
    strategy = "ps" if config.startswith("ps") else "ring"
    comp = "powersgd" if config.endswith("powersgd") else "onebit"
    planner = Planner(prof, comp, workers, strategy)
    plan = _never(sizes, workers) if config == "none" else planner.plan(sizes)
    sync, step = predict_step(plan, sizes, workers, {comp: planner}, tl, local=local)
    cbytes = sum(b for name, b in sizes if plan.decide(name, b, workers).compress)
    return {"step_s": step, "sync_s": sync, "efficiency": tl.floor_s / step,
            "compressed_bytes": cbytes}


def _paper_value(row: Mapping[str, Any], grid: Mapping[Tuple[str, str, int, str], Mapping]
                 ) -> float:
    """The model's number for a ``PAPER`` row: an efficiency, a throughput ratio
    (step of the second over step of the first), or a ratio of two speed-ups."""
    spec = row["model"]
    model, bed, n, a, b = spec[:5]
    if b is None:
        return grid[model, bed, n, a]["efficiency"]
    ratio = grid[model, bed, n, b]["step_s"] / grid[model, bed, n, a]["step_s"]
    if len(spec) == 6:  # the same speed-up on another testbed
        other = spec[5]
        ratio /= grid[model, other, n, b]["step_s"] / grid[model, other, n, a]["step_s"]
    return ratio


def _solve(eff: Any, lo: float, hi: float, target: float) -> Optional[float]:
    """The x in [lo, hi] at which the increasing ``eff(x)`` equals ``target`` (bisection
    on a log scale); None when the target lies outside ``eff``'s range there."""
    if not eff(lo) <= target <= eff(hi):
        return None
    for _ in range(24):  # the bracket shrinks to a factor (hi/lo) ** (2 ** -24)
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if eff(mid) < target else (lo, mid)
    return (lo * hi) ** 0.5


def solve_bandwidth(model: str, bed: Testbed, config: str, n: int, target: float
                    ) -> Optional[float]:
    """The network Gbit/s (0.1 .. 10,000) at which the model's efficiency on ``n`` GPUs of
    ``bed`` equals ``target``: efficiency rises with bandwidth."""
    return _solve(lambda g: predict(model, replace(bed, net_gbit=g), config, n)["efficiency"],
                  0.1, 10000.0, target)


def solve_compute(model: str, bed: Testbed, config: str, n: int, target: float
                  ) -> Optional[float]:
    """The factor (0.01 .. 100) on the assumed compute time at which the model's
    efficiency on ``n`` GPUs of ``bed`` equals ``target``: a longer step hides more."""
    base = compute_seconds(model)
    return _solve(lambda f: predict(model, bed, config, n, base * f)["efficiency"],
                  0.01, 100.0, target)


def run() -> Dict[str, Any]:
    """Every prediction, the paper comparison and the sensitivity, as JSON-ready data."""
    beds = testbeds()
    rows, grid = [], {}
    for model, key in PAIRS:
        bed = beds[key]
        for config in CONFIGS:
            for n in (1,) + tuple(w for w in WORKERS if w <= bed.size):
                p = predict(model, bed, config, n)
                grid[model, key, n, config] = p
                rows.append({"model": model, "testbed": key, "config": config, "n": n,
                             **{k: round(v, 6) for k, v in p.items()}})
    paper = []
    for row in PAPER:
        got = _paper_value(row, grid)
        model, key, n, a, b = row["model"][:5]
        gbit = factor = None  # for an efficiency: where the model would agree
        if b is None:
            gbit = solve_bandwidth(model, beds[key], a, n, row["paper"])
            factor = solve_compute(model, beds[key], a, n, row["paper"])
        paper.append({k: v for k, v in row.items() if k != "model"}
                     | {"model": list(row["model"]), "predicted": round(got, 4),
                        "ratio": round(got / row["paper"], 4),
                        "solved_gbit": None if gbit is None else round(gbit, 2),
                        "solved_compute": None if factor is None else round(factor, 3)})
    # One unknown fitted to one number, another predicted: the bandwidth at which the
    # model's Ring matches the Ring efficiency Table 1 implies for BERT-large, and what
    # the model then predicts for CaSync-PS + onebit over Ring (the paper: 1.441).
    fit = next(r for r in paper if r["id"] == "bert-ring-eff")["solved_gbit"]
    calibrated: Dict[str, Any] = {"model": "bert-large", "n": 128, "fitted_to": "bert-ring-eff",
                                  "gbit": fit, "against": "bert-ps-over-ring"}
    if fit is not None:
        bed = replace(beds["fast"], net_gbit=fit)
        eff = {c: predict("bert-large", bed, c, 128) for c in CONFIGS}
        calibrated["efficiency"] = {c: round(p["efficiency"], 4) for c, p in eff.items()}
        calibrated["ps_over_ring"] = round(eff["none"]["step_s"] / eff["ps-onebit"]["step_s"], 4)
        calibrated["rows"] = [
            {"config": c, "n": n, "efficiency": round(
                predict("bert-large", bed, c, n)["efficiency"], 6)}
            for c in ("none", "ps-onebit") for n in WORKERS]
    sens = []
    for model in MODELS:
        base = compute_seconds(model)
        for factor in (0.25, 0.5, 1.0, 2.0):
            for config in CONFIGS:
                p = predict(model, beds["fast"], config, 128, base * factor)
                sens.append({"model": model, "compute_factor": factor, "config": config,
                             "efficiency": round(p["efficiency"], 4)})
    rank = int(_a("powersgd_rank"))
    return {"assumptions": {k: {"value": v[0], "unit": v[1], "source": v[2]}
                            for k, v in ASSUMPTIONS.items()},
            "models": {m: {"gradients": len(sizes_of(m)),
                           "bytes": sum(b for _, b in sizes_of(m)),
                           "compute_ms": round(compute_seconds(m) * 1e3, 3),
                           "powersgd_ratio": round(powersgd_ratio(m, rank), 6)} for m in MODELS},
            "testbeds": {k: {"name": b.name, "gpus": b.size} for k, b in beds.items()},
            "pairs": [list(p) for p in PAIRS], "workers": list(WORKERS),
            "configs": list(CONFIGS), "rows": rows, "paper": paper, "sensitivity": sens,
            "calibrated": calibrated}


# ---------------------------------------------------------------- the page


def main(argv: Optional[List[str]] = None) -> int:
    """CLI (see the module doc)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", default=os.path.join(ROOT, "results", "simulate.json"))
    ap.add_argument("--publish", action="store_true",
                    help=f"also write the record {os.path.relpath(RECORD, ROOT)}, the page "
                         f"{os.path.relpath(PAGE, ROOT)}, its figure and the results index")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when the committed record or page is stale")
    a = ap.parse_args(argv)
    import report
    from simulate_page import plot, render_page  # the page renderer, beside this file

    data = run()
    if a.check:
        with open(RECORD) as f:
            committed = json.load(f)
        stale = []
        if committed.get("data") != json.loads(json.dumps(data)):
            stale.append(f"{RECORD} (the code predicts otherwise)")
        if not os.path.exists(PAGE) or open(PAGE).read() != render_page(committed):
            stale.append(PAGE)
        if stale:
            print(f"out of date: {', '.join(stale)}; run `{COMMAND}`", file=sys.stderr)
            return 1
        print("the simulation record and page match the code")
        return 0
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    png = os.path.splitext(a.out)[0] + ".png"
    plot({"date": date, "data": data}, png)
    for row in data["paper"]:
        print(f"{row['claim']}: paper {row['paper']:g}, model {row['predicted']:.3f} "
              f"({row['ratio']:.2f}x)")
    print(f"wrote {a.out} and {png}")
    if a.publish:
        rec = report.make_record(
            "simulation", data, command=COMMAND, date=date,
            machine=report.machine_info("none: simulated (the testbeds are in the data)"),
            source=SOURCE, title="Scaling past this machine (simulated)", headline=False,
            notes="Predictions of the step model for HiPress's testbeds, beside the paper's "
                  "figures; the assumptions and the comparison are on their own page.")
        with open(RECORD, "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
        with open(PAGE, "w") as f:
            f.write(render_page(rec))
        plot(rec, FIGURE)
        index, _ = report.render(RESULTS, plots=False)  # the other records' figures stay
        with open(os.path.join(RESULTS, "index.md"), "w") as f:
            f.write(index)
        print(f"wrote {', '.join(os.path.relpath(p, ROOT) for p in (RECORD, PAGE, FIGURE))} "
              f"and docs/results/index.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
