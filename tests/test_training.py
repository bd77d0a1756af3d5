"""Losses, the training loop, the student trainer (Margin-MSE / MNRL) and the cross-encoder trainer, on
tiny models and a real SciFact slice. A few steps each: what is tested is behaviour (loss goes down,
resume is exact, the saved model loads, the runtime's device and precision reach the loop), not
quality."""

from __future__ import annotations

import json
import logging
import os
import re
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml
from pydantic import ValidationError

from irflow.dev.testing import SHARED_DATASETS
from irflow.engine import runtime as irt
from irflow.engine.errors import DataError, StageFailed
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig, StageRuntime
from irflow.learn import training
from irflow.learn.training import CHECKPOINT, BatchPlan, LoopParams, epoch_batches, train_loop
from irflow.stages.train_cross_encoder import TrainCrossEncoderParams, train_cross_encoder, training_pairs
from irflow.stages.train_student import TrainStudentParams, mnrl_examples, train_student

SCIFACT = SHARED_DATASETS / "scifact.zip"


# ---- losses ---------------------------------------------------------------------------------------
def _batch(seed=0, n=6, dim=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) * 3 for _ in range(3)] + [torch.randn(n, generator=g)]


def test_margin_mse_formula_and_similarity():
    from irflow.learn.losses import MarginMSELoss

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
    from irflow.learn.losses import MultipleNegativesRankingLoss

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
    a = epoch_batches(10, 3, seed=1, epoch=0)
    assert a == epoch_batches(10, 3, seed=1, epoch=0) and a != epoch_batches(10, 3, seed=1, epoch=1)
    assert len(a) == 3 and all(len(b) == 3 for b in a)  # drop_last
    keys = [frozenset({("q", i % 4)}) for i in range(12)]  # queries 0..3 each three times
    for b in epoch_batches(12, 4, seed=0, epoch=0, keys=keys):
        assert len({i % 4 for i in b}) == len(b)
    plan = BatchPlan(10, 3, seed=1)
    assert plan.total_steps(LoopParams(epochs=2)) == 6 and plan.total_steps(LoopParams(steps=5)) == 5
    assert plan.at(4) == epoch_batches(10, 3, 1, 1)[1] and plan.at(0) == a[0]


def test_training_params_are_validated():
    """Bad training settings fail when the params are built, naming the field; the old `bf16_autocast`
    key is gone (precision is the runtime's) and is rejected, never silently ignored."""
    with pytest.raises(ValidationError, match="similarity"):
        TrainStudentParams(similarity="cos_sim")  # GPL's spelling is not ours
    with pytest.raises(ValidationError, match="loss"):
        TrainStudentParams(loss="triplet")
    with pytest.raises(ValidationError, match="bf16_autocast"):
        TrainStudentParams(bf16_autocast=True)
    with pytest.raises(ValidationError, match="batch_size"):
        TrainStudentParams(batch_size=0)
    with pytest.raises(ValidationError, match="lr"):
        TrainCrossEncoderParams(lr=0)
    with pytest.raises(ValidationError, match="negatives_per_positive"):
        TrainCrossEncoderParams(negatives_per_positive=0)
    with pytest.raises(ValidationError, match="checkpoint_every"):
        LoopParams(checkpoint_every=-1)
    with pytest.raises(ValidationError, match="precision"):
        RuntimeConfig(precision="bf8")
    assert TrainStudentParams(steps=3).steps == 3 and TrainStudentParams().steps is None


# ---- precision: what `auto` picks, and that the runtime's precision reaches the loop -------------
def test_auto_precision_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(irt, "cpu_flags", lambda: frozenset({"sse4_2", "avx2", "avx512f"}))
    assert irt.resolve_precision("auto", "train", "cpu") == "fp32"
    warning = irt.precision_warning("bf16", "train", "cpu")
    assert warning and "bf16" in warning and "avx512_bf16" in warning
    plan = irt.resolved_plan(RuntimeConfig(device="cpu", precision="bf16"))
    assert plan["train"]["precision"] == "bf16" and plan["train"]["warning"]  # forced: honoured, with a warning
    assert irt.resolved_plan(RuntimeConfig(device="cpu"))["train"] == {"device": "cpu", "precision": "fp32",
                                                                       "warning": None}
    for flag in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(irt, "cpu_flags", lambda flag=flag: frozenset({"avx2", flag}))
        assert irt.resolve_precision("auto", "train", "cpu") == "bf16"
        assert irt.precision_warning("bf16", "train", "cpu") is None
        # inference stays fp32 under auto (its outputs are what other stages read)
        assert irt.resolve_precision("auto", "encode", "cpu") == "fp32"
        assert irt.resolve_precision("auto", "score", "cpu") == "fp32"
    assert irt.resolve_precision("fp32", "train", "cpu") == "fp32"  # a forced value is kept
    assert irt.stage_runtime(RuntimeConfig(device="cpu"), "train").precision == "bf16"
    assert irt.stage_runtime(RuntimeConfig(device="cpu"), "encode").precision == "fp32"


def test_bf16_native_is_bf16_only_where_the_cpu_has_it(monkeypatch):
    """The offline RocketQA configs score in `bf16-native`: bf16 on AVX-512 BF16 / AMX, fp32 on an
    AVX2-only CPU, where emulated bf16 scored 7x slower (a forced `bf16` is kept, with a warning)."""
    scoring = RuntimeConfig.model_validate({"device": "cpu", "precision": {"score": "bf16-native"}})
    monkeypatch.setattr(irt, "cpu_flags", lambda: frozenset({"sse4_2", "avx2"}))
    plan = irt.resolved_plan(scoring)
    assert plan["score"] == {"device": "cpu", "precision": "fp32", "warning": None}
    assert irt.stage_runtime(scoring, "score").precision == "fp32"
    monkeypatch.setattr(irt, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    plan = irt.resolved_plan(scoring)
    assert plan["score"]["precision"] == "bf16" and plan["score"]["warning"] is None
    assert plan["encode"]["precision"] == "fp32"  # the other kinds keep auto
    for config in ("rocketqa_scifact_offline.yaml", "rocketqa_nfcorpus_offline.yaml"):
        runtime = yaml.safe_load((Path(__file__).parents[1] / "configs" / config).read_text())["runtime"]
        assert RuntimeConfig.model_validate(runtime).precision.score == "bf16-native", config


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_train_loop_autocasts_at_the_runtimes_precision(precision, tmp_path):
    torch.manual_seed(0)
    model, x, y = _Tiny(), torch.randn(8, 4), torch.randn(8)
    seen = []

    def compute_loss(idx):
        out = model.lin(x[idx]).view(-1)
        seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return torch.nn.functional.mse_loss(out.float(), y[idx])

    rt = StageRuntime(device="cpu", precision=precision, resume_dir=tmp_path)
    history = train_loop(model, compute_loss, BatchPlan(8, 4, seed=0), LoopParams(steps=3, lr=1e-2), 0, rt, "t")
    assert len(history) == 3 and all(np.isfinite(h["loss"]) for h in history)
    expect = (True, torch.bfloat16) if precision == "bf16" else (False, torch.float32)
    assert seen == [expect] * 3


# ---- data -----------------------------------------------------------------------------------------
def _words(s):
    return {w for w in re.findall(r"[a-z0-9]+", s.lower()) if len(w) > 3}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from irflow.dev.testing import beir_slice, ingest_folder, make_tiny_bi_encoder, make_tiny_cross_encoder, model

    base = tmp_path_factory.mktemp("train")
    root = base / "store"
    run = Run(str(root), "run-1")
    sl = beir_slice(SCIFACT, base / "slice", n_test_queries=2, n_train_queries=10, n_extra_docs=30)
    beir = ingest_folder(run, sl)
    corpus = beir["corpus"].table()
    # BEIR's passage text, written out here rather than taken from irflow.learn.text
    docs = {d: f"{t or ''} {x or ''}".strip()
            for d, t, x in zip(*(corpus.column(c).to_pylist() for c in ("doc_id", "title", "text")))}
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
    store = run.store
    pub = lambda name, contract, t: store.publish_table(name, contract, t)[0]  # noqa: E731
    bi, ce = make_tiny_bi_encoder(base / "bi"), make_tiny_cross_encoder(base / "ce")
    return {"run": run, "base": base, "docs": docs, "queries_text": allq, "corpus": beir["corpus"],
            "bi": str(bi), "ce": str(ce), "bi_ref": model(run, bi), "ce_ref": model(run, ce),
            "queries": pub("queries", "queries", queries_t), "qrels": pub("qrels", "qrels", qrels_t),
            "negatives": pub("negatives", "negatives", neg_t), "pseudo_labels": pub("pl", "pseudo_labels", pl_t),
            "pl_t": pl_t}


def _student_params(**kw) -> TrainStudentParams:
    return TrainStudentParams(**{"loss": "margin_mse", "similarity": "dot", "batch_size": 4, "max_seq_length": 48,
                                 "lr": 1e-3, "warmup_steps": 2, "steps": 6, "seed": 11, "checkpoint_every": 3, **kw})


def _mm_inputs(env) -> dict:
    return dict(queries=env["queries"], corpus=env["corpus"], pseudo_labels=env["pseudo_labels"],
                base_model=env["bi_ref"])


def _weights(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").state_dict()


class _ForwardSpy:
    """Global forward hooks while installed: (autocast on?, output dtype) of every nn.Linear call, and
    the device of the weights of every module called (recorded before its forward runs)."""

    def __init__(self):
        self.seen: list[tuple[bool, torch.dtype]] = []
        self.devices: set[str] = set()

    def __enter__(self):
        def pre_hook(module, args):
            first = next(module.parameters(), None)
            if first is not None:
                self.devices.add(first.device.type)

        def hook(module, args, output):
            if isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
                self.seen.append((torch.is_autocast_enabled("cpu"), output.dtype))

        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
                         torch.nn.modules.module.register_module_forward_hook(hook)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


# ---- student --------------------------------------------------------------------------------------
def test_margin_mse_decreases_on_a_repeated_batch(env):
    from sentence_transformers import SentenceTransformer

    from irflow.learn.losses import MarginMSELoss
    from irflow.stages.train_student import _embed

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

    run = env["run"]
    inputs = _mm_inputs(env)
    outputs = train_student.run(run, _student_params(), tag="mm", **inputs)
    ref = outputs["student"]
    assert ref.kind == "model"
    m = SentenceTransformer(ref.path, device="cpu")
    emb = m.encode(["a query about cells", "another one"])
    assert emb.shape == (2, 32) and np.isfinite(emb).all()
    trained, base = m.state_dict(), _weights(env["bi"])
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # it did train
    log = json.loads((Path(ref.path) / "irflow_training.json").read_text())
    assert [h["step"] for h in log["history"]] == list(range(1, 7))
    assert not (Path(run.store_root) / "partial" / train_student.key(_student_params(), inputs)).exists()
    # the loss history is a dataset too: one row per step, the model's own log, lineage to its inputs
    losses = outputs["training_losses"]
    assert losses.contract == "training_losses"
    assert losses.table().to_pylist() == [dict(h, candidates=None) for h in log["history"]]
    me, *ancestors = run.catalog.lineage(losses.id)
    assert me["stage"] == "train_student[mm]" and me["cache_key"] == train_student.key(_student_params(), inputs)
    assert {(p["role"], p["dataset_id"]) for p in me["parents"]} >= {
        ("pseudo_labels", inputs["pseudo_labels"].id), ("base_model", inputs["base_model"].id)}
    assert inputs["pseudo_labels"].id in {a["dataset_id"] for a in ancestors}

    run2 = Run(run.store_root, "run-2")
    # a dict is validated into the same params: same key, same model, same losses dataset
    as_dict = _student_params().model_dump()
    again = train_student.run(run2, as_dict, tag="mm", **inputs)
    assert (again["student"].id, again["training_losses"].id) == (ref.id, losses.id)
    assert [s["status"] for s in run2.catalog.stage_runs("run-2")] == ["cached"]
    # the base model is an input: another base model is another key
    other = dict(inputs, base_model=env["ce_ref"])
    assert train_student.key(_student_params(), other) != train_student.key(_student_params(), inputs)


def test_listwise_examples_group_each_query_and_keep_the_margins(env):
    from irflow.stages.train_student import listwise_examples

    pl = env["pl_t"]
    ex = listwise_examples(pl)
    rows = pl.to_pylist()
    assert len(ex["q"]) == len({(r["query_id"], r["pos_doc_id"]) for r in rows}) == 12
    assert sum(len(n) for n in ex["negs"]) == len(rows)
    for q, p, negs, scores in zip(ex["q"], ex["p"], ex["negs"], ex["scores"]):
        mine = [r for r in rows if (r["query_id"], r["pos_doc_id"]) == (q, p)]
        assert negs == [r["neg_doc_id"] for r in mine] and len(scores) == 1 + len(negs)
        # the softmax over [pos, negs...] sees exactly the triples' margins
        for r, s in zip(mine, scores[1:]):
            assert scores[0] - s == pytest.approx(r["margin"], abs=1e-6)


def test_train_student_listwise_kl_trains_on_whole_lists(env):
    from sentence_transformers import SentenceTransformer

    run = env["run"]
    inputs = _mm_inputs(env)
    params = _student_params(loss="listwise_kl", similarity="cos", batch_size=3, steps=5)
    ref = train_student.run(run, params, tag="lw", **inputs)["student"]
    log = json.loads((Path(ref.path) / "irflow_training.json").read_text())
    # one example per query with its list (12 generated queries), not one per triple (24)
    assert (log["loss"], log["examples"], log["steps"]) == ("listwise_kl", 12, 5)
    assert all(np.isfinite(h["loss"]) and h["loss"] >= 0 for h in log["history"])
    trained, base = SentenceTransformer(ref.path, device="cpu").state_dict(), _weights(env["bi"])
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    assert train_student.key(params, inputs) != train_student.key(params.model_copy(update={"loss": "margin_mse"}),
                                                                 inputs)
    # the factor is keyed when set; at its default it is not in the key, so stores made before it existed
    # keep their students
    assert "listwise_scale" not in params.key_dump() and "listwise_scale" not in _student_params().key_dump()
    assert train_student.key(params.model_copy(update={"listwise_scale": 10.0}), inputs) != train_student.key(
        params, inputs)


def test_listwise_kl_decreases_on_a_repeated_list(env):
    from sentence_transformers import SentenceTransformer

    from irflow.learn.losses import ListwiseDistillationLoss
    from irflow.stages.train_student import _embed, listwise_examples

    torch.manual_seed(0)
    model = SentenceTransformer(env["bi"], device="cpu")
    model.max_seq_length = 48
    ex = listwise_examples(env["pl_t"])
    qt, dt = env["queries_text"], env["docs"]
    loss_fn = ListwiseDistillationLoss(similarity="cos", scale=20.0, temperature=1 / 20.0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(12):
        q = _embed(model, [qt[ex["q"][0]]], "cpu")
        cands = _embed(model, [dt[ex["p"][0]]] + [dt[d] for d in ex["negs"][0]], "cpu")
        loss = loss_fn.from_embeddings(q, cands.unsqueeze(0), torch.tensor([ex["scores"][0]]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_train_student_resumes_from_its_checkpoint(env, tmp_path, monkeypatch, caplog):
    from irflow.dev.testing import model

    # candidates_every 2: the students of steps 2, 4 and 6 are kept; step 2's before the crash, beside the checkpoint
    params = _student_params(steps=7, checkpoint_every=3, similarity="cos", candidates_every=2)

    def inputs_for(run):
        return dict(_mm_inputs(env), base_model=model(run, env["bi"]))

    # Reference: uninterrupted, in its own store.
    run_a = Run(str(tmp_path / "a"), "r")
    full = train_student.run(run_a, params, **inputs_for(run_a))
    ref_full = full["student"]

    crash_run = Run(str(tmp_path / "b"), "r1")
    inputs = inputs_for(crash_run)
    seen = []

    def crash_after_4(step):
        seen.append(step)
        if step == 4:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(training, "_on_step", crash_after_4)
    with pytest.raises(StageFailed, match="simulated crash") as e:
        train_student.run(crash_run, params, **inputs)
    assert isinstance(e.value.cause, RuntimeError) and e.value.stage == "train_student"
    partial = Path(crash_run.store_root) / "partial" / train_student.key(params, inputs)
    assert (partial / CHECKPOINT).exists()
    assert sorted(p.name for p in (partial / "checkpoints").iterdir()) == ["step-2", "step-4"]

    seen.clear()
    monkeypatch.setattr(training, "_on_step", lambda step: seen.append(step))
    with caplog.at_level(logging.INFO, logger="irflow.train"):
        resumed = train_student.run(Run(str(tmp_path / "b"), "r2"), params, **inputs)
    ref_resumed = resumed["student"]
    assert "resuming from step 3" in caplog.text
    assert seen == [4, 5, 6, 7]  # steps 1-3 were not redone
    # ...yet the resumed training's losses are the whole history: steps 1-3 from the checkpoint
    a, b = (o["training_losses"].table().to_pydict() for o in (full, resumed))
    assert b["step"] == a["step"] == list(range(1, 8))
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    assert b["lr"] == a["lr"]
    for sub in ("", "checkpoints/step-2", "checkpoints/step-4", "checkpoints/step-6"):
        a, b = _weights(Path(ref_full.path) / sub), _weights(Path(ref_resumed.path) / sub)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert sorted(p.name for p in (Path(ref_resumed.path) / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    assert not partial.exists()


def test_train_student_mnrl_with_hard_negatives(env, tmp_path):
    from sentence_transformers import SentenceTransformer

    ex = mnrl_examples(env["qrels"].table(), env["negatives"].table(), sorted(env["docs"]), "generated", 11)
    assert len(ex["q"]) == 12 and all(n != p for p, n in zip(ex["p"], ex["n"]))
    with pytest.raises(DataError, match="no positive qrels in split 'nope'"):
        mnrl_examples(env["qrels"].table(), None, sorted(env["docs"]), "nope", 11)
    params = _student_params(loss="mnrl", similarity="cos", steps=3, checkpoint_every=0)
    # bf16 autocast (what the old `bf16_autocast: true` asked for) now comes from the runtime
    run = Run(env["run"].store_root, "run-mnrl", runtime=RuntimeConfig(device="cpu", precision="bf16"))
    ref = train_student.run(run, params, tag="mnrl", queries=env["queries"], corpus=env["corpus"],
                            qrels=env["qrels"], negatives=env["negatives"], base_model=env["bi_ref"])["student"]
    assert SentenceTransformer(ref.path, device="cpu").encode(["x"]).shape == (1, 32)
    [row] = run.catalog.stage_runs("run-mnrl")
    assert row["name"] == "train_student[mnrl]" and row["runtime"]["precision"] == "bf16"
    history = json.loads((Path(ref.path) / "irflow_training.json").read_text())["history"]
    assert len(history) == 3 and all(np.isfinite(h["loss"]) for h in history)

    rt = StageRuntime(workdir=tmp_path)
    with pytest.raises(ValueError, match="pseudo_labels"):
        train_student.fn(_student_params(), rt, queries=env["queries"], corpus=env["corpus"],
                         base_model=env["bi_ref"])
    with pytest.raises(ValueError, match="qrels"):
        train_student.fn(params, rt, queries=env["queries"], corpus=env["corpus"], base_model=env["bi_ref"])
    with pytest.raises(TypeError, match="base_model"):  # the base model is a required input now
        train_student.run(env["run"], params, queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"])


def test_runtime_precision_reaches_student_training(env, tmp_path):
    """Through the runner: runtime.precision.train = bf16 makes the model's forward passes inside the
    loop run under bf16 autocast (bf16 activations); fp32 does not autocast. Encoding precision is
    another setting and does not leak into training."""
    from irflow.dev.testing import model

    params = _student_params(steps=1, checkpoint_every=0)
    out = {}
    for precision in ({"default": "fp32", "train": "bf16"}, {"default": "bf16", "train": "fp32"}):
        run = Run(str(tmp_path / precision["train"]), "r", runtime=RuntimeConfig(device="cpu", precision=precision))
        with _ForwardSpy() as spy:
            train_student.run(run, params, **dict(_mm_inputs(env), base_model=model(run, env["bi"])))
        out[precision["train"]] = set(spy.seen)
        assert spy.devices == {"cpu"}
        [row] = run.catalog.stage_runs("r")
        assert row["runtime"]["precision"] == precision["train"]
    assert out["bf16"] == {(True, torch.bfloat16)}
    assert out["fp32"] == {(False, torch.float32)}


def test_recomputed_activations_train_the_same_weights_and_the_model_is_released(env, tmp_path, monkeypatch):
    """runtime.recompute_activations (activation checkpointing, on by default) recomputes each layer in
    the backward pass -- the layers' Linear forwards run again -- and ends with the very weights of a
    run that keeps every activation, dropout and bf16 autocast included. Once the stage is done, nothing
    holds the trained model (its memory can be given back)."""
    import weakref

    from irflow.dev.testing import model

    trained = []
    checkpoint_activations = training.checkpoint_activations

    def spy(m, on):
        trained.append(weakref.ref(m))
        checkpoint_activations(m, on)

    monkeypatch.setattr(training, "checkpoint_activations", spy)
    params = _student_params(steps=2, checkpoint_every=0)
    weights, calls = {}, {}
    for recompute in (False, True):
        run = Run(str(tmp_path / str(recompute)), "r", runtime=RuntimeConfig(
            device="cpu", precision={"train": "bf16"}, recompute_activations=recompute))
        with _ForwardSpy() as fwd:
            ref = train_student.run(run, params, **dict(_mm_inputs(env), base_model=model(run, env["bi"])))["student"]
        calls[recompute] = len(fwd.seen)
        weights[recompute] = _weights(ref.path)
        [row] = run.catalog.stage_runs("r")
        assert row["runtime"]["recompute_activations"] is recompute
        assert trained and all(r() is None for r in trained)
    assert calls[True] > calls[False]
    assert weights[True].keys() == weights[False].keys()
    assert all(torch.equal(weights[True][k], weights[False][k]) for k in weights[False])


def test_checkpoint_activations_also_on_transformers_without_the_activation_names():
    """transformers 5.17 (a lent H100's image) names it gradient_checkpointing_enable / is_gradient_checkpointing
    only; irflow's training stopped there with AttributeError before the fallback. A model with the old
    names alone gets them called."""
    from transformers import BertConfig, BertModel

    class OldNames(BertModel):
        def __getattribute__(self, name):
            if "activation_checkpointing" in name:  # what 5.17 lacks
                raise AttributeError(name)
            return super().__getattribute__(name)

        def gradient_checkpointing_enable(self, **kw):
            self.calls.append("enable")
            self.flag = True

        def gradient_checkpointing_disable(self):
            self.calls.append("disable")
            self.flag = False

        @property
        def is_gradient_checkpointing(self):
            return self.flag

    m = OldNames(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32))
    m.calls, m.flag = [], False
    training.checkpoint_activations(m, False)  # off and not on: nothing to do
    training.checkpoint_activations(m, True)
    training.checkpoint_activations(m, False)
    assert m.calls == ["enable", "disable"]


# ---- cross-encoder --------------------------------------------------------------------------------
def _ce_params(**kw) -> TrainCrossEncoderParams:
    return TrainCrossEncoderParams(**{"split": "train", "negatives_per_positive": 1, "batch_size": 8,
                                      "max_length": 48, "lr": 3e-3, "warmup_steps": 2, "steps": 60, "seed": 5,
                                      "checkpoint_every": 0, **kw})


def _bce_on_pairs(model_path, env, ex):
    from irflow.learn.scoring import cross_encoder_scores

    pairs = [(env["queries_text"][q], env["docs"][d]) for q, d in zip(ex["q"], ex["d"])]
    logits = torch.from_numpy(cross_encoder_scores(model_path, pairs, batch_size=16, max_length=48,
                                                   show_progress=False))
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(ex["label"])).item()


def test_train_cross_encoder_learns_and_loads(env):
    from transformers import AutoModelForSequenceClassification

    params = _ce_params()
    qrels = env["qrels"].table()
    ex = training_pairs(qrels, sorted(env["docs"]), params, env["negatives"].table())
    cols = (qrels.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))
    judged = {(q, d) for q, d, s in zip(*cols) if s > 0}
    assert sum(ex["label"]) > 0
    assert all(((q, d) in judged) == (lab == 1.0) for q, d, lab in zip(ex["q"], ex["d"], ex["label"]))
    with pytest.raises(DataError, match="no positive qrels in split 'dev'"):
        training_pairs(qrels, sorted(env["docs"]), _ce_params(split="dev"))
    before = _bce_on_pairs(env["ce"], env, ex)
    outputs = train_cross_encoder.run(env["run"], params, queries=env["queries"], corpus=env["corpus"],
                                      qrels=env["qrels"], negatives=env["negatives"], base_model=env["ce_ref"])
    ref = outputs["cross_encoder"]
    after = _bce_on_pairs(ref.path, env, ex)
    assert after < 0.8 * before, (before, after)
    # its loss per step is a dataset: the model's own log, one row per step
    log = json.loads((Path(ref.path) / "irflow_training.json").read_text())
    losses = outputs["training_losses"].table()
    assert losses.column("step").to_pylist() == list(range(1, 61))
    assert losses.to_pylist() == [dict(h, candidates=None) for h in log["history"]]
    m = AutoModelForSequenceClassification.from_pretrained(ref.path)
    assert m.config.num_labels == 1


def test_listwise_cross_encoder_learns_to_put_each_positive_above_its_own_negatives(env, tmp_path):
    """loss: listwise groups each positive with the negatives drawn for it and lowers the softmax
    cross-entropy of those groups (LCE); batch_size still counts pairs; bce stays out of the key."""
    from irflow.learn.losses import LocalizedContrastiveLoss
    from irflow.learn.scoring import cross_encoder_scores
    from irflow.stages.train_cross_encoder import pair_groups

    params = _ce_params(loss="listwise", negatives_per_positive=3, batch_size=8, steps=40)
    assert params.examples_per_step() == 2  # groups of 4 pairs
    ex = training_pairs(env["qrels"].table(), sorted(env["docs"]), params, env["negatives"].table())
    groups = pair_groups(ex)
    assert len(groups) == int(sum(ex["label"])) and all(len(g) == 4 for g in groups)
    for g in groups:
        assert [ex["label"][i] for i in g] == [1.0, 0.0, 0.0, 0.0] and len({ex["q"][i] for i in g}) == 1

    def group_loss(model_path) -> float:
        pairs = [(env["queries_text"][ex["q"][i]], env["docs"][ex["d"][i]]) for g in groups for i in g]
        logits = torch.from_numpy(cross_encoder_scores(model_path, pairs, batch_size=16, max_length=48,
                                                       show_progress=False)).view(len(groups), 4)
        return LocalizedContrastiveLoss()(logits).item()

    before = group_loss(env["ce"])
    out = train_cross_encoder.fn(params, StageRuntime(workdir=tmp_path), queries=env["queries"], corpus=env["corpus"],
                                 qrels=env["qrels"], negatives=env["negatives"], base_model=env["ce_ref"])
    after = group_loss(out["cross_encoder"])
    assert after < 0.8 * before, (before, after)
    assert out["training_losses"].column("step").to_pylist() == list(range(1, 41))
    assert "loss" not in _ce_params().key_dump() and params.key_dump()["loss"] == "listwise"
    with pytest.raises(ValueError, match="cannot hold one listwise group"):
        _ce_params(loss="listwise", negatives_per_positive=8, batch_size=8)


def test_localized_contrastive_loss_is_the_positive_s_softmax_cross_entropy_in_its_group():
    from irflow.learn.losses import LocalizedContrastiveLoss

    logits = torch.tensor([[2.0, 1.0, 0.0], [0.5, 3.0, float("-inf")]])
    want = (-torch.log_softmax(torch.tensor([2.0, 1.0, 0.0]), 0)[0]
            - torch.log_softmax(torch.tensor([0.5, 3.0]), 0)[0]) / 2  # a padded slot takes no probability
    assert abs(LocalizedContrastiveLoss()(logits).item() - want.item()) < 1e-6
    # only differences within a group count: shifting a group's logits changes nothing
    shifted = logits + torch.tensor([[5.0], [-2.0]])
    assert abs(LocalizedContrastiveLoss()(shifted).item() - want.item()) < 1e-5


def test_cross_encoder_positives_per_query_caps_each_query(env):
    """positives_per_query keeps a seeded sample of each query's positives, each still with its
    negatives_per_positive negatives (never judged); left at its default it stays out of the cache key."""
    from irflow.learn.qrels import judged_positives, positives

    qrels = env["qrels"].table()
    docs = sorted(env["docs"])
    every = training_pairs(qrels, docs, _ce_params())
    by_query = positives(qrels, "train")
    assert max(len(ds) for ds in by_query.values()) > 1  # the slice has queries with several positives
    p = _ce_params(positives_per_query=1)
    ex = training_pairs(qrels, docs, p)
    pos = [(q, d) for q, d, lab in zip(ex["q"], ex["d"], ex["label"]) if lab == 1.0]
    assert sorted(q for q, _ in pos) == sorted(by_query)  # every query once
    assert set(pos) <= {(q, d) for q, d, lab in zip(every["q"], every["d"], every["label"]) if lab == 1.0}
    judged = judged_positives(qrels)
    negs = [(q, d) for q, d, lab in zip(ex["q"], ex["d"], ex["label"]) if lab == 0.0]
    assert len(negs) == p.negatives_per_positive * len(pos) and not any(d in judged[q] for q, d in negs)
    assert training_pairs(qrels, docs, p)["d"] == ex["d"]  # seeded
    assert training_pairs(qrels, docs, p.model_copy(update={"seed": 1}))["d"] != ex["d"]
    assert "positives_per_query" not in _ce_params().key_dump()
    assert p.key_dump()["positives_per_query"] == 1


def test_train_cross_encoder_from_a_bi_encoder_and_resume(env, tmp_path, monkeypatch, caplog):
    """A sentence-transformers dir (plain BERT, no head) gets a fresh head; random corpus negatives;
    a crash after step 3 resumes from the step-2 checkpoint to the same weights."""
    from transformers import AutoModelForSequenceClassification

    from irflow.dev.testing import model

    params = _ce_params(max_length=64, lr=1e-3, warmup_steps=1, steps=4, checkpoint_every=2)

    def inputs_for(run):
        return dict(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"], base_model=model(run, env["bi"]))

    run_a = Run(str(tmp_path / "a"), "r")
    with caplog.at_level(logging.INFO, logger="irflow.train"):
        full = train_cross_encoder.run(run_a, params, **inputs_for(run_a))["cross_encoder"]
    assert "has no relevance head; a fresh one is trained at lr 0.001" in caplog.text  # and head_lr is unset
    caplog.clear()

    def crash(step):
        if step == 3:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(training, "_on_step", crash)
    crash_run = Run(str(tmp_path / "b"), "r1")
    with pytest.raises(StageFailed, match="simulated crash"):
        train_cross_encoder.run(crash_run, params, **inputs_for(crash_run))
    monkeypatch.setattr(training, "_on_step", lambda step: None)
    resume_run = Run(str(tmp_path / "b"), "r2")
    with caplog.at_level(logging.INFO, logger="irflow.train"):
        resumed = train_cross_encoder.run(resume_run, params, **inputs_for(resume_run))["cross_encoder"]
    assert "resuming from step 2" in caplog.text
    a = AutoModelForSequenceClassification.from_pretrained(full.path).state_dict()
    b = AutoModelForSequenceClassification.from_pretrained(resumed.path).state_dict()
    assert a.keys() == b.keys() and a["classifier.weight"].shape == (1, 32)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_head_lr_is_the_rate_of_the_parameters_outside_the_pretrained_body(env, tmp_path, caplog):
    """A fresh 1-logit head moves by about lr per AdamW step: at a body's lr (3e-5) it barely leaves its
    initialisation in a few hundred steps (the offline M_C learnt only the label prior). ``head_lr``
    gives the classifier its own rate; the body keeps ``lr``."""
    from transformers import AutoModelForSequenceClassification

    m = AutoModelForSequenceClassification.from_pretrained(env["ce"])
    lr_of = {id(p): g["lr"] for g in training.make_optimizer(m, 1e-5, 0.01, head_lr=1e-3).param_groups
             for p in g["params"]}
    assert len(lr_of) == len(list(m.parameters()))
    for name, p in m.named_parameters():
        assert lr_of[id(p)] == (1e-3 if name.startswith("classifier.") else 1e-5), name
    assert {g["lr"] for g in training.make_optimizer(m, 1e-5, 0.01).param_groups} == {1e-5}

    base = m.state_dict()
    inputs = dict(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"], base_model=env["ce_ref"])

    def moved(**kw) -> tuple[float, float]:
        """(largest change of a body weight, of a head weight) after 3 steps at a negligible body lr."""
        out = train_cross_encoder.fn(_ce_params(steps=3, warmup_steps=0, lr=1e-9, weight_decay=0, **kw),
                                     StageRuntime(workdir=tmp_path / str(kw)), **inputs)["cross_encoder"]
        after = AutoModelForSequenceClassification.from_pretrained(out).state_dict()
        delta = {k: (after[k].float() - base[k].float()).abs().max().item() for k in base}
        return (max(v for k, v in delta.items() if not k.startswith("classifier.")),
                max(v for k, v in delta.items() if k.startswith("classifier.")))

    with caplog.at_level(logging.INFO, logger="irflow.train"):
        body, head = moved(head_lr=1e-2)
    assert "no relevance head" not in caplog.text  # the tiny cross-encoder has one

    assert body < 1e-6 and head > 1e-2, (body, head)
    body, head = moved()
    assert body < 1e-6 and head < 1e-6, (body, head)


def test_runtime_precision_reaches_cross_encoder_training(env, tmp_path):
    inputs = dict(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"], base_model=env["ce_ref"])
    params = _ce_params(steps=1)
    for precision, expect in (("bf16", {(True, torch.bfloat16)}), ("fp32", {(False, torch.float32)})):
        with _ForwardSpy() as spy:
            out = train_cross_encoder.fn(params, StageRuntime(precision=precision, workdir=tmp_path / precision),
                                         **inputs)["cross_encoder"]
        assert (out / "config.json").exists()
        assert set(spy.seen) == expect, precision


# ---- device ---------------------------------------------------------------------------------------
def test_runtime_device_reaches_every_training_model_load(env, tmp_path):
    """A "meta" device cannot compute anything: a training stage given one fails once its model is on it,
    which proves that runtime.device is what the model loads use (the same calls on the CPU are the
    tests above). The spy also sees that every forward pass ran with weights on the meta device."""
    meta = StageRuntime(device="meta", workdir=tmp_path)
    calls = [
        lambda: train_student.fn(_student_params(steps=1), meta, **_mm_inputs(env)),
        lambda: train_student.fn(_student_params(loss="mnrl", similarity="cos", steps=1), meta,
                                 queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"],
                                 base_model=env["bi_ref"]),
        lambda: train_cross_encoder.fn(_ce_params(steps=1), meta, queries=env["queries"], corpus=env["corpus"],
                                       qrels=env["qrels"], base_model=env["ce_ref"]),
    ]
    for call in calls:
        with _ForwardSpy() as spy, pytest.raises(Exception, match="meta"):
            call()
        assert spy.devices == {"meta"}
    # through the runner: both are "train" work, and the config's train device reaches them
    run = Run(env["run"].store_root, "run-meta", runtime=RuntimeConfig(device={"default": "cpu", "train": "meta"}))
    with pytest.raises(StageFailed, match="meta") as e:
        train_student.run(run, _student_params(steps=1, seed=99), tag="meta", **_mm_inputs(env))
    assert e.value.stage == "train_student[meta]"
    with pytest.raises(StageFailed, match="meta") as e:
        train_cross_encoder.run(run, _ce_params(steps=1, seed=99), tag="meta", queries=env["queries"],
                                corpus=env["corpus"], qrels=env["qrels"], base_model=env["ce_ref"])
    assert e.value.stage == "train_cross_encoder[meta]"


# ---- several processes (runtime.train_processes) --------------------------------------------------
def _model(outputs: dict):
    """The model among a trainer stage's outputs (the other one is its training_losses)."""
    return next(ref for ref in outputs.values() if ref.kind == "model")


def _two_process_equivalence(stage, params, inputs_for, tmp_path, base_path, load):
    """``stage`` with train_processes 1 and 2 (gloo on the CPU, fp32): one cache key, the same loss curve
    and the same weights; the second run in the first store is a cache hit."""
    runs, refs, keys = {}, {}, {}
    for n in (1, 2):
        runs[n] = Run(str(tmp_path / f"p{n}"), "r", runtime=RuntimeConfig(device="cpu", precision="fp32",
                                                                         train_processes=n))
        inputs = inputs_for(runs[n])
        keys[n] = stage.key(params, inputs)
        refs[n] = _model(stage.run(runs[n], params, **inputs))
    assert keys[1] == keys[2]  # runtime is never keyed
    [row] = runs[2].catalog.stage_runs("r")
    assert row["runtime"]["train_processes"] == 2
    log1, log2 = (json.loads((Path(refs[n].path) / "irflow_training.json").read_text()) for n in (1, 2))
    assert (log1["processes"], log2["processes"]) == (1, 2)
    assert [h["step"] for h in log2["history"]] == [h["step"] for h in log1["history"]] == [1, 2, 3]
    # the history holds the whole batch's loss, not rank 0's share
    np.testing.assert_allclose([h["loss"] for h in log2["history"]], [h["loss"] for h in log1["history"]],
                               rtol=1e-5)
    base, a, b = load(base_path), load(refs[1].path), load(refs[2].path)
    assert a.keys() == b.keys()
    assert max(float((a[k] - base[k]).abs().max()) for k in a) > 1e-3  # it trained
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    again = Run(str(tmp_path / "p1"), "again", runtime=RuntimeConfig(device="cpu", train_processes=2))
    assert _model(stage.run(again, params, **inputs_for(again))).id == refs[1].id
    assert [s["status"] for s in again.catalog.stage_runs("again")] == ["cached"]


def test_cross_encoder_on_two_processes_takes_the_steps_of_one(env, tmp_path):
    """2 torchrun processes of 4 pairs each train like 1 process with batches of 8; 3 processes cannot
    split a batch of 8 and are refused naming the key."""
    from transformers import AutoModelForSequenceClassification

    from irflow.dev.testing import make_tiny_cross_encoder, model

    ce = make_tiny_cross_encoder(tmp_path / "ce", dropout=0.0)  # dropout masks differ with the batch layout
    params = _ce_params(steps=3, warmup_steps=1, checkpoint_every=0)

    def inputs_for(run):
        return dict(queries=env["queries"], corpus=env["corpus"], qrels=env["qrels"], negatives=env["negatives"],
                    base_model=model(run, ce))

    _two_process_equivalence(train_cross_encoder, params, inputs_for, tmp_path, ce,
                             lambda path: AutoModelForSequenceClassification.from_pretrained(path).state_dict())
    with pytest.raises(ValueError, match=r"runtime.train_processes: 3 processes cannot split a batch of 8"):
        train_cross_encoder.fn(params, StageRuntime(train_processes=3, workdir=tmp_path / "w3"),
                               **inputs_for(env["run"]))


def test_student_on_two_processes_takes_the_steps_of_one(env, tmp_path):
    """GPL's Margin-MSE student: 2 torchrun processes of 4 examples each train like 1 process with
    batches of 8; 3 processes cannot split a batch of 8 and are refused naming the key."""
    from irflow.dev.testing import make_tiny_bi_encoder, model

    bi = make_tiny_bi_encoder(tmp_path / "bi", dropout=0.0)
    params = _student_params(batch_size=8, steps=3, warmup_steps=1, checkpoint_every=0)

    def inputs_for(run):
        return dict(_mm_inputs(env), base_model=model(run, bi))

    _two_process_equivalence(train_student, params, inputs_for, tmp_path, bi, _weights)
    with pytest.raises(ValueError, match=r"runtime.train_processes: 3 processes cannot split a batch of 8"):
        train_student.fn(params, StageRuntime(train_processes=3, workdir=tmp_path / "w3"),
                         **inputs_for(env["run"]))


def test_a_process_computes_its_weighted_share_of_each_batch(monkeypatch, tmp_path):
    """Shares are contiguous and partition the batch; weighted by rows * processes / batch, their mean
    losses average to the whole batch's mean loss, also when the batch does not split evenly. In the
    loop, process 1 of 2 computes the loss of the second half of every batch."""
    from irflow.engine import distributed

    torch.manual_seed(0)
    errors = torch.randn(7)
    shares = [distributed.share_of(list(range(7)), r, 2) for r in range(2)]
    assert [s for s, _ in shares] == [[0, 1, 2, 3], [4, 5, 6]]
    mean_of_shares = sum(w * float(errors[s].pow(2).mean()) for s, w in shares) / 2
    assert mean_of_shares == pytest.approx(float(errors.pow(2).mean()), rel=1e-6)
    assert distributed.share_of([3, 1], 0, 1) == ([3, 1], 1.0)
    with pytest.raises(ValueError, match="runtime.train_processes: 3 processes, but a batch has 2 rows"):
        distributed.share_of([3, 1], 0, 3)

    monkeypatch.setattr(distributed, "rank_and_world", lambda: (1, 2))
    monkeypatch.setattr(distributed, "average_gradients", lambda model, world: None)
    monkeypatch.setattr(distributed, "mean_over_processes", lambda value, world: float(value))
    seen = []

    def compute_loss(idx):
        seen.append(idx)
        return model.lin(torch.ones(len(idx), 4)).pow(2).mean()

    model, plan = _Tiny(), BatchPlan(16, 8, seed=0)
    train_loop(model, compute_loss, plan, LoopParams(steps=3, checkpoint_every=1), 0,
               StageRuntime(resume_dir=tmp_path), "t")
    assert seen == [plan.at(s)[4:] for s in range(3)]
    assert not (tmp_path / CHECKPOINT).exists()  # rank 0 writes the checkpoints


def test_a_checkpoint_resumes_on_another_number_of_processes(env, tmp_path):
    """Rank 0 of a 2-process student run writes the step-2 checkpoint; a 1-process run resumes from it,
    and so does a 2-process run (both processes read it): each ends with the weights of the
    uninterrupted run."""
    from irflow.dev.testing import make_tiny_bi_encoder, model

    bi = make_tiny_bi_encoder(tmp_path / "bi", dropout=0.0)
    params = _student_params(batch_size=8, steps=3, warmup_steps=1, checkpoint_every=2)
    inputs = dict(_mm_inputs(env), base_model=model(env["run"], bi))
    resume = tmp_path / "resume"
    resume.mkdir()

    def fn(processes: int, name: str) -> tuple[dict, list]:
        (tmp_path / name).mkdir()  # the runner makes both dirs
        out = train_student.fn(params, StageRuntime(train_processes=processes, workdir=tmp_path / name,
                                                    resume_dir=resume), **inputs)["student"]
        return _weights(out), json.loads((out / "irflow_training.json").read_text())["history"]

    uninterrupted, _ = fn(2, "first")
    state = torch.load(resume / CHECKPOINT, weights_only=True)
    assert state["step"] == 2
    # marks the checkpoint's history: a run that resumed from it reports these losses for steps 1-2
    state["history"] = [dict(h, loss=-1.0) for h in state["history"]]
    torch.save(state, resume / CHECKPOINT)
    for processes in (1, 2):
        weights, history = fn(processes, f"resumed{processes}")
        assert [h["loss"] for h in history][:2] == [-1.0, -1.0], processes
        for k in uninterrupted:
            torch.testing.assert_close(weights[k], uninterrupted[k], rtol=1e-4, atol=1e-5)



def test_a_training_process_killed_by_a_signal_gets_one_more_try_and_a_python_error_none(tmp_path):
    """A process that dies of SIGABRT (a gloo abort was seen once in CI) costs one more torchrun with a
    fresh process group; a second abort, or a Python error at the first, fails with the whole output
    kept beside the job."""
    from irflow.dev.testing import abort_or_raise
    from irflow.engine import distributed

    def attempts(**job) -> int:
        log = tmp_path / "attempts"
        log.unlink(missing_ok=True)
        try:
            distributed.run(abort_or_raise, {"attempts": str(log), "marker": str(tmp_path / "marker"), **job},
                            StageRuntime(workdir=tmp_path), 2)
        finally:
            n = len(log.read_text().splitlines())
        return n

    assert attempts(abort="once") == 2
    assert distributed._killing_signal((tmp_path / "torchrun.failed.log").read_text()) == 6
    with pytest.raises(RuntimeError, match=r"torchrun with 2 processes failed \(rc 1; its whole output: "):
        attempts(abort="always")
    assert distributed._killing_signal((tmp_path / "torchrun.log").read_text()) == 6
    with pytest.raises(RuntimeError, match=r"(?s)failed.*ValueError: a Python error in rank 1"):
        attempts(**{"raise": True})
    assert len((tmp_path / "attempts").read_text().splitlines()) == 1  # no second try


def test_an_abort_counts_even_when_torchrun_names_the_peer_that_saw_it_as_the_root_cause():
    """CI once saw rank 0 exit 1 (its socket closed) before torchrun noticed rank 1's abort."""
    from irflow.engine.distributed import _killing_signal

    peer_first = ("Fatal Python error: Aborted\n\nCurrent thread 0x00007f (most recent call first):\n"
                  "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
                  "  exitcode  : 1 (pid: 12)\n")
    assert _killing_signal(peer_first) == 6
    python_error = ("ValueError: a Python error in rank 1\nFailures:\n[1]:\n  exitcode  : -15 (pid: 11)\n"
                    "Root Cause (first observed failure):\n[0]:\n  exitcode  : 1 (pid: 12)\n")
    assert _killing_signal(python_error) is None  # torchrun stopping the other rank is not a crash
    assert _killing_signal("failed (exitcode: -11) local_rank: 1 (pid: 3)") == 11


def test_recompute_activations_auto_turns_on_only_when_a_step_would_not_fit(env, monkeypatch):
    """auto: off for a batch whose activations take a small share of the free memory, on past half of it;
    the reason gives the estimate. The choice is runtime, never keyed (the weights are the same)."""
    from sentence_transformers import SentenceTransformer

    from irflow.engine.runtime import StageRuntime

    m = SentenceTransformer(str(env["bi"]), device="cpu")
    m.max_seq_length = 200
    rt = StageRuntime(precision="bf16")
    monkeypatch.setattr(training, "available_memory", lambda device: 8 * 2**30)
    on, why = training.recompute_needed(m, rt, 48, "cpu")  # GPL's batch of 16: query, positive, negative
    assert not on and "48 sequences of up to 200 tokens" in why and "of the 8.0 GiB free" in why
    monkeypatch.setattr(training, "available_memory", lambda device: 2**20)
    on, why = training.recompute_needed(m, rt, 48, "cpu")
    assert on and "more than 50%" in why
    assert RuntimeConfig().recompute_activations == "auto"
    assert RuntimeConfig(recompute_activations=True).recompute_activations is True


def test_a_cpu_training_maps_its_largest_blocks_apart_from_the_heap():
    """steady_heap: inside, a 20 MiB block (a step's attention scores) gets a mapping of its own; outside, at
    glibc's threshold after large blocks were freed (32 MiB), it comes from the heap, which it fragments."""
    import subprocess
    import sys

    code = """
import ctypes
import numpy as np
from irflow.engine.processes import HEAP_MMAP_THRESHOLD, M_MMAP_THRESHOLD, steady_heap
ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)

def in_heap(a):
    addr = a.__array_interface__["data"][0]
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False

outside = np.ones(20 * 2**20, dtype=np.uint8)
print(in_heap(outside))
del outside
with steady_heap("cpu"):
    inside = np.ones(20 * 2**20, dtype=np.uint8)
    print(in_heap(inside))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_a_paced_training_reports_its_steps_as_progress(tmp_path, monkeypatch):
    """train_loop reports each step done to the pace of the stage computing in its thread: a training four
    times slower than its estimate is said at its third step of twenty (counted from the first, a warm-up), long
    before it outlasts the estimate."""
    from irflow.engine import pace

    model, x, y = _Tiny(), torch.randn(8, 4), torch.randn(8)
    clock = {"now": 1000.0}
    p = pace.Pace({"train_student[gpl]": 100.0}, started=1000.0)
    p.stage_started("train_student[gpl]", now=1000.0)
    said = []

    def compute_loss(idx):
        clock["now"] += 20.0  # a step estimated at 5 s takes 20
        return torch.nn.functional.mse_loss(model.lin(x[idx]).view(-1), y[idx])

    pace._PACES["r"] = p
    monkeypatch.setattr(pace, "time", types.SimpleNamespace(time=lambda: clock["now"]))  # the pace's clock
    real_check = pace.Pace.check
    try:
        pace.Pace.check = lambda self, now=None: said.append(real_check(self, clock["now"])) or said[-1]
        with pace.computing("r", "train_student[gpl]"):
            train_loop(model, compute_loss, BatchPlan(8, 4, seed=0), LoopParams(steps=20, lr=1e-2), 0,
                       StageRuntime(device="cpu", precision="fp32"), "t", show_progress=False)
    finally:
        pace.Pace.check = real_check
        pace._PACES.pop("r", None)
    first = next(i for i, m in enumerate(said) if m)
    assert first == 2 and "4.0x slower" in said[first]  # 10 s covered after the first step (steps 2-3: 40 s)
    assert all(m is None for m in said[first + 1:])  # said once
