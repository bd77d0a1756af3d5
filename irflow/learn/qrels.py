"""Positives and judgements, grouped by query: the one place that says what a positive is.

A positive is a qrels row with score > 0. ``positives(qrels, split)`` are the pairs a stage trains
on; ``judged_positives(qrels)`` (every split) are what must never be drawn as a negative.
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
import pyarrow.compute as pc

from irflow.learn.sampling import sample


def group(table: pa.Table, key: str = "query_id", value: str = "doc_id") -> dict[str, set[str]]:
    """key -> set of values over the rows of a table."""
    out: dict[str, set[str]] = defaultdict(set)
    for k, v in zip(table.column(key).to_pylist(), table.column(value).to_pylist()):
        out[k].add(v)
    return dict(out)


def positive_rows(qrels: pa.Table, split: str | None = None) -> pa.Table:
    """The qrels rows with score > 0 (of ``split``, if given)."""
    mask = pc.greater(qrels.column("score"), 0)
    if split is not None:
        mask = pc.and_(mask, pc.equal(qrels.column("split"), split))
    return qrels.filter(mask)


def positives(qrels: pa.Table, split: str | None = None) -> dict[str, set[str]]:
    """query -> its positive documents (of ``split``, if given)."""
    return group(positive_rows(qrels, split))


def positive_pairs(qrels: pa.Table, split: str | None = None) -> list[tuple[str, str]]:
    """Sorted distinct (query, positive document) pairs (of ``split``, if given)."""
    t = positive_rows(qrels, split)
    return sorted(set(zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist())))


def cap_per_query(pairs: list[tuple[str, str]], k: int | None, seed, key: str = "positives") -> list[tuple[str, str]]:
    """Sorted (query, document) pairs keeping at most ``k`` per query: a sample seeded per (seed, key,
    query), so it does not depend on the other queries; ``k`` None keeps every pair. Training batches are
    a shuffle of the pairs, so without a cap a query weighs as much as it has judged passages (NFCorpus:
    "cancer" has 1,363 positives in train, the median query 18)."""
    if not k:
        return sorted(pairs)
    by_query: dict[str, list[str]] = defaultdict(list)
    for q, d in pairs:
        by_query[q].append(d)
    return sorted((q, d) for q, ds in by_query.items() for d in sample(ds, k, seed, key, q))


def judged_positives(qrels: pa.Table) -> dict[str, set[str]]:
    """query -> every document judged positive for it in any split: never a negative."""
    return positives(qrels)
