"""Speed A/B of two commits in one run: bench/sync.py and bench/train.py rows, alternately.

Checks out ``--base`` (default: the commit before HEAD) into a temporary git
worktree and runs, for each row, the base tree's benchmark and this tree's
benchmark in alternation (base, new, base, new, ... ``--rounds`` times), so
the load of a shared machine drifts over both alike. Rows:

- ``sync``: bench/sync.py at ``--net`` on the VGG19-like and ResNet50-like
  lists, one strategy+compressor per row (``--sync-only``);
- ``train``: bench/train.py at ``--net``, one configuration per row
  (``--train-configs``, timing only: no accuracy runs), with ``--nprocs``
  ranks; a second row gives the configuration's CPU time per rank;
- ``compressors``: bench/compressors.py at ``--compressor-sizes`` MB, one
  row per compressor and direction (``--compressors``; '' for none), its
  encode or decode time over the memory copy timed interleaved with it in
  the same run (so load drift cancels, as in the sync rows).

Each row prints the base's and the new tree's median and their ratio (new /
base): ms per step for train rows, and for sync rows the time over the
DDP-bucketed allreduce timed alternately with it (so load drift cancels);
the change is "within 5%" where the ratio is <= 1.05.

    python bench/ab_speed.py --base 7d7c489                 # the issue's rows (root, netem)
    python bench/ab_speed.py --net loopback --rounds 1 --sync-only ps+onebit \\
        --train-configs hp-ps-onebit                        # a quick look

Writes results/ab_speed.json. Timing lives here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # netem.py

SYNC_ONLY = "ps+onebit,ring+onebit,ps+powersgd,ring+powersgd,ps+identity"
TRAIN_CONFIGS = ("hp-none,hp-ps-onebit,hp-ps-terngrad,hp-ps-dgc,hp-ps-powersgd,"
                 "hp-ps-powersgd1,hp-ring-onebit,hp-ring-powersgd,hp-ring-powersgd1")


def _sync(tree: str, net: str, only: str, reps: int, tmp: str) -> dict:
    out = os.path.join(tmp, "sync.json")
    cmd = [sys.executable, os.path.join(tree, "bench", "sync.py"), "--nets", net,
           "--lists", "vgg19,resnet50", "--reps", str(reps), "--only", only, "--out", out]
    subprocess.run(cmd, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    with open(out) as f:
        # each config's time over the DDP-bucketed allreduce timed alternately with it
        # in the same run (bench/sync.py's ratio): load drift cancels out of it
        return {f"sync {r['list']} {r['config']} (x allreduce)": r["ratio"]
                for r in json.load(f)["rows"] if not r["config"].startswith("allreduce")}


def _compressors(tree: str, only: str, sizes: str, repeats: int, tmp: str) -> dict:
    out = os.path.join(tmp, "compressors.json")
    cmd = [sys.executable, os.path.join(tree, "bench", "compressors.py"), "--sizes", sizes,
           "--repeats", str(repeats), "--out", out]
    if only != "all":
        cmd += ["--only", only]
    subprocess.run(cmd, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    res = {}
    with open(out) as f:
        for r in json.load(f)["results"]:
            for side in ("encode", "decode"):
                if r.get(f"{side}_s") and r.get("copy_s"):
                    key = f"compressors {r['name']} {r['size_mb']:g}MB {side} (x copy time)"
                    res[key] = r[f"{side}_s"] / r["copy_s"]
    return res


def _train(tree: str, net: str, config: str, model: str, steps: int, nprocs: int,
           tmp: str) -> dict:
    out = os.path.join(tmp, "train.json")
    cmd = [sys.executable, os.path.join(tree, "bench", "train.py"), "--model", model,
           "--configs", config, "--acc-steps", "0", "--steps", str(steps),
           "--nprocs", str(nprocs), "--out", out]
    if net != "loopback":
        cmd += ["--netem", net]
    subprocess.run(cmd, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    res = {}
    with open(out) as f:
        for r in json.load(f)["rows"]:
            res[f"train {model} {r['config']}"] = r["ms_per_step"]
            if r.get("cpu_ms_per_step"):  # with 4 ranks on 2 cores, what a rank costs
                res[f"train {model} {r['config']} (CPU ms/rank)"] = r["cpu_ms_per_step"]
    return res


def main() -> int:
    """Run the rows alternately on both trees; print and write the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--net", default="1gbit", help="link rate, or 'loopback'")
    ap.add_argument("--rounds", type=int, default=2, help="alternations per row")
    ap.add_argument("--sync-only", default=SYNC_ONLY, help="sync rows ('' for none)")
    ap.add_argument("--sync-reps", type=int, default=3)
    ap.add_argument("--train-configs", default=TRAIN_CONFIGS, help="train rows ('' for none)")
    ap.add_argument("--compressors", default="",
                    help="compressor rows: names for bench/compressors.py --only, 'all', "
                         "or '' (default) for none")
    ap.add_argument("--compressor-sizes", default="16", help="their gradient sizes in MB")
    ap.add_argument("--compressor-repeats", type=int, default=5)
    ap.add_argument("--model", default="vgg", choices=["vgg", "resnet18"])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per train run")
    ap.add_argument("--nprocs", type=int, default=4,
                    help="ranks of the train rows (2: a core each on this host)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "ab_speed.json"))
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    # each bench/train.py and bench/sync.py run takes its own emulation session
    # (netem's lock): holding one here would make every child wait for this process
    times = {"base": {}, "new": {}}
    with tempfile.TemporaryDirectory(prefix="hipress-ab-") as tmp:
        wt = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", wt, a.base],
                       check=True, stdout=subprocess.DEVNULL)
        try:
            jobs = []
            if a.sync_only:
                jobs.append(lambda tree: _sync(tree, a.net, a.sync_only, a.sync_reps, tmp))
            if a.compressors:
                jobs.append(lambda tree: _compressors(tree, a.compressors, a.compressor_sizes,
                                                      a.compressor_repeats, tmp))
            for c in [c for c in a.train_configs.split(",") if c]:
                jobs.append(lambda tree, c=c: _train(tree, a.net, c, a.model, a.steps,
                                                     a.nprocs, tmp))
            for i, job in enumerate(jobs):
                for r in range(a.rounds):
                    for side, tree in (("base", wt), ("new", ROOT)):
                        for k, v in job(tree).items():
                            times[side].setdefault(k, []).append(v)
                        print(f"[{i + 1}/{len(jobs)} round {r + 1}] {side} done", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", wt],
                           check=False)
    rows = []
    print(f"\n{'row':64s} {'base':>9s} {'new':>9s} {'new/base':>9s}  (net {a.net}, "
          f"base {a.base}, {a.rounds} alternations, medians)")
    for k in times["new"]:
        if k not in times["base"]:
            continue
        b, n = statistics.median(times["base"][k]), statistics.median(times["new"][k])
        rows.append({"row": k, "base_ms": b, "new_ms": n, "ratio": n / b})
        print(f"{k:64s} {b:9.3f} {n:9.3f} {n / b:9.3f}{'' if n / b <= 1.05 else '  > 1.05'}")
    worst = max((r["ratio"] for r in rows), default=float("nan"))
    print(f"\nworst new/base: {worst:.3f} (goal <= 1.05 on every row)")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"base": a.base, "net": a.net, "rounds": a.rounds, "rows": rows,
                   "samples": times}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
