"""Same bits before and after a change: every compressor, both strategies, fixed plans.

Checks out ``--base`` (default: the commit before HEAD) into a temporary git
worktree, runs ``bench/_bits_job.py`` with 4 gloo ranks against it and
against this tree, and compares the SHA-256 digests of the averaged
gradients after two steps, per compressor and strategy.

    python bench/ab_bits.py                     # HEAD~1 against the work tree
    python bench/ab_bits.py --base 7d7c489 --ranks 4 --out results/ab_bits.json

Exit status 1 when some pair differs. A compressor whose base run is not
reproducible by itself cannot be compared bit for bit: ``--repeat 2`` runs
the base twice and marks such rows "base not reproducible".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(tree: str, names: str, ranks: int, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, HERE]))
    subprocess.run([sys.executable, os.path.join(HERE, "_bits_job.py"), "--ranks", str(ranks),
                    "--names", names, "--out", out], check=True, env=env, cwd=tree)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    """Compare the two trees; print one row per compressor and strategy."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="runs of the base (2 flags "
                    "rows whose base is not reproducible)")
    ap.add_argument("--out", help="write the comparison as JSON")
    a = ap.parse_args()
    if a.ranks < 2:
        ap.error("--ranks must be >= 2")
    sys.path.insert(0, ROOT)
    from hipress_like import compressors

    names = ",".join(c for c in compressors.available()
                     if c not in ("none", "ef", "error_feedback"))
    with tempfile.TemporaryDirectory(prefix="hipress-ab-") as tmp:
        wt = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", wt, a.base],
                       check=True, stdout=subprocess.DEVNULL)
        try:
            bases = [_run(wt, names, a.ranks, os.path.join(tmp, f"base{i}.json"))
                     for i in range(a.repeat)]
            new = _run(ROOT, names, a.ranks, os.path.join(tmp, "new.json"))
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", wt],
                           check=False)
    rows, bad = [], 0
    print(f"{'compressor/strategy':28s} verdict   ({a.ranks} ranks, base {a.base})")
    for key in sorted(set(bases[0]) | set(new)):
        if key not in bases[0] or key not in new:
            verdict = "only in " + ("new" if key in new else "base")
        elif any(b.get(key) != bases[0][key] for b in bases[1:]):
            verdict = "base not reproducible"
        else:
            verdict = "same" if bases[0][key] == new[key] else "DIFFERENT"
            bad += verdict == "DIFFERENT"
        rows.append({"key": key, "verdict": verdict})
        print(f"{key:28s} {verdict}")
    print(f"{sum(r['verdict'] == 'same' for r in rows)} same, {bad} different")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"base": a.base, "ranks": a.ranks, "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
