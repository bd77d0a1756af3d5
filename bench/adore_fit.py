"""Does ADORE fit its training queries, and does the fit carry to held-out queries?

For a finished STAR run with ADORE (``--run``, in ``--store``): the corpus embeddings STAR's model made (the
fixed index ADORE trained against) are searched with the test, dev and train queries, each encoded twice:
by STAR's query side (where ADORE started) and by ADORE's trained query encoder. Per split: nDCG@10 and
R@100 against that split's qrels (pytrec_eval, as irflow's evaluate), the mean cosine between two of the split's
query embeddings, and the distinct passages in its queries' top 10s (hubs). The train split is ADORE's own
data: a gain there and a loss on test and dev is a fit that does not carry over; a loss on train too is
an objective that does not track nDCG@10.

    python bench/adore_fit.py --store /work/bench-strat/nfcorpus --run keep=star-20261202-050235-3ccb \\
        --run drop=star-20261202-072440-2787 --out bench/results/adore_fit_nfcorpus.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (sets the offline environment first)


def fit(catalog, store, run_id: str, args) -> dict:
    """One run's STAR and ADORE query encoders on each split (see the module docstring), and its training
    batches' loss, MRR@10 and share of positives beyond the depth, over the first and last tenth of the steps."""
    import random

    import numpy as np
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    from irflow.learn.adore import embedding_matrix
    from irflow.learn.collapse import mean_cosine
    from irflow.engine.store import TABLE_FILE
    from irflow.stages.evaluate import evaluate_run, qrels_to_dict

    stages = {s["name"]: s for s in catalog.stage_runs(run_id)}  # cached stages name their outputs too

    def table(dataset_id: str):
        return pq.read_table(store.object_dir(dataset_id) / TABLE_FILE)

    def output(stage: str, name: str) -> str:
        return stages[stage]["outputs"][name]

    emb = table(output("encode_corpus[star]", "embeddings"))
    doc_ids = emb.column("doc_id").to_pylist()
    docs = embedding_matrix(emb)
    queries = table(output("ingest", "queries"))
    text = dict(zip(queries.column("query_id").to_pylist(), queries.column("text").to_pylist()))
    qrels = table(output("ingest", "qrels"))
    star_path = str(store.object_dir(output("train_dual_encoder[star]", "model")))
    adore_path = str(store.object_dir(output("train_query_encoder[adore]", "model")))
    encoders = {"star": SentenceTransformer(star_path, device="cpu").encode,
                "adore": SentenceTransformer(adore_path, device="cpu").encode_query}
    out: dict = {"run_id": run_id, "passages": len(doc_ids), "splits": {}}
    for split in args.splits:
        grades = qrels_to_dict(qrels, split)  # as irflow's evaluate scores a run
        judged = sorted(q for q, g in grades.items() if any(v > 0 for v in g.values()) and q in text)
        if not judged:
            continue
        sample = sorted(random.Random(0).sample(judged, min(args.max_queries, len(judged))))
        row: dict = {"queries": len(sample), "judged_queries": len(judged)}
        per_query: dict[str, list[float]] = {}
        for name, encode in encoders.items():
            q = encode([text[x] for x in sample], batch_size=64, normalize_embeddings=True, show_progress_bar=False)
            scores = q @ docs.T
            top = np.argsort(-scores, axis=1)[:, :100]
            ranked = [[doc_ids[i] for i in r] for r in top]
            results = {x: {doc_ids[i]: float(scores[k, i]) for i in top[k]} for k, x in enumerate(sample)}
            metrics = evaluate_run({x: grades[x] for x in sample}, results, ["ndcg@10", "recall@100"])
            ndcg = [metrics["ndcg@10"][x] for x in sample]
            hubs = Counter(d for r in ranked for d in r[:10])
            per_query[name] = ndcg
            row[name] = {"ndcg@10": round(float(np.mean(ndcg)), 4),
                         "recall@100": round(float(np.mean(list(metrics["recall@100"].values()))), 4),
                         "query_mean_cosine": round(mean_cosine(q), 4), "top10_distinct": len(hubs),
                         "top10_most_frequent": hubs.most_common(1)[0][1]}
        diff = np.array(per_query["adore"]) - np.array(per_query["star"])
        row["adore_minus_star"] = {"mean": round(float(diff.mean()), 4), "wins": int((diff > 0).sum()),
                                   "losses": int((diff < 0).sum())}
        out["splits"][split] = row
        harness.log(f"{split}: {json.dumps(row)}")
    history = json.loads((store.object_dir(output("train_query_encoder[adore]", "model")) / "irflow_training.json")
                         .read_text())["history"]
    tenth = max(1, len(history) // 10)
    for k in ("loss", "mrr@10", "beyond"):
        values = [h[k] for h in history if h.get(k) is not None]
        if values:
            out[f"{k}_first_tenth"] = round(sum(values[:tenth]) / len(values[:tenth]), 4)
            out[f"{k}_last_tenth"] = round(sum(values[-tenth:]) / len(values[-tenth:]), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", required=True, action="append", metavar="LABEL=RUN_ID",
                    help="a star run with adore.enabled (its star and star-adore models), under a label; repeatable")
    ap.add_argument("--splits", nargs="+", default=["test", "dev", "train"])
    ap.add_argument("--max-queries", type=int, default=1000, help="per split, a seeded sample of its judged queries")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from irflow import api
    from irflow.engine.store import Store

    torch.set_num_threads(args.threads)
    catalog = api.catalog(args.store)
    store = Store(args.store)
    out: dict = {"store": args.store, "runs": {}}
    for arg in args.run:
        label, _, run_id = arg.rpartition("=")
        out["runs"][label or run_id] = fit(catalog, store, run_id, args)
    out["machine"] = harness.machine()
    harness.write_json(args.out, out)
    harness.table(["run", "split", "queries", "STAR nDCG@10", "ADORE nDCG@10", "ADORE - STAR (wins/losses)",
                   "query mean cos STAR / ADORE", "top-10 distinct STAR / ADORE"],
                  [[label, s, r["queries"], r["star"]["ndcg@10"], r["adore"]["ndcg@10"],
                    f"{r['adore_minus_star']['mean']:+.4f} ({r['adore_minus_star']['wins']}/{r['adore_minus_star']['losses']})",
                    f"{r['star']['query_mean_cosine']} / {r['adore']['query_mean_cosine']}",
                    f"{r['star']['top10_distinct']} / {r['adore']['top10_distinct']}"]
                   for label, run in out["runs"].items() for s, r in run["splits"].items()])
    for label, run in out["runs"].items():
        print(f"{label}: training batches' MRR@10 {run.get('mrr@10_first_tenth')} -> {run.get('mrr@10_last_tenth')}, "
              f"loss {run.get('loss_first_tenth')} -> {run.get('loss_last_tenth')}, positives beyond the depth "
              f"{run.get('beyond_first_tenth', 'not recorded')}")


if __name__ == "__main__":
    main()
