"""Your own documents, end to end, as a user runs them: a corpus with no queries and no labels, in the
formats users have (JSONL, Parquet, CSV, a folder of text files), through `irflow new` -> `irflow run` ->
`irflow export`, the exported folder loaded by sentence-transformers. Real text (the bundled SciFact
sample's documents), tiny local models in place of MiniLM so that each run takes seconds."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml

from irflow.catalog import Catalog
from irflow.testing import make_tiny_bi_encoder, make_tiny_cross_encoder, run_cli

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "irflow" / "samples" / "scifact-sample.zip"
N_DOCS = 120
# what makes a tiny run: the config `irflow new` wrote, with the work cut to seconds
TINY = ["train.steps=2", "train.batch_size=4", "train.max_seq_length=32", "train.warmup_steps=1",
        "dense.max_seq_length=32", "dense.batch_size=32", "label.negatives_per_positive=1", "mine.depth=10",
        "runtime.threads=1"]


def _sets(*kv: str) -> list[str]:
    return [a for s in kv for a in ("--set", s)]


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    with zipfile.ZipFile(SAMPLE) as z:
        name = min((n for n in z.namelist() if n.endswith("corpus.jsonl")), key=len)
        lines = z.read(name).decode().splitlines()[:N_DOCS]
        qname = min((n for n in z.namelist() if n.endswith("queries.jsonl")), key=len)
        queries = [json.loads(ln) for ln in z.read(qname).decode().splitlines()]
    docs = [json.loads(ln) for ln in lines]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return {"root": root, "docs": docs, "queries": queries, "store": root / "store",
            "bi": make_tiny_bi_encoder(root / "bi", normalize=True), "ce": make_tiny_cross_encoder(root / "ce")}


def _new_run_export(own, corpus: Path, recipe: str = "gpl", new_args: list[str] = ()) -> dict:
    cfg = own["root"] / f"{corpus.stem}-{recipe}.yaml"
    args = ["new", recipe, "--corpus", corpus, "--model", own["bi"], "--out", cfg, "--force", *new_args]
    if recipe == "gpl":
        args += ["--teacher", own["ce"], "--budget-minutes", "1"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "estimate for" in out and "total" in out
    sets = _sets(*(TINY if recipe == "gpl" else ["dense.max_seq_length=32", "runtime.threads=1"]))
    code, out, err = run_cli("run", cfg, "--store", own["store"], "--json", *sets)
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    exported = own["root"] / f"exported-{corpus.stem}-{recipe}"
    code, out, err = run_cli("export", result["run_id"], "--out", exported, "--store", own["store"], "--force")
    assert code == 0, err
    return {"config": cfg, "result": result, "exported": exported}


def test_jsonl_parquet_csv_corpora_run_without_labels_and_export_a_loadable_model(own):
    from sentence_transformers import SentenceTransformer

    jsonl = own["root"] / "docs.jsonl"
    first = _new_run_export(own, jsonl)
    r = first["result"]
    # no labels: the evaluation is a synthetic held-out set, called a proxy everywhere
    assert r["evaluation"].startswith("proxy (ict queries of ")
    assert {m["dataset"] for m in r["metrics"]} == {"docs (proxy)"}
    sel = r["selected"]
    assert sel["system"] in sel["models"] and sel["evaluation"] == r["evaluation"] and sel["reason"]
    assert set(sel["models"]) == {"dense-bi", "gpl-student"}  # irflow new leaves the QGen baseline off

    # the exported folder is the selected model: SentenceTransformer loads it and encodes as the stored one does
    catalog = Catalog(own["store"] / "catalog.duckdb")
    stored = catalog.dataset(sel["model_id"])["path"]
    texts = [d["text"] for d in own["docs"][:8]]
    exported = SentenceTransformer(str(first["exported"]), device="cpu").encode(texts)
    np.testing.assert_allclose(exported, SentenceTransformer(stored, device="cpu").encode(texts), atol=1e-6)
    card = (first["exported"] / "README.md").read_text()
    assert "**proxy**" in card and r["run_id"] in card and sel["reason"] in card and "irflow run" in card

    # the same documents as Parquet and as CSV with other column names: the same corpus, so the run
    # reads the file and reuses everything after it
    table = pa.table({"doc_id": [d["_id"] for d in own["docs"]], "headline": [d.get("title", "") for d in own["docs"]],
                      "body": [d["text"] for d in own["docs"]]})
    pq.write_table(table.rename_columns(["_id", "title", "text"]), own["root"] / "docs.parquet")
    pacsv.write_csv(table, own["root"] / "docs.csv")
    for corpus, fields in ((own["root"] / "docs.parquet", []),
                           (own["root"] / "docs.csv", ["--field", "id=doc_id", "--field", "title=headline",
                                                       "--field", "text=body"])):
        again = _new_run_export(own, corpus, new_args=fields)["result"]
        computed = {s["name"] for s in again["stages"] if s["status"] == "computed"}
        assert computed == {"ingest_corpus"}, computed
        assert again["selected"]["model_id"] == sel["model_id"]


def test_held_out_documents_never_reach_training(own):
    """The proxy's passages are set aside before anything trains: no training query is made from them and
    no training pair uses them; with passages cut, a document's passages stay on one side."""
    from irflow.corpus_sources import document_id

    cfg = own["root"] / "cut.yaml"
    code, out, err = run_cli("new", "gpl", "--corpus", own["root"] / "docs.jsonl", "--model", own["bi"],
                             "--teacher", own["ce"], "--out", cfg, "--force")
    assert code == 0, err
    code, out, err = run_cli("run", cfg, "--store", own["store"], "--json", "--to", "mine_negatives", "--to", "generate_queries[proxy]",
                             *_sets(*TINY, "dataset.passages={max_words: 60, stride: 40}", "generate.source=crop"))
    assert code == 0, err[-3000:]
    stages = {s["name"]: s["outputs"] for s in json.loads(out.strip().splitlines()[-1])["stages"]}
    catalog = Catalog(own["store"] / "catalog.duckdb")

    def table(dataset_id):
        return pq.read_table(catalog.dataset(dataset_id)["path"])

    corpus = table(stages["ingest_corpus"]["corpus"])
    assert any("#" in i for i in corpus.column("doc_id").to_pylist())  # long documents were cut
    held = set(table(stages["holdout"]["heldout"]).column("doc_id").to_pylist())
    train = set(table(stages["holdout"]["train_corpus"]).column("doc_id").to_pylist())
    assert held and not held & train and held | train == set(corpus.column("doc_id").to_pylist())
    assert not {document_id(i) for i in held} & {document_id(i) for i in train}
    generated = table(stages["generate_queries[crop]"]["qrels"]).column("doc_id").to_pylist()
    negatives = table(stages["mine_negatives"]["negatives"]).column("doc_id").to_pylist()
    assert generated and set(generated) <= train and set(negatives) <= train
    proxy = table(stages["generate_queries[proxy]"]["qrels"]).column("doc_id").to_pylist()
    assert set(proxy) <= held


def test_a_folder_of_text_files_with_a_labelled_set(own):
    """A folder of .txt / .md / .html documents (ids are their paths) with a small labelled set beside it:
    the evaluation is labelled, the baseline model is exported."""
    from sentence_transformers import SentenceTransformer

    folder = own["root"] / "notes"
    folder.mkdir()
    docs = own["docs"][:60]
    for i, d in enumerate(docs):
        if i % 3 == 0:
            (folder / f"{d['_id']}.md").write_text(f"# {d.get('title', '')}\n\n{d['text']}\n")
        elif i % 3 == 1:
            (folder / f"{d['_id']}.html").write_text(f"<html><head><title>{d.get('title', '')}</title>"
                                                     f"<style>p {{}}</style></head><body><p>{d['text']}</p></body></html>")
        else:
            (folder / f"{d['_id']}.txt").write_text(d["text"])
    ids = sorted(p.name for p in folder.iterdir())
    (own["root"] / "q.tsv").write_text("query_id\ttext\n" + "".join(f"q{i}\t{docs[i]['title']}\n" for i in range(5)))
    qrels = "".join(f"q{i}\t{next(n for n in ids if n.startswith(docs[i]['_id'] + '.'))}\t1\n" for i in range(5))
    (own["root"] / "qrels.tsv").write_text(qrels)
    code, out, err = run_cli("new", "baselines", "--corpus", folder, "--model", own["bi"], "--queries",
                             own["root"] / "q.tsv", "--qrels", own["root"] / "qrels.tsv",
                             "--out", own["root"] / "notes.yaml", "--force")
    assert code == 0, err
    code, out, err = run_cli("run", own["root"] / "notes.yaml", "--store", own["store"], "--json",
                             *_sets("dense.max_seq_length=32", "runtime.threads=1"))
    assert code == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["evaluation"] == "labelled" and {m["split"] for m in r["metrics"]} == {"test"}
    assert all(m["num_queries"] == 5 for m in r["metrics"])
    assert r["selected"]["system"] == "dense-bi"
    out_dir = own["root"] / "exported-notes"
    assert run_cli("export", "latest", "--out", out_dir, "--store", own["store"], "--format", "onnx")[0] == 0
    texts = ["a query", docs[0]["text"]]
    torch_vectors = SentenceTransformer(str(out_dir), device="cpu").encode(texts)
    assert torch_vectors.shape == (2, 32)
    # the ONNX export beside it encodes the same (irflow's ONNX Runtime path, no torch)
    from irflow.encoding import encode_texts
    from irflow.onnx_inference import load

    onnx_vectors = encode_texts(load(str(out_dir / "onnx"), threads=1), texts, batch_size=8, normalize=False)
    np.testing.assert_allclose(onnx_vectors, torch_vectors, atol=1e-5)
    assert "## ONNX" in (out_dir / "README.md").read_text()
    code, out, err = run_cli("models", "--store", own["store"], "--json")
    rows = json.loads(out)
    assert {r["run_id"] for r in rows if r["selected"]} >= {r_["run_id"] for r_ in [r]}


@pytest.mark.parametrize("case", ["malformed", "queries-without-qrels", "beir-with-passages", "unknown-format"])
def test_bad_input_is_one_line_and_exit_2(own, tmp_path, case):
    cfg = {"flow": "baselines", "dataset": {"source": str(own["root"] / "docs.jsonl")},
           "dense": {"model": str(own["bi"])}}
    expect = ""
    if case == "malformed":
        bad = tmp_path / "bad.jsonl"
        bad.write_text((own["root"] / "docs.jsonl").read_text().replace("\n", "\n{oops\n", 1))
        cfg["dataset"]["source"], expect = str(bad), f"{bad}:2: malformed JSON"
    elif case == "queries-without-qrels":
        cfg["dataset"]["queries"], expect = str(own["root"] / "docs.jsonl"), "qrels: a labelled set needs both"
    elif case == "beir-with-passages":
        cfg["dataset"] = {"source": str(SAMPLE), "passages": {"max_words": 100}}
        expect = "dataset.passages: for your own documents"
    else:
        (tmp_path / "docs.xml").write_text("<docs/>")
        cfg["dataset"]["source"], expect = str(tmp_path / "docs.xml"), "docs.xml"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    store = tmp_path / "store"
    code, out, err = run_cli("run", path, "--store", store, "--no-estimate")
    lines = [ln for ln in err.splitlines() if ln.startswith("irflow: error:")]
    assert code == 2 and len(lines) == 1 and expect in lines[0] + err, err[-2000:]
    if store.exists():  # nothing of the corpus was stored
        assert not list((store / "objects").glob("corpus-*"))
