"""Dual-encoder training: GradCache, cross-batch negatives over torchrun processes, listwise
distillation, and the examples the stage builds -- on real SciFact texts and tiny local models."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from irflow.dev.testing import beir_slice, ingest_folder, make_tiny_bi_encoder, model, scifact_docs
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig
from irflow.learn.dual_encoder import TrainDualEncoderParams
from irflow.learn.encoding import load_sentence_transformer
from irflow.learn.losses import (
    CrossBatchInfoNCE,
    ListwiseDistillationLoss,
    MultipleNegativesRankingLoss,
    grad_cache_step,
)
from irflow.learn.qrels import judged_positives
from irflow.stages.train_dual_encoder import train_dual_encoder, training_examples


@pytest.fixture(scope="module")
def texts():
    docs = scifact_docs(24)
    passages = [f"{t} {x}" for t, x in zip(docs.column("title").to_pylist(), docs.column("text").to_pylist())]
    queries = [t for t in docs.column("title").to_pylist()]  # real short texts as queries
    return queries, passages


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _embed(model, texts, max_length=48):
    model.max_seq_length = max_length
    f = model.tokenize(texts)
    return model(f)["sentence_embedding"]


@pytest.mark.parametrize("with_dropout", [False, True])
def test_grad_cache_gives_the_full_batch_gradients(tmp_path, texts, with_dropout):
    queries, passages = texts
    path = make_tiny_bi_encoder(tmp_path / "bi", dropout=0.1 if with_dropout else 0.0)
    q, p, n = queries[:8], passages[:8], passages[8:16]
    loss_fn = CrossBatchInfoNCE(similarity="cos")

    full = load_sentence_transformer(str(path))
    full.train()
    torch.manual_seed(7)
    ref_loss = loss_fn.from_embeddings(_embed(full, q), _embed(full, p), _embed(full, n))
    if not with_dropout:
        ref_loss.backward()
        ref = _grads(full)

    cached = load_sentence_transformer(str(path))
    cached.train()
    torch.manual_seed(7)
    loss = grad_cache_step([lambda t: _embed(cached, t)] * 3, [q, p, n],
                           lambda reps: loss_fn.from_embeddings(*reps), mini_batch=3)
    assert not loss.requires_grad
    got = _grads(cached)
    assert len(got) > 10
    if with_dropout:
        # Dropout masks differ between the full graph and the chunks, but GradCache's second pass replays
        # the first pass's masks: its gradients are those of the loss it reported.
        replay = load_sentence_transformer(str(path))
        replay.train()
        torch.manual_seed(7)
        reps = [torch.cat([_embed(replay, g[i:i + 3]) for i in range(0, len(g), 3)]) for g in (q, p, n)]
        replay_loss = loss_fn.from_embeddings(*reps)
        assert float(replay_loss.detach()) == pytest.approx(float(loss), abs=1e-6)
        replay_loss.backward()
        ref = _grads(replay)
    else:
        assert float(loss) == pytest.approx(float(ref_loss.detach()), abs=1e-6)
    for name, g in ref.items():
        assert torch.allclose(got[name], g, atol=1e-6, rtol=1e-4), name


def test_cross_batch_loss_in_one_process_is_mnrl(texts):
    torch.manual_seed(0)
    q, p, n = torch.randn(6, 16), torch.randn(6, 16), torch.randn(6, 16)
    a = CrossBatchInfoNCE(similarity="cos").from_embeddings(q, p, n)
    b = MultipleNegativesRankingLoss(similarity="cos").from_embeddings(q, p, n)
    assert float(a) == pytest.approx(float(b), abs=1e-6)


def test_a_masked_candidate_is_left_out_of_the_softmax():
    """false_negatives: mask -- the loss equals cross-entropy over the unmasked candidates only; a mask
    on a row's own positive is ignored (the target always stays)."""
    torch.manual_seed(0)
    q, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    loss = CrossBatchInfoNCE(similarity="dot", scale=1.0)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0, 1] = mask[0, 6] = mask[2, 0] = True  # other lines' passages judged relevant to rows 0 and 2
    mask[3, 3] = True  # row 3's own positive: must stay
    scores = q @ torch.cat([p, n]).T
    manual = []
    for i in range(4):
        keep = [j for j in range(8) if not mask[i, j] or j == i]
        manual.append(-torch.log_softmax(scores[i, keep], -1)[keep.index(i)])
    assert float(loss.from_embeddings(q, p, n, mask)) == pytest.approx(float(torch.stack(manual).mean()), abs=1e-6)
    assert float(loss.from_embeddings(q, p, n, mask)) < float(loss.from_embeddings(q, p, n))
    assert float(loss.from_embeddings(q, p, n, torch.zeros(4, 8, dtype=torch.bool))) == pytest.approx(
        float(loss.from_embeddings(q, p, n)), abs=1e-7)


def test_listwise_distillation_is_the_kl_of_the_two_softmaxes():
    torch.manual_seed(0)
    q, c, t = torch.randn(3, 8), torch.randn(3, 5, 8), torch.randn(3, 5)
    loss = ListwiseDistillationLoss(similarity="dot", scale=1.0).from_embeddings(q, c, t)
    s = torch.log_softmax(torch.einsum("bd,bmd->bm", q, c), -1)
    tp = torch.softmax(t, -1)
    manual = (tp * (tp.log() - s)).sum(-1).mean()
    assert float(loss) == pytest.approx(float(manual), abs=1e-6)
    # A retriever that already matches the teacher's distribution has nothing to learn.
    student_scores = torch.einsum("bd,bmd->bm", q, c)
    zero = ListwiseDistillationLoss(similarity="dot", scale=1.0).from_embeddings(q, c, student_scores)
    assert float(zero) == pytest.approx(0.0, abs=1e-6)


@pytest.fixture(scope="module")
def slice_run(tmp_path_factory, shared_datasets):
    root = tmp_path_factory.mktemp("de")
    data = beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=4, n_train_queries=24,
                      n_extra_docs=40, seed=3)
    # fp32: the equivalence checks compare weights, and bf16 autocast (chosen on CPUs with native bf16)
    # rounds differently for different batch shapes -- which Adam turns into sign flips.
    run = Run(root / "store", "test-de", runtime=RuntimeConfig(precision="fp32"))
    refs = ingest_folder(run, data)
    return {"root": root, "run": run, **refs}


def test_examples_lines_negatives_and_random_fill(slice_run):
    qrels = slice_run["qrels"].table()
    corpus_ids = slice_run["corpus"].table().column("doc_id").to_pylist()
    judged = judged_positives(qrels)
    # No negatives input: every line gets random passages (DPR), never a judged positive of its query.
    p = TrainDualEncoderParams(negatives_per_line=2, negative_lines=3)
    ex = training_examples(p, [qrels], corpus_ids)
    pairs = {(q, d) for q, d in zip(ex["q"], ex["p"])}
    assert len(ex["q"]) == 3 * len(pairs)
    by_pair: dict = {}
    for q, d, n in zip(ex["q"], ex["p"], ex["n"]):
        assert len(n) == 2 and not set(n) & judged[q]
        by_pair.setdefault((q, d), []).extend(n)
    # The three lines of a (query, positive) have distinct negatives.
    assert all(len(v) == len(set(v)) == 6 for v in by_pair.values())
    # Deterministic for a seed, different for another.
    assert training_examples(p, [qrels], corpus_ids)["n"] == ex["n"]
    assert training_examples(p.model_copy(update={"seed": 1}), [qrels], corpus_ids)["n"] != ex["n"]
    with pytest.raises(Exception, match="no positive qrels in split"):
        training_examples(p.model_copy(update={"splits": ("dev",)}), [qrels], corpus_ids)


def test_positives_per_query_weighs_broad_queries_like_the_others(slice_run):
    """A query judged relevant to many passages (NFCorpus's 'cancer': 1,363) gives one training pair per
    positive; positives_per_query keeps a seeded sample of them, every query kept, negatives still drawn."""
    import pyarrow as pa

    qrels = slice_run["qrels"].table()
    corpus_ids = slice_run["corpus"].table().column("doc_id").to_pylist()
    train = qrels.filter(pa.compute.equal(qrels.column("split"), "train"))
    broad_q = train.column("query_id")[0].as_py()
    # the slice's first train query, judged relevant to 30 more corpus passages: a broad query
    extra = [d for d in corpus_ids if d not in set(train.column("doc_id").to_pylist())][:30]
    rows = {c: train.column(c).to_pylist() for c in train.column_names}
    for d in extra:
        for c in train.column_names:
            rows[c].append({"query_id": broad_q, "doc_id": d}.get(c, rows[c][0]))
    broad = pa.Table.from_pydict(rows, schema=train.schema)
    queries = set(broad.column("query_id").to_pylist())

    every = training_examples(TrainDualEncoderParams(), [broad], corpus_ids)
    assert every["q"].count(broad_q) >= 31  # one line per judged pair: the broad query dominates
    p = TrainDualEncoderParams(positives_per_query=2, negatives_per_line=1)
    ex = training_examples(p, [broad], corpus_ids)
    assert set(ex["q"]) == queries and max(ex["q"].count(q) for q in queries) == 2
    judged = judged_positives(broad)
    assert all((q, d) in set(zip(every["q"], every["p"])) for q, d in zip(ex["q"], ex["p"]))
    assert all(len(n) == 1 and not set(n) & judged[q] for q, n in zip(ex["q"], ex["n"]))
    # seeded: the same sample for a seed, another for another seed
    assert training_examples(p, [broad], corpus_ids)["p"] == ex["p"]
    assert training_examples(p.model_copy(update={"seed": 1}), [broad], corpus_ids)["p"] != ex["p"]
    # left at its default, the field stays out of the cache key (stores made before it keep their keys)
    assert "positives_per_query" not in TrainDualEncoderParams().key_dump()
    assert TrainDualEncoderParams(positives_per_query=1).key_dump()["positives_per_query"] == 1


def test_two_processes_see_world_times_batch_passages_and_step_like_one_big_batch(slice_run):
    """torchrun, 2 processes (gloo on CPU) x 4 queries: each query is scored against the 16 gathered
    passages (positive + 1 negative for 8 queries), and the trained weights equal one process with a
    batch of 8."""
    run, root = slice_run["run"], slice_run["root"]
    bi = model(run, make_tiny_bi_encoder(root / "bi0", dropout=0.0))
    common = dict(negatives_per_line=1, steps=2, lr=1e-3, warmup_ratio=0.0, query_max_length=16,
                  passage_max_length=32, checkpoint_every=0)
    inputs = dict(queries=[slice_run["queries"]], corpus=slice_run["corpus"], base_model=bi,
                  qrels=[slice_run["qrels"]])
    ddp_out = train_dual_encoder.run(run, TrainDualEncoderParams(batch_size=4, processes=2, **common), tag="ddp",
                                     **inputs)
    ddp = ddp_out["model"]
    one = train_dual_encoder.run(run, TrainDualEncoderParams(batch_size=8, **common), tag="one", **inputs)["model"]
    assert ddp.id != one.id  # different params, different keys and bytes
    info = json.loads((Path(ddp.path) / "irflow_training.json").read_text())
    assert info["processes"] == 2 and info["global_batch"] == 8
    assert [h["candidates"] for h in info["history"]] == [2 * 4 * (1 + 1)] * 2
    # the loss dataset of a torchrun training is rank 0's history, candidates included
    losses = ddp_out["training_losses"].table().to_pylist()
    assert losses == [{k: h.get(k) for k in ("step", "loss", "lr", "candidates")} for h in info["history"]]
    single = json.loads((Path(one.path) / "irflow_training.json").read_text())
    assert [h["candidates"] for h in single["history"]] == [8 * 2] * 2
    a = load_sentence_transformer(ddp.path).state_dict()
    b = load_sentence_transformer(one.path).state_dict()
    assert a.keys() == b.keys()
    base = load_sentence_transformer(bi.path).state_dict()
    moved = max(float((b[k] - base[k]).abs().max()) for k in b)
    assert moved > 1e-4  # it trained
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff < 1e-4 * max(1.0, moved), diff
    # the history holds the loss of the whole global batch (the mean over the processes' queries)
    np.testing.assert_allclose([h["loss"] for h in info["history"]], [h["loss"] for h in single["history"]],
                               rtol=1e-5)


def test_train_processes_split_the_global_batch_and_change_nothing_else(slice_run, tmp_path):
    """runtime.train_processes: 2 (not keyed) on batches of 8: each process embeds 4 queries, every query
    is still scored against the passages of the whole batch, and the run takes the steps of one
    process (same key, loss curve and weights); 3 processes cannot split 8 and are refused."""
    bi = model(slice_run["run"], make_tiny_bi_encoder(tmp_path / "bi", dropout=0.0))
    params = TrainDualEncoderParams(negatives_per_line=1, steps=2, lr=1e-3, warmup_ratio=0.0, batch_size=8,
                                    query_max_length=16, passage_max_length=32, checkpoint_every=0)
    inputs = dict(queries=[slice_run["queries"]], corpus=slice_run["corpus"], base_model=bi,
                  qrels=[slice_run["qrels"]])
    refs, logs = {}, {}
    for n in (1, 2):
        r = Run(tmp_path / f"p{n}", "r", runtime=RuntimeConfig(precision="fp32", train_processes=n))
        refs[n] = train_dual_encoder.run(r, params, **inputs)["model"]
        logs[n] = json.loads((Path(refs[n].path) / "irflow_training.json").read_text())
    assert (logs[1]["processes"], logs[2]["processes"]) == (1, 2)
    assert logs[2]["global_batch"] == 8
    assert [h["candidates"] for h in logs[2]["history"]] == [h["candidates"] for h in logs[1]["history"]] == [16] * 2
    np.testing.assert_allclose([h["loss"] for h in logs[2]["history"]], [h["loss"] for h in logs[1]["history"]],
                               rtol=1e-5)
    a, b = (load_sentence_transformer(refs[n].path).state_dict() for n in (1, 2))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    again = Run(tmp_path / "p1", "again", runtime=RuntimeConfig(train_processes=2))
    assert train_dual_encoder.run(again, params, **inputs)["model"].id == refs[1].id  # runtime is not keyed: cached
    with pytest.raises(Exception, match=r"runtime.train_processes: 3 processes cannot split a batch of 8 "
                                        r"\(processes x batch_size\)"):
        train_dual_encoder.run(Run(tmp_path / "p3", "r", runtime=RuntimeConfig(train_processes=3)), params,
                               **inputs)


def test_judged_in_batch_passages_are_masked_in_one_process_and_across_two(slice_run, tmp_path):
    """Queries that share judged passages (NFCorpus-like): each train query also judges the next query's
    positive, so batches hold false negatives. ``false_negatives: mask`` changes the loss (keep: the
    published recipes), is keyed only when set, and 2 torchrun processes (the passage numbers gathered
    with the embeddings) take the steps of one process with the whole batch."""
    import shutil

    folder = shutil.copytree(slice_run["root"] / "slice", tmp_path / "shared")
    lines = (folder / "qrels" / "train.tsv").read_text().splitlines()
    firsts = {}
    for ln in lines[1:]:
        q, d = ln.split("\t")[:2]
        firsts.setdefault(q, d)
    qs = sorted(firsts)
    extra = [f"{q}\t{firsts[qs[(i + 1) % len(qs)]]}\t1" for i, q in enumerate(qs)]
    (folder / "qrels" / "train.tsv").write_text("\n".join(lines + extra) + "\n")
    run = Run(tmp_path / "store", "shared", runtime=RuntimeConfig(precision="fp32"))
    data = ingest_folder(run, folder)
    bi = model(run, make_tiny_bi_encoder(tmp_path / "bi", dropout=0.0))
    common = dict(negatives_per_line=1, steps=2, lr=1e-3, warmup_ratio=0.0, batch_size=8, query_max_length=16,
                  passage_max_length=32, checkpoint_every=0)
    inputs = dict(queries=[data["queries"]], corpus=data["corpus"], base_model=bi, qrels=[data["qrels"]])
    keep, mask = (TrainDualEncoderParams(**common, false_negatives=v) for v in ("keep", "mask"))
    assert keep.key_dump() == TrainDualEncoderParams(**common).key_dump()  # keep: keys as before the field
    assert mask.key_dump()["false_negatives"] == "mask"
    hist = {}
    for name, params, n in (("keep", keep, 1), ("mask", mask, 1), ("mask2", mask, 2)):
        # a store each: train_processes is not keyed, so a shared store would hand mask2 mask's model
        r = Run(tmp_path / f"store-{name}", name, runtime=RuntimeConfig(precision="fp32", train_processes=n))
        ref = train_dual_encoder.run(r, params, **inputs)["model"]
        hist[name] = json.loads((Path(ref.path) / "irflow_training.json").read_text())["history"]
    # the same first batch (same seed) and weights: its false negatives left the softmax, so a lower loss
    assert hist["mask"][0]["loss"] < hist["keep"][0]["loss"] - 1e-4, (hist["mask"], hist["keep"])
    np.testing.assert_allclose([h["loss"] for h in hist["mask2"]], [h["loss"] for h in hist["mask"]], rtol=1e-5)
    with pytest.raises(Exception, match="false_negatives: mask applies to infonce"):
        TrainDualEncoderParams(loss="listwise_kl", false_negatives="mask")
