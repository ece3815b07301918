"""No import circles in kvctl, and the packages' layers (ARCHITECTURE.md: imports point down; "No import circle,
not even inside a function: move the shared types down"). Read from the sources with ``ast``: every import, at
the top or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvctl": ROOT / "kvctl", "kvctl.connector": ROOT / "connector", "kvctl.plugins": ROOT / "plugins"}
#: circles still being untangled, each with its issue; a new one fails, and so does one of these once gone
PENDING: set[frozenset[str]] = set()  # loading <-> loading_vllm ended: SourceState moved to kvctl/loading/types.py


def modules() -> dict[str, Path]:
    out = {}
    for pkg, base in PACKAGES.items():
        for p in base.rglob("*.py"):
            rel = p.relative_to(base).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            out[".".join([pkg, *parts])] = p
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The kvctl modules ``path`` imports, anywhere in it (``from pkg import mod`` counts as ``pkg.mod``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return found & known


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: set[frozenset[str]] = set()
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.add(frozenset(comp))
    return out


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert circles({"a": {"b"}, "b": set()}) == set()


def test_no_import_circles():
    mods = modules()
    graph = {m: imports(p, set(mods)) - {m} for m, p in mods.items()}
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}  # a package's own __init__
    found = circles(graph)
    assert found - PENDING == set(), f"import circles: {[sorted(c) for c in found - PENDING]}"
    assert PENDING - found == set(), f"gone (take them off PENDING): {[sorted(c) for c in PENDING - found]}"




# --- the packages' layers (ARCHITECTURE.md): a package imports only packages of lower layers

#: package -> its layer; kvctl's loose modules count as packages of their own name
LAYERS = {
    "core": 0, "hooks": 0,
    "connector": 1,
    "tier": 2, "plugins": 2, "records": 2,
    "bench": 3, "diagnose": 3,
    "replay": 4,
    "loading": 5, "lab": 5,
    "ops": 6,
    "sim": 7, "drill": 7,
    "views": 8,
    "commands": 9,
    "cli": 10,
}


def package_of(module: str) -> str:
    """The layer-holding package of a kvctl module: connector, plugins, or kvctl's first level (``kvctl.sim.plan`` -> sim)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_edges(mods: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> the modules that make the edge, for every import between two packages."""
    edges: dict[tuple[str, str], list[str]] = {}
    for m, path in mods.items():
        src = package_of(m)
        for dep in imports(path, set(mods)):
            dst = package_of(dep)
            if dst != src and dep != "kvctl":
                edges.setdefault((src, dst), []).append(f"{m} -> {dep}")
    return edges


def upward(edges: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    """The edges that do not point down a layer (or touch a package LAYERS does not place)."""
    return {e: why for e, why in edges.items()
            if e[0] not in LAYERS or e[1] not in LAYERS or LAYERS[e[1]] >= LAYERS[e[0]]}


def test_every_package_has_a_layer():
    mods = modules()
    assert {package_of(m) for m in mods} - {"kvctl"} <= set(LAYERS), sorted({package_of(m) for m in mods} - set(LAYERS))


def test_imports_point_down_the_layers():
    bad = upward(package_edges(modules()))
    assert not bad, f"imports that do not point down (ARCHITECTURE.md): {bad}"
    graph: dict[str, set[str]] = {}
    for a, b in package_edges(modules()):
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    assert circles(graph) == set()


def test_a_planted_upward_import_is_caught(tmp_path):
    """The check can fail: a core module importing a command, and a sim module importing the views."""
    core = tmp_path / "core_mod.py"
    core.write_text("def f():\n    from kvctl.commands import plan\n")
    sim = tmp_path / "sim_mod.py"
    sim.write_text("from kvctl.views import sim\n")
    mods = {**modules(), "kvctl.core.planted": core, "kvctl.sim.planted": sim}
    bad = upward(package_edges(mods))
    assert ("core", "commands") in bad and ("sim", "views") in bad
    assert any("kvctl.core.planted" in why for why in bad[("core", "commands")])


# --- a test module imports helpers from helper modules and fixtures from conftest.py, never from another test module

TESTS = ROOT / "tests"


def _absolute(module: str | None, level: int, package: str) -> str:
    """The dotted name an import statement in ``package`` refers to (``from ..x import y`` resolved)."""
    if not level:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of_test_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import, anywhere in ``tree``, of a module named ``test_*`` (or of a name inside one)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            names = [base] + [f"{base}.{a.name}" for a in node.names if a.name.startswith("test_")]  # from pkg import test_x
        else:
            continue
        found += [(node.lineno, n) for n in names if any(part.startswith("test_") for part in n.split("."))]
    return found


def test_the_scan_finds_every_form_of_importing_a_test_module():
    src = ("import tests.a.test_b\nfrom tests.a.test_b import x\nfrom tests.a import test_b\nfrom .test_b import x\n"
           "from . import test_b\nfrom tests.a.helpers import x\nfrom .helpers import x\nimport pytest_timeout\n"
           "def f():\n    from tests.test_c import y\n")
    found = imports_of_test_modules(ast.parse(src), "tests.a")
    assert [line for line, _ in found] == [1, 2, 3, 4, 5, 10]
    assert dict(found)[4] == "tests.a.test_b" and dict(found)[5] == "tests.a.test_b"


def test_no_test_module_imports_from_another():
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = ".".join(rel.parent.parts)
        if hits := imports_of_test_modules(ast.parse(path.read_text(), str(path)), package):
            found[str(rel)] = hits
    assert not found, f"imports from test modules (move shared helpers to a helper module, fixtures to a conftest.py): {found}"


MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines():
    """ARCHITECTURE.md: a module that grows past 500 lines is split by what its parts do."""
    long = {m: n for m, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


# --- a module's underscore names are its own (STYLE.md, "Split by concept"): another module that needs one means the
# concept wants a public name, or the two modules are one


def private_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every ``from X import _name`` (dunders aside), anywhere in ``tree``."""
    return [(node.lineno, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_the_private_import_scan_can_fail():
    src = "from .a import _x, y\ndef f():\n    from kvctl.b import _Z as z\nfrom c import __version__\n"
    assert private_imports(ast.parse(src)) == [(1, "_x"), (3, "_Z")]


def test_no_module_imports_another_modules_private_name():
    found = {m: hits for m, path in modules().items() if (hits := private_imports(ast.parse(path.read_text())))}
    assert not found, f"imports of another module's _name (give the concept a public name): {found}"
