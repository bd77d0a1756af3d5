"""Baselines: BM25 (flat and multifield), zero-shot dense retrieval and, optionally, DeepCT over a BEIR dataset.

    BEIR dataset ──ingest──> corpus, queries, qrels
                               │
              select_queries (the evaluation split)
       ┌───────────────────────┼───────────────────────────────┐
  bm25_index[variant]   (deepct.enabled)                  encode_corpus
  bm25_search[variant]  train_deepct (train split qrels)  dense_search
       │                deepct_weight (tf'-weighted text)      │
       │                bm25_index, bm25_search[flat-deepct]   │
       └───────────────────────┼───────────────────────────────┘
                     evaluate[system] ──> report (metrics table, Prefect artifact, catalog)

DeepCT (Dai & Callan, 2019; ``irflow.stages.deepct``) is off by default: with ``deepct.enabled`` it trains a
term-weighting model on the dataset's train split and evaluates BM25 over the re-weighted corpus as system
``bm25-deepct``, next to the others on the evaluated split.
"""

# No `from __future__ import annotations`: Prefect loads a deployment entrypoint file as a module that
# is not in sys.modules, where pydantic could not resolve string annotations of the config models.
from typing import ClassVar, Literal

from pydantic import Field, PositiveInt, model_validator

from irflow.engine.follows import Follow
from irflow.engine.params import ModelName
from irflow.engine.runner import Run
from irflow.engine.store import DatasetRef
from irflow.recipes.base import Made, RecipeConfig, recipe
from irflow.recipes.common import (
    BM25Config,
    Systems,
    ZeroShotDense,
    alias_runs,
    bm25_rankings,
    dense_ranking,
    evaluate_systems,
    system_name,
)
from irflow.recipes.dataset import Dataset, DatasetConfig, ingest
from irflow.stages.bm25 import BM25IndexParams, BM25SearchParams, bm25_index, bm25_search
from irflow.stages.deepct import DeepCTWeightParams, TrainDeepCTParams, deepct_weight, train_deepct
from irflow.stages.evaluate import EvaluationParams

DEEPCT_MODEL = "bert-base-uncased"  # the paper's encoder
DEEPCT_SYSTEM = "bm25-deepct"


class DeepCTConfig(TrainDeepCTParams):
    enabled: bool = Field(False, description="train DeepCT on the dataset's train split (deepct.split), re-weight "
                                             "the corpus with it and evaluate BM25 over it as system bm25-deepct")
    model: ModelName | None = Field(None, description="the encoder DeepCT starts from (a hub id, a local directory "
                                                      "or a stored model id; a fresh one-output token head is "
                                                      "trained on it)")
    scale: float = Field(100, gt=0, description="tf' = round(max(0, predicted weight) * scale) (100: the paper's)")
    weight_batch_size: PositiveInt = Field(32, description="passages per forward pass when the corpus is weighted")
    k1: float | None = Field(None, ge=0, description="BM25 k1 over the DeepCT index (null: bm25.k1); tf' runs up "
                                                     "to about `scale`, far above raw counts, so k1 may want its "
                                                     "own value there")
    b: float | None = Field(None, ge=0, le=1, description="BM25 b over the DeepCT index (null: bm25.b)")


class BaselinesConfig(RecipeConfig):
    follows: ClassVar = (
        # a model to load only when DeepCT runs: a disabled section names none (nothing to check offline)
        Follow("deepct.model", "deepct.enabled", lambda on: DEEPCT_MODEL if on else None,
               says=f"{DEEPCT_MODEL} when deepct.enabled, else null"),
    )

    flow: Literal["baselines"] = Field(description="this recipe: baselines")
    dataset: DatasetConfig = Field(description="the BEIR dataset and the split to evaluate")
    bm25: BM25Config = Field(BM25Config(), description="BM25 systems")
    dense: ZeroShotDense = Field(ZeroShotDense(), description="the zero-shot dense system")
    deepct: DeepCTConfig = Field(DeepCTConfig(), description="DeepCT (Dai & Callan, 2019): BM25 over term weights "
                                                             "learned from the train split (off by default)")
    evaluate: EvaluationParams = Field(EvaluationParams(), description="metrics")

    @model_validator(mode="after")
    def _deepct_split(self):
        d = self.deepct
        if not d.enabled:
            return self
        if d.split == self.dataset.split:
            raise ValueError(f"deepct.split: '{d.split}' is the evaluated split (dataset.split); training DeepCT on "
                             "its queries would leak the test set")
        splits = self.dataset.splits()
        if splits is not None and d.split not in splits:
            raise ValueError(f"deepct.enabled: DeepCT learns term weights from the queries judged in a train split, "
                             f"and {self.dataset.source} has no split '{d.split}' (deepct.split; its qrels: "
                             f"{', '.join(splits) or 'none'}): set deepct.split to a labelled split other than "
                             f"dataset.split, or leave deepct off")
        return self


def deepct_run(run: Run, c: BaselinesConfig, data: Dataset) -> DatasetRef:
    """BM25 over the DeepCT-weighted corpus (a flat index: the title is folded into the weighted text)."""
    d = c.deepct
    base = run.model(d.model or DEEPCT_MODEL, "deepct.model")
    trained = train_deepct(run, d.to(TrainDeepCTParams), corpus=data.corpus, queries=data.queries, qrels=data.qrels,
                           model=base)["deepct_model"]
    weighted = deepct_weight(run, d.to(DeepCTWeightParams, batch_size=d.weight_batch_size), corpus=data.corpus,
                             model=trained)
    index = bm25_index(run, BM25IndexParams(variant="flat"), tag="flat-deepct", corpus=weighted)
    bm25 = {k: v for k in ("k1", "b") if (v := getattr(d, k)) is not None}
    return bm25_search(run, c.bm25.to(BM25SearchParams, variant="flat", system=DEEPCT_SYSTEM, **bm25),
                       tag="flat-deepct", bm25_index=index, queries=data.test_queries)


@recipe("baselines", BaselinesConfig)
def baselines(c: BaselinesConfig, run: Run) -> Made:
    data = ingest(run, c.dataset)
    systems = Systems(bm25_rankings(run, c.bm25, data.corpus, data.test_queries))
    if c.dense.enabled:
        system = c.dense.system or system_name(c.dense.model)
        model = run.model(c.dense.model, "dense.model")
        systems.dense(system, dense_ranking(run, c.dense, data.corpus, data.test_queries, system=system, tag="zero-shot",
                                        model=model), model, start=True)
        systems.rankings.update(alias_runs(run, c, data, systems, c.dense))
    if c.deepct.enabled:
        systems.rankings[DEEPCT_SYSTEM] = deepct_run(run, c, data)
    return evaluate_systems(run, c.evaluate, data, systems)

