"""What fresh gradient buffers cost a CPU step: page faults under three allocator settings.

Autograd allocates every gradient afresh each step once ``zero_grad()`` sets them
to None (PyTorch's default). glibc serves a request above its mmap threshold
(at most 32 MB by default) with a new mapping, so the VGG-style model's 84 MB
weight gradient is faulted in page by page, every step, and unmapped again at
the next ``zero_grad()``; the step pays the kernel's clearing of about 20,500
pages. Two process-wide settings avoid it, both the user's to choose (they
change every allocation of the process, so this library sets neither):

- ``THP_MEM_ALLOC_ENABLE=1``: PyTorch's CPU allocator aligns allocations of
  2 MB and more to 2 MB and asks for transparent huge pages (``madvise``), so
  the buffer is faulted 2 MB at a time;
- ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...``
  above the largest gradient: glibc keeps such buffers on its heap and reuses
  them without faults.

The benchmark times the floor step of bench/train.py's model (forward,
backward, SGD with momentum; one thread, no communication) in a fresh process
per setting, the settings alternated ``--repeats`` times, and prints each
one's median page faults and CPU time per step and the CPU time over the
default's. Writes results/alloc_<model>.json. Timing lives here, never in tests.

    python bench/alloc.py --model vgg --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name -> environment added to the worker's
SETTINGS = {
    "default": {},
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
    "glibc-heap": {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=268435456:"
                                     "glibc.malloc.trim_threshold=536870912"},
}


def worker(model: str, steps: int, batch: int) -> dict:
    """Faults and CPU ms per floor step of ``model`` in this process (after 3 warm-up steps)."""
    import resource
    import time

    sys.path.insert(0, HERE)
    from bound import floor_step  # the floor step bench/bound.py times

    step, _ = floor_step(model, batch)
    for _ in range(3):
        step()
    f0, c0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
    for _ in range(steps):
        step()
    return {"faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps,
            "cpu_ms_per_step": (time.process_time() - c0) / steps * 1e3}


def run(setting: str, model: str, steps: int, batch: int) -> dict:
    """One worker process under ``SETTINGS[setting]``; its result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **SETTINGS[setting])
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model,
                          "--steps", str(steps), "--batch", str(batch)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    """Run every setting ``--repeats`` times, alternated; print the table; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vgg", choices=["vgg", "resnet18"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="images per step (train.py's)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs per setting")
    ap.add_argument("--worker", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.worker:
        print(json.dumps(worker(ns.worker, ns.steps, ns.batch)))
        return 0
    if ns.repeats < 1 or ns.steps < 1:
        ap.error("--repeats and --steps must be at least 1")
    runs = {s: [] for s in SETTINGS}
    for _ in range(ns.repeats):
        for s in SETTINGS:
            runs[s].append(run(s, ns.model, ns.steps, ns.batch))
    rows = [{"setting": s, "env": SETTINGS[s], "runs": got,
             "faults_per_step": statistics.median(r["faults_per_step"] for r in got),
             "cpu_ms_per_step": statistics.median(r["cpu_ms_per_step"] for r in got)}
            for s, got in runs.items()]
    base = rows[0]["cpu_ms_per_step"]
    print(f"{ns.model} floor step, one thread, medians of {ns.repeats} alternated runs")
    print(f"{'setting':<12} {'faults/step':>12} {'CPU ms/step':>12} {'x default':>10}")
    for r in rows:
        r["cpu_over_default"] = r["cpu_ms_per_step"] / base
        print(f"{r['setting']:<12} {r['faults_per_step']:12.0f} {r['cpu_ms_per_step']:12.1f} "
              f"{r['cpu_over_default']:10.2f}")
    out = ns.out or os.path.join(ROOT, "results", f"alloc_{ns.model}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": ns.model, "steps": ns.steps, "repeats": ns.repeats, "rows": rows},
                  f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
