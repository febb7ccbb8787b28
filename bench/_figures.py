"""PNG figures for the benchmark scripts, written next to their JSON.

Each bench script keeps printing its table and writing its JSON; these
functions draw the same rows as a picture (matplotlib, Agg backend, no
display needed) and return the path written:

- ``train_png``: bench/train.py's median ms per step per configuration
  (horizontal bars, fastest first), with the speed-up over the slowest
  uncompressed row printed on each bar;
- ``sync_png``: bench/sync.py's sync time relative to allreduce, one panel
  per (network, gradient list);
- ``compressors_png``: bench/compressors.py's encode and decode speed as
  multiples of a memory copy at the largest measured size, with the goal
  lines the README quotes.

A figure never decides anything: the ratios come from the rows, measured
in one run.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

__all__ = ["train_png", "sync_png", "compressors_png"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


def train_png(rows: Sequence[Dict[str, Any]], json_path: str, title: str) -> str:
    """Bars of ms/step per configuration (``rows`` from bench/train.py); returns the PNG path."""
    plt = _plt()
    rows = sorted(rows, key=lambda r: r["ms_per_step"])
    base = [r["ms_per_step"] for r in rows if not r.get("compressed")]
    ref = max(base) if base else max(r["ms_per_step"] for r in rows)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    names = [r["config"] for r in rows]
    ms = [r["ms_per_step"] for r in rows]
    bars = ax.barh(names, ms, color=["#4c72b0" if r.get("compressed") else "#999999"
                                     for r in rows])
    for b, v in zip(bars, ms):  # noqa: B905
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v:.0f} ms ({ref / v:.2f}x)",
                va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median ms per step (lower is better); x = speed-up over the slowest "
                  "uncompressed row")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(ms) * 1.35)
    fig.tight_layout()
    out = _png(json_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def sync_png(rows: Sequence[Dict[str, Any]], json_path: str) -> str:
    """Sync time / allreduce per configuration, a panel per (net, list); returns the PNG path."""
    plt = _plt()
    panels: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        panels.setdefault((r["net"], r["list"]), []).append(r)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(8, sum(0.35 * len(v) + 1.2 for v in panels.values())))
    for ax, ((net, lst), rs) in zip(axes[:, 0], panels.items()):  # noqa: B905
        rs = sorted(rs, key=lambda r: r["ratio"])
        ax.barh([r["config"] for r in rs], [r["ratio"] for r in rs], color="#4c72b0")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set_title(f"{lst} over {net}", fontsize=9)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("sync time / allreduce's (lower is better)")
    fig.tight_layout()
    out = _png(json_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def compressors_png(results: Sequence[Dict[str, Any]], json_path: str,
                    goals: Dict[str, float]) -> str:
    """Encode/decode x memory copy per compressor at the largest size; returns the PNG path.

    Args:
        results: bench/compressors.py rows (``name``, ``size_mb``,
            ``encode_x_copy``, ``decode_x_copy``).
        json_path: the JSON the rows were written to (the PNG goes beside it).
        goals: label -> x-copy level, drawn as dashed lines.
    """
    plt = _plt()
    top = max(r["size_mb"] for r in results)
    rs = [r for r in results if r["size_mb"] == top]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rs) + 1.5))
    ys = range(len(rs))
    ax.barh([y - 0.2 for y in ys], [r["encode_x_copy"] for r in rs], height=0.4,
            label="encode", color="#4c72b0")
    ax.barh([y + 0.2 for y in ys], [r["decode_x_copy"] for r in rs], height=0.4,
            label="decode", color="#dd8452")
    for label, level in goals.items():
        ax.axvline(level, ls="--", lw=0.8, color="k")
        ax.text(level, -0.9, f" {label}", fontsize=7)
    ax.set_yticks(list(ys), [r["name"] for r in rs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"speed as a multiple of a memory copy, {top:g} MB (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = _png(json_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
