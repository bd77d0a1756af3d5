"""Dense retrieval: encode the corpus once (a cached embeddings dataset), then search it with faiss.

Passages are encoded as BEIR's ``title + " " + text`` (``irflow.learn.text.passage_text``) and queries as
their text. ``similarity: cos`` L2-normalises both sides; ``dot`` uses raw inner products. The index
(``irflow.learn.ann``) is flat inner product by default (exact); ``index: hnsw`` builds an HNSW graph;
``ivf_flat`` and ``ivf_pq`` build inverted lists over k-means cells, ``ivf_pq`` with compressed
vectors and an exact re-ranking of a shortlist (approximate, for corpora too big for flat).

The model is an input ref: a model named in the config (``Run.model``) or one trained by an earlier
stage -- the same code path either way. Encoding runs on the runtime's ``encode`` device, with torch or
ONNX Runtime (``runtime.backend``, exact); ``quantization: int8`` encodes with an int8 ONNX model
(keyed: its embeddings are not the model's exact ones; ``irflow.learn.onnx_inference``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt, model_validator

from irflow.engine.params import QUANTIZATION_DOC, Params, Quantization
from irflow.engine.row_reuse import RowMap
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.engine.worker import per_worker
from irflow.learn import ann
from irflow.learn.ann import IVF_KINDS
from irflow.learn.encoding import encode_texts, load_sentence_transformer
from irflow.learn.pairs import candidate_pairs, scored_run
from irflow.learn.text import passage_texts

log = logging.getLogger("irflow.dense")

Similarity = Literal["cos", "dot"]


class EncodeParams(Params):
    similarity: Similarity = Field("cos", description="cos: L2-normalised embeddings; dot: raw inner products")
    batch_size: PositiveInt = Field(64, description="texts per encoding batch")
    max_seq_length: PositiveInt | None = Field(None, description="truncate texts to this many tokens (null: the "
                                                                 "model's own limit, 256 for MiniLM)")
    quantization: Quantization = Field("none", description=QUANTIZATION_DOC)


class DenseRetrieval(EncodeParams):
    index: Literal["flat", "hnsw", "ivf_flat", "ivf_pq"] = Field(
        "flat", description="flat: exact inner-product search; hnsw: an HNSW graph (approximate, faster on big "
                            "corpora); ivf_flat: k-means cells, `nprobe` of them scanned per query (exact when "
                            "nprobe >= nlist); ivf_pq: the same with vectors compressed to `pq_m` bytes, a "
                            "shortlist re-ranked exactly (the index for corpora too big for flat in RAM)")
    hnsw_m: PositiveInt = Field(32, description="HNSW: neighbours per node")
    ef_search: PositiveInt | None = Field(None, description="HNSW: search breadth (null: faiss's default; at "
                                                            "least `depth`)")
    nlist: PositiveInt | None = Field(None, description="ivf_flat/ivf_pq: number of k-means cells (null: about "
                                                        "4 x sqrt(corpus size), at most training sample / 39)")
    nprobe: PositiveInt = Field(32, description="ivf_flat/ivf_pq: cells scanned per query (capped at nlist); "
                                                "more: higher recall, slower search")
    pq_m: PositiveInt | None = Field(None, description="ivf_pq: sub-quantizers, i.e. bytes per stored vector; "
                                                       "must divide the embedding dimension (null: dim / 8, "
                                                       "48 for MiniLM's 384)")
    train_size: PositiveInt | None = Field(None, description="ivf_flat/ivf_pq: vectors sampled from the corpus "
                                                             "to train k-means on (null: 100000)")
    rerank_depth: PositiveInt | None = Field(None, description="ivf_pq: candidates per query re-ranked with the "
                                                               "exact vectors (null: 4 x depth; "
                                                               "below depth: depth)")
    depth: PositiveInt = Field(1000, description="how many passages per query the ranking holds")
    remove_query: bool = Field(True, description="drop a hit whose doc id equals the query id (BEIR's "
                                                 "ignore_identical_ids)")

    @model_validator(mode="after")
    def _index_fields(self):
        applies = {"nlist": IVF_KINDS, "train_size": IVF_KINDS, "pq_m": ("ivf_pq",), "rerank_depth": ("ivf_pq",)}
        for name, kinds in applies.items():
            if getattr(self, name) is not None and self.index not in kinds:
                raise ValueError(f"{name}: only used with index {' or '.join(kinds)} (index is {self.index})")
        if self.nlist is not None and self.train_size is not None and self.train_size < self.nlist:
            raise ValueError(f"nlist: {self.nlist} cells need a training sample at least that big "
                             f"(train_size is {self.train_size}; faiss wants 39 x nlist or more)")
        return self


class DenseSearchParams(DenseRetrieval):
    system: str = Field(min_length=1, description="system name written into the run")


def embeddings_to_numpy(table: pa.Table) -> np.ndarray:
    col = table.column("embedding").combine_chunks()
    n = len(col)
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(n, -1)


def _bi_encoder(p: EncodeParams) -> dict:
    return {"model": ("embed", p.quantization)}  # the model input runs on ONNX Runtime for onnx / int8


@stage("encode_corpus", version="4", outputs=Output("embeddings", "embeddings"), work="encode", shard="corpus",
       onnx=_bi_encoder, rows=RowMap(key="doc_id", owners={"embeddings": "doc_id"}))
def encode_corpus(p: EncodeParams, rt: StageRuntime, *, corpus: DatasetRef, model: DatasetRef) -> pa.Table:
    """One embedding per passage of ``corpus`` with ``model``, in corpus order."""
    st = load_sentence_transformer(model.path, rt.device, p.max_seq_length, onnx=rt.onnx_model(model),
                                   threads=rt.threads)
    c = corpus.table()
    # full batches: a passage's embedding depends on the passage alone, so unchanged passages' rows are
    # reused when the corpus changes (irflow.engine.row_reuse) and equal a cold run's bit for bit
    emb = encode_texts(st, passage_texts(c), p.batch_size, p.similarity == "cos", desc="encode corpus",
                       autocast=rt.autocast, full_batches=True, task="document")
    values = pa.array(emb.ravel(), pa.float32())
    return pa.table({"doc_id": c.column("doc_id"),
                     "embedding": pa.FixedSizeListArray.from_arrays(values, emb.shape[1]).cast(pa.list_(pa.float32()))})


def build_index(doc_emb: np.ndarray | ann.Batches, kind: str = "flat", hnsw_m: int = 32, ef_construction: int = 200,
                *, nlist: int | None = None, pq_m: int | None = None, train_size: int | None = None,
                threads: int | None = None, work_dir: str | Path | None = None) -> ann.AnnIndex:
    """An ``irflow.learn.ann`` index of ``doc_emb``: the embedding matrix, or a callable yielding its batches in
    corpus order (so a sharded corpus need not be in RAM at once). A parameter that does not fit the
    embeddings (``pq_m`` not dividing the dimension, ``nlist`` above the corpus) is a ValueError naming
    its ``dense.`` key."""
    batches = doc_emb if callable(doc_emb) else lambda: iter((doc_emb,))
    try:
        return ann.build(batches, kind, nlist=nlist, pq_m=pq_m, train_size=train_size or ann.DEFAULT_TRAIN_SIZE,
                         hnsw_m=hnsw_m, ef_construction=ef_construction, threads=threads, work_dir=work_dir)
    except ann.AnnParamError as e:
        raise ValueError(f"dense.{e.param}: {e.message}") from e


def search_index(index: ann.AnnIndex, query_emb: np.ndarray, top_k: int, ef_search: int | None = None, *,
                 nprobe: int = 32, rerank_depth: int | None = None):
    """(scores, row ids) of the ``top_k`` passages per query (``irflow.learn.ann.search``)."""
    return ann.search(index, query_emb, top_k, nprobe=nprobe, ef_search=ef_search, rerank_depth=rerank_depth)


def _index(embeddings: DatasetRef, p: DenseRetrieval, rt: StageRuntime):
    """(doc ids, index) of stored embeddings, filled row group by row group (the float32 matrix is never
    held whole: IVF-PQ keeps codes in RAM and the vectors for re-ranking on disk)."""
    doc_ids = embeddings.table(columns=["doc_id"]).column("doc_id").to_pylist()

    def batches():
        for b in embeddings.batches(columns=["embedding"]):
            yield embeddings_to_numpy(pa.Table.from_batches([b]))

    return doc_ids, build_index(batches, p.index, p.hnsw_m, nlist=p.nlist, pq_m=p.pq_m, train_size=p.train_size,
                                threads=rt.threads, work_dir=rt.workdir)


@stage("dense_search", version="3", outputs=Output("run", "run"), work="encode", shard="queries", onnx=_bi_encoder)
def dense_search(p: DenseSearchParams, rt: StageRuntime, *, embeddings: DatasetRef, queries: DatasetRef,
                 model: DatasetRef) -> pa.Table:
    """Top ``depth`` passages per query: queries encoded with ``model``, searched in ``embeddings``."""
    import faiss

    faiss.omp_set_num_threads(rt.threads)
    st = load_sentence_transformer(model.path, rt.device, p.max_seq_length, onnx=rt.onnx_model(model),
                                   threads=rt.threads)
    q = queries.table()
    qids = q.column("query_id").to_pylist()
    q_emb = encode_texts(st, q.column("text").to_pylist(), p.batch_size, p.similarity == "cos",
                         desc="encode queries", autocast=rt.autocast, task="query")
    # Built once per worker process (and once per stage in this one): every query shard searches it.
    doc_ids, index = per_worker(("dense_index", embeddings.id, p.index, p.hnsw_m, p.nlist, p.pq_m, p.train_size),
                                lambda: _index(embeddings, p, rt))
    top_k = min(p.depth, len(doc_ids))
    scores, idx = search_index(index, q_emb, top_k, p.ef_search, nprobe=p.nprobe, rerank_depth=p.rerank_depth)
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    for qi, qid in enumerate(qids):
        rank = 0
        for s, di in zip(scores[qi], idx[qi]):
            if di < 0 or (p.remove_query and doc_ids[di] == qid):
                continue
            rank += 1
            cols["query_id"].append(qid)
            cols["doc_id"].append(doc_ids[di])
            cols["rank"].append(rank)
            cols["score"].append(float(s))
    n = len(cols["query_id"])
    return pa.table({**cols, "rank": pa.array(cols["rank"], pa.int32()), "score": pa.array(cols["score"], pa.float32()),
                     "system": [p.system] * n})


class DenseScoreParams(EncodeParams):
    system: str = Field(min_length=1, description="system name written into the run")


@stage("dense_score", version="1", outputs=Output("run", "run"), work="encode", shard="queries", onnx=_bi_encoder)
def dense_score(p: DenseScoreParams, rt: StageRuntime, *, embeddings: DatasetRef, queries: DatasetRef,
                model: DatasetRef, candidates: list[DatasetRef]) -> pa.Table:
    """The similarity of every (query, passage) pair of ``candidates`` (runs, negatives or qrels) whose
    query is in ``queries``, as a run ranked by it: queries encoded with ``model`` as ``dense_search``
    encodes them, passages read from ``embeddings`` (a retriever's score for passages its own top-k
    missed, ``irflow.learn.pairs``)."""
    q = queries.table()
    qids = q.column("query_id").to_pylist()
    pairs = candidate_pairs([c.table(columns=["query_id", "doc_id"]) for c in candidates], qids)
    log.info("dense_score: %d pairs of %d queries", len(pairs), len({x for x, _ in pairs}))
    if not pairs:
        return scored_run([], [], p.system)
    st = load_sentence_transformer(model.path, rt.device, p.max_seq_length, onnx=rt.onnx_model(model),
                                   threads=rt.threads)
    asked = sorted({x for x, _ in pairs})
    text = dict(zip(qids, q.column("text").to_pylist()))
    q_emb = encode_texts(st, [text[x] for x in asked], p.batch_size, p.similarity == "cos",
                         desc="encode queries", autocast=rt.autocast, task="query")
    doc_ids = embeddings.table(columns=["doc_id"]).column("doc_id").to_pylist()
    row = {d: i for i, d in enumerate(doc_ids)}
    unknown = sorted({d for _, d in pairs if d not in row})
    if unknown:
        raise ValueError(f"dense_score: {len(unknown)} candidate passage(s) are not in the embeddings "
                         f"(first: {unknown[:3]}): the candidates come from another corpus")
    needed = sorted({row[d] for _, d in pairs})
    d_emb = embeddings_to_numpy(embeddings.table(columns=["embedding"]).take(pa.array(needed, pa.int64())))
    at = {r: i for i, r in enumerate(needed)}
    qi = {x: i for i, x in enumerate(asked)}
    a = np.asarray(q_emb, dtype=np.float32)[[qi[x] for x, _ in pairs]]
    b = d_emb[[at[row[d]] for _, d in pairs]]
    return scored_run(pairs, (a * b).sum(1), p.system)
