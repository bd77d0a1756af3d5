"""The engine's layout: no import cycle among irflow's modules, counting the imports made inside functions
(a cycle there is a cycle of responsibilities, whatever Python tolerates at import time)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for p in (ROOT / "irflow").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = p
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("irflow"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {t for t in targets if t in mods and t != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and graph["irflow.stage"]  # the walk found the package and its imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
