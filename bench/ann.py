"""ANN benchmark: IVF-Flat and IVF-PQ (with exact re-ranking) against flat search: recall and cost.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/ann.py [--cases scifact,synthetic]
        [--out bench/results/ann.json] [--cache-dir /tmp/irflow-ann-bench] [--threads 1]
        [--synthetic-size 100000] [--nprobes 1,4,8,16,32,64,128]

Every index is built with ``irflow.learn.ann.build`` from batches of 10,000 embeddings (the path a sharded
corpus takes) and searched for the top 100 of every query. Per index: build seconds (training +
filling), index bytes (``faiss.serialize_index``; for ivf_pq also the re-ranking vectors, which sit
in a memmap file on disk, not in RAM); per nprobe: search seconds for all queries, and recall@10 /
recall@100 against flat's top 10 / top 100 on the same vectors. IVF-PQ uses pq_m 48 (48 B codes for
384 dims) and is also searched with a shortlist of 100 (no re-ranking: PQ's own order) and of 1000.

Cases:
- ``scifact``: the whole SciFact corpus (5183 passages) encoded once with all-MiniLM-L6-v2 (cos, the
  model's 256 tokens) and cached as .npy in ``--cache-dir``; queries: all 1109 SciFact queries.
- ``synthetic``: ``--synthetic-size`` vectors of 384 dims with cluster structure taken from real
  queries: each is q_i + 0.5 q_j + Gaussian noise (|noise| ~ 0.8), normalised, with q_i, q_j two
  random SciFact query embeddings (seed 0); queries: the 1109 real query embeddings. A corpus large
  enough for IVF's automatic nlist (4 x sqrt(N)) to be a realistic number of cells.

faiss runs on ``--threads`` OpenMP threads (default 1: on a shared 2-core machine two spinning threads
measured several times slower than one). Results merge into ``--out`` (a case run again replaces its
entry).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import harness
from harness import ROOT, log

import numpy as np

CASES = ("scifact", "synthetic")
TOP_K = 100
BATCH = 10_000
PQ_M = 48
SHORTLISTS = (100, 1000)  # besides the default 4 x top_k; 100 = no re-ranking
MSMARCO_PASSAGES = 8_841_823


def cached(path: Path, compute) -> np.ndarray:
    """``compute()`` saved to ``path`` the first time, read from it after."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, compute())
    return np.load(path)


def minilm_encode(texts: list[str], what: str) -> np.ndarray:
    from irflow.learn.encoding import encode_texts
    from irflow.engine.models import minilm_path
    from irflow.learn.encoding import load_sentence_transformer

    log(f"encoding {len(texts)} SciFact {what} with MiniLM (once)")
    return encode_texts(load_sentence_transformer(minilm_path(), "cpu"), texts, 64, True, desc=what)


def scifact_queries(cache_dir: Path) -> np.ndarray:
    _, queries, _ = harness.read_beir(harness.DATASETS / "scifact.zip")
    return cached(cache_dir / "scifact-minilm-queries.npy", lambda: minilm_encode(list(queries.values()), "queries"))


def scifact_corpus(cache_dir: Path) -> np.ndarray:
    from irflow.learn.text import passage_text

    corpus, _, _ = harness.read_beir(harness.DATASETS / "scifact.zip")
    return cached(cache_dir / "scifact-minilm-corpus.npy",
                  lambda: minilm_encode([passage_text(r.get("title"), r.get("text")) for r in corpus], "passages"))


def synthetic_corpus(queries: np.ndarray, size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    i, j = rng.integers(0, len(queries), size), rng.integers(0, len(queries), size)
    noise = rng.normal(scale=0.8 / np.sqrt(queries.shape[1]), size=(size, queries.shape[1]))
    docs = (queries[i] + 0.5 * queries[j] + noise).astype(np.float32)
    return docs / np.linalg.norm(docs, axis=1, keepdims=True)


def recall(found: np.ndarray, exact: np.ndarray, k: int) -> float:
    return round(float(np.mean([len(set(f[:k]) & set(e[:k])) / k for f, e in zip(found, exact)])), 4)


def index_bytes(index) -> int:
    import faiss

    return int(faiss.serialize_index(index.index).nbytes)


def measure(docs: np.ndarray, queries: np.ndarray, nprobes: list[int], threads: int) -> dict:
    from irflow.learn import ann

    def batches():
        return (docs[i:i + BATCH] for i in range(0, len(docs), BATCH))

    def timed_build(kind, **kw):
        t0 = time.perf_counter()
        index = ann.build(batches, kind, threads=threads, **kw)
        seconds = round(time.perf_counter() - t0, 2)
        log(f"  {kind}: built in {seconds} s ({index.index.nlist if kind != 'flat' else '-'} cells)")
        return index, seconds

    def timed_search(index, **kw):
        t0 = time.perf_counter()
        scores, ids = ann.search(index, queries, TOP_K, threads=threads, **kw)
        return ids, round(time.perf_counter() - t0, 3)

    flat, flat_build = timed_build("flat")
    exact, flat_search = timed_search(flat)
    out = {"num_docs": len(docs), "num_queries": len(queries), "dim": docs.shape[1],
           "flat": {"build_seconds": flat_build, "search_seconds": flat_search, "index_bytes": index_bytes(flat)}}
    for kind, kw in (("ivf_flat", {}), ("ivf_pq", {"pq_m": PQ_M})):
        index, build_seconds = timed_build(kind, **kw)
        entry = {"nlist": index.index.nlist, "build_seconds": build_seconds, "index_bytes": index_bytes(index),
                 "searches": []}
        if index.vectors is not None:
            entry["rerank_vectors_bytes_on_disk"] = int(index.vectors.nbytes)
        shortlists = (None, *SHORTLISTS) if kind == "ivf_pq" else (None,)
        for nprobe in nprobes:
            for shortlist in shortlists:
                ids, seconds = timed_search(index, nprobe=nprobe, rerank_depth=shortlist)
                row = {"nprobe": min(nprobe, index.index.nlist), "search_seconds": seconds,
                       "recall@10": recall(ids, exact, 10), "recall@100": recall(ids, exact, 100)}
                if kind == "ivf_pq":
                    row["rerank_depth"] = shortlist or 4 * TOP_K
                entry["searches"].append(row)
                log(f"    {row}")
        out[kind] = entry
    return out


def sizing(num_vectors: int, dim: int, pq_m: int, nlist: int) -> dict:
    """RAM of flat vs IVF-PQ at ``num_vectors`` (codes + 8-byte ids + centroids + PQ codebooks)."""
    return {"num_vectors": num_vectors, "dim": dim, "flat_bytes": num_vectors * dim * 4, "pq_m": pq_m,
            "nlist": nlist, "ivf_pq_bytes": num_vectors * (pq_m + 8) + nlist * dim * 4 + 256 * dim * 4,
            "rerank_vectors_float32_bytes_on_disk": num_vectors * dim * 4}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ann.json"))
    ap.add_argument("--cache-dir", default="/tmp/irflow-ann-bench", help="where the SciFact embeddings are cached")
    ap.add_argument("--threads", type=int, default=1, help="faiss OpenMP threads")
    ap.add_argument("--synthetic-size", type=int, default=100_000)
    ap.add_argument("--nprobes", default="1,4,8,16,32,64,128")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if set(cases) - set(CASES):
        ap.error(f"unknown case(s) {sorted(set(cases) - set(CASES))}; choose from {', '.join(CASES)}")
    nprobes = [int(n) for n in args.nprobes.split(",")]
    out_path = Path(args.out)
    data = json.loads(out_path.read_text()) if out_path.exists() else {}
    results = data.get("results", {})
    cache_dir = Path(args.cache_dir)
    queries = scifact_queries(cache_dir)
    for name in cases:
        docs = scifact_corpus(cache_dir) if name == "scifact" else synthetic_corpus(queries, args.synthetic_size)
        log(f"{name}: {len(docs)} x {docs.shape[1]} docs, {len(queries)} queries")
        load0 = harness.loadavg()
        results[name] = {**measure(docs, queries, nprobes, args.threads), "threads": args.threads,
                         "loadavg_start": load0, "loadavg_end": harness.loadavg()}
        for kind in ("ivf_flat", "ivf_pq"):
            r = results[name][kind]
            harness.table(["index", "nlist", "nprobe", "rerank depth", "recall@10", "recall@100", "search s"],
                          [[kind, r["nlist"], s["nprobe"], s.get("rerank_depth", "-"), s["recall@10"],
                            s["recall@100"], s["search_seconds"]] for s in r["searches"]])
        data = {"description": "recall@10/@100 of IVF-Flat and IVF-PQ (+ exact re-ranking) against flat inner-product "
                               "search, build/search seconds, index bytes (bench/ann.py)",
                "note": "2-core machine shared with other jobs (see loadavg_*): times are indicative",
                "results": results,
                "sizing_msmarco_minilm": sizing(MSMARCO_PASSAGES, 384, PQ_M, 65536)}
        harness.write_json(out_path, data)
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
