"""BEIR evaluation with pytrec_eval, using BEIR's metric definitions.

- nDCG@k  = pytrec_eval ``ndcg_cut.k``
- Recall@k = ``recall.k``
- MAP@k   = ``map_cut.k``
- MRR@k   = reciprocal rank of the first relevant (score > 0) document within the top k, as
  ``beir.retrieval.custom_metrics.mrr`` computes it.
Averages are over every judged query of the split that the system was asked (the ``queries``
input): a query the run returns nothing for scores 0, as with ``trec_eval -c`` (which Pyserini's
regressions use). BEIR's own evaluator averages over the answered queries only, which reads higher
where some queries get no hit, as on NFCorpus with BM25 (bench/results/baselines.json: ``bm25.nfcorpus``,
``ndcg@10`` over the answered queries against ``ndcg@10_over_all_judged``; docs/bench/baselines.md). Hits
whose doc id equals the query id are ignored (BEIR's ``ignore_identical_ids``).

Judgements of documents missing from the corpus (kept by default, ``dataset.dangling_qrels: keep``)
are scored as pytrec_eval, BEIR and Pyserini score them: they count in the ideal DCG and in recall's
denominator, and a judged query none of whose judged documents is in the corpus stays in the average
with 0. The metrics table says how many evaluated queries are such (``no_judged_doc``), when the
``corpus`` input is given.

Per-query values are kept as a dataset, so "which queries got worse" is one SQL query away.
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
import pyarrow.compute as pc
import pytrec_eval
from pydantic import Field, field_validator

from irflow import data_contracts
from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef

DEFAULT_METRICS = ("ndcg@10", "recall@100", "map@100", "mrr@10")
_TREC = {"ndcg": "ndcg_cut", "recall": "recall", "map": "map_cut", "p": "P"}


def _parse(metric: str) -> tuple[str, int]:
    name, _, k = metric.lower().partition("@")
    if not k.isdigit() or int(k) < 1 or (name not in _TREC and name != "mrr"):
        raise ValueError(f"cannot read metric '{metric}' (use e.g. ndcg@10, recall@100, map@100, mrr@10, p@5)")
    return name, int(k)


class EvaluationParams(Params):
    metrics: tuple[str, ...] = Field(DEFAULT_METRICS, min_length=1,
                                     description="BEIR metrics: ndcg@k, recall@k, map@k, mrr@k, p@k")
    ignore_identical_ids: bool = Field(True, description="ignore hits whose doc id equals the query id (BEIR)")

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v):
        for m in v:
            _parse(m)
        return tuple(v)


class EvaluateParams(EvaluationParams):
    dataset: str = Field(min_length=1, description="dataset name written into the metrics")
    split: str = Field(min_length=1, description="the qrels split the run is judged against")


def run_to_dict(run: pa.Table, ignore_identical_ids: bool = True) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for q, d, s in zip(run.column("query_id").to_pylist(), run.column("doc_id").to_pylist(),
                       run.column("score").to_pylist()):
        if ignore_identical_ids and q == d:
            continue
        out[q][d] = float(s)
    return out


def qrels_to_dict(qrels: pa.Table, split: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(dict)
    t = qrels.filter(pc.equal(qrels.column("split"), split))
    for q, d, s in zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist(), t.column("score").to_pylist()):
        out[q][d] = int(s)
    return out


def mrr_at_k(qrels: dict, results: dict, k: int) -> dict[str, float]:
    out = {}
    for qid, docs in results.items():
        if qid not in qrels:
            continue
        top = sorted(docs.items(), key=lambda x: x[1], reverse=True)[:k]
        rr = 0.0
        for rank, (doc, _) in enumerate(top, start=1):
            if qrels[qid].get(doc, 0) > 0:
                rr = 1.0 / rank
                break
        out[qid] = rr
    return out


def evaluate_run(qrels: dict, results: dict, metrics: list[str], asked: set[str] | None = None
                 ) -> dict[str, dict[str, float]]:
    """metric -> {query_id -> value} over the judged queries (those in ``asked``, if given); a judged
    query missing from ``results`` scores 0 (trec_eval -c)."""
    parsed = [(m, *_parse(m)) for m in metrics]
    judged = {q for q in qrels if asked is None or q in asked}
    qrels = {q: qrels[q] for q in judged}
    results = {q: docs for q, docs in results.items() if q in judged}
    trec_measures = {f"{_TREC[n]}.{k}" for _, n, k in parsed if n != "mrr"}
    per_query: dict[str, dict[str, float]] = {m: {} for m in metrics}
    if trec_measures:
        scores = pytrec_eval.RelevanceEvaluator(qrels, trec_measures).evaluate(results)
        for m, n, k in parsed:
            if n != "mrr":
                key = f"{_TREC[n]}_{k}"
                per_query[m] = {q: s[key] for q, s in scores.items()}
    for m, n, k in parsed:
        if n == "mrr":
            per_query[m] = mrr_at_k(qrels, results, k)
    for m in metrics:
        for q in judged:
            per_query[m].setdefault(q, 0.0)
    return per_query


def no_judged_doc(qrels: pa.Table, corpus: pa.Table, split: str, evaluated: set[str]) -> int:
    """How many of the ``evaluated`` queries have no judged document (of ``split``) in the corpus."""
    return len(data_contracts.queries_without_judged_doc(qrels, corpus, split, among=evaluated).get(split, ()))


# version 4: the corpus input and the metrics' no_judged_doc column
@stage("evaluate", version="4", outputs=[Output("per_query", "per_query_metrics"), Output("metrics", "metrics")])
def evaluate(p: EvaluateParams, rt: StageRuntime, *, ranking: DatasetRef, qrels: DatasetRef,
             queries: DatasetRef | None = None, corpus: DatasetRef | None = None):
    """Metrics of ``ranking`` against the ``p.split`` qrels, over the queries the system was asked
    (``queries``; without them: every judged query of the split). With the ``corpus``, each metrics
    row says how many of those queries have no judged document in it (``no_judged_doc``)."""
    r = ranking.table()
    asked = set(queries.table(columns=["query_id"]).column("query_id").to_pylist()) if queries is not None else None
    systems = sorted(set(r.column("system").to_pylist()))
    qrels_t = qrels.table()
    qrels_d = qrels_to_dict(qrels_t, p.split)
    evaluated = {q for q in qrels_d if asked is None or q in asked}
    missing = (no_judged_doc(qrels_t, corpus.table(columns=["doc_id"]), p.split, evaluated)
               if corpus is not None else None)
    pq_rows = {"system": [], "query_id": [], "metric": [], "value": []}
    m_rows = {"system": [], "dataset": [], "split": [], "metric": [], "value": [], "num_queries": [],
              "no_judged_doc": []}
    for system in systems:
        results = run_to_dict(r.filter(pc.equal(r.column("system"), system)), p.ignore_identical_ids)
        per_query = evaluate_run(qrels_d, results, list(p.metrics), asked)
        for metric, values in per_query.items():
            for q, v in sorted(values.items()):
                pq_rows["system"].append(system)
                pq_rows["query_id"].append(q)
                pq_rows["metric"].append(metric)
                pq_rows["value"].append(v)
            for col, v in zip(m_rows, (system, p.dataset, p.split, metric,
                                       sum(values.values()) / max(len(values), 1), len(values), missing)):
                m_rows[col].append(v)
    return {"per_query": pa.table(pq_rows),
            "metrics": pa.table(m_rows, schema=data_contracts.get("metrics").schema)}
