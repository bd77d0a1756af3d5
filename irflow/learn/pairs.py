"""(query, passage) candidate pairs, and a run that scores exactly them.

A fusion of retrievers' own top-k lists knows nothing of a passage that one retriever did not return:
``irflow.learn.fusion`` gives it that list's lowest score. Scoring every candidate with every retriever
(the ``bm25_score`` and ``dense_score`` stages) removes the guess: each retriever then has a score for
each candidate, and a z-score fusion standardises it over the query's candidates (GPL's fusion teacher,
``irflow.learn.teachers.FusionTeacher``).
"""

from __future__ import annotations

from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc


def candidate_pairs(tables: Sequence[pa.Table], queries: Sequence[str]) -> list[tuple[str, str]]:
    """The distinct (query_id, doc_id) pairs of ``tables`` (runs, negatives, qrels: any table with those
    two columns) whose query is in ``queries``; in the order of ``queries``, then by doc id."""
    asked = pa.array(list(queries), pa.string())
    docs: dict[str, set[str]] = {}
    for t in tables:
        t = t.filter(pc.is_in(t.column("query_id").cast(pa.string()), asked))
        for q, d in zip(t.column("query_id").cast(pa.string()).to_pylist(), t.column("doc_id").to_pylist()):
            docs.setdefault(q, set()).add(d)
    return [(q, d) for q in queries if q in docs for d in sorted(docs[q])]


def scored_run(pairs: Sequence[tuple[str, str]], scores: Sequence[float], system: str) -> pa.Table:
    """A run (contract ``run``) of exactly ``pairs``: ranked per query by score, ties by doc id; queries in
    the order they first appear in ``pairs``."""
    by_q: dict[str, list[tuple[float, str]]] = {}
    for (q, d), s in zip(pairs, scores):
        by_q.setdefault(q, []).append((-float(s), d))
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    for q, rows in by_q.items():
        for rank, (neg, d) in enumerate(sorted(rows), 1):
            cols["query_id"].append(q), cols["doc_id"].append(d), cols["rank"].append(rank)
            cols["score"].append(-neg)
    n = len(cols["query_id"])
    return pa.table({"query_id": pa.array(cols["query_id"], pa.string()), "doc_id": pa.array(cols["doc_id"], pa.string()),
                     "rank": pa.array(cols["rank"], pa.int32()), "score": pa.array(cols["score"], pa.float32()),
                     "system": pa.array([system] * n, pa.string())})
