"""Reports a person looks at: `irflow report` (one self-contained HTML page per run) and `irflow compare`,
checked against the store; and irflow.learn.stats against scipy / numpy computed independently.

The runs are the session's GPL and RocketQA samples (tests/conftest.py): when test_gpl_flow and
test_rocketqa ran first in the session, these reuse their first runs and compute nothing.
"""

import html
import json
import math
import re
from html import escape as html_escape
from html.parser import HTMLParser
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from scipy import stats as sp

from irflow import api
from irflow.dev.testing import run_cli as cli
from irflow.learn.stats import bootstrap_ci, paired
from irflow.tools.report import SECTION_BUILDERS, Section, build_report


# ---- irflow.learn.stats against independent computations ------------------------------------------------
def test_bootstrap_ci_is_numpys_percentile_bootstrap_and_seeded():
    rng = np.random.default_rng(7)
    values = rng.random(40)
    as_dict = {f"q{i}": v for i, v in enumerate(values)}
    # The same resampling written out: 10,000 samples of 40 query indices, their means, the 2.5/97.5% points.
    idx = np.random.default_rng(0).integers(0, 40, size=(10_000, 40))
    means = np.sort(values[np.array([int(k[1:]) for k in sorted(as_dict)])][idx].mean(axis=1))
    expected = tuple(np.quantile(means, [0.025, 0.975]))
    assert bootstrap_ci(as_dict) == pytest.approx(expected, abs=1e-15)
    # dict order does not matter; the seed does; a wider level gives a wider interval around the mean
    assert bootstrap_ci(dict(reversed(list(as_dict.items())))) == bootstrap_ci(as_dict)
    assert bootstrap_ci(as_dict, seed=1) != bootstrap_ci(as_dict)
    lo95, hi95 = bootstrap_ci(values)
    lo99, hi99 = bootstrap_ci(values, level=0.99)
    assert lo99 < lo95 < values.mean() < hi95 < hi99
    assert bootstrap_ci([0.25] * 9) == (0.25, 0.25)
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_bootstrap_ci_in_blocks_equals_one_draw():
    # 300 queries x 10,000 resamples is drawn in blocks; the interval is the one of a single draw.
    values = np.random.default_rng(3).random(300)
    idx = np.random.default_rng(0).integers(0, 300, size=(10_000, 300))
    expected = tuple(np.quantile(values[idx].mean(axis=1), [0.025, 0.975]))
    from irflow.learn import stats

    old = stats._BLOCK_VALUES
    stats._BLOCK_VALUES = 300 * 7  # blocks of 7 resamples
    try:
        assert bootstrap_ci(values) == pytest.approx(expected, abs=1e-15)
    finally:
        stats._BLOCK_VALUES = old


def test_paired_matches_scipy_on_the_common_queries():
    rng = np.random.default_rng(11)
    a = {f"q{i}": float(v) for i, v in enumerate(rng.random(30))}
    b = {q: (v if i % 5 == 0 else float(rng.random())) for i, (q, v) in enumerate(a.items())}  # 6 exact ties
    b["only-b"], a["only-a"] = 1.0, 0.0  # not in common: left out
    p = paired(a, b)
    common = sorted(set(a) & set(b))
    va, vb = np.array([a[q] for q in common]), np.array([b[q] for q in common])
    assert p.n == 30 and (p.wins, p.ties, p.losses) == (int((vb > va).sum()), 6, int((vb < va).sum()))
    assert p.wins + p.ties + p.losses == 30
    assert p.mean_diff == pytest.approx((vb - va).mean(), abs=1e-12)
    assert p.mean_a == pytest.approx(va.mean()) and p.mean_b == pytest.approx(vb.mean())
    assert p.t_pvalue == pytest.approx(sp.ttest_rel(vb, va).pvalue, rel=1e-12)
    assert p.wilcoxon_pvalue == pytest.approx(sp.wilcoxon(vb, va).pvalue, rel=1e-12)
    # B against A is A against B mirrored
    r = paired(b, a)
    assert (r.wins, r.losses) == (p.losses, p.wins) and r.t_pvalue == pytest.approx(p.t_pvalue)


def test_paired_all_ties_gives_p_one_not_nan():
    a = {"1": 0.5, "2": 0.0, "3": 1.0}
    p = paired(a, dict(a))
    assert (p.n, p.wins, p.ties, p.losses, p.mean_diff) == (3, 0, 3, 0, 0.0)
    assert p.t_pvalue == 1.0 and p.wilcoxon_pvalue == 1.0
    # float noise within `tie` is a tie too
    p = paired(a, {q: v + 1e-12 for q, v in a.items()})
    assert (p.wins, p.ties, p.losses, p.t_pvalue, p.wilcoxon_pvalue) == (0, 3, 0, 1.0, 1.0)
    assert paired(a, {q: v + 1e-12 for q, v in a.items()}, tie=0).wins == 3


def test_paired_on_a_few_queries_with_ties_gives_scipys_permutation_p():
    # n <= 13 with zero or tied differences: scipy runs a permutation test over every sign pattern
    # (its statistic once per pattern); paired computes the same p-value at once.
    rng = np.random.default_rng(5)
    checked = 0
    for n in [*range(2, 10), 13]:
        for _ in range(4 if n < 13 else 1):
            a = {f"q{i}": float(v) for i, v in enumerate(rng.random(n).round(1))}
            b = {q: float(v) for q, v in zip(a, rng.random(n).round(1))}  # one decimal: ties and zeros
            d = np.array([b[q] - a[q] for q in sorted(a)])
            d[np.abs(d) <= 1e-9] = 0.0  # as paired sees them
            if not d.any():
                continue
            assert paired(a, b).wilcoxon_pvalue == pytest.approx(float(sp.wilcoxon(d).pvalue), abs=1e-12), (n, d)
            checked += 1
    assert checked >= 30


# ---- reading the store independently of irflow.tools.report ---------------------------------------------
def catalog_rows(store: Path, sql: str, params=()) -> list[tuple]:
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def stage_output(store: Path, run_id: str, stage: str, output: str) -> str:
    ((outputs,),) = catalog_rows(store, "SELECT outputs FROM stage_runs WHERE run_id = ? AND stage = ?",
                                 [run_id, stage])
    return json.loads(outputs)[output]


def table(store: Path, dataset_id: str):
    return pq.read_table(store / "objects" / dataset_id / "data.parquet")


def ranking_of(store: Path, run_id: str, system: str):
    """The run's ranking of ``system``: the stage output that is a ranking whose rows are all that system's."""
    for (outputs,) in catalog_rows(store, "SELECT outputs FROM stage_runs WHERE run_id = ?", [run_id]):
        did = json.loads(outputs).get("run")
        if did and set(table(store, did).column("system").to_pylist()) == {system}:
            return table(store, did)
    raise AssertionError(f"no ranking of {system} in {run_id}")


def per_query(store: Path, run_id: str, system: str, metric: str = "ndcg@10") -> dict[str, float]:
    t = table(store, stage_output(store, run_id, f"evaluate[{system}]", "per_query"))
    t = t.filter(pc.equal(t.column("metric"), metric))
    return dict(zip(t.column("query_id").to_pylist(), t.column("value").to_pylist()))


class Page(HTMLParser):
    """The tables of a page (id -> rows of cell texts) and every tag with its attributes."""

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.tables, self._table, self._row, self._cell = [], {}, None, None, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "table":
            self._table = self.tables.setdefault(dict(attrs).get("id") or f"t{len(self.tables)}", [])
        elif tag == "tr" and self._table is not None:
            self._row = []
            self._table.append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def assert_self_contained(text: str) -> None:
    page = Page(text)
    for tag, attrs in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed"), tag
        for name in ("src", "href", "srcset", "action", "data", "poster"):
            value = attrs.get(name)
            assert value is None or value.startswith(("data:", "#")), (tag, name, value[:80])
    style = "".join(re.findall(r"<style>(.*?)</style>", text, re.S))
    assert "url(" not in style and "@import" not in style
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*https?://""", text)


def metrics_table_matches_store(page: Page, store: Path, run_id: str) -> dict:
    """Every metric cell of the page's metrics table equals the catalog's value (4 decimals); returns the
    page's table as {system: {column: text}}."""
    rows = page.tables["metrics"]
    head = rows[0]
    shown = {r[0]: dict(zip(head, r)) for r in rows[1:]}
    stored = catalog_rows(store, "SELECT system, metric, value, num_queries FROM metrics WHERE run_id = ?", [run_id])
    assert stored and {s for s, *_ in stored} == set(shown)
    for system, metric, value, num_queries in stored:
        assert shown[system][metric] == f"{value:.4f}", (system, metric)
        assert int(shown[system]["queries"]) == num_queries
    return shown


def check_comparisons(result, page: Page, store: Path, run_id: str) -> None:
    """wins + ties + losses = the evaluated queries, in the data and on the page."""
    (num_queries,) = {n for (n,) in catalog_rows(store, "SELECT DISTINCT num_queries FROM metrics WHERE run_id = ?",
                                                  [run_id])}
    assert result.data.comparisons
    for c in result.data.comparisons:
        assert c.stats.wins + c.stats.ties + c.stats.losses == c.stats.n == num_queries
        assert len(c.largest_wins) == min(5, c.stats.wins) and len(c.largest_losses) == min(5, c.stats.losses)
    for b in result.data.baselines:
        rows = page.tables[f"vs-{b}"]
        assert len(rows) - 1 == len([c for c in result.data.comparisons if c.baseline == b])
        for r in rows[1:]:
            assert int(r[2]) + int(r[3]) + int(r[4]) == int(r[1]) == num_queries


# ---- the report of a real GPL run -----------------------------------------------------------------
@pytest.fixture(scope="module")
def gpl(gpl_sample, gpl_sample_run):
    return {**gpl_sample, "run": gpl_sample_run}


def test_gpl_report_against_the_store(gpl, tmp_path):
    store, run_id = Path(gpl["store"]), gpl["run"].run_id
    result = api.report(run_id, tmp_path / "report", store=store)
    text = result.path.read_text()
    assert result.path == tmp_path / "report" / "index.html" and result.run_id == run_id
    assert_self_contained(text)
    page = Page(text)

    # the header: run id, flow, status, config file
    assert run_id in text and "completed" in text and str(gpl["config"]) in text
    shown = metrics_table_matches_store(page, store, run_id)
    systems = {s.system for s in result.data.systems}
    assert systems == set(shown) == {"bm25-flat", "dense-bi", "hybrid", "bm25-doc2query-flat", "qgen-student",
                                     "gpl-student", "hybrid-qgen-student", "hybrid-gpl-student"}
    # one distribution plot per system, one of the trainers' losses, one of the teacher's margins: inlined
    assert len([a for t, a in page.tags if t == "img" and a["src"].startswith("data:image/png;base64,")]) == 8 + 2
    assert ">Training losses</h2>" in text and "GPL teacher: pseudo-label margins" in text
    # the run's DAG: every stage the catalog recorded for the run, drawn in the page's SVG
    from irflow.engine.catalog import Catalog

    svg = text[text.index("<svg"):text.index("</svg>")]
    stages = {r["name"] for r in Catalog(store / "catalog.duckdb").stage_runs(run_id)}
    assert stages and all(html_escape(s) in svg for s in stages)
    # the CI is of the same mean the metrics table holds, and holds it
    for s in result.data.systems:
        assert s.per_query_mean == pytest.approx(s.value, abs=1e-12)
        assert s.ci[0] <= s.value <= s.ci[1]
        assert shown[s.system]["ndcg@10 95% CI"] == f"[{s.ci[0]:.4f}, {s.ci[1]:.4f}]"

    # default baselines: the zero-shot dense system (train.model's directory: dense-bi) and BM25 flat
    assert result.data.baselines == ["dense-bi", "bm25-flat"]
    check_comparisons(result, page, store, run_id)

    # a pair's statistics equal scipy's on the per-query values read from the store with pyarrow
    c = max((c for c in result.data.comparisons if c.baseline == "dense-bi"),
            key=lambda c: (c.stats.wins + c.stats.losses, c.system))
    a, b = per_query(store, run_id, "dense-bi"), per_query(store, run_id, c.system)
    assert c.stats.wins + c.stats.losses >= 2, "the sample has no pair that differs on two queries"
    q = sorted(a)
    va, vb = np.array([a[k] for k in q]), np.array([b[k] for k in q])
    assert c.stats.t_pvalue == pytest.approx(sp.ttest_rel(vb, va).pvalue, rel=1e-12)
    assert c.stats.wilcoxon_pvalue == pytest.approx(sp.wilcoxon(vb, va).pvalue, rel=1e-12)
    assert c.stats.mean_diff == pytest.approx((vb - va).mean(), abs=1e-12)
    row = next(r for r in page.tables["vs-dense-bi"][1:] if r[0] == c.system)
    assert row[6:8] == [html_p(c.stats.t_pvalue), html_p(c.stats.wilcoxon_pvalue)]

    # the largest win: its query text, and each system's top 3 with relevance, as the store has them
    ex = c.largest_wins[0]
    assert ex.diff == pytest.approx(max(vb - va))
    queries = table(store, stage_output(store, run_id, "select_queries[test]", "queries"))
    assert ex.query == queries.filter(pc.equal(queries.column("query_id"), ex.query_id)).column("text")[0].as_py()
    qrels = table(store, stage_output(store, run_id, "ingest", "qrels")).to_pylist()
    judged = {r["doc_id"]: r["score"] for r in qrels if r["query_id"] == ex.query_id and r["split"] == "test"}
    for system in ("dense-bi", c.system):
        ranking = ranking_of(store, run_id, system).to_pylist()
        top = sorted((r["rank"], r["doc_id"]) for r in ranking if r["query_id"] == ex.query_id and r["rank"] <= 3)
        assert [(p.rank, p.doc_id) for p in ex.top[system]] == top
        assert [p.relevance for p in ex.top[system]] == [judged.get(d) for _, d in top]
        assert all(p.doc_id in text for p in ex.top[system])
    assert html.escape(ex.query) in text


def html_p(x: float) -> str:
    return f"{x:.2e}" if x < 1e-3 else f"{x:.3f}"


def test_report_sections_are_an_extension_point(gpl, tmp_path, monkeypatch):
    seen = []

    def builder(ctx):
        seen.append((ctx.run_id, len(ctx.data.systems)))
        return Section("From a builder", "<p>built for every report</p>")

    monkeypatch.setattr("irflow.tools.report.SECTION_BUILDERS", SECTION_BUILDERS + [builder])
    from irflow.engine.catalog import Catalog

    catalog = Catalog(Path(gpl["store"]) / "catalog.duckdb")
    result = build_report(catalog, gpl["run"].run_id, tmp_path, baselines=["bm25-flat"],
                          sections=[Section("Extra <notes>", "<p id=extra>added by a caller</p>")])
    text = result.path.read_text()
    assert seen == [(gpl["run"].run_id, 8)]  # the run's 8 systems (6, and BM25 fused with each of its 2 students)
    assert text.index("From a builder") < text.index("Extra &lt;notes&gt;") < text.index("added by a caller")
    assert result.data.baselines == ["bm25-flat"] and {c.baseline for c in result.data.comparisons} == {"bm25-flat"}


def test_report_cli_errors_are_one_line(gpl, tmp_path):
    store, run_id = gpl["store"], gpl["run"].run_id
    ((latest,),) = catalog_rows(store, "SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1")
    code, out, err = cli("report", "no-such-run", "--store", store, "--out", tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no run 'no-such-run'" in err and "recent runs:" in err and latest in err
    assert not (tmp_path / "index.html").exists()
    code, _, err = cli("report", run_id, "--store", store, "--out", tmp_path, "--baseline", "bm25-flatt")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "bm25-flatt" in err and "gpl-student" in err
    code, _, err = cli("report", run_id, "--store", store, "--out", tmp_path, "--metric", "ndcg@5")
    assert code == 2 and "ndcg@10" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("compare", run_id, "nope", "--store", store)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no run 'nope'" in err and latest in err
    code, _, err = cli("report", "--store", tmp_path / "nothing", "--out", tmp_path)
    assert code == 2 and "no irflow store" in err


def test_compare_names_exactly_the_changed_key(gpl):
    store, a = gpl["store"], gpl["run"]
    b = api.run(gpl["config"], ["evaluate.ignore_identical_ids=false"], store=store)
    diff = api.compare(a.run_id, b.run_id, store=store)
    assert [(c.key, c.a, c.b) for c in diff.config] == [("evaluate.ignore_identical_ids", True, False)]
    stages = {s.name: s for s in diff.stages}
    assert set(stages) == {s.name for s in a.stages} == {s.name for s in b.stages}
    # only the evaluations read the key; everything else B reused
    assert {n for n, s in stages.items() if s.b == "computed"} == {n for n in stages if n.startswith("evaluate[")}
    assert all(s.b == "cached" for n, s in stages.items() if not n.startswith("evaluate["))
    # a label the run called twice (one cache key: computed once, cached once) reads computed
    computed_a = {s.name for s in a.stages if s.status == "computed"}
    assert {n: s.a for n, s in stages.items()} == {s.name: "computed" if s.name in computed_a else s.status
                                                   for s in a.stages}
    assert stages["bm25_index[flat]"].a == "computed"
    # SciFact's query ids are never doc ids: the same rankings score the same; every query a tie
    assert {s.system for s in diff.systems} == {m["system"] for m in a.metrics}
    for s in diff.systems:
        assert s.a == s.b == a.metric(s.system)
        assert (s.stats.ties, s.stats.wins, s.stats.losses) == (s.stats.n, 0, 0) and s.stats.n == 8
        assert s.stats.t_pvalue == s.stats.wilcoxon_pvalue == 1.0
    code, out, _ = cli("compare", a.run_id, b.run_id, "--store", store)
    assert code == 0 and "evaluate.ignore_identical_ids: True -> False" in out
    assert len([ln for ln in out.splitlines() if re.match(r"  [\w.]+: .+ -> ", ln)]) == 1
    code, out, _ = cli("compare", a.run_id, b.run_id, "--store", store, "--json")
    assert code == 0 and [c["key"] for c in json.loads(out.splitlines()[-1])["config"]] == [
        "evaluate.ignore_identical_ids"]


def test_a_failed_run_still_gets_a_report(gpl, tmp_path):
    store = gpl["store"]
    broken = tmp_path / "broken-t5"  # a model directory that passes the checks and cannot be loaded
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    code, _, _ = cli("run", gpl["config"], "--store", store, "--set", f"generate.model={broken}")
    assert code in (1, 2)
    ((failed, status),) = catalog_rows(store, "SELECT run_id, status FROM runs ORDER BY started_at DESC LIMIT 1")
    assert status == "failed"
    # `latest` is that run
    code, out, _ = cli("report", "latest", "--store", store, "--out", tmp_path / "r")
    assert code == 0 and failed in out and "no metrics" in out
    result = api.report(failed, tmp_path / "r2", store=store)
    text = result.path.read_text()
    assert_self_contained(text)
    d = result.data
    assert d.run["status"] == "failed" and d.systems == [] and d.comparisons == [] and d.metric_rows == []
    assert any(n.startswith("no metrics") for n in d.notes) and "no metrics" in text
    # what it had done: ingest and the test queries, cached from the sample's first run
    assert [(s["name"], s["status"]) for s in d.stages] == [("ingest", "cached"), ("select_queries[test]", "cached")]
    assert "select_queries[test]" in text and "failed" in text


# ---- the report of a real RocketQA run ------------------------------------------------------------
def test_rocketqa_report_against_the_store(rocketqa_sample, rocketqa_sample_run, tmp_path):
    store = Path(rocketqa_sample["store"])
    run_id = rocketqa_sample_run.run_id
    code, out, err = cli("report", run_id, "--store", store, "--out", tmp_path)
    assert code == 0, err
    text = (tmp_path / "index.html").read_text()
    assert_self_contained(text)
    page = Page(text)
    shown = metrics_table_matches_store(page, store, run_id)
    assert {"md0", "md1-ce", "md1-fusion", "md2", "mc-rerank"} <= set(shown)
    result = api.report(run_id, tmp_path / "again", store=store)
    zero_shot = "dense-" + Path(rocketqa_sample["bi"]).name
    assert result.data.baselines == [zero_shot, "bm25-flat"]
    assert len(result.data.comparisons) == 2 * (len(shown) - 1)
    check_comparisons(result, page, store, run_id)
    # the same page for the same run (seeded bootstrap, PNGs without timestamps)
    assert result.path.read_text() == text
    # md2 against BM25 flat: scipy on the stored per-query values
    c = result.data.comparison("md2", "bm25-flat")
    a, b = per_query(store, run_id, "bm25-flat"), per_query(store, run_id, "md2")
    q = sorted(a)
    va, vb = np.array([a[k] for k in q]), np.array([b[k] for k in q])
    if (vb != va).any():
        assert c.stats.t_pvalue == pytest.approx(sp.ttest_rel(vb, va).pvalue, rel=1e-12)
        assert c.stats.wilcoxon_pvalue == pytest.approx(sp.wilcoxon(vb, va).pvalue, rel=1e-12)
    else:
        assert c.stats.t_pvalue == c.stats.wilcoxon_pvalue == 1.0
    assert not math.isnan(c.stats.mean_diff)
