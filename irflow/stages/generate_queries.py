"""Pseudo-queries for passages of the target corpus: the training signal of unsupervised domain adaptation.

One stage, ``generate_queries``, with five sources (the params' ``source``):

- ``t5`` -- a seq2seq query generator samples queries from each passage: docT5query (Nogueira & Lin,
  2019, "From doc2query to docTTTTTquery"), as BEIR's ``QueryGenerator`` (Thakur et al., 2021) and
  GPL (Wang et al., 2022, "GPL: Generative Pseudo Labeling for Unsupervised Domain Adaptation of
  Dense Retrieval") run it: nucleus sampling, top_p 0.95, top_k 25, at most 64 tokens, input
  ``title + " " + text``.
- ``ict`` -- Inverse Cloze Task (Lee, Chang & Toutanova, 2019, "Latent Retrieval for Weakly Supervised
  Open Domain Question Answering"): a random sentence of the passage is the query.
- ``crop`` -- independent cropping (Izacard et al., 2021, "Unsupervised Dense Information Retrieval
  with Contrastive Learning", Contriever): a random contiguous span of 10-50% of the passage words.
- ``spider`` -- recurring spans (Ram et al., NAACL 2022, "Learning to Retrieve Passages without
  Supervision", Spider): an n-gram that two passages of the same document share (passages ``<doc>#<n>``
  of a document that ``dataset.passages`` cut); a window of words around it in one passage, the span
  kept or taken out at random, is the query, and the OTHER passage its positive (``generation.spider_queries``).
- ``unlabelled`` -- the dataset's own query texts of one split, without their judgements, as a query
  log would give them.

Outputs: ``queries`` and ``qrels``. For the four generating sources each query has one qrels row
(``split="generated"``, ``score=1``): t5, ict and crop point to the passage the query came from, spider
to the other passage of its document. ``unlabelled`` queries have no known positive, so their qrels
table is empty (but valid).

Sharding (``irflow.engine.shards``): t5, ict and crop are maps over the corpus, computed in shards of
``runtime.shard_rows`` passages (parts of both outputs in ``partial/<key>``, resumed after a kill, run on
Ray workers with ``runtime.executor: ray``), and their outputs do not depend on the shards: ict and crop
seed per passage; t5 samples passage by passage, each seeded from (seed, passage id) -- or, with
``sampling: batch``, in batches that start at multiples of ``batch_size`` in the whole corpus, each seeded
from (seed, batch number), and the stage asks for shards that start on those batches (the runner rounds
``shard_rows`` up to a multiple of ``batch_size``). Seeded per passage, a passage's queries depend on it
alone: a later run on a changed corpus generates only for new and edited passages (``irflow.engine.row_reuse``). ``queries_per_passage: auto`` counts
the whole corpus, not the shard. ``unlabelled`` is no map over the corpus (it reads the dataset's
queries): it is computed whole, unsharded (``shard_when``). Nor is ``spider``: a passage's queries depend
on the other passages of its document (the spans it shares with them, the positives), which a shard of
rows need not hold; it is computed whole, and a changed corpus generates all its queries again.

Measured on SciFact: ICT and cropping queries are too easy -- the source passage is BM25's top-1 for
nearly all of them -- and GPL trained on them scored *below* the zero-shot model on the test qrels,
where the train split's real query texts (labels unused) raised it (``irflow/measured/model_free.json``,
from bench/model_free.py -> bench/results/model_free.json; the figures in docs/recipes/gpl.md, "Query
sources"). Model-free sources are offered as cheap
baselines and for machines without a query generator; the GPL recipe warns before it runs on them.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import pyarrow as pa
from pydantic import Field, PositiveInt, field_validator, model_validator
from tqdm.auto import tqdm

from irflow.engine.errors import DataError
from irflow.engine.params import Params
from irflow.engine.row_reuse import RowMap
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn import generation

SOURCES = ("t5", "ict", "crop", "spider", "unlabelled")
GENERATED_SPLIT = "generated"
# GPL's rule for the number of queries per passage: about 250K generated queries in all (Wang et
# al., 2022, section 4), at least 1 and at most 50 per passage.
GPL_TOTAL_QUERIES = 250_000
MAX_AUTO_QPP = 50
# Query-id tag per source, so queries from several sources can be concatenated without id clashes.
ID_TAGS = {"t5": "q", "ict": "ict", "crop": "crop", "spider": "spider"}

QueriesPerPassage = Union[PositiveInt, Literal["auto"]]


class T5Source(Params):
    source: Literal["t5"] = Field(description="a seq2seq query generator samples queries per passage (docT5query)")
    queries_per_passage: QueriesPerPassage = Field(3, description="queries sampled per passage, or auto: about "
                                                                  "250k in all (GPL), 1 to 50 per passage")
    max_input_length: PositiveInt = Field(350, description="passage tokens the generator reads")
    max_length: PositiveInt = Field(64, description="most tokens per generated query")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling mass")
    sample_top_k: PositiveInt = Field(25, description="sample among the k most likely tokens")
    sampling: Literal["passage", "batch"] = Field(
        "passage", description="passage: each passage's queries are sampled on their own, seeded from the seed and "
                               "its passage id, so they never depend on the other passages and a later run on a "
                               "changed corpus generates only for new or edited passages (irflow.engine.row_reuse); "
                               "batch: batch_size passages at once, seeded per batch (faster on a GPU; every "
                               "passage is generated again whenever the corpus changes)")
    batch_size: PositiveInt | None = Field(None, description="sampling batch: passages per generation batch (halved "
                                                             "on out-of-memory; null: 32); batches start at its "
                                                             "multiples and are seeded one by one, so the draws "
                                                             "depend on it")
    max_rounds: PositiveInt = Field(3, description="sampling rounds to replace empty or repeated queries (within "
                                                   "a passage, or a batch)")
    seed: int = Field(42, description="sampling seed (re-seeded per passage from the seed and its id, or per batch "
                                      "from the seed and the batch number)")

    @model_validator(mode="after")
    def _batch_size_for_batches(self):
        if self.batch_size is not None and self.sampling == "passage":
            raise ValueError("batch_size: only used with sampling batch (sampling passage generates passage by "
                             "passage)")
        return self

    @property
    def batch(self) -> int:
        """Passages per generation call: batch_size (sampling batch), or 1."""
        return (self.batch_size or 32) if self.sampling == "batch" else 1


class ICTSource(Params):
    source: Literal["ict"] = Field(description="Inverse Cloze Task: a random sentence of the passage is the query")
    queries_per_passage: QueriesPerPassage = Field(1, description="sentences drawn per passage (or auto)")
    min_words: PositiveInt = Field(3, description="shortest sentence used, in words")
    seed: int = Field(42, description="sampling seed")


class CropSource(Params):
    source: Literal["crop"] = Field(description="independent cropping (Contriever): a random span is the query")
    queries_per_passage: QueriesPerPassage = Field(1, description="spans drawn per passage (or auto)")
    crop_ratio: tuple[float, float] = Field((0.1, 0.5), description="span length as a fraction of the passage, "
                                                                    "drawn uniformly from [lo, hi]")
    min_words: PositiveInt = Field(3, description="shortest span, in words")
    seed: int = Field(42, description="sampling seed")

    @field_validator("crop_ratio")
    @classmethod
    def _ratio(cls, v):
        if not 0 < v[0] <= v[1] <= 1:
            raise ValueError(f"crop_ratio must be [lo, hi] with 0 < lo <= hi <= 1, got {list(v)}")
        return v


class SpiderSource(Params):
    """Recurring spans (Spider; ``generation.spider_queries``). Spider pairs passages of one document, so it
    needs documents cut into passages (``<doc>#<n>`` ids: ``dataset.passages``). A corpus with no document
    of two passages -- a BEIR corpus, a passage per document -- is refused (a ``DataError`` when the stage
    runs), not given a stand-in: pairing the halves of one passage, the positive being the whole passage,
    would make queries contained in their positive (crop's near-copies, measured too easy), not Spider's
    pairs of different passages. Passages that overlap (``dataset.passages.stride`` below ``max_words``)
    share their overlap word for word: its spans recur trivially and such queries are near-copies of the
    positive; cut without overlap for Spider."""

    source: Literal["spider"] = Field(description="recurring spans (Spider): a window around an n-gram that recurs "
                                                  "in another passage of the same document is the query, that "
                                                  "other passage its positive; needs documents cut into passages "
                                                  "(dataset.passages)")
    queries_per_passage: QueriesPerPassage = Field(1, description="queries per passage (or auto), each with a "
                                                                  "different other passage of its document as "
                                                                  "positive, those sharing the longest span "
                                                                  "first; fewer where fewer share a span")
    min_span_words: PositiveInt = Field(2, description="shortest recurring span, in words")
    max_span_words: PositiveInt = Field(10, description="longest recurring span, in words (the longest shared "
                                                        "span up to this is taken)")
    window_words: tuple[PositiveInt, PositiveInt] = Field(
        (10, 30), description="words of the passage around the span in the query (the span not counted), drawn "
                              "uniformly from [lo, hi] (a single number: always that many); fewer where the "
                              "passage has fewer")
    keep_span_probability: float = Field(0.5, ge=0, le=1, description="probability that the query keeps the span "
                                                                      "(else every occurrence of it is taken out)")
    seed: int = Field(42, description="sampling seed (re-seeded per passage from the seed and its id)")

    @field_validator("window_words", mode="before")
    @classmethod
    def _window(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):
            v = (v, v)
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) for x in v) \
                and not 1 <= v[0] <= v[1]:
            raise ValueError(f"window_words must be a number of words >= 1 or [lo, hi] with 1 <= lo <= hi, got "
                             f"{list(v) if v[0] != v[1] else v[0]}")
        return v

    @model_validator(mode="after")
    def _spans(self):
        if self.max_span_words < self.min_span_words:
            raise ValueError(f"max_span_words: {self.max_span_words} is below min_span_words "
                             f"({self.min_span_words})")
        return self


class UnlabelledSource(Params):
    source: Literal["unlabelled"] = Field(description="the dataset's own query texts of one split, labels unused "
                                                      "(what a query log gives)")
    split: str = Field("train", min_length=1, description="whose queries (never the evaluated split); a "
                                                          "dataset.query_log is read whole")

    @field_validator("split")
    @classmethod
    def _not_test(cls, v):
        if v == "test":
            raise ValueError("test queries must not be used for training")
        return v


GenerateParams = Annotated[Union[T5Source, ICTSource, CropSource, SpiderSource, UnlabelledSource],
                          Field(discriminator="source")]


# ---- shared helpers ---------------------------------------------------------------------------
def queries_per_passage(value, num_passages: int) -> int:
    """``value`` as an int, or GPL's ``"auto"``: round(250_000 / |C|), clipped to [1, 50]."""
    if value == "auto":
        return max(1, min(MAX_AUTO_QPP, round(GPL_TOTAL_QUERIES / max(1, num_passages))))
    return int(value)


def _outputs(queries: dict[str, list], with_qrels: bool) -> dict[str, pa.Table]:
    q = pa.table({"query_id": queries["query_id"], "text": queries["text"]},
                 schema=pa.schema([("query_id", pa.string()), ("text", pa.string())]))
    doc_ids = queries["doc_id"] if with_qrels else []
    qids = queries["query_id"] if with_qrels else []
    qrels = pa.table({"query_id": pa.array(qids, pa.string()), "doc_id": pa.array(doc_ids, pa.string()),
                      "score": pa.array([1] * len(qids), pa.int32()),
                      "split": pa.array([GENERATED_SPLIT] * len(qids), pa.string())})
    return {"queries": q, "qrels": qrels}


def _none_produced(corpus: DatasetRef, what: str) -> None:
    """No query from these passages: a DataError when they are the whole corpus. A shard may have none
    (passages of one sentence); the assembled ``queries`` output is then checked whole (not empty)."""
    if corpus.num_rows() == corpus.total_rows():
        raise DataError(what)


# ---- ict / crop -------------------------------------------------------------------------------
def _model_free(corpus_ref: DatasetRef, p: ICTSource | CropSource) -> dict[str, pa.Table]:
    source = p.source
    corpus = corpus_ref.table()
    n = queries_per_passage(p.queries_per_passage, corpus_ref.total_rows())  # the whole corpus, not the shard
    seed, min_words = p.seed, p.min_words
    tag = ID_TAGS[source]
    out: dict[str, list] = {"query_id": [], "doc_id": [], "text": []}
    doc_ids, texts = corpus.column("doc_id").to_pylist(), corpus.column("text").to_pylist()
    for doc_id, text in tqdm(zip(doc_ids, texts), total=len(doc_ids), desc=f"{source} queries", unit=" passages",
                             mininterval=2):
        if source == "ict":
            qs = generation.ict_queries(doc_id, text, n, seed, min_words)
        else:
            qs = generation.crop_queries(doc_id, text, n, seed, p.crop_ratio, min_words)
        for i, q in enumerate(qs):
            out["query_id"].append(f"{doc_id}-{tag}{i}")
            out["doc_id"].append(doc_id)
            out["text"].append(q)
    if not out["query_id"]:
        _none_produced(corpus_ref, f"source '{source}' produced no query from {corpus.num_rows} passages")
    return _outputs(out, with_qrels=True)


# ---- spider -----------------------------------------------------------------------------------
def _spider(corpus_ref: DatasetRef, p: SpiderSource) -> dict[str, pa.Table]:
    from irflow.sources.corpus_sources import document_id

    corpus = corpus_ref.table(columns=["doc_id", "text"])  # the whole corpus: spider is not sharded
    passage_ids = corpus.column("doc_id").to_pylist()
    documents = [document_id(i) for i in passage_ids]
    if not generation.multi_passage_documents(documents):
        raise DataError(f"source 'spider' pairs passages of the same document (ids <document>#<n>), and no "
                        f"document of the corpus has two ({len(passage_ids)} passages, one per document): for "
                        f"your own documents cut them into passages with dataset.passages (max_words, no "
                        f"overlapping stride); a corpus of single passages (BEIR) cannot give Spider's pairs: use "
                        f"source t5, ict or crop")
    n = queries_per_passage(p.queries_per_passage, len(passage_ids))
    rows = generation.spider_queries(passage_ids, documents, corpus.column("text").to_pylist(), n, p.seed,
                                     min_span_words=p.min_span_words, max_span_words=p.max_span_words,
                                     window_words=p.window_words, keep_span_probability=p.keep_span_probability,
                                     id_tag=ID_TAGS["spider"])
    if not rows["query_id"]:
        raise DataError(f"source 'spider' found no recurring span of {p.min_span_words}-{p.max_span_words} words "
                        f"(beginning and ending with a word that is not a stopword) shared by two passages of a "
                        f"document ({generation.multi_passage_documents(documents)} documents of two passages or "
                        f"more): lower min_span_words, or cut documents into more passages")
    return _outputs(rows, with_qrels=True)


# ---- unlabelled -------------------------------------------------------------------------------
def _unlabelled(queries, qrels, p: UnlabelledSource) -> dict[str, pa.Table]:
    if queries is None:
        raise ValueError("generate_queries: source 'unlabelled' needs the 'queries' input")
    import duckdb

    if qrels is None:  # a query log: every query, no split to pick
        with duckdb.connect() as con:
            con.register("q", queries.table())
            t = con.sql("SELECT query_id, text FROM q WHERE trim(text) <> '' ORDER BY query_id").to_arrow_table()
        return _outputs({"query_id": t.column("query_id").to_pylist(), "text": t.column("text").to_pylist(),
                         "doc_id": []}, with_qrels=False)

    with duckdb.connect() as con:
        con.register("q", queries.table())
        # The judgements are read only to know which queries belong to the split; none are passed on.
        con.register("r", qrels.table(columns=["query_id", "split"]))
        t = con.sql("SELECT query_id, text FROM q WHERE query_id IN (SELECT query_id FROM r WHERE split = ?) "
                    "AND trim(text) <> '' ORDER BY query_id", params=[p.split]).to_arrow_table()
    if t.num_rows == 0:
        splits = sorted(set(qrels.table(columns=["split"]).column("split").to_pylist()))
        raise DataError(f"no queries are judged in split '{p.split}' (the dataset's splits: {', '.join(splits)})")
    return _outputs({"query_id": t.column("query_id").to_pylist(), "text": t.column("text").to_pylist(),
                     "doc_id": []}, with_qrels=False)


# ---- t5 ---------------------------------------------------------------------------------------
def _t5(corpus_ref: DatasetRef, p: T5Source, model: DatasetRef, rt: StageRuntime) -> dict[str, pa.Table]:
    from irflow.engine.worker import per_worker

    corpus = corpus_ref.table()
    n = queries_per_passage(p.queries_per_passage, corpus_ref.total_rows())  # the whole corpus, not the shard
    gen = {"max_input_length": p.max_input_length, "max_length": p.max_length, "top_p": p.top_p,
           "sample_top_k": p.sample_top_k}
    # Loaded once per worker process (or once per stage when its shards run here), not once per shard.
    tokenizer, generator_model = per_worker(("t5", model.path, rt.device),
                                            lambda: generation.load_generator(model.path, rt.device, model.name))
    generator = generation.BatchGenerator(generator_model, tokenizer, gen, rt.device, p.batch, rt.autocast)
    columns = [corpus.column(c).to_pylist() for c in ("doc_id", "title", "text")]
    if p.sampling == "passage":
        rows = generation.generate_each(generator, *columns, n, seed=p.seed, max_rounds=p.max_rounds,
                                        id_tag=ID_TAGS["t5"])
    else:
        rows = generation.generate_batches(generator, *columns, n, first_row=corpus_ref.row_offset,
                                           batch_size=p.batch, seed=p.seed, max_rounds=p.max_rounds,
                                           id_tag=ID_TAGS["t5"])
    if not rows["query_id"]:
        _none_produced(corpus_ref, "the generator produced no (non-empty) query")
    return _outputs(rows, with_qrels=True)


# ---- the stage --------------------------------------------------------------------------------
def _maps_the_corpus(p) -> bool:
    """Sharded by corpus unless the source is ``unlabelled`` or ``spider``, each computed whole (one call).
    ``unlabelled`` reads the dataset's queries, not the corpus: shards of the corpus would have nothing to
    split. ``spider``'s queries for a passage depend on the other passages of its document (the spans they
    share, the positive), which a shard of rows may not hold: a shard would miss pairs, or point at
    passages it never read."""
    return not isinstance(p, (UnlabelledSource, SpiderSource))


def _batch_rows(p) -> int:
    """Shards start at multiples of t5's batch size (sampling batch): a batch never straddles two shards
    (its draws depend on its passages), so the output is the same for any ``shard_rows``."""
    return p.batch if isinstance(p, T5Source) else 1


def _per_passage(p) -> bool:
    """Whether a passage's queries depend on that passage alone (ict, crop, t5 sampling passage by
    passage): then a changed corpus generates only for its new and edited passages. Not spider's: an
    edited passage changes the queries of its document's other passages (and their positives)."""
    return not isinstance(p, (UnlabelledSource, SpiderSource)) and not (isinstance(p, T5Source)
                                                                        and p.sampling == "batch")


def _generated_for(queries: pa.Table) -> list[str]:
    """The passage each generated query came from: its id is ``<passage id>-<tag><j>``."""
    return [q.rsplit("-", 1)[0] for q in queries.column("query_id").to_pylist()]


def _row_context(p, passages: int) -> int:
    """What a passage's queries depend on besides the passage: how many are drawn (auto: the corpus size)."""
    return queries_per_passage(p.queries_per_passage, passages)


@stage("generate_queries", version="3", outputs=[Output("queries", "queries"), Output("qrels", "qrels")],
       work="generate", shard="corpus", shard_when=_maps_the_corpus, shard_align=_batch_rows,
       rows=RowMap(key="doc_id", owners={"queries": _generated_for, "qrels": "doc_id"}, context=_row_context,
                   when=_per_passage))
def generate_queries(p: GenerateParams, rt: StageRuntime, *, corpus: DatasetRef, queries: DatasetRef | None = None,
                     qrels: DatasetRef | None = None, model: DatasetRef | None = None) -> dict[str, pa.Table]:
    """Pseudo-queries for the corpus (see the module doc for the sources and papers).

    Inputs: ``corpus``; ``model`` (t5: the seq2seq generator); ``queries`` and ``qrels`` (unlabelled:
    the dataset's own, to pick the split's query texts).

    t5, ict and crop are computed in shards of the corpus (``runtime.shard_rows`` passages; a shard
    finished before a run was killed is not computed again), with the same output for any shards; spider
    and unlabelled are computed whole. t5's
    output is deterministic for a seed on a given device (sampling batch: and batch size; an
    out-of-memory halving of the batch changes the draws from the batch it happens in on).
    """
    if isinstance(p, UnlabelledSource):
        return _unlabelled(queries, qrels, p)
    if isinstance(p, SpiderSource):
        return _spider(corpus, p)
    if isinstance(p, T5Source):
        if model is None:
            raise ValueError("generate_queries: source 't5' needs the model input (the query generator)")
        return _t5(corpus, p, model, rt)
    return _model_free(corpus, p)
