"""The lineage catalog: one DuckDB file next to the store's objects.

Tables
- runs        one row per `irflow run` (config, flow, timing, Prefect flow-run id)
- datasets    every published dataset/model/index: who made it (stage, params, code version, run)
- edges       lineage: child dataset <- parent dataset, with the input role it played
- cache       cache key -> output dataset ids (how a stage finds its earlier result)
- stage_runs  what each run did per stage: computed or cached, seconds, outputs
- metrics     evaluation results of each run
- selections  the model each run selected to ship (irflow.decide.selection)
- aliases     named aliases (production): one row per promotion decision (irflow.decide.promotion)

A dataset row with stage ``external`` is something no stage made: a dataset source (zip, folder) or a
model named in a config (hub id, local directory). Lineage ends there.

`Catalog.connect_with_views()` (what `irflow sql` queries) also exposes every stored Parquet dataset as a view.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import socket
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import duckdb

from irflow.engine import memdb
from irflow.engine.catalog_decisions import ALIAS_COLUMNS, Decisions, now  # noqa: F401 -- also found here

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs(
  run_id VARCHAR PRIMARY KEY, flow VARCHAR, config_path VARCHAR, config JSON,
  started_at TIMESTAMP, finished_at TIMESTAMP, status VARCHAR, prefect_flow_run_id VARCHAR);
CREATE TABLE IF NOT EXISTS datasets(
  dataset_id VARCHAR PRIMARY KEY, name VARCHAR, kind VARCHAR, contract VARCHAR, path VARCHAR,
  num_rows BIGINT, num_bytes BIGINT, stage VARCHAR, cache_key VARCHAR, code_version VARCHAR,
  params JSON, run_id VARCHAR, created_at TIMESTAMP);
CREATE TABLE IF NOT EXISTS edges(
  child_id VARCHAR, parent_id VARCHAR, role VARCHAR, cache_key VARCHAR);
CREATE TABLE IF NOT EXISTS cache(
  cache_key VARCHAR, output VARCHAR, dataset_id VARCHAR, stage VARCHAR, created_at TIMESTAMP,
  PRIMARY KEY (cache_key, output));
CREATE TABLE IF NOT EXISTS stage_runs(
  run_id VARCHAR, position INTEGER, stage VARCHAR, cache_key VARCHAR, status VARCHAR,
  outputs JSON, seconds DOUBLE, started_at TIMESTAMP, detail JSON);
CREATE TABLE IF NOT EXISTS forced(run_id VARCHAR, dataset_id VARCHAR);
CREATE TABLE IF NOT EXISTS metrics(
  run_id VARCHAR, eval_dataset_id VARCHAR, system VARCHAR, dataset VARCHAR, split VARCHAR,
  metric VARCHAR, value DOUBLE, num_queries BIGINT);
-- The runtime (device, precision, threads, library versions) a dataset
-- was computed with. Provenance only: never part of a cache key.
ALTER TABLE datasets ADD COLUMN IF NOT EXISTS runtime JSON;
ALTER TABLE stage_runs ADD COLUMN IF NOT EXISTS runtime JSON;
-- The full sha256 of an object's files (its id holds the first 16
-- hex), checked before the object is reused or read.
ALTER TABLE datasets ADD COLUMN IF NOT EXISTS digest VARCHAR;
-- Which process runs it, so a later run can tell a run that was killed
-- (status 'interrupted') from one still going.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS pid INTEGER;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS host VARCHAR;
-- One row per shard of a computed sharded stage (where it ran, how long;
-- status computed, or resumed: its part was left by an earlier, interrupted run).
CREATE TABLE IF NOT EXISTS shard_runs(
  run_id VARCHAR, stage VARCHAR, cache_key VARCHAR, shard INTEGER, start_row BIGINT, stop_row BIGINT,
  host VARCHAR, pid INTEGER, device VARCHAR, seconds DOUBLE, status VARCHAR);
-- For run graphs (irflow.tools.dag): the stages --to left out ({name, inputs, outputs} each) and the
-- stage that failed ({name, inputs, seconds}); NULL: none. Neither has a stage_runs row.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS skipped JSON;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS failed_stage JSON;
-- What the computation that made a dataset warned about (a JSON list of
-- messages; NULL: nothing, or made before this column). A run that reuses the dataset says them again.
ALTER TABLE datasets ADD COLUMN IF NOT EXISTS warnings JSON;
-- The model each run selected to ship (irflow.decide.selection): its system and id, the metric on the run's
-- evaluation (labelled, or a proxy), and why.
CREATE TABLE IF NOT EXISTS selections(
  run_id VARCHAR PRIMARY KEY, system VARCHAR, model_id VARCHAR, metric VARCHAR, value DOUBLE,
  start_system VARCHAR, start_value DOUBLE, p_value DOUBLE, evaluation VARCHAR, reason VARCHAR,
  models JSON);
-- Named aliases (irflow.decide.promotion): one row per decision of a run with promote.alias, promoted or
-- kept, with the numbers and the reason. An alias's current model is its latest promoted row (seq).
CREATE TABLE IF NOT EXISTS aliases(
  seq BIGINT, alias VARCHAR, decision VARCHAR, model_id VARCHAR, run_id VARCHAR, system VARCHAR,
  previous_model_id VARCHAR, metric VARCHAR, value DOUBLE, previous_value DOUBLE, p_value DOUBLE,
  evaluation VARCHAR, reason VARCHAR, decided_at TIMESTAMP);
-- What `irflow run` estimated for each stage before the run (irflow.tools.estimate): the figure from the
-- shipped rates (prior) and the one it printed, the hardware it was for and the cores other processes kept busy
-- then (runtime.others_busy).
-- Later estimates on the same hardware are calibrated by measured / prior of these stages.
CREATE TABLE IF NOT EXISTS estimates(
  run_id VARCHAR, stage VARCHAR, kind VARCHAR, prior DOUBLE, seconds DOUBLE, hardware VARCHAR, load DOUBLE);
"""


# DuckDB allows one writing process per file; inside a process we serialise access ourselves so
# that Prefect's worker threads can record lineage safely.
_LOCK = threading.RLock()


class CatalogLocked(RuntimeError):
    """Another process kept the catalog file locked for longer than we were willing to wait."""


def when_unlocked(open_fn, path: str, timeout: float | None = None):
    """open_fn(), retried while another process holds the DuckDB file's lock.

    DuckDB lets one process at a time open a database file for writing. irflow holds a catalog
    connection only for the moment it reads or records something, so two irflow processes on one
    store (a scheduled run and a shell run, `irflow sql` during a run) mostly just take turns; we
    retry for up to `timeout` seconds ($IRFLOW_CATALOG_LOCK_TIMEOUT, default 60) before giving up.
    """
    timeout = float(os.environ.get("IRFLOW_CATALOG_LOCK_TIMEOUT", 60)) if timeout is None else timeout
    deadline, pause = time.monotonic() + timeout, 0.02
    while True:
        try:
            return open_fn()
        except duckdb.IOException as e:
            if "lock" not in str(e).lower():
                raise
            if time.monotonic() >= deadline:
                holder = re.search(r"\(PID (\d+)\)", str(e))
                raise CatalogLocked(f"the catalog {path} is in use by another process"
                                    f"{f' (PID {holder.group(1)})' if holder else ''} and stayed locked for "
                                    f"{timeout:g} s; wait for it to finish, or use another --store") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.5)


# Each catalog access ATTACHes the catalog file to the process's in-memory DuckDB (irflow.engine.memdb) and
# DETACHes it after: the file is locked only for the access, as with a connection per access (two
# irflow processes on one store take turns, see ``when_unlocked``). A connection per access cost
# 20-25 ms to open and close (a new DuckDB instance each time); an ATTACH of the file costs ~2 ms, ~11
# ms with a write (DETACH checkpoints, as close did). A fully cached re-run of the GPL demo (31 stages,
# ~220 accesses) spent 3.5 s of its 6.3 s under cProfile opening instances; `irflow run` of it now
# spends 1.9 s in its flow, 3.3 s before.
_ATTACHED: dict[str, list] = {}  # catalog path -> [alias, read_only, open accesses]
_ATTACHED_IN: list = [None]  # the process they are attached in
_ALIASES = itertools.count(1)


@contextmanager
def _attached(path: str, read_only: bool):
    """A connection whose default database is the catalog at ``path``, attached for this block (call
    it under ``_LOCK``). Nested accesses to one catalog share its attachment; the outermost detaches it.
    A cursor of its own (never the instance's first connection, which other threads' cursors are made
    from): what is ATTACHed belongs to the instance, whichever connection attached it."""
    if _ATTACHED_IN[0] != os.getpid():  # a forked child: its instance is new, nothing is attached to it
        _ATTACHED.clear()
        _ATTACHED_IN[0] = os.getpid()
    cur = memdb.cursor()
    try:
        entry = _ATTACHED.get(path)
        if entry is None:
            alias = f"catalog_{next(_ALIASES)}"
            quoted = path.replace("'", "''")
            attach = f"ATTACH '{quoted}' AS {alias}" + (" (READ_ONLY)" if read_only else "")
            try:
                when_unlocked(lambda: cur.execute(attach), path)
            except duckdb.Error:
                # ResourceInUseException ("already attached by database catalog_N"): a Ctrl-C landed
                # between an ATTACH and its bookkeeping here, or inside a DETACH, and left the file
                # attached under an alias nobody uses. That attachment is detached and the file attached
                # again; without this every later access of the run (its 'interrupted' row too) fails.
                if not _detach_orphans(cur, path):
                    raise
                when_unlocked(lambda: cur.execute(attach), path)
            entry = _ATTACHED[path] = [alias, read_only, 0]
        elif entry[1] and not read_only:
            raise RuntimeError(f"the catalog {path} is open read-only here; a write cannot nest inside that access")
        entry[2] += 1
        try:
            cur.execute(f"USE {entry[0]}")
            yield cur
        finally:
            entry[2] -= 1
            if entry[2] == 0:
                del _ATTACHED[path]
                cur.execute("USE memory")  # a connection cannot detach its default database
                cur.execute(f"DETACH {entry[0]}")
    finally:
        cur.close()


def _detach_orphans(cur, path: str) -> bool:
    """Detach every attachment of the catalog file ``path`` that ``_ATTACHED`` does not know of (an
    access interrupted half-way left it); whether there was one."""
    known = {entry[0] for entry in _ATTACHED.values()}
    target = os.path.realpath(path)
    orphans = [name for name, attached in cur.execute(
        "SELECT database_name, path FROM duckdb_databases() WHERE path IS NOT NULL").fetchall()
        if name not in known and os.path.realpath(attached) == target]
    for name in orphans:
        # debug only: after a Ctrl-C the CLI's one line "interrupted" is all the console says
        logging.getLogger(__name__).debug("catalog %s left attached as %s by an interrupted access: detached",
                                          path, name)
        cur.execute("USE memory")
        cur.execute(f"DETACH {name}")
    return bool(orphans)


class Catalog(Decisions):
    """The lineage catalog of one store (``<store>/catalog.duckdb``).

    Paths of stored objects are kept relative to the store root (``objects/<id>``), so a store can be
    moved or copied: a moved store still hits its cache, and a copy reads its own objects, never the
    original's. Paths outside the store (a local model directory) stay absolute."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.root = Path(self.path).resolve().parent
        with self.connect() as con:
            con.execute(SCHEMA)
            # Stores written before paths were relative: every stored object lives at objects/<id>.
            con.execute("UPDATE datasets SET path = 'objects/' || dataset_id "
                        "WHERE path LIKE '/%/objects/' || dataset_id")

    def _rel(self, path: str | None) -> str | None:
        """How a path is recorded: relative to the store root when inside it."""
        if path is None or "://" in path or not Path(path).exists():
            return path  # a URL or a hub id: not a place on this disk
        full = Path(path).resolve()
        try:
            return full.relative_to(self.root).as_posix()
        except ValueError:
            return str(full)

    def _abs(self, path: str | None) -> str | None:
        """A recorded path as a usable one: relative paths are below this store's root."""
        if path is None or Path(path).is_absolute() or "://" in path:
            return path
        if path.startswith("objects/") or (self.root / path).exists():
            return str(self.root / path)
        return path  # a hub id

    @contextmanager
    def connect(self, read_only: bool = False):
        """A connection to the catalog, held only for the ``with`` block (see ``_attached``)."""
        with _LOCK, _attached(self.path, read_only) as con:
            yield con

    # ---- runs -----------------------------------------------------------------------------
    def start_run(self, run_id: str, flow: str, config_path: str | None, config: dict) -> list[str]:
        """Record a new run as 'running'; first, mark runs whose process died as 'interrupted'
        (a kill -9 or a power cut leaves no chance to say so). Returns the ids of those."""
        interrupted = self.mark_interrupted()
        with self.connect() as con:
            con.execute(
                "INSERT INTO runs (run_id, flow, config_path, config, started_at, finished_at, status, "
                "prefect_flow_run_id, pid, host) VALUES (?, ?, ?, ?, ?, NULL, 'running', NULL, ?, ?)",
                [run_id, flow, config_path, json.dumps(config, sort_keys=True), now(), os.getpid(),
                 socket.gethostname()],
            )
        return interrupted

    def mark_interrupted(self) -> list[str]:
        """Runs still 'running' whose process (on this host) is gone become 'interrupted'."""
        from irflow.engine.processes import pid_alive

        host = socket.gethostname()
        with self.connect() as con:
            rows = con.execute("SELECT run_id, pid, host FROM runs WHERE status = 'running'").fetchall()
            dead = [r for r, pid, h in rows if pid is None or (h == host and not pid_alive(pid))]
            for run_id in dead:
                con.execute("UPDATE runs SET status = 'interrupted' WHERE run_id = ?", [run_id])
        return dead

    def finish_run(self, run_id: str, status: str, prefect_flow_run_id: str | None = None,
                   skipped: list[dict] | None = None, failed_stage: dict | None = None) -> None:
        with self.connect() as con:
            con.execute(
                "UPDATE runs SET finished_at = ?, status = ?, prefect_flow_run_id = coalesce(?, prefect_flow_run_id), "
                "skipped = ?, failed_stage = ? WHERE run_id = ?",
                [now(), status, prefect_flow_run_id, json.dumps(skipped) if skipped else None,
                 json.dumps(failed_stage) if failed_stage else None, run_id],
            )

    def run(self, run_id: str) -> dict | None:
        """The runs row of a run (its JSON columns decoded), or None."""
        with self.connect() as con:
            cur = con.execute("SELECT * FROM runs WHERE run_id = ?", [run_id])
            row = cur.fetchone()
            cols = [d[0] for d in cur.description]
        if row is None:
            return None
        info = dict(zip(cols, row))
        for k in ("config", "skipped", "failed_stage"):
            info[k] = json.loads(info[k]) if info.get(k) else None
        return info

    # ---- cache + lineage ------------------------------------------------------------------
    def lookup(self, cache_key: str) -> dict:
        """output name -> DatasetRef for a cache key, if recorded."""
        from irflow.engine.store import DatasetRef

        with self.connect() as con:
            rows = con.execute(
                "SELECT c.output, d.dataset_id, d.name, d.kind, d.contract, d.path, d.digest FROM cache c "
                "JOIN datasets d USING (dataset_id) WHERE c.cache_key = ?",
                [cache_key],
            ).fetchall()
        return {r[0]: DatasetRef(*r[1:5], self._abs(r[5]), r[6]) for r in rows}

    def record_outputs(
        self,
        *,
        stage: str,
        cache_key: str,
        code_version: str,
        params: dict,
        run_id: str,
        outputs: dict[str, tuple[object, int | None, int]],
        parents: dict[str, list[str]],
        runtime: dict | None = None,
        warnings: list[str] | None = None,
    ) -> None:
        """outputs: name -> (DatasetRef, num_rows, num_bytes); parents: role -> parent ids; warnings: what
        the computation warned about."""
        ts = now()
        with self.connect() as con:
            con.execute("BEGIN")
            for output, (ref, num_rows, num_bytes) in outputs.items():
                con.execute(
                    "INSERT INTO datasets (dataset_id, name, kind, contract, path, num_rows, num_bytes, stage, "
                    "cache_key, code_version, params, run_id, created_at, runtime, digest, warnings) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT DO UPDATE SET digest = coalesce(datasets.digest, excluded.digest)",
                    [ref.id, ref.name, ref.kind, ref.contract, self._rel(ref.path), num_rows, num_bytes, stage,
                     cache_key,
                     code_version, json.dumps(params, sort_keys=True, default=str), run_id, ts,
                     json.dumps(runtime, sort_keys=True, default=str) if runtime else None,
                     getattr(ref, "digest", None), json.dumps(warnings) if warnings else None],
                )
                for role, ids in parents.items():
                    for pid in ids:
                        # once per (child, parent, role, key): recomputing the same output adds no edge
                        con.execute("INSERT INTO edges SELECT ?, ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM edges "
                                    "WHERE child_id = ? AND parent_id = ? AND role = ? AND cache_key = ?)",
                                    [ref.id, pid, role, cache_key] * 2)
                con.execute(
                    "INSERT OR REPLACE INTO cache VALUES (?, ?, ?, ?, ?)", [cache_key, output, ref.id, stage, ts]
                )
            con.execute("COMMIT")

    def warnings_of(self, dataset_ids: list[str]) -> list[tuple[str, str]]:
        """(message, run id) of what the computations that made these datasets warned about, each once."""
        if not dataset_ids:
            return []
        with self.connect() as con:
            rows = con.execute(
                f"SELECT warnings, run_id FROM datasets WHERE warnings IS NOT NULL AND dataset_id IN "
                f"({', '.join('?' * len(dataset_ids))}) ORDER BY dataset_id", dataset_ids).fetchall()
        out: list[tuple[str, str]] = []
        for warnings, run_id in rows:
            out += [(m, run_id) for m in json.loads(warnings) if (m, run_id) not in out]
        return out

    def record_external(self, ref, run_id: str, params: dict) -> None:
        """A dataset source or a config-named model, so lineage ends at something with a name.
        Its path is where it was found last (a local model directory may move: same id, new path)."""
        with self.connect() as con:
            con.execute(
                "INSERT INTO datasets (dataset_id, name, kind, contract, path, stage, params, run_id, created_at) "
                "VALUES (?, ?, ?, NULL, ?, 'external', ?, ?, ?) "
                "ON CONFLICT (dataset_id) DO UPDATE SET path = excluded.path",
                [ref.id, ref.name, ref.kind, self._rel(ref.path), json.dumps(params, sort_keys=True), run_id, now()],
            )

    def record_stage_run(self, run_id: str, stage: str, cache_key: str, status: str, outputs: dict[str, str],
                         seconds: float, started_at: datetime, detail: dict | None = None,
                         runtime: dict | None = None) -> None:
        """detail: what the key was made of ({version, cfg, inputs}), so `irflow status` can say why a
        stage is stale by diffing it against the last execution. runtime: where and how a computed
        stage ran (None when cached)."""
        with self.connect() as con:
            pos = con.execute("SELECT count(*) FROM stage_runs WHERE run_id = ?", [run_id]).fetchone()[0]
            con.execute(
                "INSERT INTO stage_runs (run_id, position, stage, cache_key, status, outputs, seconds, started_at, "
                "detail, runtime) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [run_id, pos, stage, cache_key, status, json.dumps(outputs), seconds, started_at,
                 json.dumps(detail or {}, sort_keys=True, default=str),
                 json.dumps(runtime, sort_keys=True, default=str) if runtime else None],
            )

    def record_shards(self, run_id: str, stage: str, cache_key: str, records: list[dict]) -> None:
        with self.connect() as con:
            for r in records:
                con.execute("INSERT INTO shard_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            [run_id, stage, cache_key, r["index"], r["rows"][0], r["rows"][1], r["host"], r["pid"],
                             r["device"], r["seconds"], r["status"]])

    def last_stage_detail(self, stage: str, exclude_run: str | None = None) -> dict | None:
        """The key ingredients of the most recent execution of a stage label (any earlier run)."""
        with self.connect() as con:
            row = con.execute(
                "SELECT detail, run_id, cache_key FROM stage_runs WHERE stage = ? AND run_id IS DISTINCT FROM ? "
                "ORDER BY started_at DESC LIMIT 1",
                [stage, exclude_run],
            ).fetchone()
        return {**json.loads(row[0] or "{}"), "run_id": row[1], "cache_key": row[2]} if row else None

    def row_family_sources(self, family: str, role: str, limit: int = 5) -> list[dict]:
        """The latest computations of a row family (``irflow.engine.row_reuse``), newest first: {input: the id of
        its mapped input, outputs: {name: id}, run_id}."""
        with self.connect() as con:
            rows = con.execute(
                "SELECT run_id, detail, outputs FROM stage_runs WHERE status = 'computed' AND "
                "json_extract_string(detail, '$.row_family') = ? ORDER BY started_at DESC LIMIT ?", [family, limit]
            ).fetchall()
        out = []
        for run_id, detail, outputs in rows:
            inputs = json.loads(detail or "{}").get("inputs", {}).get(role) or []
            if inputs:
                out.append({"input": inputs[0], "outputs": json.loads(outputs), "run_id": run_id})
        return out

    def taint(self, run_id: str, dataset_ids: list[str]) -> None:
        with self.connect() as con:
            for d in dataset_ids:
                con.execute("INSERT INTO forced VALUES (?, ?)", [run_id, d])

    def tainted(self, run_id: str, dataset_ids: list[str]) -> bool:
        if not dataset_ids:
            return False
        with self.connect() as con:
            return bool(con.execute(
                f"SELECT count(*) FROM forced WHERE run_id = ? AND dataset_id IN ({', '.join('?' * len(dataset_ids))})",
                [run_id, *dataset_ids]).fetchone()[0])

    def stage_runs(self, run_id: str, with_inputs: bool = False) -> list[dict]:
        """What a run did per stage, in the order they finished (``started``: when, UTC; ``seconds``: how
        long, so stages that ran at once show as overlapping); ``with_inputs`` adds the ids each stage
        read, by role."""
        with self.connect() as con:
            rows = con.execute(
                "SELECT stage, status, outputs, seconds, cache_key, runtime, detail, started_at FROM stage_runs "
                "WHERE run_id = ? ORDER BY position",
                [run_id],
            ).fetchall()
            shards: dict[str, list[dict]] = {}  # the run's shards, read at once (not a connection per stage)
            for r in con.execute("SELECT cache_key, shard, start_row, stop_row, host, pid, device, seconds, status "
                                 "FROM shard_runs WHERE run_id = ? ORDER BY shard", [run_id]).fetchall():
                shards.setdefault(r[0], []).append({"index": r[1], "rows": [r[2], r[3]], "host": r[4], "pid": r[5],
                                                    "device": r[6], "seconds": r[7], "status": r[8]})
        return [
            {"name": r[0], "status": r[1], "outputs": json.loads(r[2]), "seconds": round(r[3], 3), "cache_key": r[4],
             "runtime": json.loads(r[5]) if r[5] else None, "started": r[7].isoformat() if r[7] else None,
             # map stages (irflow.engine.row_reuse): rows of the mapped input computed and reused
             "rows": json.loads(r[6] or "{}").get("rows") if r[1] == "computed" else None,
             **({"inputs": json.loads(r[6] or "{}").get("inputs", {})} if with_inputs else {}),
             "shards": shards.get(r[4], []) if r[1] == "computed" else []}
            for r in rows
        ]

    # ---- metrics --------------------------------------------------------------------------
    # ---- lineage --------------------------------------------------------------------------
    def dataset(self, dataset_id: str) -> dict | None:
        with self.connect() as con:
            cur = con.execute("SELECT * FROM datasets WHERE dataset_id = ?", [dataset_id])
            row = cur.fetchone()
            cols = [d[0] for d in cur.description]
        if not row:
            return None
        info = dict(zip(cols, row))
        info["path"] = self._abs(info["path"])
        return info

    def ref(self, dataset_id: str):
        """A recorded dataset as a ``DatasetRef`` (its table readable with ``.table()``), or None."""
        from irflow.engine.store import DatasetRef

        info = self.dataset(dataset_id)
        if info is None:
            return None
        return DatasetRef(dataset_id, info["name"], info["kind"], info["contract"], info["path"], info.get("digest"))

    def resolve(self, prefix: str) -> str:
        """A full dataset id from a unique prefix (ids are long; users type the start)."""
        with self.connect() as con:
            rows = con.execute(
                "SELECT dataset_id FROM datasets WHERE starts_with(dataset_id, ?) ORDER BY dataset_id", [prefix]
            ).fetchall()
        if not rows:
            raise KeyError(f"no dataset or model with id starting '{prefix}' in {self.path}")
        if len(rows) > 1 and rows[0][0] != prefix:
            raise KeyError(f"'{prefix}' is ambiguous: {[r[0] for r in rows[:5]]}")
        return rows[0][0]

    def parents(self, dataset_id: str) -> list[tuple[str, str]]:
        """(role, parent id) of the inputs a dataset was computed from (by the key that made it)."""
        with self.connect() as con:
            return con.execute(
                "SELECT e.role, e.parent_id FROM edges e JOIN datasets d ON d.dataset_id = e.child_id "
                "AND d.cache_key = e.cache_key WHERE e.child_id = ? ORDER BY e.role, e.parent_id",
                [dataset_id]).fetchall()

    def lineage(self, dataset_id: str) -> list[dict]:
        """The dataset and all its ancestors, each once, nearest first, with depth and parent ids."""
        seen: dict[str, dict] = {}
        frontier = [(dataset_id, 0)]
        with self.connect() as con:
            while frontier:
                did, depth = frontier.pop(0)
                if did in seen:
                    continue
                cur = con.execute("SELECT * FROM datasets WHERE dataset_id = ?", [did])
                row = cur.fetchone()
                if row is None:
                    seen[did] = {"dataset_id": did, "depth": depth, "missing": True, "parents": []}
                    continue
                info = dict(zip([d[0] for d in cur.description], row))
                info["path"] = self._abs(info["path"])
                parents = con.execute(
                    "SELECT role, parent_id FROM edges WHERE child_id = ? AND cache_key = ? ORDER BY role, parent_id",
                    [did, info["cache_key"]],
                ).fetchall()
                info["depth"] = depth
                info["parents"] = [{"role": r, "dataset_id": p} for r, p in parents]
                shard_rows = con.execute(
                    "SELECT shard, start_row, stop_row, host, pid, device, seconds, status FROM shard_runs "
                    "WHERE cache_key = ? AND run_id = ? ORDER BY shard", [info["cache_key"], info["run_id"]]).fetchall()
                info["shards"] = [{"index": r[0], "rows": [r[1], r[2]], "host": r[3], "pid": r[4], "device": r[5],
                                   "seconds": r[6], "status": r[7]} for r in shard_rows]
                made = con.execute("SELECT detail FROM stage_runs WHERE cache_key = ? AND run_id = ? AND "
                                   "status = 'computed' LIMIT 1", [info["cache_key"], info["run_id"]]).fetchone()
                info["rows"] = json.loads(made[0] or "{}").get("rows") if made else None  # irflow.engine.row_reuse
                seen[did] = info
                frontier.extend((p, depth + 1) for _, p in parents)
        return list(seen.values())

    # ---- store maintenance (irflow verify / gc) -------------------------------------------------
    def stored_objects(self) -> list:
        """A DatasetRef (with digest when recorded) for every dataset the catalog places in the store."""
        from irflow.engine.store import DatasetRef

        with self.connect() as con:
            rows = con.execute("SELECT dataset_id, name, kind, contract, path, digest FROM datasets "
                               "WHERE path LIKE 'objects/%' ORDER BY created_at").fetchall()
        return [DatasetRef(*r[:4], self._abs(r[4]), r[5]) for r in rows]

    def finished_keys(self) -> set[str]:
        with self.connect() as con:
            return {r[0] for r in con.execute("SELECT DISTINCT cache_key FROM cache").fetchall()}

    # ---- SQL ------------------------------------------------------------------------------
    def connect_with_views(self):
        """An in-memory DuckDB with the catalog attached read-only as `catalog` (its tables are also
        visible unqualified) and one view per stored table dataset, plus `all_<contract>` unions."""
        con = duckdb.connect()
        when_unlocked(lambda: con.execute(f"ATTACH '{self.path}' AS catalog (READ_ONLY)"), self.path)
        for t in ("runs", "datasets", "edges", "cache", "stage_runs", "metrics", "forced", "selections", "aliases"):
            con.execute(f"CREATE VIEW {t} AS SELECT * FROM catalog.main.{t}")
        rows = con.execute(
            "SELECT dataset_id, contract, path FROM catalog.main.datasets WHERE kind = 'table' ORDER BY created_at"
        ).fetchall()
        by_contract: dict[str, list[tuple[str, str]]] = {}
        for did, contract, path in rows:
            if path is None:
                continue
            pq_path = str(Path(self._abs(path)) / "data.parquet")
            if not Path(pq_path).exists():
                continue
            con.execute(f'CREATE VIEW "{did}" AS SELECT * FROM read_parquet(\'{pq_path}\')')
            by_contract.setdefault(contract, []).append((did, pq_path))
        for contract, items in by_contract.items():
            union = " UNION ALL ".join(
                f"SELECT '{did}' AS dataset_id, * FROM read_parquet('{p}')" for did, p in items
            )
            con.execute(f"CREATE VIEW all_{_ident(contract)} AS {union}")
        return con


def _ident(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)
