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

from irflow.dev.testing import make_tiny_bi_encoder, make_tiny_cross_encoder, run_cli
from irflow.engine.catalog import Catalog

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "irflow" / "samples" / "scifact-sample.zip"
N_DOCS = 120
# what makes a tiny run: the config `irflow new` wrote, with the work cut to seconds
# (training reads 24 tokens, evaluation 32: the exported folder must encode as the evaluation did)
TINY = ["train.steps=2", "train.batch_size=4", "train.max_seq_length=24", "train.warmup_steps=1",
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
    # the estimate printed before the run is kept beside its stages: what later estimates calibrate by
    from irflow.tools import estimate

    kept = Catalog(own["store"] / "catalog.duckdb").estimated_stages(estimate.hardware_key(estimate.hardware()))
    assert {r["stage"] for r in kept} >= {s["name"] for s in result["stages"] if s["status"] == "computed"
                                          and s["name"].startswith("train_student")}
    assert all(r["runtime"]["load"][0] is not None for r in kept)
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

    # the exported folder is the model that was measured: SentenceTransformer loads it and encodes the evaluated
    # passages into the embeddings the run searched (the same sequence length, pooling and normalisation)
    from irflow.engine.labels import stage_name
    from irflow.learn.text import passage_texts

    catalog = Catalog(own["store"] / "catalog.duckdb")
    runs = catalog.stage_runs(r["run_id"], with_inputs=True)
    corpus_id = next(s["outputs"]["corpus"] for s in runs if s["name"] == "ingest_corpus")
    encoded = next(s for s in runs if stage_name(s["name"]) == "encode_corpus"
                   and s["inputs"]["model"] == [sel["model_id"]] and s["inputs"]["corpus"] == [corpus_id])
    stored = pq.read_table(catalog.dataset(encoded["outputs"]["embeddings"])["path"])
    passages = pq.read_table(catalog.dataset(corpus_id)["path"])
    exported_model = SentenceTransformer(str(first["exported"]), device="cpu")
    assert exported_model.max_seq_length == 32  # the evaluation's, not training's 24
    vectors = exported_model.encode(passage_texts(passages), batch_size=64)
    diff = np.abs(vectors - np.array(stored.column("embedding").to_pylist(), dtype=np.float32)).max()
    assert diff < 1e-5, diff
    assert json.loads((first["exported"] / "irflow_export.json").read_text())["inference"]["max_seq_length"] == 32
    card = (first["exported"] / "README.md").read_text()
    assert "**proxy**" in card and r["run_id"] in card and sel["reason"] in card and "irflow run" in card
    assert "truncated at 32 tokens" in card and "-> 32 (the run evaluated it at 32 tokens)" in card
    # --force replaces an earlier export, never a folder export did not write
    mine = own["root"] / "my-project"
    mine.mkdir(exist_ok=True)
    (mine / "notes.txt").write_text("mine")
    code, out, err = run_cli("export", r["run_id"], "--out", mine, "--store", own["store"], "--force")
    assert code == 2 and "not an earlier irflow export" in err and (mine / "notes.txt").read_text() == "mine"

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

    # 6 more documents: the summary counts the passages new since the last run, from the two corpora
    from irflow.sources.corpus_sources import document_id

    with zipfile.ZipFile(SAMPLE) as z:
        name = min((n for n in z.namelist() if n.endswith("corpus.jsonl")), key=len)
        more = z.read(name).decode().splitlines()[N_DOCS:N_DOCS + 6]
    grown = own["root"] / "grown.jsonl"
    grown.write_text(jsonl.read_text() + "\n".join(more) + "\n")
    code, out, err = run_cli("run", first["config"], "--store", own["store"], "--no-estimate", "--json",
                             *_sets(*TINY, f"dataset.source={grown}", "dataset.fields=null"))
    assert code == 0, err[-3000:]
    stages = json.loads(out.strip().splitlines()[-1])["stages"]
    corpus = pq.read_table(catalog.dataset(next(s["outputs"]["corpus"] for s in stages
                                                 if s["name"] == "ingest_corpus"))["path"])
    added = {json.loads(ln)["_id"] for ln in more}
    new = sum(1 for i in corpus.column("doc_id").to_pylist() if document_id(i) in added)
    assert f"{new} of {corpus.num_rows} passages new or changed since run " in out, out


def test_held_out_documents_never_reach_training(own):
    """The proxy's passages are set aside before anything trains: no training query is made from them and
    no training pair uses them; with passages cut, a document's passages stay on one side."""
    from irflow.sources.corpus_sources import document_id

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


def test_a_small_corpus_gets_a_config_that_runs_and_says_what_it_chose(own, tmp_path):
    """15 documents, one of them a long page: `irflow new` cuts the long one (judged per document, not by a
    percentile), says the corpus is too small to hold documents out, and writes a config that runs: the
    trained model handed out unmeasured, named so on the terminal, in the result and on the card."""
    folder = tmp_path / "small"
    folder.mkdir()
    for d in own["docs"][:14]:  # short notes, and one long page
        (folder / f"{d['_id']}.txt").write_text(" ".join(d["text"].split()[:60]))
    (folder / "manual.md").write_text("# Manual\n\n" + " ".join(d["text"] for d in own["docs"][14:20]))
    cfg = tmp_path / "small.yaml"
    code, out, err = run_cli("new", "gpl", "--corpus", folder, "--model", own["bi"], "--teacher", own["ce"],
                             "--budget-minutes", "1", "--out", cfg)
    assert code == 0, err
    assert "corpus: 15 documents -> " in out and "1 longer than the encoder reads (256 tokens" in out
    assert "evaluation: none (dataset.proxy: null)" in out and "warning: 15 documents are too few" in out
    written = yaml.safe_load(cfg.read_text())
    assert written["dataset"]["proxy"] is None and written["dataset"]["passages"]["max_words"] > 0
    assert Path(written["dataset"]["source"]).is_absolute()
    assert cfg.read_text().startswith(f"# irflow new gpl --corpus {folder}")
    code, out, err = run_cli("run", cfg, "--store", tmp_path / "store", "--json", "--no-estimate", *_sets(*TINY))
    assert code == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["metrics"] == [] and r["evaluation"].startswith("none")
    assert r["selected"]["system"] == "gpl-student" and "not measured" in r["selected"]["reason"]
    code, out, err = run_cli("export", r["run_id"], "--out", tmp_path / "m", "--store", tmp_path / "store")
    assert code == 0, err
    assert "**Not measured.**" in (tmp_path / "m" / "README.md").read_text()


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
    code, out, err = run_cli("export", "latest", "--out", out_dir, "--store", own["store"], "--format", "onnx")
    assert code == 0, err
    texts = ["a query", docs[0]["text"]]
    torch_vectors = SentenceTransformer(str(out_dir), device="cpu").encode(texts)
    assert torch_vectors.shape == (2, 32)
    # the ONNX export beside it encodes the same (irflow's ONNX Runtime path, no torch)
    from irflow.learn.encoding import encode_texts
    from irflow.learn.onnx_inference import load

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


def test_export_settings_make_a_model_without_normalize_encode_unit_vectors(tmp_path):
    """A model evaluated with similarity cos but saved without a Normalize module: the exported folder gets
    one (and the evaluated sequence length), so plain `encode` returns the vectors the run searched."""
    from sentence_transformers import SentenceTransformer

    from irflow.tools.export import apply_inference_settings

    folder = make_tiny_bi_encoder(tmp_path / "plain", normalize=False)
    texts = ["a query about cells", "a passage " * 40]
    raw = SentenceTransformer(str(folder), device="cpu")
    raw.max_seq_length = 16
    expected = raw.encode(texts, normalize_embeddings=True)
    changed = apply_inference_settings(folder, {"max_seq_length": 16, "similarity": "cos"})
    assert len(changed) == 2 and "-> 16 (the run evaluated it at 16 tokens)" in changed[0]
    exported = SentenceTransformer(str(folder), device="cpu")
    assert exported.max_seq_length == 16
    np.testing.assert_allclose(exported.encode(texts), expected, atol=1e-6)
    assert apply_inference_settings(folder, {"max_seq_length": 16, "similarity": "cos"}) == []  # idempotent


def test_a_held_out_part_of_the_query_log_is_judged_by_the_teacher_and_never_trained_on(own):
    """dataset.proxy.queries: log: a fifth of the log (by each query's own words) is held out; training reads
    the rest; the teacher (the cross-encoder) judges each held-out query's best candidate among the miners'
    rankings of the whole corpus, and the models are evaluated, and selected with each query its own unit,
    on those judgements."""
    from irflow.learn.scoring import cross_encoder_scores
    from irflow.learn.text import doc_texts

    log = own["root"] / "log.txt"
    log.write_text("\n".join(q["text"] for q in own["queries"]) + "\n")
    cfg = own["root"] / "log-proxy.yaml"
    code, out, err = run_cli("new", "gpl", "--corpus", own["root"] / "docs.jsonl", "--model", own["bi"],
                             "--teacher", own["ce"], "--query-log", log, "--out", cfg, "--force")
    assert code == 0, err
    code, out, err = run_cli("run", cfg, "--store", own["store"], "--json",
                             *_sets(*TINY, "dataset.proxy.queries={source: log, fraction: 0.2}"))
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    stages = {s["name"]: s["outputs"] for s in result["stages"]}
    catalog = Catalog(own["store"] / "catalog.duckdb")

    def table(dataset_id):
        return pq.read_table(catalog.dataset(dataset_id)["path"])

    held = table(stages["hold_out_queries"]["heldout"])
    trained = set(table(stages["generate_queries[unlabelled]"]["queries"]).column("text").to_pylist())
    held_texts = set(held.column("text").to_pylist())
    assert held_texts and trained and not held_texts & trained
    assert len(held_texts | trained) == len({q["text"] for q in own["queries"]})
    # the judgements: the cross-encoder's best of the union of the miners' candidates, one per held-out query
    qrels = table(stages["judge_queries"]["qrels"])
    judged = dict(zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist()))
    assert set(judged) == set(held.column("query_id").to_pylist())
    cands: dict[str, set] = {}
    for name in (n for n in stages if n.startswith(("bm25_search[judge-", "dense_search[judge-"))):
        t = table(stages[name]["run"])
        for q, d in zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist()):
            cands.setdefault(q, set()).add(d)
    assert len([n for n in stages if "[judge-" in n and "_search" in n]) == 2  # both miners, on held-out queries
    texts = dict(zip(held.column("query_id").to_pylist(), held.column("text").to_pylist()))
    dtext = doc_texts(table(stages["ingest_corpus"]["corpus"]))
    for q in sorted(judged)[:5]:
        docs = sorted(cands[q])
        scores = cross_encoder_scores(str(own["ce"]), [(texts[q], dtext[d]) for d in docs], batch_size=32,
                                      max_length=350)
        assert judged[q] == docs[int(np.argmax(scores))]
    assert "held-out query log" in result["evaluation"]
    assert "queries" in result["selected"]["reason"] and "documents" not in result["selected"]["reason"]
