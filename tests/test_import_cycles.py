"""The package's modules import each other without circles.

Every `import` / `from ... import` of a jaxrl_llm module counts, at module level or inside a
function (a lazy import that breaks a circle at run time still leaves the circle in the design).
Importing `a.b.c` also runs the package `__init__` files of `a` and `a.b`, so those are edges too.
A circle is reported as the strongly connected set of modules that form it."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxrl_llm"


def _module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _target(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The module `name` refers to (an attribute of a module counts as that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in targets:
                target = _target(name, modules) if name.startswith("jaxrl_llm") else None
                if target is None or target == module:
                    continue
                graph[module].add(target)
                parts = target.split(".")
                for k in range(1, len(parts)):  # the package __init__ files run first
                    parent = ".".join(parts[:k])
                    if parent != module and not module.startswith(parent + "."):
                        graph[module].add(parent)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    cycles.append(sorted(members))
    return cycles


def test_finder_sees_a_lazy_circle():
    graph = {"jaxrl_llm.a": {"jaxrl_llm.b"}, "jaxrl_llm.b": {"jaxrl_llm.a"}, "jaxrl_llm.c": {"jaxrl_llm.a"}}
    assert import_cycles(graph) == [["jaxrl_llm.a", "jaxrl_llm.b"]]
    assert import_cycles({"jaxrl_llm.a": {"jaxrl_llm.b"}, "jaxrl_llm.b": set()}) == []


def test_graph_counts_function_level_and_package_imports():
    graph = import_graph()
    # function-level: trainer/__init__ imports Trainer lazily (PEP 562 __getattr__)
    assert "jaxrl_llm.trainer.trainer" in graph["jaxrl_llm.trainer"]
    # importing jaxrl_llm.checkpoint.store from config runs jaxrl_llm/checkpoint/__init__.py
    assert "jaxrl_llm.checkpoint" in graph["jaxrl_llm.config.checks"]


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)
