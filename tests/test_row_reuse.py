"""Row-level reuse (irflow.engine.row_reuse): a map stage on a changed corpus computes only new and edited rows.

Real SciFact passages in versions (90% of them, then all, then 1 in 50 edited and 1 in 50 deleted); each
later version in a store that holds the earlier ones, against a cold run of that version in a store of
its own: the published dataset must be the same (same id: same bytes), and the stage's record says how
many rows were computed and reused.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from irflow.dev.testing import make_tiny_bi_encoder, make_tiny_t5, model, scifact_docs
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig
from irflow.stages.dense import EncodeParams, encode_corpus
from irflow.stages.generate_queries import ICTSource, T5Source, generate_queries

RUNTIME = RuntimeConfig(device="cpu", threads=1, shard_rows=64)
N = 200


def versions() -> dict[str, pa.Table]:
    docs = scifact_docs(N)
    ids = docs.column("doc_id").to_pylist()
    edited = set(ids[::50])
    deleted = set(ids[25::50])
    text = [t + " (revised)" if d in edited else t for d, t in zip(ids, docs.column("text").to_pylist())]
    changed = docs.set_column(2, "text", pa.array(text))
    return {"v90": docs.slice(0, int(N * 0.9)), "v100": docs,
            "edited": changed.filter(pc.invert(pc.is_in(changed.column("doc_id"), pa.array(sorted(deleted))))),
            "shrunk": docs.slice(0, N // 2)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    return {"root": root, "versions": versions(), "bi": make_tiny_bi_encoder(root / "bi"),
            "t5": make_tiny_t5(root / "t5")}


def call(setup, store: str, run_id: str, version: str, stage, params, **inputs):
    """The stage on a corpus version in a run on ``store``: (its output refs, its stage record)."""
    run = Run(str(setup["root"] / store), run_id, runtime=RUNTIME)
    corpus, _ = run.store.publish_table("corpus", "corpus", setup["versions"][version])
    extra = {k: model(run, v) for k, v in inputs.items()}
    out = stage.run(run, params, tag="t", corpus=corpus, **extra)
    return out, run.catalog.stage_runs(run_id)[-1]


def ids(out) -> dict[str, str] | str:
    return {k: r.id for k, r in out.items()} if isinstance(out, dict) else out.id


ENCODE = EncodeParams(batch_size=16, max_seq_length=32)
ICT = ICTSource(source="ict", queries_per_passage=2)


@pytest.mark.parametrize("stage, params, models", [
    (encode_corpus, ENCODE, {"model": "bi"}),
    (generate_queries, ICT, {}),
], ids=["encode_corpus", "generate_queries-ict"])
def test_a_changed_corpus_computes_only_its_new_and_edited_rows(setup, stage, params, models):
    name = stage.name
    inputs = {k: setup[v] for k, v in models.items()}
    _, first = call(setup, f"{name}-inc", "v90", "v90", stage, params, **inputs)
    assert first["rows"] == {"input": 180, "computed": 180, "reused": 0}
    grown, rec = call(setup, f"{name}-inc", "v100", "v100", stage, params, **inputs)
    assert {k: rec["rows"][k] for k in ("input", "computed", "reused")} == \
        {"input": 200, "computed": 20, "reused": 180}
    assert rec["rows"]["reused_from"] == {"v90": 180}
    cold, cold_rec = call(setup, f"{name}-cold-v100", "cold", "v100", stage, params, **inputs)
    assert ids(grown) == ids(cold)  # the same bytes as a cold run on the new corpus
    assert cold_rec["rows"]["computed"] == 200

    # 4 of 200 passages edited, 4 deleted: the edited ones computed again, the deleted ones gone
    edited, rec = call(setup, f"{name}-inc", "edited", "edited", stage, params, **inputs)
    assert {k: rec["rows"][k] for k in ("input", "computed", "reused")} == \
        {"input": 196, "computed": 4, "reused": 192}
    cold, _ = call(setup, f"{name}-cold-edited", "cold", "edited", stage, params, **inputs)
    assert ids(edited) == ids(cold)

    # a corpus that only shrank computes nothing per row (its passages are found in the runs before)
    shrunk, rec = call(setup, f"{name}-inc", "shrunk", "shrunk", stage, params, **inputs)
    assert rec["status"] == "computed" and rec["rows"]["computed"] == 0
    assert rec["shards"] == []
    cold, _ = call(setup, f"{name}-cold-shrunk", "cold", "shrunk", stage, params, **inputs)
    assert ids(shrunk) == ids(cold)


def test_t5_sampled_passage_by_passage_is_reused_and_auto_counts_the_corpus(setup):
    """t5 seeds each passage from its id: the queries of the 10 passages a grown corpus shares with the
    old one are reused, and equal a cold run's; with queries_per_passage auto the count per passage
    depends on the corpus size, and rows drawn with another count are never reused."""
    t5 = T5Source(source="t5", queries_per_passage=2, max_length=8, max_input_length=48, seed=3)
    setup["versions"]["t5-a"] = setup["versions"]["v100"].slice(0, 10)
    setup["versions"]["t5-b"] = setup["versions"]["v100"].slice(0, 14)
    call(setup, "t5-inc", "a", "t5-a", generate_queries, t5, model=setup["t5"])
    grown, rec = call(setup, "t5-inc", "b", "t5-b", generate_queries, t5, model=setup["t5"])
    assert (rec["rows"]["computed"], rec["rows"]["reused"]) == (4, 10)
    cold, _ = call(setup, "t5-cold", "cold", "t5-b", generate_queries, t5, model=setup["t5"])
    assert ids(grown) == ids(cold)

    # auto draws round(250k / corpus size) per passage: another count is another family (nothing reused)
    from irflow.engine.row_reuse import family

    auto = ICTSource(source="ict", queries_per_passage="auto")
    inputs = {"corpus": None}
    assert family(generate_queries, auto, inputs, "corpus", 50_000) != family(generate_queries, auto, inputs,
                                                                              "corpus", 60_000)
    assert family(generate_queries, auto, inputs, "corpus", 180) == family(generate_queries, auto, inputs,
                                                                           "corpus", 200)  # both 50


def test_reuse_off_and_forced_stages_compute_every_row(setup):
    """runtime.reuse_rows false computes every row (the same dataset)."""
    inputs = {"model": setup["bi"]}
    call(setup, "off", "v90", "v90", encode_corpus, ENCODE, **inputs)
    run = Run(str(setup["root"] / "off"), "v100", runtime=RUNTIME.model_copy(update={"reuse_rows": False}))
    corpus, _ = run.store.publish_table("corpus", "corpus", setup["versions"]["v100"])
    out = encode_corpus.run(run, ENCODE, tag="t", corpus=corpus, model=model(run, setup["bi"]))
    rec = run.catalog.stage_runs("v100")[-1]
    assert rec["rows"]["computed"] == 200
    cold, _ = call(setup, "encode_corpus-cold-v100", "cold", "v100", encode_corpus, ENCODE, **inputs)
    assert out.id == cold.id
