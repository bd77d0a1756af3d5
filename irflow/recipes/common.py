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
from typing import Annotated, Literal, Union

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from irflow.decide.selection import NO_EVALUATION
from irflow.engine.errors import ConfigError
from irflow.engine.follows import Follow
from irflow.engine.params import ModelName, NoParams
from irflow.engine.runner import Run
from irflow.engine.store import DatasetRef
from irflow.learn.dual_encoder import TrainDualEncoderParams
from irflow.recipes.base import Made, RecipeConfig
from irflow.sources.beir import IngestError, _relative_hint, dataset_splits, is_beir_source, is_url
from irflow.stages.bm25 import BM25IndexParams, BM25Retrieval, BM25SearchParams, Variant, bm25_index, bm25_search
from irflow.stages.dense import DenseRetrieval, DenseSearchParams, EncodeParams, dense_search, encode_corpus
from irflow.stages.evaluate import EvaluateParams, EvaluationParams, evaluate
from irflow.stages.fuse import FuseParams, FuseSettings, fuse
from irflow.stages.generate_queries import GENERATED_SPLIT, CropSource, ICTSource, T5Source, generate_queries
from irflow.stages.ingest import (
    CorpusReadParams,
    HoldoutParams,
    IngestParams,
    OwnFormat,
    PassageSettings,
    QueryFileParams,
    QueryHoldoutParams,
    SelectQueriesParams,
    cut_proxy_queries,
    hold_out_queries,
    holdout,
    ingest_beir,
    ingest_corpus,
    ingest_queries,
    select_queries,
    source_ref,
)
from irflow.stages.mine_negatives import MineParams
from irflow.stages.train_student import CheckpointParams, TrainStudentParams, checkpoint_student

log = logging.getLogger("irflow")

# ---- sections ---------------------------------------------------------------------------------
class ProxyT5(T5Source):
    model: ModelName = Field(description="the seq2seq query generator (a hub id or local directory)")


# ICT's sentence, crop's span and spider's recurring-span window are all cut out of the passage they point
# to: one kind of query
SPAN_SOURCES = frozenset({"ict", "crop", "spider"})


def same_kind(proxy_source: str, training_source: str) -> bool:
    """Whether a proxy's queries are of the kind a model trained on: one generator, or two that cut their
    queries out of the passage alike (ict, crop). Such a proxy favours the model (measured:
    bench/results/own_corpus_*.json)."""
    return proxy_source == training_source or {proxy_source, training_source} <= SPAN_SOURCES


class LogProxy(QueryHoldoutParams):
    source: Literal["log"] = Field(description="a held-out part of the query log (dataset.query_log), never trained "
                                               "on, each query judged by the run's teacher (gpl): real queries, the "
                                               "teacher as judge; no documents are held out")
    relevant: PositiveInt = Field(1, description="the teacher's best this many candidates of a held-out query are "
                                                 "judged relevant")


class ProxyConfig(HoldoutParams):
    queries: Annotated[Union[ICTSource, ProxyT5, CropSource, LogProxy], Field(discriminator="source")] = Field(
        ICTSource(source="ict"), description="how the synthetic evaluation's queries are made: ict (a sentence of a "
                                             "held-out passage, offline), crop (a span), t5 with a model, or log (a "
                                             "held-out part of the query log judged by the teacher: with the "
                                             "offline fusion teacher it ranked 8 models closer to the real qrels "
                                             "than ict on SciFact and NFCorpus, but favours the starting model the "
                                             "teacher scores with; bench/results/proxy_agreement_*.json). A proxy "
                                             "made by the generator that made the training queries favours the "
                                             "model trained on them")

    cut: bool = Field(False, description="cut each ict / crop query out of the held-out passage it points to, in "
                                         "the corpus the proxy searches (as Lee et al.'s ICT pairs a sentence with "
                                         "its context). Measured on SciFact as unlabelled documents, 8 models "
                                         "scored on the real qrels (bench/results/proxy_agreement_scifact.json): "
                                         "cut, the proxy ranked them worse (Kendall tau 0.07 for ict, -0.07 for "
                                         "crop) than with the passages whole (0.29 each), so it is off by default")

    @model_validator(mode="after")
    def _cut(self):
        if self.cut and self.queries.source not in SPAN_SOURCES:
            raise ValueError(f"dataset.proxy.cut: {self.queries.source} queries are not cut out of their passages "
                             f"(only ict and crop are); leave it false")
        return self

    @property
    def cuts(self) -> bool:
        """Whether the proxy's queries are cut out of the passages it searches."""
        return self.cut

    @property
    def judged(self) -> bool:
        """Whether the proxy is a held-out part of the query log, judged by the run's teacher."""
        return isinstance(self.queries, LogProxy)

    def describe(self) -> str:
        if self.judged:
            return (f"held-out query log queries (fraction {self.queries.fraction:g}), the teacher's top "
                    f"{self.queries.relevant} judged relevant")
        cap = f", at most {self.documents}" if self.documents is not None else ""
        cut = " (cut out of their passages)" if self.cuts else ""
        return f"{self.queries.source} queries{cut} of the held-out documents (fraction {self.fraction:g}{cap})"


class DatasetConfig(IngestParams):
    source: str = Field(min_length=1, description="a BEIR folder, a .zip, or an http(s) URL (then md5 is required); "
                                                  "or your own documents: a .jsonl / .jsonl.gz, .parquet (or a "
                                                  "folder of them), .csv, .tsv file, or a folder of .txt / .md / "
                                                  ".html files")
    name: str | None = Field(None, description="name in the metrics (null: the source's file name without "
                                               "extension)")
    md5: str | None = Field(None, description="md5 of the zip: required for a URL, checked for a local file")
    split: str = Field("test", min_length=1, description="the evaluated split: its judged queries are the test "
                                                         "queries")
    limit_queries: PositiveInt | None = Field(None, description="evaluate only the first n test queries by id "
                                                                "(null: all)")
    # your own documents
    format: OwnFormat = Field("auto", description="your own documents: how the source is read (auto: by extension)")
    fields: dict[Literal["id", "title", "text"], str] | None = Field(
        None, description="your own documents: the source's column for id, title and text (null: _id / id / doc_id, "
                          "title, text)")
    passages: PassageSettings | None = Field(None, description="your own documents: cut long documents into "
                                                               "passages (null: a passage per document)")
    queries: str | None = Field(None, description="your own documents, labelled: a file of test queries (.jsonl, "
                                                  ".tsv, .csv, or .txt with a query per line); needs qrels")
    qrels: str | None = Field(None, description="your own documents, labelled: the judgements of queries "
                                                "(TSV query_id, doc_id, relevance; or TREC qrels)")
    query_log: str | None = Field(None, description="your own documents: query texts without labels (a search "
                                                    "log), for generate.source: unlabelled")
    proxy: ProxyConfig | None = Field(ProxyConfig(), description="your own documents without labels: the synthetic "
                                                                 "held-out evaluation (a proxy, reported as one); "
                                                                 "null: none (a corpus too small to hold documents "
                                                                 "out): the run trains and hands out the trained model "
                                                                 "unmeasured, as GPL's script does without "
                                                                 "evaluation data")

    @field_validator("md5", mode="before")
    @classmethod
    def _md5(cls, v):
        # YAML (and --set) reads an all-digit md5 as an integer, dropping leading zeros: an md5 has 32 digits
        return f"{v:032d}" if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else v

    @model_validator(mode="after")
    def _source_and_split(self):
        if is_url(self.source) and not self.md5:
            raise ValueError(f"md5: required for a URL source ({self.source}), so the download can be "
                             "verified")
        if self.own:
            if (self.queries is None) != (self.qrels is None):
                have, lack = ("queries", "qrels") if self.qrels is None else ("qrels", "queries")
                raise ValueError(f"{lack}: a labelled set needs both queries and qrels ({have} is set); without "
                                 "labels leave both out (the evaluation is then a synthetic proxy)")
            if self.proxy is None and self.qrels is not None:
                raise ValueError("proxy: null is for documents without labels; with queries and qrels the evaluation "
                                 "is labelled (leave proxy out)")
            if self.proxy is not None and self.proxy.judged and self.qrels is None and self.query_log is None:
                raise ValueError("proxy.queries.source: log holds out a part of the query log: set query_log (a file "
                                 "of query texts)")
            for key in ("queries", "qrels", "query_log"):
                path = getattr(self, key)
                if path is not None and not Path(path).expanduser().is_file():
                    raise ValueError(f"{key}: no such file: {path}{_relative_hint(path)}")
            return self
        own_keys = [k for k in ("fields", "passages", "queries", "qrels", "query_log")
                    if getattr(self, k) is not None] + (["format"] if self.format != "auto" else [])
        if own_keys:
            raise ValueError(f"{own_keys[0]}: for your own documents; {self.source} is a BEIR dataset (its queries "
                             "and qrels are read from it)")
        splits = self.splits()
        if splits is not None and self.split not in splits:
            raise ValueError(f"split: '{self.split}' is not a split of {self.source} "
                             f"(its qrels: {', '.join(splits) or 'none'})")
        return self

    @property
    def own(self) -> bool:
        """Your own documents (not a BEIR folder, zip or URL)."""
        try:
            return not is_beir_source(self.source)
        except IngestError as e:
            raise ValueError(f"source: {e}") from None

    @property
    def labelled(self) -> bool:
        return not self.own or self.qrels is not None

    @property
    def evaluation_proxy(self) -> ProxyConfig | None:
        """The synthetic held-out evaluation a run makes: your own documents without labels (None: labelled,
        or ``proxy: null``)."""
        return None if self.labelled else self.proxy

    def splits(self) -> tuple[str, ...] | None:
        """The source's qrels splits (None: not known before download); your own documents: the labelled
        split, or none."""
        if self.own:
            return (self.split,) if self.qrels is not None else ()
        try:
            return dataset_splits(self.source)
        except IngestError as e:
            raise ValueError(f"source: {e}") from None

    @property
    def display_name(self) -> str:
        name = Path(str(self.source).rstrip("/")).name
        return self.name or (name[: -len(".jsonl.gz")] if name.endswith(".jsonl.gz") else Path(name).stem)


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
        """The first variant's system name: the BM25 run a hybrid fuses (``bm25_runs`` names it so)."""
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


# ---- building blocks ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Dataset:
    """A dataset in the store and its evaluation queries: a BEIR dataset, or your own documents with a
    labelled set or, without labels, a synthetic held-out set (``proxy``)."""

    name: str
    split: str
    corpus: DatasetRef  # what every evaluated system searches
    queries: DatasetRef | None
    qrels: DatasetRef | None
    test_queries: DatasetRef | None  # None: nothing is evaluated (dataset.proxy: null)
    train_corpus: DatasetRef | None = None  # what training queries and pairs come from (None: corpus)
    query_log: DatasetRef | None = None  # your own documents: query texts without labels
    proxy: str | None = None  # without labels: how the synthetic evaluation was made (None: labelled)
    judged: bool = False  # a held-out part of the query log: its qrels are the recipe's teacher's to make

    @property
    def training_corpus(self) -> DatasetRef:
        return self.train_corpus or self.corpus

    @property
    def evaluation(self) -> str:
        """What the metrics are measured on: labelled, or a proxy and how it was made."""
        if self.test_queries is None:
            return NO_EVALUATION
        return "labelled" if self.proxy is None else f"proxy ({self.proxy})"


def ingest(run: Run, d: DatasetConfig) -> Dataset:
    """The dataset (fetched once if a URL) and the judged queries of its evaluated split; your own
    documents: read into passages, with a labelled set if given, else a synthetic held-out set."""
    source = run.external(source_ref(d.source, d.md5, run.store.root / "downloads"), {"source": d.source})
    if d.own:
        return _own_documents(run, d, source)
    beir = ingest_beir(run, d.to(IngestParams), source=source)
    test = select_queries(run, SelectQueriesParams(split=d.split, limit=d.limit_queries), tag=d.split,
                          queries=beir["queries"], qrels=beir["qrels"])
    return Dataset(d.display_name, d.split, beir["corpus"], beir["queries"], beir["qrels"], test)


def _file_ref(run: Run, path: str, key: str) -> DatasetRef:
    return run.external(source_ref(path, None, run.store.root / "downloads"), {"source": path, "config_key": key})


def _own_documents(run: Run, d: DatasetConfig, source: DatasetRef) -> Dataset:
    corpus = ingest_corpus(run, d.to(CorpusReadParams), source=source)
    log_queries = None
    if d.query_log is not None:
        log_queries = ingest_queries(run, QueryFileParams(), tag="query-log",
                                     queries=_file_ref(run, d.query_log, "dataset.query_log"))["queries"]
    if d.labelled:
        labelled = ingest_queries(run, QueryFileParams(split=d.split), tag=d.split, corpus=corpus,
                                  queries=_file_ref(run, d.queries, "dataset.queries"),
                                  qrels=_file_ref(run, d.qrels, "dataset.qrels"))
        test = select_queries(run, SelectQueriesParams(split=d.split, limit=d.limit_queries), tag=d.split,
                              queries=labelled["queries"], qrels=labelled["qrels"])
        return Dataset(d.display_name, d.split, corpus, labelled["queries"], labelled["qrels"], test,
                       query_log=log_queries)
    # No labels: documents set aside before anything trains; each held-out passage's generated queries
    # have it as their one relevant passage.
    p = d.proxy
    if p is None:
        return Dataset(d.display_name, d.split, corpus, None, None, None, query_log=log_queries)
    if p.judged:  # held-out log queries, searched over the whole corpus; the recipe's teacher judges them
        parts = hold_out_queries(run, p.queries.to(QueryHoldoutParams), queries=log_queries)
        return Dataset(d.display_name, GENERATED_SPLIT, corpus, parts["heldout"], None, parts["heldout"],
                       query_log=parts["train_queries"], proxy=p.describe(), judged=True)
    parts = holdout(run, p.to(HoldoutParams), corpus=corpus)
    q = p.queries
    if isinstance(q, ProxyT5):
        gen = generate_queries(run, q.to(T5Source), tag="proxy", corpus=parts["heldout"],
                               model=run.model(q.model, "dataset.proxy.queries.model"))
    else:
        gen = generate_queries(run, q, tag="proxy", corpus=parts["heldout"])
    searched = corpus
    if p.cuts:
        searched = cut_proxy_queries(run, NoParams(), corpus=corpus, queries=gen["queries"], qrels=gen["qrels"])
    return Dataset(d.display_name, GENERATED_SPLIT, searched, gen["queries"], gen["qrels"], gen["queries"],
                   train_corpus=parts["train_corpus"], query_log=log_queries, proxy=p.describe())


def bm25_runs(run: Run, c: BM25Config, corpus: DatasetRef, queries: DatasetRef, *, prefix: str = "bm25",
              tag_suffix: str = "") -> dict[str, DatasetRef]:
    """System name -> run, one per BM25 variant (an index each, cached apart from the search); none without
    queries (nothing evaluated)."""
    runs = {}
    if queries is None:
        return runs
    for variant in c.variants:
        tag = variant + tag_suffix
        index = bm25_index(run, BM25IndexParams(variant=variant), tag=tag, corpus=corpus)
        system = bm25_system(variant, prefix)
        runs[system] = bm25_search(run, c.to(BM25SearchParams, variant=variant, system=system), tag=tag,
                                   bm25_index=index, queries=queries)
    return runs


def dense_run(run: Run, c: DenseRetrieval, corpus: DatasetRef, queries: DatasetRef, *, model: DatasetRef,
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


def evaluate_runs(run: Run, c: EvaluationParams, data: Dataset, systems: Systems, caveat: str | None = None) -> Made:
    """One evaluate stage per system (a changed system re-evaluates alone), on the test queries (the corpus
    lets it count the judged queries with no judged document in it); what the recipe hands back (``Made``).
    ``caveat``: why this evaluation cannot tell a trained model from the start (see ``Made``)."""
    made = Made([], data.evaluation, dict(systems.models), systems.start, caveat,
                units="queries" if data.judged else "documents")
    if data.test_queries is None:
        return made
    if data.judged and data.qrels is None:
        raise ValueError("evaluate_runs: the held-out log queries have no judgements yet (the recipe's teacher "
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


def hybrid_runs(run: Run, c: HybridConfig, runs: dict[str, DatasetRef], sparse: str, zero_shot: str,
                students: Iterable[str]) -> dict[str, DatasetRef]:
    """System name -> fused test run: ``hybrid`` (BM25 + the zero-shot model) and, with ``students``,
    BM25 + each trained model (``hybrid-<model>``); none unless ``enabled``. A user who deploys BM25 +
    dense wants to know what adaptation adds to that system, not only to the dense model alone."""
    if not c.enabled or sparse not in runs:
        return {}
    fused = {"hybrid": fuse(run, c.params(sparse, zero_shot), tag="hybrid", rankings=[runs[sparse], runs[zero_shot]])}
    for name in students if c.students else ():
        fused[f"hybrid-{name}"] = fuse(run, c.student_params(sparse, name), tag=f"hybrid-{name}",
                                       rankings=[runs[sparse], runs[name]])
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
    return dense_run(run, c.to(type(c), depth=depth, remove_query=False), data.corpus, queries, model=model,
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


def test_runs(run: Run, c: RecipeConfig, data: Dataset, base: DatasetRef,
              models: dict[str, DatasetRef], base_model: str | None = None,
              start: tuple[str, DatasetRef] | None = None) -> Systems:
    """The test systems: BM25 (``c.bm25``), the zero-shot base model (``base_model``: its config value, by
    default ``c.base_model``; the start), and each trained model, encoded and searched as ``c.dense``.
    ``start``: (system, model) where training continued from an alias's model (``start_model``): evaluated
    too, and the model the trained ones are selected against. And the promotion's comparison
    (``alias_runs``)."""
    systems = Systems(bm25_runs(run, c.bm25, data.corpus, data.test_queries))
    zero_shot = system_name(base_model or c.base_model)
    systems.dense(zero_shot, dense_run(run, c.dense, data.corpus, data.test_queries, model=base, system=zero_shot,
                                       tag="zero-shot"), base, start=True)
    if start is not None:
        name, model = start
        if name in systems.rankings:
            raise ConfigError(f"train.init: '{name}' is also the name of a system of this run; the alias's model is "
                              "evaluated as a system of that name: choose another alias name")
        systems.dense(name, dense_run(run, c.dense, data.corpus, data.test_queries, model=model, system=name,
                                      tag=name), model, start=True)
    for name, model in models.items():
        systems.dense(name, dense_run(run, c.dense, data.corpus, data.test_queries, model=model, system=name,
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
    return {alias: dense_run(run, dense, data.corpus, data.test_queries, model=model, system=alias, tag=alias)}


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
