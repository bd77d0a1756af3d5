"""Dense encoding/search, BM25 search and BEIR evaluation, on real SciFact text."""

import json
import math
import zipfile

import numpy as np
import pyarrow as pa
import pytest

from irflow.stage import RunContext
from irflow.tasks.dense import build_index, embeddings_to_numpy, encode_corpus, encode_texts, passage_texts, \
    search_index
from irflow.tasks.evaluate import evaluate_run, mrr_at_k
from irflow.testing import make_tiny_bi_encoder


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


def test_length_sorted_encoding_keeps_input_order(scifact_docs, tiny):
    _, model = tiny
    texts = passage_texts(scifact_docs)
    ours = encode_texts(model, texts, batch_size=16, normalize=True)
    ref = model.encode(texts, batch_size=16, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-4


def test_encode_stage_roundtrip_and_hnsw_matches_flat(tmp_path, scifact_docs, tiny):
    path, model = tiny
    ctx = RunContext(str(tmp_path / "store"), "r")
    corpus, _ = ctx.store.publish_table("corpus", "corpus", scifact_docs)
    emb_ref = encode_corpus.run(ctx, cfg={"model": "tiny", "model_key": "k", "_model_path": str(path),
                                          "similarity": "cos", "batch_size": 32}, corpus=corpus)
    emb = embeddings_to_numpy(emb_ref.table())
    assert emb.shape == (scifact_docs.num_rows, 32)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)
    queries = emb[:10] + 0.01
    flat_scores, flat_idx = search_index(build_index(emb, "flat"), queries, 10)
    hnsw_scores, hnsw_idx = search_index(build_index(emb, "hnsw", hnsw_m=16), queries, 10, ef_search=200)
    # HNSW is approximate, but on 120 vectors with a wide search it finds the exact top 1.
    assert (flat_idx[:, 0] == hnsw_idx[:, 0]).all()
    assert np.allclose(flat_scores[:, 0], hnsw_scores[:, 0], atol=1e-5)
    brute = (queries @ emb.T).argsort(axis=1)[:, ::-1][:, :10]
    assert (brute[:, 0] == flat_idx[:, 0]).all()


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


def test_bm25_search_removes_query_id_hits(tmp_path, scifact_docs):
    from irflow.tasks.bm25 import bm25_index, bm25_search

    ctx = RunContext(str(tmp_path / "store"), "r")
    corpus, _ = ctx.store.publish_table("corpus", "corpus", scifact_docs)
    # A query whose id equals a document id and whose text is that document's title (like ArguAna).
    doc = scifact_docs.slice(3, 1).to_pylist()[0]
    queries, _ = ctx.store.publish_table("queries", "queries", pa.table({"query_id": [doc["doc_id"]],
                                                                         "text": [doc["title"]]}))
    index = bm25_index.run(ctx, cfg={"variant": "flat"}, corpus=corpus)
    kept = bm25_search.run(ctx, cfg={"system": "b", "variant": "flat", "top_k": 10, "remove_query": False},
                           label="keep", bm25_index=index, queries=queries).table()
    removed = bm25_search.run(ctx, cfg={"system": "b", "variant": "flat", "top_k": 10, "remove_query": True},
                              label="drop", bm25_index=index, queries=queries).table()
    assert kept.column("doc_id")[0].as_py() == doc["doc_id"]  # its own title finds it first
    assert doc["doc_id"] not in removed.column("doc_id").to_pylist()
    assert removed.column("rank").to_pylist() == list(range(1, removed.num_rows + 1))


def test_unanswered_judged_queries_score_zero():
    """trec_eval -c semantics (Pyserini's regressions): a judged query the system was asked but
    returned nothing for counts as 0; a judged query it was not asked does not count."""
    qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}, "q3": {"d3": 1}}
    results = {"q1": {"d1": 1.0}}
    per_query = evaluate_run(qrels, results, ["ndcg@10", "mrr@10"], asked={"q1", "q2"})
    assert per_query["ndcg@10"] == {"q1": 1.0, "q2": 0.0}
    assert per_query["mrr@10"] == {"q1": 1.0, "q2": 0.0}
    assert set(evaluate_run(qrels, results, ["ndcg@10"])["ndcg@10"]) == {"q1", "q2", "q3"}
