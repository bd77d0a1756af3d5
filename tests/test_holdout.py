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

from irflow.runtime import StageRuntime
from irflow.store import TABLE_FILE, DatasetRef
from irflow.tasks.ingest import HoldoutParams, holdout
from irflow.twins import twin_groups

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
    from irflow.errors import DataError

    with pytest.raises(DataError, match="holds out 0.*dataset.proxy: null"):
        _split(tmp_path, docs[:3], "tiny", fraction=0.01)
