"""Dense retrieval: encode the corpus once (a cached embeddings dataset), then search it with faiss.

Passages are encoded as ``title + " " + text`` and queries as their text (BEIR's convention for
sentence-transformers models). Texts are sorted by length before batching so that each batch pads
to similar lengths (what ``SentenceTransformer.encode`` does inside one call; we do it over the
whole corpus so the progress bar can count passages). ``similarity: cos`` L2-normalises both
sides; ``dot`` uses raw inner products. The index is flat inner product by default (exact);
``index: hnsw`` builds an HNSW graph (approximate, faster on big corpora).

The model comes either from the config (``model``, resolved by irflow.models) or as an input ref
of kind ``model`` (a student trained by an earlier stage).
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from irflow.models import ResolvedModel, load_sentence_transformer
from irflow.stage import Output, stage

log = logging.getLogger("irflow.dense")


def passage_texts(corpus: pa.Table) -> list[str]:
    return [(t + " " + x).strip() for t, x in zip(corpus.column("title").to_pylist(), corpus.column("text").to_pylist())]


def _model_path(cfg: dict, model) -> str:
    return model.path if model is not None else cfg["_model_path"]


def embedding_dim(st_model) -> int:
    # sentence-transformers >= 6 renamed the method; keep working with both.
    get = getattr(st_model, "get_embedding_dimension", None) or st_model.get_sentence_embedding_dimension
    return int(get())


def encode_texts(st_model, texts: list[str], batch_size: int, normalize: bool, desc: str = "encode") -> np.ndarray:
    """Length-sorted batches, a progress bar over texts, float32 output in the input order."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    dim = embedding_dim(st_model)
    out = np.zeros((len(texts), dim), dtype=np.float32)
    with tqdm(total=len(texts), desc=desc, unit=" texts", mininterval=2) as bar:
        for start in range(0, len(texts), batch_size):
            idx = order[start:start + batch_size]
            emb = st_model.encode([texts[i] for i in idx], batch_size=len(idx), convert_to_numpy=True,
                                  normalize_embeddings=normalize, show_progress_bar=False)
            out[idx] = emb
            bar.update(len(idx))
    return out


def embeddings_to_numpy(table: pa.Table) -> np.ndarray:
    col = table.column("embedding").combine_chunks()
    n = len(col)
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(n, -1)


@stage("encode_corpus", version="1", outputs=Output("embeddings", "embeddings"))
def encode_corpus(corpus, cfg: dict, model=None) -> pa.Table:
    """cfg: {model, model_key, _model_path, similarity: cos|dot, batch_size, max_seq_length, _device}."""
    st = load_sentence_transformer(ResolvedModel(cfg.get("model", ""), _model_path(cfg, model), ""),
                                   cfg.get("_device"), cfg.get("max_seq_length"))
    c = corpus.table()
    emb = encode_texts(st, passage_texts(c), int(cfg.get("batch_size", 64)), cfg.get("similarity", "cos") == "cos",
                       desc="encode corpus")
    values = pa.array(emb.ravel(), pa.float32())
    return pa.table({"doc_id": c.column("doc_id"),
                     "embedding": pa.FixedSizeListArray.from_arrays(values, emb.shape[1]).cast(pa.list_(pa.float32()))})


def build_index(doc_emb: np.ndarray, kind: str = "flat", hnsw_m: int = 32, ef_construction: int = 200):
    import faiss

    dim = doc_emb.shape[1]
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
    else:
        raise ValueError(f"dense.index: unknown index '{kind}' (flat or hnsw)")
    index.add(np.ascontiguousarray(doc_emb))
    return index


def search_index(index, query_emb: np.ndarray, top_k: int, ef_search: int | None = None):
    if ef_search is not None and hasattr(index, "hnsw"):
        index.hnsw.efSearch = max(ef_search, top_k)
    return index.search(np.ascontiguousarray(query_emb), top_k)


@stage("dense_search", version="1", outputs=Output("run", "run"))
def dense_search(embeddings, queries, cfg: dict, model=None) -> pa.Table:
    """cfg: {system, model*, similarity, batch_size, max_seq_length, index: flat|hnsw, hnsw_m, ef_search,
    top_k, remove_query, _device, _threads}."""
    import faiss

    faiss.omp_set_num_threads(int(cfg.get("_threads", 2)))
    st = load_sentence_transformer(ResolvedModel(cfg.get("model", ""), _model_path(cfg, model), ""),
                                   cfg.get("_device"), cfg.get("max_seq_length"))
    q = queries.table()
    qids = q.column("query_id").to_pylist()
    q_emb = encode_texts(st, q.column("text").to_pylist(), int(cfg.get("batch_size", 64)),
                         cfg.get("similarity", "cos") == "cos", desc="encode queries")
    e = embeddings.table()
    doc_ids = e.column("doc_id").to_pylist()
    index = build_index(embeddings_to_numpy(e), cfg.get("index", "flat"), int(cfg.get("hnsw_m", 32)))
    top_k = min(int(cfg.get("top_k", 1000)), len(doc_ids))
    scores, idx = search_index(index, q_emb, top_k, cfg.get("ef_search"))
    remove_query = bool(cfg.get("remove_query", True))
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    for qi, qid in enumerate(qids):
        rank = 0
        for s, di in zip(scores[qi], idx[qi]):
            if di < 0 or (remove_query and doc_ids[di] == qid):
                continue
            rank += 1
            cols["query_id"].append(qid)
            cols["doc_id"].append(doc_ids[di])
            cols["rank"].append(rank)
            cols["score"].append(float(s))
    n = len(cols["query_id"])
    return pa.table({**cols, "rank": pa.array(cols["rank"], pa.int32()), "score": pa.array(cols["score"], pa.float32()),
                     "system": [cfg["system"]] * n})
