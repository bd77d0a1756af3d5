"""pseudo_label: cross-encoder and fusion teachers, sampling, margin scale -- on a real SciFact slice."""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pyarrow as pa
import pytest

from irflow.testing import SHARED_DATASETS

from irflow.stage import RunContext
from irflow.store import Store

SCIFACT = SHARED_DATASETS / "scifact.zip"


# ---- fixtures: a real slice, generated queries, two miners ----------------------------------------
def _words(s: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", s.lower()) if len(w) > 3}


def lexical_run(queries: dict, docs: dict, system: str, top_k: int) -> pa.Table:
    """A word-overlap ranking, standing in for BM25 (keeps the test free of the JVM)."""
    rows = {"query_id": [], "doc_id": [], "rank": [], "score": [], "system": []}
    dw = {d: _words(t) for d, t in docs.items()}
    for q, text in queries.items():
        qw = _words(text)
        scored = sorted(((len(qw & w) + 1e-3 * len(w) ** 0.5, d) for d, w in dw.items()), key=lambda x: (-x[0], x[1]))
        for r, (s, d) in enumerate(scored[:top_k], start=1):
            rows["query_id"].append(q), rows["doc_id"].append(d), rows["rank"].append(r)
            rows["score"].append(s), rows["system"].append(system)
    return pa.table({**rows, "rank": pa.array(rows["rank"], pa.int32()), "score": pa.array(rows["score"], pa.float32())})


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


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from irflow.tasks.ingest import ingest_beir, ingest_config
    from irflow.tasks.pseudo_label import doc_text
    from irflow.testing import beir_slice, make_tiny_bi_encoder, make_tiny_cross_encoder

    base = tmp_path_factory.mktemp("pl")
    root = base / "store"
    ctx = RunContext(str(root), "run-1")
    sl = beir_slice(SCIFACT, base / "slice", n_test_queries=4, n_train_queries=8, n_extra_docs=40)
    beir = ingest_beir.run(ctx, cfg=ingest_config({"source": str(sl)}, Path(root) / "downloads"))
    corpus = beir["corpus"].table()
    docs = {d: doc_text(t, x) for d, t, x in zip(*(corpus.column(c).to_pylist() for c in ("doc_id", "title", "text")))}
    # Generated queries (cropping-style): the first words of 10 passages; the source is the positive.
    src = sorted(docs)[:10]
    gen_q = {f"gq-{d}": " ".join(corpus.filter(pa.compute.equal(corpus.column("doc_id"), d)).column("text")[0]
                                 .as_py().split()[:12]) for d in src}
    real_q = beir["queries"].table()
    train_ids = set(beir["qrels"].table().filter(pa.compute.equal(beir["qrels"].table().column("split"), "train"))
                    .column("query_id").to_pylist())
    train_q = {q: t for q, t in zip(real_q.column("query_id").to_pylist(), real_q.column("text").to_pylist())
               if q in train_ids}
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
    store = Store(root)
    pub = lambda name, contract, t: store.publish_table(name, contract, t)[0]  # noqa: E731
    return {
        "ctx": ctx, "base": base, "docs": docs, "queries_text": all_q, "gen_q": gen_q, "train_q": train_q,
        "bi": bi, "ce": ce, "corpus": beir["corpus"], "queries": pub("queries", "queries", queries_t),
        "qrels": pub("qrels", "qrels", qrels_t), "negatives": pub("negatives", "negatives", negs_t),
        "lex_run": pub("run", "run", lex), "dense_run": pub("run", "run", den), "negs_t": negs_t,
    }


def _ce_cfg(env, **kw):
    return {"teacher": {"type": "cross_encoder", "model": "tiny-ce", "model_key": "tiny-ce",
                        "_model_path": env["ce"], "batch_size": 4, "max_length": 128},
            "positive": "qrels", "split": "generated", "negatives_per_query": 3, "seed": 7, "scale": None, **kw}


def _direct_logits(model_path, pairs):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    out = []
    with torch.no_grad():
        for q, d in pairs:  # one at a time: no padding at all
            enc = tok(q, d, truncation=True, max_length=128, return_tensors="pt")
            out.append(float(model(**enc).logits[0, 0]))
    return np.array(out)


# ---- tests ----------------------------------------------------------------------------------------
def test_cross_encoder_scores_are_raw_logits(env):
    from irflow.tasks.pseudo_label import cross_encoder_scores

    docs = env["docs"]
    pairs = [(env["gen_q"][q], docs[d]) for q, d in zip(sorted(env["gen_q"]), sorted(docs)[5:11])]
    got = cross_encoder_scores(env["ce"], pairs, batch_size=3, max_length=128, show_progress=False)
    np.testing.assert_allclose(got, _direct_logits(env["ce"], pairs), atol=1e-5)
    assert (got < 0).any() or (got > 1).any() or np.ptp(got) > 0  # not squashed into one constant


def test_cross_encoder_teacher_stage(env):
    from irflow.tasks.pseudo_label import build_triples, pseudo_label

    ctx = env["ctx"]
    inputs = dict(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"], negatives=env["negatives"])
    ref = pseudo_label.run(ctx, cfg=_ce_cfg(env), label="ce", **inputs)
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

    # Teacher scores are the cross-encoder's raw logits for (query, title + " " + text).
    some = rows[:4]
    direct = _direct_logits(env["ce"], [(env["queries_text"][r["query_id"]], env["docs"][r["neg_doc_id"]]) for r in some])
    np.testing.assert_allclose([r["neg_score"] for r in some], direct, atol=1e-5)

    # Deterministic for a seed, different for another.
    tabs = {k: v.table() for k, v in inputs.items()}
    a = build_triples(tabs["queries"], tabs["corpus"], {**_ce_cfg(env), "teacher": {"type": "fusion"}},
                      qrels=tabs["qrels"], negatives=tabs["negatives"], runs=[env["lex_run"].table()])
    b = build_triples(tabs["queries"], tabs["corpus"], {**_ce_cfg(env), "teacher": {"type": "fusion"}},
                      qrels=tabs["qrels"], negatives=tabs["negatives"], runs=[env["lex_run"].table()])
    c = build_triples(tabs["queries"], tabs["corpus"], {**_ce_cfg(env, seed=8), "teacher": {"type": "fusion"}},
                      qrels=tabs["qrels"], negatives=tabs["negatives"], runs=[env["lex_run"].table()])
    assert a["triples"] == b["triples"] == [(r["query_id"], r["pos_doc_id"], r["neg_doc_id"]) for r in rows]
    assert a["triples"] != c["triples"]

    # The second call is a cache hit: same dataset, nothing recomputed.
    ctx2 = RunContext(ctx.store_root, "run-2")
    assert pseudo_label.run(ctx2, cfg=_ce_cfg(env), label="ce", **inputs).id == ref.id
    assert [s["status"] for s in ctx2.catalog.stage_runs("run-2")] == ["cached"]


def test_fusion_scores_by_hand():
    from irflow.tasks.pseudo_label import fused_scores

    def run(system, q, docs_scores):
        return pa.table({"query_id": [q] * len(docs_scores), "doc_id": [d for d, _ in docs_scores],
                         "rank": pa.array(range(1, len(docs_scores) + 1), pa.int32()),
                         "score": pa.array([s for _, s in docs_scores], pa.float32()), "system": [system] * len(docs_scores)})

    a = run("bm25", "q1", [("d1", 3.0), ("d2", 2.0), ("d3", 1.0)])
    b = run("dense", "q1", [("d2", 0.9), ("d4", 0.5)])
    za = (np.array([3.0, 2.0, 1.0]) - 2.0) / np.std([3.0, 2.0, 1.0])
    zb = (np.array([0.9, 0.5]) - 0.7) / np.std([0.9, 0.5])
    expect = {"d1": 0.3 * za[0] + 0.7 * zb.min(), "d2": 0.3 * za[1] + 0.7 * zb[0],
              "d3": 0.3 * za[2] + 0.7 * zb.min(), "d4": 0.3 * za.min() + 0.7 * zb[1]}
    got = fused_scores([a, b], method="zscore", weights={"bm25": 0.3, "dense": 0.7})
    got = dict(zip(got.column("doc_id").to_pylist(), got.column("score").to_pylist()))
    assert got.keys() == expect.keys()
    for d in expect:
        assert got[d] == pytest.approx(expect[d], abs=1e-6)

    mm = fused_scores([a, b], method="minmax", weights=[1.0, 1.0])
    mm = dict(zip(mm.column("doc_id").to_pylist(), mm.column("score").to_pylist()))
    assert mm == pytest.approx({"d1": 1.0, "d2": 0.5 + 1.0, "d3": 0.0, "d4": 0.0}, abs=1e-6)

    # Only the pairs asked for; a pair no run has gets each run's minimum.
    pairs = pa.table({"query_id": ["q1"], "doc_id": ["dX"]})
    only = fused_scores([a, b], weights={"bm25": 0.3, "dense": 0.7}, pairs=pairs)
    assert only.num_rows == 1 and only.column("score")[0].as_py() == pytest.approx(0.3 * za.min() + 0.7 * zb.min())
    with pytest.raises(ValueError, match="no weight"):
        fused_scores([a, b], weights={"bm25": 1.0})


def test_teacher_top1_on_unlabelled_queries(env):
    from irflow.tasks.pseudo_label import fused_scores, pseudo_label

    ctx = env["ctx"]
    cfg = {"teacher": {"type": "fusion", "method": "zscore", "weights": {"lex": 0.3, "dense": 0.7}},
           "positive": "teacher_top1", "neg_rank_range": [3, 6], "negatives_per_query": 2, "seed": 1, "scale": None}
    runs = [env["lex_run"], env["dense_run"]]
    t = pseudo_label.run(ctx, cfg=cfg, label="top1", queries=env["queries"], corpus=env["corpus"],
                         teacher_runs=runs).table()
    fused = fused_scores([r.table() for r in runs], weights={"lex": 0.3, "dense": 0.7})
    ranked = {}
    for q, d, s in zip(*(fused.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))):
        ranked.setdefault(q, []).append((-s, d))
    ranked = {q: [d for _, d in sorted(v)] for q, v in ranked.items()}
    rows = t.to_pylist()
    assert {r["query_id"] for r in rows} == set(env["queries_text"])  # real (unlabelled) and generated queries
    for r in rows:
        order = ranked[r["query_id"]]
        assert r["pos_doc_id"] == order[0]
        assert 3 <= order.index(r["neg_doc_id"]) + 1 <= 6
        assert r["margin"] > 0  # the negative ranks below the teacher's top-1
    with pytest.raises(ValueError, match="reads no qrels"):
        pseudo_label.fn(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"], teacher_runs=runs, cfg=cfg)


def test_least_squares_scale():
    from irflow.tasks.pseudo_label import least_squares_scale

    t = np.array([1.0, -2.0, 3.0, 0.5])
    assert least_squares_scale(t, 0.07 * t) == pytest.approx(0.07)
    noisy = 0.07 * t + np.array([0.01, -0.02, 0.0, 0.01])
    assert least_squares_scale(t, noisy) == pytest.approx(float(t @ noisy / (t @ t)))
    assert least_squares_scale(t, -t) == pytest.approx(1.0)  # disagreement: RMS ratio, never negative


def test_scale_auto_matches_student_units(env):
    from irflow.tasks.pseudo_label import pseudo_label, student_margins

    ctx = env["ctx"]
    inputs = dict(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"], negatives=env["negatives"],
                  teacher_runs=[env["lex_run"], env["dense_run"]])
    base = {"teacher": {"type": "fusion", "method": "zscore", "weights": {"lex": 0.2, "dense": 0.8}},
            "positive": "qrels", "negatives_per_query": 4, "seed": 3}
    raw = pseudo_label.run(ctx, cfg={**base, "scale": None}, label="raw", **inputs).table()
    fixed = pseudo_label.run(ctx, cfg={**base, "scale": 0.5}, label="fixed", **inputs).table()
    np.testing.assert_allclose(fixed.column("margin").to_numpy(), 0.5 * raw.column("margin").to_numpy(), rtol=1e-5,
                               atol=1e-6)
    auto_cfg = {**base, "scale": "auto", "student": {"model_key": "tiny-bi", "_model_path": env["bi"],
                                                     "similarity": "cos"}}
    auto = pseudo_label.run(ctx, cfg=auto_cfg, label="auto", **inputs).table()
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
