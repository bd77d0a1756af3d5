"""ANCE (Xiong et al., ICLR 2021): negatives from the model's own index, refreshed as it trains.

    labelled pairs + BM25 negatives ──train_dual_encoder──> warm-up model (round 0)    (DPR's recipe)
    for r in 1..rounds:                                                               (synchronous rounds)
        model_{r-1} encodes the corpus, retrieves the train queries' top 200 (ANN)
        mine_negatives: a sample of its top 200, positives excluded
        train_dual_encoder from model_{r-1} on labelled pairs + those negatives ──> model_r
    test queries ──> BM25 | zero-shot | warm-up | round 1..R (| BM25 + each: hybrid.enabled) ──> evaluate ──> report

ANCE refreshes its index asynchronously (an inference job re-encodes the corpus every 10k training
steps while the trainer goes on); here the rounds are synchronous, as Tevatron reproduces it. Each
round's stages are keyed on the previous round's model: raising ``rounds`` from 2 to 3 computes
round 3 and its evaluation only. ``round.negatives: warmup`` is the control that tells the refresh's
gain from more training: the same rounds, continued from the same models, on the warm-up's BM25
negatives.
"""

# No `from __future__ import annotations`: Prefect loads a deployment entrypoint file as a module that
# is not in sys.modules, where pydantic could not resolve string annotations of the config models.
from typing import ClassVar, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from irflow.engine.follows import Follow
from irflow.engine.runner import Run
from irflow.learn.dual_encoder import TrainDualEncoderParams
from irflow.recipes.base import Made, recipe
from irflow.recipes.common import (
    HardNegativeTraining,
    SupervisedConfig,
    bm25_train_run,
    check_skip_top,
    evaluate_systems,
    hybrid_rankings,
    labelled_queries,
    retrieve,
    system_name,
    test_systems,
    top_negative_mining,
    train_split_follows,
)
from irflow.recipes.dataset import ingest
from irflow.stages.mine_negatives import MineParams, mine_negatives
from irflow.stages.train_dual_encoder import train_dual_encoder


class WarmupConfig(HardNegativeTraining):
    bm25_depth: PositiveInt = Field(100, description="warm-up negatives come from BM25's top n, positives excluded")
    bm25_skip_top: NonNegativeInt = Field(0, description="leave BM25's first n ranks out of the warm-up negatives "
                                                         "(where unjudged relevant passages crowd); 0: none left out")

    @model_validator(mode="after")
    def _bm25_ranks(self):
        check_skip_top(self.bm25_skip_top, self.bm25_depth, "bm25_skip_top", "bm25_depth", "BM25's")
        return self


class RoundConfig(HardNegativeTraining):
    depth: PositiveInt = Field(200, description="the current model's top n per train query (ANCE: 200; 500 was "
                                                "worse in the paper)")
    negatives_per_query: PositiveInt = Field(20, description="negatives sampled per query from that top n (ANCE: "
                                                             "20); each training line takes negatives_per_line")
    skip_top: NonNegativeInt = Field(0, description="leave the current model's first n ranks out of that sample "
                                                    "(where unjudged relevant passages crowd); 0: none left out")
    init: Literal["previous", "base"] = Field("previous", description="previous: continue from the last round's "
                                                                      "model (ANCE); base: retrain from base_model "
                                                                      "(Tevatron's cheap reproduction)")
    negatives: Literal["refreshed", "warmup"] = Field(
        "refreshed", description="refreshed: each round mines the current model's own top `depth` (ANCE); "
                                 "warmup: each round trains on the warm-up's BM25 negatives again, no refresh "
                                 "(the control: as many steps, from the same models, without the new index)")

    @model_validator(mode="after")
    def _ranks(self):
        check_skip_top(self.skip_top, self.depth, "skip_top", "depth", "the model's")
        return self


class ANCEConfig(SupervisedConfig):
    follows: ClassVar = (
        *train_split_follows("warmup.splits", "round.splits"),
        Follow("dense.similarity", "warmup.similarity"),
    )

    flow: Literal["ance"] = Field(description="this recipe: ance")
    warmup: WarmupConfig = Field(WarmupConfig(), description="round 0: BM25 negatives")
    rounds: NonNegativeInt = Field(2, description="index refreshes after the warm-up")
    round: RoundConfig = Field(RoundConfig(), description="each refresh's retrieval, mining and training")

    @model_validator(mode="after")
    def _rules(self):
        split = self.train_split
        for key in ("warmup", "round"):
            section = getattr(self, key)
            if tuple(section.splits) != (split,):
                raise ValueError(f"{key}.splits: {list(section.splits)}, but the labelled split is train_split '{split}'")
            if section.loss != "infonce" or section.negatives_per_line < 1:
                raise ValueError(f"{key}: ANCE trains with infonce on at least one hard negative per line "
                                 "(negatives_per_line >= 1)")
        if self.round.negatives_per_query < self.round.negatives_per_line * self.round.negative_lines:
            raise ValueError(f"round.negatives_per_query: {self.round.negatives_per_query} is fewer than the "
                             f"negatives a query's lines take ({self.round.negatives_per_line} x "
                             f"{self.round.negative_lines})")
        if self.dense.similarity != self.warmup.similarity or self.round.similarity != self.warmup.similarity:
            raise ValueError(f"dense.similarity / round.similarity: one similarity throughout (warmup.similarity: "
                             f"{self.warmup.similarity})")
        return self


def round_negative_mining(c: RoundConfig, r: int) -> MineParams:
    """Round r's sample of the current model's top ``depth`` (seeded per round); with ``skip_top``, of
    ranks ``skip_top + 1 .. depth`` only (0 keeps the mining stage's cache key of before the option)."""
    return top_negative_mining(c.depth, c.skip_top, negatives_per_miner=c.negatives_per_query, seed=c.seed + r)


@recipe("ance", ANCEConfig)
def ance(c: ANCEConfig, run: Run) -> Made:
    data = ingest(run, c.dataset)
    base = run.model(c.base_model, "base_model")
    train_q = labelled_queries(run, data, c.train_split)

    # Warm start (round 0): labelled pairs + BM25 negatives.
    bm25 = bm25_train_run(run, c.bm25, data, train_q, c.warmup.bm25_depth)
    bm25_negatives = mine_negatives(run, top_negative_mining(c.warmup.bm25_depth, c.warmup.bm25_skip_top),
                                    tag="bm25", rankings=[bm25], qrels=data.qrels)
    model = train_dual_encoder(run, c.warmup.to(TrainDualEncoderParams), tag="ance-warmup", queries=[train_q],
                               corpus=data.corpus, base_model=base, qrels=[data.qrels],
                               negatives=[bm25_negatives])["model"]
    systems = {"ance-warmup": model}

    # Rounds: the current model's own top 200 become the next negatives.
    for r in range(1, c.rounds + 1):
        if c.round.negatives == "refreshed":
            top = retrieve(run, c.dense, data, model, train_q, c.round.depth, tag=f"ance-r{r}-train")
            negatives = mine_negatives(run, round_negative_mining(c.round, r), tag=f"ance-r{r}", rankings=[top],
                                       qrels=data.qrels)
        else:  # the control: is it the refresh that helps, or only the longer training?
            negatives = bm25_negatives
        model = train_dual_encoder(run, c.round.to(TrainDualEncoderParams), tag=f"ance-round{r}",
                                   queries=[train_q], corpus=data.corpus,
                                   base_model=model if c.round.init == "previous" else base, qrels=[data.qrels],
                                   negatives=[negatives])["model"]
        systems[f"ance-round{r}"] = model

    tested = test_systems(run, c, data, base, systems)
    tested.rankings.update(hybrid_rankings(run, c.hybrid, tested.rankings, c.bm25.first_system,
                                           system_name(c.base_model), systems))
    return evaluate_systems(run, c.evaluate, data, tested)

