"""Config sections and building blocks shared by every recipe: the baseline spine of the graph.

    ingest -> select_queries -> bm25_index -> bm25_search ----\\
                             -> encode_corpus -> dense_search --> evaluate (per system) -> report

Each section is composed of the params of the stages it feeds (defaults live there, once); each
building block wires stages together, and each stage is cached on its own inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from irflow.engine.errors import ConfigError
from irflow.engine.follows import Follow
from irflow.engine.params import ModelName
from irflow.engine.runner import Run
from irflow.engine.store import DatasetRef
from irflow.learn.dual_encoder import TrainDualEncoderParams
from irflow.recipes.base import Made, RecipeConfig
from irflow.recipes.dataset import Dataset, DatasetConfig
from irflow.stages.bm25 import BM25IndexParams, BM25Retrieval, BM25SearchParams, Variant, bm25_index, bm25_search
from irflow.stages.dense import DenseRetrieval, DenseSearchParams, EncodeParams, dense_search, encode_corpus
from irflow.stages.evaluate import EvaluateParams, EvaluationParams, evaluate
from irflow.stages.fuse import FuseParams, FuseSettings, fuse
from irflow.stages.ingest import (
    SelectQueriesParams,
    select_queries,
)
from irflow.stages.mine_negatives import MineParams
from irflow.stages.train_student import CheckpointParams, TrainStudentParams, checkpoint_student

log = logging.getLogger("irflow")

# ---- sections ---------------------------------------------------------------------------------

class BM25Config(BM25Retrieval):
    variants: tuple[Variant, ...] = Field(("flat",), min_length=1, description="index variants, one system each "
                                                                               "(bm25-flat, bm25-multifield)")

    @field_validator("variants")
    @classmethod
    def _unique(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"each variant once, got {list(v)}")
        return v

    @property
    def first_system(self) -> str:
        """The first variant's system name: the BM25 ranking a hybrid fuses (``bm25_rankings`` names it so)."""
        return bm25_system(self.variants[0])


def bm25_system(variant: str, prefix: str = "bm25") -> str:
    """A BM25 system's name: ``bm25-flat``, ``bm25-multifield``, ``bm25-doc2query-flat``."""
    return f"{prefix}-{variant}"


class DenseConfig(DenseRetrieval):
    """How dense systems encode and search (the model comes from the recipe)."""


class ZeroShotDense(DenseRetrieval):
    enabled: bool = Field(True, description="run the zero-shot dense system")
    model: ModelName = Field("all-MiniLM-L6-v2", description="bi-encoder: a hub id, a local directory or a "
                                                             "stored model id (MiniLM comes from a package, offline)")
    system: str | None = Field(None, description="system name (null: dense-<model directory name>)")


class HybridConfig(FuseSettings):
    enabled: bool = Field(True, description="evaluate the hybrid of BM25 (the first of bm25.variants) and the "
                                            "zero-shot dense model")
    sparse_weight: float = Field(0.3, ge=0, le=1, description="weight of BM25; the dense system gets 1 - w")
    students: bool = Field(True, description="also evaluate BM25 fused with each trained model (system "
                           "hybrid-<model>, e.g. hybrid-gpl-student, hybrid-md2, hybrid-ance-round2): what "
                           "adapting the dense model gives a deployed hybrid, against `hybrid` (needs enabled)")
    student_sparse_weight: float | None = Field(None, ge=0, le=1, description="weight of BM25 when fused with a "
                                                "trained model (hybrid.students); the model gets 1 - w. null: "
                                                "sparse_weight, the zero-shot hybrid's")

    def params(self, sparse: str, dense: str) -> FuseParams:
        """The `hybrid` system: BM25 fused with the zero-shot dense model."""
        return self._fuse(sparse, dense, self.sparse_weight, "hybrid")

    def student_params(self, sparse: str, student: str) -> FuseParams:
        """System hybrid-<student>: BM25 fused with a trained model, by the same method and depth."""
        weight = self.sparse_weight if self.student_sparse_weight is None else self.student_sparse_weight
        return self._fuse(sparse, student, weight, f"hybrid-{student}")

    def _fuse(self, sparse: str, dense: str, sparse_weight: float, system: str) -> FuseParams:
        return self.to(FuseParams, weights={sparse: sparse_weight, dense: 1 - sparse_weight}, system=system)


class SupervisedHybridConfig(HybridConfig):
    enabled: bool = Field(False, description="evaluate the hybrid of BM25 (the first of bm25.variants) and the "
                                             "zero-shot dense model and, with students, BM25 fused with each "
                                             "trained dual encoder (off by default: the papers evaluate dense "
                                             "models alone)")



def bm25_rankings(run: Run, c: BM25Config, corpus: DatasetRef, queries: DatasetRef, *, prefix: str = "bm25",
                  tag_suffix: str = "") -> dict[str, DatasetRef]:
    """System name -> ranking (a ``run`` dataset), one per BM25 variant (an index each, cached apart from the
    search); none without queries (nothing evaluated)."""
    rankings = {}
    if queries is None:
        return rankings
    for variant in c.variants:
        tag = variant + tag_suffix
        index = bm25_index(run, BM25IndexParams(variant=variant), tag=tag, corpus=corpus)
        system = bm25_system(variant, prefix)
        rankings[system] = bm25_search(run, c.to(BM25SearchParams, variant=variant, system=system), tag=tag,
                                       bm25_index=index, queries=queries)
    return rankings


def dense_ranking(run: Run, c: DenseRetrieval, corpus: DatasetRef, queries: DatasetRef, *, model: DatasetRef,
              system: str, tag: str) -> DatasetRef:
    """Encode the corpus (cached on corpus + model + encoding settings: shared by every query set),
    then search it. None without queries (nothing evaluated)."""
    if queries is None:
        return None
    embeddings = encode_corpus(run, c.to(EncodeParams), tag=tag, corpus=corpus, model=model)
    return dense_search(run, c.to(DenseSearchParams, system=system), tag=tag, embeddings=embeddings,
                        queries=queries, model=model)


def system_name(model: str) -> str:
    return "dense-" + Path(str(model).rstrip("/")).name


@dataclass
class Systems:
    """What a recipe evaluates: system -> test ranking (``rankings``), the dense models among them a selection may
    pick (system -> model ref) and the system training started from (``start``)."""

    rankings: dict[str, DatasetRef] = field(default_factory=dict)
    models: dict[str, DatasetRef] = field(default_factory=dict)
    start: str | None = None

    def dense(self, system: str, ranking: DatasetRef, model: DatasetRef, *, start: bool = False) -> None:
        """A dense system: its test ranking, and its model (the one training started from, with ``start``)."""
        self.rankings[system], self.models[system] = ranking, model
        if start:
            self.start = system


def evaluate_systems(run: Run, c: EvaluationParams, data: Dataset, systems: Systems, caveat: str | None = None) -> Made:
    """One evaluate stage per system (a changed system re-evaluates alone), on the test queries (the corpus
    lets it count the judged queries with no judged document in it); what the recipe hands back (``Made``).
    ``caveat``: why this evaluation cannot tell a trained model from the start (see ``Made``)."""
    made = Made([], data.evaluation, dict(systems.models), systems.start, caveat,
                units="queries" if data.judged else "documents")
    if data.test_queries is None:
        return made
    if data.judged and data.qrels is None:
        raise ValueError("evaluate_systems: the held-out log queries have no judgements yet (the recipe's teacher "
                         "makes them: judge_queries)")
    name = data.name if data.proxy is None else f"{data.name} (proxy)"
    p = c.to(EvaluateParams, dataset=name, split=data.split)
    return replace(made, evaluations=[evaluate(run, p, tag=system, ranking=ref, qrels=data.qrels,
                                               queries=data.test_queries, corpus=data.corpus)
                                      for system, ref in systems.rankings.items()])


def checkpoint_candidates(run: Run, p: TrainStudentParams, data: Dataset, student: DatasetRef, system: str,
                          tag: str) -> dict[str, DatasetRef]:
    """system -> model of the ``student`` kept every ``p.candidates_every`` steps before its last (systems
    ``<system>-step<k>``, stages ``checkpoint_student[<tag>-step<k>]``): candidates evaluated beside it. None
    without an evaluation to choose between them (a warning: the run hands out the final student)."""
    if not p.candidate_steps:
        return {}
    if data.test_queries is None:
        log.warning("train.candidates_every: nothing is evaluated (dataset.proxy: null), so no checkpoint can be "
                    "chosen; the final student is the run's")
        return {}
    return {f"{system}-step{k}": checkpoint_student(run, CheckpointParams(step=k), tag=f"{tag}-step{k}",
                                                    student=student) for k in p.candidate_steps}


def hybrid_rankings(run: Run, c: HybridConfig, rankings: dict[str, DatasetRef], sparse: str, zero_shot: str,
                    students: Iterable[str]) -> dict[str, DatasetRef]:
    """System name -> fused test ranking: ``hybrid`` (BM25 + the zero-shot model) and, with ``students``,
    BM25 + each trained model (``hybrid-<model>``); none unless ``enabled``. A user who deploys BM25 +
    dense wants to know what adaptation adds to that system, not only to the dense model alone."""
    if not c.enabled or sparse not in rankings:
        return {}
    fused = {"hybrid": fuse(run, c.params(sparse, zero_shot), tag="hybrid",
                            rankings=[rankings[sparse], rankings[zero_shot]])}
    for name in students if c.students else ():
        fused[f"hybrid-{name}"] = fuse(run, c.student_params(sparse, name), tag=f"hybrid-{name}",
                                       rankings=[rankings[sparse], rankings[name]])
    return fused


# ---- supervised recipes: their training queries' lists ------------------------------------------
def labelled_queries(run: Run, data: Dataset, split: str) -> DatasetRef:
    """The queries judged in a labelled ``split`` (what RocketQA and ANCE train on)."""
    return select_queries(run, SelectQueriesParams(split=split), tag=split, queries=data.queries, qrels=data.qrels)


def bm25_train_run(run: Run, c: BM25Config, data: Dataset, queries: DatasetRef, depth: int,
                   tag: str = "bm25-train") -> DatasetRef:
    """BM25's top ``depth`` for training queries (system 'bm25': a fusion teacher's weight key; the
    index is the first variant's, shared with the evaluated BM25 system)."""
    variant = c.variants[0]
    index = bm25_index(run, BM25IndexParams(variant=variant), tag=variant, corpus=data.corpus)
    return bm25_search(run, c.to(BM25SearchParams, variant=variant, system="bm25", depth=depth, remove_query=False),
                       tag=tag, bm25_index=index, queries=queries)


def top_negative_mining(depth: int, skip_top: int, **sample) -> MineParams:
    """Negatives from a ranked list's top ``depth`` (BM25's, or the current model's), every non-positive
    or ``sample`` (``negatives_per_miner``, ``seed``); with ``skip_top``, from ranks ``skip_top + 1 ..
    depth`` only. Unjudged relevant passages (false negatives) crowd the top of a retriever's list where
    queries have many relevant passages (RocketQA, Qu et al., 2021, found many of the top unlabelled
    passages on MS MARCO relevant; NFCorpus judges 43 passages a train query). 0 keeps the mining stage's
    cache key of before this option."""
    ranks = {} if skip_top == 0 else {"strategy": "range", "rank_range": (skip_top + 1, depth)}
    return MineParams(**{"strategy": "topk", "depth": depth, **sample, **ranks})


def check_skip_top(skip_top: int, depth: int, skip_key: str, depth_key: str, whose: str) -> None:
    """A config rule: ``skip_top`` must leave some of the mined top ``depth``."""
    if skip_top >= depth:
        raise ValueError(f"{skip_key}: {skip_top} leaves none of {whose} top {depth} ({depth_key}) to mine")


def retrieve(run: Run, c: DenseRetrieval, data: Dataset, model: DatasetRef, queries: DatasetRef, depth: int,
             tag: str, system: str = "dense") -> DatasetRef:
    """A dual encoder's top ``depth`` for training queries. Its corpus embeddings are the ones its test
    evaluation uses (same model, same encoding settings: one encode_corpus)."""
    return dense_ranking(run, c.to(type(c), depth=depth, remove_query=False), data.corpus, queries, model=model,
                     system=system, tag=tag)


def train_split_follows(*keys: str) -> tuple[Follow, ...]:
    """Keys that read the labelled split unless set (``irflow.engine.follows``): a ``splits`` key as a
    one-item list, a ``split`` key as it is."""
    return tuple(Follow(k, "train_split", lambda split: [split]) if k.endswith("splits") else Follow(k, "train_split")
                 for k in keys)


class HardNegativeTraining(TrainDualEncoderParams):
    """A dual encoder trained on mined hard negatives (ANCE's rounds, RocketQA's students)."""

    negatives_per_line: NonNegativeInt = Field(1, description="hard negatives on each training line, from the "
                                                              "mined or denoised negatives")


class SupervisedConfig(RecipeConfig):
    """What every supervised recipe (RocketQA, ANCE) has: a dataset, its labelled split, the dual
    encoders' starting point, and the test-side systems."""

    dataset: DatasetConfig = Field(description="the BEIR dataset and the split to evaluate")
    train_split: str = Field("train", min_length=1, description="the labelled split trained on (never the "
                                                                "evaluated one)")
    base_model: ModelName = Field("all-MiniLM-L6-v2", description="the dual encoders' starting point")
    bm25: BM25Config = Field(BM25Config(), description="BM25 systems (and BM25 negatives / a fusion teacher)")
    dense: DenseConfig = Field(DenseConfig(), description="how dense systems encode and search (similarity follows "
                                                          "the dual encoder's)")
    hybrid: SupervisedHybridConfig = Field(SupervisedHybridConfig(), description="BM25 + dense fusions (off by "
                                                                                 "default)")
    evaluate: EvaluationParams = Field(EvaluationParams(), description="metrics")

    @model_validator(mode="after")
    def _labelled_split(self):
        split, evaluated = self.train_split, self.dataset.split
        if split == evaluated:
            raise ValueError(f"train_split: '{split}' is the evaluated split (dataset.split); training on it would "
                             "leak the test set")
        splits = self.dataset.splits()
        if splits is not None and split not in splits:
            raise ValueError(f"train_split: '{split}' is not a split of {self.dataset.source} (its qrels: "
                             f"{', '.join(splits) or 'none'}): {self.flow} trains on labelled pairs")
        return self


def test_systems(run: Run, c: RecipeConfig, data: Dataset, base: DatasetRef,
              models: dict[str, DatasetRef], base_model: str | None = None,
              start: tuple[str, DatasetRef] | None = None) -> Systems:
    """The test systems: BM25 (``c.bm25``), the zero-shot base model (``base_model``: its config value, by
    default ``c.base_model``; the start), and each trained model, encoded and searched as ``c.dense``.
    ``start``: (system, model) where training continued from an alias's model (``start_model``): evaluated
    too, and the model the trained ones are selected against. And the promotion's comparison
    (``alias_runs``)."""
    systems = Systems(bm25_rankings(run, c.bm25, data.corpus, data.test_queries))
    zero_shot = system_name(base_model or c.base_model)
    systems.dense(zero_shot, dense_ranking(run, c.dense, data.corpus, data.test_queries, model=base, system=zero_shot,
                                       tag="zero-shot"), base, start=True)
    if start is not None:
        name, model = start
        if name in systems.rankings:
            raise ConfigError(f"train.init: '{name}' is also the name of a system of this run; the alias's model is "
                              "evaluated as a system of that name: choose another alias name")
        systems.dense(name, dense_ranking(run, c.dense, data.corpus, data.test_queries, model=model, system=name,
                                      tag=name), model, start=True)
    for name, model in models.items():
        systems.dense(name, dense_ranking(run, c.dense, data.corpus, data.test_queries, model=model, system=name,
                                      tag=name), model)
    systems.rankings.update(alias_runs(run, c, data, systems, c.dense))
    return systems


# ---- promotion (irflow.decide.promotion) and training continued from an alias's model -----------------------
def alias_model(run: Run, model_id: str, where: str) -> DatasetRef | None:
    """The model an alias holds, as an input ref (``Run.model``): a stored model by its id; a model no stage
    made (a hub id, a local directory) by the name or path it was found at, if that still resolves to the
    same id. None (and a warning) if it cannot be had here."""
    from irflow.engine.models import ModelNotAvailable, resolve

    if run.store.object_dir(model_id).is_dir():
        return run.model(model_id, where)
    info = run.catalog.dataset(model_id) or {}
    for name in (info.get("name"), info.get("path")):
        if name and resolve(name, run.store_root).id == model_id:
            try:
                return run.model(name, where)
            except ModelNotAvailable:
                break
    log.warning("%s: the alias's model %s cannot be had here (removed, moved or changed since it was promoted)",
                where, model_id)
    return None


def alias_runs(run: Run, c: RecipeConfig, data: Dataset, systems: Systems,
               dense: DenseRetrieval) -> dict[str, DatasetRef]:
    """With ``promote.alias``: the alias's current model as a test run of system ``<alias>``, searched as
    ``dense`` like the zero-shot model, so that the promotion compares it with the run's selected model on
    the run's evaluation. Nothing if the alias has no model yet, or holds one of the run's dense models
    (their own runs stand for it)."""
    alias = c.promote.alias
    current = run.catalog.alias(alias) if alias is not None else None
    if current is None:
        return {}
    if any(isinstance(ref, DatasetRef) and ref.id == current["model_id"] for ref in systems.models.values()):
        return {}
    if alias in systems.rankings:
        raise ConfigError(f"promote.alias: '{alias}' is also the name of a system of this run; the alias's model is "
                          "evaluated as a system of that name: choose another alias name")
    model = alias_model(run, current["model_id"], "promote.alias")
    if model is None:
        return {}
    return {alias: dense_ranking(run, dense, data.corpus, data.test_queries, model=model, system=alias, tag=alias)}


def start_model(run: Run, init: str, base: DatasetRef, base_name: str, where: str
                ) -> tuple[DatasetRef, tuple[str, DatasetRef] | None]:
    """Where training starts: (the model, and (system, model) to evaluate as the start, or None). ``init``
    ``base``: ``base``. An alias name: the alias's current model (its id enters the trainers' keys), evaluated
    as system ``<alias>``; ``base`` with a warning when the alias has no model yet (or it cannot be had)."""
    if init == "base":
        return base, None
    current = run.catalog.alias(init)
    model = alias_model(run, current["model_id"], where) if current else None
    if model is None:
        log.warning("%s: alias '%s' %s: training starts from %s (as with %s: base)", where, init,
                    "has no model yet" if current is None else "holds a model that cannot be had here", base_name,
                    where)
        return base, None
    if model.id == base.id:
        return base, None
    return model, (init, model)
