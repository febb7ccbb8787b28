"""The simulation's docs page, figure and results-index section, from its record.

``bench/simulate.py --publish`` wraps its predictions in a ``bench/report.py``
record of kind "simulation" (``docs/results/simulation.json``). From that
record this module renders the page ``docs/results/simulation.md``
(``render_page``), its figure (``plot``) and the short section the results
index shows (``render_section``, report.py's renderer for the kind). Nothing
is edited by hand: ``bench/simulate.py --check`` and ``bench/report.py render
--check`` fail when a page differs from its record. The data's shape is
``simulate.run``'s; this module only formats it.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import _plt, _save, md_table  # noqa: E402

LABELS = {"none": "no compression (Ring allreduce)", "ring-onebit": "CaSync-Ring + onebit",
          "ps-onebit": "CaSync-PS + onebit", "ring-powersgd": "CaSync-Ring + PowerSGD"}
MODEL_NAMES = {"vgg19": "VGG19", "bert-large": "BERT-large"}
FAR = 0.20  # model and paper "disagree" beyond this relative difference (issue 50)


def _rows(data: Mapping[str, Any], model: str, bed: str, config: str) -> List[Mapping]:
    return sorted((r for r in data["rows"] if (r["model"], r["testbed"], r["config"])
                   == (model, bed, config)), key=lambda r: r["n"])


def _why(row: Mapping[str, Any], data: Mapping[str, Any]) -> str:
    """Why a row's model and paper differ by more than ``FAR``, as far as known."""
    paper = {r["id"]: r for r in data["paper"]}
    cal = data.get("calibrated", {})
    gbit = {k: paper[k]["solved_gbit"] for k in ("vgg-ring-eff", "bert-ring-eff")}
    if row["id"] in ("vgg-ring-eff", "bert-ring-eff"):
        text = ("the model's ring runs at line rate and hides its traffic behind backward; "
                f"it gives the paper's figure with the network delivering "
                f"{row['solved_gbit']} Gbit/s, or with a compute step "
                f"{row['solved_compute']}x the assumed one (see the two sections below)")
        if row["id"] == "bert-ring-eff":
            model, bed, n, config = row["model"][:4]
            r = next(x for x in data["rows"] if (x["model"], x["testbed"], x["n"],
                                                  x["config"]) == (model, bed, n, config))
            text += (f". Table 1 puts communication at 63.6% of BytePS's BERT-large step on "
                     f"this testbed; the model's ring synchronisation, nothing overlapped, is "
                     f"{r['sync_s'] / r['step_s'] * 100:.0f}% of its step")
        return text
    if row["id"] in ("vgg-ps-over-ring", "bert-ps-over-ring"):
        ring = "vgg-ring-eff" if row["id"].startswith("vgg") else "bert-ring-eff"
        text = (f"the model's no-compression baseline already scales to {_eff(data, row):.2f} "
                f"(line rate, traffic hidden behind backward), so compression has little left "
                f"to gain; the paper's Ring is much slower: the model gives its implied "
                f"efficiency ({paper[ring]['paper']:g}) at {gbit[ring]} Gbit/s")
        if row["id"] == "bert-ps-over-ring" and cal.get("ps_over_ring"):
            text += (f", and at that bandwidth predicts {cal['ps_over_ring']:.2f}x here "
                     f"(within {abs(cal['ps_over_ring'] / row['paper'] - 1) * 100:.0f}%)")
        return text
    if row["id"] == "bert-25-vs-100":
        return ("at 100 Gbit/s the model's baseline hides its traffic, so the speed-up is "
                "near 1 there and grows at 25 Gbit/s; the paper saw the same speed-up at both "
                "(BERT-base), as if its 100 Gbit/s network delivered far less than line rate")
    if row["id"] == "vgg-local-over-default":
        return ("the paper's Default for VGG19 is BytePS, and its Sec. 6.2.1 finds Ring "
                "31-50% faster than BytePS on VGG19; the model's ring, at line rate, again "
                "hides its traffic")
    return "not known"


def _agrees(row: Mapping[str, Any]) -> str:
    """Where the model would agree with an efficiency row: network or compute."""
    parts = []
    if row.get("solved_gbit") is not None:
        parts.append(f"{row['solved_gbit']:g} Gbit/s")
    if row.get("solved_compute") is not None:
        parts.append(f"compute x{row['solved_compute']:.2f}")
    return "; ".join(parts) or "-"


def _eff(data: Mapping[str, Any], row: Mapping[str, Any]) -> float:
    """The efficiency of the baseline (second configuration) of a ratio row."""
    model, bed, n, _, b = row["model"][:5]
    return next(r["efficiency"] for r in data["rows"]
                if (r["model"], r["testbed"], r["n"], r["config"]) == (model, bed, n, b))


def _summary(data: Mapping[str, Any]) -> str:
    """The page's findings in one paragraph, its numbers from the data."""
    def eff(model: str, bed: str, config: str) -> float:
        return _rows(data, model, bed, config)[-1]["efficiency"]

    paper = {r["id"]: r for r in data["paper"]}
    cpr = [c for c in data["configs"] if c != "none"]
    worst = min(eff(m, b, c) for m, b in data["pairs"] for c in cpr)
    cal = data.get("calibrated", {})
    text = (f"With links at line rate, the model hides most of the traffic behind backward at "
            f"100 Gbit/s: without compression VGG19 keeps {eff('vgg19', 'fast', 'none'):.2f} "
            f"and BERT-large {eff('bert-large', 'fast', 'none'):.2f} of linear scaling on 128 "
            f"GPUs, so compression gains little there. At 25 Gbit/s no compression falls to "
            f"{eff('vgg19', 'slow', 'none'):.2f} and {eff('bert-large', 'slow', 'none'):.2f}, "
            f"while no compressed row drops below {worst:.2f} on any testbed. The paper's "
            f"HiPress efficiencies (0.90-0.94) are within 20% of the model's; its Ring "
            f"baseline is far slower than the model's: the model reproduces it at "
            f"{paper['vgg-ring-eff']['solved_gbit']:g} Gbit/s (VGG19) and "
            f"{paper['bert-ring-eff']['solved_gbit']:g} Gbit/s (BERT-large) of achieved "
            f"bandwidth, or with a compute step "
            f"{paper['vgg-ring-eff']['solved_compute']:.2f}x and "
            f"{paper['bert-ring-eff']['solved_compute']:.2f}x the assumed one.")
    if cal.get("ps_over_ring"):
        text += (f" Fitted to BERT-large's Ring alone, it then predicts CaSync-PS + onebit "
                 f"{cal['ps_over_ring']:.2f}x faster than Ring, against the paper's "
                 f"{paper[cal['against']]['paper']:g}x.")
    return text


def render_page(rec: Mapping[str, Any]) -> str:
    """The docs page (markdown) of one ``simulate.py`` record."""
    data = rec["data"]
    a = data["assumptions"]
    out = ["# Scaling past this machine: a simulation", "",
           "Generated by `python bench/simulate.py --publish` into the record "
           "[`simulation.json`](simulation.json); do not edit by hand (`python "
           f"bench/simulate.py --check` fails when it is stale). Date {rec['date']}.", "",
           "Nothing on this page is measured. This host has two cores and no GPU; the "
           "project's step model (`hipress_like.tuning.step_model`, the model behind "
           "`hipress-profile advise`) predicts what the engine's configurations would do on "
           "the testbeds of HiPress (Sec. 6.1), from the paper's reported figures and the "
           "assumptions listed below. Where the prediction and the paper differ by more than "
           "20%, the table says why as far as it is known.", "",
           "## In short", "", _summary(data), "",
           "## How the prediction is made", "",
           "1. Gradients from the published layer shapes: VGG19 in torchvision's layout "
           "(38 tensors, 548 MiB, as HiPress Table 6) and BERT-large (24 layers, hidden 1024, "
           "16 heads, FFN 4096, vocabulary 30522, a 2-class head; 393 tensors, 1278 MiB; "
           "Table 6 counts 399 and 1283 MiB). In backward a layer's gradients are final when "
           "its share of the FLOPs is done.",
           "2. Workers: up to one node the workers are its GPUs over the node's link (NVLink; "
           "PCIe on the local cluster); beyond, each node is one worker of the cost model "
           "over the network, its GPUs reduce-scattering every gradient before and "
           "all-gathering it after (`step_model.LocalStage`, the ring's 2(G-1)/G volume law) "
           "and compressing an eighth each.",
           "3. Plans: no compression is one ring allreduce per fused bucket (the Ring "
           "baseline); the compressed rows are the cost model's plans (HiPress Eq. 1-2, "
           "selective compression and partitioning, Sec. 3.3) for co-located CaSync-PS or "
           "CaSync-Ring with onebit, and CaSync-Ring with PowerSGD.",
           "4. Step: `predict_step` overlaps each gradient's synchronisation with the rest of "
           "backward (CaSync's pipeline). Scaling efficiency = throughput on N / (N x one "
           "GPU's) = the step without communication / the step on N (HiPress footnote 1; "
           "weak scaling: the per-GPU batch is fixed, Sec. 6.1).", "",
           "## Assumptions", "",
           md_table(["input", "value", "unit", "source"],
                    [[k, f"{v['value']:g}", v["unit"], v["source"]] for k, v in a.items()]),
           "",
           md_table(["model", "gradients", "MiB", "compute per step, ms (V100)",
                     "PowerSGD payload / gradient"],
                    [[MODEL_NAMES[m], v["gradients"], f"{v['bytes'] / 2 ** 20:.1f}",
                      f"{v['compute_ms']:.0f}", f"{v['powersgd_ratio']:.4f}"]
                     for m, v in data["models"].items()]), "",
           "## Predicted scaling efficiency", ""]
    for model, bed in data["pairs"]:
        ns = [r["n"] for r in _rows(data, model, bed, "none") if r["n"] > 1]
        out += [f"### {MODEL_NAMES[model]}, {data['testbeds'][bed]['name']}", "",
                md_table(["configuration"] + [f"N={n}" for n in ns] + [f"step ms, N={ns[-1]}"],
                         [[LABELS[c]] + [f"{r['efficiency']:.2f}" for r in _rows(
                             data, model, bed, c) if r["n"] > 1]
                          + [f"{_rows(data, model, bed, c)[-1]['step_s'] * 1e3:.0f}"]
                          for c in data["configs"]]), ""]
    out += ["![Predicted scaling efficiency against N, with the paper's figures]"
            "(img/simulation.png)", "",
            "## Against the paper", "",
            "A ratio is the first configuration's throughput over the second's (the "
            "second's step over the first's); "
            "efficiencies are as above. \"implied\" rows combine two of the paper's "
            "statements, as the source column shows. The last column is, for an "
            "efficiency, the network bandwidth (or else the factor on the assumed compute "
            "time) at which the model's efficiency equals the paper's.", ""]
    rows = []
    for r in data["paper"]:
        far = abs(r["ratio"] - 1) > FAR
        rows.append([r["claim"], f"{r['paper']:g}", r["source"], f"{r['predicted']:.2f}",
                     f"{r['ratio']:.2f}", _why(r, data) if far else "within 20%",
                     _agrees(r)])
    out += [md_table(["paper's claim", "paper", "source", "model", "model / paper",
                      "why they differ", "model agrees at"], rows), ""]
    cal = data.get("calibrated", {})
    paper_of = {r["id"]: r["paper"] for r in data["paper"]}
    if cal.get("gbit"):
        eff = cal["efficiency"]
        out += ["### One unknown fitted, another predicted", "",
                f"The model's BERT-large Ring matches Table 1's implied efficiency "
                f"({paper_of[cal['fitted_to']]}) "
                f"when the network delivers {cal['gbit']:g} Gbit/s. At that bandwidth it "
                f"predicts, on 128 GPUs: " + "; ".join(
                    f"{LABELS[c]} {e:.2f}" for c, e in eff.items()) +
                f". CaSync-PS + onebit over Ring is then {cal['ps_over_ring']:.2f}x, against "
                f"the paper's {paper_of[cal['against']]}x (Sec. 6.2.1), which was not used "
                "in the fit.", ""]
    out += ["## Sensitivity to the compute time", "",
            "Efficiency on 128 GPUs at 100 Gbit/s when the step's compute is scaled (a "
            "smaller batch, mixed precision or a faster GPU shortens it). The per-GPU batch of "
            "Fig. 9 is in the figure only, so the compute time is the least certain input.", ""]
    factors = sorted({s["compute_factor"] for s in data["sensitivity"]})
    sens_rows = []
    for model in data["models"]:
        for c in data["configs"]:
            got = {s["compute_factor"]: s["efficiency"] for s in data["sensitivity"]
                   if s["model"] == model and s["config"] == c}
            sens_rows.append([MODEL_NAMES[model], LABELS[c]]
                             + [f"{got[f]:.2f}" for f in factors])
    out += [md_table(["model", "configuration"] + [f"compute x{f:g}" for f in factors],
                     sens_rows), "",
            "## What the model leaves out", "",
            "- The achieved network bandwidth: links run at line rate with a fixed latency; "
            "protocol overhead, congestion, EFA/libfabric and the frameworks' own "
            "scheduling (MXNet's engine, Horovod's negotiation per tensor) are not modelled.",
            "- Compression kernels do not slow backward on the same GPU (the paper measured "
            "the effect as negligible, Sec. 6.3).",
            "- BytePS: the paper's BytePS baselines (Table 1, Fig. 9 and 11) are not "
            "simulated; only the ring allreduce is.",
            "- Stragglers and variance between the 128 GPUs.",
            "- The plans minimise each gradient's synchronisation (HiPress Eq. 1-2), not the "
            "step: re-planned for a faster link, a step can come out about 1% longer "
            "(tests/unit/test_simulate.py holds the plan fixed to pin that a faster link "
            "never slows a step).",
            "- PowerSGD runs as one payload of the model's average ratio per gradient; its "
            "two rounds (P, then Q) are priced as one (HiPress Sec. 6.1's counts).", ""]
    return "\n".join(out)


def plot(rec: Mapping[str, Any], path: str) -> None:
    """Efficiency against N per (model, testbed), the paper's efficiency figures marked,
    and a last panel of model / paper ratios."""
    data = rec["data"]
    plt = _plt()
    pairs = data["pairs"]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    marks: Dict[tuple, List[Mapping]] = {}
    for r in data["paper"]:
        model, bed, n, a, b = r["model"][:5]
        if b is None:
            marks.setdefault((model, bed), []).append(r)
    for ax, (model, bed) in zip(axes.flat, pairs):
        for c in data["configs"]:
            rs = _rows(data, model, bed, c)
            ax.plot([r["n"] for r in rs], [r["efficiency"] for r in rs], marker="o", ms=3,
                    label=LABELS[c])
        for r in marks.get((model, bed), []):
            ax.scatter([r["model"][2]], [r["paper"]], marker="*", s=120, color="black",
                       zorder=5)
            who = "Ring" if r["model"][3] == "none" else "HiPress"
            ax.annotate(f"paper, {who}: {r['paper']:g}", (r["model"][2], r["paper"]),
                        textcoords="offset points", xytext=(-95, -4), fontsize=7)
        cal = data.get("calibrated", {})
        if (model, bed) == (cal.get("model"), "fast") and cal.get("rows"):
            for c, color in (("none", "C0"), ("ps-onebit", "C2")):
                rs = [r for r in cal["rows"] if r["config"] == c]
                ax.plot([r["n"] for r in rs], [r["efficiency"] for r in rs], ls="--",
                        color=color, lw=1, label=f"{LABELS[c]}, network at {cal['gbit']:g} "
                                                  "Gbit/s (fitted)")
            ax.legend(fontsize=6, loc="lower left")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{MODEL_NAMES[model]}, {data['testbeds'][bed]['name']}", fontsize=8)
        ax.set_xlabel("GPUs N")
        ax.set_ylabel("scaling efficiency")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="lower left")
    ax = axes.flat[len(pairs)]
    ids = [r["id"] for r in data["paper"]]
    ratios = [r["ratio"] for r in data["paper"]]
    ax.barh(ids, ratios, color=["#c44" if abs(v - 1) > FAR else "#4a4" for v in ratios])
    ax.axvspan(1 - FAR, 1 + FAR, color="#ddd", zorder=0)
    ax.axvline(1.0, color="#666", lw=0.8)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("model / paper (grey: within 20%)")
    ax.set_title("against the paper's figures", fontsize=8)
    for extra in list(axes.flat)[len(pairs) + 1:]:
        extra.axis("off")
    fig.suptitle(f"Predicted, not measured: bench/simulate.py ({rec['date'][:10]})",
                 fontsize=9)
    _save(fig, path)


def render_section(rec: Mapping[str, Any]
                   ) -> Tuple[str, List[Dict[str, str]], Optional[Callable[[str], None]]]:
    """The results index's section of a "simulation" record (``report.Rendered``): the
    predicted efficiency at each testbed's largest N and a link to the full page; no
    headline row (nothing measured)."""
    data = rec["data"]
    rows = []
    for model, bed in data["pairs"]:
        last = {c: _rows(data, model, bed, c)[-1] for c in data["configs"]}
        rows.append([MODEL_NAMES[model], data["testbeds"][bed]["name"],
                     str(last[data["configs"][0]]["n"])]
                    + [f"{last[c]['efficiency']:.2f}" for c in data["configs"]])
    text = (md_table(["model", "testbed", "GPUs"] + [LABELS[c] for c in data["configs"]], rows)
            + "\n\nPredicted scaling efficiency. The assumptions, the paper's figures beside "
            "the predictions and why they differ: [Scaling past this machine: a simulation]"
            "(simulation.md).")
    return text, [], lambda path: plot(rec, path)
