"""Which of a run's dense models to ship: the best on the run's evaluation, unless that is a trained model
whose gain over the model it started from is within noise.

A trained model is selected only when it scores above the starting model and a paired t-test over the
evaluation's queries says the gain is unlikely to be chance (p < ``alpha``). Otherwise the starting model
is selected and the reason says so plainly: adapting did not help (or hurt) on this evaluation. With a
synthetic (proxy) evaluation this rule is what keeps a run from handing out a model that only fits its
own generated queries better.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

from irflow.stats import paired

ALPHA = 0.05


@dataclass(frozen=True)
class Selection:
    system: str  # the selected system (a dense model)
    start: str  # the system of the model training started from
    metric: str
    value: float  # the selected system's mean
    start_value: float
    best_trained: str | None  # the trained system with the highest mean (None: nothing was trained)
    best_trained_value: float | None
    p_value: float | None  # paired t-test, best trained vs start
    evaluation: str  # labelled, or proxy (how it was made)
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def select(per_query: Mapping[str, Mapping[str, float]], start: str, evaluation: str, metric: str = "ndcg@10",
           alpha: float = ALPHA, caveat: str | None = None) -> Selection:
    """``per_query``: system -> {query id: value} of ``metric`` for every dense model evaluated (the start
    among them). Returns the selection and why. ``caveat``: why this evaluation cannot be trusted to prefer a
    trained model (a proxy asking the kind of query the model trained on): a trained model that would have
    been selected is not, and the reason says why."""
    if start not in per_query:
        raise ValueError(f"the starting model's system {start!r} was not evaluated (evaluated: {sorted(per_query)})")
    mean = {s: (sum(v.values()) / len(v) if v else 0.0) for s, v in per_query.items()}
    trained = sorted((s for s in per_query if s != start), key=lambda s: (-mean[s], s))
    where = f"{metric} on the {evaluation} evaluation"
    if not trained:
        return Selection(start, start, metric, mean[start], mean[start], None, None, None, evaluation,
                         f"{start}: the only dense model evaluated")
    best = trained[0]
    test = paired(per_query[start], per_query[best])
    p = test.t_pvalue
    common = dict(start=start, metric=metric, start_value=mean[start], best_trained=best,
                  best_trained_value=mean[best], p_value=p, evaluation=evaluation)
    if mean[best] > mean[start] and p == p and p < alpha and caveat:
        return Selection(start, value=mean[start], reason=(
            f"{start} kept: {best} scored {mean[best]:.4f} vs {mean[start]:.4f} ({where}; p = {p:.3g}), but {caveat}"),
            **common)
    if mean[best] > mean[start] and p == p and p < alpha:  # p == p: not NaN
        return Selection(best, value=mean[best], reason=(
            f"{best} {mean[best]:.4f} vs {start} {mean[start]:.4f} ({where}; +{mean[best] - mean[start]:.4f}, "
            f"paired t-test p = {p:.3g} over {test.n} queries)"), **common)
    if mean[best] > mean[start]:
        why = (f"adaptation did not help beyond noise: the best trained model, {best}, scored {mean[best]:.4f} vs "
               f"{mean[start]:.4f} ({where}; p = {p:.3g} over {test.n} queries, needs < {alpha})")
    else:
        why = (f"adaptation did not help: every trained model scored at or below the starting model (best: "
               f"{best} {mean[best]:.4f} vs {mean[start]:.4f}, {where})")
    return Selection(start, value=mean[start], reason=f"{start} kept: {why}", **common)
