"""Ingest of real BEIR data (SciFact slices, the NFCorpus archive over HTTP): counts, contracts,
bad input (IngestError naming file:line, nothing published), dangling qrels, downloads, cache keys.

A source enters the ``ingest`` stage as an input ref (``source_ref``: its content fingerprint, not its
path); bad *data* is found inside the stage, so it surfaces as ``StageFailed`` whose cause is the
``IngestError``; a bad *source* (missing file, wrong md5, failed download) is found by ``source_ref``
before any stage runs, and raises ``IngestError`` itself."""

from __future__ import annotations

import functools
import http.server
import json
import logging
import re
import shutil
import threading
import zipfile
from pathlib import Path

import duckdb
import pyarrow.compute as pc
import pytest
from pydantic import ValidationError

from irflow import data_contracts
from irflow.dev.testing import SHARED_DATASETS, beir_slice
from irflow.engine.errors import DataError, StageFailed, UserError
from irflow.engine.runner import Run
from irflow.engine.store import fingerprint_file, remove_tree
from irflow.sources.beir import IngestError, dataset_splits, is_url
from irflow.stages.ingest import IngestParams, ingest_beir, source_ref

DATASETS = SHARED_DATASETS
SCIFACT = DATASETS / "scifact.zip"
NFCORPUS = DATASETS / "nfcorpus.zip"
NFCORPUS_MD5 = "a89dba18a62ef92f7d323ec890a0d38d"



# ---- helpers --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scifact_slice_master(tmp_path_factory) -> Path:
    return beir_slice(SCIFACT, tmp_path_factory.mktemp("scifact") / "scifact", n_test_queries=12,
                      n_train_queries=6, n_extra_docs=25, seed=1)


@pytest.fixture
def sl(scifact_slice_master, tmp_path) -> Path:
    """A private, editable copy of the SciFact slice."""
    return Path(shutil.copytree(scifact_slice_master, tmp_path / "scifact"))


@pytest.fixture
def ctx(tmp_path) -> Run:
    return Run(str(tmp_path / "store"), "run-1")


def ingest(ctx: Run, source, md5: str | None = None, **params):
    """What the recipes do (irflow.recipes.dataset.ingest): the source as an external input ref, then the stage."""
    ref = ctx.external(source_ref(str(source), md5, ctx.store.root / "downloads"), {"source": str(source)})
    return ingest_beir.run(ctx, IngestParams(**params), source=ref)


def ingest_fails(ctx: Run, source, **extra) -> str:
    """Ingest bad data: the stage fails, named, with the IngestError (a user error) as its cause. Its message."""
    with pytest.raises(StageFailed) as e:
        ingest(ctx, source, **extra)
    assert e.value.stage == "ingest"
    assert isinstance(e.value.cause, IngestError) and isinstance(e.value.cause, DataError)
    assert e.value.user_error and e.value.one_line() == f"stage ingest: {e.value.cause}"
    return str(e.value.cause)


def nonempty_lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def qrels_rows(folder: Path) -> dict[str, list[list[str]]]:
    return {f.stem: [ln.split("\t") for ln in nonempty_lines(f)[1:]] for f in sorted((folder / "qrels").glob("*.tsv"))}


def last_status(ctx: Run) -> str:
    return ctx.catalog.stage_runs(ctx.run_id)[-1]["status"]


def assert_nothing_published(ctx: Run):
    root = Path(ctx.store_root)
    objects = sorted(p.name for p in (root / "objects").iterdir()) if (root / "objects").exists() else []
    assert not [o for o in objects if o.split("-")[0] in ("corpus", "queries", "qrels")], objects
    assert objects == []
    tmp = sorted(p.name for p in (root / "tmp").iterdir()) if (root / "tmp").exists() else []
    assert tmp == [], "staging left behind"
    if (root / "catalog.duckdb").exists():
        con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
        try:
            # the source itself may be recorded (an external ref, for lineage); nothing a stage made is
            assert con.execute("SELECT count(*) FROM datasets WHERE stage <> 'external' OR kind <> 'source'"
                               ).fetchone()[0] == 0
            assert con.execute("SELECT count(*) FROM stage_runs").fetchone()[0] == 0
        finally:
            con.close()


def rewrite_line(path: Path, lineno: int, new: str | bytes) -> None:
    """Replace 1-based line ``lineno`` of a file (bytes allowed, for bad UTF-8)."""
    lines = path.read_bytes().split(b"\n")
    lines[lineno - 1] = new if isinstance(new, bytes) else new.encode()
    path.write_bytes(b"\n".join(lines))


def zip_folder(folder: Path, out: Path, top: str | None = None, junk: bool = False) -> Path:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                rel = f.relative_to(folder).as_posix()
                z.write(f, f"{top}/{rel}" if top else rel)
                if junk:  # what macOS archivers add next to every file
                    z.writestr(f"__MACOSX/{top or '.'}/{Path(rel).parent.as_posix()}/._{f.name}", b"\x00\x05\x16\x07")
    return out


# ---- good input -----------------------------------------------------------------------------
def check_matches_source(refs: dict, folder: Path) -> None:
    corpus_lines = [json.loads(ln) for ln in nonempty_lines(folder / "corpus.jsonl")]
    query_lines = [json.loads(ln) for ln in nonempty_lines(folder / "queries.jsonl")]
    qrels = qrels_rows(folder)
    corpus, queries, qr = refs["corpus"].table(), refs["queries"].table(), refs["qrels"].table()

    assert corpus.num_rows == len(corpus_lines) > 0
    assert queries.num_rows == len(query_lines) > 0
    assert qr.num_rows == sum(len(rows) for rows in qrels.values()) > 0
    # same ids, in file order, and the texts survive byte for byte
    assert corpus.column("doc_id").to_pylist() == [str(d["_id"]) for d in corpus_lines]
    assert corpus.column("text").to_pylist() == [d["text"] for d in corpus_lines]
    assert corpus.column("title").to_pylist() == [d.get("title") or "" for d in corpus_lines]
    assert queries.column("query_id").to_pylist() == [str(q["_id"]) for q in query_lines]
    for split, rows in qrels.items():
        got = qr.filter(pc.equal(qr["split"], split))
        assert sorted(zip(got["query_id"].to_pylist(), got["doc_id"].to_pylist(), got["score"].to_pylist())) == \
            sorted((r[0], r[1], int(r[2])) for r in rows)
    for name in ("corpus", "queries", "qrels"):
        c = data_contracts.get(name)
        t = refs[name].table()
        assert t.schema.equals(c.schema)
        c.validate(t)  # raises if a contract does not hold


def test_ingest_folder_matches_source_and_contracts(sl, ctx):
    refs = ingest(ctx, sl)
    assert set(refs) == {"corpus", "queries", "qrels"}
    check_matches_source(refs, sl)
    assert set(qrels_rows(sl)) == {"test", "train"}
    assert last_status(ctx) == "computed"
    for name, ref in refs.items():
        row = ctx.catalog.dataset(ref.id)
        assert row["stage"] == "ingest" and row["run_id"] == "run-1" and row["contract"] == name
        assert row["num_rows"] == ref.table().num_rows
        assert Path(ref.path) == Path(ctx.store_root).resolve() / "objects" / ref.id
    assert list((Path(ctx.store_root) / "tmp").iterdir()) == []


@pytest.mark.parametrize("top", [None, "scifact"], ids=["flat", "top-folder"])
def test_ingest_local_zip(sl, ctx, tmp_path, top):
    folder_refs = ingest(ctx, sl)
    z = zip_folder(sl, tmp_path / "scifact.zip", top=top, junk=top is not None)
    zip_refs = ingest(ctx, z)
    assert last_status(ctx) == "computed"  # another source fingerprint ...
    check_matches_source(zip_refs, sl)
    # ... but the same content: content-addressed ids are equal to the folder's
    assert {k: r.id for k, r in zip_refs.items()} == {k: r.id for k, r in folder_refs.items()}


# ---- bad input ------------------------------------------------------------------------------
def _mutate_malformed(d):
    rewrite_line(d / "corpus.jsonl", 3, '{"_id": "broken", "title": "x", "text": ')


def _mutate_missing_id(d):
    rewrite_line(d / "queries.jsonl", 2, json.dumps({"text": "a query without an id"}))


def _mutate_duplicate(d):
    first = json.loads(nonempty_lines(d / "corpus.jsonl")[1])
    rewrite_line(d / "corpus.jsonl", 5, json.dumps({"_id": first["_id"], "title": "", "text": "again"}))


def _mutate_text_number(d):
    rewrite_line(d / "corpus.jsonl", 4, json.dumps({"_id": "num-text", "title": "t", "text": 42}))


def _mutate_text_list(d):
    rewrite_line(d / "queries.jsonl", 3, json.dumps({"_id": "list-text", "text": ["a", "b"]}))


def _mutate_title_number(d):
    rewrite_line(d / "corpus.jsonl", 2, json.dumps({"_id": "num-title", "title": 3.5, "text": "t"}))


def _mutate_bad_utf8(d):
    line = nonempty_lines(d / "corpus.jsonl")[5].encode()
    cut = line.index(b'"text": "') + len(b'"text": "')
    rewrite_line(d / "corpus.jsonl", 6, line[:cut] + b"\xff\xfe\xc3(" + line[cut:])


def _mutate_empty_corpus(d):
    (d / "corpus.jsonl").write_bytes(b"")


def _mutate_empty_queries(d):
    (d / "queries.jsonl").write_bytes(b"\n")


def _mutate_no_qrels(d):
    shutil.rmtree(d / "qrels")


def _mutate_qrels_score(d):
    rows = nonempty_lines(d / "qrels" / "test.tsv")
    q, doc, _ = rows[2].split("\t")
    rewrite_line(d / "qrels" / "test.tsv", 3, f"{q}\t{doc}\t1.5")


def _mutate_qrels_conflict(d):
    rows = nonempty_lines(d / "qrels" / "test.tsv")
    q, doc, s = rows[1].split("\t")
    with open(d / "qrels" / "test.tsv", "a") as f:
        f.write(f"{q}\t{doc}\t{int(s) + 1}\n")


BAD = {
    # name: (mutation, substrings the message must contain)
    "malformed-json": (_mutate_malformed, ["corpus.jsonl:3", "malformed JSON"]),
    "missing-id": (_mutate_missing_id, ["queries.jsonl:2", "_id"]),
    "duplicate-id": (_mutate_duplicate, ["corpus.jsonl:5", "duplicate", "line 2"]),
    "text-number": (_mutate_text_number, ["corpus.jsonl:4", "text", "int"]),
    "text-list": (_mutate_text_list, ["queries.jsonl:3", "text", "list"]),
    "title-number": (_mutate_title_number, ["corpus.jsonl:2", "title"]),
    "bad-utf8": (_mutate_bad_utf8, ["corpus.jsonl:6", "UTF-8"]),
    "empty-corpus": (_mutate_empty_corpus, ["corpus.jsonl", "empty corpus"]),
    "empty-queries": (_mutate_empty_queries, ["queries.jsonl", "no queries"]),
    "no-qrels": (_mutate_no_qrels, ["qrels"]),
    "qrels-score": (_mutate_qrels_score, ["test.tsv:3", "integer", "1.5"]),
    "qrels-conflict": (_mutate_qrels_conflict, ["test.tsv:", "line 2"]),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("as_zip", [False, True], ids=["folder", "zip"])
def test_bad_input_raises_and_publishes_nothing(sl, ctx, tmp_path, case, as_zip):
    mutate, expected = BAD[case]
    mutate(sl)
    source = zip_folder(sl, tmp_path / "bad.zip", top="scifact") if as_zip else sl
    msg = ingest_fails(ctx, source)
    for s in expected:
        assert s in msg, f"{s!r} not in {msg!r}"
    assert_nothing_published(ctx)


def test_qrels_conflict_names_both_lines(sl, ctx):
    _mutate_qrels_conflict(sl)
    n = len(nonempty_lines(sl / "qrels" / "test.tsv"))
    assert re.search(rf"test\.tsv:{n}: .* on line 2", ingest_fails(ctx, sl))


def test_repeated_identical_qrels_row_is_ignored(sl, ctx, caplog):
    row = nonempty_lines(sl / "qrels" / "test.tsv")[1]
    with open(sl / "qrels" / "test.tsv", "a") as f:
        f.write(row + "\n")
    caplog.set_level(logging.WARNING, logger="irflow.ingest")
    refs = ingest(ctx, sl)
    assert refs["qrels"].table().num_rows == sum(len(r) for r in qrels_rows(sl).values()) - 1
    assert any("1 repeated qrels row" in r.getMessage() for r in caplog.records)


def test_fixing_bad_input_then_ingests(sl, ctx):
    good = (sl / "corpus.jsonl").read_bytes()
    _mutate_malformed(sl)
    ingest_fails(ctx, sl)
    (sl / "corpus.jsonl").write_bytes(good)
    check_matches_source(ingest(ctx, sl), sl)
    assert last_status(ctx) == "computed"


# ---- dangling qrels -------------------------------------------------------------------------
def add_dangling(d: Path) -> tuple[int, set[str]]:
    """Two qrels rows whose document / query is not in the slice. Returns (source rows, bad doc ids)."""
    q = json.loads(nonempty_lines(d / "queries.jsonl")[0])["_id"]
    doc = json.loads(nonempty_lines(d / "corpus.jsonl")[0])["_id"]
    with open(d / "qrels" / "test.tsv", "a") as f:
        f.write(f"{q}\tno-such-doc\t1\n")
        f.write(f"no-such-query\t{doc}\t1\n")
    return sum(len(r) for r in qrels_rows(d).values()), {"no-such-doc"}


def test_dangling_qrels_keep_is_default_and_warns(sl, ctx, caplog):
    """As BEIR, pytrec_eval and Pyserini: judgements of missing documents stay (they score 0)."""
    n, _ = add_dangling(sl)
    caplog.set_level(logging.WARNING, logger="irflow.ingest")
    qr = ingest(ctx, sl)["qrels"].table()
    assert qr.num_rows == n
    assert "no-such-doc" in qr["doc_id"].to_pylist() and "no-such-query" in qr["query_id"].to_pylist()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("2 qrels row(s)" in w and "kept" in w and "scoring 0" in w for w in warnings), warnings


def test_dangling_qrels_drop(sl, ctx, caplog):
    n, _ = add_dangling(sl)
    caplog.set_level(logging.WARNING, logger="irflow.ingest")
    qr = ingest(ctx, sl, dangling_qrels="drop")["qrels"].table()
    assert qr.num_rows == n - 2
    assert "no-such-doc" not in qr["doc_id"].to_pylist()
    assert "no-such-query" not in qr["query_id"].to_pylist()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("2 qrels row(s)" in w and "dropped" in w for w in warnings), warnings


def test_dangling_warning_counts_the_queries_left_without_a_judged_document(sl, ctx, caplog):
    """Two test queries whose every judged document is removed from the corpus: keep says so (they
    will score 0), drop says they leave the evaluation."""
    rows = qrels_rows(sl)["test"]
    judged_by: dict[str, set[str]] = {}
    for q, d, _ in rows:
        judged_by.setdefault(d, set()).add(q)
    docs_of: dict[str, set[str]] = {}
    for q, d, _ in rows:
        docs_of.setdefault(q, set()).add(d)
    # queries whose documents no other query judges (in any split): removing them touches no one else
    others = {r[1] for split, rs in qrels_rows(sl).items() for r in rs if split != "test"}
    lonely = sorted(q for q, ds in docs_of.items() if all(judged_by[d] == {q} and d not in others for d in ds))[:2]
    gone = set().union(*(docs_of[q] for q in lonely))
    lines = nonempty_lines(sl / "corpus.jsonl")
    (sl / "corpus.jsonl").write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["_id"] not in gone))
    caplog.set_level(logging.WARNING, logger="irflow.ingest")
    assert ingest(ctx, sl)["qrels"].table().num_rows == sum(len(r) for r in qrels_rows(sl).values())
    assert ingest(ctx, sl, dangling_qrels="drop")["qrels"].table().num_rows == \
        sum(len(r) for r in qrels_rows(sl).values()) - len(gone)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{len(gone)} qrels row(s)" in w and "kept" in w and w.endswith("scoring 0 as in BEIR/Pyserini: "
                                                                                "2 in test") for w in warnings)
    assert any("dropped" in w and w.endswith("not evaluated: 2 in test") for w in warnings), warnings


def test_dangling_qrels_error(sl, ctx):
    add_dangling(sl)
    msg = ingest_fails(ctx, sl, dangling_qrels="error")
    assert re.search(r"\b2 qrels row", msg) and "dangling_qrels: error" in msg
    assert_nothing_published(ctx)


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_a_split_whose_every_judgement_dangles_is_refused(sl, ctx, policy):
    """Every test judgement points to a missing document: ingest refuses, naming the split, instead of
    publishing qrels that leave nothing to evaluate (drop would empty the split; keep would score every
    query 0)."""
    path = sl / "qrels" / "test.tsv"
    rows = [ln.split("\t") for ln in nonempty_lines(path)[1:]]
    path.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"{r[0]}\tgone-{i}\t1\n" for i, r in enumerate(rows)))
    msg = ingest_fails(ctx, sl, dangling_qrels=policy)
    assert "every qrels row of split test" in msg and "missing" in msg
    assert_nothing_published(ctx)


def test_dangling_policy_is_validated():
    with pytest.raises(ValidationError, match="dangling_qrels"):
        IngestParams(dangling_qrels="ignore")
    with pytest.raises(ValidationError, match="dangling"):  # extra=forbid: a typo is not a default
        IngestParams(dangling="keep")
    assert IngestParams().dangling_qrels == "keep"  # as BEIR / Pyserini / MTEB score


def test_dangling_policy_is_part_of_the_key(sl, ctx):
    add_dangling(sl)
    drop = ingest(ctx, sl, dangling_qrels="drop")
    keep = ingest(ctx, sl)
    assert last_status(ctx) == "computed"
    assert drop["corpus"].id == keep["corpus"].id and drop["qrels"].id != keep["qrels"].id


# ---- one dataset per source ------------------------------------------------------------------
def test_a_source_holding_two_datasets_is_refused_naming_both(sl, ctx, tmp_path):
    """A zip (or folder) with scifact/... and nfcorpus/... would mix one's corpus with the other's
    qrels: refused, one line naming both folders -- by the config check and by the stage."""
    from irflow.dev.testing import run_cli

    nf = beir_slice(NFCORPUS, tmp_path / "nf", n_test_queries=3, n_extra_docs=5, seed=2)
    both = tmp_path / "both.zip"
    with zipfile.ZipFile(both, "w") as z:
        for top, folder in (("scifact", sl), ("nfcorpus", nf)):
            for f in sorted(folder.rglob("*")):
                if f.is_file():
                    z.write(f, f"{top}/{f.relative_to(folder).as_posix()}")
    folder = tmp_path / "both"
    shutil.copytree(sl, folder / "scifact")
    shutil.copytree(nf, folder / "nfcorpus")
    for source in (both, folder):
        with pytest.raises(IngestError) as e:
            dataset_splits(str(source))
        msg = str(e.value)
        assert "\n" not in msg and "2 BEIR datasets (nfcorpus/, scifact/)" in msg and str(source) in msg
        assert ingest_fails(ctx, source) == msg
    assert_nothing_published(ctx)
    # a dataset at the top level next to one in a folder is two datasets too
    top = Path(shutil.copytree(sl, tmp_path / "top"))
    shutil.copytree(nf, top / "nfcorpus")
    with pytest.raises(IngestError, match=r"2 BEIR datasets \(\(top level\), nfcorpus/\)"):
        dataset_splits(str(top))
    # the CLI: one line, exit 2, before anything is created
    store = tmp_path / "store-cli"
    code, out, err = run_cli("run", Path(__file__).parents[1] / "configs" / "baselines_scifact.yaml",
                             "--set", f"dataset.source={both}", "--store", store)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err, err
    assert len([ln for ln in lines if ln.startswith("irflow: error:")]) == 1, err
    assert "nfcorpus/, scifact/" in err and not store.exists()


def test_a_dataset_in_a_folder_of_its_zip_reads_only_that_folder(sl, ctx, tmp_path):
    """One dataset under a top folder, plus stray non-BEIR files elsewhere: read from its folder."""
    z = zip_folder(sl, tmp_path / "s.zip", top="scifact", junk=True)
    with zipfile.ZipFile(z, "a") as zf:
        zf.writestr("README.txt", "not data")
        zf.writestr("scifact/qrels/notes/test.tsv", "not a split")  # not qrels/<split>.tsv of the dataset
    assert dataset_splits(str(z)) == ("test", "train")
    check_matches_source(ingest(ctx, z), sl)


def test_a_dataset_without_the_evaluated_split_is_refused(sl, ctx, tmp_path):
    """Known before any stage for a local source (the config check: dataset.split), else by
    select_queries once the source is read (a URL): one line, a user error, naming the splits there."""
    from irflow.recipes.dataset import DatasetConfig
    from irflow.stages.ingest import SelectQueriesParams, select_queries

    (sl / "qrels" / "test.tsv").unlink()
    with pytest.raises(ValidationError, match=r"split: 'test' is not a split of .* \(its qrels: train\)"):
        DatasetConfig(source=str(sl), split="test")
    refs = ingest(ctx, sl)
    with pytest.raises(StageFailed) as e:
        select_queries.run(ctx, SelectQueriesParams(split="test"), queries=refs["queries"], qrels=refs["qrels"])
    assert e.value.user_error
    assert e.value.one_line() == ("stage select_queries: no queries are judged in split 'test' "
                                  "(the dataset's qrels splits: train)")


def test_dataset_splits_and_is_url(sl, tmp_path, http_root):
    """What a recipe config checks before any stage runs: the source's qrels splits."""
    base, requests = http_root
    requests.clear()
    assert dataset_splits(str(sl)) == ("test", "train")
    z = zip_folder(sl, tmp_path / "s.zip", top="scifact", junk=True)
    assert dataset_splits(str(z)) == ("test", "train")
    assert dataset_splits(str(NFCORPUS)) == ("dev", "test", "train")
    assert is_url(f"{base}/nfcorpus.zip") and not is_url(str(z)) and not is_url("file:///x.zip")
    assert dataset_splits(f"{base}/nfcorpus.zip") is None  # not known before the download ...
    assert requests == []  # ... and not downloaded to find out
    with pytest.raises(IngestError, match="no such file"):
        dataset_splits(str(tmp_path / "missing"))


# ---- URL downloads --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    """A local HTTP server (127.0.0.1 only) serving a copy of nfcorpus.zip; yields (base URL, GET log)."""
    root = tmp_path_factory.mktemp("www")
    shutil.copy(NFCORPUS, root / "nfcorpus.zip")
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def nfcorpus_source_counts() -> dict:
    with zipfile.ZipFile(NFCORPUS) as z:
        def lines(m):
            return [ln for ln in z.read(m).decode().splitlines() if ln.strip()]

        test = lines("nfcorpus/qrels/test.tsv")[1:]
        return {
            "docs": len(lines("nfcorpus/corpus.jsonl")),
            "queries": len(lines("nfcorpus/queries.jsonl")),
            "test_queries": len({ln.split("\t")[0] for ln in test}),
        }


def test_url_download_ingest_and_cache(http_root, tmp_path):
    base, requests = http_root
    requests.clear()
    ctx = Run(str(tmp_path / "store"), "run-1")
    url = f"{base}/nfcorpus.zip"
    refs = ingest(ctx, url, md5=NFCORPUS_MD5)
    assert last_status(ctx) == "computed"
    src = nfcorpus_source_counts()
    corpus, queries, qr = refs["corpus"].table(), refs["queries"].table(), refs["qrels"].table()
    assert corpus.num_rows == src["docs"] == 3633
    assert queries.num_rows == src["queries"]
    test_q = set(qr.filter(pc.equal(qr["split"], "test"))["query_id"].to_pylist())
    assert len(test_q) == src["test_queries"] == 323
    assert set(qr["split"].to_pylist()) == {"train", "dev", "test"}
    for name in ("corpus", "queries", "qrels"):
        data_contracts.get(name).validate(refs[name].table())

    downloads = sorted((Path(ctx.store_root) / "downloads").iterdir())
    assert [p.name for p in downloads] == [f"{NFCORPUS_MD5}-nfcorpus.zip"]
    assert fingerprint_file(downloads[0], "md5") == NFCORPUS_MD5
    assert requests == ["/nfcorpus.zip"]

    # same config again, in a new run: no second download, the stage is cached with the same ids
    ctx2 = Run(ctx.store_root, "run-2")
    refs2 = ingest(ctx2, url, md5=NFCORPUS_MD5)
    assert [s["status"] for s in ctx2.catalog.stage_runs("run-2")] == ["cached"]
    assert {k: r.id for k, r in refs2.items()} == {k: r.id for k, r in refs.items()}
    assert requests == ["/nfcorpus.zip"]


def test_url_wrong_md5_leaves_nothing(http_root, tmp_path):
    base, _ = http_root
    ctx = Run(str(tmp_path / "store"), "run-1")
    wrong = "0" * 32
    with pytest.raises(IngestError, match="md5 mismatch") as e:
        ingest(ctx, f"{base}/nfcorpus.zip", md5=wrong)
    assert NFCORPUS_MD5 in str(e.value)  # says what it got
    assert isinstance(e.value, UserError)
    assert list((Path(ctx.store_root) / "downloads").iterdir()) == []
    assert_nothing_published(ctx)


def test_url_needs_md5_and_must_exist(http_root, tmp_path):
    base, _ = http_root
    ctx = Run(str(tmp_path / "store"), "run-1")
    with pytest.raises(IngestError, match="md5"):
        ingest(ctx, f"{base}/nfcorpus.zip")
    with pytest.raises(IngestError, match=r"no-such\.zip.*404"):
        ingest(ctx, f"{base}/no-such.zip", md5=NFCORPUS_MD5)
    assert list((Path(ctx.store_root) / "downloads").iterdir()) == []
    assert_nothing_published(ctx)


def test_local_zip_md5_checked(tmp_path):
    ctx = Run(str(tmp_path / "store"), "run-1")
    with pytest.raises(IngestError, match="md5 mismatch"):
        ingest(ctx, NFCORPUS, md5="f" * 32)
    with pytest.raises(IngestError, match="no such file"):
        ingest(ctx, tmp_path / "missing.zip")
    assert_nothing_published(ctx)


# ---- cache key ------------------------------------------------------------------------------
def test_changed_byte_recomputes(sl, ctx):
    first = ingest(ctx, sl)
    ingest(ctx, sl)
    assert last_status(ctx) == "cached"
    # change one character of one document's text (the file stays valid JSONL)
    lines = nonempty_lines(sl / "corpus.jsonl")
    doc = json.loads(lines[7])
    text = doc["text"]
    i = next(k for k, ch in enumerate(text) if ch.isalpha())
    doc["text"] = text[:i] + ("X" if text[i] != "X" else "Y") + text[i + 1:]
    rewrite_line(sl / "corpus.jsonl", 8, json.dumps(doc))
    second = ingest(ctx, sl)
    assert last_status(ctx) == "computed"
    assert second["corpus"].id != first["corpus"].id
    assert second["corpus"].table()["text"][7].as_py() == doc["text"]
    # what did not change keeps its id (content addressing)
    assert second["queries"].id == first["queries"].id and second["qrels"].id == first["qrels"].id
    # both versions stay in the store
    assert Path(first["corpus"].path).exists() and Path(second["corpus"].path).exists()


def test_moved_zip_is_cached(sl, ctx, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    z = zip_folder(sl, tmp_path / "a" / "scifact.zip", top="scifact")
    first = ingest(ctx, z)
    assert last_status(ctx) == "computed"
    moved = Path(shutil.move(z, tmp_path / "b" / "scifact.zip"))
    second = ingest(ctx, moved)
    assert last_status(ctx) == "cached"
    assert {k: r.id for k, r in second.items()} == {k: r.id for k, r in first.items()}
    # renamed too: the file name is not keyed (the dataset's display name is a recipe matter)
    renamed = Path(shutil.move(moved, tmp_path / "b" / "copy-of-it.zip"))
    ingest(ctx, renamed)
    assert last_status(ctx) == "cached"
    # a folder with the same files is a different source (different bytes to fingerprint)
    ingest(ctx, sl)
    assert last_status(ctx) == "computed"


def test_source_ref_id_is_path_independent(sl, tmp_path):
    """The same zip at two paths (a copy, not a move: both exist) is one source; other bytes are another."""
    downloads = tmp_path / "downloads"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    z = zip_folder(sl, tmp_path / "a" / "scifact.zip", top="scifact")
    copy = Path(shutil.copy(z, tmp_path / "b" / "other-name.zip"))
    ra, rb = source_ref(str(z), None, downloads), source_ref(str(copy), None, downloads)
    assert ra.id == rb.id == "sha256:" + fingerprint_file(z)
    assert (ra.path, rb.path) == (str(z.resolve()), str(copy.resolve()))  # where to read it differs
    assert ra.kind == "source" and ra.name == "scifact.zip" and rb.name == "other-name.zip"
    # a folder: keyed by its files, wherever it is
    folder_copy = Path(shutil.copytree(sl, tmp_path / "b" / "scifact"))
    assert source_ref(str(sl), None, downloads).id == source_ref(str(folder_copy), None, downloads).id != ra.id
    # one changed byte in the copy: another id
    rewrite_line(folder_copy / "queries.jsonl", 1, json.dumps({"_id": "new-query", "text": "edited"}))
    assert source_ref(str(folder_copy), None, downloads).id != source_ref(str(sl), None, downloads).id
    # a verified md5 is the id of a file (the same for every copy)
    md5 = fingerprint_file(z, "md5")
    assert source_ref(str(z), md5, downloads).id == source_ref(str(copy), md5, downloads).id == f"md5:{md5}"


def test_folder_md5_is_not_trusted(sl, ctx):
    """An md5 given for a folder cannot be verified, so the folder's content is still what is keyed."""
    first = ingest(ctx, sl, md5="0" * 32)
    rewrite_line(sl / "queries.jsonl", 1, json.dumps({"_id": "new-query", "text": "edited"}))
    second = ingest(ctx, sl, md5="0" * 32)
    assert last_status(ctx) == "computed"
    assert second["queries"].id != first["queries"].id


def test_deleted_output_recomputes(sl, ctx):
    first = ingest(ctx, sl)
    remove_tree(first["qrels"].path)  # objects are read-only
    second = ingest(ctx, sl)
    assert last_status(ctx) == "computed"
    assert second["qrels"].id == first["qrels"].id and Path(second["qrels"].path).exists()


# ---- a dev cut of the train split (bench/train_dev.py chooses settings on it) ------------------------
SAMPLE = Path(__file__).resolve().parents[1] / "irflow" / "samples" / "scifact-sample.zip"


def _beir_qrels(folder: Path, split: str) -> set[tuple[str, str, str]]:
    lines = (folder / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]
    return {tuple(ln.split("\t")) for ln in lines}


def test_train_dev_split_keeps_every_test_query_out(tmp_path):
    """The real sample: the train split's judged queries are cut into train (fit) and dev by query, every
    judgement lands on exactly one side, and the folder holds no test query, text or judgement."""
    from irflow.recipes.base import load_config
    from irflow.sources.beir import train_dev_split

    counts = train_dev_split(SAMPLE, tmp_path / "cut", dev_share=0.2, seed=7)
    with zipfile.ZipFile(SAMPLE) as z:
        def member(suffix):
            return z.read(next(n for n in z.namelist() if n.endswith(suffix))).decode()
        train = {tuple(ln.split("\t")) for ln in member("qrels/train.tsv").splitlines()[1:] if ln.strip()}
        test_ids = {ln.split("\t")[0] for ln in member("qrels/test.tsv").splitlines()[1:] if ln.strip()}
        corpus = member("corpus.jsonl")
    fit, dev = _beir_qrels(tmp_path / "cut", "train"), _beir_qrels(tmp_path / "cut", "dev")
    assert fit | dev == train and not fit & dev
    fit_q, dev_q = {r[0] for r in fit}, {r[0] for r in dev}
    assert not fit_q & dev_q, "a query is on both sides"
    assert counts == {"fit_queries": len(fit_q), "dev_queries": len(dev_q), "fit_qrels": len(fit),
                      "dev_qrels": len(dev)}
    assert len(dev_q) == round(0.2 * len(fit_q | dev_q))
    assert sorted(p.name for p in (tmp_path / "cut" / "qrels").iterdir()) == ["dev.tsv", "train.tsv"]
    query_ids = {json.loads(ln)["_id"] for ln in (tmp_path / "cut" / "queries.jsonl").read_text().splitlines()}
    assert query_ids == fit_q | dev_q and not query_ids & test_ids
    assert (tmp_path / "cut" / "corpus.jsonl").read_text() == corpus

    # seeded: the same cut again, another one with another seed
    train_dev_split(SAMPLE, tmp_path / "again", dev_share=0.2, seed=7)
    assert _beir_qrels(tmp_path / "again", "dev") == dev
    train_dev_split(SAMPLE, tmp_path / "other", dev_share=0.2, seed=8)
    assert _beir_qrels(tmp_path / "other", "dev") != dev

    # a recipe takes the folder as it is: dev is the evaluated split, train (the fit part) the labelled one
    c = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "rocketqa_demo.yaml"),
                    [f"dataset.source={tmp_path / 'cut'}", "dataset.split=dev"])
    assert c.dataset.splits() == ("dev", "train") and c.train_split == "train"
    with pytest.raises(UserError, match="split: 'test' is not a split"):
        load_config(str(Path(__file__).resolve().parents[1] / "configs" / "rocketqa_demo.yaml"),
                    [f"dataset.source={tmp_path / 'cut'}"])


def test_cli_dev_split(tmp_path):
    from irflow.dev.testing import run_cli

    code, out, err = run_cli("dev-split", SAMPLE, tmp_path / "cut", "--share", "0.25", "--seed", "3")
    assert code == 0, err
    assert "225 train (fit) queries" in out and "75 dev queries" in out and "dataset.split=dev" in out
    assert len({ln.split("\t")[0] for ln in (tmp_path / "cut" / "qrels" / "dev.tsv").read_text().splitlines()[1:]}) == 75
    for args, says in ((["--train-split", "dev"], "no qrels/dev.tsv to cut a dev part from (its splits: test, train)"),
                       (["--share", "1.5"], "the dev share must be in (0, 1)")):
        code, _, err = run_cli("dev-split", SAMPLE, tmp_path / "x", *args)
        assert code == 2 and says in err and "Traceback" not in err, err
    code, _, err = run_cli("dev-split", tmp_path / "nothing.zip", tmp_path / "x")
    assert code == 2 and "no such file or folder" in err
    assert not (tmp_path / "x").exists()
