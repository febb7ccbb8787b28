"""The main job's picture: test accuracy against wall time, and where a step's time goes.

Two panels, one PNG (matplotlib, Agg: no display needed):

1. test accuracy after each epoch against the training time spent so far,
   one curve per run (CaSync and the uncompressed run);
2. per run, milliseconds per step: the training loop's wall time stacked as
   compute (forward and backward, which the engine overlaps with
   synchronisation) and waiting (``opt.step()`` blocked on what was not
   hidden), beside the engine's busy time in compression and in
   communication (``cli_digits.step_breakdown``), which overlap the first two.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["plot_runs"]


def plot_runs(path: str, runs: Sequence[Tuple[str, Dict[str, Any]]], title: str) -> str:
    """Write the picture of ``runs`` ([(label, rank 0's train_digits result)]) to ``path``.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, res in runs:
        t, xs, ys = 0.0, [0.0], [None]
        for e in res["epochs"]:
            t += e["seconds"]
            xs.append(t)
            ys.append(e["acc"])
        ax1.plot(xs[1:], ys[1:], marker="o", label=f"{label} ({t:.0f} s)")
    ax1.set_xlabel("training time (s)")
    ax1.set_ylabel("test accuracy (%)")
    ax1.set_title("accuracy against wall time")
    ax1.grid(alpha=0.3)
    ax1.legend()

    labels: List[str] = [label for label, _ in runs]
    bd = [res.get("breakdown", {}) for _, res in runs]
    x = list(range(len(runs)))
    w = 0.38
    compute = [b.get("compute", 0.0) for b in bd]
    waiting = [b.get("waiting", 0.0) for b in bd]
    ax2.bar([i - w / 2 for i in x], compute, w, label="compute (fwd + bwd)", color="#4c72b0")
    ax2.bar([i - w / 2 for i in x], waiting, w, bottom=compute,
            label="waiting in opt.step()", color="#dd8452")
    comp = [b.get("compression", 0.0) for b in bd]
    comm = [b.get("communication", 0.0) for b in bd]
    ax2.bar([i + w / 2 for i in x], comp, w, label="engine: compression", color="#55a868")
    ax2.bar([i + w / 2 for i in x], comm, w, bottom=comp, label="engine: communication",
            color="#8172b3")
    ax2.set_xticks(x)
    ax2.set_xticklabels(labels)
    ax2.set_ylabel("ms per step (rank 0)")
    ax2.set_title("a step: loop (left) and engine busy time (right)")
    ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
