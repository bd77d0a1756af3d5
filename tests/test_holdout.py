"""The synthetic evaluation's held-out documents: a rule on each document's own id, so that adding and
deleting other documents never moves a document across, and exact and near twins (the same page under
another id, or with another footer) held out with it. Real text: the bundled SciFact sample's documents."""

from __future__ import annotations

import json
import random
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from irflow.engine.runtime import StageRuntime
from irflow.engine.store import TABLE_FILE, DatasetRef
from irflow.learn.twins import twin_groups
from irflow.stages.ingest import HoldoutParams, holdout

SAMPLE = Path(__file__).resolve().parents[1] / "irflow" / "samples" / "scifact-sample.zip"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    with zipfile.ZipFile(SAMPLE) as z:
        name = min((n for n in z.namelist() if n.endswith("corpus.jsonl")), key=len)
        return [json.loads(ln) for ln in z.read(name).decode().splitlines()[:600]]


def _corpus(tmp_path: Path, docs: list[dict], name: str) -> DatasetRef:
    folder = tmp_path / name
    folder.mkdir()
    pq.write_table(pa.table({"doc_id": [d["_id"] for d in docs], "title": [d.get("title", "") for d in docs],
                             "text": [d["text"] for d in docs]}), folder / TABLE_FILE)
    return DatasetRef(name, name, "table", "corpus", str(folder))


def _split(tmp_path: Path, docs: list[dict], name: str, **params) -> tuple[set[str], set[str]]:
    out = holdout.fn(HoldoutParams(**params), StageRuntime(threads=1, workdir=tmp_path),
                     corpus=_corpus(tmp_path, docs, name))
    return (set(out["heldout"].column("doc_id").to_pylist()), set(out["train_corpus"].column("doc_id").to_pylist()))


def test_membership_never_moves_when_documents_are_added_and_deleted(tmp_path, docs):
    """Night 1 on 500 documents; night 2 with 10% more and 5% deleted (held-out ones among them): every
    document of both nights is on the same side both nights."""
    night1 = docs[:500]
    rng = random.Random(3)
    deleted = set(rng.sample([d["_id"] for d in night1], 25))
    night2 = [d for d in night1 if d["_id"] not in deleted] + docs[500:550]
    held1, train1 = _split(tmp_path, night1, "n1", fraction=0.1)
    held2, train2 = _split(tmp_path, night2, "n2", fraction=0.1)
    assert deleted & held1, "the deletions must include held-out documents for this test to mean anything"
    assert 30 <= len(held1) <= 75  # about a tenth, by hash
    both = {d["_id"] for d in night1} & {d["_id"] for d in night2}
    assert held1 & both == held2 & both and train1 & both == train2 & both
    assert not train1 & held2  # nothing night 1 trained on is evaluated on night 2


def test_exact_and_near_twins_follow_their_twin(tmp_path, docs):
    """20 documents copied under new ids, 20 more with another footer: every held-out text's twins are
    held out with it, so no held-out text is in the training corpus."""
    base = docs[:200]
    exact = [{**d, "_id": d["_id"] + "-copy"} for d in base[:20]]
    near = [{**d, "_id": d["_id"] + "-v2", "text": d["text"] + " Copyright 2026 the authors. All rights reserved."}
            for d in base[20:40]]
    corpus = base + exact + near
    held, train = _split(tmp_path, corpus, "t", fraction=0.2)
    pairs = [(d["_id"], d["_id"] + "-copy") for d in base[:20]] + [(d["_id"], d["_id"] + "-v2") for d in base[20:40]]
    assert any(a in held or b in held for a, b in pairs), "some twin pair must touch the held-out side"
    for a, b in pairs:
        assert (a in held) == (b in held), (a, b)
    text = {d["_id"]: d["text"] for d in corpus}
    assert not {text[i] for i in held} & {text[i] for i in train}
    # without twins, the same corpus leaks: some held-out text is also trained on
    held_plain, train_plain = _split(tmp_path, corpus, "plain", fraction=0.2, twins=False)
    assert {text[i] for i in held_plain} & {text[i] for i in train_plain}


def test_twin_groups_keep_different_documents_apart(docs):
    groups = twin_groups({d["_id"]: d["text"] for d in docs[:300]})
    assert groups == []  # SciFact abstracts are distinct documents
    a, b = docs[0]["text"], docs[1]["text"]
    assert twin_groups({"a": a, "A": a.upper() + " !!", "b": b}) == [{"a", "A"}]


def test_a_corpus_with_nothing_to_hold_out_says_what_to_do(tmp_path, docs):
    from irflow.engine.errors import DataError

    with pytest.raises(DataError, match="holds out 0.*dataset.proxy: null"):
        _split(tmp_path, docs[:3], "tiny", fraction=0.01)


def test_proxy_queries_are_cut_out_of_the_passages_the_proxy_searches(tmp_path, docs):
    """ICT queries of the held-out passages, cut out of them: each judged passage no longer holds its
    query (nor is it empty), every other passage and every id and position is the corpus's own."""
    from irflow.stages.generate_queries import ICTSource, generate_queries
    from irflow.stages.ingest import cut_proxy_queries

    rt = StageRuntime(threads=1, workdir=tmp_path)
    corpus = _corpus(tmp_path, docs[:300], "c")
    parts = holdout.fn(HoldoutParams(fraction=0.2), rt, corpus=corpus)
    (tmp_path / "h").mkdir()
    pq.write_table(parts["heldout"], tmp_path / "h" / TABLE_FILE)
    gen = generate_queries.fn(ICTSource(source="ict"), rt, corpus=DatasetRef("h", "h", "table", "corpus",
                                                                             str(tmp_path / "h")))
    refs = {}
    for name in ("queries", "qrels"):
        (tmp_path / name).mkdir()
        pq.write_table(gen[name], tmp_path / name / TABLE_FILE)
        refs[name] = DatasetRef(name, name, "table", name, str(tmp_path / name))
    out = cut_proxy_queries.fn(None, rt, corpus=corpus, **refs)
    before, after = corpus.table(), out
    assert after.column("doc_id").to_pylist() == before.column("doc_id").to_pylist()
    query_of = dict(zip(gen["qrels"].column("doc_id").to_pylist(),
                        (dict(zip(gen["queries"].column("query_id").to_pylist(), gen["queries"].column("text").to_pylist()))[q]
                         for q in gen["qrels"].column("query_id").to_pylist())))
    assert len(query_of) >= 30
    for d, old, new in zip(*(before.column("doc_id").to_pylist(), before.column("text").to_pylist(),
                             after.column("text").to_pylist())):
        if d in query_of:
            assert query_of[d] in old and query_of[d] not in new and len(new.split()) >= len(old.split()) // 3
        else:
            assert new == old


def test_a_t5_proxy_cannot_be_cut(docs):
    from pydantic import ValidationError

    from irflow.recipes.dataset import ProxyConfig

    assert not ProxyConfig().cuts and ProxyConfig(cut=True).cuts  # whole passages: measured the better proxy
    with pytest.raises(ValidationError, match="t5 queries are not cut out"):
        ProxyConfig(queries={"source": "t5", "model": "some/t5"}, cut=True)


def test_held_out_log_queries_stay_held_out_as_the_log_grows_and_repeats_follow_their_twin(tmp_path):
    """A held-out part of a query log (dataset.proxy.queries: log): night 2's log has 10% more queries, 5%
    deleted and a repeat of each held-out query in other case and punctuation: every query of both nights
    is on the same side both nights, and each repeat on its twin's."""
    from irflow.stages.ingest import QueryHoldoutParams, hold_out_queries

    with zipfile.ZipFile(SAMPLE) as z:
        name = min((n for n in z.namelist() if n.endswith("queries.jsonl")), key=len)
        texts = [json.loads(ln)["text"] for ln in z.read(name).decode().splitlines()]
    assert len(texts) >= 200

    def split(log: list[str], tag: str) -> tuple[set[str], set[str]]:
        folder = tmp_path / tag
        folder.mkdir()
        pq.write_table(pa.table({"query_id": [f"{tag}-{i}" for i in range(len(log))], "text": log}), folder / TABLE_FILE)
        out = hold_out_queries.fn(QueryHoldoutParams(fraction=0.2), StageRuntime(threads=1, workdir=tmp_path),
                                  queries=DatasetRef(tag, tag, "table", "queries", str(folder)))
        return set(out["heldout"].column("text").to_pylist()), set(out["train_queries"].column("text").to_pylist())

    night1 = texts[:180]
    deleted = set(random.Random(4).sample(night1, 9))
    held1, train1 = split(night1, "n1")
    repeats = [t.upper().rstrip("?.") + " ?" for t in sorted(held1)]
    held2, train2 = split([t for t in night1 if t not in deleted] + texts[180:198] + repeats, "n2")
    assert 18 <= len(held1) <= 54 and deleted & held1
    both = set(night1) - deleted
    assert held1 & both == held2 & both and train1 & both == train2 & both
    assert set(repeats) <= held2  # a repeat, however written, is held out with its twin
