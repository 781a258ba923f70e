"""No import circle in specdecode/: the module graph, built from the source with ast, is acyclic.

Every import counts, a function's own (a lazy import is still a dependency) and a package's
`__init__` too; `from specdecode.x import y` is an edge to specdecode.x.y when that is a module, else
to specdecode.x. The cycle finder is checked on a graph with a circle (the negative control)."""

from __future__ import annotations

import ast
from pathlib import Path

import specdecode

ROOT = Path(specdecode.__file__).parent


def module_graph(root: Path = ROOT, package: str = "specdecode") -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up `level - 1` steps
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # `import specdecode.engine.x` names its module
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith(package):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return path[path.index(succ):] + [succ]
            if succ not in state and (cycle := visit(succ)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_circle():
    graph = module_graph()
    assert "specdecode.engine.engine" in graph["specdecode.engine.decoder"]  # the scan sees imports
    assert "specdecode.engine.calibration" in graph["specdecode.bench.methods"]  # lazy ones too
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_a_circle_is_found(tmp_path):
    """The negative control: two modules that import each other (one of them lazily), and a package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    graph = module_graph(pkg, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    assert find_cycle({"x": {"y"}, "y": set()}) is None
