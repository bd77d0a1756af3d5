"""Document expansion with generated queries: doc2query / docTTTTTquery.

Nogueira, Yang, Lin & Cho (2019), "Document Expansion by Query Prediction", and Nogueira & Lin
(2019), "From doc2query to docTTTTTquery": append the queries a seq2seq model predicts for a passage
to the passage's text, then index the expanded corpus with BM25. The expansion adds the words users
would search with (and re-weights the passage's own salient words), so it is a strong sparse
baseline built from the same generated queries a GPL student trains on.

The stage is sharded by corpus (``irflow.engine.shards``): each shard of ``runtime.shard_rows`` passages is
expanded on its own, reading the generated queries and qrels whole (they are small next to a shard of
passages) and keeping the judgements of its own passages only; a passage's expansion depends on its own
queries alone, so the expanded corpus is the same, byte for byte, for any shards.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa
from pydantic import Field, PositiveInt

from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef


class Doc2QueryParams(Params):
    separator: str = Field(" ", description="what joins the passage and each appended query")
    max_queries: PositiveInt | None = Field(None, description="append at most n queries per passage (null: all)")


def expand_corpus(corpus: pa.Table, queries: pa.Table, qrels: pa.Table, separator: str = " ",
                  max_queries: int | None = None) -> pa.Table:
    """The corpus with each passage's generated queries appended to its text.

    A query belongs to the passage its qrels rows (score > 0) point to; queries are appended in the
    order of the queries table (generation order), at most ``max_queries`` per passage. Passages
    keep their order; a passage without queries is unchanged.
    """
    with duckdb.connect() as con:
        return _expand(con, corpus, queries, qrels, separator, max_queries)


def _expand(con, corpus: pa.Table, queries: pa.Table, qrels: pa.Table, separator: str, max_queries) -> pa.Table:
    # Explicit positions: a parallel scan does not promise row order, and both orders matter here.
    con.register("cn", corpus.select(["doc_id", "title", "text"]).append_column(
        "pos", pa.array(range(corpus.num_rows), pa.int64())))
    con.register("qn", queries.select(["query_id", "text"]).append_column(
        "qpos", pa.array(range(queries.num_rows), pa.int64())))
    con.register("r", qrels.select(["query_id", "doc_id", "score"]))
    # Only the judgements of these passages (a shard's): the others' expansions would be dropped anyway.
    limit = f"WHERE k <= {int(max_queries)}" if max_queries else ""
    return con.sql(f"""
        WITH pairs AS (SELECT DISTINCT r.doc_id, qn.text, qn.qpos
                       FROM r JOIN qn USING (query_id)
                       WHERE r.score > 0 AND r.doc_id IN (SELECT doc_id FROM cn)),
             ranked AS (SELECT *, row_number() OVER (PARTITION BY doc_id ORDER BY qpos) AS k FROM pairs),
             exp AS (SELECT doc_id, string_agg(text, ? ORDER BY qpos) AS expansion FROM ranked {limit} GROUP BY doc_id)
        SELECT cn.doc_id, cn.title,
               CASE WHEN exp.expansion IS NULL THEN cn.text ELSE cn.text || ? || exp.expansion END AS text
        FROM cn LEFT JOIN exp USING (doc_id)
        ORDER BY cn.pos
    """, params=[separator, separator]).to_arrow_table()


# version 1 still: sharding (and reading only a shard's judgements) changes no output byte
@stage("doc2query_expand", version="1", outputs=Output("corpus", "corpus"), shard="corpus")
def doc2query_expand(p: Doc2QueryParams, rt: StageRuntime, *, corpus: DatasetRef, queries: DatasetRef,
                     qrels: DatasetRef) -> pa.Table:
    """Expanded corpus (doc2query): the corpus, with the generated ``queries`` whose ``qrels`` point to a
    passage appended to it. Index the result with ``bm25_index`` for the docT5query baseline. Computed in
    shards of the corpus (see the module doc)."""
    return expand_corpus(corpus.table(), queries.table(), qrels.table(), p.separator, p.max_queries)
