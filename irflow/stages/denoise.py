"""Denoised hard negatives (RocketQA, Qu et al., NAACL 2021, section 4.2; ``construct_marco_train_de.py``).

A retriever's top passages for a labelled query are the hardest negatives, and also where the
unlabelled positives are (RocketQA found ~70% of MS MARCO's top-retrieved "negatives" relevant):
training on them as negatives hurt (MRR@10 26.03 vs 33.32). So a teacher reads them first
(``score_candidates``: the retriever's top ``depth`` and the judged positives, raw scores), and this
stage decides from its scores, without a model:

1. scores become probabilities: a cross-encoder's logit through a sigmoid (``calibration.method:
   sigmoid``, what RocketQA does), or any teacher's score through a sigmoid fitted on the labelled
   queries' retrieved candidates (``platt``: judged positives 1, others 0; the judged positives the
   run missed or ranked below ``depth`` are left out, see ``teachers.read_candidates``) -- which a
   fusion teacher (BM25 + dense, no training, works offline) needs;
2. walking the ranks, a passage is kept as a negative if its probability is below
   ``negative_threshold`` and it is not a judged positive, up to ``negatives_per_positive`` per
   positive; a passage at or above the threshold is dropped as a likely false negative;
3. queries short of negatives are filled with random passages from ranks ``fill_ranks`` of the
   retriever's list (not judged positives).

It also checks the teacher (``teachers.list_order_check``): on the labelled lists, does it score judged
positives above the other candidates more often than chance, and not less often than the retriever's own
order? A teacher that fails is logged as a warning with its numbers (and shown on the report page): at
chance, its kept and dropped candidates are close to a random split, whatever the thresholds.

Outputs: ``negatives`` (miner ``denoised`` or ``fill``, the retriever rank), ``scores`` (every scored
pair with its probability: what listwise distillation and augmentation's calibration read), ``audit``
(per query and rank bucket: candidates, judged positives, dropped, kept), and ``histogram`` (PNG +
JSON of the probabilities, judged positives apart).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, PositiveInt, model_validator

from irflow.engine.errors import DataError
from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.figures import probability_histogram
from irflow.learn.qrels import judged_positives, positives
from irflow.learn.sampling import sample
from irflow.learn.teachers import Calibration, fit_platt_on_lists, list_order_check, probabilities

log = logging.getLogger("irflow.denoise")

Probability = Field(ge=0.0, le=1.0)


class DenoiseParams(Params):
    """What a denoising run keeps, from a teacher's scores of the candidates."""

    calibration: Calibration = Field(Calibration(), description="how teacher scores become probabilities")
    negative_threshold: float = Field(0.1, ge=0.0, le=1.0, description="a candidate whose probability is below "
                                                                       "this is a negative; at or above, it is "
                                                                       "dropped as a likely false negative")
    negatives_per_positive: PositiveInt = Field(4, description="negatives kept per judged positive of a query")
    fill_ranks: tuple[PositiveInt, PositiveInt] | None = Field(
        (51, 1000), description="fill a query short of negatives with random passages from these ranks of the "
                                "retriever's list [lo, hi] (null: no fill)")
    split: str = Field("train", min_length=1, description="the qrels split whose queries and positives are used")
    buckets: tuple[PositiveInt, ...] = Field((5, 10, 20, 50), min_length=1, description="upper ranks of the audit's "
                                                                                        "rank buckets")
    seed: int = Field(42, description="seed of the fill's sampling")

    @model_validator(mode="after")
    def _ranges(self):
        if self.fill_ranks is not None and self.fill_ranks[0] > self.fill_ranks[1]:
            raise ValueError(f"fill_ranks: [lo, hi] with lo <= hi, got {list(self.fill_ranks)}")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets: increasing upper ranks, got {list(self.buckets)}")
        return self


def bucket_names(buckets: tuple[int, ...]) -> list[tuple[int, int, str]]:
    out, lo = [], 1
    for hi in buckets:
        out.append((lo, hi, f"{lo}-{hi}"))
        lo = hi + 1
    return out


def denoise_tables(p: DenoiseParams, triples: list[tuple[str, str, int]], prob: np.ndarray, score: np.ndarray,
                   pos_by_q: dict[str, set[str]], judged: dict[str, set[str]], ranks: dict[str, dict[str, int]]
                   ) -> dict[str, pa.Table]:
    """The negatives, scores and audit tables from scored candidates (the stage without models)."""
    by_q: dict[str, list[tuple[int, str, float]]] = defaultdict(list)
    for (q, d, r), pr in zip(triples, prob):
        by_q[q].append((r, d, float(pr)))
    buckets = bucket_names(p.buckets)
    neg = {"query_id": [], "doc_id": [], "miner": [], "rank": []}
    audit = {k: [] for k in ("query_id", "bucket", "candidates", "known_positives", "dropped", "kept")}
    short = 0
    for q in sorted(pos_by_q):
        quota = p.negatives_per_positive * len(pos_by_q[q])
        kept: list[tuple[str, int]] = []
        counts = {name: [0, 0, 0, 0] for _, _, name in buckets}
        for r, d, pr in sorted(x for x in by_q.get(q, ()) if x[0] > 0):
            name = next((nm for lo, hi, nm in buckets if lo <= r <= hi), None)
            c = counts[name] if name else [0, 0, 0, 0]
            c[0] += 1
            if d in judged.get(q, ()) or d == q:
                c[1] += 1
            elif pr >= p.negative_threshold:
                c[2] += 1
            elif len(kept) < quota:
                c[3] += 1
                kept.append((d, r))
        for d, r in kept:
            neg["query_id"].append(q), neg["doc_id"].append(d), neg["miner"].append("denoised"), neg["rank"].append(r)
        if len(kept) < quota and p.fill_ranks is not None:
            lo, hi = p.fill_ranks
            taken = {d for d, _ in kept}
            pool = [d for d, r in ranks.get(q, {}).items()
                    if lo <= r <= hi and d not in judged.get(q, ()) and d != q and d not in taken]
            for d in sample(pool, quota - len(kept), p.seed, "fill", q):
                neg["query_id"].append(q), neg["doc_id"].append(d), neg["miner"].append("fill")
                neg["rank"].append(ranks[q][d])
                kept.append((d, ranks[q][d]))
        short += len(kept) < quota
        for _, _, name in buckets:
            audit["query_id"].append(q), audit["bucket"].append(name)
            for k, v in zip(("candidates", "known_positives", "dropped", "kept"), counts[name]):
                audit[k].append(v)
    if short:
        log.warning("denoise: %d quer(ies) got fewer negatives than %d per positive (short lists)", short,
                    p.negatives_per_positive)
    scores = {"query_id": [t[0] for t in triples], "doc_id": [t[1] for t in triples],
              "rank": pa.array([t[2] for t in triples], pa.int32()), "score": pa.array(score, pa.float32()),
              "prob": pa.array(np.clip(prob, 0, 1), pa.float32()),
              "positive": [t[1] in judged.get(t[0], ()) for t in triples]}
    i32 = pa.int32()
    return {"negatives": pa.table({**neg, "rank": pa.array(neg["rank"], i32)}),
            "scores": pa.table(scores),
            "audit": pa.table({**{k: audit[k] for k in ("query_id", "bucket")},
                               **{k: pa.array(audit[k], i32) for k in ("candidates", "known_positives", "dropped",
                                                                       "kept")}})}


@stage("denoise", version="4",
       outputs=[Output("negatives", "negatives"), Output("scores", "teacher_scores"), Output("audit", "denoise_audit"),
                Output("histogram", kind="figure")])
def denoise(p: DenoiseParams, rt: StageRuntime, *, scores: DatasetRef, ranking: DatasetRef, qrels: DatasetRef):
    """Denoised hard negatives for the queries with positives in ``split``, from a teacher's
    ``scores`` (candidate_scores) of ``ranking``'s top candidates; ``ranking``'s deeper ranks are the fill."""
    qrels_t = qrels.table()
    pos_by_q = positives(qrels_t, p.split)
    if not pos_by_q:
        raise DataError(f"denoise: no positive qrels in split '{p.split}'")
    judged = judged_positives(qrels_t)
    cand = scores.table()
    triples = list(zip(*(cand.column(c).to_pylist() for c in ("query_id", "doc_id", "rank"))))
    scored_q = {q for q, _, _ in triples}
    pos_by_q = {q: ds for q, ds in pos_by_q.items() if q in scored_q}
    if not pos_by_q:
        raise DataError(f"denoise: the scores have no query of split '{p.split}'")
    ranks: dict[str, dict[str, int]] = defaultdict(dict)
    r = ranking.table(columns=["query_id", "doc_id", "rank"])
    for q, d, rk in zip(*(r.column(c).to_pylist() for c in ("query_id", "doc_id", "rank"))):
        if q in pos_by_q:
            ranks[q][d] = rk
    raw = cand.column("score").to_numpy().astype(np.float64)
    list_ranks = cand.column("rank").to_numpy()
    labels = np.array([d in judged.get(q, ()) for q, d, _ in triples], dtype=np.float64)
    fitted = None
    if p.calibration.method == "platt":
        fitted = fit_platt_on_lists(raw, labels, list_ranks)
    prob, (a, b) = probabilities(raw, p.calibration.method, fitted=fitted)
    out = denoise_tables(p, triples, prob, raw, pos_by_q, judged, ranks)
    audit = out["audit"]
    n_cand = pc.sum(audit.column("candidates")).as_py() or 0
    dropped = pc.sum(audit.column("dropped")).as_py() or 0
    log.info("denoise: %d of %d candidates dropped as likely false negatives (p >= %.2f; calibration %s, "
             "a=%.4g b=%.4g); %d negatives", dropped, n_cand, p.negative_threshold, p.calibration.method, a, b,
             out["negatives"].num_rows)
    # A teacher that cannot order the lists it judges "denoises" at random: say so (the run goes on; the
    # report shows the same check, irflow.tools.inside).
    check = list_order_check(cand.column("query_id").to_pylist(), list_ranks, raw, labels)
    if (problem := check.problem()) is not None:
        log.warning("denoise: %s. Denoise with a teacher that orders the lists (denoise.teachers: [fusion] needs "
                    "no training), or give the cross-encoder the budget to learn (bench/README.md, RocketQA)", problem)
    else:
        log.info("denoise: the teacher orders the labelled lists with mean AUC %.3f over %d queries (the "
                 "retriever's order %.3f)", check.teacher_auc, check.queries, check.list_auc)
    fig_dir = Path(rt.workdir) / "histogram"
    is_pos = labels > 0
    probability_histogram(fig_dir, {"judged positives": prob[is_pos], "other candidates": prob[~is_pos]},
                          {f"negative < {p.negative_threshold}": p.negative_threshold},
                          f"denoise: teacher probabilities of the top candidates ({p.calibration.method})")
    return {**out, "histogram": fig_dir}
