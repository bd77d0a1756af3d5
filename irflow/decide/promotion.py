"""Promotion: a named alias (``production``) that moves to a run's selected model only when that model
beats the alias's current one on the run's own evaluation beyond noise.

At the end of a completed run with ``promote.alias`` set, the model the run selected
(``irflow.decide.selection``) is compared with the alias's current model on the run's evaluation (labelled, or
the proxy), query by query (``irflow.learn.stats.paired``): it takes the alias only when its mean is higher by
more than ``min_gain`` and the paired t-test gives p < ``alpha``. An alias with no model yet takes the
selected model (a first promotion); an alias that already holds it stays as it is. The alias's current
model is scored by the run itself: as one of its dense models when it is one, else as an extra dense
system named after the alias (``irflow.recipes.common.alias_runs``), evaluated like the zero-shot model.

Every decision is one row of the catalog's ``aliases`` table (promoted or kept, and why); an alias's
current model is its latest promoted row. A promotion is one INSERT in one transaction, made after the
model's files are checked complete in the store, and only if the alias still holds the model the run
compared with: an interrupted run leaves the alias where it was.

``decide`` is pure (values in, decision out); ``promote`` reads the catalog and the store, and records.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from pydantic import Field, field_validator

from irflow.decide.selection import MIN_UNITS, missed_gain, unit_means
from irflow.engine.params import Params
from irflow.learn.stats import paired

log = logging.getLogger("irflow")

PROMOTED, KEPT = "promoted", "kept"
ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
# words that mean something else where an alias is accepted (`irflow export latest`, `train.init: base`)
RESERVED = ("latest", "base")


class PromoteConfig(Params):
    """Promotion to a named alias after the run (never part of a cache key: it decides after the stages)."""

    alias: str | None = Field(
        None, description="the alias the run's selected model is promoted to (e.g. production; null: no "
                          "promotion). One name per store, whatever the config or recipe (give each corpus its "
                          "own name, e.g. production-scifact, when one store serves several). The alias's current "
                          "model is evaluated by the run as system <alias> (unless it is one of the run's dense "
                          "models); `irflow export <alias>` hands out its model, `irflow models` lists aliases")
    min_gain: float = Field(0.0, ge=0, description="the selected model's mean ndcg@10 on the run's evaluation must "
                                                   "beat the alias's current model's by more than this")
    alpha: float = Field(0.05, gt=0, lt=1, description="and a paired t-test over the evaluation's queries must "
                                                       "give p below this")

    @field_validator("alias")
    @classmethod
    def _alias(cls, v):
        return check_alias_name(v)


def check_alias_name(v: str | None) -> str | None:
    """An alias name (letters, digits, ``_ . -``; not ``latest`` or ``base``) or None."""
    if v is None:
        return v
    if not re.match(ALIAS_PATTERN, v):
        raise ValueError(f"'{v}' is not an alias name (letters, digits, '_', '.', '-'; starting with a letter or "
                         "digit)")
    if v in RESERVED:
        raise ValueError(f"'{v}' is reserved ({', '.join(RESERVED)} mean something else); choose another alias name")
    return v


@dataclass(frozen=True)
class Promotion:
    decision: str  # promoted | kept
    alias: str
    model_id: str | None  # the run's selected model (the candidate)
    system: str | None  # its system in the run
    previous: str | None  # the alias's model before the decision (None: it had none)
    previous_system: str | None  # the system whose values stood for the alias's model in this run
    metric: str
    value: float | None  # the candidate's mean on the run's evaluation
    previous_value: float | None
    p_value: float | None
    evaluation: str
    reason: str

    @property
    def current(self) -> str | None:
        """The alias's model after the decision."""
        return self.model_id if self.decision == PROMOTED else self.previous

    def to_dict(self) -> dict:
        return {**asdict(self), "current": self.current}


def _mean(values: Mapping[str, float]) -> float:
    return sum(values.values()) / len(values) if values else 0.0


def decide(alias: str, candidate: tuple[str, str, Mapping[str, float]] | None,
           current: tuple[str, str | None, Mapping[str, float] | None] | None, evaluation: str,
           metric: str = "ndcg@10", min_gain: float = 0.0, alpha: float = 0.05, unit_name: str = "queries",
           min_units: int = 0) -> Promotion:
    """``candidate``: (system, model id, per-query values) of the run's selected model (None: it selected
    none); ``current``: (model id, system, per-query values) of the alias's model (None: the alias has no
    model; values None: the run did not evaluate it)."""
    prev_id, prev_system, prev_values = current if current is not None else (None, None, None)
    common = dict(alias=alias, previous=prev_id, previous_system=prev_system, metric=metric, evaluation=evaluation)
    if candidate is None:
        return Promotion(KEPT, model_id=None, system=None, value=None, previous_value=None, p_value=None,
                         reason=f"{alias} kept: the run selected no model to promote", **common)
    system, model_id, values = candidate
    mean = _mean(values)
    where = f"{metric} on the {evaluation} evaluation"
    if current is None:
        return Promotion(PROMOTED, model_id=model_id, system=system, value=mean, previous_value=None, p_value=None,
                         reason=f"first promotion: {alias} had no model; it now holds {system} ({mean:.4f}, {where})",
                         **common)
    mine = dict(model_id=model_id, system=system, value=mean)
    if prev_id == model_id:
        return Promotion(KEPT, previous_value=mean, p_value=None,
                         reason=f"already in {alias}: the run selected {system}, the model {alias} holds", **mine,
                         **common)
    if prev_values is None:
        return Promotion(KEPT, previous_value=None, p_value=None,
                         reason=f"{alias} kept: its model {prev_id} was not evaluated by this run, so nothing "
                                f"says {system} is better", **mine, **common)
    prev_mean = _mean(prev_values)
    test = paired(prev_values, values)
    p = test.t_pvalue
    gain = mean - prev_mean
    numbers = (f"{system} {mean:.4f} vs {alias}'s model {prev_mean:.4f} ({where}; {gain:+.4f}, paired t-test "
               f"p = {p:.3g} over {test.n} {unit_name})")
    if test.n < min_units:
        return Promotion(KEPT, previous_value=prev_mean, p_value=p, reason=(
            f"{alias} kept: {test.n} {unit_name} are fewer than the {min_units} needed to decide: {numbers}"),
            **mine, **common)
    if gain > min_gain and p == p and p < alpha:  # p == p: not NaN
        return Promotion(PROMOTED, previous_value=prev_mean, p_value=p, reason=f"promoted to {alias}: {numbers}",
                         **mine, **common)
    why = (f"not better than {alias}'s model" if gain <= 0 else
           f"the gain is not above promote.min_gain {min_gain}" if gain <= min_gain else
           f"the gain is within noise (needs p < {alpha})")
    _, sees = missed_gain(prev_values, values, unit_name, alpha)
    return Promotion(KEPT, previous_value=prev_mean, p_value=p, reason=f"{alias} kept: {why}: {numbers}{sees}",
                     **mine, **common)


def trained_documents(catalog, model_id: str | None, _seen: set | None = None) -> set[str]:
    """The documents a stored model was trained on: those of the training corpus its trainer read, and of
    every stored model it was trained from (training continued from an alias's model). Empty for a model
    no stage made (a hub id, a local directory)."""
    from irflow.sources.corpus_sources import document_id

    _seen = set() if _seen is None else _seen
    info = catalog.dataset(model_id) if model_id and model_id not in _seen else None
    if not info or info.get("stage") in (None, "external") or not info.get("run_id"):
        return set()
    _seen.add(model_id)
    out: set[str] = set()
    for r in catalog.stage_runs(info["run_id"], with_inputs=True):
        if model_id not in (r.get("outputs") or {}).values():
            continue
        for role, ids in (r.get("inputs") or {}).items():
            for i in ids:
                ref = catalog.ref(i)
                if ref is not None and role == "corpus" and ref.path:
                    out |= {document_id(x) for x in ref.table(columns=["doc_id"]).column("doc_id").to_pylist()}
                elif ref is not None and ref.kind == "model":
                    out |= trained_documents(catalog, i, _seen)
        break
    return out


def model_problem(catalog, store, model_id: str) -> str | None:
    """None if the model's files are complete where the catalog places them; else what is wrong. A stored
    model is checked against its recorded digest (``Store.check``); a local directory against the
    fingerprint its id holds; a hub model is named by its id and has nothing here to check."""
    from irflow.engine.store import fingerprint_dir

    ref = catalog.ref(model_id)
    if ref is None:
        return f"model {model_id} is not in the catalog"
    if store.holds(ref):
        problem = store.check(ref)
        return None if problem is None else f"model {model_id} is {problem} in the store"
    if model_id.startswith("dir:sha256:"):
        path = Path(ref.path or "")
        if not path.is_dir():
            return f"model {model_id}: its directory {path} is gone"
        if not model_id.endswith(fingerprint_dir(path)[:32]):
            return f"model {model_id}: its directory {path} changed since the run read it"
    return None


def promote(catalog, store, run_id: str, config: PromoteConfig, selected: dict | None,
            per_query: Mapping[str, Mapping[str, float]], evaluated: Mapping[str, str], evaluation: str,
            metric: str = "ndcg@10", partial: str | None = None, units: Mapping[str, str] | None = None
            ) -> Promotion:
    """Decide and record the promotion of a run's selected model to ``config.alias``.

    ``per_query``: system -> {query id: value} of ``metric`` on the run's evaluation; ``evaluated``:
    system -> model id of every dense system the run evaluated (the alias's own system among them when
    the run evaluated the alias's model apart); ``partial``: why the run cannot promote (``--to``); ``units``:
    a proxy's query -> held-out document: the comparison then reads per-document means over the documents
    neither model trained on (``trained_documents``), and refuses below ``irflow.decide.selection.MIN_UNITS``."""
    alias = config.alias
    current = catalog.alias(alias)
    prev_id = current["model_id"] if current else None
    prev = None
    if prev_id is not None:
        # the run's own system for it: one of its dense models, or the system named after the alias
        system = next((s for s, m in evaluated.items() if m == prev_id), None)
        prev = (prev_id, system, per_query.get(system) if system else None)
    candidate = None
    if selected is not None and selected["system"] in per_query:
        candidate = (selected["system"], selected["model_id"], per_query[selected["system"]])
    unit_name, min_units = "queries", 0
    if units is not None and candidate is not None and prev is not None and prev[2] is not None:
        # only documents neither model trained on: a held-out document stays held out, but a config's
        # fraction or seed can change, and a twin can pull a trained-on document across
        seen = trained_documents(catalog, prev_id) | trained_documents(catalog, candidate[1])
        keep = {q for q, u in units.items() if u not in seen}
        dropped = len({units[q] for q in per_query[candidate[0]] if q in units and q not in keep})
        values = {q: v for q, v in candidate[2].items() if q in keep}
        prev_vals = {q: v for q, v in prev[2].items() if q in keep}
        candidate = (candidate[0], candidate[1], unit_means(values, units))
        prev = (prev[0], prev[1], unit_means(prev_vals, units))
        unit_name = "held-out documents neither model trained on" + (f"; {dropped} dropped" if dropped else "")
        min_units = MIN_UNITS
    p = decide(alias, candidate, prev, evaluation, metric, config.min_gain, config.alpha, unit_name, min_units)
    if partial and p.decision == PROMOTED:
        p = _keep(p, f"{alias} kept: {partial}")
    if p.decision == PROMOTED:
        problem = model_problem(catalog, store, p.model_id)
        if problem:
            p = _keep(p, f"{alias} kept: {problem}; its files must be complete before an alias points at it")
    if not catalog.record_alias(_row(p, run_id), expect=prev_id):
        now = (catalog.alias(alias) or {}).get("model_id")
        p = _keep(p, f"{alias} kept: it moved to {now} while this run compared with {prev_id}; run again to "
                     "compare with its new model")
        catalog.record_alias(_row(p, run_id), expect=None)
    log.info("promotion: %s", p.reason)
    return p


def _keep(p: Promotion, reason: str) -> Promotion:
    from dataclasses import replace

    return replace(p, decision=KEPT, reason=reason)


def _row(p: Promotion, run_id: str) -> dict:
    return {"alias": p.alias, "decision": p.decision, "model_id": p.model_id, "run_id": run_id, "system": p.system,
            "previous_model_id": p.previous, "metric": p.metric, "value": p.value, "previous_value": p.previous_value,
            "p_value": p.p_value, "evaluation": p.evaluation, "reason": p.reason}
