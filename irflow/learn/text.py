"""Texts as models see them: BEIR's passage rule, and id -> text lookups over corpus/queries tables."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc


def passage_text(title: str | None, text: str | None) -> str:
    """BEIR's passage text: ``title + " " + text``, stripped (no title: just the text). Every model
    that reads passages -- bi-encoders, cross-encoders, query generators -- reads this."""
    return f"{title or ''} {text or ''}".strip()


def passage_texts(corpus: pa.Table) -> list[str]:
    """passage_text of every row of a corpus table, in its order."""
    return [passage_text(t, x) for t, x in zip(corpus.column("title").to_pylist(), corpus.column("text").to_pylist())]


def query_texts(queries: pa.Table, ids: set[str] | None = None) -> dict[str, str]:
    """query_id -> text (only ``ids``, if given)."""
    if ids is not None:
        queries = queries.filter(pc.is_in(queries.column("query_id"), pa.array(sorted(ids), pa.string())))
    return dict(zip(queries.column("query_id").to_pylist(), queries.column("text").to_pylist()))


def doc_texts(corpus: pa.Table, ids: set[str] | None = None) -> dict[str, str]:
    """doc_id -> passage_text (only ``ids``, if given)."""
    if ids is not None:
        corpus = corpus.filter(pc.is_in(corpus.column("doc_id"), pa.array(sorted(ids), pa.string())))
    return dict(zip(corpus.column("doc_id").to_pylist(), passage_texts(corpus)))
