"""Pseudo labels for Margin-MSE training (GPL's third step, and its offline variants), in two stages.

GPL (Wang, Thakur, Reimers, Gurevych, NAACL 2022) pairs every generated query with its source
passage (the positive) and one negative drawn from the union of the hard-negative miners' lists,
and labels the triple with a cross-encoder's margin ``CE(q, pos) - CE(q, neg)`` (raw logits). The
teacher reading every (query, positive) and (query, negative) pair is nearly all of the work, so it
is a map stage of its own and what is decided from its scores is a cheap global stage:

- ``label_scores`` (sharded by queries, ``irflow.engine.shards``): per query, its triples and the teacher's
  raw scores of their pairs (``triple_scores``, in the queries' order). Everything in a query's
  triples depends on that query alone: sampling is seeded per query (``irflow.learn.sampling``), the
  cross-encoder's score of a pair does not depend on its batch, a fusion normalises per query.
- ``pseudo_label`` (global, no teacher): the margin scale, fitted on a seeded sample of *all* the
  triples, and the ``pseudo_labels`` table, sorted by query id (within a query: positives sorted, then
  negatives in sampling order) -- from the same teacher scores, the bytes of the former single stage
  (tests/test_pseudo_label.py compares it with ``build_triples`` on whole tables). Changing
  ``scale`` or ``scale_sample`` recomputes this stage only (seconds; ``scale: auto`` encodes its
  sample with the student).

``build_triples`` is both stages on whole tables, without the store. Settings:

- ``teacher.type: cross_encoder``: any Hugging Face sequence-classification checkpoint with one
  logit (the ``teacher`` input: ``cross-encoder/ms-marco-*``, or one made by the
  ``train_cross_encoder`` stage); raw logits, as GPL uses them (``irflow.learn.scoring``).
- ``teacher.type: fusion``: a training-free hybrid of ranked runs (the ``teacher_rankings`` input, e.g.
  BM25 + the zero-shot dense model), scored by ``irflow.learn.fusion`` -- the same code as the ``fuse``
  stage. Measured offline on SciFact this is the strongest teacher available without a hub: BM25 +
  MiniLM re-ranks far better than a cross-encoder fine-tuned from MiniLM on SciFact train
  (bench/results/baselines.json, bench/results/cross_encoder_dev_scifact.json).
- ``positive: qrels`` (GPL): positives are the ``split`` qrels with score > 0 (for generated
  queries, ``split=generated`` and the doc is the source passage); ``negatives_per_positive``
  negatives per (query, positive) are sampled without replacement from the union of the miners'
  negatives, never a judged positive of the query.
- ``positive: teacher_top1`` (unlabelled real queries, e.g. a query log): the teacher ranks each
  query's candidates (the union of the teacher runs and/or the negatives lists); the positive is its
  top-1 and the negatives are sampled from teacher ranks ``rank_range`` (inclusive, 1-based).
  qrels are not read in this mode.
- ``scale`` (``pseudo_label``): teacher margins are in the teacher's units, the student's margins in
  cosine (or dot) units. ``AutoScale`` multiplies the teacher scores by the least-squares factor that
  maps teacher margins onto the student's own margins (the ``student`` input) on a sample of the
  triples; a float multiplies by it; null leaves them as they are. pos_score, neg_score and margin are
  all scaled, so ``margin == pos_score - neg_score`` always holds.

Sampling is deterministic for a seed and independent of table order (one RNG per query).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, PositiveInt, field_validator

from irflow.engine.errors import DataError
from irflow.engine.params import NoParams, Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.pairs import candidate_pairs
from irflow.learn.qrels import group, judged_positives, positives
from irflow.learn.sampling import rng, sample
from irflow.learn.scoring import least_squares_scale
from irflow.learn.teachers import (  # noqa: F401
    CrossEncoderTeacher,
    FusionTeacher,
    Teacher,
    fusion_scores,
    teacher_model,
    teacher_scores,
)
from irflow.learn.text import doc_texts, query_texts

log = logging.getLogger("irflow.pseudo_label")


# ---- params ---------------------------------------------------------------------------------------
class AutoScale(Params):
    similarity: Literal["cos", "dot"] = Field(description="the student's similarity")
    max_seq_length: PositiveInt | None = Field(None, description="the student's max tokens")


class TripleSettings(Params):
    """How a query's triples are drawn (``label_scores``)."""

    positive: Literal["qrels", "teacher_top1"] = Field(
        "qrels", description="qrels: the positives of `split` (a generated query's source passage); "
                             "teacher_top1: the teacher's best candidate (queries without labels)")
    split: str = Field("generated", min_length=1, description="positive=qrels: the qrels split of the positives")
    negatives_per_positive: PositiveInt = Field(1, description="negatives drawn per (query, positive) (GPL: 1)")
    rank_range: tuple[PositiveInt, PositiveInt] = Field(
        (3, 30), description="positive=teacher_top1: negatives come from these teacher ranks [lo, hi]")
    miners: tuple[str, ...] | None = Field(None, description="draw negatives only from these miners (null: all)")
    seed: int = Field(42, description="sampling seed (the triples' negatives, and the scale's sample)")

    @field_validator("rank_range")
    @classmethod
    def _range(cls, v):
        if not 1 < v[0] <= v[1]:
            raise ValueError(f"[lo, hi] with 1 < lo <= hi (rank 1 is the positive), got {list(v)}")
        return v


class LabelSettings(TripleSettings):
    scale_sample: PositiveInt = Field(1000, description="scale=auto: triples the scale is fitted on")


class LabelScoresParams(TripleSettings):
    """``label_scores``: the triples and who scores them."""

    teacher: Teacher = Field(description="who labels: a cross-encoder or a fusion of runs")


class PseudoLabelParams(Params):
    """``pseudo_label``: how the teacher's scores become labels (no teacher: it reads label_scores)."""

    scale: AutoScale | float | None = Field(None, description="margin scale: auto-fitted to the student, a "
                                                              "factor, or null (teacher units)")
    scale_sample: PositiveInt = Field(1000, description="scale=auto: triples the scale is fitted on")
    seed: int = Field(42, description="seed of the scale's sample of triples")


class LabelParams(LabelSettings):
    """Both stages' params: what ``build_triples`` (the labelling on whole tables) reads."""

    teacher: Teacher = Field(description="who labels: a cross-encoder or a fusion of runs")
    scale: AutoScale | float | None = Field(None, description="margin scale: auto-fitted to the student, a "
                                                              "factor, or null (teacher units)")


# ---- margin scale ---------------------------------------------------------------------------------
# (least_squares_scale: irflow.learn.scoring, shared with TAS-B's second teacher)
def student_margins(model_path: str, similarity: str, triples: Sequence[tuple[str, str, str]], *,
                    batch_size: int = 64, max_seq_length: int | None = None, device: str = "cpu") -> np.ndarray:
    """sim(q, p) - sim(q, n) under the student model, for (query text, pos text, neg text) triples."""
    from irflow.learn.encoding import load_sentence_transformer

    model = load_sentence_transformer(model_path, device, max_seq_length)
    texts = sorted({x for tr in triples for x in tr})
    emb = model.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False,
                       normalize_embeddings=(similarity == "cos")).astype(np.float64)
    pos = {t: i for i, t in enumerate(texts)}
    q = emb[[pos[t[0]] for t in triples]]
    p = emb[[pos[t[1]] for t in triples]]
    n = emb[[pos[t[2]] for t in triples]]
    return (q * p).sum(1) - (q * n).sum(1)


def margin_scale(p: PseudoLabelParams, rt: StageRuntime, triples: list[tuple[str, str, str]],
                 teacher_margins: np.ndarray, queries: pa.Table | None, corpus: pa.Table | None,
                 student_model: DatasetRef | None) -> float:
    """The factor the teacher's scores are multiplied by (see the module doc). ``triples`` in the labels'
    order (sorted query id): scale=auto samples them by index, so the order is part of the result."""
    if p.scale is None:
        return 1.0
    if not isinstance(p.scale, AutoScale):
        return float(p.scale)
    if student_model is None:
        raise ValueError("pseudo_label: scale=auto needs the student input (the model whose margins are matched)")
    idx = sorted(rng(p.seed, "scale").sample(range(len(triples)), min(len(triples), p.scale_sample)))
    picked = [triples[i] for i in idx]
    qtext = query_texts(queries, {t[0] for t in picked})
    dtext = doc_texts(corpus, {d for t in picked for d in t[1:]})
    sample_texts = [(qtext[q], dtext[pos], dtext[neg]) for q, pos, neg in picked]
    s = student_margins(student_model.path, p.scale.similarity, sample_texts,
                        max_seq_length=p.scale.max_seq_length, device=rt.device)
    return least_squares_scale(teacher_margins[idx], s)


# ---- label_scores: triples and the teacher's scores, per query -------------------------------------
def _teacher_scores(p: LabelScoresParams, rt: StageRuntime, pairs: list[tuple[str, str]], qtext, dtext, runs,
                    teacher_model: DatasetRef | None) -> dict[tuple[str, str], float]:
    uniq = sorted(set(pairs))
    scores = teacher_scores(p.teacher, uniq, qtext, dtext, runs=runs, model=teacher_model, rt=rt,
                            stage="label_scores")
    return dict(zip(uniq, (float(s) for s in scores)))


def _miners_filter(negatives: pa.Table, miners) -> pa.Table:
    if miners:
        negatives = negatives.filter(pc.is_in(negatives.column("miner"), pa.array(list(miners), pa.string())))
    return negatives


def _of_queries(t: pa.Table, qids: list[str]) -> pa.Table:
    return t.filter(pc.is_in(t.column("query_id"), pa.array(qids, pa.string())))


def score_triples(p: LabelScoresParams, rt: StageRuntime, queries: pa.Table, corpus: pa.Table,
                  qrels: pa.Table | None = None, negatives: pa.Table | None = None,
                  runs: Sequence[pa.Table] = (), teacher_model: DatasetRef | None = None) -> dict:
    """``label_scores`` without the store: {triples, pos_score, neg_score, qtext, dtext}, the triples
    (query_id, pos_doc_id, neg_doc_id) of the queries of ``queries``, in its order, with the teacher's
    unscaled scores. A query without text, negatives or candidates has no triples (and no error: a shard
    may have none; ``pseudo_label`` refuses an empty whole)."""
    runs = list(runs)
    order = queries.column("query_id").to_pylist()
    all_d = set(corpus.column("doc_id").to_pylist())

    if p.positive == "qrels":
        if qrels is None or negatives is None:
            raise ValueError("label_scores: positive=qrels needs the qrels and negatives inputs")
        pos_by_q = positives(qrels, p.split)
        if not pos_by_q:
            raise DataError(f"no positive qrels in split '{p.split}'")
        judged = judged_positives(qrels)
        asked = [q for q in order if q in pos_by_q]
        pools = group(_of_queries(_miners_filter(negatives, p.miners), asked))
        triples, skipped = [], 0
        for qid in asked:
            pool = [d for d in pools.get(qid, ()) if d not in judged[qid] and d != qid and d in all_d]
            if not pool:
                skipped += 1
                continue
            for pos in sorted(pos_by_q[qid]):
                if pos not in all_d:
                    continue
                triples += [(qid, pos, neg) for neg in sample(pool, p.negatives_per_positive, p.seed, qid, pos)]
        if skipped:
            log.warning("label_scores: %d quer(ies) without negatives skipped", skipped)
        qtext = query_texts(queries, {t[0] for t in triples})
        dtext = doc_texts(corpus, {d for t in triples for d in t[1:]})
        scores = _teacher_scores(p, rt, [(q, d) for q, pos, n in triples for d in (pos, n)], qtext, dtext, runs,
                                 teacher_model)
    else:  # teacher_top1
        if qrels is not None:
            raise ValueError("label_scores: positive=teacher_top1 reads no qrels (the queries are unlabelled); "
                             "do not pass the qrels input")
        if not runs and negatives is None:
            raise DataError("positive=teacher_top1 found no candidates (give teacher_rankings or negatives)")
        lo, hi = p.rank_range
        cand: dict[str, set[str]] = defaultdict(set)
        depth = getattr(p.teacher, "input_depth", None)
        for t in runs:
            if depth:
                t = t.filter(pc.less_equal(t.column("rank"), int(depth)))
            for q, ds in group(_of_queries(t, order)).items():
                cand[q] |= ds
        if negatives is not None:
            for q, ds in group(_of_queries(_miners_filter(negatives, p.miners), order)).items():
                cand[q] |= ds
        cand = {q: {d for d in cand[q] if d in all_d and d != q} for q in order if q in cand}
        qtext = query_texts(queries, set(cand))
        dtext = doc_texts(corpus, {d for ds in cand.values() for d in ds})
        scores = _teacher_scores(p, rt, [(q, d) for q, ds in cand.items() for d in ds], qtext, dtext, runs,
                                 teacher_model)
        triples, skipped = [], 0
        for qid in cand:
            ranked = sorted(cand[qid], key=lambda d: (-scores[(qid, d)], d))
            pool = ranked[lo - 1:hi]
            if not pool:
                skipped += 1
                continue
            triples += [(qid, ranked[0], neg) for neg in sample(pool, p.negatives_per_positive, p.seed, qid)]
        if skipped:
            log.warning("label_scores: %d quer(ies) with fewer than %d candidates skipped", skipped, lo)

    pos_score = np.array([scores[(q, pos)] for q, pos, _ in triples], dtype=np.float64)
    neg_score = np.array([scores[(q, n)] for q, _, n in triples], dtype=np.float64)
    log.info("label_scores: %d triples over %d queries; teacher %s", len(triples), len({t[0] for t in triples}),
             p.teacher.type)
    return {"triples": triples, "pos_score": pos_score, "neg_score": neg_score, "qtext": qtext, "dtext": dtext}


def scores_table(triples, pos_score: np.ndarray, neg_score: np.ndarray) -> pa.Table:
    """A ``triple_scores`` table: the teacher's raw scores, float64."""
    return pa.table({
        "query_id": pa.array([t[0] for t in triples], pa.string()),
        "pos_doc_id": pa.array([t[1] for t in triples], pa.string()),
        "neg_doc_id": pa.array([t[2] for t in triples], pa.string()),
        "pos_score": pa.array(np.asarray(pos_score, dtype=np.float64), pa.float64()),
        "neg_score": pa.array(np.asarray(neg_score, dtype=np.float64), pa.float64()),
    })


# ---- pseudo_label: scale, labels ------------------------------------------------------------------
def by_query(scores: pa.Table) -> tuple[list[tuple[str, str, str]], np.ndarray, np.ndarray]:
    """(triples, pos_score, neg_score) of a ``triple_scores`` table in the labels' order: a stable sort
    by query id keeps each query's rows as they were built (positives sorted, negatives as sampled)."""
    scores = scores.take(pc.sort_indices(scores, sort_keys=[("query_id", "ascending")]))
    triples = list(zip(*(scores.column(c).to_pylist() for c in ("query_id", "pos_doc_id", "neg_doc_id"))))
    return (triples, scores.column("pos_score").to_numpy().astype(np.float64),
            scores.column("neg_score").to_numpy().astype(np.float64))


def to_table(triples, pos_score: np.ndarray, neg_score: np.ndarray, scale: float) -> pa.Table:
    pos32 = (pos_score * scale).astype(np.float32)
    neg32 = (neg_score * scale).astype(np.float32)
    return pa.table({
        "query_id": [t[0] for t in triples], "pos_doc_id": [t[1] for t in triples],
        "neg_doc_id": [t[2] for t in triples], "pos_score": pos32, "neg_score": neg32,
        "margin": pos32 - neg32,
    })


def label(p: PseudoLabelParams, rt: StageRuntime, scores: pa.Table, queries: pa.Table | None = None,
          corpus: pa.Table | None = None, student_model: DatasetRef | None = None) -> dict:
    """``pseudo_label`` without the store: {triples, pos_score, neg_score, scale} (scores unscaled), from
    a ``triple_scores`` table in any order. ``queries`` and ``corpus`` are read for scale=auto only."""
    triples, pos_score, neg_score = by_query(scores)
    if not triples:
        raise DataError("no training triples could be built (no query has a positive, text and a negative or "
                        "enough candidates)")
    scale = margin_scale(p, rt, triples, pos_score - neg_score, queries, corpus, student_model)
    log.info("pseudo_label: %d triples over %d queries; margin scale %.4g", len(triples),
             len({t[0] for t in triples}), scale)
    return {"triples": triples, "pos_score": pos_score, "neg_score": neg_score, "scale": scale}


def build_triples(p: LabelParams, rt: StageRuntime, queries: pa.Table, corpus: pa.Table,
                  qrels: pa.Table | None = None, negatives: pa.Table | None = None,
                  runs: Sequence[pa.Table] = (), teacher_model: DatasetRef | None = None,
                  student_model: DatasetRef | None = None) -> dict:
    """Both stages on whole tables, without the store: {triples, pos_score, neg_score, scale}.

    triples are (query_id, pos_doc_id, neg_doc_id) in the labels' order; scores are unscaled teacher
    scores. ``to_table`` of them is the ``pseudo_labels`` dataset.
    """
    scored = score_triples(p.to(LabelScoresParams), rt, queries, corpus, qrels=qrels, negatives=negatives,
                           runs=runs, teacher_model=teacher_model)
    return label(p.to(PseudoLabelParams), rt, scores_table(scored["triples"], scored["pos_score"],
                                                           scored["neg_score"]),
                 queries, corpus, student_model)


@stage("label_scores", version="1", outputs=Output("out", "triple_scores"), work="score", shard="queries",
       onnx=teacher_model)
def label_scores(p: LabelScoresParams, rt: StageRuntime, *, queries: DatasetRef, corpus: DatasetRef,
                 qrels: DatasetRef | None = None, negatives: DatasetRef | None = None,
                 teacher_rankings: list[DatasetRef] | None = None, teacher: DatasetRef | None = None) -> pa.Table:
    """(query, positive, negative) triples of ``queries`` with the teacher's raw scores, in their order.

    Inputs: queries, corpus; qrels (positive=qrels); negatives; teacher_rankings (fusion teacher: the runs
    it fuses); teacher (cross-encoder teacher: the model).
    """
    out = score_triples(p, rt, queries.table(), corpus.table(), qrels=qrels.table() if qrels is not None else None,
                        negatives=negatives.table() if negatives is not None else None,
                        runs=[r.table() for r in teacher_rankings or []], teacher_model=teacher)
    return scores_table(out["triples"], out["pos_score"], out["neg_score"])


@stage("pseudo_label", version="4", outputs=Output("pseudo_labels", "pseudo_labels"), work="score")
def pseudo_label(p: PseudoLabelParams, rt: StageRuntime, *, scores: DatasetRef, queries: DatasetRef,
                 corpus: DatasetRef, student: DatasetRef | None = None) -> pa.Table:
    """(query, positive, negative, teacher scores, margin) triples, sorted by query id, scaled.

    Inputs: scores (label_scores); queries, corpus (read for scale=auto: the sample's texts); student
    (scale=auto: the student model). Work "score": scale=auto encodes its sample with the student.
    """
    auto = isinstance(p.scale, AutoScale)
    out = label(p, rt, scores.table(), queries.table() if auto else None, corpus.table() if auto else None,
                student_model=student)
    return to_table(out["triples"], out["pos_score"], out["neg_score"], out["scale"])


@stage("label_positives", version="1", outputs=Output("qrels", "qrels"))
def label_positives(p: NoParams, rt: StageRuntime, *, pseudo_labels: DatasetRef) -> pa.Table:
    """The (query, positive) pairs the teacher labelled, as qrels (split="generated").

    For the QGen baseline (MNRL with in-batch negatives) on queries that came without a source
    passage -- real unlabelled queries, whose positive is the teacher's top-1.
    """
    t = pseudo_labels.table(columns=["query_id", "pos_doc_id"])
    pairs = sorted(set(zip(t.column("query_id").to_pylist(), t.column("pos_doc_id").to_pylist())))
    return pa.table({"query_id": [q for q, _ in pairs], "doc_id": [d for _, d in pairs],
                     "score": pa.array([1] * len(pairs), pa.int32()), "split": ["generated"] * len(pairs)})


# ---- judge_queries: a held-out part of a query log, judged by the teacher --------------------------
class JudgeParams(Params):
    """``judge_queries``: which of a query's candidates the teacher's judgement calls relevant."""

    relevant: PositiveInt = Field(1, description="the teacher's best this many candidates of each query are "
                                                 "judged relevant (1: its top 1, the passage GPL would train on)")
    teacher: Teacher = Field(description="who judges: the run's teacher (a cross-encoder or a fusion of runs)")


def judgements(p: JudgeParams, rt: StageRuntime | None, queries: pa.Table, corpus: pa.Table,
               candidates: Sequence[pa.Table], runs: Sequence[pa.Table] = (),
               teacher_model: DatasetRef | None = None) -> pa.Table:
    """``judge_queries`` without the store: qrels (split ``generated``) of the teacher's best ``p.relevant``
    candidates per query, candidates being every (query, passage) any of ``candidates`` returned."""
    pairs = candidate_pairs(candidates, queries.column("query_id").to_pylist())
    if not pairs:
        raise DataError("judge_queries: the miners returned no candidate for any held-out query")
    qtext = query_texts(queries, {q for q, _ in pairs})
    dtext = doc_texts(corpus, {d for _, d in pairs})
    scores = teacher_scores(p.teacher, pairs, qtext, dtext, runs=list(runs), model=teacher_model, rt=rt,
                            stage="judge_queries")
    by_query: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for (q, d), s in zip(pairs, scores):
        by_query[q].append((-float(s), d))  # best first; ties by doc id
    judged = [(q, d) for q in sorted(by_query) for _, d in sorted(by_query[q])[:p.relevant]]
    return pa.table({"query_id": pa.array([q for q, _ in judged], pa.string()),
                     "doc_id": pa.array([d for _, d in judged], pa.string()),
                     "score": pa.array([1] * len(judged), pa.int32()),
                     "split": pa.array(["generated"] * len(judged), pa.string())})


@stage("judge_queries", version="1", outputs=Output("qrels", "qrels"), work="score", onnx=teacher_model)
def judge_queries(p: JudgeParams, rt: StageRuntime, *, queries: DatasetRef, corpus: DatasetRef,
                  candidates: list[DatasetRef], teacher_rankings: list[DatasetRef] | None = None,
                  teacher: DatasetRef | None = None) -> pa.Table:
    """Judgements of queries nobody trains on (a held-out part of a query log) by the run's teacher: each
    query's candidates (the miners' rankings, ``candidates``) scored by the teacher, its best
    ``relevant`` judged relevant. A synthetic evaluation on real queries, its judge the teacher: it ranks
    models by how well they find what the teacher would pick.

    Inputs: queries, corpus; candidates (runs); teacher_rankings (fusion teacher: the runs it fuses);
    teacher (cross-encoder teacher: the model)."""
    return judgements(p, rt, queries.table(), corpus.table(), [c.table(columns=["query_id", "doc_id"])
                                                               for c in candidates],
                      [r.table() for r in teacher_rankings or []], teacher)
