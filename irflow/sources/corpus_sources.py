"""A user's own documents, queries and judgements, read into irflow's tables (not BEIR's layout).

Corpus sources (``read_corpus``, streamed into a parquet file with the ``corpus`` schema):

* ``jsonl`` -- ``.jsonl``, ``.jsonl.gz``, ``.ndjson``, ``.json``: one JSON object per line (a ``.json``
  file is read as JSON lines too); ``parquet`` -- a ``.parquet`` file, or a folder holding only parquet
  files (read recursively, sorted; names starting with '.' or '_' skipped, as pyarrow does);
  ``csv`` / ``tsv`` (``.csv``; ``.tsv``, ``.tab``): a header row, then one document a row, quoted as
  Python's csv module (and pandas) write them;
* ``folder`` -- a folder of documents, walked recursively and sorted, hidden entries skipped:
  ``.txt`` (title: the file's stem), ``.md`` / ``.markdown`` (title: the first ``# heading`` line, else
  the stem), ``.html`` / ``.htm`` (visible text; title: ``<title>``, else the stem). Files are UTF-8;
* ``beir`` -- a BEIR folder or zip: its ``corpus.jsonl`` (``irflow.sources.beir`` reads whole BEIR datasets).

Columns: ``fields`` maps irflow's names (id, title, text) to the source's; by default id is the first
of ``_id``, ``id``, ``doc_id`` present, title is ``title`` (optional) and text is ``text``. Integer ids
become strings. Ids: a folder document's id is its path relative to the folder (``notes/a.md``); a
source with no id column gets content ids, ``row-`` + the first 16 hex digits of the sha256 of
``title + "\\n" + text``, so identical documents are one document (repeats are dropped and counted).
Explicit ids must be unique. Documents whose text is empty (after strip) are dropped with a warning;
``CorpusStats.documents`` counts the documents kept.

Passages: with ``max_words``, a document of more than ``max_words`` words (whitespace split) is cut
into windows of ``max_words`` words starting every ``stride`` words (default: no overlap), the last
ending at the document's end; a window's text is its words joined by single spaces. A document that is
not cut keeps its id and text; passage k (from 1) of a cut one is ``<doc_id>#<k>``, and every passage
keeps the title. ``document_id`` inverts this. An id that itself ends in ``#<digits>`` would be
ambiguous, so it is refused when ``max_words`` is set.

Bad input raises :class:`irflow.sources.beir.IngestError` on one line naming the file and line (or row); a
source that changes while it is read too, since the output would mix two versions of it.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import logging
import os
import re
import sys
import zlib
from collections import Counter
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from irflow import data_contracts
from irflow.engine.errors import ConfigError
from irflow.sources.beir import BATCH_ROWS, BeirSource, IngestError, _lines, json_objects

log = logging.getLogger(__name__)

FORMATS = ("auto", "beir", "jsonl", "parquet", "csv", "tsv", "folder")
DOC_SUFFIXES = (".txt", ".md", ".markdown", ".html", ".htm")
CORPUS_KEYS = {"id": ("_id", "id", "doc_id"), "title": ("title",), "text": ("text",)}
QUERY_KEYS = {"id": ("_id", "query_id", "id", "qid"), "text": ("text", "query")}
_PASSAGE = re.compile(r"(.+)#(\d+)", re.S)

Loc = tuple[int, int]  # (index of the file, line or row in it); a compact place kept per id
Record = tuple[Loc, "str | None", str, str]  # (place, id or None for a content id, title, text)


@dataclass(frozen=True)
class CorpusStats:
    documents: int        # documents read (after dropping empty ones and repeats of identical ones)
    passages: int         # rows written
    empty_dropped: int    # documents with empty text (after strip) dropped
    split_documents: int  # documents cut into more than one passage


def document_id(passage_id: str) -> str:
    """The document a passage comes from: ``"a#2"`` -> ``"a"``; an id without ``#<digits>`` as is."""
    m = _PASSAGE.fullmatch(passage_id)
    return m.group(1) if m else passage_id


# ---- formats --------------------------------------------------------------------------------
def detect_format(path: Path) -> str:
    """The format of ``path`` (one of FORMATS but 'auto'), from its extension or its files."""
    path = Path(path)
    if not path.exists():
        raise IngestError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / "corpus.jsonl").is_file() or any(
                p.is_dir() and (p / "corpus.jsonl").is_file() for p in path.iterdir()):
            return "beir"
        files = _walk(path)
        data = [f for f in files if not f.name.startswith("_")]  # _SUCCESS, _metadata: not data
        if data and all(f.suffix.lower() == ".parquet" for f in data):
            return "parquet"
        if any(f.suffix.lower() in DOC_SUFFIXES for f in files):
            return "folder"
        raise IngestError(f"{path}: no documents (.txt, .md, .html) found")
    name = path.name.lower()
    if name.endswith(".zip"):
        if BeirSource(path).find("corpus.jsonl") is None:
            raise IngestError(f"{path}: a zip without corpus.jsonl (only BEIR zips are read)")
        return "beir"
    for fmt, suffixes in (("jsonl", (".jsonl", ".jsonl.gz", ".ndjson", ".json")), ("parquet", (".parquet",)),
                          ("csv", (".csv",)), ("tsv", (".tsv", ".tab"))):
        if name.endswith(suffixes):
            return fmt
    raise IngestError(f"{path}: unknown extension '{path.suffix}' (known: .jsonl, .jsonl.gz, .parquet, .csv, "
                      f".tsv, a folder of .txt/.md/.html documents, a BEIR folder or zip)")


def _walk(root: Path) -> list[Path]:
    """Every file under ``root``, sorted by relative path; hidden files and folders skipped."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(folder, n) for n in names if not n.startswith(".")]
    return sorted((f for f in found if f.is_file()), key=lambda f: f.relative_to(root).as_posix())


def _source_files(path: Path, fmt: str) -> list[Path]:
    """The files a corpus source reads (their sizes and times are compared after reading)."""
    if fmt == "folder":
        return [f for f in _walk(path) if f.suffix.lower() in DOC_SUFFIXES]
    if fmt == "parquet" and path.is_dir():
        files = [f for f in _walk(path) if f.suffix.lower() == ".parquet" and not f.name.startswith("_")]
        if not files:
            raise IngestError(f"{path}: no .parquet files")
        return files
    if fmt == "beir" and path.is_dir():
        src = BeirSource(path)
        member = src.find("corpus.jsonl")
        return [path / member] if member else [path]
    return [path]


def _state(files: list[Path]) -> dict[str, tuple[int, int]]:
    return {str(f): (st.st_size, st.st_mtime_ns) for f in files for st in (f.stat(),)}


# ---- reading records ------------------------------------------------------------------------
class _File:
    """One (maybe gzipped) file, as ``irflow.sources.beir._lines`` reads a source."""

    def __init__(self, path: Path):
        self.path = path

    def open(self, member: str):
        return gzip.open(self.path, "rb") if self.path.name.lower().endswith(".gz") else open(self.path, "rb")

    def display(self, member: str) -> str:
        return str(self.path)


def _text_lines(src, member: str) -> Iterator[tuple[int, str]]:
    try:
        yield from _lines(src, member)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise IngestError(f"{src.display(member)}: not a valid gzip file ({e})") from None


def _resolve(fields: dict[str, str] | None, defaults: dict, have, where: str, what: str = "column"
             ) -> dict[str, str | None]:
    """The source's key per irflow name (None: absent, allowed for id and title); ``have``: its keys."""
    fields = fields or {}
    keys: dict[str, str | None] = {}
    for name, candidates in defaults.items():
        keys[name] = fields.get(name) or next((c for c in candidates if c in have), None)
        if name in fields or name == "text":
            keys[name] = keys[name] or candidates[0]
            if keys[name] not in have:
                raise IngestError(f"{where}: no {what} '{keys[name]}' ({what}s: {', '.join(map(str, have)) or 'none'})")
    return keys


def _value(value, key: str, is_id: bool, where: str) -> str:
    if is_id and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # numeric ids; ids are strings everywhere in irflow
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise IngestError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    if is_id and not value.strip():
        raise IngestError(f"{where}: empty id ('{key}')")
    return value


def _record(values: dict, keys: dict, where: str, loc: Loc, required: tuple[str, ...] = ()) -> Record:
    out = {}
    for name, key in keys.items():
        if key is None:
            out[name] = None if name == "id" else ""
        elif name in required and key not in values:
            raise IngestError(f"{where}: missing '{key}'")
        else:
            out[name] = _value(values.get(key), key, name == "id", where)
    return loc, out["id"], out.get("title", ""), out["text"]


def _jsonl_records(src, member: str, fields, defaults) -> Iterator[Record]:
    where, keys = src.display(member), None
    required = ("id", "text", *(("title",) if "title" in (fields or {}) else ()))
    for lineno, obj in json_objects(_text_lines(src, member), where):
        if keys is None:  # the first object says which keys the source has (an id or content ids)
            keys, first = _resolve(fields, defaults, list(obj), f"{where}:{lineno}", "key"), lineno
        elif keys["id"] is None:
            # content ids for some lines and the file's own ids for others would mix two kinds of id
            named = next((k for k in defaults["id"] if k in obj), None)
            if named is not None:
                raise IngestError(f"{where}:{lineno}: has an id ('{named}') but line {first} has none "
                                  f"(keys: {', '.join(map(str, defaults['id']))}): give every line an id, or none "
                                  "(then each gets a content id)")
        yield _record(obj, keys, f"{where}:{lineno}", (0, lineno), required)


def _csv_records(path: Path, delimiter: str, fields, defaults) -> Iterator[Record]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long documents are one field
    where, kind = str(path), "TSV" if delimiter == "\t" else "CSV"
    lines = (text for _, text in _text_lines(_File(path), ""))
    reader = csv.reader(lines, delimiter=delimiter, strict=True)
    start = 1
    try:
        header = next(reader, None)
        if header is None:
            raise IngestError(f"{where}: empty file (a header row naming the columns is needed)")
        keys = _resolve(fields, defaults, header, where)
        index = {k: header.index(k) for k in keys.values() if k is not None}
        start = reader.line_num + 1
        for row in reader:
            if row:
                if len(row) != len(header):
                    raise IngestError(f"{where}:{reader.line_num}: expected {len(header)} fields, got {len(row)}")
                yield _record({k: row[i] for k, i in index.items()}, keys, f"{where}:{start}", (0, start))
            start = reader.line_num + 1
    except csv.Error as e:
        raise IngestError(f"{where}:{start}: malformed {kind} row ({e})") from None


def _string_like(t: pa.DataType, is_id: bool) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
            or pa.types.is_null(t) or (is_id and pa.types.is_integer(t)))


def _parquet_records(files: list[Path], fields, defaults) -> Iterator[Record]:
    keys, row = None, 0
    for i, f in enumerate(files):
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise IngestError(f"{f}: not a readable Parquet file ({e})") from None
        schema, name_f = pf.schema_arrow, str(f)
        keys = keys or _resolve(fields, defaults, schema.names, name_f)
        columns = [k for k in keys.values() if k is not None]
        for name, key in keys.items():
            if key is not None and key not in schema.names:
                raise IngestError(f"{f}: no column '{key}' (columns: {', '.join(schema.names)})")
            if key is not None and not _string_like(schema.field(key).type, name == "id"):
                raise IngestError(f"{f}: column '{key}' must hold strings, not {schema.field(key).type}")
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            cols = {k: batch.column(k).to_pylist() for k in columns}
            for j in range(batch.num_rows):
                row += 1
                yield _record({k: v[j] for k, v in cols.items()}, keys, f"{name_f}: row {row}", (i, row))


class _HTMLText(HTMLParser):
    """Visible text of an HTML page (script/style/head skipped) and its <title>."""
    SKIP = {"script", "style", "template"}
    HEAD = {"head", "title", "meta", "link", "base", "script", "style", "noscript", "template"}
    BLOCK = {"p", "div", "br", "li", "ul", "ol", "tr", "table", "h1", "h2", "h3", "h4", "h5", "h6", "section",
             "article", "header", "footer", "nav", "aside", "main", "blockquote", "pre", "hr", "dt", "dd",
             "figcaption", "form", "body"}
    CELL = {"td", "th"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title_parts: list[str] = []
        self.skip = 0
        self.in_head = self.in_title = self.titled = False

    def handle_starttag(self, tag, attrs):
        if tag == "head":
            self.in_head = True
        elif tag not in self.HEAD:
            self.in_head = False  # a body element closes an unclosed <head>, as browsers do
        if tag in self.SKIP:
            self.skip += 1
        elif tag == "title":
            self.in_title = not self.titled  # the page's first <title> (an <svg> may hold others)
        self.parts.append("\n" if tag in self.BLOCK else " " if tag in self.CELL else "")

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.skip:
            self.skip -= 1
        elif tag == "title":
            self.titled, self.in_title = self.titled or self.in_title, False
        elif tag == "head":
            self.in_head = False
        self.parts.append("\n" if tag in self.BLOCK else " " if tag in self.CELL else "")

    def handle_data(self, data):
        if self.in_title:
            self.title_parts.append(data)
        elif not self.skip and not self.in_head:
            self.parts.append(data)


def _collapse(text: str) -> str:
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


def html_text(html: str) -> tuple[str, str]:
    """(title, text) of an HTML page: the <title>, and the visible text, a line per block."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    return " ".join("".join(parser.title_parts).split()), _collapse("".join(parser.parts))


def _markdown_title(text: str) -> str | None:
    fence = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(("```", "~~~")):
            fence = None if fence and s.startswith(fence) else fence or s[:3]
        elif fence is None and re.match(r"#\s", s):
            return s[1:].strip().rstrip("#").strip() or None
    return None


def _read_utf8(f: Path) -> str:
    data = f.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IngestError(f"{f}: not UTF-8 text (invalid byte at offset {e.start})") from None
    return text[1:] if text.startswith("\ufeff") else text


def _folder_records(root: Path, files: list[Path]) -> Iterator[Record]:
    for i, f in enumerate(files):
        raw, suffix = _read_utf8(f), f.suffix.lower()
        title, text = f.stem, raw
        if suffix in (".md", ".markdown"):
            title = _markdown_title(raw) or f.stem
        elif suffix in (".html", ".htm"):
            page_title, text = html_text(raw)
            title = page_title or f.stem
        yield (i, 0), f.relative_to(root).as_posix(), title, text


# ---- corpus ---------------------------------------------------------------------------------
def passage_spans(words: int, max_words: int, stride: int) -> list[tuple[int, int]]:
    """The [start, stop) word ranges of the passages a document of ``words`` words is cut into: windows of
    ``max_words`` every ``stride`` words until one reaches the end; the whole document when it fits."""
    if words <= max_words:
        return [(0, words)]
    out = []
    for start in range(0, words, stride):
        out.append((start, min(words, start + max_words)))
        if start + max_words >= words:
            break
    return out


def cut_passages(doc_id: str, text: str, max_words: int | None, stride: int) -> list[tuple[str, str]]:
    """A document's (passage id, text) pairs, cut as the module doc says (the document itself if not cut)."""
    words = text.split() if max_words else []
    if len(words) <= (max_words or 0):
        return [(doc_id, text)]
    return [(f"{doc_id}#{i}", " ".join(words[a:b])) for i, (a, b) in enumerate(passage_spans(len(words), max_words,
                                                                                           stride), 1)]


def _check_fields(fields: dict[str, str] | None, allowed) -> None:
    unknown = sorted(set(fields or {}) - set(allowed))
    if unknown:
        raise ConfigError(f"fields: unknown name(s) {unknown}; known: {sorted(allowed)}")


def documents_path(path: Path) -> Path:
    """What a user's source reads: GPL's input, a folder holding corpus.jsonl (and no qrels: else it is a
    BEIR dataset), is that file; any other file or folder is read as it is."""
    path = Path(path)
    return path / "corpus.jsonl" if path.is_dir() and (path / "corpus.jsonl").is_file() else path


def source_bytes(path: Path) -> int:
    """The size of a source: a file's, or every file's below a folder."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def read_documents(path: Path, out: Path, c) -> CorpusStats:
    """``read_corpus`` of a user's source (``documents_path``) as ``c`` says: its ``format``, ``fields`` and
    ``passages`` (a ``CorpusReadParams``, or the config's ``dataset`` section, which has the same keys)."""
    return read_corpus(documents_path(path), out, format=c.format, fields=c.fields,
                       max_words=c.passages.max_words if c.passages else None,
                       stride=c.passages.stride if c.passages else None)


def read_corpus(path: Path, out: Path, *, format: str = "auto", fields: dict[str, str] | None = None,
                max_words: int | None = None, stride: int | None = None) -> CorpusStats:
    """Stream the documents of ``path`` into the parquet file ``out`` (``corpus`` schema); see the module doc."""
    path, out = Path(path), Path(out)
    stride = stride if stride is not None else max_words
    fmt = _checked_format(path, format, fields, max_words, stride)
    files = _source_files(path, fmt)
    if fmt == "folder":
        if not files:
            raise IngestError(f"{path}: no documents (.txt, .md, .html) found")
        others = Counter(f.suffix.lower() or "(none)" for f in _walk(path) if f.suffix.lower() not in DOC_SUFFIXES)
        if others:
            log.warning("%s: %d file(s) of other types ignored (%s)", path, sum(others.values()),
                        ", ".join(f"{s}: {n}" for s, n in sorted(others.items())))
    before = _state(files)
    records, where = _corpus_records(path, fmt, files, fields)

    schema = data_contracts.CORPUS.schema
    seen: dict[str, Loc] = {}  # id -> where it was first read
    docs = passages = split = empty = repeats = 0
    first_empty = first_repeat = None
    batch: dict[str, list[str]] = {"doc_id": [], "title": [], "text": []}

    def flush(writer: pq.ParquetWriter) -> int:
        n = len(batch["doc_id"])
        if n:
            writer.write_table(pa.table(batch, schema=schema))
            for column in batch.values():
                column.clear()
        return n

    try:
        with pq.ParquetWriter(out, schema) as writer:
            # tqdm reads TQDM_DISABLE once, at import; an estimate sizing the corpus sets it later
            quiet = bool(os.environ.get("TQDM_DISABLE"))
            for loc, did, title, text in tqdm(records, desc=f"read {path.name}", unit=" docs", mininterval=2,
                                              disable=quiet):
                if not text.strip():
                    empty += 1
                    first_empty = first_empty or loc
                    continue
                if did is None:
                    did = "row-" + hashlib.sha256(f"{title}\n{text}".encode()).hexdigest()[:16]
                    if did in seen:
                        repeats += 1
                        first_repeat = first_repeat or loc
                        continue
                elif did in seen:
                    raise IngestError(f"{where(loc)}: duplicate id '{did}' (first at {where(seen[did])})")
                if format != "beir" and _PASSAGE.fullmatch(did):
                    # a passage's document is its id before '#<n>' (document_id): the held-out split and the
                    # proxy's per-document statistics would take 'a#1' and 'a#2' for passages of one document
                    raise IngestError(f"{where(loc)}: id '{did}' ends in '#<digits>', which irflow's passage ids "
                                      f"use (<document id>#<n>); rename it (e.g. '{did.replace('#', '-')}')")
                seen[did] = loc
                docs += 1
                cut = cut_passages(did, text, max_words, stride)
                split += len(cut) > 1
                for pid, ptext in cut:
                    batch["doc_id"].append(pid)
                    batch["title"].append(title)
                    batch["text"].append(ptext)
                if len(batch["doc_id"]) >= BATCH_ROWS:
                    passages += flush(writer)
            passages += flush(writer)
        if empty:
            log.warning("%d document(s) with empty text dropped (first: %s)", empty, where(first_empty))
        if repeats:
            log.warning("%d repeated document(s) (same title and text, no id) dropped (first: %s)", repeats,
                        where(first_repeat))
        if docs == 0:
            raise IngestError(f"{path}: no document with text")
        try:
            after = _state(_source_files(path, fmt))
        except (OSError, IngestError):
            after = None
        if after != before:
            raise IngestError(f"{path} changed while it was read; nothing was stored, run again")
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return CorpusStats(documents=docs, passages=passages, empty_dropped=empty, split_documents=split)


def _checked_format(path: Path, format: str, fields: dict[str, str] | None, max_words: int | None,
                    stride: int | None) -> str:
    """The source's format (``format``, or detected when ``auto``), after refusing settings that cannot apply."""
    if format not in FORMATS:
        raise ConfigError(f"format: '{format}' is not one of {', '.join(FORMATS)}")
    if max_words is not None and max_words <= 0:
        raise ConfigError(f"max_words must be positive, got {max_words}")
    if max_words is not None and not 0 < stride <= max_words:
        raise ConfigError(f"stride must be in 1..max_words ({max_words}), got {stride}")
    _check_fields(fields, CORPUS_KEYS)
    if not path.exists():
        raise IngestError(f"{path}: no such file or folder")
    fmt = detect_format(path) if format == "auto" else format
    if fmt == "folder" and fields:
        raise ConfigError("fields: a folder of documents has no columns to map")
    if (fmt == "folder") != path.is_dir() and fmt not in ("beir", "parquet"):
        raise IngestError(f"{path}: format '{fmt}' reads a {'folder' if fmt == 'folder' else 'file'}")
    return fmt


def _corpus_records(path: Path, fmt: str, files: list[Path], fields: dict[str, str] | None):
    """(the documents as (where, id, title, text) records, how a record's place is said in an error)."""
    names = [str(f) for f in files]
    if fmt == "beir":
        src = BeirSource(path)
        member = src.find("corpus.jsonl")
        if member is None:
            raise IngestError(f"{path}: no corpus.jsonl")
        names = [src.display(member)]
        records = _jsonl_records(src, member, fields, CORPUS_KEYS)
    elif fmt == "jsonl":
        records = _jsonl_records(_File(path), "", fields, CORPUS_KEYS)
    elif fmt in ("csv", "tsv"):
        records = _csv_records(path, "\t" if fmt == "tsv" else ",", fields, CORPUS_KEYS)
    elif fmt == "parquet":
        records = _parquet_records(files, fields, CORPUS_KEYS)
    else:
        records = _folder_records(path, files)
    where: Callable[[Loc], str] = {
        "parquet": lambda loc: f"{names[loc[0]]}: row {loc[1]}",
        "folder": lambda loc: names[loc[0]]}.get(fmt, lambda loc: f"{names[loc[0]]}:{loc[1]}")
    return records, where


# ---- queries and qrels ----------------------------------------------------------------------
def read_queries(path: Path, *, fields: dict[str, str] | None = None) -> pa.Table:
    """Queries (``queries`` schema) from .jsonl (BEIR: _id, text), .csv/.tsv with a header, or .txt
    (a query a line; ids ``q-`` + 12 hex digits of the text's sha256, repeated texts kept once)."""
    path = Path(path)
    _check_fields(fields, QUERY_KEYS)
    if not path.is_file():
        raise IngestError(f"{path}: no such file")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".json")):
        records = _jsonl_records(_File(path), "", fields, QUERY_KEYS)
    elif name.endswith((".csv", ".tsv", ".tab")):
        records = _csv_records(path, "," if name.endswith(".csv") else "\t", fields, QUERY_KEYS)
    elif name.endswith(".txt"):
        records = (((0, n), None, "", line.strip()) for n, line in _text_lines(_File(path), "") if line.strip())
    else:
        raise IngestError(f"{path}: unknown extension '{path.suffix}' for queries (known: .jsonl, .csv, .tsv, .txt)")
    seen: dict[str, int] = {}
    ids, texts = [], []
    empty = repeats = 0
    for (_, n), qid, _, text in records:
        if not text.strip():
            empty += 1
            continue
        if qid is None:
            qid = "q-" + hashlib.sha256(text.encode()).hexdigest()[:12]
            if qid in seen:
                repeats += 1
                continue
        elif qid in seen:
            raise IngestError(f"{path}:{n}: duplicate query id '{qid}' (first on line {seen[qid]})")
        seen[qid] = n
        ids.append(qid)
        texts.append(text)
    if empty:
        log.warning("%s: %d query(ies) with empty text dropped", path, empty)
    if repeats:
        log.warning("%s: %d repeated query text(s) kept once", path, repeats)
    if not ids:
        raise IngestError(f"{path}: no queries")
    return pa.table({"query_id": ids, "text": texts}, schema=data_contracts.QUERIES.schema)


def read_qrels(path: Path, *, split: str = "test") -> pa.Table:
    """Judgements (``qrels`` schema, all of ``split``) from a TSV ``query_id<TAB>doc_id<TAB>relevance``
    (an optional header row, as BEIR's) or a TREC qrels file (``qid 0 docid rel``, whitespace separated)."""
    path = Path(path)
    if not path.is_file():
        raise IngestError(f"{path}: no such file")
    from irflow.sources.beir import Judgements

    judged, first = Judgements(), True
    for lineno, text in _text_lines(_File(path), ""):
        line = text.rstrip("\r\n")
        if not line.strip():
            continue
        parts = line.split("\t") if "\t" in line else line.split()
        if first and not re.fullmatch(r"[+-]?\d+", parts[-1].strip()):
            first = False
            continue  # a header row ('query-id<TAB>corpus-id<TAB>score' in BEIR): its relevance is no number
        first = False
        if len(parts) not in (3, 4):
            raise IngestError(f"{path}:{lineno}: expected 'query_id<TAB>doc_id<TAB>relevance' or TREC "
                              f"'qid 0 docid rel', got {line[:80]!r}")
        qid, did, rel = (parts[0], parts[1], parts[2]) if len(parts) == 3 else (parts[0], parts[2], parts[3])
        qid, did = qid.strip(), did.strip()
        try:
            score = int(rel)
        except ValueError:
            raise IngestError(f"{path}:{lineno}: relevance must be an integer, got {rel!r}") from None
        if not qid or not did:
            raise IngestError(f"{path}:{lineno}: empty query or document id")
        judged.add(qid, did, score, f"{path}:{lineno}", lineno)
    if not judged.qids:
        raise IngestError(f"{path}: no judgements")
    return judged.table(split, str(path)).cast(data_contracts.QRELS.schema)
