"""Building blocks shared by every recipe: the baseline spine of the graph.

    ingest -> select_queries -> bm25_index -> bm25_search ----\\
                             -> encode_corpus -> dense_search --> evaluate (per system) -> report

Each function wires stages together; each stage is cached on its own inputs.
"""

from __future__ import annotations

from pathlib import Path

from irflow.config import section
from irflow.models import model_cfg
from irflow.stage import RunContext
from irflow.tasks.bm25 import bm25_index, bm25_search
from irflow.tasks.dense import dense_search, encode_corpus
from irflow.tasks.evaluate import DEFAULT_METRICS, evaluate
from irflow.tasks.ingest import ingest_beir, ingest_config, select_queries

BM25_DEFAULTS = {"variants": ["flat"], "k1": 0.9, "b": 0.4, "top_k": 1000, "remove_query": True}
DENSE_DEFAULTS = {"model": "all-MiniLM-L6-v2", "similarity": "cos", "batch_size": 64, "max_seq_length": None,
                  "index": "flat", "top_k": 1000, "remove_query": True}


def threads(cfg: dict) -> int:
    return int(section(cfg, "runtime").get("threads", 2))


def ingest(ctx: RunContext, cfg: dict) -> tuple[dict, object]:
    """The dataset and its evaluation queries: ({corpus, queries, qrels}, split queries)."""
    ds = section(cfg, "dataset", {"split": "test"})
    beir = ingest_beir(ctx, cfg=ingest_config(ds, Path(ctx.store_root) / "downloads"))
    split_cfg = {"split": ds["split"], **({"limit": ds["limit_queries"]} if ds.get("limit_queries") else {})}
    queries = select_queries(ctx, cfg=split_cfg, label=ds["split"], queries=beir["queries"], qrels=beir["qrels"])
    return beir, queries


def bm25_runs(ctx: RunContext, cfg: dict, corpus, queries, system_prefix: str = "bm25", label_suffix: str = "") -> dict:
    """system name -> run ref, one per BM25 variant."""
    bm = section(cfg, "bm25", BM25_DEFAULTS)
    runs = {}
    for variant in bm["variants"]:
        label = variant + label_suffix
        index = bm25_index(ctx, cfg={"variant": variant, "_threads": threads(cfg)}, label=label, corpus=corpus)
        search_cfg = {"system": f"{system_prefix}-{variant}", "variant": variant, "k1": bm["k1"], "b": bm["b"],
                      "top_k": bm["top_k"], "remove_query": bm["remove_query"], "_threads": threads(cfg)}
        runs[search_cfg["system"]] = bm25_search(ctx, cfg=search_cfg, label=label, bm25_index=index, queries=queries)
    return runs


def dense_cfg(cfg: dict, ctx: RunContext, section_name: str = "dense", model: str | None = None) -> dict:
    d = section(cfg, section_name, DENSE_DEFAULTS)
    out = {k: v for k, v in d.items() if k not in ("model", "system")}
    out["_threads"] = threads(cfg)
    if d.get("device"):
        out["_device"] = out.pop("device")
    out.update(model_cfg(model or d["model"], ctx.store_root, role=f"{section_name}.model"))
    return out


def system_name(model: str) -> str:
    return "dense-" + Path(str(model).rstrip("/")).name


def dense_run(ctx: RunContext, dcfg: dict, corpus, queries, *, system: str, label: str, model_ref=None):
    """Encode the corpus (cached on corpus + model + encoding settings), then search."""
    enc_keys = ("model", "model_key", "_model_path", "similarity", "batch_size", "max_seq_length", "_device")
    enc_cfg = {k: dcfg[k] for k in enc_keys if k in dcfg}
    if model_ref is not None:  # a model from an earlier stage: its id is in the key through the input
        enc_cfg = {k: v for k, v in enc_cfg.items() if k not in ("model", "model_key", "_model_path")}
    emb = encode_corpus(ctx, cfg=enc_cfg, label=label, corpus=corpus, model=model_ref)
    search_cfg = {**dcfg, "system": system}
    if model_ref is not None:
        search_cfg = {k: v for k, v in search_cfg.items() if k not in ("model", "model_key", "_model_path")}
    return dense_search(ctx, cfg=search_cfg, label=label, embeddings=emb, queries=queries, model=model_ref)


def evaluate_runs(ctx: RunContext, cfg: dict, runs: dict, qrels, queries) -> list[dict]:
    """runs: system name -> run ref, each answering ``queries``. One evaluate stage per system, so a
    changed system re-evaluates alone."""
    ds = section(cfg, "dataset", {"split": "test"})
    ev = section(cfg, "evaluate", {"metrics": DEFAULT_METRICS})
    name = ds.get("name") or Path(str(ds["source"])).stem
    eval_cfg = {"dataset": name, "split": ds["split"], "metrics": ev["metrics"],
                "ignore_identical_ids": ev.get("ignore_identical_ids", True)}
    return [evaluate(ctx, cfg=eval_cfg, label=system, run=run, qrels=qrels, queries=queries)
            for system, run in runs.items()]
