"""Every code block of the README and the getting-started page runs, as a reader would run it.

A reader copies the blocks of a page in order into a shell in the repository.
This test does the same in a scratch "reader folder": it links the
repository's top-level entries there (so ``examples/...``, ``scripts/...``,
``setup.py`` resolve as in a clone), and gives it a ``.venv`` of its own: a
fresh virtual environment that sees this interpreter's packages through a
``.pth`` file and has this checkout installed in it (``pip install -e .``,
what ``./run.sh`` and ``./test.sh`` do on first use), so the README's
``. .venv/bin/activate`` and console scripts (``hipress-profile``) work.

- A ``python`` block whose first line is ``# file: NAME`` is written to that
  file (a later shell block runs it, e.g. under torchrun); any other
  ``python`` block runs as a script.
- A ``bash`` block runs with ``bash -euo pipefail``, in the reader folder.

Blocks run in page order in one folder per page (a block may use what an
earlier one wrote, as ``plan`` uses ``profile``'s ``profile.json``). Blocks
that take minutes, and getting-started blocks that repeat what a default block
runs, are marked slow (``./test.sh --all`` runs them); the README's PyTorch
example and its 4-rank launch stay in the default suite.
The README's first block holds the two commands; run literally, ``./test.sh``
would run this suite inside itself, so that block runs as
``./run.sh --net none --epochs 1`` and ``./test.sh --collect-only -q``
(the same scripts and set-up; CI runs the full ``./test.sh`` itself).
"""
from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/getting-started.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
TIMEOUT = 900

# Blocks (by page and first line) that take minutes, or that repeat what a default block
# already runs: they run under -m slow.
SLOW = {
    ("README.md", "./run.sh      # 4 workers"),
    ("README.md", "hipress-profile profile --compressors onebit,terngrad,dgc,powersgd"),
    ("docs/getting-started.md", "torchrun --nproc_per_node 4 examples/pytorch_digits.py"),
    # the reader folder's own set-up installs the checkout with `pip install -e` in a fresh
    # venv, and the page's python block imports it there
    ("docs/getting-started.md", "pip install -e ."),
    # a 4-rank torchrun of a DistributedOptimizer script: README.md's
    # `torchrun --nproc_per_node 4 train.py` block runs one in the default suite
    ("docs/getting-started.md", "torchrun --nproc_per_node 4 first_job.py"),
    # the same command as README.md's `hipress-profile advise` block, which stays default
    ("docs/getting-started.md", "hipress-profile advise --profile paper --model vgg19"),
}
# The README's first block, run without recursing into this suite (see the docstring).
INSTEAD = {
    ("README.md", "./run.sh      # 4 workers"):
        "./run.sh --net none --epochs 1 --hidden 256\n./test.sh --collect-only -q\n",
}


def blocks(page: str) -> List[Tuple[int, str, str]]:
    """The fenced code blocks of ``page``: (line number, language, text), in page order."""
    text = (ROOT / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)))
    return out


def _first_line(code: str) -> str:
    return code.strip().splitlines()[0] if code.strip() else ""


def _is_slow(page: str, code: str) -> bool:
    return any(p == page and _first_line(code).startswith(k) for p, k in SLOW)


def _instead(page: str, code: str) -> str:
    for (p, k), v in INSTEAD.items():
        if p == page and _first_line(code).startswith(k):
            return v
    return code


def _cases() -> List:
    cases = []
    for page in PAGES:
        for line, lang, code in blocks(page):
            marks = [pytest.mark.slow] if _is_slow(page, code) else []
            cases.append(pytest.param(page, line, lang, code, marks=marks,
                                      id=f"{page}:{line}"))
    return cases


_FOLDERS: Dict[str, Path] = {}


def _reader_folder(page: str, tmp_root: Path) -> Path:
    """One reader folder per page: the repository's entries linked, and its own ``.venv``."""
    if page in _FOLDERS:
        return _FOLDERS[page]
    d = tmp_root / re.sub(r"\W", "_", page)
    d.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in (".git", ".venv", "results", "site") or entry.name.startswith(".venv-"):
            continue
        (d / entry.name).symlink_to(entry)
    venv = d / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    vpy = venv / "bin" / "python"
    purelib = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True,
                             timeout=60).stdout.strip()
    # this interpreter's packages (torch, ...) are visible; its own hipress_like is shadowed
    # by PYTHONPATH, which points at this checkout
    paths = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    Path(purelib, "_reader_deps.pth").write_text("\n".join(paths) + "\n")
    subprocess.run([str(vpy), "-m", "pip", "install", "-q", "--no-deps",
                    "-e", str(d)], check=True, timeout=600, cwd=d)
    _FOLDERS[page] = d
    return d


def _env(folder: Path) -> Dict[str, str]:
    env = dict(os.environ)
    # the reader's .venv first; then this interpreter's bin for the dependencies' own
    # console scripts (torchrun), which a .pth file cannot bring into the reader's .venv
    env["PATH"] = os.pathsep.join([str(folder / ".venv" / "bin"), str(Path(sys.executable).parent),
                                   env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(folder / ".venv")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONHOME", None)
    return env


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    d = tmp_path_factory.mktemp("reader")
    yield d
    _FOLDERS.clear()
    shutil.rmtree(d, ignore_errors=True)


def test_pages_have_code_blocks():
    """The pages this file runs hold the blocks a newcomer needs (a guard on the regex)."""
    readme = blocks("README.md")
    assert readme[0][2].startswith("./run.sh") and "./test.sh" in readme[0][2]
    assert any(code.startswith("# file: train.py") for _, _, code in readme)
    assert any("torchrun --nproc_per_node 4 train.py" in code for _, _, code in readme)
    assert len(blocks("docs/getting-started.md")) >= 4


@pytest.mark.parametrize("page,line,lang,code", _cases())
def test_block_runs(page, line, lang, code, tmp_root):
    """Run one block in its page's reader folder; it must exit 0."""
    folder = _reader_folder(page, tmp_root)
    env = _env(folder)
    first = _first_line(code)
    if lang == "python" and first.startswith("# file:"):
        name = first.split(":", 1)[1].split()[0]
        (folder / name).write_text(code)
        # a saved script must at least compile; the shell block that launches it runs it
        compile(code, name, "exec")
        return
    if lang == "python":
        cmd = [str(folder / ".venv" / "bin" / "python"), "-c", code]
    elif lang in ("bash", "sh", "shell"):
        cmd = ["bash", "-euo", "pipefail", "-c", _instead(page, code)]
    else:
        pytest.fail(f"{page}:{line}: a code block in language {lang!r}; expected python or "
                    "bash (a block this test cannot run would go unchecked)")
    res = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert res.returncode == 0, (
        f"{page}:{line}: the block exited {res.returncode}\n--- block\n{code}"
        f"--- stdout (tail)\n{res.stdout[-3000:]}\n--- stderr (tail)\n{res.stderr[-3000:]}")
