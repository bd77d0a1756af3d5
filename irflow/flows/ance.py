"""ANCE (Xiong et al., ICLR 2021): negatives from the model's own index, refreshed as it trains.

    labelled pairs + BM25 negatives ──train_dual_encoder──> warm-up model (round 0)    (DPR's recipe)
    for r in 1..rounds:                                                               (synchronous rounds)
        model_{r-1} encodes the corpus, retrieves the train queries' top 200 (ANN)
        mine_negatives: a sample of its top 200, positives excluded
        train_dual_encoder from model_{r-1} on labelled pairs + those negatives ──> model_r
    test queries ──> BM25 | zero-shot | warm-up | round 1..R ──> evaluate ──> report

ANCE refreshes its index asynchronously (an inference job re-encodes the corpus every 10k training
steps while the trainer goes on); here the rounds are synchronous, as Tevatron reproduces it. Each
round's stages are keyed on the previous round's model: raising ``rounds`` from 2 to 3 computes
round 3 and its evaluation only.
"""

# No `from __future__ import annotations`: Prefect loads a deployment entrypoint file as a module that
# is not in sys.modules, where pydantic could not resolve string annotations of the config models.
from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from irflow.dual_encoder import TrainDualEncoderParams
from irflow.flows.common import (SupervisedConfig, bm25_train_run, evaluate_runs, ingest, labelled_queries,
                                 raw_section, retrieve, test_runs)
from irflow.recipe import recipe
from irflow.stage import Run
from irflow.tasks.mine_negatives import MineParams, mine_negatives
from irflow.tasks.train_dual_encoder import train_dual_encoder


class WarmupConfig(TrainDualEncoderParams):
    bm25_depth: PositiveInt = Field(100, description="warm-up negatives come from BM25's top n, positives excluded")


class RoundConfig(TrainDualEncoderParams):
    depth: PositiveInt = Field(200, description="the current model's top n per train query (ANCE: 200; 500 was "
                                                "worse in the paper)")
    mined_per_query: PositiveInt = Field(20, description="negatives sampled per query from that top n (ANCE: 20)")
    init: Literal["previous", "base"] = Field("previous", description="previous: continue from the last round's "
                                                                      "model (ANCE); base: retrain from base_model "
                                                                      "(Tevatron's cheap reproduction)")


class ANCEConfig(SupervisedConfig):
    flow: Literal["ance"] = Field(description="this recipe: ance")
    warmup: WarmupConfig = Field(WarmupConfig(negatives_per_query=1), description="round 0: BM25 negatives")
    rounds: NonNegativeInt = Field(2, description="index refreshes after the warm-up")
    round: RoundConfig = Field(RoundConfig(negatives_per_query=1), description="each refresh's retrieval, mining "
                                                                               "and training")

    @model_validator(mode="before")
    @classmethod
    def _follow(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        split = data.get("train_split", "train")
        for key in ("warmup", "round"):
            section = raw_section(data, key)
            if section is not None:
                section.setdefault("splits", [split])
                section.setdefault("negatives_per_query", 1)
        warm, dense = raw_section(data, "warmup") or {}, raw_section(data, "dense")
        if dense is not None:
            dense.setdefault("similarity", warm.get("similarity", TrainDualEncoderParams.model_fields["similarity"].default))
        return data

    @model_validator(mode="after")
    def _rules(self):
        split = self.train_split
        for key in ("warmup", "round"):
            section = getattr(self, key)
            if tuple(section.splits) != (split,):
                raise ValueError(f"{key}.splits: {list(section.splits)}, but the labelled split is train_split '{split}'")
            if section.loss != "infonce" or section.negatives_per_query < 1:
                raise ValueError(f"{key}: ANCE trains with infonce on at least one hard negative per line "
                                 "(negatives_per_query >= 1)")
        if self.round.mined_per_query < self.round.negatives_per_query * self.round.negative_lines:
            raise ValueError(f"round.mined_per_query: {self.round.mined_per_query} is fewer than the negatives a "
                             f"query's lines take ({self.round.negatives_per_query} x {self.round.negative_lines})")
        if self.dense.similarity != self.warmup.similarity or self.round.similarity != self.warmup.similarity:
            raise ValueError(f"dense.similarity / round.similarity: one similarity throughout (warmup.similarity: "
                             f"{self.warmup.similarity})")
        return self


@recipe("ance", ANCEConfig)
def ance(c: ANCEConfig, run: Run) -> list[dict]:
    data = ingest(run, c.dataset)
    base = run.model(c.base_model, "base_model")
    train_q = labelled_queries(run, data, c.train_split)

    # Warm start (round 0): labelled pairs + BM25 negatives.
    bm25 = bm25_train_run(run, c.bm25, data, train_q, c.warmup.bm25_depth)
    bm25_negatives = mine_negatives(run, MineParams(strategy="topk", depth=c.warmup.bm25_depth), label="bm25",
                                    runs=[bm25], qrels=data.qrels)
    model = train_dual_encoder(run, c.warmup.to(TrainDualEncoderParams), label="ance-warmup", queries=[train_q],
                               corpus=data.corpus, base_model=base, qrels=[data.qrels], negatives=[bm25_negatives])
    systems = {"ance-warmup": model}

    # Rounds: the current model's own top 200 become the next negatives.
    for r in range(1, c.rounds + 1):
        top = retrieve(run, c.dense, data, model, train_q, c.round.depth, label=f"ance-r{r}-train")
        negatives = mine_negatives(run, MineParams(strategy="topk", depth=c.round.depth,
                                                   num_negatives=c.round.mined_per_query, seed=c.round.seed + r),
                                   label=f"ance-r{r}", runs=[top], qrels=data.qrels)
        model = train_dual_encoder(run, c.round.to(TrainDualEncoderParams), label=f"ance-round{r}",
                                   queries=[train_q], corpus=data.corpus,
                                   base_model=model if c.round.init == "previous" else base, qrels=[data.qrels],
                                   negatives=[negatives])
        systems[f"ance-round{r}"] = model

    return evaluate_runs(run, c.evaluate, data, test_runs(run, c, data, base, systems))


def __getattr__(name: str):
    # `ance_flow`: the Prefect flow (prefect.yaml's entrypoint), built on first use.
    if name == "ance_flow":
        return ance.flow
    raise AttributeError(name)
