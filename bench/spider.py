"""Spider's recurring spans against crop and ICT pairs: one trainer, one budget, documents cut into passages.

Spider pairs two passages of one document, so it needs documents of several passages; a BEIR corpus has a
passage per document. Here a SciFact (or NFCorpus) corpus is handed to irflow as a user's own documents,
cut into passages of ``--max-words`` words (``dataset.passages``), with the test queries and qrels as its
labelled set: a query judges every passage of a document it judges (a passage-level task, the same for
every system). The corpus is every document a test query judges plus random others up to ``--docs``.

Each source (``--sources``: spider, crop, ict) makes (query, positive) pairs from the passages alone and the
contriever recipe trains MiniLM on them with the same settings (InfoNCE, MoCo, ``--steps`` x 32). Every
trained model is paired (per-query nDCG@10) against zero-shot, BM25 and each other source.

    python bench/spider.py --dataset scifact --store /work/bench-spider/scifact --steps 60 \\
        --out bench/results/spider_scifact.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (sets the offline environment first)
from train_dev import paired_test, per_query_ndcg  # noqa: E402


def prepare(dataset: str, work: Path, docs: int, max_words: int, seed: int, queries_limit: int | None) -> dict:
    """The corpus (jsonl), test queries and passage-level qrels as a user's files; what was written."""
    from irflow.sources.corpus_sources import cut_passages

    corpus, queries, qrels = harness.read_beir(harness.DATASETS / f"{dataset}.zip")
    qrels = {q: qrels[q] for q in sorted(qrels)[:queries_limit]}
    judged = {d for rel in qrels.values() for d, s in rel.items() if s > 0}
    rows = {r["_id"]: r for r in corpus}
    others = sorted(set(rows) - judged)
    keep = sorted(judged & set(rows)) + random.Random(seed).sample(others, max(0, min(len(others), docs - len(judged))))
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "corpus.jsonl", "w") as f:
        for d in keep:
            f.write(json.dumps({"_id": d, "title": rows[d].get("title", ""), "text": rows[d]["text"]}) + "\n")
    passages = {d: [pid for pid, _ in cut_passages(d, rows[d]["text"], max_words, max_words)] for d in keep}
    with open(work / "queries.jsonl", "w") as f:
        for q in sorted(qrels):
            f.write(json.dumps({"_id": q, "text": queries[q]}) + "\n")
    n_qrels = 0
    with open(work / "qrels.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for q, rel in sorted(qrels.items()):
            for d, s in sorted(rel.items()):
                for pid in passages.get(d, ()):
                    f.write(f"{q}\t{pid}\t{s}\n")
                    n_qrels += 1
    return {"documents": len(keep), "passages": sum(map(len, passages.values())),
            "documents_cut": sum(len(p) > 1 for p in passages.values()), "queries": len(qrels),
            "passage_qrels": n_qrels}


def config(dataset: str, work: Path, source: str, steps: int, max_words: int, threads: int) -> dict:
    return {"flow": "contriever",
            "dataset": {"name": f"{dataset}-passages", "source": str(work / "corpus.jsonl"),
                        "passages": {"max_words": max_words}, "queries": str(work / "queries.jsonl"),
                        "qrels": str(work / "qrels.tsv"), "split": "test"},
            "generate": {"source": source, "queries_per_passage": 1},
            "train": {"model": "all-MiniLM-L6-v2", "similarity": "cos", "batch_size": 32, "max_seq_length": 128,
                      "lr": 2.0e-5, "warmup_steps": 20, "steps": steps, "checkpoint_every": 50,
                      "moco": {"enabled": True, "queue_size": 1024, "momentum": 0.999}},
            "bm25": {"variants": ["flat"]}, "dense": {"batch_size": 64, "max_seq_length": 128},
            "hybrid": {"enabled": False}, "runtime": {"threads": threads}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="scifact", choices=("scifact", "nfcorpus"))
    ap.add_argument("--store", required=True, help="one store for every source (kept: a second call reuses stages)")
    ap.add_argument("--docs", type=int, default=1500, help="documents: every judged one, then random others")
    ap.add_argument("--max-words", type=int, default=64, help="passage length in words (no overlap)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sources", nargs="+", default=["spider", "crop", "ict"])
    ap.add_argument("--queries", type=int, default=None, help="only the first n test queries (null: all)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from irflow import api

    work = Path(args.store) / "user-files"
    out: dict = {"dataset": args.dataset, "steps": args.steps, "batch_size": 32, "max_words": args.max_words,
                 "corpus": prepare(args.dataset, work, args.docs, args.max_words, args.seed, args.queries), "runs": {},
                 "table": {}}
    harness.log(f"corpus: {out['corpus']}")
    per_query: dict[str, dict[str, float]] = {}
    for source in args.sources:
        cfg = work / f"contriever_{source}.yaml"
        cfg.write_text(yaml.safe_dump(config(args.dataset, work, source, args.steps, args.max_words, args.threads)))
        t = harness.run(cfg, store=args.store)
        r = t.result
        pq = per_query_ndcg(args.store, r.run_id)
        labels = {"bm25-flat": "bm25", "dense-all-MiniLM-L6-v2": "zero-shot", "contriever": f"{source}-moco"}
        for m in r.metrics:
            label = labels[m["system"]]
            out["table"][label] = {"ndcg@10": round(m["ndcg@10"], 4), "recall@100": round(m["recall@100"], 4),
                                   "run_id": r.run_id}
            per_query[label] = pq[m["system"]]
        gen = next(s for s in r.stages if s.name.startswith("generate_queries["))
        out["runs"][source] = {"run_id": r.run_id, "wall_seconds": round(t.wall_seconds, 1),
                               "load": [t.load_before[0], t.load_after[0]],
                               "pairs": api.catalog(args.store).dataset(gen.outputs["queries"])["num_rows"],
                               "stage_seconds": {s.name: s.seconds for s in r.stages if s.status == "computed"}}
        harness.write_json(args.out, out)

    out["paired"] = {}
    for label in out["table"]:
        for against in out["table"]:
            if label != against and label.endswith("-moco") and (against in ("zero-shot", "bm25") or against < label):
                out["paired"][f"{label} vs {against}"] = paired_test(per_query[against], per_query[label])
    out["machine"] = harness.machine()
    harness.write_json(args.out, out)
    harness.table(["system", "nDCG@10", "R@100"], [[k, v["ndcg@10"], v["recall@100"]] for k, v in out["table"].items()])
    for k, v in out["paired"].items():
        print(f"{k}: {v['mean_diff']:+.4f} ({v['wins']}/{v['losses']}, p {v['t_pvalue']})")


if __name__ == "__main__":
    main()
