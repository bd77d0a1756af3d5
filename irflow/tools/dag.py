"""A run's graph as data, and as a picture: stages, the datasets between them, and each model's lineage.

    g = run_graph(catalog, run_id)         # what a finished run did (the catalog's stage_runs)
    g = planned_graph(api.status(...))     # what a run of a config would do (cached / stale, and why)
    svg = to_svg(g)                        # a plain SVG, no dependency; to_svg(g, engine="dot") uses Graphviz
    title, html = dag_section(catalog, run_id)   # inline SVG + model lineage, for a report page

Nodes: one per stage call (its label, ``bm25_search[flat]``; a label called twice in a run is one node,
with its first status) and one per dataset id. Edges go dataset -> stage (the input's role) and
stage -> dataset (the output's name). A dataset no stage of the graph made (a BEIR source, a model
named in the config, an output of an earlier run that this one only read) is a node without a producer.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from irflow.engine.cache import canonical
from irflow.engine.errors import UserError

STATUSES = ("computed", "cached", "stale", "failed", "skipped")
PENDING = "pending"  # kind of a dataset that does not exist yet (a stale or skipped stage's output)


@dataclass(frozen=True)
class StageNode:
    key: str  # "stage:<label>"
    label: str
    status: str  # one of STATUSES
    seconds: float | None = None
    why: tuple[str, ...] = ()  # a stale stage's reasons


@dataclass(frozen=True)
class DatasetNode:
    key: str  # the dataset id, or `<stage:output>` for one not computed
    name: str
    kind: str  # table | model | index | source | pending
    contract: str | None = None
    # models: {stage, run_id, base_model, training_data, params_digest}, or {external, config_key}
    lineage: dict | None = None

    @property
    def short(self) -> str:
        return short_id(self.key)


@dataclass
class Graph:
    title: str
    stages: list[StageNode] = field(default_factory=list)
    datasets: list[DatasetNode] = field(default_factory=list)
    edges: list[tuple[str, str, str]] = field(default_factory=list)  # (from key, to key, role or output)

    def stage(self, label: str) -> StageNode:
        return next(s for s in self.stages if s.label == label)

    def models(self) -> list[DatasetNode]:
        return [d for d in self.datasets if d.kind == "model"]


def short_id(dataset_id: str) -> str:
    """``corpus-3f2a91b2c4d5e6f7`` -> ``corpus-3f2a91b2``; other ids cut at 28 characters."""
    m = re.fullmatch(r"(.*-)([0-9a-f]{16})", dataset_id)
    if m:
        return m.group(1) + m.group(2)[:8]
    return dataset_id if len(dataset_id) <= 28 else dataset_id[:27] + "…"


def params_digest(params: dict | str | None) -> str | None:
    """12 hex of the sha256 of a stage's keyed params (canonical JSON): equal digests, equal params."""
    if params is None:
        return None
    value = json.loads(params) if isinstance(params, str) else params
    return hashlib.sha256(canonical(value).encode()).hexdigest()[:12]


def _lineage(base: list[str], data: list[str], **more) -> dict:
    return {"base_model": base, "training_data": data, **more}


def _split_roles(parents: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(base model ids, 'role: id' of everything else a training stage read)."""
    base = [p for role, p in parents if role == "base_model"]
    data = [f"{role}: {p}" for role, p in parents if role != "base_model"]
    return base, data


def model_lineage(catalog, dataset_id: str) -> dict | None:
    """Where a model came from, by the catalog: the stage, run, base model, training data and params
    digest of a trained one; the name and config key of one named in a config."""
    info = catalog.dataset(dataset_id)
    if info is None:
        return None
    if info["stage"] == "external":
        p = json.loads(info["params"] or "{}")
        return {"external": p.get("name", info["name"]), "config_key": p.get("config_key")}
    base, data = _split_roles(catalog.parents(dataset_id))
    return _lineage(base, data, stage=info["stage"], run_id=info["run_id"], params_digest=params_digest(info["params"]))


# ---- graphs ---------------------------------------------------------------------------------------
class _Builder:
    """Stage and dataset nodes added once each, in the order met; edges once each."""

    def __init__(self, title: str):
        self.graph = Graph(title)
        self._stages: set[str] = set()

    def stage(self, label: str, status: str, seconds=None, why=(), inputs=None, outputs=None) -> None:
        if label in self._stages:  # a repeated call of a label (a cache hit the second time): the first stands
            return
        self._stages.add(label)
        key = f"stage:{label}"
        self.graph.stages.append(StageNode(key, label, status, seconds, tuple(why)))
        for role, ids in (inputs or {}).items():
            for i in ids:
                self._edge(i, key, role)
        for name, i in (outputs or {}).items():
            self._edge(key, i, name)

    def _edge(self, a: str, b: str, role: str) -> None:
        if (a, b, role) not in self.graph.edges:
            self.graph.edges.append((a, b, role))

    def dataset_ids(self) -> list[str]:
        ids = [e for a, b, _ in self.graph.edges for e in (a, b) if not e.startswith("stage:")]
        return list(dict.fromkeys(ids))

    def dataset(self, node: DatasetNode) -> None:
        self.graph.datasets.append(node)


def _pending(dataset_id: str) -> DatasetNode:
    name = dataset_id.strip("<>").rsplit(":", 1)[-1]
    return DatasetNode(dataset_id, name, PENDING)


def run_graph(catalog, run_id: str) -> Graph:
    """The graph of a run from the catalog: its stage_runs (computed / cached, seconds), the stage that
    failed, the stages ``--to`` left out (skipped), the datasets they read and wrote, the models' lineage."""
    info = catalog.run(run_id) or {}  # stages run without a recipe (Stage.run) have no runs row
    stages = catalog.stage_runs(run_id, with_inputs=True)
    if not info and not stages:
        raise UserError(f"no run '{run_id}' in {catalog.path}")
    b = _Builder(f"run {run_id}" + (f" ({info['flow']}, {info['status']})" if info else ""))
    for s in stages:
        b.stage(s["name"], s["status"], s["seconds"], inputs=s["inputs"], outputs=s["outputs"])
    if info.get("failed_stage"):
        f = info["failed_stage"]
        b.stage(f["name"], "failed", f["seconds"], inputs=f["inputs"])
    for s in info.get("skipped") or []:
        b.stage(s["name"], "skipped", inputs=s["inputs"], outputs=s["outputs"])
    for did in b.dataset_ids():
        d = catalog.dataset(did)
        if d is None:
            b.dataset(_pending(did))
            continue
        lineage = model_lineage(catalog, did) if d["kind"] == "model" else None
        b.dataset(DatasetNode(did, d["name"], d["kind"], d["contract"], lineage))
    return b.graph


def planned_graph(plan, catalog=None, title: str = "plan") -> Graph:
    """The graph of what a run would do: ``plan`` is ``api.status(...)`` (or the dry run's entries).
    Stages are cached, stale (with why) or skipped; a model not trained yet gets its lineage from the
    stage that would train it; with a ``catalog``, a stored model gets its recorded lineage."""
    steps = [p if isinstance(p, dict) else vars(p) for p in plan]
    b = _Builder(title)
    described: dict[str, dict] = {}
    made_by: dict[str, dict] = {}
    for p in steps:
        b.stage(p["name"], p["status"], why=p["why"] if p["status"] == "stale" else (), inputs=p["inputs"],
                outputs=p["outputs"])
        described.update(p.get("datasets") or {})
        made_by.update({i: p for i in p["outputs"].values()})
    for did in b.dataset_ids():
        d = described.get(did) or {"name": did, "kind": "table", "contract": None}
        kind = d["kind"]
        lineage = None
        if did.startswith("<"):
            kind = PENDING
            producer = made_by.get(did)
            if producer and "base_model" in producer["inputs"]:  # a model this plan would train
                base, data = _split_roles([(r, i) for r, ids in producer["inputs"].items() for i in ids])
                lineage = _lineage(base, data, stage=producer["name"], run_id=None, params_digest=None)
        elif kind == "model" and catalog is not None:
            lineage = model_lineage(catalog, did)
        b.dataset(DatasetNode(did, d["name"], kind, d.get("contract"), lineage))
    return b.graph


# ---- drawing --------------------------------------------------------------------------------------
FILL = {"computed": "#b7e1b0", "cached": "#cfe0f3", "stale": "#ffd59a", "failed": "#f4a7a3", "skipped": "#eeeeee"}
CHAR_W, LINE_H, PAD, COL_GAP, ROW_GAP, ELLIPSE_RIM = 6.7, 14, 8, 46, 14, 6  # px; CHAR_W: 11px monospace
FONT = 'font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" font-size="11"'


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def stage_lines(s: StageNode) -> list[str]:
    """What a stage's box says: its label, then its status (time, or the first reason it is stale; all
    of them are in its tooltip)."""
    if s.status in ("computed", "failed") and s.seconds is not None:
        second = f"{s.status} {s.seconds:.1f} s"
    elif s.status == "stale":
        reason = s.why[0] if s.why else "would compute"
        second = "stale: " + ("upstream" if reason.startswith("upstream is stale") else _clip(reason, 40))
    elif s.status == "skipped":
        second = "not run (--to)"
    else:
        second = s.status
    return [s.label, second]


def dataset_lines(d: DatasetNode) -> list[str]:
    """A stored dataset by its short id; one not computed yet by its output name; a source or a model
    named in the config by its name (a path keeps its end)."""
    if d.kind == PENDING:
        return [d.name, "not computed yet"]
    if re.fullmatch(r".*-[0-9a-f]{16}", d.key):
        return [d.short, d.contract or d.kind]
    name = d.name if len(d.name) <= 28 else "…" + d.name[-27:]
    return [name, d.kind]


def _depths(g: Graph) -> dict[str, int]:
    """Column of each node: longest path from a node without inputs; a node without a producer
    sits just left of its first consumer (so a model named in the config is drawn where it is read)."""
    preds: dict[str, list[str]] = {}
    succs: dict[str, list[str]] = {}
    for a, b, _ in g.edges:
        preds.setdefault(b, []).append(a)
        succs.setdefault(a, []).append(b)
    keys = [s.key for s in g.stages] + [d.key for d in g.datasets]
    depth: dict[str, int] = {}

    def visit(k: str, trail: frozenset = frozenset()) -> int:
        if k not in depth:
            ps = [p for p in preds.get(k, []) if p not in trail]  # a cycle cannot happen; never loop on one
            depth[k] = 1 + max((visit(p, trail | {k}) for p in ps), default=-1)
        return depth[k]

    for k in keys:
        visit(k)
    for k in keys:
        if not preds.get(k) and succs.get(k):
            depth[k] = max(0, min(depth[c] for c in succs[k]) - 1)
    return depth


def layout(g: Graph, direction: str = "LR") -> dict[str, tuple[float, float, float, float]]:
    """Node key -> (x, y, width, height): layers by depth, left to right (``LR``) or top to bottom
    (``TB``: what a page that scrolls down reads best when the graph is wide); in a layer, nodes ordered
    by the mean place of what feeds them (fewer crossings)."""
    if direction not in ("LR", "TB"):
        raise UserError(f"unknown graph direction '{direction}'; use LR or TB")
    depth = _depths(g)
    lines = {s.key: stage_lines(s) for s in g.stages} | {d.key: dataset_lines(d) for d in g.datasets}
    preds: dict[str, list[str]] = {}
    for a, b, _ in g.edges:
        preds.setdefault(b, []).append(a)
    layers: dict[int, list[str]] = {}
    for k in lines:
        layers.setdefault(depth[k], []).append(k)
    place: dict[str, float] = {}
    for c in sorted(layers):
        order = {k: i for i, k in enumerate(layers[c])}
        layers[c].sort(key=lambda k: (sum(place[p] for p in preds.get(k, []) if p in place)
                                      / max(1, sum(p in place for p in preds.get(k, [])))
                                      if any(p in place for p in preds.get(k, [])) else order[k], order[k]))
        place.update({k: i for i, k in enumerate(layers[c])})
    size = {k: (max(len(t) for t in ls) * CHAR_W + 2 * PAD, len(ls) * LINE_H + 2 * PAD - 2) for k, ls in lines.items()}
    # along: the axis a layer's nodes are spread on (y for LR, x for TB); across: the layers' axis
    along, across = (1, 0) if direction == "LR" else (0, 1)
    gap_along = ROW_GAP if direction == "LR" else COL_GAP / 2 + 2 * ELLIPSE_RIM
    gap_across = COL_GAP if direction == "LR" else COL_GAP / 2 + ROW_GAP
    spans = {c: sum(size[k][along] + gap_along for k in ks) - gap_along for c, ks in layers.items()}
    longest = max(spans.values(), default=0)
    boxes, at = {}, 0.0
    for c in sorted(layers):
        thick = max(size[k][across] for k in layers[c])
        pos = (longest - spans[c]) / 2
        for k in layers[c]:
            w, h = size[k]
            if direction == "LR":
                boxes[k] = (at + (thick - w) / 2, pos, w, h)
            else:
                boxes[k] = (pos, at + (thick - h) / 2, w, h)
            pos += size[k][along] + gap_along
        at += thick + gap_across
    return boxes


def _text(x: float, y: float, lines: list[str], bold_first: bool) -> str:
    out = []
    for i, t in enumerate(lines):
        weight = ' font-weight="bold"' if bold_first and i == 0 else ""
        out.append(f'<text x="{x:.1f}" y="{y + (i + 1) * LINE_H - 3:.1f}" text-anchor="middle"{weight}>'
                   f"{html.escape(t)}</text>")
    return "".join(out)


def stage_tooltip(s: StageNode) -> str:
    head = f"{s.label}: {s.status}" + (f", {s.seconds:.2f} s" if s.seconds is not None else "")
    return "\n".join([head, *s.why])


def dataset_tooltip(d: DatasetNode) -> str:
    out = [d.key, d.contract or d.kind]
    lin = d.lineage or {}
    if "external" in lin:
        out.append(f"named in the config: {lin['external']} ({lin.get('config_key')})")
    elif lin:
        out.append(f"trained by {lin['stage']}" + (f" in run {lin['run_id']}" if lin.get("run_id") else ""))
        out += [f"base model: {b}" for b in lin["base_model"]] + [f"data {t}" for t in lin["training_data"]]
        if lin.get("params_digest"):
            out.append(f"params digest: {lin['params_digest']}")
    return "\n".join(out)


def _legend(y: float) -> tuple[str, float]:
    parts, x = [], 0.0
    for status in STATUSES:
        parts.append(f'<rect x="{x}" y="{y}" width="14" height="12" rx="2" fill="{FILL[status]}" stroke="#555"/>'
                     f'<text x="{x + 19}" y="{y + 10}">{status}</text>')
        x += 19 + len(status) * CHAR_W + 16
    parts.append(f'<ellipse cx="{x + 10}" cy="{y + 6}" rx="10" ry="6" fill="#fff" stroke="#555"/>'
                 f'<text x="{x + 25}" y="{y + 10}">dataset</text>')
    x += 25 + 7 * CHAR_W + 16
    parts.append(f'<ellipse cx="{x + 10}" cy="{y + 6}" rx="10" ry="6" fill="#fff5d6" stroke="#8a6d00"/>'
                 f'<text x="{x + 25}" y="{y + 10}">model</text>')
    return "".join(parts), x + 25 + 5 * CHAR_W


def to_svg(g: Graph, engine: str = "plain", direction: str = "LR") -> str:
    """The graph as a standalone SVG document. ``plain``: the layout above, no dependency; ``dot``:
    Graphviz's layout (its ``dot`` must be on PATH). ``direction``: LR (left to right) or TB."""
    if engine == "dot":
        return _dot_svg(g, direction)
    if engine != "plain":
        raise UserError(f"unknown graph engine '{engine}'; use plain or dot")
    boxes = layout(g, direction)
    top = 52  # title and legend above the graph
    legend, legend_w = _legend(26)
    width = max([x + w for x, _, w, _ in boxes.values()] + [legend_w]) + 20
    height = max([y + h for _, y, _, h in boxes.values()] + [0]) + top + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="-10 -10 {width:.0f} {height:.0f}" {FONT}>',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#666"/></marker></defs>',
           f'<text x="0" y="12" font-size="13" font-weight="bold">{html.escape(g.title)}</text>',
           f'<g class="legend">{legend}</g>', f'<g transform="translate(0,{top})">']
    rim = {d.key: ELLIPSE_RIM for d in g.datasets}  # an ellipse reaches past its text box
    for a, b, role in g.edges:
        (ax, ay, aw, ah), (bx, by, bw, bh) = boxes[a], boxes[b]
        if direction == "LR":  # from the right of a to the left of b
            x1, y1, x2, y2 = ax + aw + rim.get(a, 0), ay + ah / 2, bx - rim.get(b, 0), by + bh / 2
            mid = (x1 + x2) / 2
            curve = f"M{x1:.1f},{y1:.1f} C{mid:.1f},{y1:.1f} {mid:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"
        else:  # from the bottom of a to the top of b
            x1, y1, x2, y2 = ax + aw / 2, ay + ah, bx + bw / 2, by
            mid = (y1 + y2) / 2
            curve = f"M{x1:.1f},{y1:.1f} C{x1:.1f},{mid:.1f} {x2:.1f},{mid:.1f} {x2:.1f},{y2:.1f}"
        out.append(f'<path class="edge" d="{curve}" '
                   f'fill="none" stroke="#888" marker-end="url(#arrow)"><title>{html.escape(role)}</title></path>')
    for s in g.stages:
        x, y, w, h = boxes[s.key]
        dash = ' stroke-dasharray="4 3"' if s.status == "skipped" else ""
        out.append(f'<g class="stage {s.status}" data-label="{html.escape(s.label)}" data-status="{s.status}">'
                   f"<title>{html.escape(stage_tooltip(s))}</title>"
                   f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" fill="{FILL[s.status]}" '
                   f'stroke="#444"{dash}/>{_text(x + w / 2, y + PAD - 1, stage_lines(s), True)}</g>')
    for d in g.datasets:
        x, y, w, h = boxes[d.key]
        fill, stroke = ("#fff5d6", "#8a6d00") if d.lineage is not None or d.kind == "model" else ("#ffffff", "#777")
        dash = ' stroke-dasharray="3 3"' if d.kind == PENDING else ""
        out.append(f'<g class="dataset {d.kind}" data-id="{html.escape(d.key)}">'
                   f"<title>{html.escape(dataset_tooltip(d))}</title>"
                   f'<ellipse cx="{x + w / 2:.1f}" cy="{y + h / 2:.1f}" rx="{w / 2 + ELLIPSE_RIM:.1f}" ry="{h / 2:.1f}" '
                   f'fill="{fill}" stroke="{stroke}"{dash}/>'
                   f"{_text(x + w / 2, y + PAD - 1, dataset_lines(d), False)}</g>")
    out.append("</g></svg>")
    return "\n".join(out)


# ---- Graphviz -------------------------------------------------------------------------------------
def _dot_id(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(g: Graph, direction: str = "LR") -> str:
    """The graph in Graphviz's DOT language (same colours and texts as the plain SVG)."""
    out = ["digraph irflow {", f"rankdir={direction};", f"label={_dot_id(g.title)}; labelloc=t;",
           'node [fontname="monospace", fontsize=10];']
    for s in g.stages:
        label = "\\n".join(stage_lines(s)).replace('"', "'")
        style = "filled,dashed" if s.status == "skipped" else "filled,rounded"
        out.append(f'{_dot_id(s.key)} [shape=box, style="{style}", fillcolor="{FILL[s.status]}", label="{label}", '
                   f"tooltip={_dot_id(stage_tooltip(s))}];")
    for d in g.datasets:
        label = "\\n".join(dataset_lines(d)).replace('"', "'")
        fill = "#fff5d6" if d.lineage is not None or d.kind == "model" else "#ffffff"
        out.append(f'{_dot_id(d.key)} [shape=ellipse, style="filled{",dashed" if d.kind == PENDING else ""}", '
                   f'fillcolor="{fill}", label="{label}", tooltip={_dot_id(dataset_tooltip(d))}];')
    out += [f"{_dot_id(a)} -> {_dot_id(b)} [tooltip={_dot_id(role)}];" for a, b, role in g.edges]
    return "\n".join(out + ["}"])


def _dot_svg(g: Graph, direction: str = "LR") -> str:
    dot = shutil.which("dot")
    if dot is None:
        raise UserError("the dot engine needs Graphviz's `dot` on PATH (Debian: apt install graphviz); "
                        "without --engine dot the built-in layout needs nothing")
    done = subprocess.run([dot, "-Tsvg"], input=to_dot(g, direction), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        raise UserError(f"dot failed: {said[-1] if said else f'exit {done.returncode}'}")
    return done.stdout


# ---- for a report page ----------------------------------------------------------------------------
def lineage_html(g: Graph) -> str:
    """A table of the graph's models: where each came from."""
    rows = []
    for d in g.models():
        lin = d.lineage or {}
        if "external" in lin:
            made, base, data, digest = f"named in the config ({lin.get('config_key')})", lin["external"], "", ""
        elif lin:
            made = lin["stage"] + (f" (run {lin['run_id']})" if lin.get("run_id") else "")
            base, data = ", ".join(lin["base_model"]), "<br>".join(html.escape(t) for t in lin["training_data"])
            digest = lin.get("params_digest") or ""
        else:
            made, base, data, digest = "not in the catalog", "", "", ""
        rows.append(f"<tr><td><code>{html.escape(d.key)}</code></td><td>{html.escape(made)}</td>"
                    f"<td><code>{html.escape(base)}</code></td><td>{data}</td><td><code>{digest}</code></td></tr>")
    if not rows:
        return "<p>No models in this run.</p>"
    return ("<table class=\"lineage\"><tr><th>model</th><th>made by</th><th>base model</th><th>training data</th>"
            "<th>params digest</th></tr>" + "".join(rows) + "</table>")


PAGE_WIDTH = 1100  # px: about the report page's text width (72em of 14px, less margins)


def _svg_width(svg: str) -> float:
    return float(re.search(r'<svg[^>]*? width="([0-9.]+)', svg).group(1))


def dag_section(catalog, run_id: str, engine: str = "plain") -> tuple[str, str]:
    """(title, HTML) of a report section: the run's graph as inline SVG, then each model's lineage."""
    g = run_graph(catalog, run_id)
    svg = to_svg(g, engine)
    if engine == "plain" and _svg_width(svg) > PAGE_WIDTH:
        # Wider than the page (a whole recipe is 10 or more layers): top to bottom, if that is narrower
        tall = to_svg(g, engine, "TB")
        svg = tall if _svg_width(tall) < _svg_width(svg) else svg
    svg = svg[svg.index("<svg"):]  # Graphviz starts with an XML declaration and a doctype: not inline HTML
    return "Pipeline", (f'<figure class="dag" style="overflow-x: auto; margin: 0">{svg}</figure>\n'
                        f"<h3>Models</h3>\n{lineage_html(g)}")
