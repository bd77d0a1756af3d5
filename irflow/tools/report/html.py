"""The report page: ``ReportData`` (and any extra sections) as one self-contained HTML file.

Self-contained: the CSS is inline, figures are base64 PNGs, there is no script and no reference to
anything outside the file, so the page can be mailed, archived beside the store, or opened offline.
Collapsed parts use <details>, which needs no JavaScript.
"""

from __future__ import annotations

import base64
import math
from html import escape

from irflow.stages.report import COLUMNS
from irflow.tools.report.data import Comparison, Example, ReportData
from irflow.tools.report.plots import distribution_png

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: .2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .6em 0; } th, td { padding: .2em .6em; border-bottom: 1px solid #e4e4e4; }
th { text-align: left; background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { background: #fff6dd; border-left: 4px solid #e0b000; padding: .4em .8em; margin: .6em 0; }
.meta td:first-child { color: #666; } .win { color: #1a7f37; } .loss { color: #c0392b; }
.figs { display: flex; flex-wrap: wrap; gap: .8em; } .figs img { border: 1px solid #eee; }
details { margin: .4em 0; } summary { cursor: pointer; }
.example { border: 1px solid #ddd; border-radius: 4px; padding: .5em .8em; margin: .6em 0; }
.tops { display: flex; gap: 1em; } .tops > div { flex: 1; min-width: 0; }
.psg { font-size: 12.5px; margin: .3em 0; } .rel { font-weight: bold; color: #1a7f37; } .unj { color: #888; }
"""


def _num(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _p(x: float) -> str:
    if x is None or math.isnan(x):
        return "–"
    return f"{x:.2e}" if x < 1e-3 else f"{x:.3f}"


def _png(data: bytes, alt: str) -> str:
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def header(d: ReportData) -> str:
    r = d.run
    computed = sum(s["status"] == "computed" for s in d.stages)
    rows = [("run", r["run_id"]), ("flow", r["flow"]), ("status", r["status"]),
            ("started", f"{r['started_at']:%Y-%m-%d %H:%M:%S}" if r["started_at"] else "–"),
            ("finished", f"{r['finished_at']:%Y-%m-%d %H:%M:%S}" if r["finished_at"] else "–"),
            ("config file", r["config_path"] or "(given as a mapping, not a file)"),
            ("stages", f"{len(d.stages)}: {computed} computed, {len(d.stages) - computed} cached")]
    if d.selection:
        sel = d.selection
        rows += [("evaluation", sel["evaluation"] + ("" if sel["evaluation"] == "labelled"
                                                     else ": a proxy, not relevance labels")),
                 ("selected model", f"{sel['system']} ({sel['model_id']}): {sel['reason']}"),
                 ("hand it out", f"irflow export {r['run_id']} --out DIR")]
    if d.promotion:
        p = d.promotion
        rows.append((f"promotion ({p['decision']})", f"{p['reason']} (irflow export {p['alias']} --out DIR hands out "
                                                     f"the model {p['alias']} holds)"))
    body = "".join(f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in rows)
    stages = "".join(f"<tr><td>{escape(s['name'])}</td><td>{escape(s['status'])}</td>"
                     f"<td class=num>{s['seconds']:.1f} s</td><td class=num>{_rows(s.get('rows'))}</td></tr>"
                     for s in d.stages)
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in d.notes)
    return (f"<h1>irflow run {escape(r['run_id'])}</h1><table class=meta>{body}</table>{notes}"
            f"<details><summary>stages ({len(d.stages)})</summary><table><tr><th>stage</th><th>status</th>"
            f"<th>time</th><th>rows computed / reused</th></tr>{stages}</table></details>")


def _rows(rows: dict | None) -> str:
    """A map stage's input rows computed and reused (irflow.engine.row_reuse): "20 / 180"; '' for other stages."""
    return f"{rows['computed']:,} / {rows['reused']:,}" if rows else ""


def metrics_table(d: ReportData) -> str:
    """Every system's metrics (the run's metrics table) and the bootstrap CI of the chosen metric."""
    names = {k for s in d.systems for k in s.metrics}
    cols = [c for c in COLUMNS if c in names] + sorted(names - set(COLUMNS))
    head = "".join(f"<th>{escape(c)}</th>" for c in ["system", *cols, "queries", f"{d.metric} 95% CI"])
    body = ""
    for s in d.systems:
        cells = "".join(f"<td class=num>{_num(s.metrics.get(c))}</td>" for c in cols)
        body += (f"<tr><td>{escape(s.system)}</td>{cells}<td class=num>{s.num_queries}</td>"
                 f"<td class=num>[{_num(s.ci[0])}, {_num(s.ci[1])}]</td></tr>")
    if not d.systems:
        return "<p>No system was evaluated.</p>"
    where = (f"{escape(d.systems[0].dataset)} {escape(d.systems[0].split)}: "
             if d.systems[0].dataset else "")
    return (f"<p>{where}means over the evaluated queries, from the run's metrics table; the interval is a "
            f"percentile bootstrap of the mean of {escape(d.metric)} over queries (10,000 resamples, seed 0).</p>"
            f'<table id="metrics"><tr>{head}</tr>{body}</table>')


def distributions(d: ReportData) -> str:
    figs = "".join(_png(distribution_png(list(s.values.values()), d.metric, s.system, s.per_query_mean, s.ci),
                        f"{s.system}: {d.metric} per query") for s in d.systems)
    return f'<div class="figs">{figs}</div>' if figs else "<p>No per-query values.</p>"


def _passages(name: str, passages) -> str:
    items = []
    for p in passages:
        rel = (f'<span class="rel">rel {p.relevance}</span>' if p.relevance is not None
               else '<span class="unj">not judged</span>')
        items.append(f'<div class="psg">{p.rank}. <code>{escape(p.doc_id)}</code> {rel} '
                     f"<b>{escape(p.title)}</b> {escape(p.snippet)}</div>")
    return f"<div><b>{escape(name)}</b>{''.join(items) or '<div class=psg>(no passages)</div>'}</div>"


def _example(ex: Example, c: Comparison) -> str:
    cls = "win" if ex.diff > 0 else "loss"
    return (f'<div class="example"><b>{escape(ex.query)}</b> (query <code>{escape(ex.query_id)}</code>)<br>'
            f"{escape(c.baseline)} {_num(ex.baseline_value)} &rarr; {escape(c.system)} {_num(ex.system_value)} "
            f'(<span class="{cls}">{ex.diff:+.4f}</span>)<div class="tops">'
            + "".join(_passages(name, ex.top.get(name, [])) for name in (c.baseline, c.system)) + "</div></div>")


def comparisons(d: ReportData) -> str:
    if not d.systems:
        return "<p>No system was evaluated.</p>"
    if not d.comparisons:
        return "<p>No comparison: the run has no baseline system (give --baseline NAME).</p>"
    out = [f"<p>Each system against each baseline on {escape(d.metric)}, query by query: a win is a query the "
           "system scores higher on (by more than 1e-9). p-values are two-sided: the paired t-test assumes the "
           "differences are roughly normal; the Wilcoxon signed-rank test assumes them symmetric and ignores "
           "ties.</p>"]
    for b in d.baselines:
        rows = [c for c in d.comparisons if c.baseline == b]
        body = "".join(
            f"<tr><td>{escape(c.system)}</td><td class=num>{c.stats.n}</td><td class=num>{c.stats.wins}</td>"
            f"<td class=num>{c.stats.ties}</td><td class=num>{c.stats.losses}</td>"
            f"<td class=num>{c.stats.mean_diff:+.4f}</td><td class=num>{_p(c.stats.t_pvalue)}</td>"
            f"<td class=num>{_p(c.stats.wilcoxon_pvalue)}</td></tr>" for c in rows)
        out.append(f'<h3>against {escape(b)}</h3><table id="vs-{escape(b)}"><tr><th>system</th><th>queries</th>'
                   "<th>wins</th><th>ties</th><th>losses</th><th>mean difference</th><th>t-test p</th>"
                   "<th>Wilcoxon p</th></tr>"
                   f"{body}</table>")
        for c in rows:
            wins = "".join(_example(ex, c) for ex in c.largest_wins) or "<p>none</p>"
            losses = "".join(_example(ex, c) for ex in c.largest_losses) or "<p>none</p>"
            out.append(f"<details><summary>{escape(c.system)} vs {escape(b)}: largest wins and losses</summary>"
                       f"<h4>largest wins ({len(c.largest_wins)})</h4>{wins}"
                       f"<h4>largest losses ({len(c.largest_losses)})</h4>{losses}</details>")
    return "".join(out)


def page(d: ReportData, sections: list[tuple[str, str]]) -> str:
    """The whole page: the header, then each (title, html) section in order, with a contents list."""
    toc = "".join(f'<li><a href="#s{i}">{escape(t)}</a></li>' for i, (t, _) in enumerate(sections))
    body = "".join(f'<h2 id="s{i}">{escape(t)}</h2>{h}' for i, (t, h) in enumerate(sections))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>irflow report '
            f"{escape(d.run['run_id'])}</title><style>{CSS}</style></head><body>{header(d)}"
            f"<ul>{toc}</ul>{body}</body></html>\n")
