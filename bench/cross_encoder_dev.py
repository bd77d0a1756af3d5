"""Choosing the offline cross-encoder's training settings on a dev part of *train*, never test.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/cross_encoder_dev.py --store store-bench-scifact \
        --variant base: --variant lr1e-4:lr=1e-4 [--depth 20] [--dev-share 0.2] [--out FILE]

The train split's labelled queries are cut (seeded) into a fit part and a dev part. Each variant
(``name:key=value,...`` over ``TrainCrossEncoderParams``, on top of the RocketQA config's
``cross_encoder`` settings given by --config) trains a cross-encoder with the stage's own code
(``training_pairs`` restricted to the fit queries, ``fit_cross_encoder``), with negatives from the
same pool the stage uses (the run's ``mine_negatives[md0-ce]`` dataset, found in the store's
catalog). It is then read on the dev queries' candidates -- M_D0's top-``depth`` for those queries
(``dense_search[md0-train]``) -- as RocketQA reads it:

- re-ranking: nDCG@10 of the candidates re-ranked by the cross-encoder, next to M_D0's own order
  (judged positives outside the candidates count as missed in both);
- separation: AUC of judged positives against unjudged candidates, and the logits' spread
  (a cross-encoder that learnt only the label prior gives every pair about the same logit);
- as a denoiser: the share of judged positives it would drop as negatives (p < 0.1; these should be
  kept) and the share of unjudged candidates it drops.

Prints a table and writes JSON (bench/results/cross_encoder_dev_<dataset>.json by default).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

import harness
from harness import ROOT


def dataset_id(con, stage: str) -> str:
    rows = con.execute("SELECT dataset_id FROM datasets WHERE stage = ? ORDER BY created_at DESC", [stage]).fetchall()
    if not rows:
        raise SystemExit(f"no '{stage}' dataset in the store: run bench/rocketqa.py on it first")
    return rows[0][0]


def ingest_ids(con) -> dict[str, str]:
    ids = [r[0] for r in con.execute("SELECT dataset_id FROM datasets WHERE stage = 'ingest'").fetchall()]
    return {kind: next(i for i in ids if i.startswith(kind + "-")) for kind in ("corpus", "queries", "qrels")}


def dev_cut(train: pa.Table, seed: int = 7, share: float = 0.2, max_queries: int = 300) -> tuple[list[str], list[str]]:
    """(labelled, dev): the train split's labelled queries, and the seeded cut of them held out as dev."""
    from irflow.learn.qrels import positives

    labelled = sorted(positives(train))
    perm = np.random.default_rng(seed).permutation(len(labelled))
    n_dev = min(int(round(share * len(labelled))), max_queries)
    return labelled, sorted(labelled[i] for i in perm[:n_dev])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--config", default=None, help="RocketQA config whose cross_encoder settings are the base "
                                                   "(default: configs/rocketqa_<dataset>_offline.yaml)")
    ap.add_argument("--variant", action="append", default=[], help="name:key=value,... (repeatable)")
    ap.add_argument("--depth", type=int, default=20, help="M_D0 candidates per dev query")
    ap.add_argument("--dev-share", type=float, default=0.2)
    ap.add_argument("--max-dev-queries", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7, help="seed of the fit/dev cut")
    ap.add_argument("--precision", default="auto", help="training precision: auto (bf16 where the CPU has it), "
                                                        "fp32, bf16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads (1 when another job "
                                                                             "uses the other core)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import duckdb

    from sklearn.metrics import roc_auc_score

    from irflow.engine.models import resolve
    from irflow.learn.qrels import positives
    from irflow.engine.runtime import StageRuntime, resolve_precision
    from irflow.learn.scoring import cross_encoder_scores
    from irflow.stages.evaluate import evaluate_run
    from irflow.stages.train_cross_encoder import TrainCrossEncoderParams, fit_cross_encoder, training_pairs
    from irflow.learn.text import doc_texts, query_texts

    store = Path(args.store)
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    ids = ingest_ids(con)
    tables = {k: pq.read_table(store / "objects" / v / "data.parquet") for k, v in ids.items()}
    negatives = pq.read_table(store / "objects" / dataset_id(con, "mine_negatives[md0-ce]") / "data.parquet")
    md0_run = pq.read_table(store / "objects" / dataset_id(con, "dense_search[md0-train]") / "data.parquet")
    con.close()
    dataset = "nfcorpus" if "nfcorpus" in str(store) else "scifact"
    cfg = yaml.safe_load(open(args.config or ROOT / f"configs/rocketqa_{dataset}_offline.yaml"))
    ce_cfg = {k: v for k, v in cfg["cross_encoder"].items() if k in TrainCrossEncoderParams.model_fields}
    base_model = resolve(cfg["cross_encoder"].get("model") or cfg["base_model"]).path

    qrels = tables["qrels"]
    train = qrels.filter(pc.equal(qrels.column("split"), "train"))
    train_pos = positives(train)
    labelled, dev_ids = dev_cut(train, args.seed, args.dev_share, args.max_dev_queries)
    dev, n_dev = set(dev_ids), len(dev_ids)
    fit_qrels = train.filter(pc.invert(pc.is_in(train.column("query_id"), pa.array(sorted(dev)))))
    dev_pos = {q: ds for q, ds in train_pos.items() if q in dev}

    run = md0_run.filter(pc.is_in(md0_run.column("query_id"), pa.array(sorted(dev))))
    run = run.filter(pc.less_equal(run.column("rank"), args.depth))
    cand = list(zip(run.column("query_id").to_pylist(), run.column("doc_id").to_pylist()))
    first = run.column("score").to_pylist()
    qtext = query_texts(tables["queries"])
    dtext = doc_texts(tables["corpus"])
    qrels_dict = {q: {d: 1 for d in ds} for q, ds in dev_pos.items()}
    is_pos = np.array([d in dev_pos.get(q, ()) for q, d in cand])

    def ndcg(scores) -> float:
        res: dict = {}
        for (q, d), s in zip(cand, scores):
            res.setdefault(q, {})[d] = float(s)
        return float(np.mean(list(evaluate_run(qrels_dict, res, ["ndcg@10"])["ndcg@10"].values())))

    import torch
    torch.set_num_threads(args.threads)  # as irflow.engine.stage does around a stage
    precision = resolve_precision(args.precision, "train", "cpu")
    rt = StageRuntime(device="cpu", precision=precision, threads=args.threads, work="train")
    print(f"{dataset}: {len(labelled)} labelled train queries -> {len(labelled) - n_dev} fit / {n_dev} dev; "
          f"{len(cand)} dev candidates (M_D0 top-{args.depth}), {int(is_pos.sum())} judged positive; "
          f"base {base_model}; precision {precision}")
    out = {"dataset": dataset, "store": str(store), "fit_queries": len(labelled) - n_dev, "dev_queries": n_dev,
           "depth": args.depth, "candidates": len(cand), "candidate_positives": int(is_pos.sum()),
           "precision": precision, "base": ce_cfg, "first_stage_ndcg10": round(ndcg(first), 4),
           # what separating judged from unjudged candidates asks of M_C, read on M_D0's own scores
           "first_stage_auc": round(float(roc_auc_score(is_pos, first)), 4), "variants": []}
    print(f"M_D0 order on the dev candidates: nDCG@10 {out['first_stage_ndcg10']}, AUC {out['first_stage_auc']}")

    for spec in args.variant or ["base:"]:
        vname, _, kv = spec.partition(":")
        over = {}
        for item in filter(None, kv.split(",")):
            k, _, v = item.partition("=")
            over[k] = yaml.safe_load(v)
            if isinstance(over[k], str) and k.endswith("lr"):
                over[k] = float(v)  # YAML 1.1 reads 1e-4 as text
        p = TrainCrossEncoderParams(**{**ce_cfg, **over})
        ex = training_pairs(fit_qrels, tables["corpus"].column("doc_id").to_pylist(), p, negatives)
        t0 = time.perf_counter()
        model, tok, history = fit_cross_encoder(ex, qtext, dtext, base_model, p, rt, desc=f"fit {vname}")
        train_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp), tok.save_pretrained(tmp)
            t0 = time.perf_counter()
            logits = cross_encoder_scores(tmp, [(qtext[q], dtext[d]) for q, d in cand], batch_size=64,
                                          max_length=p.max_length)  # fp32, as score_candidates reads it.astype(np.float64)
            score_s = time.perf_counter() - t0
        prob = 1 / (1 + np.exp(-logits))
        tail = history[-max(1, len(history) // 10):]
        row = {"name": vname, "overrides": over, "pairs": len(ex["q"]), "steps": len(history),
               "final_loss": round(float(np.mean([h["loss"] for h in tail])), 4),
               "rerank_ndcg10": round(ndcg(logits), 4), "auc": round(float(roc_auc_score(is_pos, logits)), 4),
               "logit_std": round(float(logits.std()), 4),
               "logit_range": [round(float(logits.min()), 3), round(float(logits.max()), 3)],
               "positives_dropped": round(float((prob[is_pos] < 0.1).mean()), 4),
               "unjudged_dropped": round(float((prob[~is_pos] < 0.1).mean()), 4),
               "train_s": round(train_s, 1), "score_s": round(score_s, 1)}
        out["variants"].append(row)
        harness.log(f"{vname}: {row}")

    harness.table(["variant", "steps", "loss", "nDCG@10", "AUC", "std", "pos<0.1", "unj<0.1", "train s"],
                  [["(M_D0 order)", "", "", out["first_stage_ndcg10"], out["first_stage_auc"]]]
                  + [[r["name"], r["steps"], r["final_loss"], r["rerank_ndcg10"], r["auc"], r["logit_std"],
                      r["positives_dropped"], r["unjudged_dropped"], r["train_s"]] for r in out["variants"]])
    dest = harness.write_json(args.out or ROOT / f"bench/results/cross_encoder_dev_{dataset}.json", out)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
