"""Losses, the student trainer (Margin-MSE / MNRL) and the cross-encoder trainer, on tiny models and a
real SciFact slice. A few steps each: what is tested is behaviour (loss goes down, resume is exact,
the saved model loads), not quality."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pyarrow as pa
import pytest

from irflow.testing import SHARED_DATASETS
import torch

from irflow.stage import RunContext
from irflow.store import Store

SCIFACT = SHARED_DATASETS / "scifact.zip"


# ---- losses ---------------------------------------------------------------------------------------
def _batch(seed=0, n=6, dim=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) * 3 for _ in range(3)] + [torch.randn(n, generator=g)]


def test_margin_mse_formula_and_similarity():
    from irflow.losses import MarginMSELoss

    q, p, n, labels = _batch()
    dot = MarginMSELoss(similarity="dot").from_embeddings(q, p, n, labels)
    cos = MarginMSELoss(similarity="cos").from_embeddings(q, p, n, labels)
    expect_dot = (((q * p).sum(1) - (q * n).sum(1) - labels) ** 2).mean()
    cs = torch.nn.functional.cosine_similarity
    expect_cos = ((cs(q, p) - cs(q, n) - labels) ** 2).mean()
    assert dot.item() == pytest.approx(expect_dot.item(), rel=1e-5)
    assert cos.item() == pytest.approx(expect_cos.item(), rel=1e-5)
    assert abs(dot.item() - cos.item()) > 1e-3  # the similarity is honoured (GPL's script ignores it)
    with pytest.raises(ValueError):
        MarginMSELoss(similarity="cos_sim")


def test_mnrl_formula_scale_and_hard_negatives():
    from irflow.losses import MultipleNegativesRankingLoss

    q, p, n, _ = _batch(1)
    assert MultipleNegativesRankingLoss(similarity="cos").scale == 20.0
    assert MultipleNegativesRankingLoss(similarity="dot").scale == 1.0
    loss = MultipleNegativesRankingLoss(similarity="cos").from_embeddings(q, p)
    qn, pn = torch.nn.functional.normalize(q, dim=1), torch.nn.functional.normalize(p, dim=1)
    expect = torch.nn.functional.cross_entropy(20 * qn @ pn.T, torch.arange(len(q)))
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5)
    with_hard = MultipleNegativesRankingLoss(similarity="cos").from_embeddings(q, p, n)
    assert with_hard.item() > loss.item()  # more candidates in the softmax
    aligned = MultipleNegativesRankingLoss(similarity="cos").from_embeddings(p, p)
    assert aligned.item() < loss.item()


def test_batches_are_seeded_and_free_of_duplicates():
    from irflow.tasks.train_student import BatchPlan, epoch_batches

    a = epoch_batches(10, 3, seed=1, epoch=0)
    assert a == epoch_batches(10, 3, seed=1, epoch=0) and a != epoch_batches(10, 3, seed=1, epoch=1)
    assert len(a) == 3 and all(len(b) == 3 for b in a)  # drop_last
    keys = [frozenset({("q", i % 4)}) for i in range(12)]  # queries 0..3 each three times
    for b in epoch_batches(12, 4, seed=0, epoch=0, keys=keys):
        assert len({i % 4 for i in b}) == len(b)
    plan = BatchPlan(10, 3, seed=1)
    assert plan.total_steps({"epochs": 2}) == 6 and plan.total_steps({"steps": 5}) == 5
    assert plan.at(4) == epoch_batches(10, 3, 1, 1)[1] and plan.at(0) == a[0]


# ---- data -----------------------------------------------------------------------------------------
def _words(s):
    return {w for w in re.findall(r"[a-z0-9]+", s.lower()) if len(w) > 3}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    if not SCIFACT.exists():
        pytest.skip("needs the SciFact zip")
    from irflow.tasks.ingest import ingest_beir, ingest_config
    from irflow.tasks.pseudo_label import doc_text
    from irflow.testing import beir_slice, make_tiny_bi_encoder, make_tiny_cross_encoder

    base = tmp_path_factory.mktemp("train")
    root = base / "store"
    ctx = RunContext(str(root), "run-1")
    sl = beir_slice(SCIFACT, base / "slice", n_test_queries=2, n_train_queries=10, n_extra_docs=30)
    beir = ingest_beir.run(ctx, cfg=ingest_config({"source": str(sl)}, Path(root) / "downloads"))
    corpus = beir["corpus"].table()
    docs = {d: doc_text(t, x) for d, t, x in zip(*(corpus.column(c).to_pylist() for c in ("doc_id", "title", "text")))}
    src = sorted(docs)[:12]
    gen_q = {f"gq-{d}": " ".join(docs[d].split()[:10]) for d in src}
    real_q = beir["queries"].table()
    queries_t = pa.concat_tables([real_q, pa.table({"query_id": list(gen_q), "text": list(gen_q.values())})])
    qrels_t = pa.concat_tables([beir["qrels"].table(), pa.table({
        "query_id": list(gen_q), "doc_id": src, "score": pa.array([1] * len(src), pa.int32()),
        "split": ["generated"] * len(src)})])
    # Negatives: the word-overlap top-6 of every query (positives included: the stages must skip them).
    allq = dict(zip(queries_t.column("query_id").to_pylist(), queries_t.column("text").to_pylist()))
    dw = {d: _words(t) for d, t in docs.items()}
    neg = {"query_id": [], "doc_id": [], "miner": [], "rank": []}
    for q, text in allq.items():
        top = sorted(dw, key=lambda d: (-len(_words(text) & dw[d]), d))[:6]
        for r, d in enumerate(top, 1):
            neg["query_id"].append(q), neg["doc_id"].append(d), neg["miner"].append("lex"), neg["rank"].append(r)
    neg_t = pa.table({**neg, "rank": pa.array(neg["rank"], pa.int32())})
    # Pseudo labels: (generated query, source, a lexical negative) with a made-up teacher margin.
    rng = np.random.default_rng(0)
    pl = {"query_id": [], "pos_doc_id": [], "neg_doc_id": [], "pos_score": [], "neg_score": []}
    for q, d in zip(gen_q, src):
        for nd in [x for x in neg["doc_id"][neg["query_id"].index(q):][:6] if x != d][:2]:
            ps, ns = float(rng.normal(0.6, 0.1)), float(rng.normal(0.3, 0.1))
            pl["query_id"].append(q), pl["pos_doc_id"].append(d), pl["neg_doc_id"].append(nd)
            pl["pos_score"].append(ps), pl["neg_score"].append(ns)
    pl_t = pa.table({k: (pa.array(v, pa.float32()) if "score" in k else v) for k, v in pl.items()})
    pl_t = pl_t.append_column("margin", pa.compute.subtract(pl_t.column("pos_score"), pl_t.column("neg_score")))
    store = Store(root)
    pub = lambda name, contract, t: store.publish_table(name, contract, t)[0]  # noqa: E731
    return {"ctx": ctx, "base": base, "docs": docs, "queries_text": allq, "corpus": beir["corpus"],
            "bi": str(make_tiny_bi_encoder(base / "bi")), "ce": str(make_tiny_cross_encoder(base / "ce")),
            "queries": pub("queries", "queries", queries_t), "qrels": pub("qrels", "qrels", qrels_t),
            "negatives": pub("negatives", "negatives", neg_t), "pseudo_labels": pub("pl", "pseudo_labels", pl_t),
            "pl_t": pl_t}


def _student_cfg(env, **kw):
    return {"model": "tiny-bi", "model_key": "tiny-bi", "_model_path": env["bi"], "loss": "margin_mse",
            "similarity": "dot", "batch_size": 4, "max_seq_length": 48, "lr": 1e-3, "warmup_steps": 2, "steps": 6,
            "seed": 11, "checkpoint_every": 3, **kw}


def _weights(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").state_dict()


# ---- student --------------------------------------------------------------------------------------
def test_margin_mse_decreases_on_a_repeated_batch(env):
    from sentence_transformers import SentenceTransformer

    from irflow.losses import MarginMSELoss
    from irflow.tasks.train_student import _embed

    torch.manual_seed(0)
    model = SentenceTransformer(env["bi"], device="cpu")
    model.max_seq_length = 48
    rows = env["pl_t"].slice(0, 8).to_pylist()
    qt, dt = env["queries_text"], env["docs"]
    labels = torch.tensor([r["margin"] for r in rows])
    loss_fn = MarginMSELoss(similarity="cos")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(12):
        model.train()
        q = _embed(model, [qt[r["query_id"]] for r in rows], "cpu")
        p = _embed(model, [dt[r["pos_doc_id"]] for r in rows], "cpu")
        n = _embed(model, [dt[r["neg_doc_id"]] for r in rows], "cpu")
        loss = loss_fn.from_embeddings(q, p, n, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_train_student_margin_mse_saves_a_loadable_model_and_caches(env):
    from sentence_transformers import SentenceTransformer

    from irflow.tasks.train_student import train_student

    ctx = env["ctx"]
    inputs = dict(queries=env["queries"], corpus=env["corpus"], pseudo_labels=env["pseudo_labels"])
    ref = train_student.run(ctx, cfg=_student_cfg(env), label="mm", **inputs)
    assert ref.kind == "model"
    m = SentenceTransformer(ref.path, device="cpu")
    emb = m.encode(["a query about cells", "another one"])
    assert emb.shape == (2, 32) and np.isfinite(emb).all()
    trained, base = m.state_dict(), _weights(env["bi"])
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # it did train
    log = __import__("json").loads((Path(ref.path) / "irflow_training.json").read_text())
    assert [h["step"] for h in log["history"]] == list(range(1, 7))
    assert not (Path(ctx.store_root) / "partial" / train_student.key(_student_cfg(env), inputs)).exists()

    ctx2 = RunContext(ctx.store_root, "run-2")
    assert train_student.run(ctx2, cfg=_student_cfg(env), label="mm", **inputs).id == ref.id
    assert [s["status"] for s in ctx2.catalog.stage_runs("run-2")] == ["cached"]


def test_train_student_resumes_from_its_checkpoint(env, tmp_path, monkeypatch, caplog):
    from irflow.tasks import train_student as ts

    inputs = dict(queries=env["queries"], corpus=env["corpus"], pseudo_labels=env["pseudo_labels"])
    cfg = _student_cfg(env, steps=7, checkpoint_every=3, similarity="cos")
    # Reference: uninterrupted, in its own store.
    ref_full = ts.train_student.run(RunContext(str(tmp_path / "a"), "r"), cfg=cfg, **inputs)

    crash_ctx = RunContext(str(tmp_path / "b"), "r1")
    seen = []

    def crash_after_4(step):
        seen.append(step)
        if step == 4:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(ts, "_on_step", crash_after_4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ts.train_student.run(crash_ctx, cfg=cfg, **inputs)
    assert (Path(crash_ctx.store_root) / "partial" / ts.train_student.key(cfg, inputs) / ts.CHECKPOINT).exists()

    seen.clear()
    monkeypatch.setattr(ts, "_on_step", lambda step: seen.append(step))
    with caplog.at_level(logging.INFO, logger="irflow.train"):
        ref_resumed = ts.train_student.run(RunContext(str(tmp_path / "b"), "r2"), cfg=cfg, **inputs)
    assert "resuming from step 3" in caplog.text
    assert seen == [4, 5, 6, 7]  # steps 1-3 were not redone
    a, b = _weights(ref_full.path), _weights(ref_resumed.path)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert not (Path(crash_ctx.store_root) / "partial" / ts.train_student.key(cfg, inputs)).exists()


def test_train_student_mnrl_with_hard_negatives(env):
    from sentence_transformers import SentenceTransformer

    from irflow.tasks.train_student import mnrl_examples, train_student

    ex = mnrl_examples(env["qrels"].table(), env["negatives"].table(), sorted(env["docs"]), {"split": "generated"})
    assert len(ex["q"]) == 12 and all(n != p for p, n in zip(ex["p"], ex["n"]))
    cfg = _student_cfg(env, loss="mnrl", similarity="cos", steps=3, checkpoint_every=0, bf16_autocast=True)
    ref = train_student.run(env["ctx"], cfg=cfg, label="mnrl", queries=env["queries"], corpus=env["corpus"],
                            qrels=env["qrels"], negatives=env["negatives"])
    assert SentenceTransformer(ref.path, device="cpu").encode(["x"]).shape == (1, 32)
    with pytest.raises(ValueError, match="pseudo_labels"):
        train_student.fn(queries=env["queries"], corpus=env["corpus"], cfg=_student_cfg(env), workdir=Path("."),
                         resume_dir=None)


# ---- cross-encoder --------------------------------------------------------------------------------
def _bce_on_pairs(model_path, env, ex):
    from irflow.tasks.pseudo_label import cross_encoder_scores

    pairs = [(env["queries_text"][q], env["docs"][d]) for q, d in zip(ex["q"], ex["d"])]
    logits = torch.from_numpy(cross_encoder_scores(model_path, pairs, batch_size=16, max_length=48,
                                                   show_progress=False))
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(ex["label"])).item()


def test_train_cross_encoder_learns_and_loads(env):
    from transformers import AutoModelForSequenceClassification

    from irflow.tasks.train_cross_encoder import train_cross_encoder, training_pairs

    cfg = {"model": "tiny-ce", "model_key": "tiny-ce", "_model_path": env["ce"], "split": "train",
           "negatives_per_positive": 1, "batch_size": 8, "max_length": 48, "lr": 3e-3, "warmup_steps": 2,
           "steps": 60, "seed": 5, "checkpoint_every": 0}
    qrels = env["qrels"].table()
    ex = training_pairs(qrels, sorted(env["docs"]), cfg, env["negatives"].table())
    judged = {(q, d) for q, d, s in zip(*(qrels.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))) if s > 0}
    assert sum(ex["label"]) > 0 and all(((q, d) in judged) == (lab == 1.0) for q, d, lab in zip(ex["q"], ex["d"], ex["label"]))
    before = _bce_on_pairs(env["ce"], env, ex)
    ref = train_cross_encoder.run(env["ctx"], cfg=cfg, queries=env["queries"], corpus=env["corpus"],
                                  qrels=env["qrels"], negatives=env["negatives"])
    after = _bce_on_pairs(ref.path, env, ex)
    assert after < 0.8 * before, (before, after)
    m = AutoModelForSequenceClassification.from_pretrained(ref.path)
    assert m.config.num_labels == 1


def test_train_cross_encoder_from_a_bi_encoder_and_resume(env, tmp_path, monkeypatch, caplog):
    """A sentence-transformers dir (plain BERT, no head) gets a fresh head; random corpus negatives;
    a crash after step 3 resumes from the step-2 checkpoint to the same weights."""
    from transformers import AutoModelForSequenceClassification

    from irflow.tasks import train_student as ts
    from irflow.tasks.train_cross_encoder import train_cross_encoder

    cfg = {"model": "tiny-bi", "model_key": "tiny-bi", "_model_path": env["bi"], "split": "train",
           "negatives_per_positive": 1, "batch_size": 8, "max_length": 64, "lr": 1e-3, "warmup_steps": 1,
           "steps": 4, "seed": 5, "checkpoint_every": 2}
    inputs = dict(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"])
    full = train_cross_encoder.run(RunContext(str(tmp_path / "a"), "r"), cfg=cfg, **inputs)

    def crash(step):
        if step == 3:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(ts, "_on_step", crash)
    with pytest.raises(RuntimeError):
        train_cross_encoder.run(RunContext(str(tmp_path / "b"), "r1"), cfg=cfg, **inputs)
    monkeypatch.setattr(ts, "_on_step", lambda step: None)
    with caplog.at_level(logging.INFO, logger="irflow.train"):
        resumed = train_cross_encoder.run(RunContext(str(tmp_path / "b"), "r2"), cfg=cfg, **inputs)
    assert "resuming from step 2" in caplog.text
    a = AutoModelForSequenceClassification.from_pretrained(full.path).state_dict()
    b = AutoModelForSequenceClassification.from_pretrained(resumed.path).state_dict()
    assert a.keys() == b.keys() and a["classifier.weight"].shape == (1, 32)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
