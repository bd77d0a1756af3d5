"""generate_queries (t5 / ict / crop / unlabelled) and doc2query_expand on a small real SciFact slice."""

from __future__ import annotations

import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"

import pyarrow as pa
import pytest

from irflow.testing import SHARED_DATASETS

from irflow import data_contracts
from irflow.models import ModelNotAvailable, model_cfg
from irflow.stage import RunContext
from irflow.tasks import generate_queries as gq
from irflow.tasks.doc2query import doc2query_expand, expand_corpus
from irflow.tasks.generate_queries import BatchGenerator, generate_queries, queries_per_passage
from irflow.tasks.ingest import ingest_beir, ingest_config
from irflow.testing import beir_slice, make_tiny_t5

SCIFACT = SHARED_DATASETS / "scifact.zip"

N_QPP = 2
N_T5_DOCS = 10  # the t5 tests use the slice's first passages: sampling is slow on shared CPUs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A ~20-passage SciFact slice with 5 test and 5 train queries, ingested, plus a tiny T5."""
    root = tmp_path_factory.mktemp("gq")
    folder = beir_slice(SCIFACT, root / "slice", n_test_queries=5, n_train_queries=5, n_extra_docs=12, seed=1)
    ctx = RunContext(str(root / "store"), "ingest")
    refs = ingest_beir.run(ctx, cfg=ingest_config({"source": str(folder)}, ctx.store.root / "downloads"))
    t5_corpus, _ = ctx.store.publish_table("corpus", "corpus", refs["corpus"].table().slice(0, N_T5_DOCS))
    t5 = make_tiny_t5(root / "t5")
    return {"root": root, "refs": refs, "t5": t5, "corpus": refs["corpus"].table(), "t5_corpus": t5_corpus}


def t5_cfg(data, **kw) -> dict:
    cfg = {"source": "t5", **model_cfg(str(data["t5"])), "queries_per_passage": N_QPP, "max_length": 8,
           "max_input_length": 64, "batch_size": 4, "shard_size": 4, "seed": 7,
           "_threads": 1}
    cfg.update(kw)
    return cfg


def run_gq(data, store: str, cfg: dict, run_id: str = "r", **inputs):
    ctx = RunContext(str(data["root"] / store), run_id)
    corpus = data["t5_corpus"] if cfg.get("source") == "t5" else data["refs"]["corpus"]
    out = generate_queries.run(ctx, cfg=cfg, corpus=corpus, **inputs)
    return ctx, out


def as_rows(table: pa.Table) -> list[tuple]:
    return list(zip(*(table.column(c).to_pylist() for c in table.column_names)))


@pytest.fixture(scope="module")
def baseline(data):
    """One uninterrupted t5 run that other tests compare against."""
    ctx, out = run_gq(data, "store-baseline", t5_cfg(data))
    return {"ctx": ctx, "queries": out["queries"].table(), "qrels": out["qrels"].table(), "refs": out}


# ---- t5 ---------------------------------------------------------------------------------------
def test_t5_n_queries_per_passage_unique_ids_and_positives(data, baseline):
    queries, qrels = baseline["queries"], baseline["qrels"]
    doc_ids = data["t5_corpus"].table().column("doc_id").to_pylist()
    # n distinct, non-empty queries for every passage
    q_text = dict(as_rows(queries))
    per_doc: dict[str, list[str]] = {}
    for qid, doc in zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist()):
        per_doc.setdefault(doc, []).append(q_text[qid])
    assert sorted(per_doc) == sorted(doc_ids)
    assert all(len(v) == N_QPP and len(set(v)) == N_QPP and all(t.strip() for t in v) for v in per_doc.values())
    # ids unique, one qrels row per query, pointing at the passage the id names
    qids = queries.column("query_id").to_pylist()
    assert len(set(qids)) == len(qids) == N_QPP * len(doc_ids)
    assert sorted(qrels.column("query_id").to_pylist()) == sorted(qids)
    for qid, doc in zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist()):
        assert re.fullmatch(rf"{re.escape(doc)}-q\d+", qid)
    assert set(qrels.column("split").to_pylist()) == {"generated"}
    assert set(qrels.column("score").to_pylist()) == {1}


def test_t5_deterministic_for_a_seed(data, baseline):
    _, again = run_gq(data, "store-determinism", t5_cfg(data))
    assert again["queries"].table().equals(baseline["queries"])
    assert again["queries"].id == baseline["refs"]["queries"].id  # same bytes, same content id
    _, other = run_gq(data, "store-determinism", t5_cfg(data, seed=8))
    assert other["queries"].table().column("text").to_pylist() != baseline["queries"].column("text").to_pylist()


def test_t5_second_run_is_cached(data, baseline):
    ctx = baseline["ctx"]
    out = generate_queries.run(ctx, cfg=t5_cfg(data), corpus=data["t5_corpus"])
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached"
    assert out["queries"].id == baseline["refs"]["queries"].id
    # the model path is a run-time hint: moving the model does not invalidate the cache
    out = generate_queries.run(ctx, cfg={**t5_cfg(data), "_model_path": "/elsewhere"}, corpus=data["t5_corpus"])
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached"


def test_t5_resume_skips_finished_shards(data, baseline, monkeypatch):
    cfg = t5_cfg(data)
    real_write, real_generate = gq._write_shard, gq._generate_batch
    written = []

    def write_then_crash(resume_dir, index, rows):
        real_write(resume_dir, index, rows)
        written.append(index)
        raise RuntimeError("simulated crash after the first shard")

    monkeypatch.setattr(gq, "_write_shard", write_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_gq(data, "store-resume", cfg)
    assert written == [0]
    store = data["root"] / "store-resume"
    partial = list((store / "partial").iterdir())
    assert len(partial) == 1 and [p.name for p in partial[0].iterdir()] == ["shard-000000.parquet"]

    seen_texts: list[str] = []

    def recording_generate(model, tokenizer, texts, n, gen, device):
        seen_texts.extend(texts)
        return real_generate(model, tokenizer, texts, n, gen, device)

    monkeypatch.setattr(gq, "_write_shard", real_write)
    monkeypatch.setattr(gq, "_generate_batch", recording_generate)
    _, out = run_gq(data, "store-resume", cfg)
    corpus = data["t5_corpus"].table()
    texts = [gq.passage_input(t, x) for t, x in zip(corpus.column("title").to_pylist(), corpus.column("text").to_pylist())]
    shard_size = cfg["shard_size"]
    assert not set(texts[:shard_size]) & set(seen_texts), "shard 0 was generated again"
    assert set(texts[shard_size:]) <= set(seen_texts)
    # the resumed result equals an uninterrupted run's, and the partial shards are gone
    assert out["queries"].table().equals(baseline["queries"])
    assert not any((store / "partial").iterdir())


def test_t5_oom_halves_the_batch_and_retries(data, monkeypatch):
    import torch

    real_generate = gq._generate_batch
    sizes: list[int] = []

    def oom_above_two(model, tokenizer, texts, n, gen, device):
        sizes.append(len(texts))
        if len(texts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_generate(model, tokenizer, texts, n, gen, device)

    monkeypatch.setattr(gq, "_generate_batch", oom_above_two)
    _, out = run_gq(data, "store-oom", t5_cfg(data, batch_size=8, shard_size=100))
    assert sizes[:3] == [8, 4, 2]
    assert all(s <= 2 for s in sizes[3:])  # the halved size is kept for the rest of the run
    n_docs = N_T5_DOCS
    assert sum(s for s in sizes if s <= 2) >= n_docs  # every passage was generated once it fit
    assert out["queries"].table().num_rows == N_QPP * n_docs


def test_batch_generator_oom_runtime_error_and_other_errors(monkeypatch):
    calls: list[int] = []

    def fake(model, tokenizer, texts, n, gen, device):
        calls.append(len(texts))
        if len(texts) > 1:
            raise RuntimeError("CUDA error: out of memory")
        return [[t + "?"] * n for t in texts]

    monkeypatch.setattr(gq, "_generate_batch", fake)
    g = BatchGenerator(None, None, {}, "cpu", batch_size=4)
    assert g(["a", "b", "c"], 1) == [["a?"], ["b?"], ["c?"]]
    assert calls == [3, 2, 1, 1, 1] and g.batch_size == 1

    def always_oom(*a):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gq, "_generate_batch", always_oom)
    with pytest.raises(RuntimeError, match="out of memory"):  # nothing left to halve
        BatchGenerator(None, None, {}, "cpu", batch_size=2)(["a"], 1)

    def broken(*a):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(gq, "_generate_batch", broken)
    g = BatchGenerator(None, None, {}, "cpu", batch_size=4)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not an OOM: no retry
        g(["a", "b"], 1)
    assert g.batch_size == 4


def test_unavailable_hub_model_fails_naming_it(data):
    cfg = {**t5_cfg(data), **model_cfg("BeIR/query-gen-msmarco-t5-base-v1")}
    with pytest.raises(ModelNotAvailable, match="BeIR/query-gen-msmarco-t5-base-v1"):
        run_gq(data, "store-missing-model", cfg)


def test_auto_queries_per_passage_follows_gpl():
    assert queries_per_passage("auto", 5183) == 48  # SciFact: 250K / 5183
    assert queries_per_passage("auto", 1000) == 50  # clipped at 50
    assert queries_per_passage("auto", 8_841_823) == 1  # MS MARCO: at least 1
    assert queries_per_passage(3, 10) == 3
    with pytest.raises(ValueError):
        queries_per_passage(0, 10)


# ---- model-free sources -----------------------------------------------------------------------
def test_ict_queries_are_sentences_of_their_source_passage(data):
    _, out = run_gq(data, "store-mf", {"source": "ict", "queries_per_passage": 2, "seed": 3})
    queries, qrels = out["queries"].table(), out["qrels"].table()
    text_of = dict(zip(data["corpus"].column("doc_id").to_pylist(), data["corpus"].column("text").to_pylist()))
    q_text = dict(as_rows(queries))
    assert queries.num_rows > 0 and qrels.num_rows == queries.num_rows
    for qid, doc in zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist()):
        assert qid.startswith(f"{doc}-ict")
        assert q_text[qid] in gq.split_sentences(text_of[doc])
        assert q_text[qid] != text_of[doc].strip()
    counts: dict[str, int] = {}
    for doc in qrels.column("doc_id").to_pylist():
        counts[doc] = counts.get(doc, 0) + 1
    assert max(counts.values()) <= 2
    _, again = run_gq(data, "store-mf-2", {"source": "ict", "queries_per_passage": 2, "seed": 3})
    assert again["queries"].table().equals(queries)


def test_crop_queries_are_spans_of_the_configured_length(data):
    lo, hi = 0.1, 0.5
    _, out = run_gq(data, "store-mf", {"source": "crop", "queries_per_passage": 3, "crop_ratio": [lo, hi], "seed": 3})
    queries, qrels = out["queries"].table(), out["qrels"].table()
    words_of = {d: t.split() for d, t in zip(data["corpus"].column("doc_id").to_pylist(),
                                             data["corpus"].column("text").to_pylist())}
    q_text = dict(as_rows(queries))
    docs = qrels.column("doc_id").to_pylist()
    assert len(set(docs)) == data["corpus"].num_rows  # every passage is long enough here
    for qid, doc in zip(qrels.column("query_id").to_pylist(), docs):
        words, q = words_of[doc], q_text[qid].split()
        assert any(words[i:i + len(q)] == q for i in range(len(words) - len(q) + 1)), "not a contiguous span"
        assert max(3, round(lo * len(words))) <= len(q) <= max(3, round(hi * len(words)))
    assert len(set(q_text)) == queries.num_rows


def test_unlabelled_gives_split_query_texts_without_qrels(data):
    refs = data["refs"]
    _, out = run_gq(data, "store-mf", {"source": "unlabelled", "split": "train"}, queries=refs["queries"],
                    qrels=refs["qrels"])
    train_ids = {q for q, s in zip(refs["qrels"].table().column("query_id").to_pylist(),
                                   refs["qrels"].table().column("split").to_pylist()) if s == "train"}
    queries = out["queries"].table()
    assert set(queries.column("query_id").to_pylist()) == train_ids and len(train_ids) == 5
    originals = dict(as_rows(refs["queries"].table()))
    assert all(originals[q] == t for q, t in as_rows(queries))
    assert out["qrels"].table().num_rows == 0  # labels are not passed on
    data_contracts.get("qrels").validate(out["qrels"].table())


def test_unlabelled_refuses_test_queries(data):
    refs = data["refs"]
    with pytest.raises(ValueError, match="test queries must not be used for training"):
        run_gq(data, "store-mf", {"source": "unlabelled", "split": "test"}, queries=refs["queries"],
               qrels=refs["qrels"])


def test_unknown_source_is_rejected(data):
    with pytest.raises(ValueError, match="unknown source"):
        run_gq(data, "store-mf", {"source": "gpt"})


# ---- doc2query --------------------------------------------------------------------------------
def test_expand_corpus_appends_queries_in_generation_order():
    corpus = pa.table({"doc_id": ["d1", "d2", "d3"], "title": ["T", "", ""], "text": ["one", "two", "three"]})
    queries = pa.table({"query_id": ["d2-q0", "d1-q0", "d1-q1", "x"], "text": ["b", "a0", "a1", "stray"]})
    qrels = pa.table({"query_id": ["d1-q1", "d1-q0", "d2-q0", "x"], "doc_id": ["d1", "d1", "d2", "d3"],
                      "score": pa.array([1, 1, 1, 0], pa.int32()), "split": ["generated"] * 4})
    out = expand_corpus(corpus, queries, qrels)
    assert out.column("doc_id").to_pylist() == ["d1", "d2", "d3"]
    assert out.column("text").to_pylist() == ["one a0 a1", "two b", "three"]  # score 0: not the doc's query
    assert out.column("title").to_pylist() == ["T", "", ""]
    assert expand_corpus(corpus, queries, qrels, max_queries=1).column("text").to_pylist()[0] == "one a0"


def test_doc2query_stage_expands_every_passage(data, baseline):
    ctx = baseline["ctx"]
    refs = baseline["refs"]
    out = doc2query_expand.run(ctx, cfg={}, corpus=data["t5_corpus"], queries=refs["queries"], qrels=refs["qrels"])
    expanded = out.table()
    corpus = data["t5_corpus"].table()
    assert expanded.column("doc_id").to_pylist() == corpus.column("doc_id").to_pylist()
    q_by_doc: dict[str, list[str]] = {}
    q_text = dict(as_rows(baseline["queries"]))
    for qid, doc in zip(baseline["qrels"].column("query_id").to_pylist(), baseline["qrels"].column("doc_id").to_pylist()):
        q_by_doc.setdefault(doc, []).append(q_text[qid])
    for doc, text, new in zip(corpus.column("doc_id").to_pylist(), corpus.column("text").to_pylist(),
                              expanded.column("text").to_pylist()):
        assert new == " ".join([text, *q_by_doc[doc]])
    doc2query_expand.run(ctx, cfg={}, corpus=data["t5_corpus"], queries=refs["queries"], qrels=refs["qrels"])
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached"
