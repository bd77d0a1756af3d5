"""Dense retrieval: encode the corpus once (a cached embeddings dataset), then search it with faiss.

Passages are encoded as BEIR's ``title + " " + text`` (``irflow.text.passage_text``) and queries as
their text. ``similarity: cos`` L2-normalises both sides; ``dot`` uses raw inner products. The index
is flat inner product by default (exact); ``index: hnsw`` builds an HNSW graph (approximate, faster
on big corpora).

The model is an input ref: a model named in the config (``Run.model``) or one trained by an earlier
stage -- the same code path either way. Encoding runs on the runtime's ``encode`` device.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt

from irflow.encoding import encode_texts
from irflow.models import load_sentence_transformer
from irflow.params import Params
from irflow.runtime import StageRuntime
from irflow.shards import per_worker
from irflow.stage import Output, stage
from irflow.store import DatasetRef
from irflow.text import passage_texts

log = logging.getLogger("irflow.dense")

Similarity = Literal["cos", "dot"]


class EncodeParams(Params):
    similarity: Similarity = Field("cos", description="cos: L2-normalised embeddings; dot: raw inner products")
    batch_size: PositiveInt = Field(64, description="texts per encoding batch")
    max_seq_length: PositiveInt | None = Field(None, description="truncate texts to this many tokens (null: the "
                                                                 "model's own limit, 256 for MiniLM)")


class DenseRetrieval(EncodeParams):
    index: Literal["flat", "hnsw"] = Field("flat", description="flat: exact inner-product search; hnsw: an HNSW "
                                                               "graph (approximate, faster on big corpora)")
    hnsw_m: PositiveInt = Field(32, description="HNSW: neighbours per node")
    ef_search: PositiveInt | None = Field(None, description="HNSW: search breadth (null: faiss's default; at "
                                                            "least `depth`)")
    depth: PositiveInt = Field(1000, description="how many passages per query the ranking holds")
    remove_query: bool = Field(True, description="drop a hit whose doc id equals the query id (BEIR's "
                                                 "ignore_identical_ids)")


class DenseSearchParams(DenseRetrieval):
    system: str = Field(min_length=1, description="system name written into the run")


def embeddings_to_numpy(table: pa.Table) -> np.ndarray:
    col = table.column("embedding").combine_chunks()
    n = len(col)
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(n, -1)


@stage("encode_corpus", version="3", outputs=Output("embeddings", "embeddings"), work="encode", shard="corpus")
def encode_corpus(p: EncodeParams, rt: StageRuntime, *, corpus: DatasetRef, model: DatasetRef) -> pa.Table:
    """One embedding per passage of ``corpus`` with ``model``, in corpus order."""
    st = load_sentence_transformer(model.path, rt.device, p.max_seq_length)
    c = corpus.table()
    emb = encode_texts(st, passage_texts(c), p.batch_size, p.similarity == "cos", desc="encode corpus",
                       autocast=rt.autocast)
    values = pa.array(emb.ravel(), pa.float32())
    return pa.table({"doc_id": c.column("doc_id"),
                     "embedding": pa.FixedSizeListArray.from_arrays(values, emb.shape[1]).cast(pa.list_(pa.float32()))})


def build_index(doc_emb: np.ndarray, kind: str = "flat", hnsw_m: int = 32, ef_construction: int = 200):
    import faiss

    dim = doc_emb.shape[1]
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    else:
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
    index.add(np.ascontiguousarray(doc_emb))
    return index


def search_index(index, query_emb: np.ndarray, top_k: int, ef_search: int | None = None):
    if ef_search is not None and hasattr(index, "hnsw"):
        index.hnsw.efSearch = max(ef_search, top_k)
    return index.search(np.ascontiguousarray(query_emb), top_k)


def _index(embeddings: DatasetRef, kind: str, hnsw_m: int):
    e = embeddings.table()
    return e.column("doc_id").to_pylist(), build_index(embeddings_to_numpy(e), kind, hnsw_m)


@stage("dense_search", version="3", outputs=Output("run", "run"), work="encode", shard="queries")
def dense_search(p: DenseSearchParams, rt: StageRuntime, *, embeddings: DatasetRef, queries: DatasetRef,
                 model: DatasetRef) -> pa.Table:
    """Top ``depth`` passages per query: queries encoded with ``model``, searched in ``embeddings``."""
    import faiss

    faiss.omp_set_num_threads(rt.threads)
    st = load_sentence_transformer(model.path, rt.device, p.max_seq_length)
    q = queries.table()
    qids = q.column("query_id").to_pylist()
    q_emb = encode_texts(st, q.column("text").to_pylist(), p.batch_size, p.similarity == "cos",
                         desc="encode queries", autocast=rt.autocast)
    # Built once per worker process (and once per stage in this one): every query shard searches it.
    doc_ids, index = per_worker(("dense_index", embeddings.id, p.index, p.hnsw_m),
                                lambda: _index(embeddings, p.index, p.hnsw_m))
    top_k = min(p.depth, len(doc_ids))
    scores, idx = search_index(index, q_emb, top_k, p.ef_search)
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
