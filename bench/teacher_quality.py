"""How good is a GPL run's fusion teacher? Scored on *train-side* labelled queries, never test.

    .venv/bin/python bench/teacher_quality.py --store STORE [--run-id RUN] [--out bench/results/teacher_quality.json]

For the `pseudo_label` stage of a GPL run whose queries are a dataset's unlabelled train queries
(`generate.source: unlabelled`), the train qrels exist even though the recipe never reads them, so
we can ask how often the teacher's top-1 -- the positive GPL trains on -- is a judged-relevant
passage, and how well it ranks each query's candidates (the union of the miners' lists). The
inputs are found through the catalog's lineage from the run's pseudo-labels, not by path.

Teacher variants (same candidates):
- `pipeline`: the pipeline's fusion teacher -- ``irflow.learn.fusion.fuse_runs`` over the two miners' runs
  with the run's ``FusionSettings`` (method, rrf_k, depth; by default z-scores over each miner's
  list, a candidate missing from a list gets that list's per-query minimum), scoring exactly the
  candidate pairs, as ``label_scores`` does; the BM25 weight is varied with --alphas;
- `exact`: every candidate scored by both retrievers (cosine from the miner's corpus embeddings with
  the query encoded as ``dense_search`` encodes it; BM25 from a deeper search, 0 where the term match
  is below its depth), z-scores over the candidates;
- each retriever alone.
The dense miner's model is found through lineage (the ``model`` input of its ``dense_search``), its
encoding settings in that stage's params. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

import harness
from harness import ROOT


def table(store: Path, dataset_id: str):
    return pq.read_table(store / "objects" / dataset_id / "data.parquet")


def parents(con, child: str) -> list[tuple[str, str, str]]:
    """(role, parent id, parent's stage) of the stage execution that made ``child`` (its cache key), as
    ``Catalog.lineage`` walks them."""
    return con.execute("SELECT e.role, e.parent_id, d.stage FROM edges e JOIN datasets d ON d.dataset_id = e.parent_id "
                       "WHERE e.child_id = ? AND e.cache_key = (SELECT cache_key FROM datasets WHERE dataset_id = ?) "
                       "ORDER BY e.role, e.parent_id", [child, child]).fetchall()


def params_of(con, dataset_id: str) -> dict:
    return json.loads(con.execute("SELECT params FROM datasets WHERE dataset_id = ?", [dataset_id]).fetchone()[0]
                      or "{}")


def model_path(con, store: Path, model_id: str) -> str:
    """Where to load a model input from: a stored model (objects/<id>), or a config-named one (an
    `external` row: the path it was found at, else the name resolved again)."""
    from irflow.engine.models import resolve

    stored = store / "objects" / model_id
    if stored.is_dir():
        return str(stored)
    stage, path, params = con.execute("SELECT stage, path, params FROM datasets WHERE dataset_id = ?",
                                      [model_id]).fetchone()
    if path and Path(path).exists():
        return path
    name = json.loads(params or "{}").get("name")
    if stage != "external" or not name:
        raise SystemExit(f"model {model_id}: not in {store / 'objects'} and no path to load it from")
    return resolve(name, str(store)).path


def zscore(v: np.ndarray) -> np.ndarray:
    s = v.std()
    return (v - v.mean()) / s if s > 0 else np.zeros_like(v)


def quality(cand: dict, rel: dict, score) -> dict:
    p1, ndcg = [], []
    for q, docs in cand.items():
        if q not in rel:
            continue
        ranked = sorted(docs, key=lambda d: (-score(q, d), d))
        p1.append(ranked[0] in rel[q])
        dcg = sum(1 / np.log2(i + 2) for i, d in enumerate(ranked[:10]) if d in rel[q])
        ndcg.append(dcg / sum(1 / np.log2(i + 2) for i in range(min(10, len(rel[q])))))
    return {"top1_relevant": round(float(np.mean(p1)), 4), "ndcg@10_of_candidates": round(float(np.mean(ndcg)), 4),
            "queries": len(p1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--run-id", help="a GPL run (default: the latest run with a pseudo_label stage)")
    ap.add_argument("--alphas", default="0.3,0.5", help="BM25 weights to try (dense gets 1 - alpha)")
    ap.add_argument("--bm25-depth", type=int, default=1000, help="BM25 depth for the exact variant")
    ap.add_argument("--no-exact", action="store_true", help="skip the exact variant (and its deep BM25 search)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "teacher_quality.json"))
    args = ap.parse_args()

    import duckdb

    from irflow.engine.catalog import when_unlocked

    from irflow.engine.java import setup_pyserini_env

    setup_pyserini_env()
    import pyarrow as pa

    from irflow.learn.encoding import encode_texts
    from irflow.learn.fusion import FusionSettings, fuse_runs
    from irflow.learn.encoding import load_sentence_transformer
    from irflow.stages.bm25 import SEARCH_FIELDS, search
    from irflow.stages.dense import embeddings_to_numpy

    store = Path(args.store).resolve()
    path = str(store / "catalog.duckdb")
    con = when_unlocked(lambda: duckdb.connect(path, read_only=True), path)  # a running flow may hold it
    run_id = args.run_id or con.execute(
        "SELECT run_id FROM stage_runs WHERE stage = 'pseudo_label' ORDER BY started_at DESC LIMIT 1").fetchone()[0]
    [labels_id] = [json.loads(o)["pseudo_labels"] for (o,) in con.execute(
        "SELECT outputs FROM stage_runs WHERE run_id = ? AND stage = 'pseudo_label'", [run_id]).fetchall()]
    cfg = json.loads(con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchone()[0])
    # the teacher and its runs are label_scores' (the scores the labels were scaled from)
    scores_id = next(p for r, p, _ in parents(con, labels_id) if r == "scores")
    label_params = params_of(con, scores_id)
    inputs = parents(con, scores_id)
    queries_id = next(p for r, p, _ in inputs if r == "queries")
    corpus_id = next(p for r, p, _ in inputs if r == "corpus")
    runs = {s: p for r, p, s in inputs if r in ("teacher_rankings", "teacher_runs")}
    bm25_run = next(p for s, p in runs.items() if s.startswith("bm25_search"))
    dense_run = next(p for s, p in runs.items() if s.startswith("dense_search"))
    index_id = next(p for r, p, _ in parents(con, bm25_run) if r == "bm25_index")
    dense_inputs = parents(con, dense_run)
    emb_id = next(p for r, p, _ in dense_inputs if r == "embeddings")
    # the model is an input of dense_search (and of encode_corpus), not a param
    dense_model = model_path(con, store, next(p for r, p, _ in dense_inputs if r == "model"))
    dense_params = params_of(con, dense_run)  # similarity, batch_size, max_seq_length as the search encoded queries
    # ingest's outputs share one cache key: its qrels sit beside the corpus the run used
    [qrels_id] = con.execute("SELECT dataset_id FROM datasets WHERE name = 'qrels' AND cache_key = "
                             "(SELECT cache_key FROM datasets WHERE dataset_id = ?)", [corpus_id]).fetchone()
    bm25_params = params_of(con, bm25_run)
    con.close()
    teacher = label_params.get("teacher") or {}
    fusion = (FusionSettings(**{k: teacher[k] for k in FusionSettings.model_fields if k in teacher})
              if teacher.get("type") == "fusion" else FusionSettings())

    queries = table(store, queries_id)
    qids, texts = queries.column("query_id").to_pylist(), queries.column("text").to_pylist()
    split = cfg.get("generate", {}).get("split", "train")
    qr = table(store, qrels_id).to_pandas()
    qr = qr[(qr.split == split) & (qr.score > 0)]
    rel: dict[str, set] = defaultdict(set)
    for q, d in zip(qr.query_id, qr.doc_id):
        rel[q].add(d)
    if split == "test":
        raise SystemExit("the run's queries are test queries: this bench only scores train-side queries")

    bm, de = table(store, bm25_run), table(store, dense_run)
    cand: dict[str, set] = defaultdict(set)
    for t in (bm, de):  # the teacher's candidates: the union of the miners' lists (to the teacher's depth)
        for q, d, r in zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist(),
                           t.column("rank").to_pylist()):
            if d != q and (not fusion.input_depth or r <= fusion.input_depth):
                cand[q].add(d)
    pairs = pa.table({"query_id": [q for q, ds in cand.items() for _ in ds],
                      "doc_id": [d for ds in cand.values() for d in ds]},
                     schema=pa.schema([("query_id", pa.string()), ("doc_id", pa.string())]))

    t0 = time.perf_counter()
    model = load_sentence_transformer(dense_model, "cpu", dense_params.get("max_seq_length"))
    qemb = encode_texts(model, texts, int(dense_params.get("batch_size", 64)),
                        dense_params.get("similarity", "cos") == "cos", desc="encode queries")
    emb_t = table(store, emb_id)
    doc_emb = embeddings_to_numpy(emb_t)
    drow = {d: i for i, d in enumerate(emb_t.column("doc_id").to_pylist())}
    qrow = {q: i for i, q in enumerate(qids)}
    cos = {(q, d): float(qemb[qrow[q]] @ doc_emb[drow[d]]) for q, ds in cand.items() for d in ds}
    deep = {"query_id": [], "doc_id": [], "score": []}
    if not args.no_exact:
        deep = search(str(store / "objects" / index_id), qids, texts, k1=float(bm25_params.get("k1", 0.9)),
                      b=float(bm25_params.get("b", 0.4)), top_k=args.bm25_depth,
                      fields=SEARCH_FIELDS[bm25_params.get("variant", "flat")],
                      remove_query=bool(bm25_params.get("remove_query", False)), threads=1)
    bm25 = {k: s for k, s in zip(zip(deep["query_id"], deep["doc_id"]), deep["score"]) if k in cos}
    seconds = time.perf_counter() - t0

    rows = {"dense alone": quality(cand, rel, lambda q, d: cos[(q, d)])}
    if not args.no_exact:
        rows["bm25 alone"] = quality(cand, rel, lambda q, d: bm25.get((q, d), 0.0))
    bm_sys, de_sys = bm.column("system")[0].as_py(), de.column("system")[0].as_py()
    for a in (float(x) for x in args.alphas.split(",")):
        f = fuse_runs([bm, de], method=fusion.method, weights={bm_sys: a, de_sys: 1 - a}, rrf_k=fusion.rrf_k,
                      input_depth=fusion.input_depth, pairs=pairs)
        piped = dict(zip(zip(f.column("query_id").to_pylist(), f.column("doc_id").to_pylist()), f.column("score").to_pylist()))
        rows[f"pipeline fusion alpha={a}"] = quality(cand, rel, lambda q, d: piped[(q, d)])
        if args.no_exact:
            continue
        exact = {}
        for q, ds in cand.items():
            ds = sorted(ds)
            s = a * zscore(np.array([bm25.get((q, d), 0.0) for d in ds])) + (1 - a) * zscore(np.array([cos[(q, d)] for d in ds]))
            exact.update(zip(((q, d) for d in ds), s))
        rows[f"exact fusion alpha={a}"] = quality(cand, rel, lambda q, d: exact[(q, d)])

    # Check: with the run's own weights, does the `pipeline` variant pick the positives the run trained on?
    reproduced = None
    if label_params.get("positive") == "teacher_top1" and teacher.get("type") == "fusion" and teacher.get("weights"):
        f = fuse_runs([bm, de], method=fusion.method, weights=teacher["weights"], rrf_k=fusion.rrf_k,
                      input_depth=fusion.input_depth, pairs=pairs, depth=1)
        ours = dict(zip(f.column("query_id").to_pylist(), f.column("doc_id").to_pylist()))
        lab = table(store, labels_id)
        theirs = dict(zip(lab.column("query_id").to_pylist(), lab.column("pos_doc_id").to_pylist()))
        reproduced = {"queries": len(theirs), "same_top1": sum(ours.get(q) == d for q, d in theirs.items())}
        print(f"pipeline variant at the run's weights {teacher['weights']}: same top-1 as the run's pseudo labels "
              f"for {reproduced['same_top1']} of {reproduced['queries']} queries")

    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "store": str(store), "run_id": run_id,
              "pseudo_labels": labels_id, "dataset": cfg.get("dataset", {}).get("name"), "query_split": split,
              "candidates_per_query": round(float(np.mean([len(v) for v in cand.values()])), 1),
              "teacher_in_run": cfg.get("teacher"), "pipeline_fusion": fusion.model_dump(), "run_teacher_reproduced": reproduced,
              "dense_model": dense_model, "dense_params": dense_params,
              "scoring_seconds": round(seconds, 1), "variants": rows}
    print(f"run {run_id} ({report['dataset']}, {split} queries, {report['candidates_per_query']} candidates/query)")
    harness.table(["teacher", "top-1 relevant", "nDCG@10 of candidates"],
                  [[name, f"{r['top1_relevant']:.4f}", f"{r['ndcg@10_of_candidates']:.4f}"] for name, r in rows.items()])
    print(f"wrote {harness.write_json(args.out, report)}")


if __name__ == "__main__":
    main()
