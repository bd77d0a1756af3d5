"""Data contracts: the one place that says what every dataset looks like.

A contract is a pyarrow schema plus checks. Every table a stage produces is validated against its
contract *before* it is published to the store, so a dataset in the store is always well formed.
Checks run in DuckDB directly over the Arrow table (no copy), which keeps them fast on whole BEIR
datasets. They also run over a parquet file as a ``pyarrow.dataset.Dataset`` (``Rows``), which DuckDB
scans batch by batch reading only the columns a check names: a corpus written by a streaming stage
is checked without ever being held in memory (see ``irflow.engine.store.write_rows``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.dataset as ds

from irflow.engine import memdb


class ContractError(ValueError):
    """A table broke its contract. The message names the contract and what is wrong, with counts."""


# What a check reads: a table in memory, or a parquet file scanned batch by batch.
Rows = pa.Table | ds.Dataset


def _num_rows(table: Rows) -> int:
    return table.num_rows if isinstance(table, pa.Table) else table.count_rows()


_LOCAL = threading.local()


@contextmanager
def _one_connection():
    """One DuckDB connection (a cursor of the process's in-memory instance, ``irflow.engine.memdb``) for every
    check of one validation, closed at its end. A new instance per query cost a GPL sample run 7 s
    (~220 queries), and one per validation still ~13 ms each. The instance itself lives as long as
    the process. Long-lived instances once went with a SIGSEGV: the BM25 indexer's forked child
    (``subprocess.run`` with a ``preexec_fn``, in a run with executor ray) died before it ran Java, in
    3 of tests/test_ray.py's runs. Children no longer run Python between fork and exec
    (``irflow.engine.processes.dying_with_parent``), and tests/test_ray.py passes with the instance kept."""
    con = _LOCAL.con = memdb.cursor()
    try:
        yield
    finally:
        _LOCAL.con = None
        con.close()


def _query(table: Rows, sql: str) -> list[tuple]:
    """``sql``'s rows with ``table`` as ``t``, in the validation's connection (a check called alone: its own)."""
    con = getattr(_LOCAL, "con", None)
    if con is None:
        with _one_connection():
            return _query(table, sql)
    con.register("t", table)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.unregister("t")


def _count(table: Rows, sql: str) -> int:
    return int(_query(table, sql)[0][0])


def _examples(table: Rows, sql: str, n: int = 3) -> list:
    return [r[0] for r in _query(table, f"{sql} LIMIT {n}")]


def check_unique_nonempty(column: str) -> Callable[[Rows], list[str]]:
    def check(table: Rows) -> list[str]:
        problems = []
        empty = _count(table, f"SELECT count(*) FROM t WHERE {column} IS NULL OR {column} = ''")
        if empty:
            problems.append(f"{empty} row(s) with an empty or null {column}")
        dup_sql = f"SELECT {column} FROM t WHERE {column} IS NOT NULL GROUP BY {column} HAVING count(*) > 1"
        dups = _count(table, f"SELECT count(*) FROM ({dup_sql})")
        if dups:
            problems.append(f"{dups} duplicate {column} value(s), e.g. {_examples(table, dup_sql)}")
        return problems

    return check


def check_not_null(*columns: str) -> Callable[[Rows], list[str]]:
    def check(table: Rows) -> list[str]:
        problems = []
        for c in columns:
            n = _count(table, f"SELECT count(*) FROM t WHERE {c} IS NULL")
            if n:
                problems.append(f"{n} row(s) with a null {c}")
        return problems

    return check


def check_ranks_contiguous(table: Rows) -> list[str]:
    """Ranks are 1..n within each (system, query) with no gaps or repeats."""
    bad = _count(
        table,
        "SELECT count(*) FROM (SELECT rank, row_number() OVER (PARTITION BY system, query_id ORDER BY rank) AS rn FROM t) "
        "WHERE rank <> rn",
    )
    return [f"{bad} row(s) whose rank is not contiguous (1..n) within its query"] if bad else []


def check_nonempty_table(table: Rows) -> list[str]:
    return [] if _num_rows(table) else ["the table has no rows"]


def check_no_duplicate_pairs(a: str, b: str, *extra: str) -> Callable[[Rows], list[str]]:
    cols = ", ".join((*extra, a, b))

    def check(table: Rows) -> list[str]:
        dup = _count(table, f"SELECT count(*) FROM (SELECT {cols} FROM t GROUP BY {cols} HAVING count(*) > 1)")
        return [f"{dup} duplicate ({cols}) pair(s)"] if dup else []

    return check


@dataclass(frozen=True)
class Contract:
    name: str
    schema: pa.Schema
    checks: tuple[Callable[[Rows], list[str]], ...] = field(default=())
    doc: str = ""

    def conform(self, table: pa.Table) -> pa.Table:
        """Select and cast the contract's columns (extra columns are an error, missing ones too)."""
        missing = [f.name for f in self.schema if f.name not in table.column_names]
        extra = [c for c in table.column_names if c not in self.schema.names]
        if missing or extra:
            raise ContractError(
                f"contract '{self.name}': columns do not match (missing {missing}, unexpected {extra}); "
                f"expected {self.schema.names}"
            )
        try:
            return table.select(self.schema.names).cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise ContractError(f"contract '{self.name}': wrong column types: {e}") from e

    def check(self, table: Rows) -> None:
        """Run the checks over conformed rows (``conform`` first: the checks assume its columns)."""
        with _one_connection():
            problems = [p for check in self.checks for p in check(table)]
        if problems:
            raise ContractError(f"contract '{self.name}' violated: " + "; ".join(problems))

    def validate(self, table: pa.Table) -> pa.Table:
        table = self.conform(table)
        self.check(table)
        return table


CORPUS = Contract(
    "corpus",
    pa.schema([("doc_id", pa.string()), ("title", pa.string()), ("text", pa.string())]),
    (check_nonempty_table, check_unique_nonempty("doc_id"), check_not_null("title", "text")),
    "One row per passage. title may be empty (''), never null.",
)

QUERIES = Contract(
    "queries",
    pa.schema([("query_id", pa.string()), ("text", pa.string())]),
    (check_nonempty_table, check_unique_nonempty("query_id"), check_not_null("text")),
    "One row per query.",
)

QRELS = Contract(
    "qrels",
    pa.schema(
        [("query_id", pa.string()), ("doc_id", pa.string()), ("score", pa.int32()), ("split", pa.string())]
    ),
    (check_not_null("query_id", "doc_id", "score", "split"), check_no_duplicate_pairs("query_id", "doc_id", "split")),
    "Relevance judgements, all splits in one table (split = train/dev/test).",
)

RUN = Contract(
    "run",
    pa.schema(
        [
            ("query_id", pa.string()),
            ("doc_id", pa.string()),
            ("rank", pa.int32()),
            ("score", pa.float32()),
            ("system", pa.string()),
        ]
    ),
    (check_not_null("query_id", "doc_id", "rank", "score", "system"), check_ranks_contiguous),
    "A ranked list per query; rank 1 is the best; ranks are contiguous per (system, query).",
)

EMBEDDINGS = Contract(
    "embeddings",
    pa.schema([("doc_id", pa.string()), ("embedding", pa.list_(pa.float32()))]),
    (check_nonempty_table, check_unique_nonempty("doc_id"), check_not_null("embedding")),
    "One vector per passage, in corpus order.",
)

PER_QUERY_METRICS = Contract(
    "per_query_metrics",
    pa.schema(
        [("system", pa.string()), ("query_id", pa.string()), ("metric", pa.string()), ("value", pa.float64())]
    ),
    (check_not_null("system", "query_id", "metric", "value"),),
)

METRICS = Contract(
    "metrics",
    pa.schema(
        [
            ("system", pa.string()),
            ("dataset", pa.string()),
            ("split", pa.string()),
            ("metric", pa.string()),
            ("value", pa.float64()),
            ("num_queries", pa.int64()),
            ("no_judged_doc", pa.int64()),
        ]
    ),
    (check_not_null("system", "metric", "value"),),
    "One row per (system, metric): the mean over num_queries evaluated queries, of which no_judged_doc "
    "have no judged document in the corpus (they score 0; null: the corpus was not given).",
)

NEGATIVES = Contract(
    "negatives",
    pa.schema(
        [("query_id", pa.string()), ("doc_id", pa.string()), ("miner", pa.string()), ("rank", pa.int32())]
    ),
    (check_not_null("query_id", "doc_id", "miner", "rank"), check_no_duplicate_pairs("query_id", "doc_id", "miner")),
    "Hard negatives per query: which miner found each and at which rank of that miner's list. "
    "Positives (the query's qrels) are never negatives.",
)

PSEUDO_LABELS = Contract(
    "pseudo_labels",
    pa.schema(
        [
            ("query_id", pa.string()),
            ("pos_doc_id", pa.string()),
            ("neg_doc_id", pa.string()),
            ("pos_score", pa.float32()),
            ("neg_score", pa.float32()),
            ("margin", pa.float32()),
        ]
    ),
    (check_nonempty_table, check_not_null("query_id", "pos_doc_id", "neg_doc_id", "pos_score", "neg_score", "margin")),
    "Margin-MSE training examples: teacher scores of (q, pos) and (q, neg); margin = pos - neg, "
    "already scaled to the student's similarity.",
)

TRIPLE_SCORES = Contract(
    "triple_scores",
    pa.schema(
        [
            ("query_id", pa.string()),
            ("pos_doc_id", pa.string()),
            ("neg_doc_id", pa.string()),
            ("pos_score", pa.float64()),
            ("neg_score", pa.float64()),
        ]
    ),
    (check_not_null("query_id", "pos_doc_id", "neg_doc_id", "pos_score", "neg_score"),),
    "A teacher's raw scores of (query, positive, negative) training triples, in the queries' order: what "
    "pseudo_label scales into pseudo_labels. Scores in the teacher's units (a logit, a fused score), kept "
    "in float64 so that scaling them gives the same float32 labels as scaling the teacher's output itself. "
    "May be empty per shard; pseudo_label refuses an empty whole.",
)


def check_probability(column: str) -> Callable[[Rows], list[str]]:
    def check(table: Rows) -> list[str]:
        bad = _count(table, f"SELECT count(*) FROM t WHERE {column} < 0 OR {column} > 1 OR isnan({column})")
        return [f"{bad} row(s) whose {column} is not a probability in [0, 1]"] if bad else []

    return check


CANDIDATE_SCORES = Contract(
    "candidate_scores",
    pa.schema(
        [
            ("query_id", pa.string()),
            ("doc_id", pa.string()),
            ("rank", pa.int32()),
            ("score", pa.float32()),
            ("positive", pa.bool_()),
        ]
    ),
    (check_nonempty_table, check_not_null("query_id", "doc_id", "rank", "score", "positive"),
     check_no_duplicate_pairs("query_id", "doc_id")),
    "A teacher's raw scores of a retriever's top candidates per labelled query: rank in the retriever's "
    "list (0: a judged positive the retriever did not return), the raw score (a logit, a fused score), "
    "and whether the pair is a judged positive. What denoising thresholds, once calibrated; for unlabelled "
    "queries (augmentation) the top candidates only, none positive.",
)

TEACHER_SCORES = Contract(
    "teacher_scores",
    pa.schema(
        [
            ("query_id", pa.string()),
            ("doc_id", pa.string()),
            ("rank", pa.int32()),
            ("score", pa.float32()),
            ("prob", pa.float32()),
            ("positive", pa.bool_()),
        ]
    ),
    (check_not_null("query_id", "doc_id", "rank", "score", "prob", "positive"),
     check_no_duplicate_pairs("query_id", "doc_id"), check_probability("prob")),
    "A teacher's scores of a retriever's candidates: rank in the retriever's list (0: a judged positive "
    "the retriever did not return), the raw score, its probability of relevance (calibrated), and whether "
    "the pair is a judged positive.",
)

DENOISE_AUDIT = Contract(
    "denoise_audit",
    pa.schema(
        [
            ("query_id", pa.string()),
            ("bucket", pa.string()),
            ("candidates", pa.int32()),
            ("known_positives", pa.int32()),
            ("dropped", pa.int32()),
            ("kept", pa.int32()),
        ]
    ),
    (check_not_null("query_id", "bucket", "candidates", "known_positives", "dropped", "kept"),
     check_no_duplicate_pairs("query_id", "bucket")),
    "Per query and rank bucket of the denoised list: candidates, judged positives among them, candidates "
    "dropped as likely false negatives (teacher probability >= the threshold, not judged), and negatives kept.",
)

def check_steps_contiguous(table: Rows) -> list[str]:
    """Steps are 1..n, each once: a history with a gap lost steps (a resume that dropped them)."""
    bad = _count(table, "SELECT count(*) FROM (SELECT step, row_number() OVER (ORDER BY step) AS rn FROM t) "
                        "WHERE step <> rn")
    return [f"{bad} row(s) whose step is not contiguous (1..n)"] if bad else []


TRAINING_LOSSES = Contract(
    "training_losses",
    pa.schema(
        [
            ("step", pa.int32()),
            ("loss", pa.float64()),
            ("lr", pa.float64()),
            ("candidates", pa.int32()),
        ]
    ),
    (check_nonempty_table, check_not_null("step", "loss", "lr"), check_steps_contiguous),
    "A trainer's loss history, one row per optimizer step (1..n, steps done before a resume included): the "
    "loss of the whole batch, the learning rate after the step (of the pretrained body where a fresh head has "
    "its own), and for dual encoders the passages each query was scored against (null for other trainers).",
)

CONTRACTS: dict[str, Contract] = {
    c.name: c
    for c in (CORPUS, QUERIES, QRELS, RUN, EMBEDDINGS, PER_QUERY_METRICS, METRICS, NEGATIVES, PSEUDO_LABELS,
              TRIPLE_SCORES, TEACHER_SCORES, DENOISE_AUDIT, CANDIDATE_SCORES, TRAINING_LOSSES)
}


def register(contract: Contract) -> Contract:
    """Later recipes add their contracts here (one registry, one place to read them all)."""
    CONTRACTS[contract.name] = contract
    return contract


def get(name: str) -> Contract:
    try:
        return CONTRACTS[name]
    except KeyError:
        raise KeyError(f"unknown data contract '{name}'; known: {sorted(CONTRACTS)}") from None


def dangling_qrels(qrels: pa.Table, queries: pa.Table, corpus: pa.Table) -> tuple[pa.Table, dict[str, int]]:
    """Split qrels into (kept rows, counts of rows that point to a missing query or document).

    BEIR's own data has such rows (ArguAna: 5), so the caller decides the policy.
    """
    # pyarrow keeps the row order (a DuckDB join over a multi-chunk table may not, which would make
    # the published bytes -- and so the dataset id -- differ from run to run).
    import pyarrow.compute as pc

    qcol, dcol = qrels.column("query_id"), qrels.column("doc_id")
    no_query = pc.invert(pc.is_in(qcol, value_set=queries.column("query_id").combine_chunks().cast(qcol.type)))
    no_doc = pc.invert(pc.is_in(dcol, value_set=corpus.column("doc_id").combine_chunks().cast(dcol.type)))
    either = pc.or_(no_query, no_doc)
    counts = [pc.sum(pc.cast(m, pa.int64())).as_py() or 0 for m in (no_query, no_doc, either)]
    kept = qrels.select(["query_id", "doc_id", "score", "split"]).filter(pc.invert(either))
    return kept, {"missing_query": int(counts[0]), "missing_doc": int(counts[1]), "dangling": int(counts[2])}


def queries_without_judged_doc(qrels: pa.Table, corpus: pa.Table, split: str | None = None,
                               among: set[str] | None = None) -> dict[str, set[str]]:
    """split -> the judged queries none of whose judged documents (of that split, any score) is in the
    corpus (of ``split`` only, if given; of the queries in ``among`` only, if given).

    Such a query can only score 0 (BEIR, pytrec_eval and Pyserini keep it in the average: the default
    ``dataset.dangling_qrels: keep``); dropping the dangling rows makes it vanish from the split instead.
    """
    import pyarrow.compute as pc

    if split is not None:
        qrels = qrels.filter(pc.equal(qrels.column("split"), split))
    if among is not None:
        qcol = qrels.column("query_id")
        qrels = qrels.filter(pc.is_in(qcol, value_set=pa.array(sorted(among), qcol.type)))
    dcol = qrels.column("doc_id")
    present = pc.is_in(dcol, value_set=corpus.column("doc_id").combine_chunks().cast(dcol.type))
    per_query = (pa.table({"split": qrels.column("split"), "query_id": qrels.column("query_id"), "present": present})
                 .group_by(["split", "query_id"]).aggregate([("present", "any")]))
    out: dict[str, set[str]] = {s: set() for s in per_query.column("split").to_pylist()}
    for s, q, has_doc in zip(*(per_query.column(c).to_pylist() for c in ("split", "query_id", "present_any"))):
        if not has_doc:
            out[s].add(q)
    return out
