"""How many tokens of each passage should the evaluated dense systems read? A stored run's models, re-read.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/passage_length.py --store /work/runs/gpl-scifact \
        --run gpl-20261127-214032-3b9a --lengths 200,256,350 --splits train,test \
        [--out bench/results/passage_length_scifact.json]

A dense system encodes a passage truncated to its model's ``max_seq_length``, unless ``dense.max_seq_length``
says otherwise. A student saved by ``train_student`` keeps the length it was trained at (GPL's SciFact config:
200 tokens), so it is evaluated at 200 while the zero-shot MiniLM reads 256; 88% of SciFact's passages are
longer than 200 tokens (median 316). This script takes a finished run's zero-shot model and trained students
(from its catalog: ``train_student[...]`` and ``train_dual_encoder[...]`` outputs), encodes the run's corpus at
each length, searches exactly (the pipeline's flat index) and scores every split asked (``train``: the split's judged
queries, whose texts GPL's SciFact config reads as its query log without their judgements, as the teacher was
chosen; ``test`` afterwards). Each row: nDCG@10 and R@100, and a paired t-test against the same model at its
own length. Prints a table and writes JSON. Nothing is written to the store.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import harness


def _ingested(stage_runs: list[dict]) -> dict[str, str] | None:
    return next((s["outputs"] for s in stage_runs if s["name"] == "ingest"), None)


def models_of(stage_runs: list[dict]) -> dict[str, str]:
    """system -> model dataset id: every student the run trained (train_student[x] -> x-student)."""
    out = {}
    for s in stage_runs:
        for prefix in ("train_student[", "train_dual_encoder["):
            if s["name"].startswith(prefix):
                model = next(v for k, v in s["outputs"].items() if k in ("student", "model"))
                out[s["name"][len(prefix):-1] + "-student"] = model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", required=True, help="a finished run in the store: its id, a unique prefix, or latest")
    ap.add_argument("--lengths", default="200,256,350", help="passage lengths in tokens, comma-separated")
    ap.add_argument("--splits", default="train,test")
    ap.add_argument("--systems", default=None, help="comma-separated systems (default: zero-shot and every student)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from irflow.engine.catalog import Catalog
    from irflow.learn.encoding import encode_texts
    from irflow.engine.models import resolve
    from irflow.learn.encoding import load_sentence_transformer
    from irflow.tools.report.runs import UnknownRun, read_table, resolve_run
    from irflow.learn.stats import paired
    from irflow.engine.store import Store
    from irflow.stages.dense import build_index, search_index
    from irflow.stages.evaluate import evaluate_run, qrels_to_dict
    from irflow.learn.text import passage_texts, query_texts

    if not (Path(args.store) / "catalog.duckdb").is_file():
        ap.error(f"--store {args.store}: not an irflow store (no catalog.duckdb)")
    store = Store(args.store)
    catalog = Catalog(Path(args.store) / "catalog.duckdb")
    try:  # an id, a unique prefix or 'latest', as `irflow report` takes it
        args.run = resolve_run(catalog, args.run)
    except UnknownRun as e:
        ap.error(f"--run: {e}")
    stage_runs = catalog.stage_runs(args.run)
    if _ingested(stage_runs) is None:
        ap.error(f"--run {args.run}: the run has no ingest stage (it failed before its data was read)")
    data = {k: read_table(catalog, v) for k, v in _ingested(stage_runs).items()}
    corpus, doc_ids = data["corpus"], data["corpus"].column("doc_id").to_pylist()
    docs = passage_texts(corpus)
    systems = {"zero-shot": resolve("all-MiniLM-L6-v2").path}
    systems.update({name: store.object_dir(mid) for name, mid in models_of(stage_runs).items()})
    if args.systems:
        unknown = set(args.systems.split(",")) - set(systems)
        if unknown:
            ap.error(f"--systems: {', '.join(sorted(unknown))} not in run {args.run} (it has {', '.join(systems)})")
        systems = {k: v for k, v in systems.items() if k in args.systems.split(",")}
    lengths = [int(x) for x in args.lengths.split(",")]
    splits = args.splits.split(",")

    judged = {sp: qrels_to_dict(data["qrels"], sp) for sp in splits}
    queries = {sp: query_texts(data["queries"], set(judged[sp])) for sp in splits}
    rows, per_query = [], {}
    for system, path in systems.items():
        own = int(load_sentence_transformer(str(path), "cpu").max_seq_length)  # the length it was saved with
        for length in lengths:
            t0 = time.perf_counter()
            st = load_sentence_transformer(str(path), "cpu", length)
            # fp32, as the runs encode (precision auto is fp32 for inference)
            index = build_index(encode_texts(st, docs, args.batch_size, True, desc=f"{system} @{length}"), "flat")
            for sp in splits:
                qids = sorted(queries[sp])
                q = encode_texts(st, [queries[sp][i] for i in qids], args.batch_size, True, desc="queries")
                scores, hits = search_index(index, q, 100)  # row ids, best first
                results = {qid: {doc_ids[j]: float(x) for x, j in zip(scores[i], hits[i]) if j >= 0}
                           for i, qid in enumerate(qids)}
                m = evaluate_run(judged[sp], results, ["ndcg@10", "recall@100"])
                per_query[(system, length, sp)] = m["ndcg@10"]
                rows.append({"system": system, "length": length, "own_length": own, "split": sp,
                             "queries": len(m["ndcg@10"]),
                             "ndcg@10": round(float(np.mean(list(m["ndcg@10"].values()))), 4),
                             "recall@100": round(float(np.mean(list(m["recall@100"].values()))), 4),
                             "seconds": round(time.perf_counter() - t0, 1)})
                print(json.dumps(rows[-1]), flush=True)
    for r in rows:  # against the same model at the length it was saved with
        ref = per_query.get((r["system"], r["own_length"], r["split"]))
        if ref is not None and r["length"] != r["own_length"]:
            t = paired(ref, per_query[(r["system"], r["length"], r["split"])])
            r["vs_own_length"] = {"diff": round(t.mean_diff, 4), "wins": t.wins, "losses": t.losses,
                                  "t_pvalue": round(t.t_pvalue, 4)}

    print(f"\n| system | split | length | nDCG@10 | R@100 | vs its own length ({'/'.join(map(str, lengths))}) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        v = r.get("vs_own_length")
        vs = f"{v['diff']:+.4f} ({v['wins']} / {v['losses']}, p {v['t_pvalue']})" if v else "(own length)" \
            if r["length"] == r["own_length"] else ""
        print(f"| {r['system']} | {r['split']} | {r['length']} | {r['ndcg@10']:.4f} | {r['recall@100']:.4f} | {vs} |")
    if args.out:
        harness.write_json(args.out, {"store": args.store, "run": args.run, "rows": rows,
                                      "machine": harness.machine()})


if __name__ == "__main__":
    main()
