"""Fusion of ranked lists: hybrid sparse + dense retrieval without training.

Methods:
- ``zscore``: each run's scores are standardised per query, (s - mean) / std (population std), then
  summed with weights: CombSUM (Fox & Shaw, 1994) over zero-mean unit-variance scores (Montague &
  Aslam, 2001, "Relevance Score Normalization for Metasearch"). On SciFact it is the strongest
  system we measured offline (BM25 + MiniLM, alpha 0.5, over BM25's top 100: nDCG@10 0.7295 vs 0.6789 BM25 and 0.6451
  MiniLM; shared/notes/offline-adaptation-findings.md), hence also the teacher of choice.
- ``minmax``: each run's scores are rescaled per query to [0, 1], then summed with weights
  (Lee, 1997, "Analyses of Multiple Evidence Combination").
- ``rrf``: reciprocal rank fusion, sum over runs of w / (k + rank), k = 60 (Cormack, Clarke &
  Buettcher, 2009, "Reciprocal Rank Fusion outperforms Condorcet and individual Rank Learning Methods").

A document that a run did not retrieve for a query gets, from that run, the lowest normalised score
that run gave any document for that query (zscore/minmax): it ranked below everything the run
returned, and the minimum is the most that can be said of it without the run's full score
distribution. Under rrf it gets nothing from that run (its rank is beyond the list). A query a run
has no list for at all gets 0 from that run (neutral: the mean under zscore).
Degenerate lists (all scores equal) normalise to 0.

``fuse_tables`` is the plain function (a teacher reuses it to score candidates); ``fuse`` is the stage.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from irflow.stage import Output, stage

METHODS = ("zscore", "minmax", "rrf")


def resolve_weights(n_runs: int, weights=None, alpha: float | None = None, method: str = "zscore") -> list[float]:
    """Weights per run, in the order of the runs: ``weights`` as given, or ``alpha`` for two runs
    (alpha for the first, 1 - alpha for the second), or equal weights: 1/n for score fusion (a convex
    combination, like alpha), 1 for rrf (Cormack et al.'s unweighted formula)."""
    if weights is not None and alpha is not None:
        raise ValueError("fuse: give either weights or alpha, not both")
    if alpha is not None:
        if n_runs != 2:
            raise ValueError(f"fuse: alpha is for fusing exactly 2 runs, got {n_runs}")
        return [float(alpha), 1.0 - float(alpha)]
    if weights is None:
        return [1.0 if method == "rrf" else 1.0 / n_runs] * n_runs
    if len(weights) != n_runs:
        raise ValueError(f"fuse: {len(weights)} weight(s) for {n_runs} run(s)")
    return [float(w) for w in weights]


def fuse_tables(tables: list[pa.Table], method: str = "zscore", weights=None, *, alpha: float | None = None,
                rrf_k: float = 60.0, top_k: int | None = None, system: str = "fused") -> pa.Table:
    """Fuse run tables (query_id, doc_id, rank, score[, system]) into one run (contract ``run``).

    Ranks of the result are 1..n per query, by fused score descending, ties by doc_id.
    ``top_k`` keeps the best ``top_k`` per query (default: every document any run retrieved).
    """
    if method not in METHODS:
        raise ValueError(f"fuse: unknown method {method!r} (known: {list(METHODS)})")
    if not tables:
        raise ValueError("fuse: no runs to fuse")
    w = resolve_weights(len(tables), weights, alpha, method)
    parts = []
    for i, t in enumerate(tables):
        if "system" in t.column_names and len(set(t.column("system").unique().to_pylist())) > 1:
            raise ValueError(f"fuse: run {i} holds several systems; give one run table per system")
        cols = t.select(["query_id", "doc_id", "rank", "score"])
        parts.append(pa.table({
            "r": pa.array([i] * t.num_rows, pa.int32()),
            "query_id": cols.column("query_id").cast(pa.string()),
            "doc_id": cols.column("doc_id").cast(pa.string()),
            "rank": cols.column("rank").cast(pa.int64()),
            "score": cols.column("score").cast(pa.float64()),
        }))
    con = duckdb.connect()
    con.register("runs_raw", pa.concat_tables(parts))
    con.register("weights", pa.table({"r": pa.array(range(len(w)), pa.int32()), "w": pa.array(w, pa.float64())}))

    win = "OVER (PARTITION BY r, query_id)"
    if method == "zscore":
        norm = f"coalesce((score - avg(score) {win}) / nullif(stddev_pop(score) {win}, 0), 0)"
    elif method == "minmax":
        norm = f"coalesce((score - min(score) {win}) / nullif(max(score) {win} - min(score) {win}, 0), 0)"
    else:
        norm = f"1.0 / ({float(rrf_k)} + rank)"
    # What a run gives a document it did not retrieve for a query (see the module doc).
    missing = "coalesce(m.floor, 0)" if method != "rrf" else "0"
    limit = f"WHERE pos <= {int(top_k)}" if top_k else ""
    return con.sql(f"""
        WITH runs AS (  -- one row per (run, query, doc) even if a run repeats a document
                 SELECT r, query_id, doc_id, max(score) AS score, min(rank) AS rank
                 FROM runs_raw GROUP BY r, query_id, doc_id),
             norm AS (SELECT r, query_id, doc_id, {norm} AS ns FROM runs),
             floors AS (SELECT r, query_id, min(ns) AS floor FROM norm GROUP BY r, query_id),
             cand AS (SELECT DISTINCT query_id, doc_id FROM runs),
             grid AS (SELECT cand.query_id, cand.doc_id, weights.r, weights.w FROM cand CROSS JOIN weights),
             fused AS (
                 SELECT g.query_id, g.doc_id, sum(g.w * coalesce(n.ns, {missing})) AS score
                 FROM grid g
                 LEFT JOIN norm n ON n.r = g.r AND n.query_id = g.query_id AND n.doc_id = g.doc_id
                 LEFT JOIN floors m ON m.r = g.r AND m.query_id = g.query_id
                 GROUP BY g.query_id, g.doc_id),
             ranked AS (SELECT *, row_number() OVER (PARTITION BY query_id ORDER BY score DESC, doc_id) AS pos
                        FROM fused)
        SELECT query_id, doc_id, CAST(pos AS INTEGER) AS rank, CAST(score AS FLOAT) AS score, ? AS system
        FROM ranked {limit}
        ORDER BY query_id, rank
    """, params=[system]).to_arrow_table()


@stage("fuse", version="1", outputs=Output("run", "run"))
def fuse(runs, cfg: dict) -> pa.Table:
    """Fused run of ``runs`` (a list of run refs, in the order of the weights).

    cfg: {method: zscore|minmax|rrf (zscore), weights: [w per run] or alpha: weight of the first of
    two runs (default: equal weights, 1/n; 1 for rrf), rrf_k: 60, top_k: null (all), system: name of the fused run}.
    """
    refs = list(runs) if isinstance(runs, (list, tuple)) else [runs]
    return fuse_tables([r.table() for r in refs], cfg.get("method", "zscore"), cfg.get("weights"),
                       alpha=cfg.get("alpha"), rrf_k=float(cfg.get("rrf_k", 60)), top_k=cfg.get("top_k"),
                       system=cfg.get("system", "fused"))
