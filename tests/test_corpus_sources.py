"""irflow.sources.corpus_sources: a user's own documents (JSONL, Parquet, CSV/TSV, a folder of files), queries and
qrels, read from real SciFact data written out in each format."""

from __future__ import annotations

import csv
import gzip
import hashlib
import html
import json
import logging
import math
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from irflow import data_contracts
from irflow.dev.testing import SHARED_DATASETS
from irflow.sources import corpus_sources as cs
from irflow.sources.beir import IngestError

N = 60
SAMPLE = Path(cs.__file__).parents[1] / "samples" / "scifact-sample.zip"


def _zip_lines(member: str, n: int | None = None) -> list[str]:
    with zipfile.ZipFile(SHARED_DATASETS / "scifact.zip") as z, z.open(member) as f:
        lines = [line.decode("utf-8") for line in f]
    return lines[:n] if n else lines


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    """The first N SciFact documents as they are in its corpus.jsonl."""
    out = [json.loads(line) for line in _zip_lines("scifact/corpus.jsonl", N)]
    # the line numbers asserted below assume one document per line of a CSV file
    assert not any("\n" in d["text"] or "\n" in d["title"] for d in out)
    return out


def expected(docs: list[dict]) -> list[tuple[str, str, str]]:
    return [(str(d["_id"]), d.get("title") or "", d["text"]) for d in docs]


def rows(path: Path) -> list[tuple[str, str, str]]:
    t = pq.read_table(path)
    assert t.schema == data_contracts.CORPUS.schema
    return list(zip(*(t.column(c).to_pylist() for c in ("doc_id", "title", "text"))))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return path


def write_csv(path: Path, records: list[dict], columns: dict[str, str], delimiter: str = ",") -> Path:
    """``columns``: the file's column -> the record's key."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter=delimiter, lineterminator="\n")
        w.writerow(columns)
        w.writerows([r[k] for k in columns.values()] for r in records)
    return path


def table(records: list[dict], columns: dict[str, str]) -> pa.Table:
    return pa.table({col: [r[k] for r in records] for col, k in columns.items()})


BEIR_COLUMNS = {"_id": "_id", "title": "title", "text": "text"}


# ---- every format gives the same corpus ------------------------------------------------------
def _jsonl(tmp, docs):
    return write_jsonl(tmp / "corpus.jsonl", docs), {}


def _jsonl_gz(tmp, docs):
    return write_jsonl(tmp / "corpus.jsonl.gz", docs), {}


def _parquet(tmp, docs):
    pq.write_table(table(docs, BEIR_COLUMNS), tmp / "corpus.parquet")
    return tmp / "corpus.parquet", {}


def _parquet_folder(tmp, docs):
    half = len(docs) // 2
    (tmp / "parts" / "b").mkdir(parents=True)  # sorted by path: a-first/ before b/
    (tmp / "parts" / "a-first").mkdir()
    pq.write_table(table(docs[:half], BEIR_COLUMNS), tmp / "parts" / "a-first" / "part-0.parquet")
    pq.write_table(table(docs[half:], BEIR_COLUMNS), tmp / "parts" / "b" / "part-1.parquet")
    (tmp / "parts" / "_SUCCESS").write_text("")  # a Spark marker file: not data
    return tmp / "parts", {}


def _csv_mapped(tmp, docs):
    path = write_csv(tmp / "corpus.csv", docs, {"doc_id": "_id", "headline": "title", "body": "text"})
    return path, {"id": "doc_id", "title": "headline", "text": "body"}


def _tsv(tmp, docs):
    return write_csv(tmp / "corpus.tsv", docs, BEIR_COLUMNS, "\t"), {}


@pytest.mark.parametrize("make, fmt", [(_jsonl, "jsonl"), (_jsonl_gz, "jsonl"), (_parquet, "parquet"),
                                       (_parquet_folder, "parquet"), (_csv_mapped, "csv"), (_tsv, "tsv")])
def test_each_format_reads_the_same_documents(tmp_path, docs, make, fmt):
    path, fields = make(tmp_path, docs)
    assert cs.detect_format(path) == fmt
    stats = cs.read_corpus(path, tmp_path / "out.parquet", fields=fields)
    assert rows(tmp_path / "out.parquet") == expected(docs)
    assert stats == cs.CorpusStats(documents=len(docs), passages=len(docs), empty_dropped=0, split_documents=0)
    data_contracts.CORPUS.validate(pq.read_table(tmp_path / "out.parquet"))


def test_beir_zip_and_folder(tmp_path):
    with zipfile.ZipFile(SAMPLE) as z:
        z.extractall(tmp_path / "beir")
        n_lines = sum(1 for line in z.read("corpus.jsonl").splitlines() if line.strip())
    assert cs.detect_format(SAMPLE) == cs.detect_format(tmp_path / "beir") == "beir"
    stats = cs.read_corpus(SAMPLE, tmp_path / "a.parquet")
    cs.read_corpus(tmp_path / "beir", tmp_path / "b.parquet")
    assert stats.documents == stats.passages == n_lines
    assert rows(tmp_path / "a.parquet") == rows(tmp_path / "b.parquet")


def test_numeric_ids_become_strings(tmp_path, docs):
    records = [{**d, "_id": int(d["_id"])} for d in docs]
    cs.read_corpus(write_jsonl(tmp_path / "c.jsonl", records), tmp_path / "a.parquet")
    pq.write_table(table(records, {"doc_id": "_id", "text": "text"}), tmp_path / "c.parquet")
    cs.read_corpus(tmp_path / "c.parquet", tmp_path / "b.parquet")
    assert rows(tmp_path / "a.parquet") == expected(docs)
    assert rows(tmp_path / "b.parquet") == [(i, "", text) for i, _, text in expected(docs)]


def test_rows_without_ids_get_content_ids_and_repeats_are_one_document(tmp_path, docs, caplog):
    path = write_csv(tmp_path / "c.csv", docs + docs[:2], {"title": "title", "text": "text"})
    with caplog.at_level(logging.WARNING, logger="irflow.sources.corpus_sources"):
        stats = cs.read_corpus(path, tmp_path / "out.parquet")
    want = [("row-" + hashlib.sha256(f"{t}\n{x}".encode()).hexdigest()[:16], t, x) for _, t, x in expected(docs)]
    assert rows(tmp_path / "out.parquet") == want
    assert stats.documents == len(docs)
    assert "2 repeated document(s)" in caplog.text and f"{path}:{len(docs) + 2}" in caplog.text


# ---- a folder of documents -------------------------------------------------------------------
def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>body {{ color: red }}</style><script>var hidden = 'SCRIPTTEXT';</script></head>"
            f"<body><h1>{html.escape(title)}</h1><p>{html.escape(body)}</p><script>alert('x')</script></body></html>")


def test_folder_of_txt_md_html(tmp_path, docs, caplog):
    root = tmp_path / "docs"
    for sub in ("notes", "pages", "txt", ".git"):
        (root / sub).mkdir(parents=True)
    want = {}
    for i, d in enumerate(docs[:30]):
        title, text = d["title"], d["text"]
        if i % 3 == 0:
            name = f"txt/{i:02d}.txt"
            (root / name).write_text(text, encoding="utf-8")
            want[name] = (f"{i:02d}", text)
        elif i % 3 == 1:
            name = f"notes/{i:02d}.md"
            content = f"```sh\n# not the title\n```\n# {title}\n\n{text}\n"
            (root / name).write_text(content, encoding="utf-8")
            want[name] = (title, content)
        else:
            name = f"pages/{i:02d}.html"
            (root / name).write_text(_page(title, text), encoding="utf-8")
            want[name] = (" ".join(title.split()), " ".join(title.split()) + "\n" + " ".join(text.split()))
    (root / ".hidden.txt").write_text("hidden")
    (root / ".git" / "HEAD.txt").write_text("hidden too")
    (root / "paper.pdf").write_bytes(b"%PDF-1.4")
    (root / "notes" / "sheet.xlsx").write_bytes(b"PK")
    assert cs.detect_format(root) == "folder"
    with caplog.at_level(logging.WARNING, logger="irflow.sources.corpus_sources"):
        stats = cs.read_corpus(root, tmp_path / "out.parquet")
    assert "2 file(s) of other types ignored (.pdf: 1, .xlsx: 1)" in caplog.text
    assert rows(tmp_path / "out.parquet") == [(name, *want[name]) for name in sorted(want)]
    assert stats.documents == len(want)


def test_html_keeps_the_title_and_visible_text_only(tmp_path, docs):
    d = docs[0]
    words = d["text"].split()
    half = len(words) // 2
    page = (f"<html><head><title>  {html.escape(d['title'])} </title><style>p {{ margin: 0 }}</style>"
            f"<script>var SECRET = 1;</script></head><body><div>{' '.join(words[:half])}<br>"
            f"<b>{words[half]}</b> {' '.join(words[half + 1:])}</div><ul><li>first</li><li>second</li></ul>"
            f"<table><tr><td>a</td><td>b</td></tr></table><script>alert('SECRET')</script>"
            f"<noscript>enable &amp; reload</noscript></body></html>")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "page.htm").write_text(page, encoding="utf-8")
    cs.read_corpus(tmp_path / "d", tmp_path / "out.parquet")
    [(doc_id, title, text)] = rows(tmp_path / "out.parquet")
    assert (doc_id, title) == ("page.htm", d["title"])
    assert "SECRET" not in text and "margin" not in text
    assert text.split("\n") == [" ".join(words[:half]), " ".join(words[half:]), "first", "second", "a b",
                                "enable & reload"]
    # a page whose <head> is never closed still has a body; no <title>: the file's stem
    (tmp_path / "d" / "page.htm").write_text("<head><meta charset=utf-8><p>body text</p>", encoding="utf-8")
    cs.read_corpus(tmp_path / "d", tmp_path / "out.parquet")
    assert rows(tmp_path / "out.parquet") == [("page.htm", "page", "body text")]


def test_folder_utf8_bom_and_bad_bytes(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    (root / "bom.txt").write_bytes("\ufeffcafé au lait".encode("utf-8"))
    cs.read_corpus(root, tmp_path / "out.parquet")
    assert rows(tmp_path / "out.parquet") == [("bom.txt", "bom", "café au lait")]
    latin = "un café noir".encode("latin-1")
    (root / "latin.txt").write_bytes(latin)
    offset = latin.index(0xE9)
    with pytest.raises(IngestError, match=rf"latin\.txt: not UTF-8 text \(invalid byte at offset {offset}\)"):
        cs.read_corpus(root, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_source_changed_while_read(tmp_path, docs, monkeypatch):
    root = tmp_path / "d"
    root.mkdir()
    for i, d in enumerate(docs[:3]):
        (root / f"{i}.txt").write_text(d["text"], encoding="utf-8")
    read = cs._read_utf8

    def read_and_touch(f):  # another program appends to the last file while the first is read
        if f.name == "0.txt":
            with open(root / "2.txt", "a", encoding="utf-8") as w:
                w.write(" appended")
        return read(f)

    monkeypatch.setattr(cs, "_read_utf8", read_and_touch)
    with pytest.raises(IngestError, match=r"changed while it was read; nothing was stored, run again"):
        cs.read_corpus(root, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


# ---- passages --------------------------------------------------------------------------------
def test_passages_windows_ids_and_coverage(tmp_path, docs):
    longest = max(docs, key=lambda d: len(d["text"].split()))
    words = longest["text"].split()
    max_words = len(words) // 3
    stride = max_words // 2
    path = write_jsonl(tmp_path / "c.jsonl", docs)
    stats = cs.read_corpus(path, tmp_path / "out.parquet", max_words=max_words, stride=stride)
    out = rows(tmp_path / "out.parquet")

    mine = [(pid, title, text) for pid, title, text in out if cs.document_id(pid) == longest["_id"]]
    n_windows = math.ceil((len(words) - max_words) / stride) + 1
    assert [pid for pid, _, _ in mine] == [f"{longest['_id']}#{k}" for k in range(1, n_windows + 1)]
    assert all(title == longest["title"] for _, title, _ in mine)
    windows = [text.split() for _, _, text in mine]
    assert all(len(w) == max_words for w in windows[:-1]) and 0 < len(windows[-1]) <= max_words
    for a, b in zip(windows, windows[1:]):
        assert a[stride:] == b[:max_words - stride]  # consecutive windows overlap by max_words - stride
    assert windows[-1][-1] == words[-1] and windows[-1] != windows[-2][-len(windows[-1]):]
    assert [w for k, win in enumerate(windows) for w in win[(max_words - stride if k else 0):]] == words

    cut = [d for d in docs if len(d["text"].split()) > max_words]
    assert stats.split_documents == len(cut)
    assert stats.documents == len(docs) == len({cs.document_id(p) for p, _, _ in out})
    assert stats.passages == len(out) > len(docs)
    whole = [(p, t, x) for p, t, x in out if "#" not in p]
    assert whole == [(d["_id"], d["title"], d["text"]) for d in docs if d not in cut]

    # no overlap by default: the windows are the words, in order, once each
    cs.read_corpus(path, tmp_path / "plain.parquet", max_words=max_words)
    plain = [text for pid, _, text in rows(tmp_path / "plain.parquet") if cs.document_id(pid) == longest["_id"]]
    assert len(plain) == math.ceil(len(words) / max_words) and " ".join(plain) == " ".join(words)


def test_document_id_and_passage_settings(tmp_path, docs):
    assert cs.document_id("a#2") == "a" and cs.document_id("x#1#12") == "x#1"
    for same in ("a", "a#", "a#b", "#3", "notes/a.md", "row-0123abcd"):
        assert cs.document_id(same) == same
    path = write_jsonl(tmp_path / "c.jsonl", docs)
    for bad in ({"max_words": 10, "stride": 0}, {"max_words": 10, "stride": 11}, {"max_words": 0}):
        with pytest.raises(ValueError):
            cs.read_corpus(path, tmp_path / "out.parquet", **bad)
    hashed = write_jsonl(tmp_path / "h.jsonl", [{**docs[0], "_id": "doc#3"}, *docs[1:]])
    # refused cut or not: the held-out split would take 'doc#3' for a passage of a document 'doc'
    for max_words in (None, 50):
        with pytest.raises(IngestError, match=rf"{hashed}:1: id 'doc#3' ends in '#<digits>'.*'doc-3'"):
            cs.read_corpus(hashed, tmp_path / "out.parquet", max_words=max_words)


def test_jsonl_ids_on_some_lines_only_are_refused(tmp_path, docs):
    """Line 1 without an id gives every line a content id; a later line's own id would then be dropped
    silently: refused, naming both lines."""
    first = {k: v for k, v in docs[0].items() if k != "_id"}
    path = write_jsonl(tmp_path / "mixed.jsonl", [first, *docs[1:4]])
    with pytest.raises(IngestError, match=rf"{path}:2: has an id \('_id'\) but line 1 has none"):
        cs.read_corpus(path, tmp_path / "out.parquet")
    none = write_jsonl(tmp_path / "none.jsonl", [{k: v for k, v in d.items() if k != "_id"} for d in docs[:4]])
    stats = cs.read_corpus(none, tmp_path / "out.parquet")
    assert stats.documents == 4


# ---- bad input -------------------------------------------------------------------------------
def test_malformed_json_and_bad_utf8_name_the_line(tmp_path, docs):
    lines = [json.dumps(d) + "\n" for d in docs]
    lines[6] = lines[6][:40] + "\n"
    (tmp_path / "c.jsonl").write_text("".join(lines), encoding="utf-8")
    with pytest.raises(IngestError, match=rf"{tmp_path / 'c.jsonl'}:7: malformed JSON"):
        cs.read_corpus(tmp_path / "c.jsonl", tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()
    (tmp_path / "t.jsonl").write_text('{"_id": "x", "text": "a\tb"}\n')  # a raw tab inside a string
    with pytest.raises(IngestError, match=r"t.jsonl:1: malformed JSON \(Invalid control character at column 24\)"):
        cs.read_corpus(tmp_path / "t.jsonl", tmp_path / "out.parquet")
    raw = [line.encode() for line in lines[:6]] + [b'{"_id": "x", "text": "caf\xe9"}\n']
    (tmp_path / "b.jsonl").write_bytes(b"".join(raw))
    with pytest.raises(IngestError, match=rf"{tmp_path / 'b.jsonl'}:7: invalid UTF-8"):
        cs.read_corpus(tmp_path / "b.jsonl", tmp_path / "out.parquet")


def test_malformed_csv_rows(tmp_path, docs):
    path = write_csv(tmp_path / "c.csv", docs, BEIR_COLUMNS)
    good = path.read_text(encoding="utf-8")
    bad_line = good.count("\n") + 1
    path.write_text(good + "x1,title,text,one too many\n", encoding="utf-8")
    with pytest.raises(IngestError, match=rf"{path}:{bad_line}: expected 3 fields, got 4"):
        cs.read_corpus(path, tmp_path / "out.parquet")
    path.write_text(good + 'x1,"quoted"garbage,text\n', encoding="utf-8")
    with pytest.raises(IngestError, match=rf"{path}:{bad_line}: malformed CSV row"):
        cs.read_corpus(path, tmp_path / "out.parquet")


def test_missing_mapped_column(tmp_path, docs):
    fields = {"id": "_id", "text": "body"}
    path = write_csv(tmp_path / "c.csv", docs, BEIR_COLUMNS)
    with pytest.raises(IngestError, match=rf"{path}: no column 'body' \(columns: _id, title, text\)"):
        cs.read_corpus(path, tmp_path / "out.parquet", fields=fields)
    pq.write_table(table(docs, BEIR_COLUMNS), tmp_path / "c.parquet")
    with pytest.raises(IngestError, match=r"c\.parquet: no column 'body' \(columns: _id, title, text\)"):
        cs.read_corpus(tmp_path / "c.parquet", tmp_path / "out.parquet", fields=fields)
    records = [{"_id": d["_id"], "body": d["text"]} for d in docs]
    del records[4]["body"]
    jsonl = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(IngestError, match=rf"{jsonl}:5: missing 'body'"):
        cs.read_corpus(jsonl, tmp_path / "out.parquet", fields=fields)
    with pytest.raises(IngestError, match=rf"{jsonl}:1: no key 'text'"):  # the default text key, absent
        cs.read_corpus(jsonl, tmp_path / "out.parquet")


def test_duplicate_ids_name_both_places(tmp_path, docs):
    path = write_csv(tmp_path / "c.csv", docs + [docs[3]], BEIR_COLUMNS)
    with pytest.raises(IngestError, match=rf"{path}:{len(docs) + 2}: duplicate id '{docs[3]['_id']}' "
                                          rf"\(first at {path}:5\)"):
        cs.read_corpus(path, tmp_path / "out.parquet")
    jsonl = write_jsonl(tmp_path / "c.jsonl", docs + [docs[0]])
    with pytest.raises(IngestError,
                       match=rf"{jsonl}:{len(docs) + 1}: duplicate id '{docs[0]['_id']}' \(first at {jsonl}:1\)"):
        cs.read_corpus(jsonl, tmp_path / "out.parquet")
    folder, _ = _parquet_folder(tmp_path, docs + [docs[1]])
    with pytest.raises(IngestError, match=rf"part-1\.parquet: row {len(docs) + 1}: duplicate id '{docs[1]['_id']}' "
                                          rf"\(first at \S*part-0\.parquet: row 2\)"):
        cs.read_corpus(folder, tmp_path / "out.parquet")


def test_empty_texts_are_dropped_and_counted(tmp_path, docs, caplog):
    empty_at = [2, 5, len(docs) - 1]
    records = [{**d, "text": " \t "} if i in empty_at else d for i, d in enumerate(docs)]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="irflow.sources.corpus_sources"):
        stats = cs.read_corpus(path, tmp_path / "out.parquet")
    assert f"{len(empty_at)} document(s) with empty text dropped (first: {path}:{empty_at[0] + 1})" in caplog.text
    assert stats.empty_dropped == len(empty_at) and stats.documents == len(docs) - len(empty_at)
    assert rows(tmp_path / "out.parquet") == [r for i, r in enumerate(expected(docs)) if i not in empty_at]
    write_jsonl(path, [{**d, "text": ""} for d in docs])
    with pytest.raises(IngestError, match=rf"{path}: no document with text"):
        cs.read_corpus(path, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_paths_that_are_not_sources(tmp_path):
    with pytest.raises(IngestError, match=rf"{tmp_path / 'nope.jsonl'}: no such file or folder"):
        cs.detect_format(tmp_path / "nope.jsonl")
    with pytest.raises(IngestError, match="no such file or folder"):
        cs.read_corpus(tmp_path / "nope.jsonl", tmp_path / "out.parquet")
    (tmp_path / "report.docx").write_bytes(b"PK")
    with pytest.raises(IngestError, match=r"report\.docx: unknown extension '\.docx'"):
        cs.read_corpus(tmp_path / "report.docx", tmp_path / "out.parquet")
    (tmp_path / "empty").mkdir()
    (tmp_path / "only-pdf").mkdir()
    (tmp_path / "only-pdf" / "a.pdf").write_bytes(b"%PDF")
    for folder in ("empty", "only-pdf"):
        with pytest.raises(IngestError, match=rf"{tmp_path / folder}: no documents \(\.txt, \.md, \.html\) found"):
            cs.read_corpus(tmp_path / folder, tmp_path / "out.parquet")
    with pytest.raises(ValueError, match="format"):
        cs.read_corpus(tmp_path / "empty", tmp_path / "out.parquet", format="xml")


@pytest.mark.parametrize("name, fmt", [("a.jsonl", "jsonl"), ("a.JSONL.gz", "jsonl"), ("a.json", "jsonl"),
                                       ("a.parquet", "parquet"), ("a.csv", "csv"), ("a.tsv", "tsv"),
                                       ("a.tab", "tsv")])
def test_detect_format_by_extension(tmp_path, name, fmt):
    (tmp_path / name).write_bytes(b"")
    assert cs.detect_format(tmp_path / name) == fmt


# ---- queries and qrels -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def queries() -> list[dict]:
    return [json.loads(line) for line in _zip_lines("scifact/queries.jsonl")]


def test_read_queries_jsonl_tsv_txt(tmp_path, queries):
    (tmp_path / "queries.jsonl").write_text("".join(_zip_lines("scifact/queries.jsonl")), encoding="utf-8")
    got = cs.read_queries(tmp_path / "queries.jsonl")
    assert got.schema == data_contracts.QUERIES.schema
    assert got.to_pylist() == [{"query_id": q["_id"], "text": q["text"]} for q in queries]

    some = queries[:25]
    write_csv(tmp_path / "q.tsv", some, {"query_id": "_id", "text": "text"}, "\t")
    assert cs.read_queries(tmp_path / "q.tsv").to_pylist() == got.slice(0, len(some)).to_pylist()
    write_csv(tmp_path / "q.csv", some, {"qno": "_id", "question": "text"})
    mapped = cs.read_queries(tmp_path / "q.csv", fields={"id": "qno", "text": "question"})
    assert mapped.to_pylist() == got.slice(0, len(some)).to_pylist()

    texts = [q["text"] for q in some]
    (tmp_path / "q.txt").write_text("\n".join(texts[:10] + ["", "   "] + texts[10:] + [texts[3]]) + "\n",
                                    encoding="utf-8")
    txt = cs.read_queries(tmp_path / "q.txt")
    assert txt.column("text").to_pylist() == texts
    assert txt.column("query_id").to_pylist() == ["q-" + hashlib.sha256(t.encode()).hexdigest()[:12] for t in texts]


def test_read_queries_errors(tmp_path, queries):
    (tmp_path / "q.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(IngestError, match=rf"{tmp_path / 'q.txt'}: no queries"):
        cs.read_queries(tmp_path / "q.txt")
    path = write_csv(tmp_path / "q.tsv", queries[:5] + [queries[1]], {"query_id": "_id", "text": "text"}, "\t")
    with pytest.raises(IngestError, match=rf"{path}:7: duplicate query id '{queries[1]['_id']}' \(first on line 3\)"):
        cs.read_queries(path)
    path = write_csv(tmp_path / "q2.tsv", queries[:5], {"query_id": "_id", "question": "text"}, "\t")
    with pytest.raises(IngestError, match=rf"{path}: no column 'text' \(columns: query_id, question\)"):
        cs.read_queries(path)


@pytest.fixture(scope="module")
def qrels_lines() -> list[str]:
    return _zip_lines("scifact/qrels/test.tsv")


def test_read_qrels_tsv_with_header_and_trec(tmp_path, qrels_lines):
    (tmp_path / "test.tsv").write_text("".join(qrels_lines), encoding="utf-8")
    body = [line.rstrip("\n").split("\t") for line in qrels_lines[1:]]
    want = {"query_id": [q for q, _, _ in body], "doc_id": [d for _, d, _ in body], "score": [int(s) for *_, s in body]}
    got = cs.read_qrels(tmp_path / "test.tsv")
    assert got.schema == data_contracts.QRELS.schema
    assert got.to_pydict() == {**want, "split": ["test"] * len(body)}
    (tmp_path / "qrels.trec").write_text("".join(f"{q} 0 {d}  {s}\n" for q, d, s in body), encoding="utf-8")
    assert cs.read_qrels(tmp_path / "qrels.trec", split="dev").to_pydict() == {**want, "split": ["dev"] * len(body)}
    (tmp_path / "own.tsv").write_text("question\tpassage\tlabel\n" + "".join(qrels_lines[1:]), encoding="utf-8")
    assert cs.read_qrels(tmp_path / "own.tsv").equals(got)


def test_read_qrels_errors(tmp_path, qrels_lines):
    lines = list(qrels_lines)
    q, d, _ = lines[4].rstrip("\n").split("\t")
    lines[4] = f"{q}\t{d}\trelevant\n"
    (tmp_path / "bad.tsv").write_text("".join(lines), encoding="utf-8")
    with pytest.raises(IngestError, match=rf"{tmp_path / 'bad.tsv'}:5: relevance must be an integer, got 'relevant'"):
        cs.read_qrels(tmp_path / "bad.tsv")
    lines[4] = f"{q}\t{d}\n"
    (tmp_path / "bad.tsv").write_text("".join(lines), encoding="utf-8")
    with pytest.raises(IngestError, match=rf"{tmp_path / 'bad.tsv'}:5: expected 'query_id<TAB>doc_id"):
        cs.read_qrels(tmp_path / "bad.tsv")
    (tmp_path / "empty.tsv").write_text(qrels_lines[0], encoding="utf-8")
    with pytest.raises(IngestError, match="no judgements"):
        cs.read_qrels(tmp_path / "empty.tsv")
