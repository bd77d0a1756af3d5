"""BEIR datasets on disk: a folder or a zip (with or without a top folder), or a URL downloaded once
and md5-checked, read into corpus/queries parquet files and a qrels table.

BEIR layout: ``corpus.jsonl`` ({"_id", "title", "text"}), ``queries.jsonl`` ({"_id", "text"}),
``qrels/<split>.tsv`` (header row, then query-id, corpus-id, score). JSONL is streamed line by line
into Arrow batches. Any bad input -- malformed JSON, a missing ``_id``, a wrong type, bad UTF-8,
duplicate ids, an empty corpus, no qrels -- raises :class:`IngestError` naming the file and line.
The ``ingest`` stage (``irflow.stages.ingest``) publishes only validated outputs, so nothing partial
is ever stored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import IO, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from irflow import data_contracts
from irflow.engine.errors import DataError
from irflow.engine.store import fingerprint_file

log = logging.getLogger("irflow.ingest")  # named after the stage whose warnings these are
BATCH_ROWS = 20_000


class IngestError(DataError):
    """Bad BEIR input. The message says which file and line."""


# ---- sources --------------------------------------------------------------------------------
class BeirSource:
    """Uniform read access to a BEIR dataset in a folder or a zip (with or without a top folder)."""

    def __init__(self, path: Path):
        self.path = path
        if path.is_dir():
            self.zip = None
            self.names = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        elif zipfile.is_zipfile(path):
            self.zip = zipfile.ZipFile(path)
            self.names = [n for n in self.zip.namelist() if not n.endswith("/")]
        else:
            raise IngestError(f"{path}: neither a BEIR folder nor a zip file")
        # macOS archivers add __MACOSX/ and ._* resource forks: never BEIR data.
        self.names = [n for n in self.names
                      if "__MACOSX" not in n.split("/") and not n.rsplit("/", 1)[-1].startswith("._")]
        self.root = self._dataset_root()

    def _dataset_root(self) -> str:
        """The one folder ("" or "name/") holding the dataset's corpus.jsonl, queries.jsonl and qrels/.

        Files of two datasets (scifact/... and nfcorpus/..., or CQADupStack's sub-forums) would be
        mixed -- one's corpus, the other's qrels -- so such a source is refused, naming the folders."""
        roots = set()
        for n in self.names:
            folder, _, base = n.rpartition("/")
            if base in ("corpus.jsonl", "queries.jsonl"):
                roots.add(folder + "/" if folder else "")
            elif base.endswith(".tsv") and (folder == "qrels" or folder.endswith("/qrels")):
                roots.add(folder[: -len("qrels")])
        if len(roots) > 1:
            shown = ", ".join(r or "(top level)" for r in sorted(roots))
            raise IngestError(f"{self.path}: holds {len(roots)} BEIR datasets ({shown}); a source must be one "
                              f"dataset (corpus.jsonl, queries.jsonl and qrels/ in one folder)")
        return roots.pop() if roots else ""

    def find(self, name: str) -> str | None:
        """The member ``name`` (corpus.jsonl, queries.jsonl) of the dataset's folder, if there."""
        member = self.root + name
        return member if member in self.names else None

    def qrels_files(self) -> dict[str, str]:
        """split -> the member ``qrels/<split>.tsv`` of the dataset's folder."""
        prefix = self.root + "qrels/"
        return {n[len(prefix): -len(".tsv")]: n for n in sorted(self.names)
                if n.startswith(prefix) and n.endswith(".tsv") and "/" not in n[len(prefix):]}

    def open(self, member: str) -> IO[bytes]:
        return self.zip.open(member) if self.zip else open(self.path / member, "rb")

    def display(self, member: str) -> str:
        return f"{self.path}!{member}" if self.zip else str(self.path / member)


def fetch(source: str, md5: str | None, downloads: Path) -> Path:
    """A local path for ``source``: a folder or zip as is, or a URL downloaded (once) and md5-checked."""
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme in ("http", "https"):
        if not md5:
            raise IngestError(f"{source}: a URL source needs its md5 (dataset.md5) so the download can be verified")
        target = downloads / f"{md5}-{Path(parsed.path).name or 'dataset.zip'}"
        if target.exists() and fingerprint_file(target, "md5") == md5:
            return target
        part = target.with_suffix(target.suffix + ".part")
        h = hashlib.md5()
        try:
            with urllib.request.urlopen(source, timeout=60) as resp, open(part, "wb") as out:
                total = int(resp.headers.get("Content-Length") or 0) or None
                with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {target.name}") as bar:
                    for chunk in iter(lambda: resp.read(1 << 20), b""):
                        out.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
        except BaseException as e:
            part.unlink(missing_ok=True)
            if isinstance(e, OSError):  # URLError / HTTPError / connection reset are OSErrors
                raise IngestError(f"{source}: download failed ({e})") from e
            raise
        if h.hexdigest() != md5:
            part.unlink(missing_ok=True)
            raise IngestError(f"{source}: md5 mismatch (expected {md5}, got {h.hexdigest()}); download discarded")
        part.rename(target)
        return target
    path = Path(source).expanduser()
    if not path.exists():
        raise IngestError(f"{source}: no such file or folder{_relative_hint(source)}")
    if md5 and path.is_file():
        got = fingerprint_file(path, "md5")
        if got != md5:
            raise IngestError(f"{source}: md5 mismatch (expected {md5}, got {got})")
    return path


def is_url(source: str) -> bool:
    return urllib.parse.urlparse(str(source)).scheme in ("http", "https")


def is_beir_source(source: str) -> bool:
    """A BEIR dataset: a URL, a zip, or a folder with corpus.jsonl and qrels/<split>.tsv. Anything else
    (a folder with only corpus.jsonl, a JSONL / Parquet / CSV file, a folder of documents) is a user's
    own documents (``irflow.sources.corpus_sources``)."""
    if is_url(source):
        return True
    path = Path(source).expanduser()
    if not path.exists():
        raise IngestError(f"no such file or folder: {source}{_relative_hint(source)}")
    if path.is_file():
        return zipfile.is_zipfile(path)
    return _is_beir_folder(str(path.resolve()), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _is_beir_folder(path: str, mtime_ns: int) -> bool:
    p = Path(path)
    return any((p / "qrels").glob("*.tsv")) and (p / "corpus.jsonl").is_file() or any(
        (d / "qrels").is_dir() and (d / "corpus.jsonl").is_file() for d in p.iterdir() if d.is_dir())


@functools.lru_cache(maxsize=32)
def _splits(path: str, mtime_ns: int) -> tuple[str, ...]:
    return tuple(sorted(BeirSource(Path(path)).qrels_files()))


def dataset_splits(source: str) -> tuple[str, ...] | None:
    """The qrels splits of a local BEIR folder or zip (None for a URL not fetched yet: unknown)."""
    if is_url(source):
        return None
    path = Path(source).expanduser()
    if not path.exists():
        raise IngestError(f"no such file or folder: {source}{_relative_hint(source)}")
    return _splits(str(path.resolve()), path.stat().st_mtime_ns)


# ---- JSONL / TSV readers --------------------------------------------------------------------
def _lines(src: BeirSource, member: str) -> Iterator[tuple[int, str]]:
    where = src.display(member)
    with src.open(member) as raw:
        for lineno, line in enumerate(raw, start=1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise IngestError(f"{where}:{lineno}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
            if lineno == 1:
                text = text.lstrip("\ufeff")
            yield lineno, text


def json_objects(lines: Iterable[tuple[int, str]], where: str) -> Iterator[tuple[int, dict]]:
    """(line, object) for each non-blank line of a JSON Lines file; a line that is not a JSON object is
    refused naming ``where`` and the line (BEIR's files and a user's own corpus alike)."""
    for lineno, text in lines:
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            # json's own message can end in "at" ("Invalid control character at"): one "at" before the column
            msg = e.msg[:-3] if e.msg.endswith(" at") else e.msg
            raise IngestError(f"{where}:{lineno}: malformed JSON ({msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise IngestError(f"{where}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


def _jsonl_records(src: BeirSource, member: str, fields: dict[str, bool]) -> Iterator[tuple[int, dict]]:
    """Yield (line, record) with the given string fields (name -> required)."""
    where = src.display(member)
    for lineno, obj in json_objects(_lines(src, member), where):
        rec = {}
        for name, required in fields.items():
            value = obj.get(name)
            if value is None:
                if required:
                    raise IngestError(f"{where}:{lineno}: missing '{name}'")
                value = ""
            if name == "_id" and isinstance(value, int) and not isinstance(value, bool):
                value = str(value)  # some BEIR sets use numeric ids; ids are strings everywhere in irflow
            if not isinstance(value, str):
                raise IngestError(f"{where}:{lineno}: '{name}' must be a string, got {type(value).__name__}")
            if name == "_id" and not value.strip():
                raise IngestError(f"{where}:{lineno}: empty '_id'")
            rec[name] = value
        yield lineno, rec


def _stream_jsonl_to_parquet(src, member, out: Path, columns: dict[str, tuple[str, bool]], contract: str) -> int:
    """Stream JSONL into a parquet file; duplicate ids are reported with both line numbers."""
    schema = data_contracts.get(contract).schema
    id_col = next(c for c, (f, _) in columns.items() if f == "_id")
    seen: dict[str, int] = {}
    where = src.display(member)
    n = 0
    fields = {f: req for f, req in columns.values()}
    with pq.ParquetWriter(out, schema) as writer:
        batch: dict[str, list] = {c: [] for c in columns}
        for lineno, rec in tqdm(_jsonl_records(src, member, fields), desc=f"ingest {Path(member).name}", unit=" rows",
                                mininterval=2):
            rid = rec["_id"]
            if rid in seen:
                raise IngestError(f"{where}:{lineno}: duplicate {id_col} '{rid}' (first seen on line {seen[rid]})")
            seen[rid] = lineno
            for c, (f, _) in columns.items():
                batch[c].append(rec[f])
            n += 1
            if len(batch[id_col]) >= BATCH_ROWS:
                writer.write_table(pa.table(batch, schema=schema))
                batch = {c: [] for c in columns}
        if batch[id_col]:
            writer.write_table(pa.table(batch, schema=schema))
    return n


class Judgements:
    """Relevance judgements read row by row (BEIR qrels, a user's TSV or TREC file): a pair judged twice
    with one score is kept once (counted, and logged by ``table``), with two scores it is refused naming
    both lines."""

    def __init__(self):
        self.qids: list[str] = []
        self.dids: list[str] = []
        self.scores: list[int] = []
        self.seen: dict[tuple[str, str], tuple[int, int]] = {}  # (query, doc) -> (line, score)
        self.repeated = 0

    def add(self, qid: str, did: str, score: int, here: str, lineno: int) -> None:
        if (qid, did) in self.seen:
            first, first_score = self.seen[(qid, did)]
            if first_score != score:
                raise IngestError(f"{here}: query '{qid}' / document '{did}' judged {score} here but "
                                  f"{first_score} on line {first}")
            self.repeated += 1
            return
        self.seen[(qid, did)] = (lineno, score)
        self.qids.append(qid)
        self.dids.append(did)
        self.scores.append(score)

    def table(self, split: str, where: str) -> pa.Table:
        if self.repeated:
            log.warning("%s: %d repeated qrels row(s) (same query, document and score) ignored", where,
                        self.repeated)
        return pa.table({"query_id": self.qids, "doc_id": self.dids, "score": pa.array(self.scores, pa.int32()),
                         "split": [split] * len(self.qids)})


def _read_qrels(src: BeirSource, member: str, split: str) -> pa.Table:
    where = src.display(member)
    judged = Judgements()
    for lineno, text in _lines(src, member):
        line = text.rstrip("\r\n")
        if not line.strip():
            continue
        parts = line.split("\t")
        if lineno == 1 and parts[0].strip().lower() in ("query-id", "query_id", "qid"):
            continue  # header row
        if len(parts) not in (3, 4):
            raise IngestError(f"{where}:{lineno}: expected 'query-id<TAB>corpus-id<TAB>score', got {line[:80]!r}")
        qid, did, score = (parts[0], parts[1], parts[2]) if len(parts) == 3 else (parts[0], parts[2], parts[3])
        try:
            s = int(score)
        except ValueError:
            raise IngestError(f"{where}:{lineno}: score must be an integer, got {score!r}") from None
        if not qid.strip() or not did.strip():
            raise IngestError(f"{where}:{lineno}: empty query or corpus id")
        judged.add(qid, did, s, f"{where}:{lineno}", lineno)
    return judged.table(split, where)


def read_beir(path: Path, workdir: Path, dangling: str = "keep") -> dict[str, object]:
    """Read a BEIR folder/zip into corpus/queries (parquet files in workdir) and a qrels table."""
    src = BeirSource(path)
    corpus_m, queries_m = src.find("corpus.jsonl"), src.find("queries.jsonl")
    if corpus_m is None:
        raise IngestError(f"{path}: no corpus.jsonl")
    if queries_m is None:
        raise IngestError(f"{path}: no queries.jsonl")
    qrels_members = src.qrels_files()
    if not qrels_members:
        raise IngestError(f"{path}: no qrels/<split>.tsv file")

    corpus_file, queries_file = workdir / "corpus.parquet", workdir / "queries.parquet"
    n_docs = _stream_jsonl_to_parquet(
        src, corpus_m, corpus_file, {"doc_id": ("_id", True), "title": ("title", False), "text": ("text", True)},
        "corpus")
    if n_docs == 0:
        raise IngestError(f"{src.display(corpus_m)}: empty corpus")
    n_queries = _stream_jsonl_to_parquet(src, queries_m, queries_file,
                                         {"query_id": ("_id", True), "text": ("text", True)}, "queries")
    if n_queries == 0:
        raise IngestError(f"{src.display(queries_m)}: no queries")
    qrels = pa.concat_tables([_read_qrels(src, m, split) for split, m in sorted(qrels_members.items())])
    if qrels.num_rows == 0:
        raise IngestError(f"{path}: the qrels files ({', '.join(sorted(qrels_members.values()))}) have no rows")
    corpus_ids = pq.read_table(corpus_file, columns=["doc_id"])
    usable, counts = data_contracts.dangling_qrels(
        qrels, pq.read_table(queries_file, columns=["query_id"]), corpus_ids)
    kept = qrels
    if counts["dangling"]:
        msg = (f"{path}: {counts['dangling']} qrels row(s) point to a missing query ({counts['missing_query']}) "
               f"or document ({counts['missing_doc']})")
        if dangling == "error":
            raise IngestError(msg + " (dataset.dangling_qrels: error)")
        no_doc = {s: len(q) for s, q in sorted(data_contracts.queries_without_judged_doc(qrels, corpus_ids).items())
                  if q}
        per_split = ", ".join(f"{n} in {s}" for s, n in no_doc.items()) or "none"
        if dangling == "keep":
            log.warning(f"{msg}; kept (dataset.dangling_qrels: keep): judged queries with no judged document in "
                        f"the corpus, evaluated and scoring 0 as in BEIR/Pyserini: {per_split}")
        else:
            kept = usable
            log.warning(f"{msg}; dropped (dataset.dangling_qrels: drop): judged queries left with no judgement, "
                        f"so not evaluated: {per_split}")
    # A split whose every judgement dangles cannot be evaluated or trained on (keep would score every
    # query 0, drop would empty it): refuse it here, naming the split, rather than publish qrels that
    # fail or mislead a later stage.
    splits_before = set(qrels.column("split").to_pylist())
    splits_after = set(usable.column("split").to_pylist())
    if splits_before - splits_after:
        empty = ", ".join(sorted(splits_before - splits_after))
        raise IngestError(f"{path}: every qrels row of split {empty} points to a query or document missing from "
                          f"the dataset ({counts['missing_query']} queries, {counts['missing_doc']} documents "
                          f"missing); nothing to evaluate or train on")
    return {"corpus": corpus_file, "queries": queries_file, "qrels": kept}


def _relative_hint(source: str) -> str:
    # Relative sources are read from the working directory (the configs in configs/ assume the repo root).
    return "" if Path(source).is_absolute() else f" (relative to the working directory {Path.cwd()})"


# ---- a dev cut of the train split -------------------------------------------------------------
def train_dev_split(source: str | Path, out: str | Path, *, train_split: str = "train", dev_share: float = 0.2,
                    seed: int = 7, max_dev_queries: int | None = None) -> dict[str, int]:
    """Write a BEIR folder for choosing settings without the test split: the judged queries of
    ``train_split`` are cut (seeded, by query) into ``train`` (fit) and ``dev``; every other split's
    qrels, and every query not judged in ``train_split``, are left out, so no run on the folder can
    read a test query or judgement. The corpus is copied unchanged (same ids). Returns the counts.

    Run any recipe on it with ``dataset.source=<out>``, ``dataset.split=dev`` (``train_split`` and
    unlabelled query sources keep reading ``train``, now the fit part); ``bench/train_dev.py`` does."""
    import random
    import shutil

    if not 0 < dev_share < 1:
        raise ValueError(f"the dev share must be in (0, 1), got {dev_share}")
    if not Path(source).expanduser().exists():
        raise IngestError(f"no such file or folder: {source}{_relative_hint(str(source))}")
    src = BeirSource(Path(source).expanduser())
    member = src.root + f"qrels/{train_split}.tsv"
    if member not in src.names:
        raise IngestError(f"{source}: no qrels/{train_split}.tsv to cut a dev part from (its splits: "
                          f"{', '.join(sorted(src.qrels_files())) or 'none'})")
    qrels = _read_qrels(src, member, train_split)
    judged = sorted(set(qrels.column("query_id").to_pylist()))
    n_dev = max(1, round(dev_share * len(judged)))
    if max_dev_queries:
        n_dev = min(n_dev, max_dev_queries)
    dev = set(random.Random(seed).sample(judged, n_dev))
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "qrels").mkdir(parents=True)
    with src.open(src.find("corpus.jsonl")) as r, open(tmp / "corpus.jsonl", "wb") as w:
        shutil.copyfileobj(r, w)
    keep = set(judged)
    with open(tmp / "queries.jsonl", "w", encoding="utf-8") as w:
        for _, rec in _jsonl_records(src, src.find("queries.jsonl"), {"_id": True, "text": False}):
            if rec["_id"] in keep:
                w.write(json.dumps({"_id": rec["_id"], "text": rec.get("text") or ""}, ensure_ascii=False) + "\n")
    rows = {"train": [], "dev": []}
    for q, d, s in zip(*(qrels.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))):
        rows["dev" if q in dev else "train"].append(f"{q}\t{d}\t{s}\n")
    for split, lines in rows.items():
        (tmp / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(lines))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"fit_queries": len(judged) - n_dev, "dev_queries": n_dev, "fit_qrels": len(rows["train"]),
            "dev_qrels": len(rows["dev"])}
