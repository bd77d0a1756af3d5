"""The end of every flow: record the run's metrics in the catalog and show them (and, in Prefect,
the metrics table, a summary of the run and every denoising histogram of the run as artifacts).

Not a cached stage: it costs nothing and must happen in every run, cached or not, so that
`SELECT * FROM metrics WHERE run_id = ...` always answers for the run.

Each row (one per system, dataset and split) also says over how many judged queries its metrics are
averaged (``num_queries``) and how many of those have no judged document in the corpus
(``no_judged_doc``): with ``dataset.dangling_qrels: keep``, the default, they stay in the average and
score 0, as in the numbers BEIR, Pyserini and MTEB publish.
"""

from __future__ import annotations

import json
import logging

from irflow.engine.runner import Run

log = logging.getLogger("irflow")

COLUMNS = ["ndcg@10", "recall@100", "map@100", "mrr@10"]
#: Counts carried from the evaluation's metrics table into each row (not metrics: shown as integers).
COUNTS = ["num_queries", "no_judged_doc"]
HEADERS = {"num_queries": "queries", "no_judged_doc": "no_judged_doc"}


def record_metrics(run: Run, evals: list[dict]) -> list[dict]:
    catalog = run.catalog
    counts: dict[tuple, dict] = {}
    for ev in evals:
        rows = ev["metrics"].table().to_pylist()
        catalog.record_metrics(run.run_id, ev["metrics"].id, rows)
        for r in rows:
            c = counts.setdefault((r["system"], r["dataset"], r["split"]), {})
            for k in COUNTS:
                if r.get(k) is not None:
                    c[k] = max(c.get(k, 0), r[k])
    return [{**row, **counts.get((row["system"], row["dataset"], row["split"]), {})}
            for row in catalog.run_metrics(run.run_id)]


def _cell(value, width: int) -> str:
    if value is None:
        return f"{'':>{width}}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:>{width}d}"
    return f"{value:>{width}.4f}"


def format_table(rows: list[dict], columns: list[str] = COLUMNS) -> str:
    if not rows:
        return "(no metrics)"
    fixed = {"system", "dataset", "split", *COUNTS}
    cols = [c for c in columns if any(c in r for r in rows)] + sorted(
        {k for r in rows for k in r} - set(columns) - fixed) + [c for c in COUNTS if any(c in r for r in rows)]
    widths = [max(10, len(HEADERS.get(c, c))) for c in cols]
    width = max(len("system"), *(len(r["system"]) for r in rows))
    dw = max(10, *(len(r["dataset"]) for r in rows))
    head = f"{'system':<{width}}  {'dataset':<{dw}} {'split':<6} " + " ".join(
        f"{HEADERS.get(c, c):>{w}}" for c, w in zip(cols, widths))
    lines = [head, "-" * len(head)]
    for r in rows:
        vals = " ".join(_cell(r.get(c), w) for c, w in zip(cols, widths))
        lines.append(f"{r['system']:<{width}}  {r['dataset']:<{dw}} {r['split']:<6} {vals}")
    notes = {(r["dataset"], r["split"]): (r["no_judged_doc"], r.get("num_queries")) for r in rows
             if r.get("no_judged_doc")}
    for (dataset, split), (n, total) in notes.items():
        of = f" of {total}" if total is not None else ""
        lines.append(f"{dataset} {split}: {n}{of} judged queries have no judged document in the corpus; they are "
                     f"averaged in with 0, as in published BEIR numbers (dataset.dangling_qrels: drop leaves them "
                     f"out)")
    return "\n".join(lines)


def histogram_markdown(data: dict, png: str, dataset_id: str) -> str:
    """A denoise histogram (its histogram.json) as a markdown table: probability bins x counts."""
    groups = list(data["counts"])
    lines = [f"**{data['title']}** (thresholds: {data['thresholds']})", "",
             "| probability | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for i, lo in enumerate(data["edges"][:-1]):
        lines.append(f"| {lo:.2f}-{data['edges'][i + 1]:.2f} | " + " | ".join(str(data["counts"][g][i]) for g in groups)
                     + " |")
    return "\n".join(lines + ["", f"PNG: `{png}` (dataset {dataset_id})"])


def summary_markdown(run: Run, rows: list[dict], selected: dict | None = None, promotion: dict | None = None) -> str:
    """The run in a few lines of markdown (Prefect's artifact): what its stages did, its metrics, the
    model it selected and whether it was promoted, and the commands that show more (the HTML report, the
    graph)."""
    stages = run.catalog.stage_runs(run.run_id)
    counts = {st: sum(s["status"] == st for s in stages) for st in ("computed", "cached")}
    skipped = list(dict.fromkeys(s["name"] for s in run.skipped))
    lines = [f"## irflow run {run.run_id}", "",
             f"{len(stages)} stages: {counts['computed']} computed, {counts['cached']} cached"
             + (f"; not run (--to): {', '.join(skipped)}" if skipped else ""), ""]
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    if rows:
        lines += ["| system | dataset | split | " + " | ".join(cols) + " |", "|---" * (3 + len(cols)) + "|"]
        lines += [f"| {r['system']} | {r['dataset']} | {r['split']} | "
                  + " | ".join("" if r.get(c) is None else f"{r[c]:.4f}" for c in cols) + " |" for r in rows]
    else:
        lines.append("(no metrics)")
    if selected:
        if selected["evaluation"] != "labelled":
            lines += ["", f"Evaluation: {selected['evaluation']} -- a proxy, not relevance labels."]
        lines += ["", f"Selected model: **{selected['system']}** (`{selected['model_id']}`): {selected['reason']}"]
    if promotion:
        lines += ["", f"Promotion (**{promotion['decision']}**): {promotion['reason']}; "
                      f"`irflow export {promotion['alias']} --out DIR` hands out the model it holds"]
    store = run.store_root
    lines += ["", f"HTML report: `irflow report {run.run_id} --store {store} --out {store}/reports/{run.run_id}`",
              f"Graph: `irflow dag {run.run_id} --store {store} --out {run.run_id}.svg`"]
    return "\n".join(lines)


def _artifact_key(stage_label: str) -> str:
    """denoise[ce] -> denoise-ce (Prefect artifact keys: lowercase, digits and dashes)."""
    from irflow.engine.labels import stage_name, tag

    return "-".join(filter(None, (stage_name(stage_label), tag(stage_label)))).replace("_", "-")


def publish_summary(run: Run, rows: list[dict], selected: dict | None, promotion: dict | None) -> None:
    """The run-summary artifact again, with the promotion decided after ``report`` (a new version of it)."""
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(key="run-summary", markdown=summary_markdown(run, rows, selected, promotion),
                                 description=f"irflow run {run.run_id}")
    except Exception:  # noqa: BLE001 -- outside a Prefect run there is no artifact store
        pass


def report(run: Run, evals: list[dict], selected: dict | None = None) -> list[dict]:
    rows = record_metrics(run, evals)
    try:
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is None:  # outside a Prefect flow run (tests, dry runs): no artifact store
            return rows
    except ImportError:
        return rows
    try:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        description = f"irflow run {run.run_id}"
        create_table_artifact(key="metrics", table=rows, description=description)
        create_markdown_artifact(key="run-summary", markdown=summary_markdown(run, rows, selected),
                                  description=description)
        for s in run.catalog.stage_runs(run.run_id):  # denoise[ce] -> artifact denoise-ce
            if "histogram" in s["outputs"]:
                where = run.store.object_dir(s["outputs"]["histogram"])
                markdown = histogram_markdown(json.loads((where / "histogram.json").read_text()),
                                              str(where / "histogram.png"), s["outputs"]["histogram"])
                create_markdown_artifact(key=_artifact_key(s["name"]),
                                         markdown=markdown, description=description)
    except Exception as e:  # noqa: BLE001 -- the artifacts are a view; the run's results are in the catalog
        log.warning("report: the Prefect artifacts of run %s were not written (%s: %s); the metrics are in the "
                    "catalog (irflow report)", run.run_id, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
    return rows
