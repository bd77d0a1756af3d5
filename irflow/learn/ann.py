"""Inner-product indexes for dense search, filled batch by batch: flat, HNSW, IVF-Flat, IVF-PQ.

``build`` never needs the whole embedding matrix in memory: it takes a callable that yields the
corpus's embedding batches (float32, in corpus order) and iterates it once, or twice for the IVF
kinds (a first pass draws the training sample, a second fills the index). Row ``i`` of the corpus
is id ``i`` in every index. Every index uses inner product, so ``cos`` (normalised) and ``dot``
embeddings are searched alike.

- ``flat``: exact; N x dim x 4 bytes in RAM.
- ``hnsw``: a graph over the full vectors; more RAM than flat (vectors + ~2 x hnsw_m links each).
- ``ivf_flat``: k-means cells (``nlist``); a query scans the ``nprobe`` nearest cells. Full vectors in
  RAM, like flat; with ``nprobe = nlist`` it is exact.
- ``ivf_pq``: cells as above, each vector stored as a product-quantised code of ``pq_m`` bytes. Codes
  give approximate scores, so a search takes a shortlist of ``rerank_depth`` candidates and re-ranks
  it exactly against the original vectors, which ``build`` writes to a float32 memmap file (on disk,
  paged in only for the shortlisted rows): the returned scores are exact inner products.

Sizing. flat at 8.8M x 384 (MS MARCO passages, MiniLM) is 8.8M x 384 x 4 B = 13.6 GB of RAM; IVF-PQ
with ``pq_m`` = 48 stores 48 B per vector plus an 8 B id, about 0.5 GB (the re-ranking vectors stay
on disk). faiss's guideline for 1M-10M vectors is IVF65536_HNSW32 (65536 cells, the centroids
searched with HNSW) trained on 30-256 x nlist vectors; k-means warns below 39 training vectors per
cell, so an automatic ``nlist`` is about 4 x sqrt(N), lowered until the training sample holds 39 x
nlist. PQ's own k-means (256 centroids per sub-quantizer) needs at least 256 training vectors.

Results are deterministic for a given corpus order: the training sample is chosen by seeded random
keys (independent of how the corpus is split into batches), and faiss's k-means is seeded.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

KINDS = ("flat", "hnsw", "ivf_flat", "ivf_pq")
IVF_KINDS = ("ivf_flat", "ivf_pq")
DEFAULT_TRAIN_SIZE = 100_000
MIN_POINTS_PER_CELL = 39  # below this faiss's k-means warns that the clustering is poor
PQ_CENTROIDS = 256  # 8-bit codes: one byte per sub-quantizer

#: A callable that yields the corpus's embedding batches, in corpus order, each time it is called.
Batches = Callable[[], Iterable[np.ndarray]]


class AnnParamError(ValueError):
    """A parameter that does not fit the data (known only once the embeddings are seen)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass
class AnnIndex:
    """A built index and what searching it needs besides faiss."""

    kind: str
    index: object  # a faiss.Index
    vectors: np.memmap | None = None  # ivf_pq: the original vectors, for exact re-ranking

    @property
    def ntotal(self) -> int:
        return self.index.ntotal


def auto_nlist(num_vectors: int, train_vectors: int) -> int:
    """About 4 x sqrt(N) cells, at most one per ``MIN_POINTS_PER_CELL`` training vectors, at least 1."""
    return max(1, min(round(4 * math.sqrt(num_vectors)), train_vectors // MIN_POINTS_PER_CELL))


def auto_pq_m(dim: int) -> int:
    """The largest divisor of ``dim`` up to dim / 8 (8 dimensions per byte of code: 48 for 384)."""
    return max(m for m in range(1, max(1, dim // 8) + 1) if dim % m == 0)


def training_sample(batches: Iterable[np.ndarray], size: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """A uniform sample of at most ``size`` vectors, in corpus order, and the number of vectors seen.

    Each vector gets a seeded random key and the ``size`` smallest keys are kept (bottom-k sampling:
    one pass, at most about 2 x ``size`` vectors held). The keys are drawn in corpus order from one
    generator, so the sample depends on the corpus and the seed, not on the batch sizes.
    """
    rng = np.random.default_rng(seed)
    keys: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    kept: list[np.ndarray] = []
    held = seen = 0

    def smallest_keys() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k, r, v = np.concatenate(keys), np.concatenate(rows), np.concatenate(kept)
        if len(k) > size:
            best = np.argpartition(k, size - 1)[:size]
            k, r, v = k[best], r[best], v[best]
        return k, r, v

    for batch in batches:
        batch = np.asarray(batch, dtype=np.float32)
        keys.append(rng.random(len(batch)))
        rows.append(np.arange(seen, seen + len(batch)))
        kept.append(batch)
        seen += len(batch)
        held += len(batch)
        if held >= 2 * size:  # compact now and then, not per batch: each vector is copied O(1) times
            k, r, v = smallest_keys()
            keys, rows, kept, held = [k], [r], [v], len(k)
    if not seen:
        raise ValueError("no embeddings to index")
    _, r, v = smallest_keys()
    return np.ascontiguousarray(v[np.argsort(r)]), seen


def build(batches: Batches, kind: str = "flat", *, nlist: int | None = None, pq_m: int | None = None,
          train_size: int = DEFAULT_TRAIN_SIZE, hnsw_m: int = 32, ef_construction: int = 200, seed: int = 0,
          threads: int | None = None, work_dir: str | Path | None = None) -> AnnIndex:
    """An index of every vector ``batches()`` yields (ids = corpus rows).

    ``nlist`` (IVF cells; None: ``auto_nlist``), ``pq_m`` (ivf_pq sub-quantizers, dividing dim;
    None: ``auto_pq_m``) and ``train_size`` (the k-means sample) matter for the IVF kinds only.
    ``work_dir``: where ivf_pq writes its re-ranking vectors (an unnamed file, gone once the index
    is; None: the system's temp dir). ``threads``: faiss's OpenMP threads (None: as set).
    """
    import faiss

    if kind not in KINDS:
        raise ValueError(f"index kind {kind!r} is not one of {KINDS}")
    if threads is not None:
        faiss.omp_set_num_threads(threads)
    if kind in ("flat", "hnsw"):
        index = None
        for batch in batches():
            batch = np.ascontiguousarray(batch, dtype=np.float32)
            if index is None:
                index = _graph_or_flat(kind, batch.shape[1], hnsw_m, ef_construction)
            index.add(batch)
        if index is None:
            raise ValueError("no embeddings to index")
        return AnnIndex(kind, index)

    sample, num_vectors = training_sample(batches(), train_size, seed)
    dim = sample.shape[1]
    nlist = nlist or auto_nlist(num_vectors, len(sample))
    if nlist > len(sample):
        raise AnnParamError("nlist", f"{nlist} cells need at least {nlist} training vectors, got {len(sample)} "
                                     f"(corpus {num_vectors}, train_size {train_size}); lower it or leave it null")
    quantizer = faiss.IndexFlatIP(dim)
    if kind == "ivf_flat":
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    else:
        pq_m = pq_m or auto_pq_m(dim)
        if dim % pq_m:
            raise AnnParamError("pq_m", f"{pq_m} does not divide the embedding dimension {dim}")
        if len(sample) < PQ_CENTROIDS:
            raise AnnParamError("index", f"ivf_pq needs at least {PQ_CENTROIDS} training vectors, got "
                                         f"{len(sample)}; use flat for a corpus this small")
        index = faiss.IndexIVFPQ(quantizer, dim, nlist, pq_m, 8, faiss.METRIC_INNER_PRODUCT)
        index.pq.cp.seed = seed
    index.cp.seed = seed
    index.train(sample)
    del sample

    vectors = None
    if kind == "ivf_pq":
        # An unnamed temp file: the OS reclaims it once the memmap (and with it the index) is gone.
        vectors = np.memmap(tempfile.TemporaryFile(dir=work_dir), np.float32, "w+", shape=(num_vectors, dim))
    filled = 0
    for batch in batches():
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        if vectors is not None:
            vectors[filled:filled + len(batch)] = batch
        index.add(batch)
        filled += len(batch)
    if filled != num_vectors:
        raise ValueError(f"the second pass over the batches yielded {filled} vectors, the first {num_vectors}")
    if vectors is not None:
        vectors.flush()
    return AnnIndex(kind, index, vectors)


def _graph_or_flat(kind: str, dim: int, hnsw_m: int, ef_construction: int):
    import faiss

    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    return index


def search(ann: AnnIndex, queries: np.ndarray, top_k: int, *, nprobe: int = 32, ef_search: int | None = None,
           rerank_depth: int | None = None, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids), each (num queries, top_k), best first; id -1 (score -FLT_MAX) where fewer hits exist.

    ``nprobe``: IVF cells scanned per query (capped at nlist). ``ef_search``: HNSW search breadth
    (at least top_k; None: faiss's default). ``rerank_depth``: ivf_pq's shortlist re-ranked exactly
    (None: 4 x top_k; at least top_k).
    """
    import faiss

    if threads is not None:
        faiss.omp_set_num_threads(threads)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if ann.kind == "hnsw" and ef_search is not None:
        ann.index.hnsw.efSearch = max(ef_search, top_k)
    if ann.kind in IVF_KINDS:
        ann.index.nprobe = min(nprobe, ann.index.nlist)
    if ann.kind != "ivf_pq":
        return ann.index.search(queries, top_k)
    shortlist_k = min(max(rerank_depth or 4 * top_k, top_k), ann.ntotal)
    _, shortlist = ann.index.search(queries, shortlist_k)
    return rerank(ann.vectors, queries, shortlist, top_k)


def rerank(vectors: np.ndarray, queries: np.ndarray, shortlist: np.ndarray, top_k: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """The ``top_k`` of each query's shortlisted ids (-1: none) by exact inner product with ``vectors``
    (an array or a memmap; only shortlisted rows are read), ties in row order."""
    scores = np.full((len(queries), top_k), np.finfo(np.float32).min, dtype=np.float32)
    ids = np.full((len(queries), top_k), -1, dtype=np.int64)
    # One query at a time: its rows stay in cache, and batching queries measured slower (a large
    # gathered array is page-faulted in anew for every batch).
    for q, (query, candidates) in enumerate(zip(queries, shortlist)):
        rows = np.sort(candidates[candidates >= 0])  # ascending: sequential reads from the memmap file
        exact = np.take(vectors, rows, axis=0) @ query
        best = np.argsort(-exact, kind="stable")[:top_k]
        scores[q, :len(best)] = exact[best]
        ids[q, :len(best)] = rows[best]
    return scores, ids
