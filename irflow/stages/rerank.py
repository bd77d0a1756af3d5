"""Re-rank a run's top ``depth`` with a cross-encoder: the teacher evaluated as a system.

Users of GPL and RocketQA ask to see how good a teacher is before trusting its labels (gpl #35): a
cross-encoder re-ranking the first stage's top 100 on the test queries is that number. The output is
a run (ranks 1..depth by the cross-encoder's score); passages below ``depth`` are not kept, so
R@depth equals the first stage's. The cross-encoder runs with torch or ONNX Runtime
(``runtime.backend``), or as an int8 ONNX model (``quantization``, keyed; ``irflow.learn.onnx_inference``).
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, PositiveInt

from irflow.engine.params import QUANTIZATION_DOC, Params, Quantization
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.scoring import cross_encoder_scores
from irflow.learn.text import doc_texts, query_texts

log = logging.getLogger("irflow.rerank")


class RerankSettings(Params):
    depth: PositiveInt = Field(100, description="re-rank the first stage's top n per query")
    batch_size: PositiveInt = Field(32, description="pairs per scoring batch")
    max_length: PositiveInt = Field(256, description="tokens of (query, passage) the cross-encoder reads")
    quantization: Quantization = Field("none", description=QUANTIZATION_DOC)


class RerankParams(RerankSettings):
    system: str = Field(min_length=1, description="system name written into the run")


def rerank_table(run: pa.Table, scores: np.ndarray, system: str, query_order: list[str]) -> pa.Table:
    """The rows of ``run`` re-ordered per query by ``scores`` (ties: the first stage's order), queries
    in ``query_order`` (the asked queries' order: shards of them concatenate to the whole)."""
    qids = run.column("query_id").to_pylist()
    dids = run.column("doc_id").to_pylist()
    ranks = run.column("rank").to_pylist()
    by_q: dict[str, list[tuple[float, int, str]]] = {}
    for q, d, r, s in zip(qids, dids, ranks, scores):
        by_q.setdefault(q, []).append((-float(s), r, d))
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    for q in (q for q in query_order if q in by_q):
        for k, (neg, _, d) in enumerate(sorted(by_q[q]), 1):
            cols["query_id"].append(q), cols["doc_id"].append(d), cols["rank"].append(k), cols["score"].append(-neg)
    n = len(cols["query_id"])
    return pa.table({**cols, "rank": pa.array(cols["rank"], pa.int32()), "score": pa.array(cols["score"], pa.float32()),
                     "system": [system] * n})


@stage("rerank", version="3", outputs=Output("run", "run"), work="score", shard="queries",
       onnx=lambda p: {"model": ("score", p.quantization)})
def rerank(p: RerankParams, rt: StageRuntime, *, ranking: DatasetRef, queries: DatasetRef, corpus: DatasetRef,
           model: DatasetRef) -> pa.Table:
    """``ranking``'s top ``depth`` per query of ``queries``, re-ordered by the cross-encoder ``model``."""
    r = ranking.table()
    asked = queries.table(columns=["query_id"]).column("query_id")
    r = r.filter(pc.and_(pc.less_equal(r.column("rank"), p.depth), pc.is_in(r.column("query_id"), asked)))
    qids, dids = r.column("query_id").to_pylist(), r.column("doc_id").to_pylist()
    qtext = query_texts(queries.table(), set(qids))
    dtext = doc_texts(corpus.table(), set(dids))
    log.info("rerank: %d pairs (%d queries x top %d)", len(qids), len(qtext), p.depth)
    scores = cross_encoder_scores(model.path, [(qtext[q], dtext[d]) for q, d in zip(qids, dids)],
                                  batch_size=p.batch_size, max_length=p.max_length, device=rt.device,
                                  autocast=rt.autocast, onnx=rt.onnx_model(model), threads=rt.threads)
    return rerank_table(r, scores, p.system, asked.to_pylist())
