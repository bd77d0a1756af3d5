"""Is a re-ranker better than shuffling the list it re-ranks? Floors for M_C's re-ranking rows.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/rerank_floor.py bench/results/train_dev_rocketqa_nfcorpus_mc_transfer.json \
        --variant base --store /work/runs/rocketqa-nfcorpus-dev [--list "dense_search[md0]"] [--depth 100] \
        [--cross-encoder DIR --max-length 128] [--out bench/results/rerank_floor_nfcorpus_dev.json]

A re-ranker only reorders a list, so a list of 100 with several judged passages in it gives a re-ranking
row a floor well above 0: what any order of the same 100 passages scores. This reads one run of a
``train_dev.py`` result file (its evaluated queries and split, and the list a re-ranker re-ranks:
``dense_search[md0]``, M_D0's top 100 in RocketQA) from the store, and gives nDCG@10 of that list in
orders that know nothing of the query beyond the list itself:

- ``list``: the list's own order (M_D0's row);
- ``random``: shuffled, the mean and standard deviation over 20 seeds;
- ``constant``: one score for every passage, ties broken as the evaluation breaks them (what a
  re-ranker that gives every pair the same logit would score);
- ``reversed``: the list upside down;
- ``longest_first`` / ``shortest_first``: by the passage's length in characters;
- ``label_prior``: by how many queries of the labelled (train) split judge the passage relevant, the list's
  order breaking ties -- a prior a cross-encoder could learn from its labels without reading the query;
- with ``--cross-encoder DIR`` (repeatable): that cross-encoder's re-ranking as it is, no steps on this
  dataset (irflow's own scoring, ``irflow.learn.scoring.cross_encoder_scores``, fp32), alone and fused with the
  list's own scores as RocketQA's ``mc-rerank-fused`` fuses them (``irflow.learn.fusion.fuse_runs``, z-scores per
  query, ``--list-weight`` on the list), each with its paired t-test against the list's own order
  (``irflow.learn.stats.paired`` over the queries).

The qrels are the evaluated split's, judged passages outside the list counting as missed, as the
evaluate stage counts them (its per-query nDCG@10 of ``list`` is the run's row). Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np

import harness


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a train_dev.py result file")
    ap.add_argument("--variant", default=None, help="its variant (default: the first)")
    ap.add_argument("--store", required=True)
    ap.add_argument("--list", default="dense_search[md0]", help="the stage whose run a re-ranker re-ranks")
    ap.add_argument("--depth", type=int, default=100, help="the list's top passages per query")
    ap.add_argument("--cross-encoder", action="append", default=[], help="a cross-encoder directory, read as it is")
    ap.add_argument("--max-length", type=int, default=128, help="the cross-encoder's (query, passage) tokens")
    ap.add_argument("--list-weight", type=float, default=0.7, help="the list's weight when fused with a "
                                                                    "cross-encoder (RocketQA's rerank_md0_weight)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import pyarrow.dataset as ds

    from irflow.engine.catalog import Catalog
    from irflow.learn.qrels import positives
    from irflow.tools.report import runs as R
    from irflow.stages.evaluate import evaluate_run, qrels_to_dict
    from irflow.learn.text import doc_texts

    store = Path(args.store)
    result = json.loads(Path(args.file).read_text())
    variants = result["variants"]
    v = next((x for x in variants if x["name"] == args.variant), None) if args.variant else variants[0]
    if v is None:
        ap.error(f"no variant {args.variant!r} in {args.file}: {[x['name'] for x in variants]}")
    if not (store / "catalog.duckdb").exists():
        ap.error(f"{store}: no irflow store there (no catalog.duckdb)")
    catalog = Catalog(store / "catalog.duckdb")
    out = {s["name"]: s["outputs"] for s in R.stage_runs(catalog, v["run_id"])}
    if not out:
        ap.error(f"run {v['run_id']} is not in {store}'s catalog")
    if args.list not in out:
        ap.error(f"run {v['run_id']} has no {args.list!r}: {sorted(out)}")

    # the evaluated queries: the run's select_queries stage that is not the labelled (train) split's
    evaluated = [s for s in out if s.startswith("select_queries[") and s != "select_queries[train]"]
    if len(evaluated) != 1:
        ap.error(f"cannot tell the evaluated queries apart: {evaluated}")
    split = evaluated[0][len("select_queries["):-1]
    queries = R.read_table(catalog, out[evaluated[0]]["queries"], columns=["query_id", "text"])
    asked = set(queries.column("query_id").to_pylist())
    query_text = dict(zip(queries.column("query_id").to_pylist(), queries.column("text").to_pylist()))
    ingest = out["ingest"]
    passage_text = doc_texts(R.read_table(catalog, ingest["corpus"]))
    qrels_table = R.read_table(catalog, ingest["qrels"])
    qrels = qrels_to_dict(qrels_table, split)  # as the evaluate stage reads them; evaluate_run keeps the asked
    judged_in_train = Counter(d for docs in positives(qrels_table, "train").values() for d in docs)
    rows = [r for r in R.read_table(catalog, out[args.list]["run"], columns=["query_id", "doc_id", "rank", "score"],
                                    where=ds.field("rank") <= args.depth).to_pylist() if r["query_id"] in asked]

    def as_run(score, system: str):
        import pyarrow as pa

        return pa.table({"query_id": [r["query_id"] for r in rows], "doc_id": [r["doc_id"] for r in rows],
                         "rank": [r["rank"] for r in rows], "score": pa.array(score, pa.float64()),
                         "system": [system] * len(rows)})

    def per_query(score) -> dict[str, float]:
        ranked: dict[str, dict[str, float]] = {}
        for r, s in zip(rows, score):
            ranked.setdefault(r["query_id"], {})[r["doc_id"]] = float(s)
        return evaluate_run(qrels, ranked, ["ndcg@10"], asked)["ndcg@10"]

    def ndcg(score) -> float:
        return round(float(np.mean(list(per_query(score).values()))), 4)

    def against_list(score) -> dict:
        """the paired test of this order's per-query nDCG@10 against the list's own order"""
        from irflow.learn.stats import paired

        t = paired(per_query([r["score"] for r in rows]), per_query(score))
        return {"mean_diff": round(t.mean_diff, 4), "wins": t.wins, "losses": t.losses, "t_pvalue": round(t.t_pvalue, 4)}

    def shuffle(seed: int) -> list[float]:
        rng = random.Random(seed)
        return [rng.random() for _ in rows]

    shuffled = [ndcg(shuffle(seed)) for seed in range(20)]
    floors = {
        "list": ndcg([r["score"] for r in rows]),
        "random": {"mean": round(float(np.mean(shuffled)), 4), "sd": round(float(np.std(shuffled)), 4), "seeds": 20},
        "constant": ndcg([0.0] * len(rows)),
        "reversed": ndcg([-r["score"] for r in rows]),
        "longest_first": ndcg([len(passage_text[r["doc_id"]]) for r in rows]),
        "shortest_first": ndcg([-len(passage_text[r["doc_id"]]) for r in rows]),
        "label_prior": ndcg([judged_in_train.get(r["doc_id"], 0) + 1e-6 * r["score"] for r in rows]),
    }
    crosses = []
    for model in args.cross_encoder:
        from irflow.learn.fusion import fuse_runs
        from irflow.learn.scoring import cross_encoder_scores

        t0 = time.perf_counter()
        scores = cross_encoder_scores(model, [(query_text[r["query_id"]], passage_text[r["doc_id"]]) for r in rows],
                                      batch_size=64, max_length=args.max_length, threads=args.threads)
        seconds = round(time.perf_counter() - t0, 1)
        # fuse_runs normalises each run over its rows per query; ranks do not enter a z-score fusion
        fused = fuse_runs([as_run([r["score"] for r in rows], "list"), as_run(scores, "ce")],
                          weights={"list": args.list_weight, "ce": 1 - args.list_weight})
        by_pair = dict(zip(zip(fused.column("query_id").to_pylist(), fused.column("doc_id").to_pylist()),
                           fused.column("score").to_pylist()))
        fused_scores = [by_pair[(r["query_id"], r["doc_id"])] for r in rows]
        crosses.append({"model": model, "max_length": args.max_length, "ndcg@10": ndcg(scores),
                        "vs_list": against_list(scores), "fused_ndcg@10": ndcg(fused_scores),
                        "fused_vs_list": against_list(fused_scores), "list_weight": args.list_weight,
                        "seconds": seconds})

    report = {"file": Path(args.file).name, "variant": v["name"], "run_id": v["run_id"], "store": str(store),
              "split": split, "queries": len(asked & set(qrels)), "list": args.list, "depth": args.depth, "pairs": len(rows),
              "orders": floors, "cross_encoders": crosses, "machine": harness.machine()}
    harness.table(["order of the list", "nDCG@10"],
                  [[k, f"{x['mean']} (sd {x['sd']})" if isinstance(x, dict) else x] for k, x in floors.items()]
                  + [[f"cross-encoder {Path(c['model']).name}, as it is", c["ndcg@10"]] for c in crosses]
                  + [[f"  fused with the list (w {c['list_weight']})", c["fused_ndcg@10"]] for c in crosses])
    for c in crosses:
        for what, t in (("alone", c["vs_list"]), ("fused", c["fused_vs_list"])):
            print(f"{Path(c['model']).name} {what} against the list: {t['mean_diff']:+.4f}, better on {t['wins']} "
                  f"queries, worse on {t['losses']}, paired t-test p {t['t_pvalue']}")
    if args.out:
        print(f"wrote {harness.write_json(args.out, report)}")


if __name__ == "__main__":
    main()
