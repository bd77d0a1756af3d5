"""What runs decided and measured, in the catalog: metrics, the model each run selected, the estimates it was
promised, and the aliases (``production``) promotions move. A part of ``irflow.engine.catalog.Catalog``
(which opens the connection, ``connect``); the tables are created there."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import duckdb

from irflow.engine.processes import check_interrupted

ALIAS_COLUMNS = ("alias", "decision", "model_id", "run_id", "system", "previous_model_id", "metric", "value",
                 "previous_value", "p_value", "evaluation", "reason")


def now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Decisions:
    """The catalog's metrics, selections, estimates and aliases (a mixin of ``Catalog``)."""

    def connect(self, read_only: bool = False):  # Catalog's
        raise NotImplementedError

    def record_metrics(self, run_id: str, eval_dataset_id: str, rows: list[dict]) -> None:
        with self.connect() as con:
            con.execute("DELETE FROM metrics WHERE run_id = ? AND eval_dataset_id = ?", [run_id, eval_dataset_id])
            for r in rows:
                con.execute(
                    "INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [run_id, eval_dataset_id, r["system"], r["dataset"], r["split"], r["metric"], r["value"],
                     r.get("num_queries")],
                )

    def record_selection(self, run_id: str, sel: dict) -> None:
        with self.connect() as con:
            con.execute("INSERT OR REPLACE INTO selections VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [run_id, sel["system"], sel["model_id"], sel["metric"], sel["value"], sel["start"],
                         sel["start_value"], sel["p_value"], sel["evaluation"], sel["reason"],
                         json.dumps(sel.get("models") or {})])

    def record_estimates(self, run_id: str, rows: list[dict], hardware: str, load: float | None) -> None:
        """rows: {stage, kind, prior, seconds} of a run's estimate."""
        with self.connect() as con:
            for r in rows:
                con.execute("INSERT INTO estimates VALUES (?, ?, ?, ?, ?, ?, ?)",
                            [run_id, r["stage"], r["kind"], r["prior"], r["seconds"], hardware, load])

    def estimated_stages(self, hardware: str) -> list[dict]:
        """Every computed stage run that had an estimate on ``hardware``: {stage, kind, prior, measured,
        load (at the estimate), runtime}, newest first."""
        with self.connect(read_only=True) as con:
            try:
                rows = con.execute(
                    "SELECT e.stage, e.kind, e.prior, s.seconds, e.load, s.runtime FROM estimates e JOIN stage_runs s "
                    "ON e.run_id = s.run_id AND e.stage = s.stage WHERE s.status = 'computed' AND e.hardware = ? "
                    "ORDER BY s.started_at DESC", [hardware]).fetchall()
            except duckdb.CatalogException:  # a store no run of this version has written to
                return []
        return [{"stage": r[0], "kind": r[1], "prior": r[2], "measured": r[3], "load": r[4],
                 "runtime": json.loads(r[5]) if r[5] else {}} for r in rows]

    def selection(self, run_id: str) -> dict | None:
        with self.connect(read_only=True) as con:
            try:
                cur = con.execute("SELECT * FROM selections WHERE run_id = ?", [run_id])
            except duckdb.CatalogException:  # a store no run of this version has written to
                return None
            row = cur.fetchone()
            cols = [d[0] for d in cur.description]
        if row is None:
            return None
        out = dict(zip(cols, row))
        out["models"] = json.loads(out["models"] or "{}")
        return out

    def selections(self) -> list[dict]:
        """Every run's selection, oldest first (``irflow models``)."""
        with self.connect(read_only=True) as con:
            try:
                cur = con.execute("SELECT s.*, r.flow, r.started_at FROM selections s JOIN runs r USING (run_id) "
                                  "ORDER BY r.started_at")
            except duckdb.CatalogException:
                return []
            cols = [d[0] for d in cur.description]
            rows = [dict(zip(cols, r)) for r in cur.fetchall()]
        for r in rows:
            r["models"] = json.loads(r["models"] or "{}")
        return rows

    # ---- aliases (irflow.decide.promotion) ---------------------------------------------------------
    def record_alias(self, row: dict, expect: str | None = None) -> bool:
        """One decision about an alias (``ALIAS_COLUMNS``), in one transaction. A promotion (decision
        ``promoted``) is written only if the alias still holds ``expect`` (the model the run compared
        with; None: no model), else nothing is written and False returned. A Ctrl-C that came before the
        commit rolls it back: the alias keeps its model."""
        with self.connect() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                if row["decision"] == "promoted" and (self._alias(con, row["alias"]) or {}).get("model_id") != expect:
                    con.execute("ROLLBACK")
                    return False
                con.execute(f"INSERT INTO aliases (seq, {', '.join(ALIAS_COLUMNS)}, decided_at) SELECT coalesce(max(seq), 0) "
                            f"+ 1, {', '.join('?' * len(ALIAS_COLUMNS))}, ? FROM aliases",
                            [row.get(k) for k in ALIAS_COLUMNS] + [now()])
                check_interrupted()
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        return True

    def set_alias(self, alias: str, model_id: str, reason: str = "set by hand", run_id: str | None = None,
                  system: str | None = None) -> None:
        """Point ``alias`` at a model by hand (a roll-back, or a model chosen elsewhere). Without
        ``run_id`` the latest run that evaluated the model stands for it (its model card, its metrics)."""
        if run_id is None:
            for s in reversed(self.selections()):
                hit = next((name for name, m in s["models"].items() if m == model_id), None)
                if hit:
                    run_id, system = s["run_id"], system or hit
                    break
        current = self.alias(alias)
        self.record_alias({"alias": alias, "decision": "promoted", "model_id": model_id, "run_id": run_id,
                           "system": system, "previous_model_id": current["model_id"] if current else None,
                           "reason": reason}, expect=current["model_id"] if current else None)

    @staticmethod
    def _alias(con, alias: str) -> dict | None:
        cur = con.execute("SELECT * FROM aliases WHERE alias = ? AND decision = 'promoted' ORDER BY seq DESC "
                          "LIMIT 1", [alias])
        row = cur.fetchone()
        return dict(zip([d[0] for d in cur.description], row)) if row else None

    def alias(self, alias: str) -> dict | None:
        """The alias's current model: its latest promoted row (None: no model yet)."""
        with self.connect() as con:
            return self._alias(con, alias)

    def _alias_rows(self, where: str = "", params: list | None = None) -> list[dict]:
        with self.connect() as con:
            cur = con.execute(f"SELECT * FROM aliases {where} ORDER BY seq", params or [])
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    def aliases(self) -> list[dict]:
        """Every alias's current model (its latest promoted row), by alias name."""
        rows = self._alias_rows("WHERE decision = 'promoted' AND seq IN (SELECT max(seq) FROM aliases WHERE "
                                "decision = 'promoted' GROUP BY alias)")
        return sorted(rows, key=lambda r: r["alias"])

    def alias_history(self, alias: str | None = None) -> list[dict]:
        """Every decision about an alias (or about every alias), oldest first."""
        return self._alias_rows("WHERE alias = ?", [alias]) if alias else self._alias_rows()

    def promotion(self, run_id: str) -> dict | None:
        """The run's promotion decision (its last one), or None."""
        rows = self._alias_rows("WHERE run_id = ? AND seq = (SELECT max(seq) FROM aliases WHERE run_id = ?)",
                                [run_id, run_id])
        return rows[-1] if rows else None

    def run_metrics(self, run_id: str) -> list[dict]:
        """One dict per (system, dataset, split) with the metrics as keys, in recording order."""
        with self.connect() as con:
            rows = con.execute(
                "SELECT system, dataset, split, metric, value FROM metrics WHERE run_id = ? ORDER BY rowid",
                [run_id],
            ).fetchall()
        out: dict[tuple, dict] = {}
        for system, dataset, split, metric, value in rows:
            out.setdefault((system, dataset, split), {"system": system, "dataset": dataset, "split": split})[
                metric
            ] = value
        return list(out.values())
