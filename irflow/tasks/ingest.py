"""Datasets in: ``ingest`` turns a BEIR dataset (a folder, a local zip, or a URL with md5) into
corpus/queries/qrels tables, and ``select_queries`` picks the queries judged in one split.

Reading BEIR (its layout, every check, the errors naming file and line) is ``irflow.beir``'s; here a
source becomes an input ref keyed by its content (``source_ref``), and the stage publishes what
``irflow.beir.read_beir`` read (validated outputs only, so nothing partial is ever stored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pyarrow as pa
from pydantic import Field, PositiveInt

from irflow.beir import fetch, read_beir
from irflow.errors import DataError
from irflow.params import Params
from irflow.runtime import StageRuntime
from irflow.stage import Output, stage
from irflow.store import DatasetRef, fingerprint_file


# ---- sources --------------------------------------------------------------------------------
def source_fingerprint(path: Path) -> str:
    """Content fingerprint of a source, for the cache key: changing the files changes the key."""
    if path.is_file():
        return "sha256:" + fingerprint_file(path)
    from irflow.store import fingerprint_dir

    return "sha256:" + fingerprint_dir(path)


# ---- the stages -----------------------------------------------------------------------------
class IngestParams(Params):
    dangling_qrels: Literal["keep", "drop", "error"] = Field(
        "keep", description="qrels rows that point to a document missing from the corpus (or to a missing query): "
                            "keep (as BEIR, pytrec_eval, Pyserini and MTEB score them: a judged query with no judged "
                            "document in the corpus stays evaluated and scores 0, and a missing judged document "
                            "still counts in the ideal DCG; the metrics say how many such queries there are), "
                            "drop them (such queries vanish from the evaluation, so scores read higher than "
                            "published ones), or error (refuse the dataset). A row naming a query missing from "
                            "queries.jsonl is inert either way: that query is never asked, so never evaluated "
                            "or trained on. Each is logged with its counts")


# version 3: the default is keep; a zip or folder holding two datasets is refused
@stage("ingest", version="3", outputs=[Output("corpus", "corpus"), Output("queries", "queries"),
                                        Output("qrels", "qrels")])
def ingest_beir(p: IngestParams, rt: StageRuntime, *, source: DatasetRef):
    """A BEIR folder or zip (``source``, an external ref from ``source_ref``) as corpus/queries/qrels."""
    return read_beir(Path(source.path), rt.workdir, p.dangling_qrels)


def source_ref(source: str, md5: str | None, downloads: Path) -> DatasetRef:
    """A dataset source (a BEIR folder, a .zip, or a URL fetched once and md5-checked) as an input ref.

    Its id is a content fingerprint, not its path: moving the zip changes nothing, editing a file
    inside it recomputes.
    """
    path = fetch(str(source), md5, downloads)
    # An md5 is a fingerprint only where fetch() verified it (a file); a folder is hashed.
    fp = f"md5:{md5}" if md5 and path.is_file() else source_fingerprint(path)
    return DatasetRef(fp, Path(str(source)).name, "source", None, str(path.resolve()))


class SelectQueriesParams(Params):
    split: str = Field(description="the qrels split whose judged queries are selected (e.g. test)")
    limit: PositiveInt | None = Field(None, description="keep only the first n queries by id (null: all)")


@stage("select_queries", version="1", outputs=Output("queries", "queries"))
def select_queries(p: SelectQueriesParams, rt: StageRuntime, *, queries: DatasetRef, qrels: DatasetRef) -> pa.Table:
    """The queries judged in ``p.split`` (as BEIR's loader does), optionally the first ``limit``."""
    import duckdb

    with duckdb.connect() as con:
        con.register("q", queries.table())
        con.register("r", qrels.table(columns=["query_id", "split"]))
        limit = f"LIMIT {int(p.limit)}" if p.limit else ""
        t = con.sql(f"SELECT query_id, text FROM q WHERE query_id IN (SELECT query_id FROM r WHERE split = $split) "
                    f"ORDER BY query_id {limit}", params={"split": p.split}).to_arrow_table()
    if t.num_rows == 0:  # a URL source's splits are known only after its download: say which it has
        splits = sorted(set(qrels.table(columns=["split"]).column("split").to_pylist()))
        raise DataError(f"no queries are judged in split '{p.split}' (the dataset's qrels splits: "
                        f"{', '.join(splits) or 'none'})")
    return t
