"""What the catalog and the store hold about one run, read for reports: its row, its stages, its
metrics, and the tables its evaluate stages read and wrote.

Everything is found through the catalog: ``runs`` for the run, ``stage_runs`` for what each stage of
it did (computed or cached, and the dataset ids it output), ``edges`` for what an evaluate stage read
(its ranking, qrels, queries and corpus, by role), ``datasets`` for where a dataset's files are.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from irflow.engine.catalog import Catalog
from irflow.engine.errors import UserError
from irflow.engine.labels import stage_name
from irflow.engine.store import TABLE_FILE

RECENT = 5  # runs named when a run id is not found


class UnknownRun(UserError):
    """A run id (or prefix) that names no run of the store; the message lists the recent runs."""


def recent_runs(catalog: Catalog, n: int = RECENT) -> list[dict]:
    with catalog.connect() as con:
        rows = con.execute("SELECT run_id, flow, status, started_at FROM runs ORDER BY started_at DESC LIMIT ?",
                           [n]).fetchall()
    return [{"run_id": r[0], "flow": r[1], "status": r[2], "started_at": r[3]} for r in rows]


def _recent_line(catalog: Catalog) -> str:
    runs = recent_runs(catalog)
    if not runs:
        return "the store has no runs yet"
    return "recent runs: " + ", ".join(f"{r['run_id']} ({r['status']}, {r['started_at']:%Y-%m-%d %H:%M})"
                                       for r in runs)


def resolve_run(catalog: Catalog, run_id: str) -> str:
    """A full run id from an id, a unique prefix of one, or ``latest`` (the run started last)."""
    if run_id == "latest":
        runs = recent_runs(catalog, 1)
        if not runs:
            raise UnknownRun(f"no runs in {catalog.root}: run something first")
        return runs[0]["run_id"]
    with catalog.connect() as con:
        ids = [r[0] for r in con.execute("SELECT run_id FROM runs WHERE starts_with(run_id, ?) ORDER BY run_id",
                                         [run_id]).fetchall()]
    if run_id in ids:
        return run_id
    if len(ids) == 1:
        return ids[0]
    what = f"'{run_id}' is ambiguous ({', '.join(ids[:5])})" if ids else f"no run '{run_id}' in {catalog.root}"
    raise UnknownRun(f"{what}; {_recent_line(catalog)}")


def run_row(catalog: Catalog, run_id: str) -> dict:
    """The run's row of ``runs``, its config parsed."""
    with catalog.connect() as con:
        cur = con.execute("SELECT run_id, flow, config_path, config, started_at, finished_at, status FROM runs "
                          "WHERE run_id = ?", [run_id])
        row = cur.fetchone()
        cols = [d[0] for d in cur.description]
    info = dict(zip(cols, row))
    info["config"] = json.loads(info["config"]) if info["config"] else {}
    return info


def metric_rows(catalog: Catalog, run_id: str) -> list[dict]:
    """The run's metrics table, one dict per (system, dataset, split) with every metric as a key and the
    number of queries averaged over: what ``irflow run`` prints."""
    with catalog.connect() as con:
        rows = con.execute("SELECT system, dataset, split, metric, value, num_queries FROM metrics WHERE run_id = ? "
                           "ORDER BY rowid", [run_id]).fetchall()
    out: dict[tuple, dict] = {}
    for system, dataset, split, metric, value, num_queries in rows:
        row = out.setdefault((system, dataset, split), {"system": system, "dataset": dataset, "split": split})
        row[metric] = value
        if num_queries is not None:
            row["num_queries"] = max(row.get("num_queries", 0), num_queries)
    return list(out.values())


def stage_runs(catalog: Catalog, run_id: str) -> list[dict]:
    """What each stage of the run did, in order: name, status (computed | cached), seconds, outputs, key, and
    for a computed map stage its input rows computed and reused (``rows``, irflow.engine.row_reuse; else None)."""
    with catalog.connect() as con:
        rows = con.execute("SELECT stage, status, seconds, outputs, cache_key, detail FROM stage_runs "
                           "WHERE run_id = ? ORDER BY position", [run_id]).fetchall()
    return [{"name": r[0], "status": r[1], "seconds": r[2], "outputs": json.loads(r[3]), "cache_key": r[4],
             "rows": json.loads(r[5] or "{}").get("rows") if r[1] == "computed" else None}
            for r in rows]


def stage_inputs(catalog: Catalog, dataset_id: str, cache_key: str) -> dict[str, list[str]]:
    """role -> parent dataset ids of an output, as the stage run with ``cache_key`` read them (edges)."""
    with catalog.connect() as con:
        rows = con.execute("SELECT role, parent_id FROM edges WHERE child_id = ? AND cache_key = ? ORDER BY role, "
                           "parent_id", [dataset_id, cache_key]).fetchall()
    out: dict[str, list[str]] = defaultdict(list)
    for role, parent in rows:
        out[role].append(parent)
    return dict(out)


def parquet_path(catalog: Catalog, dataset_id: str) -> Path:
    info = catalog.dataset(dataset_id)
    if info is None or info["path"] is None:
        raise UserError(f"dataset {dataset_id} is not in the catalog {catalog.path}")
    return Path(info["path"]) / TABLE_FILE


def read_table(catalog: Catalog, dataset_id: str, columns: list[str] | None = None, where=None) -> pa.Table:
    """A stored table (only ``columns``, only rows matching the pyarrow expression ``where``): a report
    reads a few rows of a corpus or a ranking, never the whole file into memory first."""
    return ds.dataset(parquet_path(catalog, dataset_id), format="parquet").to_table(columns=columns, filter=where)


def evaluations(catalog: Catalog, run_id: str) -> list[dict]:
    """One dict per evaluate stage of the run that finished: its label, the per-query dataset id it output,
    and what it read (``ranking``, ``qrels``, ``queries``, ``corpus``: dataset ids), plus the stage that
    made the ranking in this run (``ranking_stage``, e.g. ``dense_search[zero-shot]``), if one did."""
    stages = stage_runs(catalog, run_id)
    made_by = {did: s["name"] for s in stages for did in s["outputs"].values()}
    out = []
    for s in stages:
        if stage_name(s["name"]) != "evaluate" or "per_query" not in s["outputs"]:
            continue
        per_query = s["outputs"]["per_query"]
        inputs = {role: ids[0] for role, ids in stage_inputs(catalog, per_query, s["cache_key"]).items()}
        out.append({"stage": s["name"], "per_query": per_query, **inputs,
                    "ranking_stage": made_by.get(inputs.get("ranking"))})
    return out


def per_query_values(catalog: Catalog, per_query_id: str, metric: str) -> dict[str, dict[str, float]]:
    """system -> {query_id -> value} of one metric, from an evaluate stage's per-query output."""
    t = read_table(catalog, per_query_id, ["system", "query_id", "value"], ds.field("metric") == metric)
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for system, q, v in zip(t.column("system").to_pylist(), t.column("query_id").to_pylist(),
                            t.column("value").to_pylist()):
        out[system][q] = v
    return dict(out)


def metrics_evaluated(catalog: Catalog, per_query_id: str) -> list[str]:
    t = read_table(catalog, per_query_id, ["metric"])
    return sorted(set(pc.unique(t.column("metric")).to_pylist()))
