"""Contriever (Izacard et al., TMLR 2022): contrastive training on the corpus alone, no model and no labels.

    corpus ──generate_queries──> (span, passage) pairs      (crop: a random span of a passage, Contriever's
       │                                                      independent cropping; spider: a window around a
       │                                                      span that recurs in another passage of the same
       │                                                      document, Ram et al. 2022; ict: a sentence)
       └──train_student (InfoNCE, MoCo) ──> model           (a momentum key encoder embeds the passages; a queue
                                                              of earlier batches' keys adds negatives)
    test queries ──> BM25 | start model | contriever (| BM25 + it) ──> evaluate ──> report

The pairs are the GPL recipe's model-free query sources (``generate.source``), trained with the QGen
student's InfoNCE (``loss: mnrl``) and, by default, Contriever's MoCo (``train.moco``: queue size and
momentum keyed; ``irflow.learn.moco`` has the formulas). Contriever crops both sides of a pair: with
``train.crop_positives: [0.1, 0.5]`` the key is a span of the passage too, drawn apart from the query's;
by default the key is the whole passage (the pair the query sources make). As pre-training before GPL: ``promote: {alias: contriever}`` here, then ``train.init: contriever`` in a
GPL config (the GPL students start from this run's selected model).

Without labels (your own documents) the evaluation is the synthetic held-out set (``dataset.proxy``), and a
proxy from the generator the model trained on is refused as the judge of its own training data: see
``dataset.proxy.queries``.
"""

# No `from __future__ import annotations`: Prefect loads a deployment entrypoint file as a module that
# is not in sys.modules, where pydantic could not resolve string annotations of the config models.
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from irflow.engine.follows import Follow
from irflow.engine.params import ModelName
from irflow.engine.runner import Run
from irflow.recipes.base import Made, RecipeConfig, recipe
from irflow.recipes.common import (
    BM25Config,
    DenseConfig,
    HybridConfig,
    checkpoint_candidates,
    evaluate_systems,
    hybrid_rankings,
    system_name,
    test_systems,
)
from irflow.recipes.dataset import DatasetConfig, ingest, same_kind
from irflow.stages.evaluate import EvaluationParams
from irflow.stages.generate_queries import CropSource, ICTSource, SpiderSource, generate_queries
from irflow.stages.train_student import MoCoParams, TrainStudentParams, train_student

PairSource = Annotated[Union[CropSource, SpiderSource, ICTSource], Field(discriminator="source")]


class ContrieverMoCo(MoCoParams):
    enabled: bool = Field(True, description="a momentum key encoder embeds the passages and a queue of earlier "
                                            "batches' passage embeddings adds negatives (Contriever); false: "
                                            "in-batch negatives only")


class ContrieverTrain(TrainStudentParams):
    model: ModelName = Field("bert-base-uncased", description="the encoder training starts from (Contriever: BERT "
                                                              "base; a hub id, a local directory or a stored model id)")
    loss: Literal["mnrl"] = Field("mnrl", description="InfoNCE over (span, passage) pairs: mnrl")
    similarity: Literal["cos", "dot"] = Field("cos", description="the model's similarity (Contriever: dot over "
                                                                 "mean-pooled embeddings; cos keeps a cos starting "
                                                                 "model's scale)")
    crop_positives: tuple[float, float] | None = Field(
        None, description="each pair's positive is a random span of its passage, this fraction range of its words: "
                          "[0.1, 0.5] is Contriever's independent cropping (query and key both crops); null: the "
                          "whole passage (a span as query, its passage as key: what bench/strategies.py measured)")
    moco: ContrieverMoCo = Field(ContrieverMoCo(), description="Contriever's MoCo: momentum key encoder and queue "
                                                               "of negatives (on unless moco.enabled: false)")
    warmup_steps: int = Field(100, ge=0, description="linear warm-up steps, then linear decay to 0")
    max_seq_length: int = Field(256, gt=0, description="tokens per text (Contriever: 256)")


class ContrieverConfig(RecipeConfig):
    follows: ClassVar = (Follow("dense.similarity", "train.similarity"),)

    flow: Literal["contriever"] = Field(description="this recipe: contriever")
    dataset: DatasetConfig = Field(description="the corpus, and the split (or the proxy) to evaluate")
    generate: PairSource = Field(CropSource(source="crop"), description="where the training pairs come from: crop "
                                                                        "(Contriever), spider (recurring spans) "
                                                                        "or ict")
    train: ContrieverTrain = Field(ContrieverTrain(), description="the contrastive training")
    bm25: BM25Config = Field(BM25Config(), description="BM25 systems")
    dense: DenseConfig = Field(DenseConfig(), description="how dense systems encode and search (similarity "
                                                          "follows train.similarity)")
    hybrid: HybridConfig = Field(HybridConfig(), description="BM25 + each dense model")
    evaluate: EvaluationParams = Field(EvaluationParams(), description="metrics")

    @model_validator(mode="after")
    def _rules(self):
        if self.dense.similarity != self.train.similarity:
            raise ValueError(f"dense.similarity: the evaluated model uses train.similarity ({self.train.similarity}); "
                             f"got {self.dense.similarity}")
        d = self.dataset
        if d.evaluation_proxy is not None and same_kind(d.proxy.queries.source, self.generate.source):
            raise ValueError(f"dataset.proxy.queries: {d.proxy.queries.source} queries are of the kind of "
                             f"generate.source ({self.generate.source}); a proxy of the training pairs' own kind "
                             f"favours the trained model whether or not it retrieves better "
                             f"(bench/results/own_corpus_*.json): choose another proxy source (t5)")
        return self


@recipe("contriever", ContrieverConfig)
def contriever(c: ContrieverConfig, run: Run) -> Made:
    data = ingest(run, c.dataset)
    base = run.model(c.train.model, "train.model")

    # 1. Pairs from the corpus alone: a span (or a recurring span's window) and its passage.
    pairs = generate_queries(run, c.generate, tag=c.generate.source, corpus=data.training_corpus)

    # 2. InfoNCE with a momentum key encoder and a queue of negatives.
    model = train_student(run, c.train.to(TrainStudentParams), tag="contriever", queries=pairs["queries"],
                          corpus=data.training_corpus, base_model=base, qrels=pairs["qrels"])["student"]

    # 3. Evaluation: BM25, the starting model and the trained one (and BM25 fused with each).
    students = {"contriever": model}
    candidates = checkpoint_candidates(run, c.train.to(TrainStudentParams), data, model, "contriever", "contriever")
    tested = test_systems(run, c, data, base, {**students, **candidates}, base_model=c.train.model)
    tested.rankings.update(hybrid_rankings(run, c.hybrid, tested.rankings, c.bm25.first_system,
                                           system_name(c.train.model), students))
    return evaluate_systems(run, c.evaluate, data, tested)
