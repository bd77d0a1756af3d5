"""generate_queries (t5 / ict / crop / unlabelled) and doc2query_expand on a small real SciFact slice.

Params are typed: a source's settings are validated when its params model is built (a bad value is a
pydantic ValidationError before any stage runs); the generator is an input ref (``model``), keyed by
its weights; device, precision and threads come from the run's runtime and are not keyed.

Both stages are sharded by corpus (irflow.engine.shards): shards of a few passages give the same datasets
(same ids) as one shard -- t5 too, its shards rounded up to whole batches --, ``queries_per_passage:
auto`` counts the whole corpus, and a failed shard leaves the others' parts for the next run."""

from __future__ import annotations

import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"

import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from pydantic import ValidationError

from irflow import data_contracts
from irflow.dev.testing import SHARED_DATASETS, beir_slice, ingest_folder, make_tiny_t5, model
from irflow.engine.errors import DataError, StageFailed
from irflow.engine.models import ModelNotAvailable, resolve
from irflow.engine.params import Params
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig, StageRuntime
from irflow.learn import generation
from irflow.learn.generation import BatchGenerator
from irflow.learn.text import passage_text
from irflow.stages import generate_queries as gq
from irflow.stages.doc2query import Doc2QueryParams, doc2query_expand, expand_corpus
from irflow.stages.generate_queries import (
    CropSource,
    ICTSource,
    T5Source,
    UnlabelledSource,
    generate_queries,
    queries_per_passage,
)

SCIFACT = SHARED_DATASETS / "scifact.zip"

N_QPP = 2
N_T5_DOCS = 10  # the t5 tests use the slice's first passages: sampling is slow on shared CPUs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A ~20-passage SciFact slice with 5 test and 5 train queries, ingested, plus a tiny T5."""
    root = tmp_path_factory.mktemp("gq")
    folder = beir_slice(SCIFACT, root / "slice", n_test_queries=5, n_train_queries=5, n_extra_docs=12, seed=1)
    ctx = Run(str(root / "store"), "ingest")
    refs = ingest_folder(ctx, folder)
    t5_corpus, _ = ctx.store.publish_table("corpus", "corpus", refs["corpus"].table().slice(0, N_T5_DOCS))
    t5 = make_tiny_t5(root / "t5")
    return {"root": root, "refs": refs, "t5": t5, "corpus": refs["corpus"].table(), "t5_corpus": t5_corpus}


def t5_params(**kw) -> T5Source:
    return T5Source(**{"source": "t5", "queries_per_passage": N_QPP, "max_length": 8, "max_input_length": 64,
                       "sampling": "batch", "batch_size": 4, "seed": 7, **kw})


# One intra-op thread (on a busy shared CPU it avoids OpenMP spin-waiting) and a fixed device: the
# sampled queries depend on the device, and "auto" would pick a GPU where there is one.
RUNTIME = RuntimeConfig(device="cpu", threads=1)


def sharded(rows: int) -> RuntimeConfig:
    return RUNTIME.model_copy(update={"shard_rows": rows})


def run_gq(data, store: str, params, run_id: str = "r", runtime=RUNTIME, **inputs):
    """generate_queries in a run on its own store; t5 reads the first passages and the tiny T5."""
    ctx = Run(str(data["root"] / store), run_id, runtime=runtime)
    source = params.source if isinstance(params, Params) else params.get("source")
    if source == "t5":
        inputs = {"corpus": data["t5_corpus"], "model": model(ctx, data["t5"]), **inputs}
    else:
        inputs = {"corpus": data["refs"]["corpus"], **inputs}
    out = generate_queries.run(ctx, params, tag=source, **inputs)
    return ctx, out


def as_rows(table: pa.Table) -> list[tuple]:
    return list(zip(*(table.column(c).to_pylist() for c in table.column_names)))


@pytest.fixture(scope="module")
def baseline(data):
    """One uninterrupted t5 run that other tests compare against."""
    ctx, out = run_gq(data, "store-baseline", t5_params())
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
    _, again = run_gq(data, "store-determinism", t5_params())
    assert again["queries"].table().equals(baseline["queries"])
    assert again["queries"].id == baseline["refs"]["queries"].id  # same bytes, same content id
    _, other = run_gq(data, "store-determinism", t5_params(seed=8))
    assert other["queries"].table().column("text").to_pylist() != baseline["queries"].column("text").to_pylist()


def test_t5_second_run_is_cached(data, baseline, tmp_path):
    ctx = baseline["ctx"]
    out = generate_queries.run(ctx, t5_params(), tag="t5", corpus=data["t5_corpus"], model=model(ctx, data["t5"]))
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached"
    assert out["queries"].id == baseline["refs"]["queries"].id
    # params given as a dict (as a config gives them) validate into the same params: same key
    out = generate_queries.run(ctx, t5_params().model_dump(), corpus=data["t5_corpus"], model=model(ctx, data["t5"]))
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached" and out == baseline["refs"]
    # the model's path is not keyed, its weights are: a copy elsewhere does not invalidate the cache
    moved = Path(shutil.copytree(data["t5"], tmp_path / "elsewhere" / "t5"))
    out = generate_queries.run(ctx, t5_params(), corpus=data["t5_corpus"], model=model(ctx, moved))
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached" and out == baseline["refs"]
    # nor is the runtime (threads, precision): another one is a cache hit
    other_rt = Run(ctx.store_root, "other-runtime", runtime=RuntimeConfig(device="cpu", threads=2, precision="fp32"))
    generate_queries.run(other_rt, t5_params(), corpus=data["t5_corpus"], model=model(other_rt, data["t5"]))
    assert [r["status"] for r in other_rt.catalog.stage_runs("other-runtime")] == ["cached"]
    # other weights are another generator: recomputed
    other = make_tiny_t5(tmp_path / "t5-other", seed=1)
    out = generate_queries.run(ctx, t5_params(), corpus=data["t5_corpus"], model=model(ctx, other))
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "computed"
    assert out["queries"].id != baseline["refs"]["queries"].id


def ids(out) -> dict[str, str]:
    """Output name -> dataset id (a content id: the same in any store)."""
    return {k: r.id for k, r in out.items()}


def last_shards(ctx) -> list[dict]:
    """The shards of the run's last stage call, as the catalog recorded them."""
    return ctx.catalog.stage_runs(ctx.run_id)[-1]["shards"]


def test_t5_shards_give_the_same_datasets_as_one_shard(data, baseline, caplog):
    """shard_rows 3 with batch_size 4: rounded up to 4 (shards never split a batch), 3 shards of the 10
    passages; every sampled query is the one the unsharded run drew (same ids, queries and qrels)."""
    assert [s["rows"] for s in baseline["ctx"].catalog.stage_runs("r")[0]["shards"]] == [[0, N_T5_DOCS]]
    with caplog.at_level("INFO", logger="irflow.engine.shards"):
        ctx, out = run_gq(data, "store-t5-sharded", t5_params(), runtime=sharded(3))
    assert "shard_rows 3 rounded up to 4, a multiple of 4" in caplog.text
    assert [s["rows"] for s in last_shards(ctx)] == [[0, 4], [4, 8], [8, 10]]
    assert {s["status"] for s in last_shards(ctx)} == {"computed"}
    assert ids(out) == ids(baseline["refs"])  # queries and qrels: same bytes, same content ids
    assert not any((data["root"] / "store-t5-sharded" / "partial").iterdir())  # parts removed once published


def test_t5_failed_shard_then_only_missing_shards_run(data, baseline, monkeypatch):
    """A shard that fails fails the stage naming its rows and publishes nothing; the finished shards'
    parts (one per output) stay, and the next run computes only the shards without all their parts."""
    from irflow.engine import shards

    params, store = t5_params(), data["root"] / "store-resume"
    real_shard, real_generate = shards.run_shard, generation._generate_batch

    def fail_third(job):
        if job.index == 2:
            raise RuntimeError("simulated crash in shard 2")
        return real_shard(job)

    monkeypatch.setattr(shards, "run_shard", fail_third)
    with pytest.raises(StageFailed, match=r"shard 2 \(rows 8-10 of corpus\) failed: RuntimeError: simulated crash") as e:
        run_gq(data, "store-resume", params, runtime=sharded(4))
    assert e.value.stage == "generate_queries[t5]" and not e.value.user_error
    assert not any(d.name.startswith(("queries-", "qrels-")) for d in (store / "objects").iterdir())
    partial = list((store / "partial").iterdir())
    assert len(partial) == 1
    parts = {shards.part_name(a, b, o) for a, b in ((0, 4), (4, 8)) for o in ("queries", "qrels")}
    assert {p.name for p in partial[0].iterdir()} == parts
    # a shard killed between its two renames has one part only: it is not done, and computed again
    (partial[0] / shards.part_name(4, 8, "qrels")).unlink()

    seen_texts: list[str] = []

    def recording_generate(model, tokenizer, texts, n, gen, device):
        seen_texts.extend(texts)
        return real_generate(model, tokenizer, texts, n, gen, device)

    monkeypatch.setattr(shards, "run_shard", real_shard)
    monkeypatch.setattr(generation, "_generate_batch", recording_generate)
    ctx, out = run_gq(data, "store-resume", params, run_id="rerun", runtime=sharded(4))
    assert [s["status"] for s in last_shards(ctx)] == ["resumed", "computed", "computed"]
    corpus = data["t5_corpus"].table()
    texts = [passage_text(t, x) for t, x in zip(corpus.column("title").to_pylist(), corpus.column("text").to_pylist())]
    assert not set(texts[:4]) & set(seen_texts), "shard 0 was generated again"
    assert set(texts[4:]) <= set(seen_texts)
    # the resumed result equals an uninterrupted (and unsharded) run's, and the parts are gone
    assert ids(out) == ids(baseline["refs"])
    assert not any((store / "partial").iterdir())


def test_t5_oom_halves_the_batch_and_retries(data, monkeypatch):
    import torch

    real_generate = generation._generate_batch
    sizes: list[int] = []

    def oom_above_two(model, tokenizer, texts, n, gen, device):
        sizes.append(len(texts))
        if len(texts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_generate(model, tokenizer, texts, n, gen, device)

    monkeypatch.setattr(generation, "_generate_batch", oom_above_two)
    _, out = run_gq(data, "store-oom", t5_params(batch_size=8))
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

    monkeypatch.setattr(generation, "_generate_batch", fake)
    g = BatchGenerator(None, None, {}, "cpu", batch_size=4)
    assert g(["a", "b", "c"], 1) == [["a?"], ["b?"], ["c?"]]
    assert calls == [3, 2, 1, 1, 1] and g.batch_size == 1

    def always_oom(*a):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(generation, "_generate_batch", always_oom)
    with pytest.raises(RuntimeError, match="out of memory"):  # nothing left to halve
        BatchGenerator(None, None, {}, "cpu", batch_size=2)(["a"], 1)

    def broken(*a):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(generation, "_generate_batch", broken)
    g = BatchGenerator(None, None, {}, "cpu", batch_size=4)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not an OOM: no retry
        g(["a", "b"], 1)
    assert g.batch_size == 4


def test_unavailable_hub_model_fails_naming_it(data):
    hub = "BeIR/query-gen-msmarco-t5-base-v1"
    ctx = Run(str(data["root"] / "store-missing-model"), "r", runtime=RUNTIME)
    # a recipe turns the config's model name into an input ref first: offline, that fails fast, naming it
    with pytest.raises(ModelNotAvailable, match=rf"generate\.model: model '{hub}' is not available"):
        ctx.model(hub, "generate.model")
    # a ref that cannot be loaded fails the stage, still naming the model
    with pytest.raises(StageFailed, match=hub) as e:
        generate_queries.run(ctx, t5_params(), corpus=data["t5_corpus"], model=resolve(hub))
    assert isinstance(e.value.cause, ModelNotAvailable) and e.value.user_error
    assert ctx.catalog.stage_runs("r") == []


def test_t5_needs_a_model(data):
    ctx = Run(str(data["root"] / "store-no-model"), "r", runtime=RUNTIME)
    with pytest.raises(StageFailed, match="source 't5' needs the model input"):
        generate_queries.run(ctx, t5_params(), corpus=data["t5_corpus"])


def test_runtime_device_reaches_the_model(data, baseline):
    """The generator is loaded on the runtime's device: on 'meta' (weights without data) it cannot generate."""
    with pytest.raises(Exception, match="meta") as e:
        generate_queries.fn(t5_params(), StageRuntime(device="meta"), corpus=data["t5_corpus"],
                            model=resolve(str(data["t5"])))
    assert not isinstance(e.value, TypeError)  # the device failed, not the call
    # through a run: the runtime config's device for "generate" (and not another kind's) is the one used
    encode_meta = RuntimeConfig(device={"default": "cpu", "encode": "meta"}, threads=1)
    _, ok = run_gq(data, "store-device", t5_params(), runtime=encode_meta)
    assert ok["queries"].id == baseline["refs"]["queries"].id
    generate_meta = RuntimeConfig(device={"default": "cpu", "generate": "meta"}, threads=1)
    with pytest.raises(StageFailed, match="meta") as e:
        run_gq(data, "store-device", t5_params(seed=99), runtime=generate_meta)
    assert e.value.stage == "generate_queries[t5]"


def test_plain_function_matches_the_stage(data, baseline):
    """``stage.fn(params, StageRuntime(), ...)`` computes what the cached stage published (no resume dir needed)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = generate_queries.fn(t5_params(), StageRuntime(device="cpu", threads=1), corpus=data["t5_corpus"],
                                  model=resolve(str(data["t5"])))
    finally:
        torch.set_num_threads(threads)
    assert out["queries"].equals(baseline["queries"]) and out["qrels"].equals(baseline["qrels"])


def test_auto_queries_per_passage_follows_gpl():
    assert queries_per_passage("auto", 5183) == 48  # SciFact: 250K / 5183
    assert queries_per_passage("auto", 1000) == 50  # clipped at 50
    assert queries_per_passage("auto", 8_841_823) == 1  # MS MARCO: at least 1
    assert queries_per_passage(3, 10) == 3
    # a count below 1 is refused when the params are built, for every generating source
    for cls, source in ((T5Source, "t5"), (ICTSource, "ict"), (CropSource, "crop")):
        with pytest.raises(ValidationError, match="queries_per_passage"):
            cls(source=source, queries_per_passage=0)
        with pytest.raises(ValidationError, match="queries_per_passage"):
            cls(source=source, queries_per_passage="many")
        assert cls(source=source, queries_per_passage="auto").queries_per_passage == "auto"


# ---- model-free sources -----------------------------------------------------------------------
def test_ict_queries_are_sentences_of_their_source_passage(data):
    _, out = run_gq(data, "store-mf", ICTSource(source="ict", queries_per_passage=2, seed=3))
    queries, qrels = out["queries"].table(), out["qrels"].table()
    text_of = dict(zip(data["corpus"].column("doc_id").to_pylist(), data["corpus"].column("text").to_pylist()))
    q_text = dict(as_rows(queries))
    assert queries.num_rows > 0 and qrels.num_rows == queries.num_rows
    for qid, doc in zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist()):
        assert qid.startswith(f"{doc}-ict")
        assert q_text[qid] in generation.split_sentences(text_of[doc])
        assert q_text[qid] != text_of[doc].strip()
    counts: dict[str, int] = {}
    for doc in qrels.column("doc_id").to_pylist():
        counts[doc] = counts.get(doc, 0) + 1
    assert max(counts.values()) <= 2
    _, again = run_gq(data, "store-mf-2", {"source": "ict", "queries_per_passage": 2, "seed": 3})  # a dict validates
    assert again["queries"].table().equals(queries)


def test_crop_queries_are_spans_of_the_configured_length(data):
    lo, hi = 0.1, 0.5
    _, out = run_gq(data, "store-mf", CropSource(source="crop", queries_per_passage=3, crop_ratio=[lo, hi], seed=3))
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


@pytest.mark.parametrize("params", [ICTSource(source="ict", queries_per_passage=2, seed=3),
                                    CropSource(source="crop", queries_per_passage=3, seed=3)], ids=["ict", "crop"])
def test_model_free_shards_give_the_same_datasets_as_one_shard(data, params):
    tag = params.source
    whole_ctx, whole = run_gq(data, f"store-{tag}-whole", params)
    assert len(last_shards(whole_ctx)) == 1
    ctx, out = run_gq(data, f"store-{tag}-sharded", params, runtime=sharded(3))
    n = data["corpus"].num_rows
    assert [s["rows"] for s in last_shards(ctx)] == [[a, min(a + 3, n)] for a in range(0, n, 3)]  # no rounding
    assert ids(out) == ids(whole) and out["queries"].table().num_rows > n  # queries and qrels


def test_auto_queries_per_passage_counts_the_whole_corpus_in_shards(data, baseline, monkeypatch):
    """``auto`` is round(total / |C|) with |C| the whole corpus, not a shard: with ``total`` set to twice
    the corpus size, 2 queries per passage in shards of 3 passages too (a shard's size would give 7)."""
    monkeypatch.setattr(gq, "GPL_TOTAL_QUERIES", 2 * data["corpus"].num_rows)
    params = CropSource(source="crop", queries_per_passage="auto", seed=3)
    _, whole = run_gq(data, "store-auto-whole", params)
    _, out = run_gq(data, "store-auto-sharded", params, runtime=sharded(3))
    assert ids(out) == ids(whole)
    per_doc: dict[str, int] = {}
    for doc in out["qrels"].table().column("doc_id").to_pylist():
        per_doc[doc] = per_doc.get(doc, 0) + 1
    assert set(per_doc.values()) == {2} and len(per_doc) == data["corpus"].num_rows
    # t5: 2 per passage of the 10, in shards of 4: the very datasets of the baseline's explicit 2
    monkeypatch.setattr(gq, "GPL_TOTAL_QUERIES", 2 * N_T5_DOCS)
    _, t5 = run_gq(data, "store-auto-t5", t5_params(queries_per_passage="auto"), runtime=sharded(4))
    assert ids(t5) == ids(baseline["refs"])


def test_unlabelled_is_not_sharded(data):
    """unlabelled reads the dataset's queries, not the corpus: computed whole whatever shard_rows says."""
    refs = data["refs"]
    params = UnlabelledSource(source="unlabelled", split="train")
    _, whole = run_gq(data, "store-unlabelled-whole", params, queries=refs["queries"], qrels=refs["qrels"])
    ctx, out = run_gq(data, "store-unlabelled-sharded", params, runtime=sharded(2), queries=refs["queries"],
                      qrels=refs["qrels"])
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "computed" and last_shards(ctx) == []
    assert ids(out) == ids(whole) and out["queries"].table().num_rows == 5


@pytest.mark.parametrize("ratio", [[0.6, 0.2], [0.0, 0.5], [0.1, 1.5]], ids=["reversed", "zero", "above-1"])
def test_crop_ratio_is_validated(ratio):
    with pytest.raises(ValidationError, match="crop_ratio must be"):
        CropSource(source="crop", crop_ratio=ratio)


def test_unlabelled_gives_split_query_texts_without_qrels(data):
    refs = data["refs"]
    _, out = run_gq(data, "store-mf", UnlabelledSource(source="unlabelled", split="train"),
                    queries=refs["queries"], qrels=refs["qrels"])
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
    with pytest.raises(ValidationError, match="test queries must not be used for training"):
        UnlabelledSource(source="unlabelled", split="test")
    with pytest.raises(ValidationError, match="test queries must not be used for training"):  # as a dict, too
        run_gq(data, "store-mf", {"source": "unlabelled", "split": "test"}, queries=refs["queries"],
               qrels=refs["qrels"])


def test_unlabelled_split_without_queries_is_a_data_error(data):
    refs = data["refs"]
    with pytest.raises(StageFailed, match=r"no queries are judged in split 'dev' \(the dataset's splits: test, "
                                          r"train\)") as e:
        run_gq(data, "store-mf", UnlabelledSource(source="unlabelled", split="dev"), queries=refs["queries"],
               qrels=refs["qrels"])
    assert isinstance(e.value.cause, DataError) and e.value.user_error


def test_unknown_source_is_rejected(data):
    with pytest.raises(ValidationError, match="'gpt'") as e:
        run_gq(data, "store-mf", {"source": "gpt"})
    # names the known sources (as a discriminated union's "expected tags", or one error per member)
    assert all(f"'{source}'" in str(e.value) for source in gq.SOURCES), str(e.value)
    with pytest.raises(ValidationError, match="top_k"):  # a setting of another source (or a typo): refused
        run_gq(data, "store-mf", {"source": "ict", "top_k": 5})


def test_generate_defaults_are_written_once():
    """The GPL recipe's generate section is the stage's params plus the model: no default of its own."""
    from irflow.recipes.gpl import GPLConfig, T5Generate

    section = GPLConfig.model_fields["generate"].default
    assert isinstance(section, T5Generate) and section.source == "t5"
    assert section.seed == T5Source.model_fields["seed"].default == 42
    assert section.to(T5Source) == T5Source(source="t5")  # every stage setting: the stage's default
    assert set(T5Generate.model_fields) - set(T5Source.model_fields) == {"model"}
    for name, field in T5Source.model_fields.items():  # inherited, not redeclared
        assert T5Generate.model_fields[name].default == field.default, name
    # the other sources are the stage's own params models
    for cls, source in ((ICTSource, "ict"), (CropSource, "crop")):
        assert cls(source=source).seed == section.seed


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
    out = doc2query_expand.run(ctx, Doc2QueryParams(), corpus=data["t5_corpus"], queries=refs["queries"],
                               qrels=refs["qrels"])
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
    doc2query_expand.run(ctx, {}, corpus=data["t5_corpus"], queries=refs["queries"], qrels=refs["qrels"])
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached"
    # at most one query per passage: another key, another corpus
    one = doc2query_expand.run(ctx, Doc2QueryParams(max_queries=1), corpus=data["t5_corpus"],
                               queries=refs["queries"], qrels=refs["qrels"])
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "computed" and one.id != out.id
    for doc, text, new in zip(corpus.column("doc_id").to_pylist(), corpus.column("text").to_pylist(),
                              one.table().column("text").to_pylist()):
        assert new == f"{text} {q_by_doc[doc][0]}"
    with pytest.raises(ValidationError, match="max_queries"):
        Doc2QueryParams(max_queries=0)


def test_doc2query_shards_give_the_same_corpus_as_one_shard(data):
    """doc2query_expand in shards of 3 passages (each reading the queries whole) gives the expanded corpus
    of one shard, byte for byte (all queries, and at most one per passage)."""
    _, gen = run_gq(data, "store-mf", ICTSource(source="ict", queries_per_passage=2, seed=3))
    corpus = data["refs"]["corpus"]
    for params in (Doc2QueryParams(), Doc2QueryParams(max_queries=1)):
        whole_ctx = Run(str(data["root"] / "store-d2q-whole"), "r", runtime=RUNTIME)
        whole = doc2query_expand.run(whole_ctx, params, corpus=corpus, queries=gen["queries"], qrels=gen["qrels"])
        ctx = Run(str(data["root"] / "store-d2q-sharded"), "r", runtime=sharded(3))
        out = doc2query_expand.run(ctx, params, corpus=corpus, queries=gen["queries"], qrels=gen["qrels"])
        assert len(last_shards(ctx)) == -(-corpus.num_rows() // 3) > 5 and len(last_shards(whole_ctx)) == 1
        assert out.id == whole.id
        expanded = out.table().column("text").to_pylist()
        assert sum(new != old for new, old in zip(expanded, corpus.table().column("text").to_pylist())) > 3
