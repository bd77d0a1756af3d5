"""GPL's fusion teacher: each miner's own list, or every candidate scored by every miner; over seeds.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/gpl_teacher.py [--dataset scifact] [--seeds 42,43]
        [--teachers own,every] [--store /work/runs/gpl-scifact] [--out bench/results/gpl_teacher_<ds>.json]
        [--set KEY=VALUE ...] [--summary-only]

``configs/gpl_<ds>_offline.yaml`` (queries: the train split's texts, labels unused; BM25 + MiniLM fusion
teacher) with ``teacher.score_every_candidate`` false (``own``: a candidate one miner did not return gets
that list's lowest z-score) or true (``every``: ``bm25_score`` / ``dense_score`` give each miner's score of
every candidate, standardised over the candidates), at each ``train.seed``; the QGen baseline off. One
store, so mining, the teacher's scores and the baselines are computed once. Prints the GPL student's
nDCG@10 / R@100 per (teacher, seed) with paired t-tests against zero-shot and BM25 over the test queries,
and the mean over seeds (with each test query's nDCG@10 averaged over the seeds, paired against zero-shot and
BM25: ``mean_over_seeds[teacher].each_query_over_seeds``); and BM25 fused with the student
(``hybrid-gpl-student``, where the run has it) against the zero-shot fusion, BM25 and the student alone, per seed
and (``mean_over_seeds[teacher].hybrid_gpl_student``) each query averaged over the seeds against the fusion.
Writes JSON after each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import harness
from harness import ROOT
from seed_mean import seed_mean_against
from train_dev import paired_with, per_query_ndcg

from irflow.learn.stats import paired

TEACHERS = {"own": "false", "every": "true"}
KEEP = ("bm25-flat", "dense-all-MiniLM-L6-v2", "hybrid", "gpl-student", "hybrid-gpl-student")


def positives_judged(store: Path, run_id: str) -> dict:
    """How often the run's GPL positive (the teacher's top-1 of a query) is judged relevant by the query's
    own qrels (the train split's: the recipe never reads them), and how many queries that covers."""
    import pyarrow.compute as pc

    from irflow.engine.catalog import Catalog
    from irflow.tools.report import runs as R

    catalog = Catalog(Path(store) / "catalog.duckdb")
    outputs = {s["name"]: s["outputs"] for s in R.stage_runs(catalog, run_id)}
    split = R.run_row(catalog, run_id)["config"]["generate"]["split"]
    qrels = R.read_table(catalog, outputs["ingest"]["qrels"], ["query_id", "doc_id"],
                         (pc.field("split") == split) & (pc.field("score") > 0))
    relevant = set(zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist()))
    judged = {q for q, _ in relevant}
    labels = R.read_table(catalog, outputs["pseudo_label"]["pseudo_labels"], ["query_id", "pos_doc_id"])
    positive = dict(zip(labels.column("query_id").to_pylist(), labels.column("pos_doc_id").to_pylist()))
    asked = [q for q in positive if q in judged]
    hits = sum((q, positive[q]) in relevant for q in asked)
    return {"split": split, "queries": len(asked), "top1_relevant": round(hits / len(asked), 4) if asked else None}


def seed_mean_tests(store: Path, run_ids: list[str]) -> dict:
    """Each test query's nDCG@10 averaged over the seeds' GPL students, against zero-shot and BM25 (the same in
    every run: nothing trained): ``irflow.learn.stats.paired``'s wins / losses and t-test p; the same for BM25 fused
    with the students against the zero-shot fusion, where every run has it. A gap no single seed
    shows beyond chance may show here; it says nothing about seeds not run. Empty with fewer than 2 runs, or
    when a run is not in ``store``."""
    if len(run_ids) < 2:
        return {}
    try:
        runs = [per_query_ndcg(store, r) for r in run_ids]
    except Exception as e:  # a run merged in from another store
        harness.log(f"seed mean skipped: {e}")
        return {}
    tests = {}
    for name, base in (("vs_zero_shot", "dense-"), ("vs_bm25", "bm25-")):
        ref = runs[0][next(s for s in runs[0] if s.startswith(base))]
        _, t = seed_mean_against(ref, [r["gpl-student"] for r in runs])
        tests[name] = {"wins": t.wins, "losses": t.losses, "mean_diff": round(t.mean_diff, 4),
                       "t_pvalue": round(t.t_pvalue, 4)}
    out = {"each_query_over_seeds": tests}
    if all("hybrid-gpl-student" in r for r in runs):  # BM25 fused with each seed's student, against the fusion
        # with the zero-shot model (one system, nothing trained: the same in every run)
        mean, t = seed_mean_against(runs[0]["hybrid"], [r["hybrid-gpl-student"] for r in runs])
        out["hybrid_gpl_student"] = {"seeds": len(runs), "ndcg@10": round(sum(mean.values()) / len(mean), 4),
                                     "vs_hybrid": {"wins": t.wins, "losses": t.losses,
                                                   "mean_diff": round(t.mean_diff, 4),
                                                   "t_pvalue": round(t.t_pvalue, 4)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="scifact")
    ap.add_argument("--seeds", default="42,43")
    ap.add_argument("--teachers", default="own,every")
    ap.add_argument("--store", help="default: /work/runs/gpl-<dataset> (beside the repo: ../runs/gpl-<ds>)")
    ap.add_argument("--out", help="default: bench/results/gpl_teacher_<dataset>.json")
    ap.add_argument("--set", action="append", default=[], help="extra override for every run")
    ap.add_argument("--summary-only", action="store_true", help="run nothing: the table and the mean over seeds "
                                                               "of the runs already in --out (their store: --store)")
    args = ap.parse_args()
    store = Path(args.store or ROOT.parent / "runs" / f"gpl-{args.dataset}")
    out_path = args.out or str(ROOT / "bench" / "results" / f"gpl_teacher_{args.dataset}.json")
    prior = json.loads(Path(out_path).read_text()) if Path(out_path).exists() else {}
    # --summary-only runs nothing here: the runs keep the machine they were measured on
    machine = prior.get("machine") if args.summary_only and prior else harness.machine()
    out = {"machine": machine, "dataset": args.dataset, "runs": prior.get("runs", [])}
    for teacher in [] if args.summary_only else args.teachers.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            sets = [f"teacher.score_every_candidate={TEACHERS[teacher]}", f"train.seed={seed}",
                    "train.qgen.enabled=false", *args.set]
            harness.log(f"== GPL on {args.dataset}, teacher {teacher}, seed {seed} (store {store}); {sets}")
            r = harness.run(f"configs/gpl_{args.dataset}_offline.yaml", sets, store)
            res = r.to_dict()
            metrics = {m["system"]: {"ndcg@10": round(m["ndcg@10"], 4), "recall@100": round(m["recall@100"], 4)}
                       for m in res["metrics"] if m["system"] in KEEP}
            student = metrics["gpl-student"]
            per_query = per_query_ndcg(store, r.run_id)
            student["vs_zero_shot"] = paired_with(per_query, "dense-").get("gpl-student")
            student["vs_bm25"] = paired_with(per_query, "bm25-").get("gpl-student")
            if "hybrid-gpl-student" in metrics:  # BM25 fused with the student (hybrid.students): against the
                # same fusion of the zero-shot model, and against BM25 and the student alone
                fused = metrics["hybrid-gpl-student"]
                for name, ref in (("vs_hybrid", "hybrid"), ("vs_bm25", "bm25-flat"), ("vs_student", "gpl-student")):
                    t = paired(per_query[ref], per_query["hybrid-gpl-student"])
                    fused[name] = {"wins": t.wins, "losses": t.losses, "t_pvalue": round(t.t_pvalue, 4)}
            entry = {"teacher": teacher, "seed": seed, "overrides": sets, "run_id": res["run_id"],
                     "positives": positives_judged(store, r.run_id),
                     "wall_seconds": round(r.wall_seconds, 1), "computed": res.get("computed"), "metrics": metrics,
                     "load_before": r.load_before, "load_after": r.load_after}
            out["runs"] = [e for e in out["runs"] if (e["teacher"], e["seed"], e["overrides"]) !=
                           (teacher, seed, sets)] + [entry]
            harness.write_json(out_path, out)

    rows, by_teacher = [], {}
    for e in sorted(out["runs"], key=lambda e: (e["teacher"], e["seed"])):
        m, s = e["metrics"], e["metrics"]["gpl-student"]
        fused = m.get("hybrid-gpl-student")
        by_teacher.setdefault(e["teacher"], []).append(s["ndcg@10"])
        rows.append([e["teacher"], e["seed"], m["dense-all-MiniLM-L6-v2"]["ndcg@10"], m["bm25-flat"]["ndcg@10"],
                     m["hybrid"]["ndcg@10"], s["ndcg@10"], s["recall@100"],
                     f"{s['vs_zero_shot']['wins']}/{s['vs_zero_shot']['losses']} p {s['vs_zero_shot']['t_pvalue']}",
                     f"{s['vs_bm25']['wins']}/{s['vs_bm25']['losses']} p {s['vs_bm25']['t_pvalue']}",
                     f"{fused['ndcg@10']} (vs fusion {fused['vs_hybrid']['wins']}/{fused['vs_hybrid']['losses']} "
                     f"p {fused['vs_hybrid']['t_pvalue']})" if fused else "-"])
    harness.table(["teacher", "seed", "zero-shot", "BM25", "fusion", "GPL student", "R@100", "vs zero-shot",
                   "vs BM25", "BM25 + GPL student"], rows)
    out["mean_over_seeds"] = {t: {"seeds": len(v), "ndcg@10": round(statistics.mean(v), 4),
                                  "stdev": round(statistics.stdev(v), 4) if len(v) > 1 else None,
                                  **seed_mean_tests(store, [e["run_id"] for e in out["runs"] if e["teacher"] == t])}
                              for t, v in by_teacher.items()}
    print(out["mean_over_seeds"])
    harness.write_json(out_path, out)


if __name__ == "__main__":
    main()
