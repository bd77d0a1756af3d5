"""Teachers: who scores (query, passage) pairs for the stages that label or filter training data.

Two kinds, chosen by ``type`` (a discriminated union, so a config says which and carries only its
own settings):

- ``cross_encoder``: a Hugging Face sequence-classification checkpoint (``irflow.learn.scoring``): one
  logit (``cross-encoder/ms-marco-*``, or the ``train_cross_encoder`` stage's), or two labels
  (RocketQA's ERNIE cross-encoders: the score is ``l1 - l0``, so that ``sigmoid(score)`` is the
  softmax probability of "relevant").
- ``fusion``: a training-free fusion of ranked runs (``irflow.learn.fusion``, e.g. BM25 + a dense model):
  what works offline.

``teacher_scores`` gives raw scores (GPL keeps margins in those units). Stages that threshold
scores as probabilities (RocketQA's denoising and augmentation: "negative if < 0.1", "positive if
> 0.9") use ``Calibration``: ``sigmoid`` reads a cross-encoder's logit as its probability (what
RocketQA does); ``platt`` fits ``sigmoid(a * score + b)`` on labelled pairs (Platt, 1999), which a
fusion score needs -- a weighted sum of z-scores is not a probability. It is fitted on the lists the
thresholds are applied to (``read_candidates``), not on the judged positives outside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Sequence, Union

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt

from irflow.engine.params import QUANTIZATION_DOC, Params, Quantization
from irflow.learn.fusion import FusionSettings, fuse_runs
from irflow.learn.stats import Paired, paired


class CrossEncoderTeacher(Params):
    type: Literal["cross_encoder"] = Field(description="a cross-encoder's raw logits (GPL)")
    batch_size: PositiveInt = Field(32, description="pairs per scoring batch")
    max_length: PositiveInt = Field(350, description="tokens of (query, passage) the cross-encoder reads")
    quantization: Quantization = Field("none", description=QUANTIZATION_DOC)


class FusionTeacher(FusionSettings):
    type: Literal["fusion"] = Field(description="a training-free fusion of the miners' runs (offline)")
    weights: dict[str, float] | None = Field(None, description="weight per run, by system (miner) name "
                                                               "(null: equal)")


Teacher = Annotated[Union[CrossEncoderTeacher, FusionTeacher], Field(discriminator="type")]


def teacher_model(p) -> dict:
    """``stage(onnx=...)`` of a stage whose params hold a ``teacher``: its ``teacher`` input is a
    cross-encoder that may run on ONNX Runtime (a fusion teacher reads no model)."""
    t = p.teacher
    return {"teacher": ("score", t.quantization)} if isinstance(t, CrossEncoderTeacher) else {}


def fusion_scores(runs: Sequence[pa.Table], teacher: FusionTeacher, pairs: list[tuple[str, str]],
                  stage: str = "pseudo_label") -> np.ndarray:
    """The fusion teacher's score of each (query, doc) pair."""
    if not runs:
        raise ValueError(f"{stage}: teacher.type fusion needs the teacher_rankings input")
    want = pa.table({"query_id": [q for q, _ in pairs], "doc_id": [d for _, d in pairs]},
                    schema=pa.schema([("query_id", pa.string()), ("doc_id", pa.string())]))
    fused = fuse_runs(runs, method=teacher.method, weights=teacher.weights, rrf_k=teacher.rrf_k,
                      input_depth=teacher.input_depth, pairs=want)
    lookup = dict(zip(zip(fused.column("query_id").to_pylist(), fused.column("doc_id").to_pylist()),
                      fused.column("score").to_pylist()))
    return np.array([lookup[p] for p in pairs], dtype=np.float64)


def teacher_scores(teacher: CrossEncoderTeacher | FusionTeacher, pairs: list[tuple[str, str]], qtext: dict,
                   dtext: dict, *, runs: Sequence[pa.Table] = (), model=None, rt=None,
                   stage: str = "stage") -> np.ndarray:
    """Raw teacher scores of (query id, doc id) pairs, in order. ``model``: the cross-encoder's ref;
    ``runs``: the fusion teacher's runs; ``rt``: the stage runtime (device, precision)."""
    from irflow.learn.scoring import cross_encoder_scores

    if not pairs:
        return np.zeros(0)
    if isinstance(teacher, CrossEncoderTeacher):
        if model is None:
            raise ValueError(f"{stage}: teacher.type cross_encoder needs the teacher input (a model)")
        return cross_encoder_scores(model.path, [(qtext[q], dtext[d]) for q, d in pairs],
                                    batch_size=teacher.batch_size, max_length=teacher.max_length,
                                    device=rt.device if rt else "cpu", autocast=rt.autocast if rt else None,
                                    onnx=rt.onnx_model(model) if rt else None, threads=rt.threads if rt else 1
                                    ).astype(np.float64)
    return fusion_scores(list(runs), teacher, pairs, stage)


# ---- probabilities --------------------------------------------------------------------------------
def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def fit_platt(scores: np.ndarray, labels: np.ndarray, iterations: int = 50) -> tuple[float, float]:
    """(a, b) maximising the likelihood of ``labels`` under ``sigmoid(a * score + b)`` (Newton's
    method on the logistic loss, with Platt's smoothed targets so separable data stays finite)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    n_pos, n_neg = float(y.sum()), float(len(y) - y.sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"platt calibration needs positive and negative pairs (got {int(n_pos)} positive, "
                         f"{int(n_neg)} negative)")
    t = np.where(y > 0, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))  # Platt (1999), section 2.2

    def loss(a: float, b: float) -> float:
        z = a * s + b
        return float(np.sum(t * np.logaddexp(0, -z) + (1 - t) * np.logaddexp(0, z)))

    # Start from the base rate (a = 0: every p equal, a well-conditioned Hessian) and backtrack each
    # Newton step until the loss decreases (Lin, Lin & Weng 2007). Plain Newton from a = 1 diverged
    # (a ~ -5e10) on NFCorpus's fusion scores: ranges up to ~17 saturate p, the Hessian vanishes.
    a, b = 0.0, float(np.log((n_pos + 1) / (n_neg + 1)))
    x = np.stack([s, np.ones_like(s)], 1)
    f = loss(a, b)
    for _ in range(iterations):
        p = sigmoid(a * s + b)
        grad = x.T @ (p - t)
        w = p * (1 - p) + 1e-12
        hess = (x * w[:, None]).T @ x + 1e-9 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        lam = 1.0
        while lam >= 1e-10:
            na, nb = a - lam * step[0], b - lam * step[1]
            nf = loss(na, nb)
            if nf < f + 1e-4 * lam * float(grad @ -step):
                break
            lam /= 2
        else:
            break  # no step decreases the loss: at the optimum (to rounding)
        a, b, f = na, nb, nf
        if np.abs(lam * step).max() < 1e-10:
            break
    return float(a), float(b)


def read_candidates(ranks: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Mask of the rows of a teacher-scores table that are the retriever's top candidates (rank 1 to
    the deepest rank of an unjudged row, i.e. the ``depth`` the teacher read).

    Such a table also holds each query's judged positives outside those lists (rank 0 where the run
    missed them, or their deeper rank), which calibration must leave out: thresholds are applied to
    the lists, and a fusion teacher scores a passage its runs missed or buried at their floor. On
    NFCorpus (many judged positives per query, few of them in M_D0's top 50) those low-scored positives
    outnumbered the listed ones and turned the fitted slope negative (positive on the lists alone):
    the fit then dropped low ranks as likely positives and kept the top ones as negatives."""
    ranks = np.asarray(ranks)
    labels = np.asarray(labels)
    unjudged = ranks[(labels == 0) & (ranks > 0)]
    depth = int(unjudged.max()) if unjudged.size else int(ranks.max(initial=0))
    return (ranks >= 1) & (ranks <= depth)


def fit_platt_on_lists(scores: np.ndarray, labels: np.ndarray, ranks: np.ndarray) -> tuple[float, float]:
    """``fit_platt`` on the rows ``read_candidates`` keeps, refusing lists without a judged positive."""
    on = read_candidates(ranks, labels)
    n_pos = int(np.asarray(labels)[on].sum())
    if n_pos == 0 or n_pos == int(on.sum()):
        raise ValueError(f"platt calibration: the retrieved lists hold {n_pos} judged positive(s) among "
                         f"{int(on.sum())} candidates; it needs both (score deeper lists, or a cross-encoder "
                         f"teacher with calibration: sigmoid)")
    return fit_platt(np.asarray(scores, dtype=np.float64)[on], np.asarray(labels, dtype=np.float64)[on])


class Calibration(Params):
    """How teacher scores become probabilities, for thresholds that are probabilities."""

    method: Literal["sigmoid", "platt"] = Field(
        "sigmoid", description="sigmoid: the score is a logit (a cross-encoder's; RocketQA); platt: "
                               "sigmoid(a * score + b) fitted on the labelled queries' retrieved candidates "
                               "(judged positives among them as 1, the rest as 0; judged positives outside the "
                               "lists left out) -- needed for a fusion teacher")


def probabilities(scores: np.ndarray, method: str,
                  fitted: tuple[float, float] | None = None) -> tuple[np.ndarray, tuple[float, float]]:
    """(probabilities, (a, b)) of raw teacher scores: ``sigmoid(a * score + b)``; (1, 0) for
    ``sigmoid``; for ``platt``, (a, b) are ``fitted`` (by ``fit_platt_on_lists``: a fit on every
    scored row would read the judged positives outside the lists)."""
    if method == "sigmoid":
        a, b = 1.0, 0.0
    elif fitted is not None:
        a, b = fitted
    else:
        raise ValueError("platt calibration needs its fitted (a, b): fit_platt_on_lists")
    return sigmoid(a * np.asarray(scores, dtype=np.float64) + b), (a, b)


# ---- does the teacher order the labelled lists? ------------------------------------------------------
def list_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The chance that a judged positive of one list scores above an unjudged candidate of the same list
    (ties count half): the area under the ROC curve of one query (Mann-Whitney U / (n_pos * n_neg)).
    0.5 is a random order, 1 every judged positive above every other candidate."""
    from scipy.stats import rankdata

    pos = np.asarray(labels) > 0
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    ranks = rankdata(np.asarray(scores, dtype=np.float64))  # average ranks: ties count half
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@dataclass(frozen=True)
class ListOrderCheck:
    """How a teacher orders the labelled lists it scored, per query: its AUC (judged positives against
    the other retrieved candidates, ``list_auc``) beside the AUC of the retriever's own order of the
    same candidates. Over the queries whose list holds both a judged positive and an unjudged candidate.

    A denoiser keeps a candidate as a negative because the teacher scores it low. A teacher at chance
    (AUC ~ 0.5) splits the candidates into kept and dropped close to at random, whatever the thresholds;
    one below the retriever judges them worse than the list it is meant to clean. The lists are the
    labelled queries', which a trained M_C (and M_D0) learnt from: the check is optimistic for them, a
    teacher that fails it fails on new queries too."""

    queries: int
    teacher_auc: float      # mean over the queries
    list_auc: float         # the retriever's order (rank 1 first), same queries
    vs_chance: Paired       # teacher's per-query AUC against 0.5 (b = teacher, a = chance)
    vs_list: Paired         # teacher against the retriever's order (b = teacher, a = list)

    def problem(self, alpha: float = 0.05) -> str | None:
        """One sentence when the teacher is at chance or below the list (paired t-test at ``alpha``
        over the queries), else None."""
        if self.queries < 2:
            return None
        nums = (f"mean AUC {self.teacher_auc:.3f} over {self.queries} labelled lists, chance 0.5; the retriever's "
                f"own order {self.list_auc:.3f}")
        if not (self.teacher_auc > 0.5 and self.vs_chance.t_pvalue < alpha):
            return (f"the teacher does not tell judged positives from the other candidates better than chance "
                    f"({nums}; vs chance p {self.vs_chance.t_pvalue:.2g}): what it keeps and drops is close to a "
                    f"random split of the candidates")
        if self.teacher_auc < self.list_auc and self.vs_list.t_pvalue < alpha:
            return (f"the teacher orders the lists worse than the retriever that made them ({nums}; better on "
                    f"{self.vs_list.wins} lists, worse on {self.vs_list.losses}, p {self.vs_list.t_pvalue:.2g}): "
                    f"it judges the candidates worse than the list it is meant to clean")
        return None

    def to_dict(self) -> dict:
        return {"queries": self.queries, "teacher_auc": self.teacher_auc, "list_auc": self.list_auc,
                "vs_chance": self.vs_chance.to_dict(), "vs_list": self.vs_list.to_dict()}


def list_order_check(query_ids: Sequence[str], ranks: np.ndarray, scores: np.ndarray,
                     labels: np.ndarray) -> ListOrderCheck:
    """``ListOrderCheck`` of a teacher-scores table's columns: rows ``read_candidates`` keeps (the
    retriever's top candidates, not the judged positives outside them), grouped by query."""
    ranks, scores, labels = np.asarray(ranks), np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0
    on = read_candidates(ranks, labels)
    rows: dict[str, list[int]] = {}
    for i in np.flatnonzero(on):
        rows.setdefault(query_ids[i], []).append(i)
    teacher, listed = {}, {}
    for q, idx in rows.items():
        y = labels[idx]
        if y.all() or not y.any():
            continue
        teacher[q] = list_auc(scores[idx], y)
        listed[q] = list_auc(-ranks[idx].astype(np.float64), y)
    n = len(teacher)
    mean = lambda d: float(np.mean(list(d.values()))) if d else float("nan")  # noqa: E731
    return ListOrderCheck(queries=n, teacher_auc=mean(teacher), list_auc=mean(listed),
                          vs_chance=paired(dict.fromkeys(teacher, 0.5), teacher), vs_list=paired(listed, teacher))


def teacher_scores_check(scores: pa.Table) -> ListOrderCheck:
    """``list_order_check`` of a stored ``teacher_scores`` table (denoise's ``scores`` output), for what reads
    one back: the report page, the benchmarks."""
    return list_order_check(scores.column("query_id").to_pylist(), scores.column("rank").to_numpy(),
                            scores.column("score").to_numpy(), scores.column("positive").to_numpy())
