"""Streaming writes (`write_rows`, `Store.stage_table` of a parquet file) give the bytes -- and so the
dataset id -- of the in-memory path for the same rows, however the rows arrive; on real SciFact rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from irflow.data_contracts import ContractError
from irflow.dev.testing import scifact_docs
from irflow.engine import store as store_module
from irflow.engine.store import TABLE_FILE, Store, parquet_batches, write_rows


@pytest.fixture(scope="module")
def corpus() -> pa.Table:
    return scifact_docs(10**6)  # all 5183 SciFact documents


@pytest.fixture(params=[1000, store_module.ROW_GROUP], ids=["row_group_1000", "row_group_default"])
def row_group(request, monkeypatch) -> int:
    """1000 puts several row-group boundaries inside SciFact (the default, 128k, holds it in one)."""
    monkeypatch.setattr(store_module, "ROW_GROUP", request.param)
    return request.param


def in_memory_bytes(store: Store, contract: str, table: pa.Table) -> bytes:
    staging, _ = store.stage_table(contract, table)
    return (staging / TABLE_FILE).read_bytes()


def split_files(table: pa.Table, cuts: list[int], folder) -> list:
    """``table`` written as consecutive parquet files cut at ``cuts``, each with its own row groups."""
    bounds = [0, *cuts, table.num_rows]
    files = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        files.append(folder / f"part-{i}.parquet")
        pq.write_table(table.slice(a, b - a), files[-1], row_group_size=451)
    return files


def test_streamed_corpus_is_byte_identical_to_in_memory(tmp_path, corpus, row_group):
    store = Store(tmp_path / "s")
    expected = in_memory_bytes(store, "corpus", corpus)
    assert pq.ParquetFile(pa.BufferReader(expected)).metadata.num_row_groups == -(-corpus.num_rows // row_group)

    one_file = tmp_path / "stage-output.parquet"
    pq.write_table(corpus, one_file, row_group_size=777)
    staging, rows = store.stage_table("corpus", one_file)
    assert rows == corpus.num_rows
    assert (staging / TABLE_FILE).read_bytes() == expected

    files = split_files(corpus, [1200, 1207, 3001], tmp_path)
    inputs = {
        "batches_of_333": corpus.to_batches(max_chunksize=333),
        "batches_on_row_group_boundaries": corpus.to_batches(max_chunksize=min(row_group, 1000)),
        "one_table_per_call": [corpus.slice(0, 2500), corpus.slice(2500)],
        "four_files_in_order": (b for f in files for b in parquet_batches(f, batch_size=500)),
    }
    for name, batches in inputs.items():
        dest = tmp_path / f"{name}.parquet"
        assert write_rows("corpus", batches, dest) == corpus.num_rows, name
        assert dest.read_bytes() == expected, name
    assert store.publish_table("corpus", "corpus", one_file)[0] == store.publish_table("corpus", "corpus", corpus)[0]


def test_streamed_run_keeps_ranks_across_row_groups_and_empty_runs(tmp_path, monkeypatch):
    """A query's ranking cut by a row-group (and batch) boundary still has contiguous ranks: the checks
    see the whole file, not one batch. An empty run is one empty row group on both paths."""
    monkeypatch.setattr(store_module, "ROW_GROUP", 100)
    docs = scifact_docs(90)
    n = docs.num_rows
    run = pa.table({"query_id": ["q1"] * n + ["q2"] * n, "doc_id": docs.column("doc_id").to_pylist() * 2,
                    "rank": pa.array(list(range(1, n + 1)) * 2, pa.int32()),
                    "score": pa.array([float(-r) for r in range(1, n + 1)] * 2, pa.float32()),
                    "system": ["bm25"] * (2 * n)})
    store = Store(tmp_path / "s")
    dest = tmp_path / "run.parquet"
    assert write_rows("run", run.to_batches(max_chunksize=70), dest) == 2 * n
    assert dest.read_bytes() == in_memory_bytes(store, "run", run)

    empty = run.schema.empty_table()
    assert write_rows("run", [], tmp_path / "empty.parquet") == 0
    assert (tmp_path / "empty.parquet").read_bytes() == in_memory_bytes(store, "run", empty)


def test_streaming_checks_the_whole_file_and_leaves_nothing(tmp_path, corpus):
    """A doc id repeated in another batch (another file) breaks the contract: no batch alone shows it."""
    store = Store(tmp_path / "s")
    files = split_files(corpus.slice(0, 1000), [600], tmp_path)
    pq.write_table(corpus.slice(10, 1), tmp_path / "repeat.parquet")
    dest = tmp_path / "out.parquet"
    with pytest.raises(ContractError, match=r"1 duplicate doc_id value\(s\)"):
        write_rows("corpus", (b for f in [*files, tmp_path / "repeat.parquet"] for b in parquet_batches(f)), dest)
    assert not dest.exists()

    wrong_type = corpus.slice(0, 5).set_column(0, "doc_id", pa.array(range(5)))
    pq.write_table(wrong_type.append_column("extra", pa.array(range(5))), tmp_path / "extra.parquet")
    with pytest.raises(ContractError, match="unexpected \\['extra'\\]"):
        store.stage_table("corpus", tmp_path / "extra.parquet")
    assert list((store.root / "tmp").iterdir()) == []
