"""Render the fault suite's JSON summary as a table: ``python tests/faults/summary.py [FILE ...]``.

FILE defaults to ``HIPRESS_FAULTS_JSON`` or ``results/faults.json`` (what
``pytest tests/faults -m faults`` and ``bench/faults.py`` write). Several files
(runs of different parts of the catalogue) are merged into one table, from
their trials; ``--out F`` writes the merged JSON. Columns: docs/reliability.md,
"The fault-injection suite".
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import ROOT, render, summarize, trial_from_dict, write_summary  # noqa: E402


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        del argv[i:i + 2]
    paths = argv or [os.environ.get("HIPRESS_FAULTS_JSON") or str(ROOT / "results" / "faults.json")]
    docs = [json.loads(Path(p).read_text()) for p in paths]
    trials = [trial_from_dict(t) for doc in docs for t in doc["trials"]]
    print(f"timeout {docs[0]['timeout_s']} s, margin {docs[0]['margin_s']} s; {', '.join(paths)}")
    print(render(summarize(trials)))
    if out:
        print(f"written to {write_summary(trials, out)}")


if __name__ == "__main__":
    main()
