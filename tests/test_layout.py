"""The import graph: eval never imports train, and no module imports one that (through others) imports it back."""

from __future__ import annotations

import ast

from conftest import ROOT

PACKAGES = ("train", "eval")


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, at any depth of its body (function-level imports count)."""
    graph = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    if node.module in PACKAGES:
                        deps.update(f"{node.module}.{alias.name}" for alias in node.names)
                    else:
                        deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps.update(alias.name for alias in node.names if alias.name.split(".")[0] in PACKAGES)
            graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node, path):
        for dep in sorted(graph.get(node, ())):
            if dep in path:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, path + [dep])
        done.add(node)

    for node in sorted(graph):
        visit(node, [node])
    return found


def test_eval_imports_nothing_from_train():
    graph = import_graph()
    assert len(graph) > 20  # both packages were read
    crossing = {module: sorted(d for d in deps if d.startswith("train")) for module, deps in graph.items()
                if module.startswith("eval")}
    assert {m: d for m, d in crossing.items() if d} == {}


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
