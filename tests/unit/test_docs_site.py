"""The documentation site builds, its links resolve, and its API pages name what exists.

1. ``mkdocs build --strict`` passes (material theme, mkdocstrings); a
   ``::: module`` whose module is gone fails the build.
2. Every internal link of every page, and of the README (which mkdocs does
   not build), resolves to a file; every ``nav`` entry exists.
3. Every member an API page lists under ``members:`` was rendered: a name
   that no longer exists is dropped by mkdocstrings without a warning, so the
   built HTML is checked for its anchor.

Needs the ``docs`` extra (``pip install -e ".[docs]"``; ``./test.sh`` installs
it); without it the build tests skip naming that command, and CI's
``.ci/run`` builds the site itself.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


def _internal_links(page: Path):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # not in code
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


def broken_links(pages, docs=DOCS):
    """``page -> target`` for every relative link of ``pages`` whose file does not exist."""
    broken = []
    for page in pages:
        for target in _internal_links(page):
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.name} -> {target}")
    return broken


def test_internal_links_resolve():
    """Every relative link and image of the docs and the README points at a file."""
    pages = _pages()
    assert len(pages) > 20
    broken = broken_links(pages)
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_link(tmp_path):
    """The checker is not vacuous: a dead link and a dead image are found, a live one is not."""
    (tmp_path / "there.md").write_text("# there\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#x) [gone](no-such-page.md) ![pic](img/none.png)\n"
                    "```\n[in code](ignored.md)\n```\n[web](https://example.org/x.md)\n")
    assert broken_links([page], docs=tmp_path) == ["page.md -> no-such-page.md",
                                                   "page.md -> img/none.png"]


def test_nav_entries_exist():
    """Every page named in mkdocs.yml's nav exists."""
    nav = re.findall(r"^\s*- [^:]+:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert len(nav) > 20
    missing = [n for n in nav if not (DOCS / n).exists()]
    assert not missing, f"nav entries without a page: {missing}"


def _api_members():
    """(page, module, [members]) of every ``::: module`` in docs/api."""
    out = []
    for page in sorted((DOCS / "api").glob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"^::: (\S+)(?:\n((?:    .*\n?)*))?", text, re.M):
            members = re.search(r"members:\s*\[([^\]]*)\]", m.group(2) or "")
            names = [x.strip() for x in members.group(1).split(",")] if members else []
            out.append((page, m.group(1), names))
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason='needs the docs extra: pip install -e ".[docs]"')
    pytest.importorskip("mkdocstrings", reason='needs the docs extra: pip install -e ".[docs]"')
    out = tmp_path_factory.mktemp("site")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stdout}\n{res.stderr}"
    return out


def test_site_builds_strict(site):
    """The strict build passed (the fixture asserts it) and wrote every page."""
    assert (site / "index.html").exists()
    assert (site / "results" / "index.html").exists()


def test_api_pages_render_every_listed_name(site):
    """A module or member an API page lists must exist and be rendered."""
    cases = _api_members()
    assert {m for _, m, _ in cases} >= {"hipress_like.torch", "hipress_like.compressors",
                                        "hipress_like.cost_model", "hipress_like.tuning"}
    missing = []
    for page, module, names in cases:
        html = (site / "api" / page.stem / "index.html").read_text()
        for name in [None] + names:
            anchor = module if name is None else f"{module}.{name}"
            if f'id="{anchor}"' not in html:
                missing.append(f"{page.relative_to(ROOT)}: {anchor}")
    assert not missing, "API pages name what no longer exists:\n" + "\n".join(missing)
