"""The package's layout: wings in a table (CONTRIBUTING.md), every module in exactly one, imports only to
its own wing or those below it, and no import cycle -- counting the imports made inside functions (a cycle
or an upward import there is one of responsibilities, whatever Python tolerates at import time)."""

import ast
import re
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


def wings() -> list[tuple[str, list[str]]]:
    """CONTRIBUTING.md's table, top to bottom: (wing, the module-name prefixes of its folders and files)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text[text.index("| wing | folder |"):].split("\n\n")[0].splitlines()[2:]
    out = []
    for row in table:
        wing, folders = [c.strip() for c in row.strip("|").split("|")][:2]
        out.append((wing, [p.removesuffix(".py").rstrip("/").replace("/", ".") for p in re.findall(r"`([^`]+)`", folders)]))
    return out


def wing_of(module: str, table: list[tuple[str, list[str]]]) -> str | None:
    found = [(len(p), w) for w, prefixes in table for p in prefixes if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else None


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


def test_every_module_is_in_one_wing_and_imports_only_its_own_or_those_below():
    graph, table = import_graph(), wings()
    order = [w for w, _ in table]
    assert order[0] == "dev" and order[-1] == "engine" and len(order) == 9
    homeless = sorted(m for m in graph if m != "irflow" and wing_of(m, table) is None)
    assert homeless == []
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() if m != "irflow" for d in deps
                    if d != "irflow" and order.index(wing_of(d, table)) < order.index(wing_of(m, table)))
    assert upward == []
    # the root holds the API and the CLI; everything else is in a wing
    assert sorted(p.stem for p in (ROOT / "irflow").glob("*.py") if p.stem != "__init__") == ["api", "cli"]


def test_an_upward_import_is_caught():
    table = [("top", ["irflow.top"]), ("bottom", ["irflow.bottom"])]
    assert wing_of("irflow.bottom.x", table) == "bottom" and wing_of("irflow.elsewhere", table) is None
    order = [w for w, _ in table]
    assert order.index(wing_of("irflow.top.a", table)) < order.index(wing_of("irflow.bottom.b", table))


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and graph["irflow.engine.runner"]  # the walk found the package and its imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_measured_figures_live_in_irflow_measured_not_in_code():
    """nDCG-like figures (four decimals) in code, comments or docstrings go stale when re-measured: they live
    in irflow/measured/*.json with their source, and the code that quotes them reads them."""
    figure = re.compile(r"\b0\.\d{4}\b")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "irflow").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if figure.search(line)]
    assert offenders == []
    assert figure.search("NFCorpus 0.3159 -> 0.3106") and not figure.search("momentum 0.999, lr 2e-5")
