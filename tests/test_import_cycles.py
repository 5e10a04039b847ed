"""No import cycles among lowbit's modules, and no module imports another's private name.

Function-level imports count (a lazy import that closes a cycle is a cycle put off); imports under
`if TYPE_CHECKING:` do not (they never run). A cycle is found as a strongly connected component of
the module graph, and reported with every module in it.
"""
from __future__ import annotations

import ast
from pathlib import Path

from test_import_order import ROOT, imports, module_name, sources


def graph(paths: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports. `from . import sibling` also names the package, which
    Python is already loading when its submodule runs: edges to a module's own packages are left out."""
    names = {module_name(p): p for p in paths}
    return {me: {t for t in imports(p, me, at_run_time=True) if t in names and t != me and not me.startswith(t + ".")}
            for me, p in names.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def private_imports(path: Path) -> list[str]:
    """`from lowbit... import _name` in a file: another module's private name."""
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}"
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lowbit"))
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_the_cycle_search_finds_a_cycle_and_only_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(graph(sources()))
    assert found == [], "import cycles (break each by moving what both sides need into a third module):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_no_module_imports_another_modules_private_name():
    found = [hit for path in sources() for hit in private_imports(path)]
    assert found == [], "\n".join(found)
