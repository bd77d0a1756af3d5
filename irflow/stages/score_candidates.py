"""A teacher's scores of a retriever's top candidates: what ``denoise`` thresholds for the labelled
queries (RocketQA, Qu et al., NAACL 2021, section 4.2), and ``augment`` for unlabelled ones (4.3).

- labelled (``split`` names a qrels split; the ``qrels`` input): per query with positives in
  ``split``, the retriever's top ``depth`` passages, plus the query's judged positives (rank 0 where
  the run does not have them: they calibrate a Platt fit and anchor listwise distillation), each with
  the teacher's raw score and whether it is a judged positive;
- unlabelled (``split: null``, no qrels): per query of ``queries``, the retriever's top ``depth``
  passages with the teacher's raw score (``positive`` is false: nothing is judged).

Scoring is its own stage (sharded by queries) so that what is decided *from* the scores (thresholds,
quotas, the fill, augmentation's top-1) recomputes without re-scoring: a cross-encoder reading 40k
pairs is nearly all of denoising's time (528 s of 530 s on SciFact), a threshold change then costs
seconds.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt

from irflow.engine.errors import DataError
from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.qrels import judged_positives, positives
from irflow.learn.teachers import Teacher, teacher_model, teacher_scores
from irflow.learn.text import doc_texts, query_texts

log = logging.getLogger("irflow.score_candidates")


class ScoreCandidatesSettings(Params):
    depth: PositiveInt = Field(50, description="the teacher reads the retriever's top n per query (RocketQA: 50)")
    split: str = Field("train", min_length=1, description="the qrels split whose queries and positives are scored")


class ScoreCandidatesParams(ScoreCandidatesSettings):
    split: str | None = Field("train", min_length=1, description="the qrels split whose queries and positives are "
                                                                 "scored (null: every query of the queries input, "
                                                                 "unlabelled: no qrels read)")
    teacher: Teacher = Field(description="who reads the candidates: a cross-encoder or a fusion of runs")


def candidate_pairs(run: pa.Table, pos_by_q: dict[str, set[str]], depth: int) -> tuple[list, dict]:
    """(query, doc, rank) to score: each query's top ``depth`` and its judged positives (their rank in
    the run, 0 if the run does not have them), queries in ``pos_by_q``'s order; and query -> {doc: rank}
    of its whole list."""
    ranks: dict[str, dict[str, int]] = defaultdict(dict)
    for q, d, r in zip(*(run.column(c).to_pylist() for c in ("query_id", "doc_id", "rank"))):
        if q in pos_by_q:
            ranks[q][d] = r
    out = []
    for q in pos_by_q:
        top = {d: r for d, r in ranks.get(q, {}).items() if r <= depth}
        for d in pos_by_q[q]:
            top.setdefault(d, ranks.get(q, {}).get(d, 0))
        out += [(q, d, r) for d, r in sorted(top.items(), key=lambda x: (x[1] == 0, x[1], x[0]))]
    return out, ranks


@stage("score_candidates", version="3", outputs=Output("out", "candidate_scores"), work="score", shard="queries",
       onnx=teacher_model)
def score_candidates(p: ScoreCandidatesParams, rt: StageRuntime, *, ranking: DatasetRef, queries: DatasetRef,
                     corpus: DatasetRef, qrels: DatasetRef | None = None, teacher: DatasetRef | None = None,
                     teacher_rankings: list[DatasetRef] | None = None) -> pa.Table:
    """Raw teacher scores of ``ranking``'s top ``depth`` (and the judged positives) for the queries with
    positives in ``split`` (or, split null, for every query of ``queries``); the teacher is a cross-encoder
    (``teacher``) or a fusion of ``teacher_rankings``."""
    if p.split is not None and qrels is None:
        raise ValueError(f"score_candidates: split '{p.split}' needs the qrels input (split null: unlabelled queries)")
    if p.split is None and qrels is not None:
        raise ValueError("score_candidates: split null (unlabelled queries) reads no qrels; do not pass the qrels input")
    queries_t = queries.table()
    order = queries_t.column("query_id").to_pylist()
    if qrels is None:
        qrels_t, pos_by_q = None, {q: set() for q in order}
    else:
        qrels_t = qrels.table()
        pos_all = positives(qrels_t, p.split)
        if not pos_all:
            raise DataError(f"score_candidates: no positive qrels in split '{p.split}'")
        # In the queries' order (a shard's queries give the rows of the whole in the same order).
        pos_by_q = {q: pos_all[q] for q in order if q in pos_all}
    triples, ranks = candidate_pairs(ranking.table(columns=["query_id", "doc_id", "rank"]), pos_by_q, p.depth)
    if pos_by_q and not ranks:
        raise DataError("score_candidates: the run has no list for any query " +
                        (f"of split '{p.split}'" if p.split else "of the (unlabelled) queries"))
    triples = [t for t in triples if t[0] in ranks]
    corpus_t = corpus.table()
    qtext = query_texts(queries_t, {t[0] for t in triples})
    known = set(corpus_t.column("doc_id").to_pylist())
    triples = [t for t in triples if t[0] in qtext and t[1] in known]
    dtext = doc_texts(corpus_t, {t[1] for t in triples})
    pairs = [(q, d) for q, d, _ in triples]
    log.info("score_candidates: the %s teacher scores %d pairs (%d queries, top %d%s)", p.teacher.type, len(pairs),
             len({q for q, _ in pairs}), p.depth, " + judged positives" if qrels_t is not None else "")
    raw = teacher_scores(p.teacher, pairs, qtext, dtext, runs=[t.table() for t in teacher_rankings or []],
                         model=teacher, rt=rt, stage="score_candidates")
    judged = judged_positives(qrels_t) if qrels_t is not None else {}
    return pa.table({"query_id": [t[0] for t in triples], "doc_id": [t[1] for t in triples],
                     "rank": pa.array([t[2] for t in triples], pa.int32()),
                     "score": pa.array(np.asarray(raw, dtype=np.float32), pa.float32()),
                     "positive": [t[1] in judged.get(t[0], ()) for t in triples]})
