"""Baselines: BM25 (flat and multifield) and zero-shot dense retrieval over a BEIR dataset.

    BEIR dataset ──ingest──> corpus, queries, qrels
                               │
              select_queries (the evaluation split)
               ┌───────────────┴──────────────────┐
      bm25_index[variant]                    encode_corpus
      bm25_search[variant]                   dense_search
               └───────────────┬──────────────────┘
                     evaluate[system] ──> report (metrics table, Prefect artifact, catalog)
"""

from __future__ import annotations

from prefect import flow

from irflow.config import section
from irflow.flows.common import DENSE_DEFAULTS, bm25_runs, dense_cfg, dense_run, evaluate_runs, ingest, system_name
from irflow.stage import RunContext
from irflow.tasks.report import report


def baselines(cfg: dict, ctx: RunContext) -> list[dict]:
    beir, queries = ingest(ctx, cfg)
    runs = bm25_runs(ctx, cfg, beir["corpus"], queries)
    if section(cfg, "dense", DENSE_DEFAULTS).get("enabled", True):
        dcfg = dense_cfg(cfg, ctx)
        system = section(cfg, "dense").get("system") or system_name(dcfg["model"])
        runs[system] = dense_run(ctx, dcfg, beir["corpus"], queries, system=system, label="zero-shot")
    evals = evaluate_runs(ctx, cfg, runs, beir["qrels"], queries)
    return [] if ctx.dry_run else report(ctx, evals)


baselines_flow = flow(name="baselines", log_prints=True, validate_parameters=False)(baselines)
