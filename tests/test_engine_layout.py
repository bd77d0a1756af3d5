"""The package's layout: wings in a table (CONTRIBUTING.md), every module in exactly one, imports only to
its own wing or those below it, and no import cycle -- counting the imports made inside functions (a cycle
or an upward import there is one of responsibilities, whatever Python tolerates at import time)."""

import ast
import io
import re
import tokenize
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
            # a relative import would escape the walk (and the table): the package imports by full name
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{m}:{node.lineno}: a relative import"
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


# Figures in prose that are settings, not measurements: (file, figure) -> why it may stay
SETTINGS_IN_PROSE = {
    ("irflow/learn/moco.py", "0.999"): "MoCo's momentum as the paper sets it (train_student's default too)",
}


def prose(source: str) -> dict[int, str]:
    """line number -> the comment on it or the docstring line it is (module, class, function docstrings)."""
    lines = source.splitlines()
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.update((i, lines[i - 1]) for i in range(first.lineno, first.end_lineno + 1))
    return out


FIGURE = re.compile(r"\b0\.\d{4}\b")  # nDCG-like, anywhere: code, comments, docstrings
# in comments and docstrings also three decimals (0.995, 1.079) and percentages with a decimal (97.4%)
PROSE_FIGURE = re.compile(r"(?<![\d.])\d+\.\d{3}(?!\d|\.\d)|(?<![\d.])\d+\.\d+%")
# anywhere (a warning's or a description's string too): a speed-up or slow-down ("2x faster", "~1.4-2x slower")
SPEED_FIGURE = re.compile(r"(?<![\w.])~?\d[\d,.]*(?:-\d[\d.]*)?x (?:slower|faster)\b")


def measured_figures(rel: str, source: str) -> list[str]:
    """``file:line: figure`` for every measured-looking figure of a module, less its settings in prose."""
    comments_and_docstrings = prose(source)
    out = []
    for i, line in enumerate(source.splitlines(), 1):
        found = FIGURE.findall(line) + SPEED_FIGURE.findall(line) + PROSE_FIGURE.findall(
            comments_and_docstrings.get(i, ""))
        out += [f"{rel}:{i}: {f}" for f in found if (rel, f) not in SETTINGS_IN_PROSE]
    return out


def test_measured_figures_live_in_irflow_measured_not_in_code():
    """Measured figures in code, comments or docstrings go stale when re-measured: they live in
    irflow/measured/*.json with their source (the code that quotes them reads them), or in bench/results and
    the docs' results pages, which the prose names. nDCG-like figures (four decimals) and speed ratios ("25x
    slower") anywhere, strings too; in comments and docstrings also three decimals and percentages with a
    decimal. Settings in prose are listed above."""
    files = [p for p in sorted((ROOT / "irflow").rglob("*.py")) if "measured" not in p.relative_to(ROOT / "irflow").parts]
    offenders = [o for p in files for o in measured_figures(p.relative_to(ROOT).as_posix(), p.read_text())]
    assert offenders == []
    assert FIGURE.search("NFCorpus 0.3159 -> 0.3106") and not FIGURE.search("momentum 0.999, lr 2e-5")


def test_a_measured_figure_in_prose_is_caught_and_a_constant_is_not():
    source = ('"""BM25 scored 0.995 on it."""\n'
              'THRESHOLD = 0.995  # the source passage is top-1 for 97.4% of them\n'
              'def f():\n    """A setting, m = 0.999."""\n    return "lr 2e-5, version 3.8.8, 1.5x"\n'
              'WARN = "bf16 there: measured 25x slower; int8 ~1.4-2x faster"\n')
    assert measured_figures("x.py", source) == ["x.py:1: 0.995", "x.py:2: 97.4%", "x.py:4: 0.999",
                                                "x.py:6: 25x slower", "x.py:6: ~1.4-2x faster"]
    assert measured_figures("irflow/learn/moco.py", '"""m = 0.999 in the paper"""\n') == []
