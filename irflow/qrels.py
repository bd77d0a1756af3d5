"""Positives and judgements, grouped by query: the one place that says what a positive is.

A positive is a qrels row with score > 0. ``positives(qrels, split)`` are the pairs a stage trains
on; ``judged_positives(qrels)`` (every split) are what must never be drawn as a negative.
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
import pyarrow.compute as pc


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


def judged_positives(qrels: pa.Table) -> dict[str, set[str]]:
    """query -> every document judged positive for it in any split: never a negative."""
    return positives(qrels)
