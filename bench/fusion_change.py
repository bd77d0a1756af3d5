"""Did merging the two fusion implementations change the GPL fusion teacher?

Before typed recipes, the teacher (pseudo_label.fused_scores) normalised each run's list per query
*with* duplicate (query, doc) rows and then took the max, while the fuse stage deduplicated first.
Both are now irflow.learn.fusion.fuse_runs (deduplicate, then normalise). This script scores every
(query, doc) pair of the given miner runs with the old teacher's SQL (copied below verbatim in
substance, for the comparison only) and with fuse_runs, and reports how many scores differ.

    .venv/bin/python bench/fusion_change.py RUN_DIR_BM25 RUN_DIR_DENSE [--weights 0.3,0.7] [--out JSON]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import harness  # before irflow: puts this checkout on the path
from irflow.learn.fusion import fuse_runs


def old_teacher(runs: list[pa.Table], weights: list[float]) -> dict:
    """The pre-typed-recipes teacher: zscore per (run, query) over the rows as they are, max per doc,
    a doc a run did not return gets that run's minimum for the query."""
    tables = [t.select(["query_id", "doc_id", "score"]).append_column("run_idx", pa.array([i] * t.num_rows, pa.int32()))
              for i, t in enumerate(runs)]
    con = duckdb.connect()
    con.register("runs", pa.concat_tables(tables))
    con.register("weights", pa.table({"run_idx": pa.array(range(len(weights)), pa.int32()), "weight": weights}))
    con.execute("CREATE TEMP TABLE cand AS SELECT DISTINCT query_id, doc_id FROM runs")
    rows = con.sql("""
        WITH z AS (SELECT run_idx, query_id, doc_id, max(z) AS z FROM (
                     SELECT run_idx, query_id, doc_id,
                            coalesce((score - avg(score) OVER w) / nullif(stddev_pop(score) OVER w, 0), 0) AS z
                     FROM runs WINDOW w AS (PARTITION BY run_idx, query_id)) GROUP BY ALL),
             zmin AS (SELECT run_idx, query_id, min(z) AS zmin FROM z GROUP BY ALL),
             grid AS (SELECT c.query_id, c.doc_id, w.run_idx, w.weight FROM cand c CROSS JOIN weights w)
        SELECT g.query_id, g.doc_id, sum(g.weight * coalesce(z.z, zmin.zmin, 0)) AS score
        FROM grid g
        LEFT JOIN z ON z.run_idx = g.run_idx AND z.query_id = g.query_id AND z.doc_id = g.doc_id
        LEFT JOIN zmin ON zmin.run_idx = g.run_idx AND zmin.query_id = g.query_id
        GROUP BY ALL""").fetchall()
    return {(q, d): s for q, d, s in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run dataset dirs (data.parquet inside), in weight order")
    ap.add_argument("--weights", default="0.3,0.7")
    ap.add_argument("--out")
    args = ap.parse_args()
    tables = [pq.read_table(Path(r) / "data.parquet") for r in args.runs]
    weights = [float(w) for w in args.weights.split(",")]
    systems = [t.column("system")[0].as_py() for t in tables]
    dups = []
    for t in tables:
        con = duckdb.connect()
        con.register("t", t)
        dups.append(con.sql("SELECT count(*) - count(DISTINCT (query_id, doc_id)) FROM t").fetchall()[0][0])
    old = old_teacher(tables, weights)
    new_t = fuse_runs(tables, method="zscore", weights=dict(zip(systems, weights)))
    new = dict(zip(zip(new_t.column("query_id").to_pylist(), new_t.column("doc_id").to_pylist()),
                   new_t.column("score").to_pylist()))
    common = sorted(set(old) & set(new))
    diff = np.array([abs(old[k] - new[k]) for k in common])
    top1_changed = 0
    by_q_old, by_q_new = {}, {}
    for (q, d) in common:
        if q not in by_q_old or old[(q, d)] > old[(q, by_q_old[q])]:
            by_q_old[q] = d
        if q not in by_q_new or new[(q, d)] > new[(q, by_q_new[q])]:
            by_q_new[q] = d
    top1_changed = sum(by_q_old[q] != by_q_new[q] for q in by_q_old)
    report = {"runs": args.runs, "systems": systems, "weights": weights, "duplicate_rows_per_run": dups,
              "pairs_old": len(old), "pairs_new": len(new), "pairs_compared": len(common),
              "pairs_differing_gt_1e-9": int((diff > 1e-9).sum()), "max_abs_diff": float(diff.max(initial=0.0)),
              "queries": len(by_q_old), "top1_changed": top1_changed}
    print(json.dumps(report, indent=2))
    if args.out:
        print(f"wrote {harness.write_json(args.out, report)}")


if __name__ == "__main__":
    sys.exit(main())
