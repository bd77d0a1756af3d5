"""The end of every flow: record the run's metrics in the catalog and show them.

Not a cached stage: it costs nothing and must happen in every run, cached or not, so that
`SELECT * FROM metrics WHERE run_id = ...` always answers for the run.
"""

from __future__ import annotations

from irflow.stage import Run

COLUMNS = ["ndcg@10", "recall@100", "map@100", "mrr@10"]


def record_metrics(run: Run, evals: list[dict]) -> list[dict]:
    catalog = run.catalog
    for ev in evals:
        t = ev["metrics"].table()
        catalog.record_metrics(run.run_id, ev["metrics"].id, t.to_pylist())
    return catalog.run_metrics(run.run_id)


def format_table(rows: list[dict], columns: list[str] = COLUMNS) -> str:
    if not rows:
        return "(no metrics)"
    cols = [c for c in columns if any(c in r for r in rows)] + sorted(
        {k for r in rows for k in r} - set(columns) - {"system", "dataset", "split"})
    width = max(len("system"), *(len(r["system"]) for r in rows))
    head = f"{'system':<{width}}  {'dataset':<10} {'split':<6} " + " ".join(f"{c:>10}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        vals = " ".join(f"{r[c]:>10.4f}" if c in r else f"{'':>10}" for c in cols)
        lines.append(f"{r['system']:<{width}}  {r['dataset']:<10} {r['split']:<6} {vals}")
    return "\n".join(lines)


def report(run: Run, evals: list[dict]) -> list[dict]:
    rows = record_metrics(run, evals)
    try:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(key="metrics", table=rows, description=f"irflow run {run.run_id}")
    except Exception:  # noqa: BLE001 -- outside a Prefect run (tests, dry runs) there is no artifact store
        pass
    return rows
