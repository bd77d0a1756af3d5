"""Negative passages per query, mined from retrievers' ranked lists (and optionally the corpus).

Which negatives a dense retriever trains on decides much of what it learns:
- ``topk``: every document of each miner's top ``depth`` that is not a positive. GPL (Wang et al.,
  2022) mines the top 50 of each of several retrievers (BM25 and dense models) and lets the teacher's
  margins, not the miner, decide how negative each one is.
- ``range``: ranks ``[lo, hi]`` of each miner's list (e.g. [10, 100]), skipping the very top, where
  unlabelled positives (false negatives) are most likely (RocketQA, Qu et al., 2021, denoise those;
  ANCE, Xiong et al., 2021, and Karpukhin et al., 2020, DPR, sample from the top of the list).
- ``random``: ``negatives_per_query`` easy negatives per query, uniformly from the corpus (DPR's "random"
  negatives), or -- without a corpus input -- ``negatives_per_query`` per query and miner from that miner's
  list below ``depth``.
- ``mix``: ``hard`` negatives per query and miner, sampled from the miner's top ``depth``, plus
  ``easy`` ones drawn as in ``random`` (never a document already picked as hard for the query).

Positives are never negatives: a document is a positive of a query if any qrels row of that query,
in any split of the table given, has score > 0. Sampling is deterministic for a seed and does not
depend on row order: ranked lists are subsampled by a hash of (seed, query, miner, document), corpus
draws by a random generator seeded with (seed, query).

Output (contract ``negatives``): query_id, doc_id, miner (the run's ``system``; ``random`` for corpus
draws), rank (the document's rank in that miner's list; 0 for corpus draws).
"""

from __future__ import annotations

import logging
import random
from typing import Literal

import duckdb
import pyarrow as pa
from pydantic import Field, PositiveInt, model_validator

from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.qrels import positive_rows

log = logging.getLogger("irflow.mine_negatives")

STRATEGIES = ("topk", "range", "random", "mix")
CORPUS_MINER = "random"
NEGATIVES_SCHEMA = pa.schema([("query_id", pa.string()), ("doc_id", pa.string()), ("miner", pa.string()),
                              ("rank", pa.int32())])


class MixCounts(Params):
    hard: PositiveInt = Field(description="hard negatives per query and miner, from its top `depth`")
    easy: PositiveInt = Field(description="easy negatives per query (from the corpus, or below `depth`)")


class MineParams(Params):
    strategy: Literal["topk", "range", "random", "mix"] = Field(
        "topk", description="topk: every non-positive of each miner's top `depth`; range: ranks `rank_range`; "
                            "random: `negatives_per_query` easy negatives; mix: `mix.hard` hard + `mix.easy` easy")
    depth: PositiveInt = Field(50, description="how deep each miner's ranked list is mined (miners retrieve this "
                                               "many hits per query)")
    rank_range: tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="range: the ranks [lo, hi] (inclusive) negatives come from")
    negatives_per_miner: PositiveInt | None = Field(
        None, description="topk/range: sample this many per query and miner (null: all)")
    negatives_per_query: PositiveInt | None = Field(None, description="random: negatives per query")
    mix: MixCounts | None = Field(None, description="mix: how many hard and easy negatives")
    seed: int = Field(42, description="sampling seed")

    @model_validator(mode="after")
    def _strategy_fields(self):
        needs = {"range": "rank_range", "random": "negatives_per_query", "mix": "mix"}
        for strategy, name in needs.items():
            if getattr(self, name) is not None and self.strategy != strategy:
                raise ValueError(f"{name}: only used with strategy {strategy} (strategy is {self.strategy})")
        if self.strategy in needs and getattr(self, needs[self.strategy]) is None:
            raise ValueError(f"{needs[self.strategy]}: required with strategy {self.strategy}")
        if self.negatives_per_miner is not None and self.strategy not in ("topk", "range"):
            raise ValueError(f"negatives_per_miner: only used with strategy topk or range (strategy is {self.strategy})")
        if self.rank_range is not None:
            lo, hi = self.rank_range
            if lo > hi:
                raise ValueError(f"rank_range: [lo, hi] with lo <= hi, got {list(self.rank_range)}")
            if hi > self.depth:
                raise ValueError(f"rank_range: reaches rank {hi}, below the mined depth {self.depth}; raise depth")
        return self


def _runs_table(tables: list[pa.Table]) -> pa.Table:
    """All runs in one table; the miner is the run's system. Two inputs may not share a system."""
    seen: dict[str, int] = {}
    parts = []
    for i, t in enumerate(tables):
        for s in t.column("system").unique().to_pylist():
            if s in seen:
                raise ValueError(f"mine_negatives: runs {seen[s]} and {i} are both system '{s}'; "
                                 "miner names must be distinct")
            seen[s] = i
        parts.append(t.select(["query_id", "doc_id", "rank", "system"]).cast(
            pa.schema([("query_id", pa.string()), ("doc_id", pa.string()), ("rank", pa.int32()),
                       ("system", pa.string())])))
    return pa.concat_tables(parts)


def positives_table(qrels: pa.Table) -> pa.Table:
    """Distinct (query, doc) judged positive in any split: never negatives."""
    t = positive_rows(qrels).select(["query_id", "doc_id"])
    pairs = sorted(set(zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist())))
    return pa.table({"query_id": pa.array([q for q, _ in pairs], pa.string()),
                     "doc_id": pa.array([d for _, d in pairs], pa.string())})


def mine_tables(runs: list[pa.Table], qrels: pa.Table, corpus_doc_ids: list[str] | None, p: MineParams) -> pa.Table:
    """Negatives from run tables (see the module doc); the plain function behind the stage."""
    if not runs:
        raise ValueError("mine_negatives: no runs to mine")
    with duckdb.connect() as con:
        return _mine(con, runs, qrels, corpus_doc_ids, p)


def _mine(con, runs, qrels, corpus_doc_ids, p: MineParams) -> pa.Table:
    strategy, top_k, seed = p.strategy, p.depth, p.seed
    con.register("runs_raw", _runs_table(runs))
    con.register("pos", positives_table(qrels))
    # One row per (query, miner, doc) at its best rank; positives removed.
    con.execute("""
        CREATE TEMP TABLE cand AS
        SELECT b.* FROM (SELECT query_id, doc_id, system AS miner, min(rank) AS rank
                         FROM runs_raw GROUP BY query_id, doc_id, system) b
        WHERE NOT EXISTS (SELECT 1 FROM pos p WHERE p.query_id = b.query_id AND p.doc_id = b.doc_id)
    """)
    positives = con.sql("SELECT * FROM pos").to_arrow_table()

    def from_lists(where: str, n: int | None, salt: str) -> pa.Table:
        """Candidates matching ``where``; if ``n``, a seeded sample of n per (query, miner)."""
        sql = f"SELECT query_id, doc_id, miner, rank FROM cand WHERE {where}"
        if n is not None:
            # md5 of (seed, salt, ids): a deterministic shuffle, independent of row order and of the
            # DuckDB version (unlike hash()).
            sql = (f"SELECT query_id, doc_id, miner, rank FROM (SELECT *, row_number() OVER (PARTITION BY query_id, miner "
                   f"ORDER BY md5(concat_ws(':', ?, ?, query_id, miner, doc_id))) AS k FROM ({sql})) WHERE k <= {int(n)}")
            return con.sql(sql, params=[str(seed), salt]).to_arrow_table()
        return con.sql(sql).to_arrow_table()

    def easy(m: int, hard: pa.Table | None) -> pa.Table:
        if corpus_doc_ids is None:
            return from_lists(f"rank > {top_k}", m, "easy")
        query_ids = con.execute("SELECT DISTINCT query_id FROM runs_raw ORDER BY query_id").fetchall()
        return corpus_draws([q for (q,) in query_ids], corpus_doc_ids, positives, hard, m, seed)

    if strategy == "topk":
        out = [from_lists(f"rank <= {top_k}", p.negatives_per_miner, "topk")]
    elif strategy == "range":
        lo, hi = p.rank_range
        out = [from_lists(f"rank BETWEEN {lo} AND {hi}", p.negatives_per_miner, "range")]
    elif strategy == "random":
        out = [easy(p.negatives_per_query, None)]
    else:
        hard = from_lists(f"rank <= {top_k}", p.mix.hard, "hard")
        out = [hard, easy(p.mix.easy, hard)]
    con.register("result", pa.concat_tables([t.cast(NEGATIVES_SCHEMA) for t in out]))
    table = con.sql("SELECT * FROM result ORDER BY query_id, miner, rank, doc_id").to_arrow_table()
    if table.num_rows == 0:
        log.warning("mine_negatives: no negatives (strategy %s)", strategy)
    return table.cast(NEGATIVES_SCHEMA)


def corpus_draws(query_ids: list[str], doc_ids: list[str], positives: pa.Table, taken: pa.Table | None, m: int,
                 seed: int) -> pa.Table:
    """``m`` documents per query drawn uniformly from the corpus, never a positive of the query nor a
    document already chosen for it (``taken``), without replacement."""
    exclude: dict[str, set[str]] = {}
    for t in (positives, taken):
        if t is not None:
            for q, d in zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist()):
                exclude.setdefault(q, set()).add(d)
    n = len(doc_ids)
    out: dict[str, list] = {"query_id": [], "doc_id": [], "miner": [], "rank": []}
    for q in query_ids:
        excl = exclude.get(q, set())
        rng = random.Random(f"{seed}:{q}:corpus")
        # Draw a few extra so that excluded documents can be skipped without a second draw.
        picks = [doc_ids[i] for i in rng.sample(range(n), min(n, m + len(excl)))]
        picks = [d for d in picks if d not in excl][:m]
        out["query_id"] += [q] * len(picks)
        out["doc_id"] += picks
        out["miner"] += [CORPUS_MINER] * len(picks)
        out["rank"] += [0] * len(picks)
    return pa.table(out, schema=NEGATIVES_SCHEMA)


@stage("mine_negatives", version="2", outputs=Output("negatives", "negatives"))
def mine_negatives(p: MineParams, rt: StageRuntime, *, rankings: list[DatasetRef], qrels: DatasetRef,
                   corpus: DatasetRef | None = None) -> pa.Table:
    """Negatives per query from ``rankings`` (one system per miner), never a positive in ``qrels``;
    ``corpus`` (optional) is where random/easy negatives are drawn from."""
    doc_ids = corpus.table(columns=["doc_id"]).column("doc_id").to_pylist() if corpus is not None else None
    return mine_tables([r.table() for r in rankings], qrels.table(), doc_ids, p)
