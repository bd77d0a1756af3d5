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

# No `from __future__ import annotations`: Prefect loads a deployment entrypoint file as a module that
# is not in sys.modules, where pydantic could not resolve string annotations of the config models.
from typing import Literal

from pydantic import Field

from irflow.flows.common import (BM25Config, DatasetConfig, ZeroShotDense, alias_runs, bm25_runs, dense_run,
                                 evaluate_runs, ingest, system_name)
from irflow.recipe import RecipeConfig, recipe
from irflow.runner import Run
from irflow.tasks.evaluate import EvaluationParams


class BaselinesConfig(RecipeConfig):
    flow: Literal["baselines"] = Field(description="this recipe: baselines")
    dataset: DatasetConfig = Field(description="the BEIR dataset and the split to evaluate")
    bm25: BM25Config = Field(BM25Config(), description="BM25 systems")
    dense: ZeroShotDense = Field(ZeroShotDense(), description="the zero-shot dense system")
    evaluate: EvaluationParams = Field(EvaluationParams(), description="metrics")


@recipe("baselines", BaselinesConfig)
def baselines(c: BaselinesConfig, run: Run) -> list[dict]:
    data = ingest(run, c.dataset)
    runs = bm25_runs(run, c.bm25, data.corpus, data.test_queries)
    if c.dense.enabled:
        system = c.dense.system or system_name(c.dense.model)
        model = run.model(c.dense.model, "dense.model")
        runs[system] = dense_run(run, c.dense, data.corpus, data.test_queries, system=system, tag="zero-shot",
                                 model=model)
        run.start_system, run.dense_models[system] = system, model
        runs.update(alias_runs(run, c, data, runs, c.dense))
    return evaluate_runs(run, c.evaluate, data, runs)

