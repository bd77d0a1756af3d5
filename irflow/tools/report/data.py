"""The numbers of a run's report, as plain data (no HTML): what the page shows and what tests check.

    data = report_data(catalog, run_id, baselines=None, metric="ndcg@10")
    data.systems[0].value, data.systems[0].ci        # the metrics table's mean, a bootstrap 95% CI
    data.comparisons[0].stats.wins                    # system against baseline, query by query
    data.comparisons[0].largest_wins[0].top["bm25-flat"][0].doc_id

Per-query values come from the evaluate stages' ``per_query`` outputs; the texts of the example
queries and passages, and the relevance judgements, from the very datasets those stages read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import pyarrow.dataset as ds

import irflow.tools.report.runs as R
from irflow.engine.catalog import Catalog
from irflow.engine.errors import UserError
from irflow.learn import stats

# Stages whose ranking is a default baseline, in the order the page lists them: every recipe names its
# zero-shot dense search `dense_search[zero-shot]` and the BM25 flat search `bm25_search[flat]`.
BASELINE_STAGES = ("dense_search[zero-shot]", "bm25_search[flat]")
TOP_PASSAGES = 3
SNIPPET = 240  # characters of a passage's text shown
TIE = 1e-9  # differences within this are ties (float noise), as in stats.paired


@dataclass
class Passage:
    rank: int
    doc_id: str
    title: str
    snippet: str
    relevance: int | None  # the qrels score in the evaluated split; None: not judged


@dataclass
class Example:
    """One query where a system and a baseline differ most."""

    query_id: str
    query: str
    baseline_value: float
    system_value: float
    diff: float  # system - baseline
    top: dict[str, list[Passage]]  # system name -> its top passages for the query


@dataclass
class Comparison:
    system: str
    baseline: str
    stats: stats.Paired  # system (B) against baseline (A)
    largest_wins: list[Example]
    largest_losses: list[Example]


@dataclass
class SystemSummary:
    system: str
    dataset: str | None
    split: str | None
    metrics: dict[str, float]  # the metrics table's row (empty if the run recorded none)
    num_queries: int  # queries with a per-query value
    value: float | None  # the chosen metric from the metrics table
    per_query_mean: float  # the same mean, recomputed from the per-query values
    ci: tuple[float, float]  # percentile-bootstrap 95% CI of the mean over queries
    values: dict[str, float] = field(repr=False)  # query_id -> value


@dataclass
class ReportData:
    run: dict  # run_id, flow, status, started_at, finished_at, config_path, config
    metric: str
    metric_rows: list[dict]  # the metrics table as `irflow run` prints it
    systems: list[SystemSummary]
    baselines: list[str]
    comparisons: list[Comparison]
    stages: list[dict]  # name, status, seconds, rows (a map stage's rows computed and reused, or None)
    notes: list[str]  # what the page must say about what is missing
    selection: dict | None = None  # the model the run selected (irflow.decide.selection), and what it was measured on
    promotion: dict | None = None  # with promote.alias: whether it took the alias (irflow.decide.promotion), and why

    def system(self, name: str) -> SystemSummary:
        return next(s for s in self.systems if s.system == name)

    def comparison(self, system: str, baseline: str) -> Comparison:
        return next(c for c in self.comparisons if c.system == system and c.baseline == baseline)

    def to_dict(self) -> dict:
        return asdict(self)


def report_data(catalog: Catalog, run_id: str, baselines: list[str] | None = None, metric: str = "ndcg@10",
                examples: int = 5, level: float = 0.95) -> ReportData:
    """Everything the report of ``run_id`` shows. ``baselines``: system names (None: the run's zero-shot
    dense system and BM25 flat, those it has). Raises UserError for an unknown baseline or metric."""
    run = R.run_row(catalog, run_id)
    rows = R.metric_rows(catalog, run_id)
    evals = R.evaluations(catalog, run_id)
    stages = [{k: s[k] for k in ("name", "status", "seconds", "rows")} for s in R.stage_runs(catalog, run_id)]
    notes = []
    if not rows:
        notes.append(f"no metrics: the run recorded none (status {run['status']}; a run records its metrics when "
                     f"every system has been evaluated)")
    if run["status"] != "completed":
        notes.append(f"the run's status is {run['status']}: this report shows what it had done")

    values, ranking_of, made_by = {}, {}, {}
    for ev in evals:
        evaluated = R.metrics_evaluated(catalog, ev["per_query"])
        if metric not in evaluated:
            raise UserError(f"--metric {metric}: not evaluated in run {run_id}; its metrics: {', '.join(evaluated)}")
        for system, v in R.per_query_values(catalog, ev["per_query"], metric).items():
            values[system], ranking_of[system], made_by[system] = v, ev, ev["ranking_stage"]
    if evals and not values:
        notes.append("the evaluate stages wrote no per-query values")
    elif not evals:
        notes.append("no system was evaluated: no per-query values, confidence intervals or comparisons")

    by_system = {r["system"]: r for r in rows}
    systems = []
    for name in [r["system"] for r in rows] + sorted(set(values) - set(by_system)):
        v = values.get(name, {})
        if not v:
            continue  # a metrics row without per-query values (an old store): nothing to bootstrap
        row = by_system.get(name, {})
        mean = sum(v.values()) / len(v)
        systems.append(SystemSummary(
            system=name, dataset=row.get("dataset"), split=row.get("split"),
            metrics={k: x for k, x in row.items() if k not in ("system", "dataset", "split", "num_queries")},
            num_queries=len(v), value=row.get(metric), per_query_mean=mean,
            ci=stats.bootstrap_ci(v, level=level), values=v))

    chosen = _baselines(baselines, made_by, list(values))
    if values and not chosen:
        notes.append("no baseline to compare with: the run has no zero-shot dense or BM25 flat system; "
                     "give --baseline NAME")
    comparisons = [_compare(s.system, b, values, examples) for b in chosen for s in systems if s.system != b]
    if comparisons:
        # the evaluated split: the metrics table's, or (no metrics yet) the config's
        split = rows[0]["split"] if rows else run["config"].get("dataset", {}).get("split")
        _fill_texts(comparisons, ranking_of, _Texts(catalog, evals[0]), split)
    return ReportData(run=run, metric=metric, metric_rows=rows, systems=systems, baselines=chosen,
                      comparisons=comparisons, stages=stages, notes=notes, selection=catalog.selection(run_id),
                      promotion=catalog.promotion(run_id))


def _baselines(asked: list[str] | None, made_by: dict[str, str], systems: list[str]) -> list[str]:
    if asked:
        unknown = [b for b in asked if b not in systems]
        if unknown:
            raise UserError(f"--baseline {', '.join(unknown)}: no such system in the run; its systems: "
                            f"{', '.join(systems) or 'none'}")
        return list(dict.fromkeys(asked))
    return [s for stage in BASELINE_STAGES for s in systems if made_by.get(s) == stage]


def _compare(system: str, baseline: str, values: dict, examples: int) -> Comparison:
    """The paired statistics, and the queries where the system gains (loses) most on the baseline; the
    examples' texts and passages are filled in afterwards, for all comparisons at once."""
    a, b = values[baseline], values[system]
    diffs = sorted((b[q] - a[q], q) for q in set(a) & set(b))
    wins = [(d, q) for d, q in reversed(diffs) if d > TIE][:examples]
    losses = [(d, q) for d, q in diffs if d < -TIE][:examples]

    def example(d: float, q: str) -> Example:
        return Example(q, "", a[q], b[q], d, {})

    return Comparison(system, baseline, stats.paired(a, b), [example(d, q) for d, q in wins],
                      [example(d, q) for d, q in losses])


def _fill_texts(comparisons: list[Comparison], ranking_of: dict, texts: "_Texts", split: str | None) -> None:
    """Each example's query text and both systems' top passages, each table read once."""
    examples = [(c, ex) for c in comparisons for ex in c.largest_wins + c.largest_losses]
    texts.load({ranking_of[name]["ranking"] for c, _ in examples for name in (c.baseline, c.system)},
               {ex.query_id for _, ex in examples}, split)
    for c, ex in examples:
        ex.query = texts.queries.get(ex.query_id, "")
        ex.top = {name: texts.top(ranking_of[name]["ranking"], ex.query_id) for name in (c.baseline, c.system)}


class _Texts:
    """Query texts, passages and judgements of the evaluation: only the rows the examples need, each
    table read once (a corpus can be millions of passages; a report shows a few dozen)."""

    def __init__(self, catalog: Catalog, evaluation: dict):
        self.catalog = catalog
        self.ev = evaluation
        self.queries: dict[str, str] = {}
        self._qrels: dict[tuple[str, str], int] = {}
        self._docs: dict[str, tuple[str, str]] = {}
        self._tops: dict[tuple[str, str], list[tuple[int, str]]] = {}

    def load(self, ranking_ids: set[str], query_ids: set[str], split: str | None) -> None:
        if not query_ids:
            return
        in_queries = ds.field("query_id").isin(sorted(query_ids))
        if self.ev.get("queries"):
            t = R.read_table(self.catalog, self.ev["queries"], ["query_id", "text"], in_queries)
            self.queries = dict(zip(t.column("query_id").to_pylist(), t.column("text").to_pylist()))
        for rid in sorted(ranking_ids):
            t = R.read_table(self.catalog, rid, ["query_id", "doc_id", "rank"],
                             in_queries & (ds.field("rank") <= TOP_PASSAGES))
            for q, d, rank in zip(*(t.column(c).to_pylist() for c in ("query_id", "doc_id", "rank"))):
                self._tops.setdefault((rid, q), []).append((rank, d))
        t = R.read_table(self.catalog, self.ev["qrels"], ["query_id", "doc_id", "score"],
                         in_queries & (ds.field("split") == split))
        self._qrels = dict(zip(zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist()),
                               t.column("score").to_pylist()))
        docs = sorted({d for hits in self._tops.values() for _, d in hits})
        if self.ev.get("corpus") and docs:
            t = R.read_table(self.catalog, self.ev["corpus"], ["doc_id", "title", "text"],
                             ds.field("doc_id").isin(docs))
            for d, title, text in zip(*(t.column(c).to_pylist() for c in ("doc_id", "title", "text"))):
                self._docs[d] = (title, text if len(text) <= SNIPPET else text[:SNIPPET].rsplit(" ", 1)[0] + " ...")

    def top(self, ranking_id: str, query_id: str) -> list[Passage]:
        return [Passage(rank, d, *self._docs.get(d, ("", "(not in the corpus)")), self._qrels.get((query_id, d)))
                for rank, d in sorted(self._tops.get((ranking_id, query_id), []))]
