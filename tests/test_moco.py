"""Contriever's MoCo (irflow.learn.moco) and the student's ``moco`` option: the key encoder is the EMA of the
query encoder, the queue is a FIFO of fixed size, the loss is InfoNCE over the batch's keys and the queue,
and the option trains end to end through train_student, keyed only when it runs."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyarrow as pa
import pytest
import torch
from pydantic import ValidationError

from irflow.engine.runner import Run
from irflow.engine.runtime import StageRuntime
from irflow.learn.moco import KeyQueue, MoCo, MoCoLoss, momentum_update
from irflow.learn.training import BatchPlan, LoopParams, train_loop
from irflow.stages.train_student import MoCoParams, TrainStudentParams, train_student

REPO = Path(__file__).resolve().parents[1]


# ---- the parts --------------------------------------------------------------------------------------
class _Toy(torch.nn.Module):
    """An encoder with the sentence-transformers call: features in, {"sentence_embedding"} out."""

    def __init__(self, dim=3):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, features):
        return {"sentence_embedding": self.lin(features["x"])}


def test_momentum_update_is_the_ema_of_the_query_encoder():
    torch.manual_seed(0)
    key, query = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    k0, q0 = key.weight.detach().clone(), query.weight.detach().clone()
    momentum_update(key, query, 0.9)
    torch.testing.assert_close(key.weight, 0.9 * k0 + 0.1 * q0)
    torch.testing.assert_close(query.weight, q0)  # the query encoder is only read


def test_the_key_encoder_after_two_steps_is_the_ema_of_the_query_encoder_s_weights(tmp_path):
    """Through train_loop (the hook after each optimizer step): theta_k starts as theta_q0, then
    theta_k1 = m theta_q0 + (1 - m) theta_q1, theta_k2 = m theta_k1 + (1 - m) theta_q2; the key encoder
    takes no gradient and the optimizer never moves it."""
    torch.manual_seed(0)
    m = 0.75
    moco = MoCo(_Toy(), queue_size=8, momentum=m, similarity="dot", temperature=0.5, dim=3)
    x = torch.randn(8, 3)
    seen = [{n: t.detach().clone() for n, t in moco.query_encoder.state_dict().items()}]  # theta_q0

    def compute_loss(idx):
        q = moco.query_encoder({"x": x[idx]})["sentence_embedding"]
        with torch.no_grad():
            k = moco.key_encoder({"x": x[idx] + 0.1})["sentence_embedding"]
        return moco.loss(q, k, torch.tensor(idx))

    def after_step():
        seen.append({n: t.detach().clone() for n, t in moco.query_encoder.state_dict().items()})
        moco.momentum_update()

    p = LoopParams(lr=0.1, steps=2, checkpoint_every=0, max_grad_norm=0)
    train_loop(moco, compute_loss, BatchPlan(8, 4, 0), p, 0, StageRuntime(workdir=tmp_path), "moco",
               show_progress=False, after_step=after_step)
    assert len(seen) == 3 and not torch.equal(seen[1]["lin.weight"], seen[2]["lin.weight"])  # it trained
    for name, got in moco.key_encoder.state_dict().items():
        k1 = m * seen[0][name] + (1 - m) * seen[1][name]
        k2 = m * k1 + (1 - m) * seen[2][name]
        torch.testing.assert_close(got, k2)
    assert all(not t.requires_grad for t in moco.key_encoder.parameters())
    assert moco.queue.contents()[1].tolist() != []  # both batches were queued


def test_the_queue_is_a_fifo_of_fixed_size():
    queue = KeyQueue(4, 2)
    keys, ids = queue.contents()
    assert keys.shape == (0, 2) and ids.tolist() == []
    for start in (0, 2):
        queue.enqueue(torch.tensor([[start, 0.0], [start + 1, 0.0]]), torch.tensor([start, start + 1]))
    keys, ids = queue.contents()
    assert ids.tolist() == [0, 1, 2, 3] and keys[:, 0].tolist() == [0, 1, 2, 3]
    queue.enqueue(torch.tensor([[4, 0.0], [5, 0.0]]), torch.tensor([4, 5]))  # the two oldest go out
    keys, ids = queue.contents()
    assert ids.tolist() == [2, 3, 4, 5] and keys[:, 0].tolist() == [2, 3, 4, 5]
    assert queue.keys.shape == (4, 2) and queue.ids.shape == (4,)  # the size never changes
    queue.enqueue(torch.arange(12.0).view(6, 2), torch.arange(10, 16))  # more than it holds: the newest 4
    assert queue.contents()[1].tolist() == [12, 13, 14, 15]
    assert set(queue.state_dict()) == {"keys", "ids", "ptr"}  # checkpointed with the model


def _infonce_by_hand(q, pos, negatives, sim, tau):
    """-log exp(s(q,k+)/tau) / (exp(s(q,k+)/tau) + sum_k- exp(s(q,k-)/tau)), one query."""
    top = math.exp(sim(q, pos) / tau)
    return -math.log(top / (top + sum(math.exp(sim(q, k) / tau) for k in negatives)))


def _dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def _cos(a, b):
    return _dot(a, b) / math.sqrt(_dot(a, a) * _dot(b, b))


def test_the_loss_is_infonce_over_the_batch_s_keys_and_the_queue_by_hand():
    q = [[1.0, 0.0], [0.0, 2.0]]
    k = [[1.0, 0.0], [0.6, 0.8]]
    queue = [[0.0, 1.0], [-1.0, 0.0], [0.6, 0.8]]
    n = [[0.5, 0.5], [1.0, 1.0]]
    T = torch.tensor
    for sim, name, tau in ((_dot, "dot", 0.5), (_cos, "cos", 0.05)):
        loss = MoCoLoss(name, tau)
        # query i: its own key is the positive; the other batch key and every queued key are negatives
        expect = sum(_infonce_by_hand(q[i], k[i], [k[1 - i]] + queue, sim, tau) for i in range(2)) / 2
        assert loss.from_embeddings(T(q), T(k), T(queue)).item() == pytest.approx(expect, rel=1e-5)
        assert loss.last_candidates == 5
        # hard negatives' keys join the negatives
        expect = sum(_infonce_by_hand(q[i], k[i], [k[1 - i]] + n + queue, sim, tau) for i in range(2)) / 2
        assert loss.from_embeddings(T(q), T(k), T(queue), n=T(n)).item() == pytest.approx(expect, rel=1e-5)
        # a masked queued key is left out of that query's softmax only
        mask = T([[False, False, True], [False, False, False]])
        expect = (_infonce_by_hand(q[0], k[0], [k[1]] + queue[:2], sim, tau)
                  + _infonce_by_hand(q[1], k[1], [k[0]] + queue, sim, tau)) / 2
        assert loss.from_embeddings(T(q), T(k), T(queue), queue_mask=mask).item() == pytest.approx(expect, rel=1e-5)
    # the queries' positives sit at `first + i` among gathered keys (another process's keys before them)
    other = [[0.3, -0.2], [0.1, 0.9]]
    expect = sum(_infonce_by_hand(q[i], k[i], [other[0], other[1], k[1 - i]], _dot, 1.0) for i in range(2)) / 2
    got = MoCoLoss("dot", 1.0).from_embeddings(T(q), T(other + k), first=2)
    assert got.item() == pytest.approx(expect, rel=1e-5)
    # the gradient reaches the queries only
    qg, kg = T(q, requires_grad=True), T(k, requires_grad=True)
    MoCoLoss("cos").from_embeddings(qg, kg, T(queue)).backward()
    assert qg.grad is not None and kg.grad is None


def test_a_query_s_own_passage_in_the_queue_is_no_negative():
    torch.manual_seed(0)
    moco = MoCo(_Toy(2), queue_size=4, momentum=0.9, similarity="dot", temperature=1.0, dim=2)
    moco.queue.enqueue(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), torch.tensor([7, 8, 9]))
    q, k = torch.tensor([[1.0, 0.5], [0.2, 1.0]]), torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    got = moco.loss(q, k, torch.tensor([8, 3]))  # query 0's passage (8) is queued
    mask = torch.tensor([[False, True, False], [False, False, False]])
    expect = MoCoLoss("dot", 1.0).from_embeddings(q, k, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
                                                 queue_mask=mask)
    assert got.item() == pytest.approx(expect.item(), rel=1e-6)
    assert moco.queue.contents()[1].tolist() == [8, 9, 8, 3]  # then the batch's keys were queued, oldest out


# ---- params -----------------------------------------------------------------------------------------
def test_moco_params_are_validated_by_dotted_key():
    from irflow import api
    from irflow.engine.errors import ConfigError

    assert MoCoParams().enabled is False
    with pytest.raises(ValidationError, match="moco.queue_size: 10 is not a multiple of batch_size 4"):
        TrainStudentParams(loss="mnrl", batch_size=4, moco={"enabled": True, "queue_size": 10})
    TrainStudentParams(loss="mnrl", batch_size=4, moco={"enabled": False, "queue_size": 10})  # off: not checked
    for m in (0, 1, 1.5):
        with pytest.raises(ValidationError, match="momentum"):
            MoCoParams(momentum=m)
    with pytest.raises(ValidationError, match="extra"):
        MoCoParams(queue=8)
    demo = str(REPO / "configs" / "demo.yaml")  # train.batch_size 16
    with pytest.raises(ConfigError, match="train.moco.queue_size: 40 is not a multiple of batch_size 16"):
        api.load_config(demo, ["train.moco.enabled=true", "train.moco.queue_size=40"])
    with pytest.raises(ConfigError, match="train.moco.momentum: 1: input should be less than 1"):
        api.load_config(demo, ["train.moco.enabled=true", "train.moco.momentum=1"])
    c = api.load_config(demo, ["train.moco.enabled=true", "train.moco.queue_size=64"])
    # train.moco reaches the QGen student (mnrl); the GPL student (margin_mse) ignores it and keeps its key
    assert c.train.qgen_params().uses_moco and c.train.qgen_params().key_dump()["moco"]["queue_size"] == 64
    assert not c.train.gpl_params().uses_moco and "moco" not in c.train.gpl_params().key_dump()


# the keys train_student gave these params and inputs before the moco field existed (version 3)
_KEY_BEFORE = {"margin_mse": "bcfde89820423439cdcf396032105a2dd8c685a94f1617df738200c8cda9c25c",
               "mnrl": "7f09e3b1d3b40950ef828bbfaaa1e04b57144865f34221c1f552db6fb5a44137"}


def test_moco_enters_the_key_only_when_it_runs():
    inputs = {"queries": SimpleNamespace(id="queries-0"), "corpus": SimpleNamespace(id="corpus-0"),
              "base_model": SimpleNamespace(id="model-0"), "qrels": SimpleNamespace(id="qrels-0")}
    default, mnrl = TrainStudentParams(), TrainStudentParams(loss="mnrl", similarity="cos", batch_size=4)
    assert train_student.key(default, inputs) == _KEY_BEFORE["margin_mse"]
    assert train_student.key(mnrl, inputs) == _KEY_BEFORE["mnrl"]
    off = mnrl.model_copy(update={"moco": MoCoParams(queue_size=8, momentum=0.99)})  # set, but disabled
    assert train_student.key(off, inputs) == _KEY_BEFORE["mnrl"]
    on = TrainStudentParams(loss="mnrl", similarity="cos", batch_size=4, moco={"enabled": True, "queue_size": 8})
    assert train_student.key(on, inputs) != _KEY_BEFORE["mnrl"]
    assert on.key_dump()["moco"] == {"enabled": True, "queue_size": 8, "momentum": 0.999, "temperature": None}
    faster = on.model_copy(update={"moco": on.moco.model_copy(update={"momentum": 0.99})})
    assert train_student.key(faster, inputs) != train_student.key(on, inputs)
    ignored = TrainStudentParams(batch_size=4, moco={"enabled": True, "queue_size": 8})  # margin_mse
    assert train_student.key(ignored, inputs) == train_student.key(TrainStudentParams(batch_size=4), inputs)


# ---- through the stage ------------------------------------------------------------------------------
_TOPICS = ["protein folding in yeast cells", "solar panel efficiency at noon", "river delta sediment flow",
           "jazz chord voicings for piano", "glacier melt in alpine valleys", "compiler register allocation",
           "honeybee colony collapse causes", "tidal energy turbine design", "medieval castle siege tactics",
           "neutron star merger signals"]


def _inputs(run, bi) -> dict:
    from irflow.dev.testing import model

    docs = {f"d{i}": f"{t} and what follows from {t.split()[0]}" for i, t in enumerate(_TOPICS)}
    queries = {f"q{i}": t.split(" in ")[0].split(" at ")[0] for i, t in enumerate(_TOPICS)}
    pub = lambda name, contract, t: run.store.publish_table(name, contract, t)[0]  # noqa: E731
    return dict(
        corpus=pub("corpus", "corpus", pa.table({"doc_id": list(docs), "title": [""] * len(docs),
                                                 "text": list(docs.values())})),
        queries=pub("queries", "queries", pa.table({"query_id": list(queries), "text": list(queries.values())})),
        qrels=pub("qrels", "qrels", pa.table({"query_id": list(queries), "doc_id": list(docs),
                                              "score": pa.array([1] * len(docs), pa.int32()),
                                              "split": ["generated"] * len(docs)})),
        base_model=model(run, bi))


def test_train_student_with_moco_trains_end_to_end_resumes_and_is_keyed(tmp_path, monkeypatch, caplog):
    from sentence_transformers import SentenceTransformer

    from irflow.dev.testing import make_tiny_bi_encoder
    from irflow.engine.errors import StageFailed
    from irflow.learn import training

    bi = make_tiny_bi_encoder(tmp_path / "bi")
    run = Run(str(tmp_path / "a"), "run-moco")
    inputs = _inputs(run, bi)
    params = TrainStudentParams(loss="mnrl", similarity="cos", batch_size=4, max_seq_length=32, lr=1e-3,
                                warmup_steps=1, steps=4, checkpoint_every=2, seed=3,
                                moco={"enabled": True, "queue_size": 8, "momentum": 0.99})
    full = train_student.run(run, params, tag="moco", **inputs)
    ref = full["student"]
    log = json.loads((Path(ref.path) / "irflow_training.json").read_text())
    assert log["moco"] == {"enabled": True, "queue_size": 8, "momentum": 0.99, "temperature": None}
    # 10 pairs, batches of 4: each query is scored against the batch's 4 keys plus the queue: empty, 4, then 8
    # (full, rolling)
    assert [h["candidates"] for h in log["history"]] == [4, 8, 12, 12]
    assert all(math.isfinite(h["loss"]) for h in log["history"])
    # the saved model is the query encoder alone, a plain sentence-transformers model that trained
    trained = SentenceTransformer(ref.path, device="cpu").state_dict()
    base = SentenceTransformer(str(bi), device="cpu").state_dict()
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    # keyed: the same params are a cache hit; without moco it is another student
    again = Run(run.store_root, "again")
    assert train_student.run(again, params, tag="moco", **inputs)["student"].id == ref.id
    assert [s["status"] for s in again.catalog.stage_runs("again")] == ["cached"]
    assert train_student.key(params.model_copy(update={"moco": MoCoParams()}), inputs) != train_student.key(
        params, inputs)

    # a crash after step 3 resumes from the step-2 checkpoint (key encoder and queue in it) to the same model
    def crash_after_3(step):
        if step == 3:
            raise RuntimeError("simulated crash")

    crash = Run(str(tmp_path / "b"), "r1")
    inputs = _inputs(crash, bi)
    monkeypatch.setattr(training, "_on_step", crash_after_3)
    with pytest.raises(StageFailed, match="simulated crash"):
        train_student.run(crash, params, tag="moco", **inputs)
    monkeypatch.setattr(training, "_on_step", lambda step: None)
    with caplog.at_level(logging.INFO, logger="irflow.train"):
        resumed = train_student.run(Run(str(tmp_path / "b"), "r2"), params, tag="moco", **inputs)
    assert "resuming from step 2" in caplog.text and "with MoCo (queue 8, momentum 0.99)" in caplog.text
    a, b = (o["training_losses"].table().to_pydict() for o in (full, resumed))
    assert b["candidates"] == a["candidates"] and b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    again = SentenceTransformer(resumed["student"].path, device="cpu").state_dict()
    for k in trained:
        torch.testing.assert_close(again[k], trained[k], rtol=0, atol=1e-6)
