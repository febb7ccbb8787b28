"""Results are rendered, not narrated: every published table and figure has its JSON record.

- ``bench/report.py render --check`` finds the committed results page and the
  README's headline table identical to what the records in ``docs/results``
  render to (so nobody edits a figure by hand);
- every image the docs or the README show is a figure of a record (same
  stem under ``docs/results/img``), and every record names its command, date
  and machine;
- ``record`` then ``render`` on a bench script's JSON gives a table whose
  ratios are the ones in that JSON, and bad input is refused with the fix.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT / "bench"))
import report  # noqa: E402


def test_committed_pages_match_their_json():
    res = subprocess.run([sys.executable, "bench/report.py", "render", "docs/results",
                          "--readme", "README.md", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_record_names_command_date_and_machine():
    records = report.load_records(str(RESULTS))
    assert len(records) >= 3
    assert any(rec["source"] == "run" for _, rec in records), "no figure from a real run"
    for path, rec in records:
        assert rec["command"] and rec["date"], path
        assert {"cores", "cpu", "link"} <= set(rec["machine"]), path
        if rec["source"] != "run":
            assert "transcribed" in rec["source"] or "simulated" in rec["source"], (
                f"{path}: say where a figure was copied from, or that it is simulated")


def test_every_shown_image_is_a_records_figure():
    """No picture in the docs or the README without a JSON record behind it."""
    stems = {Path(p).stem for p, _ in report.load_records(str(RESULTS))}
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    shown = []
    for page in pages:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            img = (page.parent / target).resolve()
            shown.append(img)
            assert img.parent == RESULTS / "img" and img.stem in stems, (
                f"{page.relative_to(ROOT)} shows {target}, which is not the figure of a record "
                f"in docs/results (render one with bench/report.py)")
    assert shown, "the README's picture is gone"
    stray = [p.name for p in (ROOT / "docs").rglob("*.png")
             if p.parent != RESULTS / "img" or p.stem not in stems]
    assert not stray, f"images without a record: {stray}"


def _compressors_json(tmp_path):
    raw = {"meta": {}, "powersgd": None, "goals": [], "results": [
        {"name": "onebit", "size_mb": 1.0, "ratio": 1 / 32, "encode_x_copy": 0.5,
         "decode_x_copy": 0.25, "decode_out_x_copy": 0.75},
        {"name": "fp16", "size_mb": 1.0, "ratio": 0.5, "encode_x_copy": 0.9,
         "decode_x_copy": 0.8, "decode_out_x_copy": None}]}
    p = tmp_path / "compressors.json"
    p.write_text(json.dumps(raw))
    return p


def test_record_then_render_reproduces_the_ratios(tmp_path):
    raw = _compressors_json(tmp_path)
    out = tmp_path / "docs" / "compressors.json"
    assert report.main(["record", "compressors", str(raw), "--command", "python bench/x.py",
                        "--link", "none", "--date", "2026-01-02T03:04Z", "-o", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["machine"]["link"] == "none" and rec["source"] == "run"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\ntail\n")
    assert report.main(["render", str(out.parent), "--readme", str(readme)]) == 0
    page = (out.parent / "index.md").read_text()
    assert "| onebit | 1 | 1.00 | 0.50 | 0.25 | 0.75 |" in page
    assert "| fp16 | 1 | 16.00 | 0.90 | 0.80 | - |" in page
    assert (out.parent / "img" / "compressors.png").stat().st_size > 1000
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("tail\n")
    assert "0.50x / 0.75x" in text and "2026-01-02" in text and "`python bench/x.py`" in text
    # a page edited by hand no longer matches its JSON
    (out.parent / "index.md").write_text(page.replace("0.50", "0.99"))
    assert report.main(["render", str(out.parent), "--check"]) == 1


def test_bad_input_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="unknown kind 'speed'"):
        report.validate({"record": 1, "kind": "speed", "command": "c", "date": "d",
                         "machine": {}, "source": "run", "data": {}}, "x.json")
    with pytest.raises(ValueError, match="needs \\['results'\\]"):
        report.make_record("compressors", {"rows": []}, command="c", date="d", machine={})
    (tmp_path / "raw.json").write_text("{}")
    with pytest.raises(ValueError, match="bench/report.py record"):
        report.load_records(str(tmp_path))
    with pytest.raises(ValueError, match="no results markers"):
        report.splice_readme("no markers here", "| a |")
