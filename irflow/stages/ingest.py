"""Datasets in: ``ingest`` turns a BEIR dataset (a folder, a local zip, or a URL with md5) into
corpus/queries/qrels tables, and ``select_queries`` picks the queries judged in one split.

Reading BEIR (its layout, every check, the errors naming file and line) is ``irflow.sources.beir``'s; here a
source becomes an input ref keyed by its content (``source_ref``), and the stage publishes what
``irflow.sources.beir.read_beir`` read (validated outputs only, so nothing partial is ever stored).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import pyarrow as pa
from pydantic import Field, PositiveInt, model_validator

from irflow.engine.errors import DataError
from irflow.engine.params import NoParams, Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef, fingerprint_file
from irflow.sources.beir import fetch, read_beir

log = logging.getLogger(__name__)


# ---- sources --------------------------------------------------------------------------------
def source_fingerprint(path: Path) -> str:
    """Content fingerprint of a source, for the cache key: changing the files changes the key."""
    if path.is_file():
        return "sha256:" + fingerprint_file(path)
    from irflow.engine.store import fingerprint_dir

    return "sha256:" + fingerprint_dir(path)


# ---- the stages -----------------------------------------------------------------------------
class IngestParams(Params):
    dangling_qrels: Literal["keep", "drop", "error"] = Field(
        "keep", description="qrels rows that point to a document missing from the corpus (or to a missing query): "
                            "keep (as BEIR, pytrec_eval, Pyserini and MTEB score them: a judged query with no judged "
                            "document in the corpus stays evaluated and scores 0, and a missing judged document "
                            "still counts in the ideal DCG; the metrics say how many such queries there are), "
                            "drop them (such queries vanish from the evaluation, so scores read higher than "
                            "published ones), or error (refuse the dataset). A row naming a query missing from "
                            "queries.jsonl is inert either way: that query is never asked, so never evaluated "
                            "or trained on. Each is logged with its counts")


# version 3: the default is keep; a zip or folder holding two datasets is refused
@stage("ingest", version="3", outputs=[Output("corpus", "corpus"), Output("queries", "queries"),
                                        Output("qrels", "qrels")])
def ingest_beir(p: IngestParams, rt: StageRuntime, *, source: DatasetRef):
    """A BEIR folder or zip (``source``, an external ref from ``source_ref``) as corpus/queries/qrels."""
    return read_beir(Path(source.path), rt.workdir, p.dangling_qrels)


def source_ref(source: str, md5: str | None, downloads: Path) -> DatasetRef:
    """A dataset source (a BEIR folder, a .zip, or a URL fetched once and md5-checked) as an input ref.

    Its id is a content fingerprint, not its path: moving the zip changes nothing, editing a file
    inside it recomputes.
    """
    path = fetch(str(source), md5, downloads)
    # An md5 is a fingerprint only where fetch() verified it (a file); a folder is hashed.
    fp = f"md5:{md5}" if md5 and path.is_file() else source_fingerprint(path)
    return DatasetRef(fp, Path(str(source)).name, "source", None, str(path.resolve()))


class SelectQueriesParams(Params):
    split: str = Field(description="the qrels split whose judged queries are selected (e.g. test)")
    limit: PositiveInt | None = Field(None, description="keep only the first n queries by id (null: all)")


@stage("select_queries", version="1", outputs=Output("queries", "queries"))
def select_queries(p: SelectQueriesParams, rt: StageRuntime, *, queries: DatasetRef, qrels: DatasetRef) -> pa.Table:
    """The queries judged in ``p.split`` (as BEIR's loader does), optionally the first ``limit``."""
    import duckdb

    with duckdb.connect() as con:
        con.register("q", queries.table())
        con.register("r", qrels.table(columns=["query_id", "split"]))
        limit = f"LIMIT {int(p.limit)}" if p.limit else ""
        t = con.sql(f"SELECT query_id, text FROM q WHERE query_id IN (SELECT query_id FROM r WHERE split = $split) "
                    f"ORDER BY query_id {limit}", params={"split": p.split}).to_arrow_table()
    if t.num_rows == 0:  # a URL source's splits are known only after its download: say which it has
        splits = sorted(set(qrels.table(columns=["split"]).column("split").to_pylist()))
        raise DataError(f"no queries are judged in split '{p.split}' (the dataset's qrels splits: "
                        f"{', '.join(splits) or 'none'})")
    return t


# ---- a user's own documents ---------------------------------------------------------------------
class PassageSettings(Params):
    max_words: PositiveInt = Field(description="a document longer than this many words is cut into passages of "
                                               "this many words (passage ids: <document id>#1, #2, ...)")
    stride: PositiveInt | None = Field(None, description="a passage starts every this many words (null: max_words, "
                                                         "no overlap; less than max_words: passages overlap)")

    @model_validator(mode="after")
    def _stride(self):
        if self.stride is not None and self.stride > self.max_words:
            raise ValueError(f"stride: {self.stride} is more than max_words ({self.max_words}): words between "
                             "passages would be lost")
        return self


OwnFormat = Literal["auto", "jsonl", "parquet", "csv", "tsv", "folder"]


class CorpusReadParams(Params):
    format: OwnFormat = Field("auto", description="how the source is read: auto (by its extension: .jsonl, "
                                                  ".jsonl.gz, .parquet or a folder of them, .csv, .tsv; a folder of "
                                                  ".txt / .md / .html documents), or one of them by name")
    fields: dict[Literal["id", "title", "text"], str] | None = Field(
        None, description="the source's column (or JSON key) for each of id, title, text, e.g. {id: doc_id, text: "
                          "body} (null: _id / id / doc_id, title, text). Documents without an id get a stable one: "
                          "their path in a folder, else a hash of their content")
    passages: PassageSettings | None = Field(None, description="cut long documents into passages (null: one "
                                                               "passage per document)")


@stage("ingest_corpus", version="1", outputs=Output("corpus", "corpus"))
def ingest_corpus(p: CorpusReadParams, rt: StageRuntime, *, source: DatasetRef):
    """A user's documents (``source``: a file or folder, keyed by its content) as a corpus of passages.
    Reading is ``irflow.sources.corpus_sources``'s; a source that changed after the run fingerprinted it (it is
    being written to) is refused, so a stored corpus is always the content its id says."""
    from irflow.sources.corpus_sources import read_documents

    path = Path(source.path)
    out = rt.workdir / "corpus.parquet"
    stats = read_documents(path, out, p)
    if source_fingerprint(path) != source.id:
        raise DataError(f"{path} changed while it was read; nothing was stored: run again")
    log.info("ingest_corpus: %d document(s) -> %d passage(s) (%d cut into passages, %d empty dropped)",
             stats.documents, stats.passages, stats.split_documents, stats.empty_dropped)
    return out


class QueryFileParams(Params):
    split: str = Field("test", min_length=1, description="the split the judgements are recorded under")
    fields: dict[Literal["id", "text"], str] | None = Field(None, description="the query file's column for id and "
                                                                             "text (null: _id / id / query_id, text)")


@stage("ingest_queries", version="1", outputs=[Output("queries", "queries"), Output("qrels", "qrels")])
def ingest_queries(p: QueryFileParams, rt: StageRuntime, *, queries: DatasetRef, qrels: DatasetRef | None = None,
                   corpus: DatasetRef | None = None):
    """A query file (JSONL, TSV/CSV, or plain text: a query per line) and, for a labelled set, its judgements
    (TSV ``query_id doc_id relevance`` or TREC qrels); without ``qrels`` the queries are a query log and the
    judgements table is empty. Judgements must name queries of the file and passages of ``corpus``."""
    import pyarrow.compute as pc

    from irflow.sources.corpus_sources import read_qrels, read_queries

    q = read_queries(Path(queries.path), fields=p.fields)
    if qrels is None:
        return {"queries": q, "qrels": pa.table({"query_id": pa.array([], pa.string()),
                                                 "doc_id": pa.array([], pa.string()),
                                                 "score": pa.array([], pa.int32()), "split": pa.array([], pa.string())})}
    r = read_qrels(Path(qrels.path), split=p.split)
    unknown_q = pc.invert(pc.is_in(r.column("query_id"), value_set=q.column("query_id")))
    if pc.any(unknown_q).as_py():
        first = r.filter(unknown_q).column("query_id")[0].as_py()
        raise DataError(f"{qrels.path}: {pc.sum(unknown_q).as_py()} judgement(s) name a query missing from "
                        f"{queries.path} (first: '{first}')")
    if corpus is not None:
        ids = corpus.table(columns=["doc_id"]).column("doc_id")
        unknown_d = pc.invert(pc.is_in(r.column("doc_id"), value_set=ids))
        if pc.any(unknown_d).as_py():
            first = r.filter(unknown_d).column("doc_id")[0].as_py()
            raise DataError(f"{qrels.path}: {pc.sum(unknown_d).as_py()} judgement(s) name a passage missing from "
                            f"the corpus (first: '{first}'; cut documents have passage ids <document id>#<n>)")
    if r.num_rows == 0:
        raise DataError(f"{qrels.path}: no judgements")
    return {"queries": q, "qrels": r}


class HoldoutParams(Params):
    fraction: float = Field(0.1, gt=0, le=0.5, description="a document is held out for the synthetic evaluation "
                            "(all its passages; never used to generate training queries or pairs) when the hash of "
                            "(seed, its id) falls below this fraction: a rule on the document's own id, so adding, "
                            "editing or deleting other documents never changes whether it is held out")
    documents: PositiveInt | None = Field(None, description="at most this many held-out documents get proxy queries "
                                                            "(those of the lowest hashes; null: every held-out "
                                                            "document). The others stay out of training either way")
    seed: int = Field(0, description="which documents are held out (the hash of seed and document id)")
    twins: bool = Field(True, description="a document whose text equals a held-out document's (after normalising "
                                          "case, punctuation and spaces) or nearly equals it (MinHash Jaccard of "
                                          "word 5-shingles >= twin_jaccard: the same page with another footer) is "
                                          "held out with it, so no held-out text is trained on under another id")
    twin_jaccard: float = Field(0.8, gt=0, le=1, description="how alike two documents' shingles must be to be twins")


def _doc_hash(seed: int, doc_id: str) -> str:
    import hashlib

    return hashlib.sha256(f"{seed}\0{doc_id}".encode()).hexdigest()


def hash_fraction(seed: int, doc_id: str) -> float:
    """Where a document falls in [0, 1): its own id's hash, nothing else."""
    return int(_doc_hash(seed, doc_id)[:15], 16) / 16 ** 15


@stage("holdout", version="2", outputs=[Output("train_corpus", "corpus"), Output("heldout", "corpus")])
def holdout(p: HoldoutParams, rt: StageRuntime, *, corpus: DatasetRef):
    """Split the corpus before anything trains: ``heldout`` (the passages of the documents whose own hash
    falls below ``fraction``, with their exact and near twins: the synthetic evaluation's positives, at most
    ``documents`` of them queried) and ``train_corpus`` (the rest: what queries and training pairs are made
    from). Retrieval at evaluation still searches the whole corpus."""
    from irflow.learn.twins import twin_groups
    from irflow.sources.corpus_sources import document_id

    t = corpus.table()
    ids = t.column("doc_id").to_pylist()
    doc_of = [document_id(i) for i in ids]
    docs = sorted(set(doc_of))
    held = {d for d in docs if hash_fraction(p.seed, d) < p.fraction}
    by_hash = len(held)
    if p.twins and held:
        texts: dict[str, list[str]] = {}
        for d, title, text in zip(doc_of, t.column("title").to_pylist(), t.column("text").to_pylist()):
            texts.setdefault(d, []).append(f"{title or ''} {text or ''}")
        for group in twin_groups({d: " ".join(v) for d, v in texts.items()}, p.twin_jaccard):
            if held & group:
                held |= group
    if not held or len(held) == len(docs):
        raise DataError(f"the corpus has {len(docs)} document(s); dataset.proxy.fraction {p.fraction:g} holds out "
                        f"{len(held)}: {'none is' if not held else 'nothing is left to train on'} (raise the "
                        f"fraction, add documents, or set dataset.proxy: null to train without a synthetic evaluation)")
    log.info("holdout: %d of %d documents held out (%d by their own hash, %d as twins of those)", len(held),
             len(docs), by_hash, len(held) - by_hash)
    queried = held if p.documents is None else set(sorted(held, key=lambda d: _doc_hash(p.seed, d))[:p.documents])
    keep = pa.array([d in queried for d in doc_of], pa.bool_())
    train = pa.array([d not in held for d in doc_of], pa.bool_())
    return {"train_corpus": t.filter(train), "heldout": t.filter(keep)}


class QueryHoldoutParams(Params):
    fraction: float = Field(0.2, gt=0, le=0.5, description="a query of the log is held out (never trained on; "
                            "judged by the teacher for the synthetic evaluation) when the hash of (seed, its "
                            "normalised text) falls below this fraction: a rule on the query's own words, so a "
                            "growing log never moves a query across, and a repeated query stays on one side")
    seed: int = Field(0, description="which queries are held out (the hash of seed and normalised text)")


@stage("hold_out_queries", version="1", outputs=[Output("train_queries", "queries"), Output("heldout", "queries")])
def hold_out_queries(p: QueryHoldoutParams, rt: StageRuntime, *, queries: DatasetRef):
    """Split a query log before anything trains: ``heldout`` (the queries whose normalised text hashes below
    ``fraction``) and ``train_queries`` (the rest: what training reads)."""
    import pyarrow.compute as pc

    from irflow.learn.twins import normalise

    t = queries.table()
    held = pa.array([hash_fraction(p.seed, " ".join(normalise(x or ""))) < p.fraction
                     for x in t.column("text").to_pylist()], pa.bool_())
    n = sum(held.to_pylist())
    if n == 0 or n == t.num_rows:
        raise DataError(f"the query log has {t.num_rows} queries; dataset.proxy.queries.fraction {p.fraction:g} holds "
                        f"out {n}: {'none is' if not n else 'nothing is left to train on'} (raise the fraction or "
                        f"give a longer log)")
    log.info("hold_out_queries: %d of %d log queries held out", n, t.num_rows)
    return {"train_queries": t.filter(pc.invert(held)), "heldout": t.filter(held)}


@stage("cut_proxy_queries", version="1", outputs=Output("corpus", "corpus"))
def cut_proxy_queries(p: NoParams, rt: StageRuntime, *, corpus: DatasetRef, queries: DatasetRef, qrels: DatasetRef):
    """The corpus a proxy searches when its queries were cut out of their held-out passages (ict, crop):
    each judged passage with its queries' words removed (``irflow.learn.generation.cut_out``), every other
    passage as it is. Ids and order are the corpus's, so unchanged passages' embeddings are reused
    (``irflow.engine.row_reuse``)."""
    from irflow.learn.generation import cut_out

    q = queries.table(columns=["query_id", "text"])
    text_of = dict(zip(q.column("query_id").to_pylist(), q.column("text").to_pylist()))
    r = qrels.table(columns=["query_id", "doc_id"])
    cut: dict[str, list[str]] = {}
    for q, d in zip(r.column("query_id").to_pylist(), r.column("doc_id").to_pylist()):
        cut.setdefault(d, []).append(text_of[q])
    t = corpus.table()
    texts = [cut_out(x, cut[d]) if d in cut else x for d, x in zip(t.column("doc_id").to_pylist(),
                                                                    t.column("text").to_pylist())]
    return t.set_column(t.schema.get_field_index("text"), "text", pa.array(texts, pa.string()))
