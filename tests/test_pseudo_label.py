"""GPL's labelling (label_scores, then pseudo_label): cross-encoder and fusion teachers, sampling, margin
scale, the teacher's scoring in shards -- on a real SciFact slice."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pydantic import ValidationError

from irflow.dev.testing import SHARED_DATASETS, lexical_run
from irflow.engine.errors import StageFailed
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig, StageRuntime
from irflow.learn.fusion import fuse_runs
from irflow.stages.fuse import FuseParams, fuse
from irflow.stages.pseudo_label import (
    AutoScale,
    CrossEncoderTeacher,
    FusionTeacher,
    LabelParams,
    LabelScoresParams,
    PseudoLabelParams,
    build_triples,
    fusion_scores,
    label_positives,
    label_scores,
    pseudo_label,
    to_table,
)

SCIFACT = SHARED_DATASETS / "scifact.zip"


# ---- fixtures: a real slice, generated queries, two miners ----------------------------------------
def dense_run(model_path: str, queries: dict, docs: dict, system: str, top_k: int) -> pa.Table:
    from sentence_transformers import SentenceTransformer

    m = SentenceTransformer(model_path, device="cpu")
    qids, dids = list(queries), list(docs)
    qe = m.encode([queries[q] for q in qids], normalize_embeddings=True, show_progress_bar=False)
    de = m.encode([docs[d] for d in dids], normalize_embeddings=True, show_progress_bar=False)
    sims = qe @ de.T
    rows = {"query_id": [], "doc_id": [], "rank": [], "score": [], "system": []}
    for i, q in enumerate(qids):
        order = sorted(range(len(dids)), key=lambda j: (-sims[i, j], dids[j]))[:top_k]
        for r, j in enumerate(order, start=1):
            rows["query_id"].append(q), rows["doc_id"].append(dids[j]), rows["rank"].append(r)
            rows["score"].append(float(sims[i, j])), rows["system"].append(system)
    return pa.table({**rows, "rank": pa.array(rows["rank"], pa.int32()), "score": pa.array(rows["score"], pa.float32())})


def run_to_negatives(run: pa.Table, miner: str) -> pa.Table:
    return pa.table({"query_id": run.column("query_id"), "doc_id": run.column("doc_id"),
                     "miner": [miner] * run.num_rows, "rank": run.column("rank")})


def test_lengths_are_measured_a_chunk_at_a_time_with_the_lengths_and_scores_of_one_call(env, monkeypatch):
    """Scoring first measures every pair's token length. In one tokenizer call a fast tokenizer held every
    encoding until it returned (8.7 GB for 129,500 NFCorpus pairs); in chunks only one chunk's
    are held, and the lengths, so the batches and the scores, are those of one call."""
    from transformers import AutoTokenizer

    from irflow.learn import encoding
    from irflow.learn.scoring import cross_encoder_scores

    docs, queries = env["docs"], env["queries_text"]
    # whole passages (truncated) and 12-word ones (not): pairs of many lengths
    texts = [docs[d] for d in sorted(docs)[:3]] + [env["gen_q"][q] for q in sorted(env["gen_q"])[:3]]
    pairs = [(queries[q], t) for q in sorted(queries)[:5] for t in texts]
    kw = dict(batch_size=8, max_length=128, show_progress=False)
    whole = cross_encoder_scores(env["ce"], pairs, **kw)  # one chunk: LENGTH_CHUNK > 30 pairs
    tok = AutoTokenizer.from_pretrained(env["ce"])
    one_call = [len(i) for i in tok([q for q, _ in pairs], [d for _, d in pairs], truncation="longest_first",
                                    max_length=128)["input_ids"]]
    assert len(set(one_call)) > 3  # lengths differ: several length buckets

    sizes = []

    class Counting:  # the tokenizer, counting how many texts each call gets
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, texts, *args, **kwargs):
            sizes.append(len(texts))
            return self.inner(texts, *args, **kwargs)

    monkeypatch.setattr(encoding, "LENGTH_CHUNK", 7)
    counted = Counting(tok)
    assert encoding.token_lengths(counted, [q for q, _ in pairs], [d for _, d in pairs], max_length=128,
                                  truncation="longest_first") == one_call
    assert sizes == [7, 7, 7, 7, 2]
    texts = [d for _, d in pairs]
    assert encoding.token_lengths(tok, texts, max_length=128) == [len(i) for i in tok(texts, truncation=True,
                                                                                       max_length=128)["input_ids"]]
    assert cross_encoder_scores(env["ce"], pairs, **kw).tobytes() == whole.tobytes()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from irflow.dev.testing import beir_slice, ingest_folder, make_tiny_bi_encoder, make_tiny_cross_encoder, model

    base = tmp_path_factory.mktemp("pl")
    run = Run(str(base / "store"), "run-1")
    sl = beir_slice(SCIFACT, base / "slice", n_test_queries=4, n_train_queries=8, n_extra_docs=40)
    beir = ingest_folder(run, sl)
    corpus = beir["corpus"].table()
    # BEIR's passage text, written out here rather than taken from irflow.learn.text
    docs = {d: f"{t or ''} {x or ''}".strip()
            for d, t, x in zip(*(corpus.column(c).to_pylist() for c in ("doc_id", "title", "text")))}
    # Generated queries (cropping-style): the first words of 10 passages; the source is the positive.
    src = sorted(docs)[:10]
    gen_q = {f"gq-{d}": " ".join(corpus.filter(pc.equal(corpus.column("doc_id"), d)).column("text")[0]
                                 .as_py().split()[:12]) for d in src}
    real_q = beir["queries"].table()
    qrels_all = beir["qrels"].table()
    train_ids = set(qrels_all.filter(pc.equal(qrels_all.column("split"), "train")).column("query_id").to_pylist())
    train_q = {q: t for q, t in zip(real_q.column("query_id").to_pylist(), real_q.column("text").to_pylist())
               if q in train_ids}
    assert len(train_q) == 8
    all_q = {**gen_q, **train_q}
    queries_t = pa.table({"query_id": list(all_q), "text": list(all_q.values())})
    qrels_t = pa.table({"query_id": list(gen_q), "doc_id": src, "score": pa.array([1] * len(src), pa.int32()),
                        "split": ["generated"] * len(src)})
    bi = str(make_tiny_bi_encoder(base / "bi"))
    ce = str(make_tiny_cross_encoder(base / "ce"))
    lex = lexical_run(all_q, docs, "lex", 12)
    den = dense_run(bi, all_q, docs, "dense", 12)
    # The miners' lists contain the positives too: the stage must drop them.
    negs_t = pa.concat_tables([run_to_negatives(lex, "lex"), run_to_negatives(den, "dense")])
    pub = lambda name, contract, t: run.store.publish_table(name, contract, t)[0]  # noqa: E731
    return {
        "run": run, "base": base, "docs": docs, "queries_text": all_q, "gen_q": gen_q, "train_q": train_q,
        "bi": bi, "ce": ce, "bi_ref": model(run, bi), "ce_ref": model(run, ce),
        "corpus": beir["corpus"], "queries": pub("queries", "queries", queries_t),
        "qrels": pub("qrels", "qrels", qrels_t), "negatives": pub("negatives", "negatives", negs_t),
        "lex_run": pub("run", "run", lex), "dense_run": pub("run", "run", den), "negs_t": negs_t,
    }


def _ce_params(**kw) -> dict:
    return {"teacher": {"type": "cross_encoder", "batch_size": 4, "max_length": 128},
            "positive": "qrels", "split": "generated", "negatives_per_positive": 3, "seed": 7, "scale": None, **kw}


def _qrels_inputs(env) -> dict:
    return dict(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"], negatives=env["negatives"])


def _label(run: Run, params: dict, tag: str | None = None, *, student=None, **inputs):
    """Both stages, as the GPL recipe calls them: the teacher's scores of the triples, then the labels."""
    p = LabelParams.model_validate(params)
    scores = label_scores.run(run, p.to(LabelScoresParams), tag=tag, **inputs)
    return pseudo_label.run(run, p.to(PseudoLabelParams), tag=tag, scores=scores, queries=inputs["queries"],
                            corpus=inputs["corpus"], student=student)


def _scores_params(params: dict) -> LabelScoresParams:
    return LabelParams.model_validate(params).to(LabelScoresParams)


def _label_params(params: dict) -> PseudoLabelParams:
    return LabelParams.model_validate(params).to(PseudoLabelParams)


def _direct_logits(model_path, pairs, max_length=128):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    out = []
    with torch.no_grad():
        for q, d in pairs:  # one at a time: no padding at all
            enc = tok(q, d, truncation=True, max_length=max_length, return_tensors="pt")
            out.append(float(model(**enc).logits[0, 0]))
    return np.array(out)


def _statuses(run: Run) -> list[str]:
    return [s["status"] for s in run.catalog.stage_runs(run.run_id)]


# ---- tests ----------------------------------------------------------------------------------------
def test_cross_encoder_scores_are_raw_logits(env):
    from irflow.learn.scoring import cross_encoder_scores

    docs = env["docs"]
    pairs = [(env["gen_q"][q], docs[d]) for q, d in zip(sorted(env["gen_q"]), sorted(docs)[5:11])]
    got = cross_encoder_scores(env["ce"], pairs, batch_size=3, max_length=128, show_progress=False)
    np.testing.assert_allclose(got, _direct_logits(env["ce"], pairs), atol=1e-5)
    assert np.ptp(got) > 0  # not squashed into one constant
    # max_length is honoured (the passages are longer than 16 tokens)
    short = cross_encoder_scores(env["ce"], pairs, batch_size=3, max_length=16, show_progress=False)
    np.testing.assert_allclose(short, _direct_logits(env["ce"], pairs, max_length=16), atol=1e-5)
    assert not np.allclose(short, got, atol=1e-4)


def test_a_pairs_score_does_not_depend_on_its_batch(env):
    """Scored alone, two at a time or all at once, every pair gets the same score bit for bit: what
    makes a sharded teacher publish the dataset one shard does (the batch's row count used to change
    the last bits: a matmul's kernels depend on its shape)."""
    from irflow.learn.scoring import cross_encoder_scores

    docs, queries = env["docs"], env["queries_text"]
    pairs = [(queries[q], docs[d]) for q in sorted(queries)[:6] for d in sorted(docs)[:5]]
    kw = dict(batch_size=8, max_length=128, show_progress=False)
    together = cross_encoder_scores(env["ce"], pairs, **kw)
    alone = np.concatenate([cross_encoder_scores(env["ce"], [pr], **kw) for pr in pairs])
    twos = np.concatenate([cross_encoder_scores(env["ce"], pairs[i:i + 2], **kw) for i in range(0, len(pairs), 2)])
    assert together.tobytes() == alone.tobytes() == twos.tobytes()


def test_cross_encoder_teacher_stage(env):
    run = env["run"]
    inputs = _qrels_inputs(env)
    ref = _label(run, _ce_params(), tag="ce", teacher=env["ce_ref"], **inputs)
    t = ref.table()
    assert t.num_rows > 0
    margin = t.column("margin").to_numpy()
    assert np.array_equal(margin, t.column("pos_score").to_numpy() - t.column("neg_score").to_numpy())

    rows = t.to_pylist()
    negs = env["negs_t"]
    pool = {}
    for q, d in zip(negs.column("query_id").to_pylist(), negs.column("doc_id").to_pylist()):
        pool.setdefault(q, set()).add(d)
    for r in rows:
        q = r["query_id"]
        assert r["pos_doc_id"] == q[len("gq-"):]  # the generated query's source passage
        assert r["neg_doc_id"] != r["pos_doc_id"]  # a positive is never a negative ...
        assert r["neg_doc_id"] in pool[q]  # ... and every negative comes from the miners
    per_q = {}
    for r in rows:
        per_q.setdefault(r["query_id"], []).append(r["neg_doc_id"])
    assert set(per_q) == set(env["gen_q"])
    for q, ns in per_q.items():
        assert len(ns) == len(set(ns)) == min(3, len(pool[q] - {q[len('gq-'):]}))

    # Teacher scores are the cross-encoder's raw logits for (query, title + " " + text), read to max_length.
    some = rows[:4]
    pairs = [(env["queries_text"][r["query_id"]], env["docs"][r["neg_doc_id"]]) for r in some]
    np.testing.assert_allclose([r["neg_score"] for r in some], _direct_logits(env["ce"], pairs), atol=1e-5)
    pos_pairs = [(env["queries_text"][r["query_id"]], env["docs"][r["pos_doc_id"]]) for r in some]
    np.testing.assert_allclose([r["pos_score"] for r in some], _direct_logits(env["ce"], pos_pairs), atol=1e-5)

    # Deterministic for a seed, different for another (sampling does not depend on the teacher).
    tabs = {k: v.table() for k, v in inputs.items()}
    fusion = {"type": "fusion"}

    def triples(**kw):
        p = LabelParams.model_validate(_ce_params(teacher=fusion, **kw))
        return build_triples(p, StageRuntime(), tabs["queries"], tabs["corpus"], qrels=tabs["qrels"],
                             negatives=tabs["negatives"], runs=[env["lex_run"].table()])["triples"]

    a, b, c = triples(), triples(), triples(seed=8)
    assert a == b == [(r["query_id"], r["pos_doc_id"], r["neg_doc_id"]) for r in rows]
    assert a != c
    # ... and on the order of the negatives table
    shuffled = tabs["negatives"].take(pa.array(np.random.default_rng(0).permutation(tabs["negatives"].num_rows)))
    p = LabelParams.model_validate(_ce_params(teacher=fusion))
    assert build_triples(p, StageRuntime(), tabs["queries"], tabs["corpus"], qrels=tabs["qrels"], negatives=shuffled,
                         runs=[env["lex_run"].table()])["triples"] == a

    # The second call is a cache hit: same dataset, nothing recomputed.
    run2 = Run(run.store_root, "run-2")
    assert _label(run2, _ce_params(), tag="ce", teacher=env["ce_ref"], **inputs).id == ref.id
    assert _statuses(run2) == ["cached", "cached"]
    # the teacher's max_length is part of what is computed (and keyed)
    shorter = _label(run2, _ce_params(teacher={"type": "cross_encoder", "batch_size": 4, "max_length": 16}),
                     tag="ce", teacher=env["ce_ref"], **inputs)
    assert shorter.id != ref.id and _statuses(run2) == ["cached", "cached", "computed", "computed"]


def test_teacher_inputs_are_checked(env):
    inputs = _qrels_inputs(env)
    with pytest.raises(ValueError, match="needs the teacher input"):
        label_scores.fn(_scores_params(_ce_params()), StageRuntime(), **inputs)
    with pytest.raises(ValueError, match="needs the teacher_rankings input"):
        label_scores.fn(_scores_params(_ce_params(teacher={"type": "fusion"})), StageRuntime(), **inputs)
    fused = label_scores.run(env["run"], _scores_params(_ce_params(teacher={"type": "fusion"})), tag="checked",
                             teacher_rankings=[env["lex_run"]], **inputs)
    with pytest.raises(ValueError, match="needs the student input"):
        pseudo_label.fn(_label_params(_ce_params(teacher={"type": "fusion"}, scale={"similarity": "cos"})),
                        StageRuntime(), scores=fused, queries=env["queries"], corpus=env["corpus"])
    with pytest.raises(ValueError, match="needs the qrels and negatives"):
        label_scores.fn(_scores_params(_ce_params()), StageRuntime(), queries=env["queries"], corpus=env["corpus"],
                        teacher=env["ce_ref"])
    # a split without positives is a user error, named (raised in a shard of label_scores: still the user's)
    with pytest.raises(StageFailed, match="no positive qrels in split 'train'") as e:
        _label(env["run"], _ce_params(split="train"), teacher=env["ce_ref"], **inputs)
    assert e.value.user_error and e.value.stage == "label_scores"
    # no triples at all (no negatives from the miners named): the scores are empty, the labels refuse them
    nobody = _ce_params(teacher={"type": "fusion"}, miners=["nobody"])
    empty = label_scores.run(env["run"], _scores_params(nobody), tag="nobody", teacher_rankings=[env["lex_run"]],
                             **inputs)
    assert empty.table().num_rows == 0
    with pytest.raises(StageFailed, match="no training triples could be built") as e:
        pseudo_label.run(env["run"], _label_params(nobody), tag="nobody", scores=empty, queries=env["queries"],
                         corpus=env["corpus"])
    assert e.value.user_error and e.value.stage == "pseudo_label[nobody]"


def test_pseudo_label_params_are_validated():
    p = LabelParams(teacher={"type": "fusion"})
    assert isinstance(p.teacher, FusionTeacher) and p.scale is None and p.negatives_per_positive == 1
    assert isinstance(LabelParams(teacher={"type": "cross_encoder"}).teacher, CrossEncoderTeacher)
    assert isinstance(LabelParams(teacher={"type": "fusion"}, scale={"similarity": "dot"}).scale, AutoScale)
    assert LabelParams(teacher={"type": "fusion"}, scale=0.5).scale == 0.5
    # each stage gets its own part: the teacher scores, the scale labels
    assert set(LabelScoresParams.model_fields) == set(LabelParams.model_fields) - {"scale", "scale_sample"}
    assert set(PseudoLabelParams.model_fields) == {"scale", "scale_sample", "seed"}
    with pytest.raises(ValidationError):
        PseudoLabelParams(teacher={"type": "fusion"})
    bad = [
        {"teacher": {"type": "bm25"}},
        {"teacher": {"type": "cross_encoder", "model": "x"}},  # the model is an input, not a param
        {"teacher": {"type": "cross_encoder", "max_length": 0}},
        {"teacher": {"type": "fusion", "method": "combmnz"}},
        {"teacher": {"type": "fusion"}, "positive": "bm25_top1"},
        {"teacher": {"type": "fusion"}, "rank_range": (1, 5)},  # rank 1 is the positive
        {"teacher": {"type": "fusion"}, "rank_range": (6, 5)},
        {"teacher": {"type": "fusion"}, "negatives_per_positive": 0},
        {"teacher": {"type": "fusion"}, "negatives_per_query": 2},  # the old name
        {"teacher": {"type": "fusion"}, "scale": "auto"},  # the recipe turns auto into AutoScale
        {"teacher": {"type": "fusion"}, "scale": {"similarity": "l2"}},
        {"teacher": {"type": "fusion"}, "split": ""},
        {"positive": "qrels"},  # no teacher
    ]
    for kw in bad:
        with pytest.raises(ValidationError):
            LabelParams(**kw)
    with pytest.raises(ValidationError, match="rank 1 is the positive"):
        LabelParams(teacher={"type": "fusion"}, rank_range=(1, 5))


def _run(system, q, docs_scores):
    return pa.table({"query_id": [q] * len(docs_scores), "doc_id": [d for d, _ in docs_scores],
                     "rank": pa.array(range(1, len(docs_scores) + 1), pa.int32()),
                     "score": pa.array([s for _, s in docs_scores], pa.float32()),
                     "system": [system] * len(docs_scores)})


def test_fusion_scores_by_hand():
    a = _run("bm25", "q1", [("d1", 3.0), ("d2", 2.0), ("d3", 1.0)])
    b = _run("dense", "q1", [("d2", 0.9), ("d4", 0.5)])
    za = (np.array([3.0, 2.0, 1.0]) - 2.0) / np.std([3.0, 2.0, 1.0])
    zb = (np.array([0.9, 0.5]) - 0.7) / np.std([0.9, 0.5])
    expect = {"d1": 0.3 * za[0] + 0.7 * zb.min(), "d2": 0.3 * za[1] + 0.7 * zb[0],
              "d3": 0.3 * za[2] + 0.7 * zb.min(), "d4": 0.3 * za.min() + 0.7 * zb[1]}
    weights = {"bm25": 0.3, "dense": 0.7}
    got = fuse_runs([a, b], method="zscore", weights=weights)
    got = dict(zip(got.column("doc_id").to_pylist(), got.column("score").to_pylist()))
    assert got.keys() == expect.keys()
    for d in expect:
        assert got[d] == pytest.approx(expect[d], abs=1e-6)
    # the teacher's scores, pair by pair, in the order asked
    order = ["d4", "d1", "d3", "d2"]
    teacher = fusion_scores([a, b], FusionTeacher(type="fusion", weights=weights), [("q1", d) for d in order])
    np.testing.assert_allclose(teacher, [expect[d] for d in order], atol=1e-6)

    mm = fuse_runs([a, b], method="minmax", weights={"bm25": 1.0, "dense": 1.0})
    mm = dict(zip(mm.column("doc_id").to_pylist(), mm.column("score").to_pylist()))
    assert mm == pytest.approx({"d1": 1.0, "d2": 0.5 + 1.0, "d3": 0.0, "d4": 0.0}, abs=1e-6)
    # null weights: equal, summing to 1
    eq = fusion_scores([a, b], FusionTeacher(type="fusion", method="minmax"), [("q1", "d2")])
    assert eq[0] == pytest.approx(0.5 * 0.5 + 0.5 * 1.0)

    # Only the pairs asked for; a pair no run has gets each run's minimum.
    pairs = pa.table({"query_id": ["q1"], "doc_id": ["dX"]})
    only = fuse_runs([a, b], weights=weights, pairs=pairs)
    assert only.num_rows == 1 and only.column("score")[0].as_py() == pytest.approx(0.3 * za.min() + 0.7 * zb.min())
    dx = fusion_scores([a, b], FusionTeacher(type="fusion", weights=weights), [("q1", "dX"), ("q1", "d2")])
    np.testing.assert_allclose(dx, [0.3 * za.min() + 0.7 * zb.min(), expect["d2"]], atol=1e-6)
    with pytest.raises(ValueError, match="no weight"):
        fuse_runs([a, b], weights={"bm25": 1.0})
    with pytest.raises(ValueError, match="no weight"):
        fusion_scores([a, b], FusionTeacher(type="fusion", weights={"bm25": 1.0}), [("q1", "d1")])
    with pytest.raises(ValueError, match="teacher_rankings"):
        fusion_scores([], FusionTeacher(type="fusion"), [("q1", "d1")])


def test_teacher_top1_on_unlabelled_queries(env):
    run = env["run"]
    weights = {"lex": 0.3, "dense": 0.7}
    params = {"teacher": {"type": "fusion", "method": "zscore", "weights": weights},
              "positive": "teacher_top1", "rank_range": [3, 6], "negatives_per_positive": 2, "seed": 1, "scale": None}
    runs = [env["lex_run"], env["dense_run"]]
    ref = _label(run, params, tag="top1", queries=env["queries"], corpus=env["corpus"], teacher_rankings=runs)
    t = ref.table()
    fused = fuse_runs([r.table() for r in runs], weights=weights)
    ranked = {}
    for q, d, s in zip(*(fused.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))):
        ranked.setdefault(q, []).append((-s, d))
    ranked = {q: [d for _, d in sorted(v)] for q, v in ranked.items()}
    rows = t.to_pylist()
    assert {r["query_id"] for r in rows} == set(env["queries_text"])  # real (unlabelled) and generated queries
    per_q = {}
    for r in rows:
        order = ranked[r["query_id"]]
        assert r["pos_doc_id"] == order[0]
        assert 3 <= order.index(r["neg_doc_id"]) + 1 <= 6
        assert r["margin"] > 0  # the negative ranks below the teacher's top-1
        per_q.setdefault(r["query_id"], set()).add(r["neg_doc_id"])
    assert all(len(ns) == 2 for ns in per_q.values())
    with pytest.raises(ValueError, match="reads no qrels"):
        label_scores.fn(_scores_params(params), StageRuntime(), queries=env["queries"], corpus=env["corpus"],
                        qrels=env["qrels"], teacher_rankings=runs)
    # label_positives: the teacher's (query, top-1) pairs as qrels of split "generated"
    qrels = label_positives.run(run, {}, pseudo_labels=ref).table()
    assert sorted(zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist())) == sorted(
        {(r["query_id"], r["pos_doc_id"]) for r in rows})
    assert set(qrels.column("split").to_pylist()) == {"generated"} and set(qrels.column("score").to_pylist()) == {1}


@pytest.mark.parametrize("method,depth", [("zscore", None), ("minmax", 8), ("rrf", None)])
def test_fuse_stage_and_fusion_teacher_give_identical_scores(env, method, depth):
    """One fusion implementation: the teacher's score of a (query, doc) is the fuse stage's score of it."""
    run = env["run"]
    weights = {"lex": 0.4, "dense": 0.6}
    runs = [env["lex_run"], env["dense_run"]]
    fused = fuse.run(run, FuseParams(method=method, input_depth=depth, weights=weights, system="teacher"),
                     tag=f"teacher-{method}", rankings=runs).table()
    score = {(q, d): s for q, d, s in zip(*(fused.column(c).to_pylist() for c in ("query_id", "doc_id", "score")))}
    top1 = {q: d for q, d, r in zip(*(fused.column(c).to_pylist() for c in ("query_id", "doc_id", "rank"))) if r == 1}
    teacher = {"type": "fusion", "method": method, "input_depth": depth, "weights": weights}
    labels = _label(run, {"teacher": teacher, "positive": "teacher_top1", "rank_range": [2, 12],
                          "negatives_per_positive": 6, "seed": 0},
                    tag=f"top1-{method}", queries=env["queries"], corpus=env["corpus"],
                    teacher_rankings=runs).table().to_pylist()
    assert {r["query_id"] for r in labels} == set(top1)
    for r in labels:
        q = r["query_id"]
        assert r["pos_doc_id"] == top1[q]
        assert r["pos_score"] == score[(q, r["pos_doc_id"])]  # float32, bit for bit
        assert r["neg_score"] == score[(q, r["neg_doc_id"])]
    # positive=qrels scores the same pairs the same way (the pairs the fused run holds)
    qlabels = _label(run, {"teacher": teacher, "negatives_per_positive": 4, "seed": 0},
                     tag=f"qrels-{method}", teacher_rankings=runs, **_qrels_inputs(env)).table().to_pylist()
    compared = 0
    for r in qlabels:
        for d, s in ((r["pos_doc_id"], r["pos_score"]), (r["neg_doc_id"], r["neg_score"])):
            if (r["query_id"], d) in score:
                assert s == score[(r["query_id"], d)]
                compared += 1
    assert compared >= len(qlabels)


def test_least_squares_scale():
    from irflow.learn.scoring import least_squares_scale

    t = np.array([1.0, -2.0, 3.0, 0.5])
    assert least_squares_scale(t, 0.07 * t) == pytest.approx(0.07)
    noisy = 0.07 * t + np.array([0.01, -0.02, 0.0, 0.01])
    assert least_squares_scale(t, noisy) == pytest.approx(float(t @ noisy / (t @ t)))
    assert least_squares_scale(t, -t) == pytest.approx(1.0)  # disagreement: RMS ratio, never negative
    assert least_squares_scale(np.zeros(3), np.ones(3)) == 1.0


def test_scale_auto_matches_student_units(env):
    from irflow.stages.pseudo_label import student_margins

    run = env["run"]
    inputs = dict(**_qrels_inputs(env), teacher_rankings=[env["lex_run"], env["dense_run"]])
    base = {"teacher": {"type": "fusion", "method": "zscore", "weights": {"lex": 0.2, "dense": 0.8}},
            "positive": "qrels", "negatives_per_positive": 4, "seed": 3}
    raw = _label(run, {**base, "scale": None}, tag="raw", **inputs).table()
    fixed = _label(run, {**base, "scale": 0.5}, tag="fixed", **inputs).table()
    np.testing.assert_allclose(fixed.column("margin").to_numpy(), 0.5 * raw.column("margin").to_numpy(), rtol=1e-5,
                               atol=1e-6)
    auto = _label(run, {**base, "scale": {"similarity": "cos"}}, tag="auto", student=env["bi_ref"],
                  **inputs).table()
    teacher = auto.column("margin").to_numpy().astype(np.float64)
    docs, qt = env["docs"], env["queries_text"]
    triples = [(qt[r["query_id"]], docs[r["pos_doc_id"]], docs[r["neg_doc_id"]]) for r in auto.to_pylist()]
    student = student_margins(env["bi"], "cos", triples)
    raw_m = raw.column("margin").to_numpy()
    # z-score units are far from the tiny student's cosine units; the scaled margins are not.
    ratio_raw, ratio_auto = np.std(raw_m) / np.std(student), np.std(teacher) / np.std(student)
    assert not 1 / 3 < ratio_raw < 3
    assert 1 / 3 < ratio_auto < 3, (ratio_raw, ratio_auto)
    assert np.corrcoef(teacher, student)[0, 1] > 0.3
    # every score is scaled by one factor, so margin == pos - neg still holds
    k = teacher / raw_m.astype(np.float64)
    np.testing.assert_allclose(k, k[0], rtol=1e-4)
    np.testing.assert_allclose(auto.column("pos_score").to_numpy(), k[0] * raw.column("pos_score").to_numpy(),
                               rtol=1e-4, atol=1e-6)


def test_runtime_device_reaches_every_model_load(env):
    """A "meta" device cannot compute anything: a stage given one fails wherever it loads a model, which
    proves that runtime.device is what every model load uses (teacher and student alike)."""
    inputs = _qrels_inputs(env)
    ce = _scores_params(_ce_params())
    fusion = _ce_params(teacher={"type": "fusion"}, scale={"similarity": "cos"})
    runs = [env["lex_run"], env["dense_run"]]
    scores = label_scores.run(env["run"], _scores_params(fusion), tag="fusion-meta", teacher_rankings=runs, **inputs)
    auto, texts = _label_params(fusion), dict(queries=env["queries"], corpus=env["corpus"])
    meta = StageRuntime(device="meta")
    with pytest.raises(Exception, match="meta"):
        label_scores.fn(ce, meta, teacher=env["ce_ref"], **inputs)
    with pytest.raises(Exception, match="meta"):  # the fusion teacher loads nothing; the student does
        pseudo_label.fn(auto, meta, scores=scores, student=env["bi_ref"], **texts)
    # the very same calls on the CPU work: the device is what failed them
    assert label_scores.fn(ce, StageRuntime(device="cpu"), teacher=env["ce_ref"], **inputs).num_rows > 0
    assert pseudo_label.fn(auto, StageRuntime(device="cpu"), scores=scores, student=env["bi_ref"], **texts).num_rows > 0
    # through the runner: both stages are "score" work, and the config's score device reaches them
    run = Run(env["run"].store_root, "run-meta", runtime=RuntimeConfig(device={"default": "cpu", "score": "meta"}))
    with pytest.raises(StageFailed, match="meta") as e:
        _label(run, _ce_params(seed=99), tag="meta", teacher=env["ce_ref"], **inputs)
    assert e.value.stage == "label_scores[meta]"
    with pytest.raises(StageFailed, match="meta") as e:
        pseudo_label.run(run, auto, tag="meta", scores=scores, student=env["bi_ref"], **texts)
    assert e.value.stage == "pseudo_label[meta]"


def test_teacher_max_length_default_is_written_once(monkeypatch):
    """The cross-encoder's max_length default lives in the stage's params; the GPL recipe inherits it
    (GPL reads 350 tokens), it does not restate it."""
    import irflow.recipes.gpl as gpl
    from irflow.api import load_config

    default = CrossEncoderTeacher.model_fields["max_length"].default
    assert default == 350
    assert LabelParams(teacher={"type": "cross_encoder"}).teacher.max_length == default
    assert "max_length" not in vars(gpl.CrossEncoderTeacherConfig).get("__annotations__", {})
    assert gpl.GPLConfig.model_fields["teacher"].default.max_length == default
    # a config that does not name it, through the recipe's own labelling step
    c = load_config({"flow": "gpl", "dataset": {"source": str(SCIFACT)},
                     "teacher": {"type": "cross_encoder", "model": "some/cross-encoder"}})
    assert c.teacher.max_length == default
    seen = []

    class FakeRun:
        def model(self, name, where):
            return f"<model {name}>"

    monkeypatch.setattr(gpl, "label_scores", lambda run, p, **inputs: seen.append((p, inputs)) or "scores")
    monkeypatch.setattr(gpl, "pseudo_label", lambda run, p, **inputs: seen.append((p, inputs)))
    gpl.labelling(FakeRun(), c, {"queries": "q", "qrels": "r"}, "negatives", ["m"], "student", "corpus")
    [(p, inputs), (labels, label_inputs)] = seen
    assert type(p) is LabelScoresParams and type(p.teacher) is CrossEncoderTeacher
    assert type(labels) is PseudoLabelParams and label_inputs["scores"] == "scores"
    assert p.teacher.max_length == default and inputs["teacher"] == "<model some/cross-encoder>"
    # the paper config agrees with the default
    paper = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpl_scifact.yaml")
    assert paper.teacher.max_length == default


# ---- the teacher's scoring in shards, the labels from its scores --------------------------------------
def _fusion_top1(**kw) -> dict:
    return {"teacher": {"type": "fusion", "method": "zscore", "weights": {"lex": 0.4, "dense": 0.6}},
            "positive": "teacher_top1", "rank_range": [2, 8], "negatives_per_positive": 2, "seed": 5, **kw}


@pytest.mark.parametrize("case", ["qrels-ce", "top1-fusion-auto"])
def test_label_scores_in_shards_give_the_labels_of_one_shard_and_of_the_whole_tables(env, case):
    """label_scores in shards of 3 queries (6 shards of the 18, some with no triple at all) publishes the
    dataset one shard does, and so do the labels; both equal the labelling of the whole tables at once
    (build_triples: what the single pseudo_label stage computed), rows and order included."""
    if case == "qrels-ce":
        params, student = _ce_params(), None
        inputs = {**_qrels_inputs(env), "teacher": env["ce_ref"]}
    else:  # the queries' table order (generated first) is not their id order: pseudo_label sorts
        params, student = _fusion_top1(scale={"similarity": "cos"}, scale_sample=7), env["bi_ref"]
        inputs = dict(queries=env["queries"], corpus=env["corpus"], negatives=env["negatives"],
                      teacher_rankings=[env["lex_run"], env["dense_run"]])
    # The same store, so that the inputs are the same refs; runtime is not keyed, so both are forced (one
    # shard of 100,000 rows, then shards of 3).
    store, forced = env["run"].store_root, {f"label_scores[{case}]"}
    whole_run = Run(store, f"whole-{case}", force=forced)
    whole = _label(whole_run, params, tag=case, student=student, **inputs)
    sharded_run = Run(store, f"sharded-{case}", runtime=RuntimeConfig(shard_rows=3), force=forced)
    sharded = _label(sharded_run, params, tag=case, student=student, **inputs)
    one, many = (run.catalog.stage_runs(run.run_id) for run in (whole_run, sharded_run))
    assert [len(s["shards"]) for s in one] == [1, 0] and [len(s["shards"]) for s in many] == [6, 0]
    assert [s["status"] for s in many] == ["computed", "computed"]
    assert [s["outputs"] for s in many] == [s["outputs"] for s in one]  # same scores id, same labels id
    assert sharded.id == whole.id

    # the labels are those of the whole tables labelled at once
    tabs = {k: v.table() for k, v in inputs.items() if k in ("queries", "corpus", "qrels", "negatives")}
    out = build_triples(LabelParams.model_validate(params), StageRuntime(), tabs["queries"], tabs["corpus"],
                        qrels=tabs.get("qrels"), negatives=tabs.get("negatives"),
                        runs=[r.table() for r in inputs.get("teacher_rankings", [])],
                        teacher_model=inputs.get("teacher"), student_model=student)
    labels = whole.table()
    assert labels.equals(to_table(out["triples"], out["pos_score"], out["neg_score"], out["scale"]))
    assert labels.column("query_id").to_pylist() == sorted(labels.column("query_id").to_pylist())
    if case == "top1-fusion-auto":
        assert out["scale"] != 1.0
        order = tabs["queries"].column("query_id").to_pylist()
        assert order != sorted(order)  # so the sort was needed
    else:
        # GPL's triples, written out here: per generated query (in id order) its source passage and
        # negatives_per_positive negatives sampled (seeded per query and positive) from the miners' lists
        from irflow.learn.sampling import sample

        negs, all_d = env["negs_t"], set(env["docs"])
        pools = {}
        for q, d in zip(negs.column("query_id").to_pylist(), negs.column("doc_id").to_pylist()):
            pools.setdefault(q, set()).add(d)
        expected = [(q, q[3:], n) for q in sorted(env["gen_q"])
                    for n in sample([d for d in pools[q] if d != q[3:] and d in all_d], 3, 7, q, q[3:])]
        assert list(zip(*(labels.column(c).to_pylist() for c in ("query_id", "pos_doc_id", "neg_doc_id")))) \
            == expected


def test_a_scale_change_relabels_without_rescoring(env):
    """What pseudo_label decides from the teacher's scores (the scale) recomputes alone: the teacher's
    scoring stays cached, and a scaled label is the raw one times the factor."""
    inputs = dict(queries=env["queries"], corpus=env["corpus"], negatives=env["negatives"],
                  teacher_rankings=[env["lex_run"], env["dense_run"]])
    store = env["run"].store_root
    raw = _label(Run(store, "scale-raw"), _fusion_top1(scale=None), tag="scale", **inputs)
    run = Run(store, "scale-half")
    half = _label(run, _fusion_top1(scale=0.5), tag="scale", **inputs)
    assert [(s["name"], s["status"]) for s in run.catalog.stage_runs(run.run_id)] == [
        ("label_scores[scale]", "cached"), ("pseudo_label[scale]", "computed")]
    np.testing.assert_allclose(half.table().column("margin").to_numpy(), 0.5 * raw.table().column("margin").to_numpy(),
                               rtol=1e-6)
    run = Run(store, "scale-sample")
    _label(run, _fusion_top1(scale={"similarity": "cos"}, scale_sample=5), tag="scale", student=env["bi_ref"], **inputs)
    assert _statuses(run) == ["cached", "computed"]
    # ... while a triples setting re-scores
    run = Run(store, "scale-seed")
    _label(run, _fusion_top1(scale=0.5, rank_range=[3, 8]), tag="scale", **inputs)
    assert _statuses(run) == ["computed", "computed"]


@pytest.mark.parametrize("shard_rows", [100_000, 5])
def test_what_a_computation_warned_about_is_recorded_with_its_dataset_and_said_again_when_reused(
        env, shard_rows, tmp_path, caplog, capsys):
    """Every query has 2 teacher candidates and negatives come from ranks 3-6, so label_scores skips each
    one and warns (once, or once per shard of 5 queries). The warnings are recorded with the dataset it
    published (the catalog, `irflow lineage`), and a later run that finds it cached says them again."""
    import logging

    from irflow import cli

    # a store of its own: sharded or not, the stage publishes the same dataset (one catalog row)
    run, tag = Run(str(tmp_path / "store"), "inputs"), "warns"
    lex = env["lex_run"].table()
    pub = lambda name, contract, t: run.store.publish_table(name, contract, t)[0]  # noqa: E731
    inputs = dict(queries=pub("queries", "queries", env["queries"].table()),
                  corpus=pub("corpus", "corpus", env["corpus"].table()),
                  teacher_rankings=[pub("run", "run", lex.filter(pc.less_equal(lex.column("rank"), 2)))])
    params = {"teacher": {"type": "fusion", "method": "zscore", "weights": {"lex": 1.0}},
              "positive": "teacher_top1", "rank_range": [3, 6], "negatives_per_positive": 2, "seed": 3}
    skipped = "label_scores: {} quer(ies) with fewer than 3 candidates skipped"
    expected = ([skipped.format(18)] if shard_rows > 18
                else [skipped.format(5), skipped.format(3)])  # shards of 5, 5, 5 and 3 queries

    first = Run(run.store_root, f"made-{tag}", runtime=RuntimeConfig(shard_rows=shard_rows))
    with caplog.at_level(logging.WARNING, logger="irflow"):
        scores = label_scores.run(first, _scores_params(params), tag=tag, **inputs)
    assert scores.num_rows() == 0 and _statuses(first) == ["computed"]
    # logged as they came: once per shard (the catalog keeps each distinct message once)
    assert [r.getMessage() for r in caplog.records] == (expected if shard_rows > 18
                                                        else 3 * [skipped.format(5)] + [skipped.format(3)])
    row = run.catalog.dataset(scores.id)
    assert json.loads(row["warnings"]) == expected

    assert cli.main(["lineage", scores.id[:12], "--store", str(run.store_root)]) == 0
    printed = capsys.readouterr().out
    assert all(f"warned: {m}" in printed for m in expected), printed

    caplog.clear()
    again = Run(run.store_root, f"reused-{tag}")
    with caplog.at_level(logging.WARNING, logger="irflow"):
        assert label_scores.run(again, _scores_params(params), tag=tag, **inputs).id == scores.id
    assert _statuses(again) == ["cached"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{m} (label_scores[{tag}]: cached, as computed by run made-{tag})" for m in expected]
