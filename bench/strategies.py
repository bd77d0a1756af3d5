"""The other training strategies against their closest relative, on one dataset, one store, one budget.

Each arm is a config run with overrides; its systems are scored on the dataset's test queries by the run
itself (nDCG@10, R@100, per-query nDCG@10). Then each new system is paired (irflow.learn.stats.paired) against
zero-shot, BM25 and its closest existing relative:

    tas-b        GPL's Margin-MSE student on TAS-B batches, MiniLM as the in-batch teacher (offline, for
                 ColBERT)  vs  gpl-margin-mse (the same labels and steps)
    qgen-moco    the QGen (MNRL) student with Contriever's MoCo  vs  qgen-mnrl (the same pairs and steps)
    bm25-deepct  BM25 over DeepCT's term weights (MiniLM's encoder: no BERT offline)  vs  bm25 (plain)
    star, star-adore  STAR, then ADORE's query encoder over STAR's index  vs  ance-round1 (the same labels)
    contriever-moco   Contriever on the corpus alone (crop pairs, MoCo)  vs  crop-infonce (the same pairs and
                      steps, in-batch negatives only)
    contriever-crop-key  the same with the key cropped too (train.crop_positives: Contriever's independent
                      cropping)  vs  contriever-moco (the whole passage as the key)

The arms share a store, so what they share (ingest, BM25, mining, teacher labels, the zero-shot encoding)
is computed once. ``--steps`` sets the GPL, QGen and Contriever training steps; every row records its arm's settings.

    python bench/strategies.py --dataset scifact --store /work/bench-strat/scifact --steps 120 \\
        --out bench/results/strategies_scifact.json [--arms gpl tasb moco deepct star ance]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (sets the offline environment first)
from train_dev import paired_test, per_query_ndcg  # noqa: E402


def arms(dataset: str, steps: int, threads: int) -> dict[str, dict]:
    """arm -> {config, overrides, systems: {run's system: table name}, relative: {table name: relative}}."""
    gpl = [f"train.steps={steps}", "train.qgen.enabled=true", f"train.qgen.steps={steps}",
           f"runtime.threads={threads}"]
    both = {"bm25-flat": "bm25", "dense-all-MiniLM-L6-v2": "zero-shot"}
    # SciFact's STAR and ANCE configs train epochs of its 809 train queries (STAR 3, ANCE 1 + 1); NFCorpus's
    # train 460 steps a model, too long for a bench of every arm: here ANCE trains steps + steps (warm-up,
    # round 1) and STAR as many in one model, before ADORE.
    star_steps = [f"star.steps={2 * steps}"] if dataset == "nfcorpus" else []
    ance_steps = [f"warmup.steps={steps}", f"round.steps={steps}"] if dataset == "nfcorpus" else []
    return {
        "gpl": {"config": f"configs/gpl_{dataset}_offline.yaml", "overrides": gpl,
                "systems": {**both, "gpl-student": "gpl-margin-mse", "qgen-student": "qgen-mnrl"}, "relative": {}},
        "tasb": {"config": f"configs/gpl_{dataset}_offline.yaml", "overrides": gpl + ["train.tas.enabled=true", "train.tas.teacher=all-MiniLM-L6-v2"],
                 "systems": {"gpl-student": "tas-b"}, "relative": {"tas-b": "gpl-margin-mse"}},
        "moco": {"config": f"configs/gpl_{dataset}_offline.yaml",
                 "overrides": gpl + ["train.moco.enabled=true", "train.moco.queue_size=1024"],
                 "systems": {"qgen-student": "qgen-moco"}, "relative": {"qgen-moco": "qgen-mnrl"}},
        "deepct": {"config": f"configs/baselines_{dataset}.yaml",
                   "overrides": ["deepct.enabled=true", "deepct.model=all-MiniLM-L6-v2", "bm25.variants=[flat]",
                                 f"runtime.threads={threads}"],
                   "systems": {**both, "bm25-deepct": "bm25-deepct"}, "relative": {"bm25-deepct": "bm25"}},
        "star": {"config": f"configs/star_{dataset}.yaml",
                 # STAR's RankNet, then ADORE with every positive a candidate: both as the paper
                 "overrides": [f"runtime.threads={threads}", "star.loss=star", "adore.positives_beyond_depth=keep"]
                 + star_steps,
                 "systems": {"star": "star", "star-adore": "star-adore"},
                 "relative": {"star": "ance-round1", "star-adore": "ance-round1"}},
        "contriever": {"config": f"configs/contriever_{dataset}.yaml",
                       "overrides": [f"train.steps={steps}", f"runtime.threads={threads}"],
                       "systems": {**both, "contriever": "contriever-moco"},
                       "relative": {"contriever-moco": "crop-infonce"}},
        "crop-key": {"config": f"configs/contriever_{dataset}.yaml",
                     "overrides": [f"train.steps={steps}", "train.crop_positives=[0.1,0.5]", f"runtime.threads={threads}"],
                     "systems": {"contriever": "contriever-crop-key"}, "relative": {"contriever-crop-key": "contriever-moco"}},
        "crop": {"config": f"configs/contriever_{dataset}.yaml",
                 "overrides": [f"train.steps={steps}", "train.moco.enabled=false", f"runtime.threads={threads}"],
                 "systems": {"contriever": "crop-infonce"}, "relative": {}},
        "ance": {"config": f"configs/ance_{dataset}_offline.yaml",
                 "overrides": ["rounds=1", "hybrid.enabled=false", f"runtime.threads={threads}"] + ance_steps,
                 "systems": {"ance-round1": "ance-round1"}, "relative": {}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, choices=("scifact", "nfcorpus"))
    ap.add_argument("--store", help="one store for every arm (kept: a second call reuses stages); not with "
                                    "--summarize")
    ap.add_argument("--steps", type=int, default=120, help="GPL, QGen and Contriever training steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=["gpl", "tasb", "moco", "contriever", "crop", "deepct", "ance", "star"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--summarize", action="store_true", help="only the paired tests and table of --out's arms")
    args = ap.parse_args()
    if args.summarize:
        out = json.loads(Path(args.out).read_text())
        summarize(out, arms(args.dataset, args.steps, args.threads))
        harness.write_json(args.out, out)
        return
    if not args.store:
        ap.error("--store is required (except with --summarize)")

    out: dict = {"dataset": args.dataset, "steps": args.steps, "arms": {}, "table": {}}
    if Path(args.out).exists():  # arms run before into the same file
        old = json.loads(Path(args.out).read_text())
        out["arms"], out["table"], out["per_query"] = old.get("arms", {}), old.get("table", {}), old.get("per_query", {})
    per_query: dict[str, dict[str, float]] = {}
    every = arms(args.dataset, args.steps, args.threads)
    for name in args.arms:
        arm = every[name]
        t = harness.run(harness.ROOT / arm["config"], overrides=arm["overrides"], store=args.store)
        r = t.result
        metrics = {m["system"]: m for m in r.metrics}
        pq = per_query_ndcg(args.store, r.run_id)
        for system, label in arm["systems"].items():
            out["table"][label] = {"arm": name, "system": system, "ndcg@10": round(metrics[system]["ndcg@10"], 4),
                                   "recall@100": round(metrics[system]["recall@100"], 4),
                                   "config": arm["config"], "overrides": arm["overrides"], "run_id": r.run_id}
            per_query[label] = pq[system]
        out["arms"][name] = {"run_id": r.run_id, "wall_seconds": round(t.wall_seconds, 1),
                             "load": [t.load_before[0], t.load_after[0]],
                             "stage_seconds": {s.name: s.seconds for s in r.stages if s.status == "computed"}}
        out.setdefault("per_query", {}).update(per_query)
        harness.write_json(args.out, out)

    summarize(out, every)
    harness.write_json(args.out, out)


ALSO = {"star-adore": "star"}  # pairs besides the relative: what ADORE adds to STAR


def summarize(out: dict, every: dict[str, dict]) -> None:
    """Paired tests of each system against zero-shot, BM25 and its relative (from the per-query values the
    arms left in ``out``), the machine, and the table."""

    per_query = out.get("per_query", {})
    relatives = {label: rel for a in every.values() for label, rel in a["relative"].items()}
    out["paired"] = {}
    for label in out["table"]:
        for against in ("zero-shot", "bm25", relatives.get(label), ALSO.get(label)):
            if label == "zero-shot" and against == "bm25":
                continue  # bm25 vs zero-shot says it
            if against and against != label and against in per_query and label in per_query:
                out["paired"][f"{label} vs {against}"] = paired_test(per_query[against], per_query[label])
    out["machine"] = harness.machine()
    def cell(label: str, against: str | None) -> str:
        t = out["paired"].get(f"{label} vs {against}") if against else None
        return f"{t['mean_diff']:+.4f} ({t['wins']} / {t['losses']}, p {t['t_pvalue']})" if t else ""

    rows = []
    for label, row in out["table"].items():
        rel = relatives.get(label)
        rows.append([label, f"{row['ndcg@10']:.4f}", f"{row['recall@100']:.4f}", cell(label, "zero-shot"),
                     cell(label, "bm25"), f"{rel}: {cell(label, rel)}" if rel and cell(label, rel) else ""])
    harness.table(["system", "nDCG@10", "R@100", "vs zero-shot", "vs BM25", "vs its relative"], rows)


if __name__ == "__main__":
    main()
