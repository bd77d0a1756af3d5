"""BM25 with Pyserini's Lucene, as in Pyserini's BEIR regressions (2CR).

Two index variants, built exactly as Anserini's BEIR regression configs build them:
- ``flat``: ``BeirFlatCollection`` (title + "\\n" + text in one ``contents`` field)
- ``multifield``: ``BeirMultifieldCollection`` with ``-fields title``; searched with
  ``contents=1.0 title=1.0``.
Both with ``-storePositions -storeDocvectors -storeRaw``. Search is BM25 (k1=0.9, b=0.4), top 1000,
with hits whose doc id equals the query id removed (Pyserini's ``--remove-query``, BEIR's
``ignore_identical_ids``).

The index is its own cached artifact, so changing k1/b/top_k re-searches without re-indexing.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable, Literal

import pyarrow as pa
from pydantic import Field, PositiveInt
from tqdm.auto import tqdm

from irflow.engine.java import anserini_jar, java_binary
from irflow.learn.lucene import LuceneBM25Searcher
from irflow.engine.params import Params
from irflow.engine.processes import dying_with_parent, run_in_spawned_child
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef, parquet_batches
from irflow.learn.pairs import candidate_pairs, scored_run

log = logging.getLogger("irflow.bm25")

COLLECTIONS = {"flat": "BeirFlatCollection", "multifield": "BeirMultifieldCollection"}
SEARCH_FIELDS = {"flat": {}, "multifield": {"contents": 1.0, "title": 1.0}}
Variant = Literal["flat", "multifield"]


class BM25IndexParams(Params):
    variant: Variant = Field(description="flat: title + text in one field; multifield: title as its own field "
                                         "(Anserini's BEIR regression collections)")


class BM25Weights(Params):
    k1: float = Field(0.9, ge=0, description="BM25 term-frequency saturation (Pyserini's BEIR setting)")
    b: float = Field(0.4, ge=0, le=1, description="BM25 document-length normalisation (Pyserini's BEIR setting)")


class BM25Retrieval(BM25Weights):
    depth: PositiveInt = Field(1000, description="how many passages per query the ranking holds")
    remove_query: bool = Field(True, description="drop a hit whose doc id equals the query id (Pyserini's "
                                                  "--remove-query, BEIR's ignore_identical_ids)")


class BM25SearchParams(BM25Retrieval):
    variant: Variant = Field(description="the index variant searched (multifield searches title and contents)")
    system: str = Field(min_length=1, description="system name written into the run")


def _check_index(path: Path) -> None:
    if not any(p.name.startswith("segments") for p in path.iterdir()):
        raise RuntimeError(f"{path}: not a Lucene index (no segments file)")


def write_beir_jsonl(corpus: Iterable[pa.RecordBatch], out_dir: Path) -> int:
    """The corpus batches as ``out_dir``/corpus.jsonl, BEIR's layout (what Anserini's Beir*Collection
    reads); returns how many documents it holds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "corpus.jsonl"
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for batch in corpus:
            for d, t, x in zip(*(batch.column(c).to_pylist() for c in ("doc_id", "title", "text"))):
                f.write(json.dumps({"_id": d, "title": t, "text": x}, ensure_ascii=False) + "\n")
            n += batch.num_rows
    return n


def index_command(collection_dir: Path, index_dir: Path, variant: str, threads: int, heap: str = "2g") -> list[str]:
    cmd = [str(java_binary()), f"-Xmx{heap}", "-cp", anserini_jar(), "io.anserini.index.IndexCollection",
           "-collection", COLLECTIONS[variant], "-input", str(collection_dir), "-index", str(index_dir),
           "-generator", "DefaultLuceneDocumentGenerator", "-threads", str(threads),
           "-storePositions", "-storeDocvectors", "-storeRaw"]
    if variant == "multifield":
        cmd += ["-fields", "title"]
    return cmd


@stage("bm25_index", version="2", outputs=Output("bm25_index", kind="index", check=_check_index))
def bm25_index(p: BM25IndexParams, rt: StageRuntime, *, corpus: DatasetRef) -> Path:
    """Runs Anserini's IndexCollection in a Java 21 JVM (heap: runtime.jvm_heap)."""
    collection_dir, index_dir = rt.workdir / "collection", rt.workdir / "index"
    # Batch by batch: the corpus is never in memory whole, however large (bench/scale.py)
    num_docs = write_beir_jsonl(parquet_batches(corpus.parquet, columns=["doc_id", "title", "text"]),
                                collection_dir)
    cmd = index_command(collection_dir, index_dir, p.variant, rt.threads, rt.jvm_heap)
    t0 = time.perf_counter()
    # SIGKILL when this stage's thread dies: a killed run leaves no indexer writing into tmp/
    cmd, dying = dying_with_parent(cmd, signal.SIGKILL)
    proc = subprocess.run(cmd, capture_output=True, text=True, **dying)
    if proc.returncode != 0 or not index_dir.exists():
        raise RuntimeError(f"Anserini indexing failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    log.info("bm25 %s index of %d docs in %.1fs", p.variant, num_docs, time.perf_counter() - t0)
    return index_dir


def search(index_dir: str, qids: list[str], texts: list[str], *, k1: float, b: float, top_k: int,
           fields: dict, remove_query: bool, threads: int, batch_size: int = 100, heap: str = "2g") -> dict[str, list]:
    """``_search`` in a child process (spawned: a fresh interpreter, no forked torch threads). The JVM
    that Lucene runs in cannot be stopped once started, so in this process its heap and buffers
    (0.5-1 GB after one search of the RocketQA demo) would stay for good, beside every later stage's
    models; the child returns all of it when the search ends, for a few seconds of start-up."""
    return run_in_spawned_child(_search, index_dir, qids, texts, k1=k1, b=b, top_k=top_k, fields=fields,
                                remove_query=remove_query, threads=threads, batch_size=batch_size, heap=heap)


def _search(index_dir: str, qids: list[str], texts: list[str], *, k1: float, b: float, top_k: int,
            fields: dict, remove_query: bool, threads: int, batch_size: int, heap: str) -> dict[str, list]:
    """Pyserini's batch search in chunks (for a progress bar); returns run columns.

    Chunks of 100 queries: every hit Anserini returns carries its stored document, so the JVM's live
    heap is ~queries x hits x document size. 1000 SciFact queries x 1000 hits needed 2.3 GB (stalled
    in GC under the default -Xmx2g); 100 need 0.24 GB, at the same speed (bench/README.md, Memory)."""
    searcher = LuceneBM25Searcher(index_dir, heap)
    searcher.set_bm25(k1, b)
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    # Like Pyserini's --remove-query: fetch top_k, then drop the query's own id (so <= top_k remain).
    for start in tqdm(range(0, len(qids), batch_size), desc="bm25 search", unit=" batch"):
        q_batch, t_batch = qids[start:start + batch_size], texts[start:start + batch_size]
        hits = searcher.batch_search(t_batch, q_batch, k=top_k, threads=threads, fields=fields)
        for qid in q_batch:
            rank = 0
            for h in hits.get(qid, []):
                doc_id = h.docid  # each attribute read is a call into the JVM: read it once
                if remove_query and doc_id == qid:
                    continue
                rank += 1
                cols["query_id"].append(qid)
                cols["doc_id"].append(doc_id)
                cols["rank"].append(rank)
                cols["score"].append(h.score)
    searcher.close()
    return cols


@stage("bm25_search", version="2", outputs=Output("run", "run"), shard="queries")
def bm25_search(p: BM25SearchParams, rt: StageRuntime, *, bm25_index: DatasetRef, queries: DatasetRef) -> pa.Table:
    """BM25 top ``depth`` per query from a ``bm25_index`` of ``p.variant``."""
    q = queries.table()
    cols = search(bm25_index.path, q.column("query_id").to_pylist(), q.column("text").to_pylist(),
                  k1=p.k1, b=p.b, top_k=p.depth, fields=SEARCH_FIELDS[p.variant], remove_query=p.remove_query,
                  threads=rt.threads, heap=rt.jvm_heap)
    n = len(cols["query_id"])
    return pa.table({**cols, "rank": pa.array(cols["rank"], pa.int32()), "score": pa.array(cols["score"], pa.float32()),
                     "system": [p.system] * n})


class BM25ScoreParams(BM25Weights):
    system: str = Field(min_length=1, description="system name written into the run")


def score_pairs(index_dir: str, pairs: list[tuple[str, str]], qtext: dict[str, str], *, k1: float, b: float,
                heap: str = "2g") -> list[float]:
    """BM25 of each (query id, doc id) pair, in a spawned child process (see ``search``)."""
    return run_in_spawned_child(_score_pairs, index_dir, pairs, qtext, k1=k1, b=b, heap=heap)


def _score_pairs(index_dir: str, pairs: list[tuple[str, str]], qtext: dict[str, str], *, k1: float, b: float,
                 heap: str) -> list[float]:
    """Anserini's score of a query against one document's ``contents`` field (the query analysed as a
    search analyses it): equal to the score a search gives a hit, and 0 for a passage without a query
    term -- the score a search could not return."""
    from irflow.engine.java import setup_pyserini_env

    setup_pyserini_env(heap)
    from pyserini.index.lucene import LuceneIndexReader  # first: it puts Anserini on jnius' class path
    from jnius import autoclass  # noqa: I001 -- after pyserini

    similarity = autoclass("org.apache.lucene.search.similarities.BM25Similarity")(float(k1), float(b))
    reader = LuceneIndexReader(index_dir)
    return [float(reader.compute_query_document_score(d, qtext[q], similarity))
            for q, d in tqdm(pairs, desc="bm25 score", unit=" pairs", mininterval=2)]


@stage("bm25_score", version="1", outputs=Output("run", "run"), shard="queries")
def bm25_score(p: BM25ScoreParams, rt: StageRuntime, *, bm25_index: DatasetRef, queries: DatasetRef,
               candidates: list[DatasetRef]) -> pa.Table:
    """BM25 of every (query, passage) pair of ``candidates`` (runs, negatives or qrels) whose query is in
    ``queries``, as a run ranked by it: a retriever's score for passages its own top-k missed
    (``irflow.learn.pairs``). Scores a flat index's ``contents`` field (title and text)."""
    q = queries.table()
    qids = q.column("query_id").to_pylist()
    pairs = candidate_pairs([c.table(columns=["query_id", "doc_id"]) for c in candidates], qids)
    qtext = dict(zip(qids, q.column("text").to_pylist()))
    log.info("bm25_score: %d pairs of %d queries", len(pairs), len({x for x, _ in pairs}))
    scores = score_pairs(bm25_index.path, pairs, qtext, k1=p.k1, b=p.b, heap=rt.jvm_heap) if pairs else []
    return scored_run(pairs, scores, p.system)
