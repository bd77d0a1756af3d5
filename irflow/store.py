"""The content-addressed dataset store.

Layout of a store directory::

    <root>/objects/<dataset_id>/      immutable; data.parquet for tables, the files themselves for
                                      models and indexes (Hugging Face / sentence-transformers format)
    <root>/tmp/                       staging: outputs are written here, validated, then renamed
    <root>/downloads/                 verified downloads (by md5)
    <root>/catalog.duckdb             the lineage catalog (see irflow.catalog)

A dataset id is ``<name>-<first 16 hex of sha256 over its files>``: the same content always gets
the same id, so a stage that recomputes and produces identical bytes leaves everything downstream
cached (early cut-off).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from irflow import data_contracts

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

    @property
    def parquet(self) -> str:
        if self.kind != "table":
            raise TypeError(f"{self.id} is a {self.kind}, not a table")
        return str(Path(self.path) / TABLE_FILE)

    def table(self, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(self.parquet, columns=columns)

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


def _rechunk(table: pa.Table, rows: int) -> pa.Table:
    """The same table as chunks of exactly ``rows`` rows (the last one shorter)."""
    if table.num_rows <= rows:
        return table.combine_chunks()
    return pa.Table.from_batches(
        [b for i in range(0, table.num_rows, rows) for b in table.slice(i, rows).combine_chunks().to_batches()],
        schema=table.schema)


class Store:
    def __init__(self, root: str | os.PathLike = DEFAULT_STORE):
        self.root = Path(root).resolve()
        for sub in ("objects", "tmp", "downloads"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def catalog_path(self) -> Path:
        return self.root / "catalog.duckdb"

    def staging_dir(self) -> Path:
        d = self.root / "tmp" / uuid.uuid4().hex
        d.mkdir(parents=True)
        return d

    def object_dir(self, dataset_id: str) -> Path:
        return self.root / "objects" / dataset_id

    def stage_table(self, contract: str, table_or_file: pa.Table | Path) -> tuple[Path, int]:
        """Validate a table against its contract and write it into a new staging dir.
        Returns (staging dir, num_rows); nothing is published yet (see `publish`).

        ``table_or_file`` may be a parquet file already written by a streaming stage.
        """
        c = data_contracts.get(contract)
        staging = self.staging_dir()
        try:
            if isinstance(table_or_file, pa.Table):
                table = c.validate(table_or_file)
            else:
                table = c.validate(pq.read_table(table_or_file))
            # Deterministic bytes: no statistics timestamps exist in parquet; fixed row-group size; and
            # fixed chunking (page boundaries follow the in-memory chunks, so the same rows chunked
            # differently by two producers would otherwise get two ids).
            pq.write_table(_rechunk(table, ROW_GROUP), staging / TABLE_FILE, row_group_size=ROW_GROUP,
                           compression="zstd")
            return staging, table.num_rows
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def publish_table(self, name: str, contract: str, table_or_file: pa.Table | Path) -> tuple[DatasetRef, int]:
        """Validate, write and publish one table. Returns (ref, num_rows)."""
        staging, rows = self.stage_table(contract, table_or_file)
        return self.publish(name, "table", contract, staging), rows

    def publish_dir(self, name: str, kind: str, staging: Path, check=None) -> DatasetRef:
        """Publish a directory (a model or an index) that a stage wrote into ``staging``."""
        try:
            if check is not None:
                check(staging)
            return self.publish(name, kind, None, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def publish(self, name: str, kind: str, contract: str | None, staging: Path) -> DatasetRef:
        """Move a validated staging dir to its content address (a rename: all or nothing)."""
        digest = fingerprint_dir(staging)
        dataset_id = f"{name}-{digest[:16]}"
        final = self.object_dir(dataset_id)
        if final.exists():
            # Same content already published (content addressing): keep the existing copy.
            shutil.rmtree(staging, ignore_errors=True)
        else:
            os.rename(staging, final)  # atomic on one filesystem: readers never see half a dataset
        return DatasetRef(dataset_id, name, kind, contract, str(final))
