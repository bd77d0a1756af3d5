"""irflow.learn.ann (IVF-Flat, IVF-PQ with exact re-ranking, indexes filled batch by batch) and the dense
params and stage that use it: seeded clustered vectors for the index properties, real SciFact text
through the dense_search stage."""

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from irflow.dev.testing import make_tiny_bi_encoder, model, scifact_docs
from irflow.engine.runner import Run
from irflow.engine.runtime import StageRuntime
from irflow.learn import ann
from irflow.learn.encoding import encode_texts, load_sentence_transformer
from irflow.stages.dense import (
    DenseRetrieval,
    DenseSearchParams,
    EncodeParams,
    build_index,
    dense_search,
    embeddings_to_numpy,
    encode_corpus,
)

DIM = 64
PQ_RECALL_BOUND = 0.95  # IVF-PQ (8-byte codes, nprobe 8 of 25 cells, 4x shortlist) vs flat, recall@100


@pytest.fixture(scope="module")
def clustered():
    """4000 vectors around 40 centres (a corpus with cluster structure, as embeddings have), unnormalised
    so that inner product is not cosine, and 50 queries drawn the same way."""
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(40, DIM)).astype(np.float32)

    def draw(n):
        return (centres[rng.integers(0, len(centres), n)] + 0.6 * rng.normal(size=(n, DIM))).astype(np.float32)

    docs, queries = draw(4000), draw(50)
    flat = ann.build(lambda: iter((docs,)), "flat", threads=1)
    return docs, queries, ann.search(flat, queries, 100)


def batches_of(docs, *sizes):
    """Uneven batches of ``docs`` (the sizes, cycled), as a callable that can be iterated twice."""
    def gen():
        start, i = 0, 0
        while start < len(docs):
            yield docs[start:start + sizes[i % len(sizes)]]
            start += sizes[i % len(sizes)]
            i += 1
    return gen


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(e)) / len(e) for f, e in zip(found, exact)]))


def test_ivf_flat_probing_every_cell_is_flat(clustered):
    docs, queries, (flat_scores, flat_ids) = clustered
    index = ann.build(lambda: iter((docs,)), "ivf_flat", threads=1)
    assert index.index.nlist == ann.auto_nlist(4000, 4000) == 4000 // 39
    scores, ids = ann.search(index, queries, 100, nprobe=index.index.nlist)
    np.testing.assert_array_equal(ids, flat_ids)
    np.testing.assert_allclose(scores, flat_scores, rtol=1e-5, atol=1e-4)


def test_fewer_probes_never_find_more(clustered):
    """Probed cells grow with nprobe, so each query's candidates do: recall vs flat cannot drop."""
    docs, queries, (_, flat_ids) = clustered
    index = ann.build(lambda: iter((docs,)), "ivf_flat", nlist=64, threads=1)
    recalls = [recall(ann.search(index, queries, 100, nprobe=n)[1], flat_ids) for n in (1, 2, 4, 16, 64)]
    assert recalls == sorted(recalls)
    assert recalls[0] < recalls[-1] == 1.0


def test_ivf_pq_reranked_recall_and_exact_scores(clustered):
    docs, queries, (_, flat_ids) = clustered
    # a small training sample keeps PQ's k-means (256 centroids per sub-quantizer) quick
    index = ann.build(lambda: iter((docs,)), "ivf_pq", pq_m=8, train_size=1000, threads=1)
    assert index.index.nlist == 1000 // 39
    assert isinstance(index.vectors, np.memmap)
    np.testing.assert_array_equal(index.vectors, docs)
    scores, ids = ann.search(index, queries, 100, nprobe=8)
    assert recall(ids, flat_ids) >= PQ_RECALL_BOUND
    assert (ids >= 0).all()
    exact = np.einsum("qkd,qd->qk", docs[ids], queries)
    np.testing.assert_allclose(scores, exact, rtol=1e-5, atol=1e-4)
    assert (np.diff(scores, axis=1) <= 0).all()  # best first
    # without the re-ranking (a shortlist as deep as the ranking) PQ's own order is what re-ranking fixes
    _, shallow = ann.search(index, queries, 100, nprobe=8, rerank_depth=100)
    assert recall(shallow, flat_ids) < recall(ids, flat_ids)


@pytest.mark.parametrize("kind", ["flat", "ivf_flat", "ivf_pq"])
def test_batches_build_the_same_index_as_the_whole_matrix(clustered, kind):
    docs, queries, _ = clustered
    # train_size below the corpus: the sample itself must not depend on the batching
    whole = ann.build(lambda: iter((docs,)), kind, pq_m=8, train_size=1000, threads=1)
    shards = ann.build(batches_of(docs, 333, 1000, 7), kind, pq_m=8, train_size=1000, threads=1)
    for a, b in zip(ann.search(whole, queries, 50, nprobe=8), ann.search(shards, queries, 50, nprobe=8)):
        np.testing.assert_array_equal(a, b)


def test_training_sample_is_seeded_uniform_and_batch_independent(clustered):
    docs = clustered[0]
    sample, seen = ann.training_sample(batches_of(docs, 100)(), 500, seed=3)
    again, _ = ann.training_sample(batches_of(docs, 999, 1)(), 500, seed=3)
    other, _ = ann.training_sample(batches_of(docs, 100)(), 500, seed=4)
    assert seen == 4000 and sample.shape == (500, DIM)
    np.testing.assert_array_equal(sample, again)
    assert not np.array_equal(sample, other)
    rows = [int(np.flatnonzero((docs == v).all(axis=1))[0]) for v in sample]
    assert rows == sorted(rows) and rows[-1] > 3000  # corpus order, drawn from the whole corpus
    whole, _ = ann.training_sample(iter((docs,)), 5000)
    np.testing.assert_array_equal(whole, docs)


def test_params_that_do_not_fit_are_refused_naming_the_key(clustered):
    docs = clustered[0]
    with pytest.raises(ValueError, match=r"dense\.pq_m: 7 does not divide the embedding dimension 64"):
        build_index(docs, "ivf_pq", pq_m=7)
    with pytest.raises(ValueError, match=r"dense\.nlist: 5000 cells need at least 5000 training vectors"):
        build_index(docs, "ivf_flat", nlist=5000)
    with pytest.raises(ValueError, match=r"dense\.index: ivf_pq needs at least 256 training vectors"):
        build_index(docs[:200], "ivf_pq")
    with pytest.raises(ValidationError, match="pq_m: only used with index ivf_pq"):
        DenseRetrieval(index="ivf_flat", pq_m=16)
    with pytest.raises(ValidationError, match="nlist: only used with index ivf_flat or ivf_pq"):
        DenseRetrieval(nlist=64)
    with pytest.raises(ValidationError, match="rerank_depth: only used with index ivf_pq"):
        DenseRetrieval(index="hnsw", rerank_depth=4000)
    with pytest.raises(ValidationError, match="nlist: 64 cells need a training sample"):
        DenseRetrieval(index="ivf_flat", nlist=64, train_size=32)
    assert DenseRetrieval().index == "flat"  # the defaults are today's exact search


def test_dense_search_stage_with_ivf_indexes(tmp_path):
    """The stage on real SciFact text (a tiny encoder, 300 passages): ivf_flat probing every cell ranks as
    flat does; ivf_pq's scores are exact inner products of the stored embeddings."""
    docs = scifact_docs(300)
    titles = docs.column("title").to_pylist()[:8]
    qids = [f"q{i}" for i in range(8)]
    run = Run(str(tmp_path / "store"), "r")
    corpus, _ = run.store.publish_table("corpus", "corpus", docs)
    queries, _ = run.store.publish_table("queries", "queries", pa.table({"query_id": qids, "text": titles}))
    tiny = model(run, make_tiny_bi_encoder(tmp_path / "tiny", normalize=True))
    embeddings = encode_corpus.run(run, EncodeParams(batch_size=64), corpus=corpus, model=tiny)
    emb, doc_ids = embeddings_to_numpy(embeddings.table()), embeddings.table().column("doc_id").to_pylist()
    q_emb = encode_texts(load_sentence_transformer(tiny.path), titles, 8, normalize=True)
    exact = {qid: dict(zip(doc_ids, emb @ q)) for qid, q in zip(qids, q_emb)}

    def ranking(**params):
        t = dense_search.fn(DenseSearchParams(system="d", depth=20, **params), StageRuntime(threads=1, workdir=tmp_path),
                            embeddings=embeddings, queries=queries, model=tiny)
        return list(zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist(),
                        t.column("score").to_pylist()))

    flat = ranking()
    assert [(q, d) for q, d, _ in ranking(index="ivf_flat", nlist=6, nprobe=6)] == [(q, d) for q, d, _ in flat]
    pq = ranking(index="ivf_pq", pq_m=8, nlist=4, nprobe=2)
    assert len(pq) == len(flat) == 8 * 20
    for q, d, score in pq:
        assert score == pytest.approx(exact[q][d], abs=1e-5)
