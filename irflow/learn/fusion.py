"""Fusion of ranked lists: the one implementation behind the ``fuse`` stage (hybrid retrieval) and the
fusion teacher of ``pseudo_label``.

Methods:
- ``zscore``: each run's scores are standardised per query, (s - mean) / std (population std), then
  summed with weights: CombSUM (Fox & Shaw, 1994) over zero-mean unit-variance scores (Montague &
  Aslam, 2001, "Relevance Score Normalization for Metasearch"). On SciFact it is the strongest
  system we measured offline (BM25 + MiniLM, alpha 0.5, over BM25's top 100, above either alone on the
  test queries: bench/results/baselines.json), hence also the teacher of choice offline.
- ``minmax``: each run's scores are rescaled per query to [0, 1], then summed with weights
  (Lee, 1997, "Analyses of Multiple Evidence Combination").
- ``rrf``: reciprocal rank fusion, sum over runs of w / (k + rank), k = 60 (Cormack, Clarke &
  Buettcher, 2009, "Reciprocal Rank Fusion outperforms Condorcet and individual Rank Learning Methods").

A run is one system of the input tables (a table may hold several systems). Per run and query a
document counts once (its best score and rank) *before* normalising, so a repeated row cannot shift
the mean. A document that a run did not retrieve for a query gets, from that run, the lowest
normalised score that run gave any document for that query (zscore/minmax): it ranked below
everything the run returned, and the minimum is the most that can be said of it without the run's
full score distribution. Under rrf it gets nothing from that run (its rank is beyond the list). A
query a run has no list for at all gets 0 from that run (neutral: the mean under zscore).
Degenerate lists (all scores equal) normalise to 0.
"""

from __future__ import annotations

from typing import Literal, Mapping, Sequence

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, PositiveInt

from irflow.engine.params import Params

METHODS = ("zscore", "minmax", "rrf")


class FusionSettings(Params):
    """How runs are fused (the weights, by system name, are given per use)."""

    method: Literal["zscore", "minmax", "rrf"] = Field("zscore", description="zscore or minmax: normalise each "
                                                                            "run's scores per query, then a weighted "
                                                                            "sum; rrf: reciprocal rank fusion")
    rrf_k: float = Field(60.0, gt=0, description="rrf: the k in 1 / (k + rank)")
    input_depth: PositiveInt | None = Field(None, description="read only each input ranking's top n (null: all "
                                                                 "of it)")


def split_systems(tables: Sequence[pa.Table]) -> list[tuple[str, pa.Table]]:
    """(system, rows) for every system of every table; a system may appear in one table only."""
    out: dict[str, pa.Table] = {}
    for t in tables:
        for system in sorted(set(t.column("system").to_pylist())):
            if system in out:
                raise ValueError(f"fusion: system '{system}' is in two of the runs to fuse; system names must be "
                                 "distinct")
            out[system] = t.filter(pc.equal(t.column("system"), system))
    if not out:
        raise ValueError("fusion: no runs to fuse")
    return list(out.items())


def run_weights(systems: list[str], weights: Mapping[str, float] | None, method: str) -> list[float]:
    """Weights by system name; None: equal weights, 1/n for score fusion (a convex combination), 1 for
    rrf (Cormack et al.'s unweighted formula)."""
    if weights is None:
        return [1.0 if method == "rrf" else 1.0 / len(systems)] * len(systems)
    missing = [s for s in systems if s not in weights]
    extra = sorted(set(weights) - set(systems))
    if missing or extra:
        raise ValueError(f"fusion: weights name {sorted(weights)}, the runs are {systems}"
                         + (f"; no weight for {missing}" if missing else "")
                         + (f"; no run named {extra}" if extra else ""))
    return [float(weights[s]) for s in systems]


def fuse_runs(tables: Sequence[pa.Table], *, method: str = "zscore", weights: Mapping[str, float] | None = None,
              rrf_k: float = 60.0, input_depth: int | None = None, pairs: pa.Table | None = None,
              depth: int | None = None, system: str = "fused") -> pa.Table:
    """Fused run (query_id, doc_id, rank, score float64, system) of the systems in ``tables``.

    ``input_depth``: use only each run's top ``input_depth``. ``pairs`` (query_id, doc_id): score exactly these
    (a teacher scoring candidates); default: every (query, doc) any run returned. Ranks are 1..n per
    query by fused score descending, ties by doc_id; ``depth`` keeps the best ``depth`` per query.
    """
    if method not in METHODS:
        raise ValueError(f"fusion: unknown method {method!r} (known: {list(METHODS)})")
    runs = split_systems(tables)
    w = run_weights([s for s, _ in runs], weights, method)
    parts = []
    for i, (_, t) in enumerate(runs):
        if input_depth:
            t = t.filter(pc.less_equal(t.column("rank"), int(input_depth)))
        parts.append(pa.table({
            "r": pa.array([i] * t.num_rows, pa.int32()),
            "query_id": t.column("query_id").cast(pa.string()),
            "doc_id": t.column("doc_id").cast(pa.string()),
            "rank": t.column("rank").cast(pa.int64()),
            "score": t.column("score").cast(pa.float64()),
        }))
    with duckdb.connect() as con:
        con.register("runs_raw", pa.concat_tables(parts))
        con.register("weights", pa.table({"r": pa.array(range(len(w)), pa.int32()), "w": pa.array(w, pa.float64())}))
        if pairs is None:
            con.execute("CREATE TEMP TABLE cand AS SELECT DISTINCT query_id, doc_id FROM runs_raw")
        else:
            con.register("pairs_in", pairs.select(["query_id", "doc_id"]))
            con.execute("CREATE TEMP TABLE cand AS SELECT DISTINCT query_id, doc_id FROM pairs_in")
        # Rows in a fixed order (doc_id is unique per run and query after the GROUP BY below): a sum's last
        # bits depend on the order of its terms, and DuckDB's threads hand a partition's rows over in any
        # order; a teacher's score of a query must not depend on which other queries were scored with it
        # (label_scores in shards of 3 queries differed from one shard in the last bit).
        win = "OVER (PARTITION BY r, query_id ORDER BY doc_id ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)"
        if method == "zscore":
            norm = f"coalesce((score - avg(score) {win}) / nullif(stddev_pop(score) {win}, 0), 0)"
        elif method == "minmax":
            norm = f"coalesce((score - min(score) {win}) / nullif(max(score) {win} - min(score) {win}, 0), 0)"
        else:
            norm = f"1.0 / ({float(rrf_k)} + rank)"
        missing = "coalesce(m.floor, 0)" if method != "rrf" else "0"
        limit = f"WHERE pos <= {int(depth)}" if depth else ""
        return con.sql(f"""
            WITH runs AS (  -- one row per (run, query, doc) even if a run repeats a document
                     SELECT r, query_id, doc_id, max(score) AS score, min(rank) AS rank
                     FROM runs_raw GROUP BY r, query_id, doc_id),
                 norm AS (SELECT r, query_id, doc_id, {norm} AS ns FROM runs),
                 floors AS (SELECT r, query_id, min(ns) AS floor FROM norm GROUP BY r, query_id),
                 grid AS (SELECT cand.query_id, cand.doc_id, weights.r, weights.w FROM cand CROSS JOIN weights),
                 fused AS (
                     SELECT g.query_id, g.doc_id, sum(g.w * coalesce(n.ns, {missing}) ORDER BY g.r) AS score
                     FROM grid g
                     LEFT JOIN norm n ON n.r = g.r AND n.query_id = g.query_id AND n.doc_id = g.doc_id
                     LEFT JOIN floors m ON m.r = g.r AND m.query_id = g.query_id
                     GROUP BY g.query_id, g.doc_id),
                 ranked AS (SELECT *, row_number() OVER (PARTITION BY query_id ORDER BY score DESC, doc_id) AS pos
                            FROM fused)
            SELECT query_id, doc_id, CAST(pos AS INTEGER) AS rank, score, ? AS system
            FROM ranked {limit}
            ORDER BY query_id, rank
        """, params=[system]).to_arrow_table()
