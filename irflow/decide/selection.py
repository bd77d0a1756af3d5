"""Which of a run's dense models to ship: the best on the run's evaluation, unless that is a trained model
whose gain over the model it started from is within noise.

A trained model is selected only when it scores above the starting model and a paired t-test over the
evaluation's units says the gain is unlikely to be chance (p < ``alpha`` after Holm's adjustment for the
number of trained models). A unit is a query of a labelled set, or a held-out document of a proxy (its
queries' mean: queries cut from one document are not independent); fewer than ``MIN_UNITS`` units select
nothing. Otherwise the starting model
is selected and the reason says so plainly: adapting did not help (or hurt) on this evaluation. With a
synthetic (proxy) evaluation this rule is what keeps a run from handing out a model that only fits its
own generated queries better.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from irflow.learn.stats import detectable_gain, paired

ALPHA = 0.05
# what a run with no evaluation (your own documents, dataset.proxy: null) records as its evaluation
NO_EVALUATION = "none (dataset.proxy: null: nothing held out, nothing measured)"


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
    # the smallest real gain of the best trained model this evaluation would find 4 times in 5 (Holm's first
    # step over the trained models): below it, "kept" says nothing was found, not that nothing was gained
    detectable_gain: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


MIN_UNITS = 20  # below this many evaluation units (queries, or held-out documents for a proxy) nothing is selected
# G x sqrt(units) of the detectable gain, measured on the proxy bench's runs (bench/selection_power.py)
POWER_FILE = Path(__file__).resolve().parents[1] / "measured" / "selection_power.json"


def expected_detectable_gain(units: float, proxy: str = "ict") -> tuple[float, float]:
    """(low, high): the real gain a ``proxy`` evaluation of ``units`` units finds 4 times in 5, as measured on the
    datasets of ``POWER_FILE`` (the detectable gain shrinks as 1 / sqrt(units)), before any model has trained."""
    scales = [r["gain_times_sqrt_units"] for r in json.loads(POWER_FILE.read_text())["rows"] if r["proxy"] == proxy]
    root = max(units, 1.0) ** 0.5
    return min(scales) / root, max(scales) / root


def missed_gain(start: Mapping[str, float], other: Mapping[str, float], unit_name: str, alpha: float = ALPHA,
                tests: int = 1) -> tuple[float | None, str]:
    """(the detectable gain of ``other`` over ``start`` on the units both have, None when it is undefined; the
    words a kept decision ends with): the real gain those units find 4 times in 5 (``detectable_gain``)."""
    shared = sorted(set(start) & set(other))
    gain = detectable_gain([other[u] - start[u] for u in shared], alpha, tests=tests)
    if gain != gain:  # NaN: fewer than 2 units
        return None, ""
    return gain, (f"; with {len(shared)} {unit_name}, a real gain of about {gain:.4f} or more is found 4 times in 5, "
                  f"a smaller one may well be missed")


def unit_means(per_query: Mapping[str, float], units: Mapping[str, str] | None) -> dict[str, float]:
    """A system's values per evaluation unit: per query, or (``units``: query -> unit, e.g. the held-out
    document a proxy query was made from) the mean over each unit's queries, so that the queries of one
    document count as one observation, not as independent ones."""
    if units is None:
        return dict(per_query)
    sums: dict[str, list[float]] = {}
    for q, v in per_query.items():
        sums.setdefault(units.get(q, q), []).append(v)
    return {u: sum(v) / len(v) for u, v in sums.items()}


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of several p-values (one per candidate compared with the start): the
    family-wise error stays at alpha whichever candidates are truly no better. Sorted ascending,
    adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)); NaN stays NaN (and counts in m)."""
    m = len(p_values)
    order = sorted((p for p in p_values.items() if p[1] == p[1]), key=lambda kv: kv[1])
    out, running = {k: float("nan") for k in p_values}, 0.0
    for i, (k, p) in enumerate(order):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out


def select(per_query: Mapping[str, Mapping[str, float]], start: str, evaluation: str, metric: str = "ndcg@10",
           alpha: float = ALPHA, caveat: str | None = None, units: Mapping[str, str] | None = None,
           unit_name: str = "queries", min_units: int = MIN_UNITS) -> Selection:
    """``per_query``: system -> {query id: value} of ``metric`` for every dense model evaluated (the start
    among them). Returns the selection and why.

    Each trained model is compared with the start by a paired t-test over evaluation units (``units``:
    query -> unit, e.g. a proxy's held-out documents; None: each query is a unit), the p-values adjusted
    for the number of trained models (Holm); the best-scoring model whose gain holds after adjustment is
    selected. Fewer than ``min_units`` units select nothing: the start is kept and the reason gives the
    count. ``caveat``: why this evaluation cannot be trusted to prefer a trained model (a proxy asking the
    kind of query the model trained on): a trained model that would have been selected is not."""
    if start not in per_query:
        raise ValueError(f"the starting model's system {start!r} was not evaluated (evaluated: {sorted(per_query)})")
    mean = {s: (sum(v.values()) / len(v) if v else 0.0) for s, v in per_query.items()}
    trained = sorted((s for s in per_query if s != start), key=lambda s: (-mean[s], s))
    where = f"{metric} on the {evaluation} evaluation"
    if not trained:
        return Selection(start, start, metric, mean[start], mean[start], None, None, None, evaluation,
                         f"{start}: the only dense model evaluated")
    by_unit = {s: unit_means(v, units) for s, v in per_query.items()}
    tests = {s: paired(by_unit[start], by_unit[s]) for s in trained}
    raw = {s: t.t_pvalue for s, t in tests.items()}
    adjusted = holm(raw) if len(trained) > 1 else raw
    n_units = len(by_unit[start])
    best = trained[0]
    p = adjusted[best]
    detectable, sees = missed_gain(by_unit[start], by_unit[best], unit_name, alpha, tests=len(trained))
    common = dict(start=start, metric=metric, start_value=mean[start], best_trained=best,
                  best_trained_value=mean[best], p_value=p, evaluation=evaluation, detectable_gain=detectable)
    several = f", Holm-adjusted for {len(trained)} trained models" if len(trained) > 1 else ""
    over = f"over {n_units} {unit_name}{several}"
    if n_units < min_units:
        return Selection(start, value=mean[start], reason=(
            f"{start} kept: the evaluation has {n_units} {unit_name}, fewer than the {min_units} needed to select "
            f"a model (best trained: {best} {mean[best]:.4f} vs {mean[start]:.4f}, {where}); hold out more "
            f"documents (dataset.proxy.fraction) or give labels"), **common)
    # the best-scoring trained model whose gain holds after the adjustment (adjusted == adjusted: not NaN)
    w = next((s for s in trained if mean[s] > mean[start] and adjusted[s] == adjusted[s] and adjusted[s] < alpha),
             None)
    if w is not None:
        common.update(best_trained=w, best_trained_value=mean[w], p_value=adjusted[w])
        if caveat:
            return Selection(start, value=mean[start], reason=(
                f"{start} kept: {w} scored {mean[w]:.4f} vs {mean[start]:.4f} ({where}; p = {adjusted[w]:.3g} "
                f"{over}), but {caveat}"), **common)
        return Selection(w, value=mean[w], reason=(
            f"{w} {mean[w]:.4f} vs {start} {mean[start]:.4f} ({where}; +{mean[w] - mean[start]:.4f}, "
            f"paired t-test p = {adjusted[w]:.3g} {over})"), **common)
    if mean[best] > mean[start]:
        why = (f"adaptation did not help beyond noise: the best trained model, {best}, scored {mean[best]:.4f} vs "
               f"{mean[start]:.4f} ({where}; p = {p:.3g} {over}, needs < {alpha}){sees}")
    else:
        why = (f"adaptation did not help: every trained model scored at or below the starting model (best: "
               f"{best} {mean[best]:.4f} vs {mean[start]:.4f}, {where}){sees}")
    return Selection(start, value=mean[start], reason=f"{start} kept: {why}", **common)


def unmeasured(models: list[str], start: str, metric: str = "ndcg@10") -> Selection:
    """The selection of a run that evaluated nothing (``NO_EVALUATION``): the model trained last, handed out
    unmeasured (as GPL's script does without evaluation data), or the start if nothing was trained."""
    trained = [s for s in models if s != start]
    pick = trained[-1] if trained else start
    why = (f"{pick}: the model this run trained last, not measured: the corpus was too small to hold documents out "
           f"for a synthetic evaluation (dataset.proxy: null), so nothing compared it with {start}") if trained else \
        f"{start}: nothing was trained or measured (dataset.proxy: null)"
    return Selection(pick, start, metric, float("nan"), float("nan"), pick if trained else None, None, None,
                     NO_EVALUATION, why)
