"""Why STAR collapsed on NFCorpus, and which setting keeps it from collapsing.

Each variant is configs/star_{dataset}.yaml at bench/strategies.py's budget (NFCorpus: 120 steps of 32),
ADORE off (but in infonce-adore), with its overrides. For each it reports what the run measured (test nDCG@10, R@100) and what
tells a collapse from a poor model:

    mean_cosine  mean cosine between two of the trained model's corpus embeddings (irflow.learn.collapse;
               zero-shot MiniLM: about 0.18): near 1, every passage points one way
    top10      distinct passages in the test queries' top 10s, and the most frequent one's count (hubs)
    loss       the first and last 10 steps' mean loss; STAR's loss when every score ties is
               (1 + alpha) log 2, so a run that ends there has learnt nothing but the tie
    beyond     of the training lines, the share whose positive the negatives' ranking leaves out of its
               top ``depth`` (every static negative then outscores it at the start)

    python bench/star_collapse.py --dataset nfcorpus --store /work/bench-strat/nfcorpus \\
        --variants base alpha1 skip100 --out bench/results/star_collapse_nfcorpus.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (sets the offline environment first)
from train_dev import paired_test, paired_with, per_query_ndcg  # noqa: E402

VARIANTS = {
    "base": [],
    "alpha1": ["star.alpha=1.0"],
    "skip100": ["star.skip_top=100"],
    "infonce": ["star.loss=infonce"],
    # ADORE after it (adore rows in the JSON): as the paper (every positive a candidate), and the default
    "infonce-adore": ["star.loss=infonce", "adore.enabled=true", "adore.positives_beyond_depth=keep"],
    "infonce-adore-within": ["star.loss=infonce", "adore.enabled=true", "adore.positives_beyond_depth=drop"],
}


def dataset_path(catalog, dataset_id: str) -> Path:
    return Path(catalog.dataset(dataset_id)["path"])


def describe(store: str, result, depth: int) -> dict:
    """The collapse signs of a STAR run's model (see the module docstring)."""
    import numpy as np
    import pyarrow.parquet as pq

    from irflow.engine.catalog import Catalog
    from irflow.learn.qrels import cap_per_query, positive_pairs
    from irflow.learn.collapse import mean_cosine

    cat = Catalog(Path(store) / "catalog.duckdb")
    out = {s.name: s.outputs for s in result.stages}
    emb = pq.read_table(dataset_path(cat, out["encode_corpus[star]"]["embeddings"]) / "data.parquet")
    vectors = np.stack(emb.column("embedding").to_numpy(zero_copy_only=False))
    run = pq.read_table(dataset_path(cat, out["dense_search[star]"]["run"]) / "data.parquet").to_pandas()
    top = run.sort_values(["query_id", "score"], ascending=[True, False]).groupby("query_id").head(10)
    hubs = Counter(top.doc_id)
    losses = pq.read_table(dataset_path(cat, out["train_dual_encoder[star]"]["training_losses"]) / "data.parquet")
    loss = losses.column("loss").to_pylist()
    qrels = pq.read_table(dataset_path(cat, out["ingest"]["qrels"]) / "data.parquet")
    ranking = pq.read_table(dataset_path(cat, out["dense_search[star-negatives]"]["run"]) / "data.parquet")
    within = {(q, d) for q, d, r in zip(*(ranking.column(c).to_pylist() for c in ("query_id", "doc_id", "rank")))
              if r <= depth}
    params = cat.dataset(out["train_dual_encoder[star]"]["model"])["params"]
    params = json.loads(params) if isinstance(params, str) else params
    pairs = cap_per_query(sorted(positive_pairs(qrels, "train")), params.get("positives_per_query"), params["seed"])
    metrics = {m["system"]: m for m in result.metrics}
    adore = {f"adore_{k}": round(metrics["star-adore"][k], 4) for k in ("ndcg@10", "recall@100")
             } if "star-adore" in metrics else {}
    return {**adore, "ndcg@10": round(metrics["star"]["ndcg@10"], 4), "recall@100": round(metrics["star"]["recall@100"], 4),
            "mean_cosine": round(mean_cosine(vectors), 4),
            "top10_distinct": len(hubs), "top10_most_frequent": hubs.most_common(1)[0][1],
            "loss_first10": round(sum(loss[:10]) / 10, 4), "loss_last10": round(sum(loss[-10:]) / 10, 4),
            "loss_at_tie": round((1 + params["alpha"]) * math.log(2), 4) if params["loss"] == "star" else None,
            "beyond_depth": round(sum(p not in within for p in pairs) / len(pairs), 4), "lines": len(pairs),
            "zero_shot_ndcg@10": round(metrics["dense-all-MiniLM-L6-v2"]["ndcg@10"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="nfcorpus", choices=("scifact", "nfcorpus"))
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, default=120, help="STAR's steps (bench/strategies.py: 2 x its --steps)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--ance-run", help="the run id of bench/strategies.py's ance arm in --store: the ADORE variant "
                                       "is paired with its ance-round1 too")
    ap.add_argument("--summarize", action="store_true", help="only the paired tests and table of --out's variants "
                                                             "(their runs read from --store)")
    args = ap.parse_args()
    from irflow.engine.config import read

    out = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    out.update(dataset=args.dataset, steps=args.steps)
    out.setdefault("variants", {})
    for name in [] if args.summarize else args.variants:
        overrides = [f"star.steps={args.steps}", "adore.enabled=false", f"runtime.threads={args.threads}",
                     *VARIANTS[name]]
        t = harness.run(harness.ROOT / f"configs/star_{args.dataset}.yaml", overrides=overrides, store=args.store)
        star = read(harness.ROOT / f"configs/star_{args.dataset}.yaml", overrides)[0]["star"]
        row = describe(args.store, t.result, int(star.get("depth", 200)))
        row.update(overrides=overrides, run_id=t.result.run_id, wall_seconds=round(t.wall_seconds, 1),
                   star_seconds=next((s.seconds for s in t.result.stages if s.name == "train_dual_encoder[star]"), None))
        out["variants"][name] = row
        out["machine"] = harness.machine()
        harness.write_json(args.out, out)
        harness.log(f"{name}: {json.dumps(row)}")
    for row in out["variants"].values():  # each variant's STAR against the zero-shot row of its run
        per_query = per_query_ndcg(args.store, row["run_id"])
        row["vs_zero_shot"] = paired_with(per_query, "dense-")["star"]
        if "star-adore" in per_query:
            row["adore_vs_star"] = paired_test(per_query["star"], per_query["star-adore"])
            refs = {"zero-shot": per_query["dense-all-MiniLM-L6-v2"], "bm25": per_query["bm25-flat"]}
            if args.ance_run:  # STAR's relative: ANCE's first round, from bench/strategies.py's store
                refs["ance-round1"] = per_query_ndcg(args.store, args.ance_run)["ance-round1"]
            row["paired"] = {f"{k} vs {ref}": paired_test(values, per_query[k]) for k in ("star", "star-adore")
                             for ref, values in refs.items()}
    harness.write_json(args.out, out)
    harness.table(["variant", "nDCG@10", "R@100", "mean_cosine", "top10 distinct", "max", "loss first/last", "tie",
                   "beyond depth", "vs zero-shot (wins / losses, p)"],
                  [[k, v["ndcg@10"], v["recall@100"], v["mean_cosine"], v["top10_distinct"], v["top10_most_frequent"],
                    f"{v['loss_first10']} / {v['loss_last10']}", v["loss_at_tie"], v["beyond_depth"],
                    "{wins} / {losses}, p {t_pvalue}".format(**v["vs_zero_shot"])]
                   for k, v in out["variants"].items()])


if __name__ == "__main__":
    main()
