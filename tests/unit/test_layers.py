"""Imports run one way, and no module imports another that imports it back.

The layers, lowest first (DESIGN.md): errors, _compat and heap (the one error
base, the old module names' finder and the collector's settling, which import
nothing of the project) <
compressors < cost_model < casync < partial (partial aggregation) < launch
and tuning (one floor: neither is below the other) < adapters < the faces
(hipress_like/torch.py, demo/, and the faces to come). The test reads every
module's source with ``ast`` (nothing is imported), resolves relative
imports, counts imports inside functions too (a lazy import is still a
dependency), and skips ``if TYPE_CHECKING:`` blocks (they never run).
"""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "hipress_like"
LAYERS = [{"errors", "_compat", "heap"}, {"compressors"}, {"cost_model"}, {"casync"}, {"partial"},
          {"launch", "tuning"}, {"adapters"}]  # then the faces


def _module_name(path: pathlib.Path, pkg: pathlib.Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path, pkg: pathlib.Path = PKG):
    """(imported module, line) for every import in the file, TYPE_CHECKING blocks aside."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_name(path, pkg)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return [(m, ln) for m, ln in out if m.split(".")[0] == "hipress_like"]


def _graph(pkg: pathlib.Path = PKG):
    files = {_module_name(p, pkg): p for p in pkg.rglob("*.py")}
    edges = {}
    for mod, path in files.items():
        deps = {}
        for target, line in _imports(path, pkg):
            while target not in files and "." in target:
                target = target.rsplit(".", 1)[0]  # a name imported from a module
            if target in files and target != mod:
                deps.setdefault(target, line)
        edges[mod] = deps
    return files, edges


def _layer(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:
        return -1  # hipress_like/__init__.py re-exports
    return next((i for i, floor in enumerate(LAYERS) if parts[1] in floor), len(LAYERS))


def upward_imports(pkg: pathlib.Path = PKG):
    """Every import from a lower layer to a higher one, as "file:line imports module"."""
    files, edges = _graph(pkg)
    return [f"{files[m].relative_to(pkg.parent)}:{line} imports {t} "
            f"({t.split('.')[1]} is above {m.split('.')[1]})"
            for m, deps in edges.items() for t, line in deps.items()
            if _layer(m) >= 0 and _layer(t) > _layer(m)]


def import_cycles(pkg: pathlib.Path = PKG):
    """Every import cycle found by a depth-first walk, as "a (file:line) -> b ..."."""
    files, edges = _graph(pkg)
    # an __init__ importing its own submodules is the package's index, not a cycle
    edges = {m: {t: ln for t, ln in d.items() if not t.startswith(m + ".")}
             for m, d in edges.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in edges.get(m, {}):
            if state.get(t) == 1:
                cyc = stack[stack.index(t):] + [t]
                cycles.append(" -> ".join(f"{a} ({files[a].name}:{edges[a][b]})"
                                          for a, b in zip(cyc, cyc[1:])) + f" -> {t}")
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles


def test_no_module_imports_a_higher_layer():
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_a_lazy_circle_through_layers(tmp_path):
    """The checks can fail: the circle this package had (engine -> auto planner ->
    profiler -> engine, the last two inside functions), rebuilt in a scratch tree."""
    pkg = tmp_path / "hipress_like"
    for d in ("", "casync", "cost_model"):
        (pkg / d).mkdir(exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "casync" / "engine.py").write_text(
        "def register():\n    from ..cost_model.auto import AutoPlanner\n")
    (pkg / "cost_model" / "auto.py").write_text("from .profiler import profile\n")
    (pkg / "cost_model" / "profiler.py").write_text(
        "def profile():\n    from ..casync.engine import Engine\n")
    assert any("hipress_like/cost_model/profiler.py:2 imports hipress_like.casync.engine" in u
               for u in upward_imports(pkg))
    cyc = import_cycles(pkg)
    assert len(cyc) == 1 and "engine.py:2" in cyc[0] and "profiler.py:2" in cyc[0], cyc


def test_the_launcher_sits_above_the_scheduler():
    """casync never imports launch (the launcher moved out of the scheduler, issue 44)."""
    _, edges = _graph()
    bad = [f"{m} imports {t}" for m, deps in edges.items() for t in deps
           if m.startswith("hipress_like.casync") and t.startswith("hipress_like.launch")]
    assert not bad, bad
    assert _layer("hipress_like.launch.netem") == _layer("hipress_like.tuning.profiler")
    assert _layer("hipress_like.casync.engine") < _layer("hipress_like.launch.launch")


def test_no_face_imports_another_face():
    """The TensorFlow and MXNet adapters use the framework-neutral collectives
    (adapters/collectives.py, objects.py, ordering.py), never adapters/torch."""
    files, edges = _graph()
    bad = [f"{files[m].relative_to(PKG.parent)}:{line} imports {t}"
           for m, deps in edges.items() for t, line in deps.items()
           if m.startswith(("hipress_like.adapters.tensorflow", "hipress_like.adapters.mxnet"))
           and (t == "hipress_like.adapters.torch" or t.startswith("hipress_like.adapters.torch."))]
    assert not bad, "a face imports the torch face:\n" + "\n".join(bad)


def test_partial_aggregation_sits_above_the_scheduler_and_talks_through_the_transport():
    """``hipress_like.partial`` is a floor of its own above casync (issue 44), and its
    store goes through the transport (``Transport.store``): it imports no
    torch.distributed, and no casync module imports it."""
    assert _layer("hipress_like.casync.engine") < _layer("hipress_like.partial.lane")
    assert _layer("hipress_like.partial.lane") < _layer("hipress_like.adapters.runtime")
    _, edges = _graph()
    assert not [f"{m} imports {t}" for m, deps in edges.items() for t in deps
                if m.startswith("hipress_like.casync") and t.startswith("hipress_like.partial")]
    files = sorted((PKG / "partial").rglob("*.py"))
    assert files
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names
                    if n == "torch.distributed" or n.startswith("torch.distributed.")]
    assert not bad, bad
