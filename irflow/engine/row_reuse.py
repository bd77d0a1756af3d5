"""Row-level reuse: a map stage computes only the rows of its input that it has not computed before.

A stage declared with ``shard=`` is a map over one input (``irflow.engine.shards``): its output rows for an
input row depend on that row alone, never on its neighbours. When it also declares ``rows=RowMap(...)``
(encode_corpus, generate_queries), a result it published for an earlier version of that input is reused
row by row, whatever else changed in the input:

    row family = sha256(stage, code version, params, every other input's id, the stage's row context)
    a row is reused when an earlier computation of the same family holds a row with the same key
    (``doc_id``) and the same content (a digest of every column of the row)

So after documents were added, edited or removed, only the new and edited passages are encoded (or have
queries generated); a deleted passage's rows are dropped; a corpus that only shrank computes nothing. The
rows to compute go through the stage's shards as any input would (resumed after a kill, on Ray with
executor ray); then every output is assembled in the new input's order from the earlier output's rows
and the computed ones. The published dataset is the one a cold run on the new input publishes, byte for
byte (same rows, same order, ``irflow.engine.store.write_parts``), so its id does not say what was reused; the
stage run's record does (``rows``: input, computed, reused, and the dataset the reused rows came from).

A stage's row context is what its rows depend on besides their own content (generate_queries'
``queries_per_passage: auto`` depends on the corpus size): a different context is a different family.
What depends on the whole input (a BM25 or faiss index, searches over it, training) has no row map: it
recomputes. The earlier computation used is the latest one of the family whose datasets are still in the
store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from irflow.engine.cache import hash_payload, key_payload
from irflow.engine.store import TABLE_FILE, DatasetRef

log = logging.getLogger("irflow.rows")

#: rows taken from the assembled tables at once (bounded memory while merging)
MERGE_ROWS = 65_536


@dataclass(frozen=True)
class RowMap:
    """How a map stage's output rows belong to its input rows.

    ``key``: the input's id column (each input row has a distinct one). ``owners``: per output, the
    column holding the input row's key each output row came from, or a function of the output table
    returning those keys. ``context(params, input_rows)``: what the rows depend on besides their own
    content (JSON-able; None: nothing). ``when(params)``: whether these params keep rows independent
    (t5 sampling in batches does not)."""

    key: str
    owners: dict[str, str | Callable[[pa.Table], list]]
    context: Callable[[Any, int], Any] | None = None
    when: Callable[[Any], bool] | None = None  # for which params rows are independent (None: all)

    def applies(self, params) -> bool:
        return self.when is None or bool(self.when(params))

    def owner_keys(self, output: str, table: pa.Table) -> list:
        how = self.owners[output]
        return table.column(how).to_pylist() if isinstance(how, str) else list(how(table))


def family(stage, params, inputs: dict, role: str, num_rows: int) -> str:
    """The row family of a stage call: everything in its cache key except the mapped input's id, plus the
    stage's row context."""
    rows: RowMap = stage.rows
    payload = key_payload(stage.name, stage.version, params.key_dump(),
                          {k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in inputs.items() if k != role})
    return hash_payload({**payload, "context": rows.context(params, num_rows) if rows.context else None})


def row_digests(ref: DatasetRef, key: str) -> tuple[list, list[str]]:
    """(keys, content digests) of a table's rows, in order: md5 over every column of the row (DuckDB)."""
    import duckdb

    schema = pq.read_schema(ref.parquet)
    cols = ", ".join(f"coalesce(CAST({_ident(n)} AS VARCHAR), chr(0))" for n in schema.names)
    with duckdb.connect() as con:
        t = con.sql(f"SELECT {_ident(key)} AS k, md5(concat_ws(chr(31), {cols})) AS d FROM read_parquet(?)",
                    params=[ref.parquet]).to_arrow_table()
    return t.column("k").to_pylist(), t.column("d").to_pylist()


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@dataclass
class Reuse:
    """What one stage call reuses: which input rows to compute, and where the others' rows are."""

    keys: list  # the new input's keys, in order
    source: dict  # key -> index in ``earlier`` of the computation whose rows it reuses (absent: computed)
    todo: DatasetRef | None  # the rows to compute, as a table of their own (None: none)
    earlier: list[dict]  # earlier computations rows are reused from: {outputs: {name: ref}, run_id}
    work: Path  # where the rows to compute and their shards' parts are (resumed after a kill)

    @property
    def reused(self) -> int:
        return len(self.source)

    @property
    def computed(self) -> int:
        return len(self.keys) - len(self.source)

    def record(self) -> dict:
        out = {"input": len(self.keys), "computed": self.computed, "reused": self.reused}
        if self.source:  # where the reused rows came from: run -> rows
            used: dict[str, int] = {}
            for i in self.source.values():
                used[self.earlier[i]["run_id"]] = used.get(self.earlier[i]["run_id"], 0) + 1
            out["reused_from"] = used
        return out


def find_reuse(stage, role: str, inputs: dict, earlier: list[dict], work: Path) -> Reuse:
    """What a call whose mapped input is ``inputs[role]`` reuses, given earlier computations of its
    family, newest first (``earlier``: [{input: ref, outputs: {name: ref}, run_id}]): a row is taken from
    the newest one that has it unchanged. The rows to compute and their parts go to a folder of ``work``
    named by those rows (a table that still says how many rows the whole input has), so that a resumed
    computation finds its own parts only."""
    ref: DatasetRef = inputs[role]
    keys, digests = row_digests(ref, stage.rows.key)
    source: dict = {}
    for i, e in enumerate(earlier):
        before = dict(zip(*row_digests(e["input"], stage.rows.key)))
        for k, d in zip(keys, digests):
            if k not in source and before.get(k) == d:
                source[k] = i
        if len(source) == len(keys):
            break
    if not source:
        return Reuse(keys, {}, ref, [], work)
    used = sorted(set(source.values()))  # only the computations rows are taken from
    earlier = [earlier[i] for i in used]
    source = {k: used.index(i) for k, i in source.items()}
    todo = None
    take = [i for i, k in enumerate(keys) if k not in source]
    work = work / ("rows-" + hash_payload({"earlier": [{k: r.id for k, r in e["outputs"].items()} for e in earlier],
                                           "take": take})[:16])
    work.mkdir(parents=True, exist_ok=True)
    if take:
        path = work / TABLE_FILE
        if not path.exists():  # (a resumed computation finds the same rows here)
            tmp = work / f".{TABLE_FILE}.tmp"
            pq.write_table(ref.table().take(pa.array(take, pa.int64())), tmp, compression="zstd")
            tmp.replace(path)
        todo = DatasetRef(f"{ref.id}~{len(take)}", ref.name, "table", ref.contract, str(work), total=len(keys))
    return Reuse(keys, source, todo, earlier, work)


def merged(stage, output: str, reuse: Reuse, computed: list[Path]):
    """An output's rows in the new input's order: each input row's rows from the earlier output it is
    reused from, or from the computed parts, in batches (``irflow.engine.store.write_parts`` takes them)."""
    rows: RowMap = stage.rows
    sources = [e["outputs"][output].table() for e in reuse.earlier]
    if computed:
        sources.append(pa.concat_tables([pq.read_table(p) for p in computed]) if len(computed) > 1
                       else pq.read_table(computed[0]))
    if not sources:
        return
    schema = sources[0].schema
    table = pa.concat_tables([s.cast(schema) for s in sources]) if len(sources) > 1 else sources[0]
    offset, where = 0, {}
    for i, s in enumerate(sources):
        # a key's rows come from the one source it was assigned (an earlier output), or the computed parts
        mine = len(reuse.earlier) if i == len(reuse.earlier) else i
        for j, k in enumerate(rows.owner_keys(output, s)):
            if reuse.source.get(k, len(reuse.earlier)) == mine:
                where.setdefault(k, []).append(offset + j)
        offset += s.num_rows
    order = [j for k in reuse.keys for j in where.get(k, ())]
    for a in range(0, len(order), MERGE_ROWS):
        yield table.take(pa.array(order[a:a + MERGE_ROWS], pa.int64()))
