"""Render the fault suite's JSON summary as a table: ``python tests/faults/summary.py [FILE]``.

FILE defaults to ``HIPRESS_FAULTS_JSON`` or ``results/faults.json`` (what
``pytest tests/faults -m faults`` and ``bench/faults.py`` write). Columns:
docs/reliability.md, "The fault-injection suite".
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import ROOT, render  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = (argv[0] if argv else os.environ.get("HIPRESS_FAULTS_JSON")
            or str(ROOT / "results" / "faults.json"))
    doc = json.loads(Path(path).read_text())
    print(f"timeout {doc['timeout_s']} s, margin {doc['margin_s']} s; {path}")
    print(render(doc["rows"]))


if __name__ == "__main__":
    main()
