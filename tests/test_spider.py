"""generate_queries' ``spider`` source (recurring spans, Ram et al., NAACL 2022) on real SciFact abstracts
cut into passages of 40 words (ids ``<doc>#<n>``, as ``dataset.passages`` cuts them): the query is a window
of one passage around a span that another passage of the same document shares, and that other passage is
its positive. A corpus without a document of two passages is refused; the source is computed whole (not
sharded, no row reuse); a GPL config takes ``generate.source: spider`` and refuses bad settings by key."""

from __future__ import annotations

import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
from pydantic import ValidationError

from irflow import api
from irflow.dev.testing import scifact_docs
from irflow.engine.errors import ConfigError, DataError, StageFailed
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig
from irflow.learn import generation
from irflow.sources.corpus_sources import document_id
from irflow.stages.generate_queries import SpiderSource, generate_queries

WORDS = 40  # passage length: SciFact abstracts (~200 words) give ~5 passages each
N_DOCS = 30
DEMO = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")


def cut(table, words: int = WORDS) -> tuple[list[str], list[str], list[str]]:
    """(passage ids, document ids, texts): each document cut into passages of ``words`` words without
    overlap, ids ``<doc>#1``, ``#2``, ... (a document that fits in one passage keeps its id)."""
    pids, texts = [], []
    for doc, text in zip(table.column("doc_id").to_pylist(), table.column("text").to_pylist()):
        w = text.split()
        if len(w) <= words:
            pids.append(doc), texts.append(text)
            continue
        for k, a in enumerate(range(0, len(w), words), start=1):
            pids.append(f"{doc}#{k}"), texts.append(" ".join(w[a:a + words]))
    return pids, [document_id(p) for p in pids], texts


def keys(text: str) -> list[str]:
    return [generation._word_key(w) for w in text.split()]


def contains(haystack: list[str], needle: list[str]) -> bool:
    return any(haystack[s:s + len(needle)] == needle for s in range(len(haystack) - len(needle) + 1))


@pytest.fixture(scope="module")
def passages():
    pids, docs, texts = cut(scifact_docs(N_DOCS))
    assert generation.multi_passage_documents(docs) >= 25
    return pids, docs, texts


def spider(passages, **kw):
    pids, docs, texts = passages
    args = {"n": 2, "seed": 7, **kw}
    return generation.spider_queries(pids, docs, texts, args.pop("n"), args.pop("seed"), **args)


def test_query_and_positive_share_the_span_the_positive_another_passage_of_the_document(passages):
    pids, docs, texts = passages
    text_of = dict(zip(pids, texts))
    rows = spider(passages, keep_span_probability=1.0, window_words=(10, 30))
    assert len(rows["query_id"]) > 100
    assert len(set(rows["query_id"])) == len(rows["query_id"])
    per_source: dict[str, list[str]] = {}
    for qid, pos, q, src, span in zip(rows["query_id"], rows["doc_id"], rows["text"], rows["source"], rows["span"]):
        assert re.fullmatch(rf"{re.escape(src)}-spider\d", qid)
        assert pos != src and document_id(pos) == document_id(src)  # another passage of the same document
        span_keys = keys(span)
        assert 2 <= len(span_keys) <= 10
        assert span_keys[0] not in generation.STOPWORDS and span_keys[-1] not in generation.STOPWORDS
        assert contains(keys(text_of[pos]), span_keys)  # the positive has the span ...
        assert contains(keys(text_of[src]), span_keys)  # ... and so has the passage the query came from,
        assert span in q and contains(keys(text_of[src]), keys(q))  # ... which holds the query, span kept
        assert len(span_keys) + 1 <= len(q.split()) <= len(span_keys) + 30  # the span and 10-30 words round it
        per_source.setdefault(src, []).append(pos)
    # up to n queries per passage, each with a different positive
    assert all(len(v) <= 2 and len(set(v)) == len(v) for v in per_source.values())
    assert any(len(v) == 2 for v in per_source.values())


def test_the_longest_recurring_span_is_preferred():
    """Passage a shares "heart failure" with b and "congestive heart failure in rats" with c: with one
    query, its positive is c and the span the longest one (stopword edges trimmed: "in rats" ends on a
    content word, so the whole 5-word span counts)."""
    a = "we studied congestive heart failure in rats treated with a novel beta blocker over twelve weeks"
    b = "heart failure outcomes were recorded by independent observers blinded to the allocation"
    c = "models of congestive heart failure in rats are widely used in preclinical cardiology research"
    for seed in range(5):
        rows = generation.spider_queries(["d#1", "d#2", "d#3"], ["d"] * 3, [a, b, c], 1, seed)
        first = rows["source"].index("d#1")
        assert rows["doc_id"][first] == "d#3" and rows["span"][first] == "congestive heart failure in rats"
    # a span of stopwords only never counts ("of the" recurs here, nothing else)
    rows = generation.spider_queries(["e#1", "e#2"], ["e"] * 2, ["most of the cells died", "none of the mice lived"],
                                     1, 0, min_span_words=2)
    assert rows["query_id"] == []


def test_keep_span_probability_zero_takes_the_span_out(passages):
    rows = spider(passages, keep_span_probability=0.0)
    assert len(rows["query_id"]) > 100
    for q, span in zip(rows["text"], rows["span"]):
        assert not contains(keys(q), keys(span)), (q, span)
    # one half: kept in about half the queries
    half = spider(passages, keep_span_probability=0.5)
    kept = sum(contains(keys(q), keys(s)) for q, s in zip(half["text"], half["span"])) / len(half["text"])
    assert 0.35 < kept < 0.65, kept


def test_deterministic_for_a_seed_and_a_passage_depends_on_its_document_only(passages):
    pids, docs, texts = passages
    rows = spider(passages)
    assert spider(passages) == rows
    assert spider(passages, seed=8)["text"] != rows["text"]
    # the corpus in another order, with another document's passages gone: the same rows for the rest
    keep = [i for i in reversed(range(len(pids))) if docs[i] != docs[0]]
    other = generation.spider_queries([pids[i] for i in keep], [docs[i] for i in keep], [texts[i] for i in keep],
                                      2, 7)
    mine = {q: (p, t) for q, p, t, s in zip(rows["query_id"], rows["doc_id"], rows["text"], rows["source"])
            if document_id(s) != docs[0]}
    assert {q: (p, t) for q, p, t in zip(other["query_id"], other["doc_id"], other["text"])} == mine


def _run(tmp_path, table, params, runtime=None):
    ctx = Run(str(tmp_path / "store"), "r", runtime=runtime or RuntimeConfig(device="cpu", threads=1))
    corpus, _ = ctx.store.publish_table("corpus", "corpus", table)
    return ctx, generate_queries.run(ctx, params, tag="spider", corpus=corpus)


def test_stage_writes_queries_and_qrels_to_the_other_passage_computed_whole(tmp_path, passages):
    import pyarrow as pa

    pids, docs, texts = passages
    table = pa.table({"doc_id": pids, "title": [""] * len(pids), "text": texts})
    params = SpiderSource(source="spider", queries_per_passage=2, seed=7)
    assert not generate_queries.sharded(params) and not generate_queries.rows.applies(params)
    ctx, out = _run(tmp_path, table, params, RuntimeConfig(device="cpu", threads=1, shard_rows=10))
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["shards"] == []  # whole, whatever shard_rows says
    queries, qrels = out["queries"].table(), out["qrels"].table()
    rows = spider(passages)
    assert queries.column("query_id").to_pylist() == rows["query_id"]
    assert queries.column("text").to_pylist() == rows["text"]
    assert qrels.column("query_id").to_pylist() == rows["query_id"]
    assert qrels.column("doc_id").to_pylist() == rows["doc_id"]  # the positive: the OTHER passage
    assert set(qrels.column("split").to_pylist()) == {"generated"} and set(qrels.column("score").to_pylist()) == {1}


def test_corpus_without_multi_passage_documents_is_refused(tmp_path):
    """BEIR corpora have a passage per document: Spider has no pairs there, and says what to do."""
    with pytest.raises(StageFailed, match=r"no document of the corpus has two \(20 passages") as e:
        _run(tmp_path, scifact_docs(20), SpiderSource(source="spider"))
    assert isinstance(e.value.cause, DataError) and e.value.user_error
    assert "dataset.passages" in str(e.value) and "t5, ict or crop" in str(e.value)


def test_params_are_validated():
    assert SpiderSource(source="spider", window_words=20).window_words == (20, 20)
    assert SpiderSource(source="spider", window_words=[5, 40]).window_words == (5, 40)
    for bad, match in [({"window_words": 0}, "window_words must be"),
                       ({"window_words": [30, 10]}, "window_words must be"),
                       ({"min_span_words": 4, "max_span_words": 3}, "max_span_words: 3 is below"),
                       ({"keep_span_probability": 1.5}, "keep_span_probability"),
                       ({"min_span_words": 0}, "min_span_words"), ({"top_k": 5}, "top_k")]:
        with pytest.raises(ValidationError, match=match):
            SpiderSource(source="spider", **bad)


def test_gpl_config_takes_spider_and_refuses_bad_settings_by_key():
    c = api.load_config(DEMO, ["generate={source: spider, window_words: [8, 20], queries_per_passage: 2}"])
    assert isinstance(c.generate, SpiderSource) and c.generate.window_words == (8, 20)
    assert c.label.positive == "qrels"  # the positive is the other passage, from the qrels
    assert c.advice() == []  # not measured: no model-free warning quoting numbers it does not have
    with pytest.raises(ConfigError) as err:
        api.load_config(DEMO, ["generate={source: spider}", "generate.window_words=0",
                               "generate.keep_span_probability=2", "generate.min_span_words=0"])
    msg = str(err.value)
    assert "3 problems" in msg and "generate.window_words: window_words must be" in msg
    assert "generate.keep_span_probability: 2" in msg and "generate.min_span_words: 0" in msg
    assert "Traceback" not in msg and "pydantic" not in msg.lower()
    with pytest.raises(ConfigError, match=r"generate.max_span_words: 1 is below min_span_words \(2\)"):
        api.load_config(DEMO, ["generate={source: spider}", "generate.max_span_words=1"])
