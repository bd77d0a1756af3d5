"""Data augmentation with a teacher (RocketQA, Qu et al., NAACL 2021, section 4.3;
``construct_unlabel_train_de.py``).

Unlabelled queries (a split's query texts with their labels unused -- never the evaluated split --
or generated queries) are retrieved by the dual encoder; the teacher reads each query's top
``depth``: that is ``score_candidates`` with ``split: null`` (sharded by queries, raw scores), and
this stage decides from its scores, without a model (a threshold change costs seconds, never a
re-scoring):

- the top passage by the teacher is a positive if its probability is above ``positive_threshold``
  (RocketQA: 0.9); otherwise the query is dropped (the teacher is not sure any passage answers it);
- negatives are passages whose probability is below ``negative_threshold`` (0.1), up to
  ``negatives_per_query`` (4), sampled (seeded).

Outputs: ``qrels`` (split ``augmented``, score 1: what M_D2 trains on beside the labelled pairs) and
``negatives`` (miner ``augmented``). Probabilities as in ``denoise``: a cross-encoder's logit through
a sigmoid, or (``platt``) a sigmoid fitted on a labelled set's scores (the ``calibration`` input: the
``scores`` that ``denoise`` wrote, with their judged positives) -- unlabelled queries have nothing to
fit on.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt, model_validator

from irflow.engine.errors import DataError
from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.sampling import sample
from irflow.learn.teachers import Calibration, fit_platt_on_lists, probabilities

log = logging.getLogger("irflow.augment")

AUGMENTED_SPLIT = "augmented"


class AugmentParams(Params):
    """What augmentation keeps, from the teacher's scores of the unlabelled queries' candidates."""

    calibration: Calibration = Field(Calibration(), description="how teacher scores become probabilities (platt: "
                                                                "fitted on the calibration input)")
    positive_threshold: float = Field(0.9, ge=0.0, le=1.0, description="the teacher's top passage is a positive "
                                                                       "if its probability is above this (else the "
                                                                       "query is dropped)")
    negative_threshold: float = Field(0.1, ge=0.0, le=1.0, description="passages below this probability are "
                                                                       "negatives")
    negatives_per_query: PositiveInt = Field(4, description="negatives kept per augmented query")
    seed: int = Field(42, description="seed of the negatives' sampling")

    @model_validator(mode="after")
    def _order(self):
        if self.negative_threshold >= self.positive_threshold:
            raise ValueError(f"negative_threshold ({self.negative_threshold}) must be below positive_threshold "
                             f"({self.positive_threshold})")
        return self


class AugmentSettings(AugmentParams):
    depth: PositiveInt = Field(50, description="the teacher reads the dual encoder's top n per query "
                                               "(score_candidates' depth)")


def augment_tables(p: AugmentParams, pairs: list[tuple[str, str, int]], prob: np.ndarray) -> dict[str, pa.Table]:
    by_q: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for (q, d, r), pr in zip(pairs, prob):
        by_q[q].append((float(pr), r, d))
    qrels = {"query_id": [], "doc_id": []}
    neg = {"query_id": [], "doc_id": [], "miner": [], "rank": []}
    for q in sorted(by_q):
        ranked = sorted(by_q[q], key=lambda x: (-x[0], x[1]))
        best_p, _, best_d = ranked[0]
        if best_p <= p.positive_threshold:
            continue
        qrels["query_id"].append(q), qrels["doc_id"].append(best_d)
        pool = {d: r for pr, r, d in ranked[1:] if pr < p.negative_threshold and d != q}
        for d in sample(list(pool), p.negatives_per_query, p.seed, q):
            neg["query_id"].append(q), neg["doc_id"].append(d), neg["miner"].append(AUGMENTED_SPLIT)
            neg["rank"].append(pool[d])
    n = len(qrels["query_id"])
    return {"qrels": pa.table({**qrels, "score": pa.array([1] * n, pa.int32()), "split": [AUGMENTED_SPLIT] * n}),
            "negatives": pa.table({**neg, "rank": pa.array(neg["rank"], pa.int32())})}


@stage("augment", version="4", outputs=[Output("qrels", "qrels"), Output("negatives", "negatives")])
def augment(p: AugmentParams, rt: StageRuntime, *, scores: DatasetRef, calibration: DatasetRef | None = None):
    """Teacher-labelled (query, positive) pairs and negatives for the unlabelled queries, from the teacher's
    ``scores`` (candidate_scores, split null) of their retrieved candidates."""
    t = scores.table(columns=["query_id", "doc_id", "rank", "score"])
    pairs = list(zip(*(t.column(c).to_pylist() for c in ("query_id", "doc_id", "rank"))))
    if not pairs:
        raise DataError("augment: the teacher scored no candidate of the unlabelled queries")
    fitted = None
    if p.calibration.method == "platt":
        if calibration is None:
            raise ValueError("augment: calibration platt needs the calibration input (a teacher_scores table of "
                             "labelled queries, e.g. denoise's scores)")
        c = calibration.table(columns=["score", "positive", "rank"])
        fitted = fit_platt_on_lists(c.column("score").to_numpy(), np.array(c.column("positive").to_pylist(), float),
                                    c.column("rank").to_numpy())
    raw = t.column("score").to_numpy().astype(np.float64)
    prob, _ = probabilities(raw, p.calibration.method, fitted=fitted)
    out = augment_tables(p, pairs, prob)
    kept, asked = out["qrels"].num_rows, len({q for q, _, _ in pairs})
    log.info("augment: %d of %d queries labelled (top passage p > %.2f), %d negatives", kept, asked,
             p.positive_threshold, out["negatives"].num_rows)
    if kept == 0:
        log.warning("augment: the teacher labelled no query (no top passage above %.2f)", p.positive_threshold)
    return out
