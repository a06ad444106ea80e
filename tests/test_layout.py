"""The package's import graph has no circle (every import, function-level ones included; a
package importing its own submodules does not count)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "sot"


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its code."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root.name:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name and not d.startswith(name + ".")}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path, or ``None``."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for dep in sorted(graph[node]):
            found = visit(dep, path + [node])
            if found:
                return found
        done.add(node)
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return None


def test_no_import_circle() -> None:
    graph = import_graph(ROOT)
    assert {"sot.cli", "sot.cli.common", "sot.engine", "sot.policy.commit"} <= set(graph)
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_checker_finds_a_circle(tmp_path: Path) -> None:
    """Guard the guard: a two-module circle is reported, a package's own submodules are not."""
    fake = tmp_path / "sot"
    fake.mkdir()
    (fake / "__init__.py").write_text("from sot.a import x\n")
    (fake / "a.py").write_text("from sot.b import x\n")
    (fake / "b.py").write_text("def f():\n    from sot.a import y\n")
    assert find_circle(import_graph(fake)) == ["sot.a", "sot.b", "sot.a"]
    (fake / "b.py").write_text("y = 1\n")
    assert find_circle(import_graph(fake)) is None
