"""Dense encoding/search, BM25 index/search and BEIR evaluation, on real SciFact text; the runtime's
device, precision and JVM heap reaching them."""

import json
import math
import types
import zipfile

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from irflow.dev.testing import make_tiny_bi_encoder, model
from irflow.engine.errors import StageFailed
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig, StageRuntime
from irflow.learn.encoding import encode_texts
from irflow.learn.text import passage_texts
from irflow.stages.dense import (
    DenseSearchParams,
    EncodeParams,
    build_index,
    dense_search,
    embeddings_to_numpy,
    encode_corpus,
    search_index,
)
from irflow.stages.evaluate import EvaluateParams, evaluate, evaluate_run, mrr_at_k


@pytest.fixture(scope="module")
def scifact_docs(shared_datasets):
    rows = []
    with zipfile.ZipFile(shared_datasets / "scifact.zip") as z, z.open("scifact/corpus.jsonl") as f:
        for line in f:
            d = json.loads(line)
            rows.append((d["_id"], d["title"], d["text"]))
            if len(rows) == 120:
                break
    return pa.table({"doc_id": [r[0] for r in rows], "title": [r[1] for r in rows], "text": [r[2] for r in rows]})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    path = make_tiny_bi_encoder(tmp_path_factory.mktemp("m") / "tiny", normalize=True)
    return path, SentenceTransformer(str(path), device="cpu")


@pytest.fixture(scope="module")
def dense_env(tmp_path_factory, scifact_docs, tiny):
    """A store with the corpus, its embeddings (computed once) and title queries whose ids are doc ids."""
    path, _ = tiny
    run = Run(str(tmp_path_factory.mktemp("dense") / "store"), "r")
    corpus, _ = run.store.publish_table("corpus", "corpus", scifact_docs)
    some = scifact_docs.slice(0, 6)
    queries, _ = run.store.publish_table("queries", "queries", pa.table({
        "query_id": some.column("doc_id"), "text": some.column("title")}))
    model_ref = model(run, path)
    emb = encode_corpus.run(run, EncodeParams(similarity="cos", batch_size=32), corpus=corpus, model=model_ref)
    return {"run": run, "corpus": corpus, "queries": queries, "model": model_ref, "embeddings": emb}


def test_length_sorted_encoding_keeps_input_order(scifact_docs, tiny):
    _, model_ = tiny
    texts = passage_texts(scifact_docs)
    ours = encode_texts(model_, texts, batch_size=16, normalize=True)
    ref = model_.encode(texts, batch_size=16, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-4


def test_encode_stage_roundtrip_and_hnsw_matches_flat(dense_env, scifact_docs):
    run = dense_env["run"]
    emb_ref = dense_env["embeddings"]
    emb = embeddings_to_numpy(emb_ref.table())
    assert emb_ref.table().column("doc_id").to_pylist() == scifact_docs.column("doc_id").to_pylist()  # corpus order
    assert emb.shape == (scifact_docs.num_rows, 32)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)
    # cached on (params, corpus, model): a dict is validated into the same params
    again = encode_corpus.run(Run(run.store_root, "r2"), {"similarity": "cos", "batch_size": 32},
                              corpus=dense_env["corpus"], model=dense_env["model"])
    assert again.id == emb_ref.id
    queries = emb[:10] + 0.01
    flat_scores, flat_idx = search_index(build_index(emb, "flat"), queries, 10)
    hnsw_scores, hnsw_idx = search_index(build_index(emb, "hnsw", hnsw_m=16), queries, 10, ef_search=200)
    # HNSW is approximate, but on 120 vectors with a wide search it finds the exact top 1.
    assert (flat_idx[:, 0] == hnsw_idx[:, 0]).all()
    assert np.allclose(flat_scores[:, 0], hnsw_scores[:, 0], atol=1e-5)
    brute = (queries @ emb.T).argsort(axis=1)[:, ::-1][:, :10]
    assert (brute[:, 0] == flat_idx[:, 0]).all()


def test_dense_search_is_exact_top_k_and_removes_query_ids(dense_env, tiny):
    _, model_ = tiny
    run = dense_env["run"]
    emb_t = dense_env["embeddings"].table()
    emb, doc_ids = embeddings_to_numpy(emb_t), emb_t.column("doc_id").to_pylist()
    q = dense_env["queries"].table()
    q_emb = encode_texts(model_, q.column("text").to_pylist(), batch_size=8, normalize=True)
    inputs = dict(embeddings=dense_env["embeddings"], queries=dense_env["queries"], model=dense_env["model"])
    kept = dense_search.run(run, DenseSearchParams(system="d", depth=5, remove_query=False), tag="keep",
                            **inputs).table()
    dropped = dense_search.run(run, DenseSearchParams(system="d", depth=5), tag="drop", **inputs).table()
    for i, qid in enumerate(q.column("query_id").to_pylist()):
        exact = [doc_ids[j] for j in np.argsort(-(emb @ q_emb[i]), kind="stable")[:5]]
        got = kept.filter(pa.compute.equal(kept.column("query_id"), qid))
        assert got.column("doc_id").to_pylist() == exact
        assert got.column("rank").to_pylist() == [1, 2, 3, 4, 5]
        np.testing.assert_allclose(got.column("score").to_numpy(), np.sort(emb @ q_emb[i])[::-1][:5], atol=1e-4)
        removed = dropped.filter(pa.compute.equal(dropped.column("query_id"), qid))
        assert removed.column("doc_id").to_pylist() == [d for d in exact if d != qid]
        assert removed.column("rank").to_pylist() == list(range(1, removed.num_rows + 1))
    # a title finds its own passage among the top 5 for at least one query: the case remove_query is for
    assert dropped.num_rows < kept.num_rows
    assert set(kept.column("system").to_pylist()) == {"d"}


def test_encoding_precision_comes_from_the_runtime(dense_env, scifact_docs):
    """bf16 encoding (runtime.precision.encode) runs under autocast: close to fp32, not identical."""
    p = EncodeParams(similarity="cos", batch_size=32)
    corpus = dense_env["run"].store.publish_table("corpus-head", "corpus", scifact_docs.slice(0, 40))[0]
    fp32 = embeddings_to_numpy(encode_corpus.fn(p, StageRuntime(), corpus=corpus, model=dense_env["model"]))
    bf16 = embeddings_to_numpy(encode_corpus.fn(p, StageRuntime(precision="bf16"), corpus=corpus,
                                                model=dense_env["model"]))
    assert fp32.dtype == bf16.dtype == np.float32
    assert not np.array_equal(fp32, bf16)
    assert (np.sum(fp32 * bf16, axis=1) > 0.99).all()
    # other batches (40 passages, not 120) pad differently: equal up to float noise
    np.testing.assert_allclose(fp32, embeddings_to_numpy(dense_env["embeddings"].table())[:40], atol=1e-5)


def test_runtime_device_reaches_every_dense_model_load(dense_env):
    """A "meta" device cannot compute anything: both dense stages fail once their model is on it, which
    proves runtime.device is what their model loads use (the same calls on the CPU are the tests above)."""
    meta = StageRuntime(device="meta")
    with pytest.raises(Exception, match="meta"):
        encode_corpus.fn(EncodeParams(), meta, corpus=dense_env["corpus"], model=dense_env["model"])
    with pytest.raises(Exception, match="meta"):
        dense_search.fn(DenseSearchParams(system="d", depth=5), meta, embeddings=dense_env["embeddings"],
                        queries=dense_env["queries"], model=dense_env["model"])
    # through the runner: both are "encode" work, and the config's encode device reaches them
    run = Run(dense_env["run"].store_root, "run-meta", runtime=RuntimeConfig(device={"default": "cpu",
                                                                                      "encode": "meta"}))
    with pytest.raises(StageFailed, match="meta") as e:
        encode_corpus.run(run, EncodeParams(batch_size=7), tag="meta", corpus=dense_env["corpus"],
                          model=dense_env["model"])
    assert e.value.stage == "encode_corpus[meta]"
    with pytest.raises(StageFailed, match="meta") as e:
        dense_search.run(run, DenseSearchParams(system="meta", depth=5), embeddings=dense_env["embeddings"],
                         queries=dense_env["queries"], model=dense_env["model"])
    assert e.value.stage == "dense_search"


def test_retrieval_params_are_validated():
    with pytest.raises(ValidationError, match="similarity"):
        EncodeParams(similarity="cos_sim")
    with pytest.raises(ValidationError, match="index"):
        DenseSearchParams(system="d", index="ivf")
    with pytest.raises(ValidationError, match="system"):
        DenseSearchParams()  # the system name written into the run is required
    with pytest.raises(ValidationError, match="depth"):
        DenseSearchParams(system="d", depth=0)
    with pytest.raises(ValidationError, match="top_k"):
        DenseSearchParams(system="d", top_k=10)  # the old key: an error, never a silent default
    from irflow.stages.bm25 import BM25IndexParams, BM25SearchParams

    with pytest.raises(ValidationError, match="variant"):
        BM25IndexParams(variant="bogus")
    with pytest.raises(ValidationError, match=r"\nb\n"):
        BM25SearchParams(system="b", variant="flat", b=1.5)
    with pytest.raises(ValidationError, match="metrics"):
        EvaluateParams(dataset="x", split="test", metrics=("ndcg@0",))
    with pytest.raises(ValidationError, match="metrics"):
        EvaluateParams(dataset="x", split="test", metrics=("bleu@10",))
    with pytest.raises(ValidationError, match="jvm_heap"):
        RuntimeConfig(jvm_heap="lots")


def test_metrics_follow_beir_definitions():
    qrels = {"q1": {"d1": 1, "d3": 2}, "q2": {"d9": 1}}
    results = {"q1": {"d2": 3.0, "d1": 2.0, "d3": 1.0}, "q2": {"d5": 2.0, "d6": 1.0}}
    per_query = evaluate_run(qrels, results, ["ndcg@10", "mrr@10", "recall@100", "map@100"])
    # nDCG@10 for q1 by hand, trec_eval's (so BEIR's) linear gain: DCG = 1/log2(3) + 2/log2(4);
    # IDCG = 2/log2(2) + 1/log2(3).
    dcg = 1 / math.log2(3) + 2 / math.log2(4)
    idcg = 2 / math.log2(2) + 1 / math.log2(3)
    assert per_query["ndcg@10"]["q1"] == pytest.approx(dcg / idcg, abs=1e-4)
    assert per_query["ndcg@10"]["q2"] == 0.0
    assert per_query["mrr@10"] == {"q1": 0.5, "q2": 0.0}
    assert per_query["recall@100"]["q1"] == 1.0
    assert per_query["map@100"]["q1"] == pytest.approx((1 / 2 + 2 / 3) / 2, abs=1e-4)
    assert mrr_at_k(qrels, results, 1) == {"q1": 0.0, "q2": 0.0}


def test_evaluate_stage_averages_over_the_asked_queries(tmp_path):
    run = Run(str(tmp_path / "store"), "r")
    pub = lambda name, contract, t: run.store.publish_table(name, contract, t)[0]  # noqa: E731
    qrels = pub("qrels", "qrels", pa.table({"query_id": ["q1", "q2", "q3", "q1"], "doc_id": ["d1", "d2", "d3", "d9"],
                                            "score": pa.array([1, 1, 1, 1], pa.int32()),
                                            "split": ["test", "test", "test", "train"]}))
    # q1 answered (d1 first, after its own id, which is ignored); q2 asked, unanswered; q3 not asked
    ranked = pub("run", "run", pa.table({"query_id": ["q1", "q1"], "doc_id": ["q1", "d1"],
                                         "rank": pa.array([1, 2], pa.int32()),
                                         "score": pa.array([2.0, 1.0], pa.float32()), "system": ["s", "s"]}))
    queries = pub("queries", "queries", pa.table({"query_id": ["q1", "q2"], "text": ["a", "b"]}))
    p = EvaluateParams(dataset="toy", split="test", metrics=("mrr@1", "ndcg@10"))
    out = evaluate.run(run, p, ranking=ranked, qrels=qrels, queries=queries)
    metrics = {r["metric"]: r for r in out["metrics"].table().to_pylist()}
    assert metrics["mrr@1"]["value"] == 0.5 and metrics["mrr@1"]["num_queries"] == 2
    assert metrics["ndcg@10"]["value"] == 0.5 and metrics["mrr@1"]["dataset"] == "toy"
    assert metrics["mrr@1"]["no_judged_doc"] is None  # unknown without the corpus input
    per_query = out["per_query"].table()
    assert sorted(set(per_query.column("query_id").to_pylist())) == ["q1", "q2"]
    # without the queries input: every judged query of the split counts
    everyone = evaluate.fn(p, StageRuntime(), ranking=ranked, qrels=qrels).get("metrics").to_pylist()
    assert {r["metric"]: r["num_queries"] for r in everyone} == {"mrr@1": 3, "ndcg@10": 3}
    # the own-id hit counts only when asked not to ignore identical ids
    strict = evaluate.fn(p.model_copy(update={"ignore_identical_ids": False}), StageRuntime(), ranking=ranked,
                         qrels=qrels, queries=queries)["metrics"].to_pylist()
    assert {r["metric"]: r["value"] for r in strict}["mrr@1"] == 0.0


def test_bm25_search_removes_query_id_hits_and_the_jvm_heap_is_the_runtimes(tmp_path, scifact_docs, monkeypatch):
    import subprocess

    from irflow.stages import bm25
    from irflow.stages.bm25 import BM25IndexParams, BM25SearchParams, bm25_index, bm25_search, index_command

    cmd = index_command(tmp_path / "c", tmp_path / "i", "multifield", 3, "3g")
    assert "-Xmx3g" in cmd and cmd.index("-Xmx3g") < cmd.index("-cp")  # a JVM option, before the class
    assert cmd[cmd.index("-threads") + 1] == "3" and cmd[-2:] == ["-fields", "title"]

    commands = []

    def spy_run(command, *args, **kwargs):
        commands.append(list(command))
        return subprocess.run(command, *args, **kwargs)

    monkeypatch.setattr(bm25, "subprocess", types.SimpleNamespace(run=spy_run))
    run = Run(str(tmp_path / "store"), "r", runtime=RuntimeConfig(jvm_heap="640m", threads=1))
    corpus, _ = run.store.publish_table("corpus", "corpus", scifact_docs)
    # A query whose id equals a document id and whose text is that document's title (like ArguAna).
    doc = scifact_docs.slice(3, 1).to_pylist()[0]
    queries, _ = run.store.publish_table("queries", "queries", pa.table({"query_id": [doc["doc_id"]],
                                                                         "text": [doc["title"]]}))
    index = bm25_index.run(run, BM25IndexParams(variant="flat"), corpus=corpus)
    [command] = commands
    assert "-Xmx640m" in command and not any(c.startswith("-Xmx") and c != "-Xmx640m" for c in command)
    assert command[command.index("-threads") + 1] == "1"
    import jnius_config

    jvm_was_running = jnius_config.vm_running
    heaps = []
    search = bm25.search

    def spy_search(*args, **kwargs):
        heaps.append(kwargs["heap"])
        return search(*args, **kwargs)

    monkeypatch.setattr(bm25, "search", spy_search)
    kept = bm25_search.run(run, BM25SearchParams(system="b", variant="flat", depth=10, remove_query=False),
                           tag="keep", bm25_index=index, queries=queries).table()
    removed = bm25_search.run(run, BM25SearchParams(system="b", variant="flat", depth=10, remove_query=True),
                              tag="drop", bm25_index=index, queries=queries).table()
    assert kept.column("doc_id")[0].as_py() == doc["doc_id"]  # its own title finds it first
    assert doc["doc_id"] not in removed.column("doc_id").to_pylist()
    assert removed.column("rank").to_pylist() == list(range(1, removed.num_rows + 1))
    assert heaps == ["640m", "640m"]  # the search JVM gets the runtime's heap too
    assert jnius_config.vm_running == jvm_was_running  # it ran in a child process, not in this one
    assert kept.num_rows == 10 and removed.column("doc_id").to_pylist() == kept.column("doc_id").to_pylist()[1:]


def test_unanswered_judged_queries_score_zero():
    """trec_eval -c semantics (Pyserini's regressions): a judged query the system was asked but
    returned nothing for counts as 0; a judged query it was not asked does not count."""
    qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}, "q3": {"d3": 1}}
    results = {"q1": {"d1": 1.0}}
    per_query = evaluate_run(qrels, results, ["ndcg@10", "mrr@10"], asked={"q1", "q2"})
    assert per_query["ndcg@10"] == {"q1": 1.0, "q2": 0.0}
    assert per_query["mrr@10"] == {"q1": 1.0, "q2": 0.0}
    assert set(evaluate_run(qrels, results, ["ndcg@10"])["ndcg@10"]) == {"q1", "q2", "q3"}


# ---- judged documents missing from the corpus ---------------------------------------------------
def test_judged_documents_missing_from_the_corpus_count_as_in_pytrec_eval():
    """A judgement of a document the corpus lacks still counts in the ideal DCG and in recall's
    denominator; a query with no judged document in the corpus scores 0 (BEIR, Pyserini)."""
    kept = {"q1": {"d1": 1, "gone": 2}, "q2": {"gone-too": 1}}
    results = {"q1": {"d1": 2.0, "d2": 1.0}, "q2": {"d1": 1.0}}
    per_query = evaluate_run(kept, results, ["ndcg@10", "recall@100", "mrr@10"])
    # q1: DCG = 1/log2(2); IDCG = 2/log2(2) + 1/log2(3) (the missing doc, grade 2, first)
    assert per_query["ndcg@10"]["q1"] == pytest.approx(1 / (2 + 1 / math.log2(3)), abs=1e-4)  # 0.3801
    assert per_query["recall@100"]["q1"] == 0.5 and per_query["mrr@10"]["q1"] == 1.0
    assert per_query["ndcg@10"]["q2"] == per_query["recall@100"]["q2"] == per_query["mrr@10"]["q2"] == 0.0
    # what dangling_qrels: drop evaluates instead: q1 perfect, q2 gone -- the mean reads 1.0, not 0.19
    dropped = evaluate_run({"q1": {"d1": 1}}, results, ["ndcg@10"])
    assert dropped["ndcg@10"] == {"q1": 1.0}


@pytest.fixture(scope="module")
def slice_with_missing_docs(tmp_path_factory, shared_datasets):
    """A real SciFact slice (10 test queries) from whose corpus every judged document of two test
    queries is removed, and one more query judges a document that is not there besides its own."""
    from irflow.dev.testing import beir_slice

    sl = beir_slice(shared_datasets / "scifact.zip", tmp_path_factory.mktemp("missing") / "scifact",
                    n_test_queries=10, n_extra_docs=20, seed=3)
    rows = [ln.split("\t")[:2] for ln in (sl / "qrels" / "test.tsv").read_text().splitlines()[1:] if ln.strip()]
    docs_of: dict[str, set[str]] = {}
    for q, d in rows:
        docs_of.setdefault(q, set()).add(d)
    judges = lambda d: {q for q, ds in docs_of.items() if d in ds}  # noqa: E731
    lonely = sorted(q for q, ds in docs_of.items() if all(judges(d) == {q} for d in ds))
    emptied, partial = lonely[:2], lonely[2]
    gone = set().union(*(docs_of[q] for q in emptied))
    lines = [ln for ln in (sl / "corpus.jsonl").read_text().splitlines() if ln.strip()]
    (sl / "corpus.jsonl").write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["_id"] not in gone))
    with open(sl / "qrels" / "test.tsv", "a") as f:
        f.write(f"{partial}\tnot-in-the-corpus\t1\n")
    return {"path": sl, "docs_of": docs_of, "emptied": set(emptied), "partial": partial}


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_queries_without_a_judged_document_in_the_corpus(slice_with_missing_docs, tmp_path, monkeypatch, policy):
    """Through the stages on real data: keep (the default) evaluates the two queries whose judged
    documents are all missing (0 each) and the metrics and the printed report count them; drop leaves
    them out. A "perfect" run ranks each query's judged documents that exist first."""
    from irflow.recipes.dataset import Dataset
    from irflow.stages.evaluate import EvaluationParams
    from irflow.stages.ingest import IngestParams, SelectQueriesParams, ingest_beir, select_queries, source_ref
    from irflow.stages.report import format_table, record_metrics

    s = slice_with_missing_docs
    run = Run(str(tmp_path / "store"), "run-1")
    source = run.external(source_ref(str(s["path"]), None, run.store.root / "downloads"), {"source": "x"})
    params = IngestParams() if policy == "keep" else IngestParams(dangling_qrels=policy)
    assert IngestParams().dangling_qrels == "keep"
    beir = ingest_beir.run(run, params, source=source)
    test = select_queries.run(run, SelectQueriesParams(split="test"), queries=beir["queries"], qrels=beir["qrels"])
    corpus_ids = set(beir["corpus"].table().column("doc_id").to_pylist())
    asked = test.table().column("query_id").to_pylist()
    rows = {"query_id": [], "doc_id": [], "rank": [], "score": [], "system": []}
    filler = sorted(corpus_ids - set().union(*s["docs_of"].values()))
    for q in asked:
        ranked = sorted(d for d in s["docs_of"][q] if d in corpus_ids) + filler[:3]
        for i, d in enumerate(ranked, start=1):
            for col, v in zip(rows, (q, d, i, float(10 - i), "perfect")):
                rows[col].append(v)
    ranked = run.store.publish_table("run", "run", pa.table({**rows, "rank": pa.array(rows["rank"], pa.int32()),
                                                             "score": pa.array(rows["score"], pa.float32())}))[0]
    data = Dataset("scifact-slice", "test", beir["corpus"], beir["queries"], beir["qrels"], test)
    [ev] = _evaluate_runs_plain(monkeypatch, run, EvaluationParams(metrics=("ndcg@10",)), data, {"perfect": ranked})
    per_query = dict(zip(ev["per_query"].table().column("query_id").to_pylist(),
                         ev["per_query"].table().column("value").to_pylist()))
    [m] = ev["metrics"].table().to_pylist()
    n_docs = len(s["docs_of"][s["partial"]])  # its own (all in the corpus, ranked first), then the missing one
    partial = sum(1 / math.log2(i + 1) for i in range(1, n_docs + 1)) / \
        sum(1 / math.log2(i + 1) for i in range(1, n_docs + 2))
    if policy == "keep":
        assert set(asked) >= s["emptied"] and len(asked) == 10
        assert {q: per_query[q] for q in s["emptied"]} == {q: 0.0 for q in s["emptied"]}
        assert per_query[s["partial"]] == pytest.approx(partial, abs=1e-4)
        assert m["num_queries"] == 10 and m["no_judged_doc"] == 2
        assert m["value"] == pytest.approx((7 + partial) / 10, abs=1e-4)
    else:
        assert not set(asked) & s["emptied"] and len(asked) == 8
        assert per_query[s["partial"]] == 1.0
        assert m["num_queries"] == 8 and m["no_judged_doc"] == 0 and m["value"] == 1.0
    # the run's report (report() without the Prefect artifact): the counts reach RunResult's metric
    # rows and the table `irflow run` prints
    [row] = record_metrics(run, [ev])
    assert row["system"] == "perfect" and row["ndcg@10"] == m["value"]
    assert row["num_queries"] == m["num_queries"] and row["no_judged_doc"] == m["no_judged_doc"]
    text = format_table([row])
    assert "no_judged_doc" in text.splitlines()[0] and "queries" in text.splitlines()[0]
    note = "scifact-slice test: 2 of 10 judged queries have no judged document in the corpus"
    assert (note in text) == (policy == "keep"), text


def _evaluate_runs_plain(monkeypatch, run, c, data, runs):
    """irflow.recipes.common.evaluate_systems's wiring, with the stages run outside Prefect (stage.run)."""
    from irflow.recipes import common

    calls = []

    def plain(run_, p, tag=None, **inputs):
        calls.append(set(inputs))
        return evaluate.run(run_, p, tag=tag, **inputs)

    monkeypatch.setattr(common, "evaluate", plain)
    out = common.evaluate_systems(run, c, data, common.Systems(runs))
    assert calls == [{"ranking", "qrels", "queries", "corpus"}]  # the recipes give evaluate the corpus
    return out.evaluations


_COMPARE_WITH_PYSERINI = """
import json, sys
from irflow.engine.java import setup_pyserini_env
from irflow.learn.lucene import LuceneBM25Searcher
from irflow.stages.bm25 import SEARCH_FIELDS

setup_pyserini_env("512m")  # Java 21 before pyserini starts the JVM
from pyserini.search.lucene import LuceneSearcher

args = json.loads(sys.argv[1])
out = {}
for variant, index in args["indexes"].items():
    ours, theirs = LuceneBM25Searcher(index, "512m"), LuceneSearcher(index)
    ours.set_bm25(1.2, 0.75)
    theirs.set_bm25(1.2, 0.75)
    hits = [s.batch_search(args["texts"], args["qids"], k=20, threads=2, fields=SEARCH_FIELDS[variant])
            for s in (ours, theirs)]
    out[variant] = [{q: [(h.docid, h.score) for h in found[q]] for q in args["qids"]} for found in hits]
print(json.dumps(out))
"""


def test_bm25_searcher_returns_pyserinis_hits_and_scores(tmp_path, scifact_docs):
    """irflow's searcher calls Anserini's SimpleSearcher without importing pyserini.search.lucene (8.5 s
    of imports in each search's child process): on a flat and a multi-field index it returns exactly
    Pyserini's LuceneSearcher.batch_search hits and scores."""
    import subprocess
    import sys

    from irflow.stages.bm25 import BM25IndexParams, bm25_index

    run = Run(str(tmp_path / "store"), "r", runtime=RuntimeConfig(jvm_heap="512m", threads=1))
    corpus, _ = run.store.publish_table("corpus", "corpus", scifact_docs)
    indexes = {v: bm25_index.run(run, BM25IndexParams(variant=v), tag=v, corpus=corpus).path
               for v in ("flat", "multifield")}
    titles = scifact_docs.column("title").to_pylist()[:12]
    args = {"indexes": {v: str(p) for v, p in indexes.items()}, "qids": [f"q{i}" for i in range(14)],
            "texts": titles + ["cancer cells in mice", "zzqxv qqzzvk"]}
    proc = subprocess.run([sys.executable, "-c", _COMPARE_WITH_PYSERINI, json.dumps(args)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for variant in ("flat", "multifield"):
        ours, theirs = found[variant]
        assert ours == theirs, variant
        assert all(ours[f"q{i}"] for i in range(13)) and ours["q13"] == []
        assert max(len(hits) for hits in ours.values()) == 20  # k
    # the two variants search different fields: some score differs
    assert found["flat"][0] != found["multifield"][0]
