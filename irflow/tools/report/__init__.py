"""Reports a person looks at: one self-contained HTML page per run, and what differs between two runs.

    from irflow.tools.report import build_report, Section
    result = build_report(catalog, run_id, "report/", baselines=None, metric="ndcg@10",
                          sections=[Section("Notes", "<p>...</p>")])
    result.path        # report/index.html
    result.data        # the numbers on the page (irflow.tools.report.data.ReportData)

The numbers (``data.report_data``) are kept apart from the page (``html``), so tests check the numbers
and the page shows exactly them.

EXTENSION POINT: a section is a title and an HTML fragment. ``build_report(..., sections=[...])`` adds
sections to one page; a builder in ``SECTION_BUILDERS`` (a function ``(ReportContext) -> Section | None``)
adds its section to every report, the CLI's included. Built-in sections come first, then builders',
then ``sections``. A fragment must be self-contained too: inline styles, ``data:`` images, no scripts,
no references outside the page.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from irflow.engine.catalog import Catalog
from irflow.engine.store import Store
from irflow.tools import dag, inside
from irflow.tools.report import html
from irflow.tools.report.data import ReportData, report_data
from irflow.tools.report.runs import UnknownRun, resolve_run

__all__ = ["Section", "ReportContext", "ReportResult", "SECTION_BUILDERS", "build_report", "UnknownRun",
           "resolve_run"]


@dataclass(frozen=True)
class Section:
    title: str
    html: str  # a fragment: no <html>/<body>, nothing that loads from outside the page


@dataclass(frozen=True)
class ReportContext:
    """What a section builder can read: the catalog (and through it the store) and the report's numbers."""

    catalog: Catalog
    run_id: str
    data: ReportData


#: Builders of extra sections for every report, in page order (see the module docstring).
SECTION_BUILDERS: list[Callable[[ReportContext], Section | None]] = []


@dataclass
class ReportResult:
    path: Path  # the page: <out_dir>/index.html
    run_id: str
    data: ReportData


def build_report(catalog: Catalog, run_id: str, out_dir: str | Path, baselines: Sequence[str] | None = None,
                 metric: str = "ndcg@10", sections: Sequence[Section] = ()) -> ReportResult:
    """Write ``out_dir/index.html`` for ``run_id`` (an id, a unique prefix, or ``latest``)."""
    run_id = resolve_run(catalog, run_id)
    data = report_data(catalog, run_id, list(baselines) if baselines else None, metric)
    built = [Section(f"Metrics and {metric} 95% confidence intervals", html.metrics_table(data)),
             Section(f"{metric} per query", html.distributions(data)),
             Section("Against the baselines", html.comparisons(data))]
    built += _inside(catalog, run_id) + [_drawn("Pipeline", lambda: dag.dag_section(catalog, run_id)[1])]
    context = ReportContext(catalog, run_id, data)
    built += [s for s in (b(context) for b in SECTION_BUILDERS) if s is not None]
    built += list(sections)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    path.write_text(html.page(data, [(s.title, s.html) for s in built]), encoding="utf-8")
    return ReportResult(path, run_id, data)


def _inside(catalog: Catalog, run_id: str) -> list[Section]:
    """What the teachers and trainers did (``irflow.tools.inside``): losses, margins, denoising."""
    try:
        return [Section(t, h) for t, h in inside.inside_sections(catalog, Store(catalog.root), run_id)]
    except Exception as e:  # a page with what it has beats no page: say what could not be drawn
        return [Section("Teachers and trainers", _could_not(e))]


def _drawn(title: str, fragment: Callable[[], str]) -> Section:
    try:
        return Section(title, fragment())
    except Exception as e:
        return Section(title, _could_not(e))


def _could_not(e: Exception) -> str:
    import html as escape

    return f"<p><em>could not be drawn: {escape.escape(f'{type(e).__name__}: {e}')}</em></p>"
