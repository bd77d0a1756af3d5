"""The dataset a run reads: its config section (a BEIR dataset, or your own documents with labels, a query log
or neither) and ``ingest``, which makes the run's ``Dataset``: the corpus every system searches, the evaluated
queries and qrels (labelled, or a synthetic held-out evaluation, a proxy, named by how it was made) and the
corpus training may read.

    BEIR:            ingest_beir -> select_queries
    your documents:  ingest_corpus -> holdout -> generate_queries [-> cut_proxy_queries]   (the proxy)
                     [ingest_queries -> hold_out_queries]   (a query log; its held-out part judged by the teacher)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, PositiveInt, field_validator, model_validator

from irflow.decide.selection import NO_EVALUATION
from irflow.engine.params import ModelName, NoParams
from irflow.engine.runner import Run
from irflow.engine.store import DatasetRef
from irflow.sources.beir import IngestError, _relative_hint, dataset_splits, is_beir_source, is_url
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

log = logging.getLogger("irflow")


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
                                             "offline fusion teacher it ranked the models closer to the real qrels "
                                             "than ict on SciFact and NFCorpus, but favours the starting model the "
                                             "teacher scores with; bench/results/proxy_agreement_*.json). A proxy "
                                             "made by the generator that made the training queries favours the "
                                             "model trained on them")

    cut: bool = Field(False, description="cut each ict / crop query out of the held-out passage it points to, in "
                                         "the corpus the proxy searches (as Lee et al.'s ICT pairs a sentence with "
                                         "its context). Measured on SciFact and NFCorpus as unlabelled documents, "
                                         "the models scored on the real qrels afterwards "
                                         "(bench/results/proxy_agreement_*.json): cut, the proxy ranked them no "
                                         "closer to the real qrels on SciFact and still backwards on NFCorpus, so "
                                         "it is off by default")

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
