"""The content-addressed dataset store.

Layout of a store directory::

    <root>/objects/<dataset_id>/      immutable; data.parquet for tables, the files themselves for
                                      models and indexes (Hugging Face / sentence-transformers format)
    <root>/tmp/                       staging: outputs are written here, validated, then renamed
    <root>/downloads/                 verified downloads (by md5)
    <root>/catalog.duckdb             the lineage catalog (see irflow.engine.catalog)

A dataset id is ``<name>-<first 16 hex of sha256 over its files>``: the same content always gets
the same id, so a stage that recomputes and produces identical bytes leaves everything downstream
cached (early cut-off).

Trust: the digest that names an object is also its checksum. The full sha256 (over every file's
relative path, size and bytes; see `fingerprint_dir`) is recorded in the catalog when an object is
published, and `Store.check` recomputes it before an object is reused from the cache or read by a
stage (once per process and file state: hashing runs at ~1-2 GB/s, see bench/results/verify.json).
A damaged object (a flipped byte, another run's file copied over it, a deleted file) is never used:
it is set aside under ``tmp/damaged-*`` and treated as missing, so it is recomputed and the fresh
copy takes its place. Published objects are read-only (files 0444, directories 0555).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from irflow import data_contracts

log = logging.getLogger("irflow")

DEFAULT_STORE = "store"
TABLE_FILE = "data.parquet"


@dataclass(frozen=True)
class DatasetRef:
    """A pointer to one published dataset. Small and picklable: this is what stages pass around."""

    id: str
    name: str
    kind: str  # "table" | "model" | "index"
    contract: str | None
    path: str
    digest: str | None = field(default=None, compare=False)  # full sha256 of the files, when known
    # A shard's view of a table: rows [start, stop) only (table() and batches() read just those row
    # groups). The id stays the whole table's: a shard is part of a stage keyed on the whole input.
    rows: tuple[int, int] | None = None
    # A table that stands for part of a bigger input (the rows a map stage still has to compute,
    # irflow.engine.row_reuse): the whole input's row count, which ``total_rows()`` then says.
    total: int | None = field(default=None, compare=False)

    @property
    def parquet(self) -> str:
        if self.kind != "table":
            raise TypeError(f"{self.id} is a {self.kind}, not a table")
        return str(Path(self.path) / TABLE_FILE)

    def num_rows(self) -> int:
        """Rows of the table (of the slice, for a shard's view), from the Parquet footer: reads no data."""
        if self.rows is not None:
            return self.rows[1] - self.rows[0]
        return pq.ParquetFile(self.parquet).metadata.num_rows

    def total_rows(self) -> int:
        """Rows of the whole table, even for a shard's view (a stage whose output depends on the size of
        its whole input, e.g. generate_queries' ``queries_per_passage: auto``): the Parquet footer."""
        if self.total is not None:
            return self.total
        return pq.ParquetFile(self.parquet).metadata.num_rows

    @property
    def row_offset(self) -> int:
        """Where this view's rows start in the whole table: 0, or a shard's first row (a stage whose
        output depends on a row's position, e.g. t5 generation's per-batch seeds)."""
        return self.rows[0] if self.rows is not None else 0

    def slice(self, start: int, stop: int) -> "DatasetRef":
        """This table's rows [start, stop) as a ref of its own (what one shard of a stage reads); it
        keeps ``row_offset`` (``start``) and ``total_rows()`` (the whole table's)."""
        return replace(self, rows=(start, stop))

    def table(self, columns: list[str] | None = None) -> pa.Table:
        try:
            if self.rows is None:
                return pq.read_table(self.parquet, columns=columns)
            return pa.Table.from_batches(list(self.batches(columns)), schema=self._schema(columns))
        except (OSError, pa.ArrowException) as e:
            # A raw "Unexpected end of stream" names no dataset; this names the one that is unreadable.
            from irflow.engine.errors import DataError

            raise DataError(f"dataset {self.id} ({self.parquet}) cannot be read: {e}; "
                            f"`irflow verify` checks the store") from e

    def _schema(self, columns: list[str] | None) -> pa.Schema:
        schema = pq.read_schema(self.parquet)
        return pa.schema([schema.field(c) for c in columns]) if columns else schema

    def batches(self, columns: list[str] | None = None, batch_size: int = 65_536):
        """The table's rows (the slice's, for a shard's view) as record batches, in order, reading only
        the row groups that hold them: memory stays one row group whatever the table's size."""
        f = pq.ParquetFile(self.parquet)
        start, stop = self.rows or (0, f.metadata.num_rows)
        offset = 0
        for g in range(f.metadata.num_row_groups):
            n = f.metadata.row_group(g).num_rows
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                part = f.read_row_group(g, columns=columns).slice(lo - offset, hi - lo)
                yield from part.to_batches(max_chunksize=batch_size)
            offset += n
            if offset >= stop:
                break

    def __str__(self) -> str:
        return self.id


def fingerprint_dir(path: Path) -> str:
    """sha256 over (relative path, size, bytes) of every file below ``path``, in sorted order."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        h.update(rel.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def fingerprint_file(path: Path, algo: str = "sha256") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


ROW_GROUP = 128_000
# Rows per batch read from a stage's parquet file (a small unit: what `write_rows` holds is bounded by
# ROW_GROUP, which the dataset ids fix, plus one batch).
READ_BATCH = 16_384


def _rechunk(table: pa.Table, rows: int) -> pa.Table:
    """The same table as chunks of exactly ``rows`` rows (the last one shorter)."""
    if table.num_rows <= rows:
        return table.combine_chunks()
    return pa.Table.from_batches(
        [b for i in range(0, table.num_rows, rows) for b in table.slice(i, rows).combine_chunks().to_batches()],
        schema=table.schema)


def write_parts(contract: str, parts: Iterable[pa.Table | Path], dest: Path, *, check: bool = True) -> int:
    """``write_rows`` of tables and/or Parquet files (a sharded stage's parts), in order: the bytes, and
    so the id, do not depend on how the rows were split into parts (tests/test_shards.py). The contract's
    checks run over the whole output (``check=False``: conform only, for a shard with no rows of its
    own: whether the whole may be empty is checked when the parts are assembled)."""
    def batches():
        for part in parts:
            yield from ([part] if isinstance(part, pa.Table) else parquet_batches(Path(part)))

    return write_rows(contract, batches(), dest, check=check)


def _write_parquet(table: pa.Table, dest: Path) -> None:
    # Deterministic bytes: no statistics timestamps exist in parquet; fixed row-group size; and
    # fixed chunking (page boundaries follow the in-memory chunks, so the same rows chunked
    # differently by two producers would otherwise get two ids).
    pq.write_table(_rechunk(table, ROW_GROUP), dest, row_group_size=ROW_GROUP, compression="zstd")


def write_rows(contract: str, batches: Iterable[pa.RecordBatch | pa.Table], dest: Path, *, check: bool = True) -> int:
    """Write ``batches`` (in order) to the parquet file ``dest``, validated against ``contract``; returns
    the number of rows. Memory: at most one row group's rows and their combined copy, whatever the total.

    The file is byte for byte the one `Store.stage_table` writes for the same rows as one table in
    memory, however they are batched (so the dataset id is too): each ``ROW_GROUP`` rows become one
    row group written from one combined chunk, with the same writer settings. Each batch is conformed
    to the contract's schema as it comes; the checks (unique ids, contiguous ranks, ...) then run over
    the written file, scanned batch by batch. On any error ``dest`` is removed.
    """
    c = data_contracts.get(contract)
    dest = Path(dest)
    num_rows = 0
    try:
        with pq.ParquetWriter(dest, c.schema, compression="zstd") as writer:
            pending: list[pa.Table] = []  # conformed rows not yet written, fewer than ROW_GROUP
            pending_rows = 0
            for batch in batches:
                t = c.conform(pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch)
                if not t.num_rows:
                    continue
                pending.append(t)
                pending_rows += t.num_rows
                while pending_rows >= ROW_GROUP:
                    pending = _write_row_group(writer, pending)
                    pending_rows -= ROW_GROUP
                    num_rows += ROW_GROUP
            if pending_rows or not num_rows:
                # pq.write_table writes one empty row group for an empty table: so does this
                last = pa.concat_tables(pending) if pending else c.schema.empty_table()
                writer.write_table(last.combine_chunks(), row_group_size=ROW_GROUP)
                num_rows += pending_rows
        if check:
            c.check(ds.dataset(dest, format="parquet"))
        return num_rows
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    finally:
        # The allocator keeps freed row groups for reuse: without this a 518k-passage corpus leaves the
        # process ~0.4 GB larger for every later stage (RSS after 665 MB, 237 MB with it).
        pa.default_memory_pool().release_unused()


def _write_row_group(writer: pq.ParquetWriter, pending: list[pa.Table]) -> list[pa.Table]:
    """Write the first ROW_GROUP of the ``pending`` rows as one row group from one combined chunk;
    returns the rows left. A function of its own so that nothing outlives the write: the consumed
    batches and the combined copy (one row group each) are freed before the next rows are read."""
    rows = pa.concat_tables(pending)
    pending.clear()
    writer.write_table(rows.slice(0, ROW_GROUP).combine_chunks(), row_group_size=ROW_GROUP)
    return [rows.slice(ROW_GROUP)]


def parquet_batches(path: Path, batch_size: int = READ_BATCH, columns: list[str] | None = None
                    ) -> Iterable[pa.RecordBatch]:
    """A parquet file's rows as record batches, in file order, never the whole file at once."""
    with pq.ParquetFile(path) as f:
        # One row group at a time: iter_batches over the whole file reads ahead of a slow consumer
        # (466 MB of Arrow memory for a 0.4 GB file, 71 MB this way).
        for row_group in range(f.num_row_groups):
            yield from f.iter_batches(batch_size=batch_size, row_groups=[row_group], columns=columns)


class Store:
    def __init__(self, root: str | os.PathLike = DEFAULT_STORE):
        self.root = Path(root).resolve()
        for sub in ("objects", "tmp", "downloads"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def catalog_path(self) -> Path:
        return self.root / "catalog.duckdb"

    def staging_dir(self) -> Path:
        # The owner's pid is in the name: `irflow gc` and the next run reclaim dirs of dead processes.
        d = self.root / "tmp" / f"{os.getpid()}-{uuid.uuid4().hex}"
        d.mkdir(parents=True)
        return d

    def object_dir(self, dataset_id: str) -> Path:
        return self.root / "objects" / dataset_id

    def holds(self, ref: DatasetRef) -> bool:
        """Whether ``ref`` is an object of this store (not a source or a model found elsewhere)."""
        p = Path(ref.path) if ref.path else None
        return p is not None and p.parent == self.root / "objects" and p.name == ref.id

    # ---- trust ---------------------------------------------------------------------------------
    def check(self, ref: DatasetRef, rehash: bool = False) -> str | None:
        """None if the object's files still hash to its digest; else what is wrong, in words.
        Objects outside this store (sources, local models) are keyed by their own fingerprint and
        are not checked here. ``rehash``: ignore this process's earlier checks (`irflow verify`)."""
        if not self.holds(ref):
            return None
        path = Path(ref.path)
        if not path.is_dir():
            return "missing"
        expected = ref.digest or ref.id.rsplit("-", 1)[-1]
        state = _dir_state(path)
        if not rehash and _VERIFIED.get(str(path)) == (state, expected):
            return None
        digest = fingerprint_dir(path)
        if not digest.startswith(expected):
            return f"damaged (its files hash to {digest[:16]}, not {expected[:16]})"
        _VERIFIED[str(path)] = (state, expected)
        return None

    def set_aside(self, ref: DatasetRef) -> Path | None:
        """Move a damaged object out of the way (to tmp/damaged-*), so it reads as missing."""
        path = Path(ref.path)
        if not path.exists():
            return None
        dest = self.root / "tmp" / f"damaged-{ref.id}-{uuid.uuid4().hex[:8]}"
        make_writable(path)
        os.rename(path, dest)
        _VERIFIED.pop(str(path), None)
        return dest

    # ---- leftovers ------------------------------------------------------------------------------
    def dead_staging(self) -> list[Path]:
        """Staging dirs of processes that no longer exist (a killed run's half-written outputs)."""
        from irflow.engine.processes import owner_pid, pid_alive

        out = []
        for d in sorted((self.root / "tmp").iterdir()):
            if d.name.startswith("damaged-"):
                continue
            pid = owner_pid(d.name)
            if pid is None or not pid_alive(pid):
                out.append(d)
        return out

    def reclaim(self) -> int:
        """Remove `dead_staging` dirs; returns the bytes freed. Called when a run starts."""
        freed = 0
        for d in self.dead_staging():
            freed += tree_size(d)
            remove_tree(d)
        if freed:
            log.info("store: reclaimed %.1f MB of staging left by killed runs", freed / 1e6)
        return freed

    # ---- publishing ----------------------------------------------------------------------------
    def stage_table(self, contract: str, table_or_file: pa.Table | Path) -> tuple[Path, int]:
        """Validate a table against its contract and write it into a new staging dir.
        Returns (staging dir, num_rows); nothing is published yet (see `publish`).

        ``table_or_file`` may be a parquet file already written by a streaming stage: it is copied
        batch by batch (`write_rows`), into the same bytes as the same rows handed over as a table.
        """
        staging = self.staging_dir()
        try:
            if isinstance(table_or_file, pa.Table):
                table = data_contracts.get(contract).validate(table_or_file)
                _write_parquet(table, staging / TABLE_FILE)
                return staging, table.num_rows
            return staging, write_rows(contract, parquet_batches(table_or_file), staging / TABLE_FILE)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def publish_table(self, name: str, contract: str, table_or_file: pa.Table | Path) -> tuple[DatasetRef, int]:
        """Validate, write and publish one table. Returns (ref, num_rows)."""
        staging, rows = self.stage_table(contract, table_or_file)
        return self.publish(name, "table", contract, staging), rows

    def publish(self, name: str, kind: str, contract: str | None, staging: Path) -> DatasetRef:
        """Move a validated staging dir to its content address (a rename: all or nothing) and make it
        read-only. An intact copy already there is kept (same content); a damaged one is replaced."""
        digest = fingerprint_dir(staging)
        dataset_id = f"{name}-{digest[:16]}"
        final = self.object_dir(dataset_id)
        ref = DatasetRef(dataset_id, name, kind, contract, str(final), digest)
        if final.exists() and self.check(ref) is None:
            shutil.rmtree(staging, ignore_errors=True)
            return ref
        if final.exists():
            self.set_aside(ref)
        make_read_only(staging, top=False)
        try:
            os.rename(staging, final)  # atomic on one filesystem: readers never see half a dataset
        except OSError:
            if not final.exists():
                raise
            remove_tree(staging)  # another process published it meanwhile
        else:
            # Last: Linux refuses (to a non-root user) to move a directory it cannot write to another parent.
            final.chmod(0o555)
        _VERIFIED[str(final)] = (_dir_state(final), digest)
        return ref



# path -> (state of its files when last verified, the digest they matched), for this process: an
# object read by five stages of a run is hashed once, and hashed again if any file changes.
_VERIFIED: dict[str, tuple[tuple, str]] = {}


def _dir_state(path: Path) -> tuple:
    out = []
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        st = f.stat()
        out.append((f.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def make_read_only(path: Path, top: bool = True) -> None:
    """Files 0444, directories 0555: a published object is not edited in place by accident."""
    for p in Path(path).rglob("*"):
        if not p.is_symlink():
            p.chmod(0o555 if p.is_dir() else 0o444)
    if top:
        Path(path).chmod(0o555)


def make_writable(path: Path) -> None:
    """Undo `make_read_only` on a tree, so that it can be moved or removed."""
    path = Path(path)
    if not path.exists():
        return
    path.chmod(0o755)
    for p in path.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)


def tree_size(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def remove_tree(path: Path) -> None:
    """rmtree that also removes read-only objects."""
    make_writable(path)
    shutil.rmtree(path, ignore_errors=True)
