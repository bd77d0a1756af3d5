"""STAR + ADORE (Zhan et al., SIGIR 2021, "Optimizing Dense Retrieval Model Training with Hard Negatives").

    a fixed ranking of the train queries (the zero-shot model's or BM25's top 200) ──> static hard negatives
    labelled pairs + static hard negatives + random in-batch negatives
        ──train_dual_encoder (loss star: RankNet on the hard ones + alpha x on the random ones)──> STAR  (star)
    STAR encodes the corpus once: fixed document embeddings
    ADORE, from STAR's query encoder: each step, its own top 200 over the fixed embeddings;
        LambdaLoss (RankNet weighted by |delta nDCG|) on positives vs the top non-positives
        ──train_query_encoder──> ADORE's query encoder beside STAR's document encoder   (star-adore)
    test queries ──> BM25 | zero-shot | star | star-adore (over STAR's embeddings) (| BM25 + each) ──> evaluate

STAR trains on static hard negatives (cheap: mined once) and keeps it stable with a small weight of random
negatives (the batch's other passages). ADORE then gives the query encoder the hard negatives of its own
current ranking, which ANCE only approximates with a stale index, at no re-encoding cost: the documents
are frozen. The result, ``star-adore``, is an asymmetric model: a query encoder beside a frozen document
encoder (``irflow.learn.adore``); it is evaluated, selected and exported like any dense model.
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
from irflow.stages.dense import DenseSearchParams, EncodeParams, dense_search, encode_corpus
from irflow.stages.mine_negatives import mine_negatives
from irflow.stages.train_dual_encoder import train_dual_encoder
from irflow.stages.train_query_encoder import TrainQueryEncoderParams, train_query_encoder


class StarTrainingConfig(HardNegativeTraining):
    loss: Literal["star", "infonce"] = Field(
        "star", description="star: STAR's loss, RankNet on the static hard negatives plus alpha x RankNet on the "
                            "batch's other passages; infonce: the same lines under a softmax (DPR with static hard "
                            "negatives), where RankNet collapses (every passage on one direction: a warning says so)")
    negatives: Literal["zero-shot", "bm25"] = Field(
        "zero-shot", description="whose fixed ranking of the train queries the static hard negatives come from: "
                                 "the zero-shot base model's (STAR: a warmed-up dense retriever's) or BM25's")
    depth: PositiveInt = Field(200, description="static hard negatives come from that ranking's top n, positives "
                                                "excluded (STAR: 200)")
    negatives_per_query: PositiveInt = Field(20, description="negatives sampled per query from that top n "
                                                             "(seeded); each training line takes negatives_per_line")
    skip_top: NonNegativeInt = Field(0, description="leave that ranking's first n ranks out of the sample (where "
                                                    "unjudged relevant passages crowd); 0: none left out")

    @model_validator(mode="after")
    def _ranks(self):
        check_skip_top(self.skip_top, self.depth, "skip_top", "depth", "the fixed ranking's")
        return self


class AdoreConfig(TrainQueryEncoderParams):
    enabled: bool = Field(True, description="train ADORE's query encoder against STAR's fixed corpus embeddings "
                                            "(system star-adore: an asymmetric model)")


class STARConfig(SupervisedConfig):
    follows: ClassVar = (
        *train_split_follows("star.splits", "adore.splits"),
        Follow("dense.similarity", "star.similarity"),
        Follow("adore.similarity", "star.similarity"),
    )

    flow: Literal["star"] = Field(description="this recipe: star")
    star: StarTrainingConfig = Field(StarTrainingConfig(), description="STAR: static hard negatives and random "
                                                                       "in-batch negatives")
    adore: AdoreConfig = Field(AdoreConfig(), description="ADORE: the query encoder against STAR's fixed index")

    @model_validator(mode="after")
    def _rules(self):
        split = self.train_split
        for key in ("star", "adore"):
            section = getattr(self, key)
            if tuple(section.splits) != (split,):
                raise ValueError(f"{key}.splits: {list(section.splits)}, but the labelled split is train_split "
                                 f"'{split}'")
        if self.star.negatives_per_query < self.star.negatives_per_line * self.star.negative_lines:
            raise ValueError(f"star.negatives_per_query: {self.star.negatives_per_query} is fewer than the "
                             f"negatives a query's lines take ({self.star.negatives_per_line} x "
                             f"{self.star.negative_lines})")
        for key in ("dense", "adore"):
            if getattr(self, key).similarity != self.star.similarity:
                raise ValueError(f"{key}.similarity: {getattr(self, key).similarity}, but STAR's embeddings are "
                                 f"{self.star.similarity} (star.similarity): one similarity throughout")
        return self


@recipe("star", STARConfig)
def star(c: STARConfig, run: Run) -> Made:
    data = ingest(run, c.dataset)
    base = run.model(c.base_model, "base_model")
    train_q = labelled_queries(run, data, c.train_split)

    # STAR: static hard negatives from a fixed ranking, plus random in-batch negatives.
    if c.star.negatives == "bm25":
        fixed = bm25_train_run(run, c.bm25, data, train_q, c.star.depth)
    else:
        fixed = retrieve(run, c.dense, data, base, train_q, c.star.depth, tag="star-negatives")
    static = mine_negatives(run, top_negative_mining(c.star.depth, c.star.skip_top, seed=c.star.seed,
                                                     negatives_per_miner=c.star.negatives_per_query),
                            tag="star", rankings=[fixed], qrels=data.qrels)
    star_model = train_dual_encoder(run, c.star.to(TrainDualEncoderParams), tag="star", queries=[train_q],
                                    corpus=data.corpus, base_model=base, qrels=[data.qrels],
                                    negatives=[static])["model"]

    tested = test_systems(run, c, data, base, {"star": star_model})
    # ADORE: STAR's corpus embeddings stay fixed; the query encoder learns from its own top-k over them.
    if c.adore.enabled:
        index = encode_corpus(run, c.dense.to(EncodeParams), tag="adore", corpus=data.corpus, model=star_model)
        adore = train_query_encoder(run, c.adore.to(TrainQueryEncoderParams), tag="adore", queries=train_q,
                                    qrels=data.qrels, embeddings=index, base_model=star_model,
                                    document_model=star_model)["model"]
        # selectable and exportable like any dense model
        tested.dense("star-adore", dense_search(run, c.dense.to(DenseSearchParams, system="star-adore"),
                                                tag="star-adore", embeddings=index, queries=data.test_queries,
                                                model=adore), adore)
    tested.rankings.update(hybrid_rankings(run, c.hybrid, tested.rankings, c.bm25.first_system,
                                           system_name(c.base_model),
                                           ["star"] + (["star-adore"] if c.adore.enabled else [])))
    return evaluate_systems(run, c.evaluate, data, tested)
