"""Does RocketQA's denoising teacher order the lists it judges? The check the denoise stage logs, read
back from stores.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/teacher_check.py --store /work/runs/rocketqa-scifact \
        [--store ...] [--run RUN_ID] [--out bench/results/teacher_check.json]

For each store (its latest run with a ``denoise`` stage, or ``--run``), every ``denoise[...]`` stage's
``scores`` output (the teacher's raw score of each retrieved candidate of the labelled queries, and whether
the candidate is a judged positive) goes through ``irflow.learn.teachers.teacher_scores_check``: per query, the AUC of
the teacher's scores (judged positives against the other retrieved candidates) and of the retriever's own
order of the same candidates, their means, and paired t-tests (teacher against chance 0.5, teacher against
the list). ``problem`` is the sentence the stage logs as a warning (null: none). Also per stage: the share
of unjudged candidates denoising dropped (from its ``audit``) and the spread of the teacher's scores.

The labelled queries are the ones M_C was trained on (and M_D0): for a trained teacher these numbers are
optimistic, a ceiling on how it orders new queries. A teacher that fails here fails everywhere.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import harness


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", action="append", required=True, help="a store (repeatable)")
    ap.add_argument("--run", default=None, help="a run id (default: each store's latest run with a denoise stage)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import pyarrow.compute as pc

    from irflow.engine.catalog import Catalog
    from irflow.tools.report import runs as R
    from irflow.learn.teachers import teacher_scores_check

    rows, out = [], {"machine": harness.machine(), "stores": []}
    for store in args.store:
        if not (Path(store) / "catalog.duckdb").exists():
            ap.error(f"{store}: no irflow store there (no catalog.duckdb)")
        catalog = Catalog(Path(store) / "catalog.duckdb")
        candidates = [args.run] if args.run else [r["run_id"] for r in R.recent_runs(catalog, 100)]
        run_id, stages = None, []
        for rid in candidates:
            stages = [s for s in R.stage_runs(catalog, R.resolve_run(catalog, rid)) if s["name"].startswith("denoise[")]
            if stages:
                run_id = R.resolve_run(catalog, rid)
                break
        if run_id is None:
            ap.error(f"{store}: no run with a denoise stage")
        info = R.run_row(catalog, run_id)
        entry = {"store": store, "run_id": run_id, "config": info["config_path"],
                 "dataset": info["config"].get("dataset", {}).get("name"), "stages": {}}
        for s in stages:
            scores = R.read_table(catalog, s["outputs"]["scores"], ["query_id", "rank", "score", "positive"])
            audit = R.read_table(catalog, s["outputs"]["audit"], ["candidates", "known_positives", "dropped"])
            check = teacher_scores_check(scores)
            unjudged = (pc.sum(audit.column("candidates")).as_py() - pc.sum(audit.column("known_positives")).as_py())
            dropped = pc.sum(audit.column("dropped")).as_py() / max(unjudged, 1)
            raw = scores.column("score").to_numpy()
            listed = scores.filter(pc.greater(scores.column("rank"), 0)).column("score").to_numpy()
            entry["stages"][s["name"]] = {**check.to_dict(), "problem": check.problem(),
                                          "dropped_share_of_unjudged": round(dropped, 4),
                                          "score_range_on_lists": [float(np.min(listed)), float(np.max(listed))],
                                          "score_std_on_lists": float(np.std(listed)), "pairs": int(raw.size),
                                          "stage_status": s["status"]}
            rows.append([entry["dataset"], s["name"], check.queries, f"{check.teacher_auc:.3f}",
                         f"{check.list_auc:.3f}",
                         f"{check.vs_list.wins} / {check.vs_list.losses}, p {check.vs_list.t_pvalue:.2g}",
                         f"{dropped:.1%}", "yes" if check.problem() else "no"])
        out["stores"].append(entry)
    harness.table(["dataset", "stage", "lists", "teacher AUC", "list AUC", "teacher vs list (better / worse, p)",
                   "unjudged dropped", "warns"], rows)
    for entry in out["stores"]:
        for name, st in entry["stages"].items():
            if st["problem"]:
                print(f"{entry['dataset']} {name}: {st['problem']}")
    if args.out:
        print(harness.write_json(args.out, out))


if __name__ == "__main__":
    main()
