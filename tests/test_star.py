"""STAR + ADORE (Zhan et al., SIGIR 2021): both losses by hand; ADORE's hard negatives and frozen documents on a
real SciFact slice with tiny models; the recipe end to end through irflow.api, its refusals, and the exported
asymmetric model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from irflow import api
from irflow.dev.testing import beir_slice, ingest_folder, make_tiny_bi_encoder, model
from irflow.dev.testing import run_cli as cli
from irflow.engine.errors import ConfigError
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig
from irflow.engine.store import fingerprint_dir
from irflow.learn.adore import TrainQueryEncoderParams, embedding_matrix
from irflow.learn.dual_encoder import TrainDualEncoderParams
from irflow.learn.losses import LambdaLoss, StarLoss
from irflow.learn.qrels import judged_positives, positives
from irflow.learn.text import passage_texts
from irflow.learn.training import BatchPlan
from irflow.stages.dense import EncodeParams, encode_corpus
from irflow.stages.train_query_encoder import train_query_encoder


def _l(x: float) -> float:  # RankNet: log(1 + exp(x))
    return math.log1p(math.exp(x))


# ---- the losses, by hand ------------------------------------------------------------------------------
def test_star_loss_is_alpha_times_the_random_pairs_plus_the_static_pairs():
    q = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    p = torch.tensor([[0.5, 0.5], [1.0, 1.0]])
    n = torch.tensor([[2.0, 0.0], [0.0, -1.0]])  # line 0's hard negative, line 1's
    s = q @ torch.cat([p, n]).T  # columns: p0, p1, n0, n1
    static = (_l(s[0, 2] - s[0, 0]) + _l(s[1, 3] - s[1, 1])) / 2
    random0 = (_l(s[0, 1] - s[0, 0]) + _l(s[0, 3] - s[0, 0])) / 2  # p1 and n1 against p0
    random1 = (_l(s[1, 0] - s[1, 1]) + _l(s[1, 2] - s[1, 1])) / 2
    random = (random0 + random1) / 2
    loss = StarLoss(similarity="dot", scale=1.0, alpha=0.25)
    assert float(loss.from_embeddings(q, p, n)) == pytest.approx(0.25 * random + static, abs=1e-6)
    assert loss.last_candidates == 4
    # a masked passage (judged relevant to that query) leaves its random pairs
    mask = torch.tensor([[False, True, False, False], [False, False, False, False]])
    random_masked = (_l(s[0, 3] - s[0, 0]) + random1) / 2
    assert float(loss.from_embeddings(q, p, n, mask)) == pytest.approx(0.25 * random_masked + static, abs=1e-6)
    # cos: the same on unit vectors, scaled
    unit = [torch.nn.functional.normalize(x, dim=-1) for x in (q, p, n)]
    cos = StarLoss(similarity="cos", scale=20.0, alpha=0.1)
    dot = StarLoss(similarity="dot", scale=20.0, alpha=0.1)
    assert float(cos.from_embeddings(q, p, n)) == pytest.approx(float(dot.from_embeddings(*unit)), abs=1e-5)


def _ndcg(gains_at: dict[int, float], ideal: list[float]) -> float:
    dcg = sum(g / math.log2(1 + r) for r, g in gains_at.items())
    idcg = sum(g / math.log2(2 + i) for i, g in enumerate(sorted(ideal, reverse=True)))
    return dcg / idcg


def test_lambdaloss_weights_are_the_ndcg_change_of_swapping_the_pair_in_the_ranking():
    labels = torch.tensor([[2.0, 1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    ranks = torch.tensor([[3.0, 1.0, 2.0, 7.0, 40.0], [5.0, 1.0, 2.0, 1.0, 1.0]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    w = LambdaLoss.weights(labels, ranks, valid)
    for b in range(2):
        m = int(valid[b].sum())
        gain = [2 ** float(y) - 1 for y in labels[b, :m]]
        rank = [int(r) for r in ranks[b, :m]]
        base = _ndcg({rank[i]: gain[i] for i in range(m)}, gain)
        for i in range(5):
            for j in range(5):
                if i < m and j < m and labels[b, i] > labels[b, j]:
                    swapped = list(rank)
                    swapped[i], swapped[j] = rank[j], rank[i]
                    expected = abs(_ndcg({swapped[k]: gain[k] for k in range(m)}, gain) - base)
                    assert float(w[b, i, j]) == pytest.approx(expected, abs=1e-6), (b, i, j)
                    assert expected > 0
                else:
                    assert float(w[b, i, j]) == 0.0
    # the loss: per query, the weighted RankNet of its (better, worse) pairs over their number, then the mean
    scores = torch.tensor([[0.3, 0.9, -0.2, 0.1, 0.0], [0.5, 0.7, 0.6, 9.0, 9.0]])
    per_query = []
    for b in range(2):
        pairs = [(i, j) for i in range(5) for j in range(5)
                 if valid[b, i] and valid[b, j] and labels[b, i] > labels[b, j]]
        per_query.append(sum(float(w[b, i, j]) * _l(float(scores[b, j] - scores[b, i])) for i, j in pairs) / len(pairs))
    assert float(LambdaLoss(similarity="dot", scale=1.0)(scores, labels, ranks, valid)) == pytest.approx(
        sum(per_query) / 2, abs=1e-6)


# ---- ADORE on a real slice -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adore(tmp_path_factory, shared_datasets):
    """STAR stand-in (a tiny normalised bi-encoder without dropout), its corpus embeddings, and two ADORE steps
    whose every candidate search is recorded."""
    import irflow.learn.adore
    import irflow.stages.train_query_encoder as stage_module

    root = tmp_path_factory.mktemp("adore")
    data = beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=2, n_train_queries=12,
                      n_extra_docs=40, seed=4)
    run = Run(root / "store", "adore", runtime=RuntimeConfig(precision="fp32", threads=1))
    refs = ingest_folder(run, data)
    star = model(run, make_tiny_bi_encoder(root / "star", normalize=True, dropout=0.0))
    emb = encode_corpus.run(run, EncodeParams(batch_size=16), corpus=refs["corpus"], model=star)
    before = fingerprint_dir(Path(emb.path))
    params = TrainQueryEncoderParams(steps=2, batch_size=16, lr=1e-3, warmup_ratio=0.0, depth=10, negatives_per_query=4,
                                     query_max_length=16, checkpoint_every=0)
    calls, jobs = [], []
    real_candidates, real_train = irflow.learn.adore.candidates, stage_module.train

    def recording(q, docs, *args):
        c = real_candidates(q, docs, *args)
        calls.append({"q": q.clone(), "positives": args[0], "excluded": args[1], "negatives": c.negatives,
                      "ranks": c.ranks.clone(), "rows": c.rows.clone(), "valid": c.valid.clone()})
        return c

    def keep_job(job, rt):
        jobs.append(job)
        return real_train(job, rt)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(irflow.learn.adore, "candidates", recording)
        mp.setattr(stage_module, "train", keep_job)
        out = train_query_encoder.run(run, params, queries=refs["queries"], qrels=refs["qrels"], embeddings=emb,
                                      base_model=star, document_model=star)
    return {"run": run, "refs": refs, "star": star, "emb": emb, "before": before, "params": params, "calls": calls,
            "job": jobs[0], "out": out}


def test_adore_leaves_the_document_embeddings_and_the_document_encoder_bit_identical(adore):
    from sentence_transformers import SentenceTransformer

    emb = adore["emb"]
    assert fingerprint_dir(Path(emb.path)) == adore["before"]  # the stored embeddings: the same bytes
    again = encode_corpus.run(adore["run"], EncodeParams(batch_size=16), corpus=adore["refs"]["corpus"],
                              model=adore["star"])
    assert again.id == emb.id  # still the dataset STAR's encoding made (cached)
    both = SentenceTransformer(adore["out"]["model"].path, device="cpu")
    star = SentenceTransformer(adore["star"].path, device="cpu")
    router = both[0]
    document = router.sub_modules["document"][0].auto_model.state_dict()
    query = router.sub_modules["query"][0].auto_model.state_dict()
    reference = star[0].auto_model.state_dict()
    assert document.keys() == reference.keys()
    assert all(torch.equal(document[k], reference[k]) for k in reference)  # frozen: bit for bit
    assert not all(torch.equal(query[k], reference[k]) for k in reference)  # the query encoder trained
    # the document side of the saved model gives the stored embeddings
    corpus = adore["refs"]["corpus"].table()
    texts = passage_texts(corpus)[:8]
    np.testing.assert_allclose(both.encode_document(texts, normalize_embeddings=True),
                               embedding_matrix(emb.table())[:8], atol=1e-5)


def test_adore_hard_negatives_are_the_current_query_encoders_top_non_positives(adore):
    from sentence_transformers import SentenceTransformer

    job, calls, p = adore["job"], adore["calls"], adore["params"]
    assert len(calls) == 2  # one search per step
    docs = embedding_matrix(adore["emb"].table())
    doc_ids = adore["emb"].table().column("doc_id").to_pylist()
    row = {d: i for i, d in enumerate(doc_ids)}
    qrels = adore["refs"]["qrels"].table()
    queries = adore["refs"]["queries"].table()
    qid_of = dict(zip(queries.column("text").to_pylist(), queries.column("query_id").to_pylist()))
    train_pos, judged = positives(qrels, "train"), judged_positives(qrels)
    # every training query: its train positives are its relevant candidates, nothing judged is a negative
    for text, pos, excl in zip(job.queries, job.positives, job.excluded):
        qid = qid_of[text]
        assert set(pos) == {row[d] for d in train_pos[qid] if d in row}
        assert {row[d] for d in judged[qid] if d in row} <= set(pos) | excl
    plan = BatchPlan(len(job.queries), p.batch_size, p.seed)
    star = SentenceTransformer(adore["star"].path, device="cpu")
    star.max_seq_length = p.query_max_length
    embedded = {}
    for step, call in enumerate(calls):
        idx = plan.at(step)
        texts = [job.queries[i] for i in idx]
        q = call["q"].numpy()
        if step == 0:  # before any update: the starting encoder's own embeddings
            np.testing.assert_allclose(q, star.encode(texts, normalize_embeddings=True), atol=1e-5)
        scores = q @ docs.T
        for k, i in enumerate(idx):
            skip = set(job.positives[i]) | job.excluded[i]
            order = np.argsort(-scores[k], kind="stable")[:p.depth]
            expected = [int(r) for r in order if int(r) not in skip][:p.negatives_per_query]
            assert call["negatives"][k] == expected
            assert not set(expected) & skip
            assert not {doc_ids[r] for r in expected} & judged.get(qid_of[texts[k]], set())
            # ranks: in the whole corpus's ranking by this query
            m = int(call["valid"][k].sum())
            for r, rank in zip(call["rows"][k][:m].tolist(), call["ranks"][k][:m].tolist()):
                assert rank == 1 + int((scores[k] > scores[k, r]).sum())
            embedded.setdefault(texts[k], []).append(q[k])
    # the second step searched with the updated encoder, not with the first step's embeddings
    assert all(len(v) == 2 and not np.allclose(v[0], v[1], atol=1e-6) for v in embedded.values())


def test_adore_drops_the_positives_beyond_depth_unless_asked_to_keep_them():
    from irflow.learn.adore import beyond_depth_warning, candidates

    docs = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.0, 1.0], [0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # query 0 ranks rows 0,1,2,4,3; query 1 ranks 3,4,2,1,0
    positives, excluded = [{3: 1.0, 1: 2.0}, {0: 1.0}], [set(), {4}]
    kept = candidates(q, docs, positives, excluded, depth=3, negatives=None, beyond_depth="keep")
    dropped = candidates(q, docs, positives, excluded, depth=3, negatives=None)  # the default
    assert kept.negatives == dropped.negatives == [[0, 2], [3, 2]]  # a positive is never a negative, kept or not
    rows = [sorted(r[v].tolist()) for r, v in zip(dropped.rows, dropped.valid)]
    assert rows == [[0, 1, 2], [2, 3]]  # query 0 keeps row 1 (rank 2), loses row 3 (rank 5); query 1 has none left
    assert int(dropped.labels[1].sum()) == 0 and int(kept.labels[0].gt(0).sum()) == 2
    assert kept.beyond == dropped.beyond == pytest.approx(2 / 3)  # rows 3 and 0 of the three positives
    first = [{"beyond": 0.6}] * 3 + [{"beyond": 0.0}] * 27  # the first tenth of the steps decides
    assert "60% of the positives" in beyond_depth_warning(first, keep=True, depth=200)
    assert beyond_depth_warning(first, keep=False, depth=200) is None
    assert beyond_depth_warning(first[3:], keep=True, depth=200) is None


# ---- the recipe ---------------------------------------------------------------------------------------
TRAIN = {"batch_size": 8, "steps": 2, "query_max_length": 16, "checkpoint_every": 0}


@pytest.fixture(scope="module")
def star_sample(tmp_path_factory, shared_datasets):
    root = tmp_path_factory.mktemp("star")
    data = beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=5, n_train_queries=12,
                      n_extra_docs=30, seed=11)
    bi = make_tiny_bi_encoder(root / "bi", normalize=True)
    cfg = {"flow": "star", "dataset": {"name": "slice", "source": str(data), "split": "test"}, "base_model": str(bi),
           "bm25": {"variants": ["flat"], "depth": 100}, "dense": {"batch_size": 32, "depth": 100},
           "star": {**TRAIN, "passage_max_length": 48, "depth": 30, "negatives_per_query": 4},
           "adore": {**TRAIN, "depth": 20, "negatives_per_query": 5},
           "runtime": {"threads": 1}}
    config = root / "star.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return {"root": root, "config": config, "store": root / "store", "cfg": cfg}


@pytest.mark.parametrize("setting, message", [
    ("star.alpha=0", "star.alpha"),
    ("adore.negatives_per_query=50", "adore.negatives_per_query: 50 is more than the top 20"),
    ("adore.similarity=dot", "adore.similarity: dot, but STAR's embeddings are cos"),
    ("star.negatives_per_line=0", "star.negatives_per_line"),
    ("adore.splits=[test]", "adore.splits"),
    ("star.loss=infonce star.alpha=0.5", "star.alpha: weighs star's random negatives; loss is infonce"),
])
def test_bad_settings_are_refused_with_their_key(star_sample, setting, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        api.load_config(star_sample["config"], setting.split())


def test_the_infonce_control_trains_the_same_static_lines_under_a_softmax(star_sample):
    c = api.load_config(star_sample["config"], ["star.loss=infonce"])
    params = c.star.to(TrainDualEncoderParams)
    star = api.load_config(star_sample["config"]).star.to(TrainDualEncoderParams)
    assert params.loss == "infonce" and params.key_dump() == {**star.key_dump(), "loss": "infonce"}


def test_star_then_adore_end_to_end_cached_rerun_and_export(star_sample, prefect_harness, tmp_path):
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    from irflow.engine.store import TABLE_FILE, Store

    first = api.run(star_sample["config"], [], store=star_sample["store"])
    systems = {m["system"] for m in first.metrics}
    assert {"bm25-flat", "dense-bi", "star", "star-adore"} <= systems
    assert {"train_dual_encoder[star]", "train_query_encoder[adore]", "dense_search[star-adore]",
            "evaluate[star-adore]"} <= first.computed
    adore_id = first.stage("train_query_encoder[adore]").outputs["model"]
    star_id = first.stage("train_dual_encoder[star]").outputs["model"]
    index_id = first.stage("encode_corpus[adore]").outputs["embeddings"]
    assert index_id == first.stage("encode_corpus[star]").outputs["embeddings"]  # STAR's own corpus encoding
    assert first.selected["models"]["star-adore"] == adore_id
    store = Store(star_sample["store"])
    logs = {i: json.loads((store.object_dir(i) / "irflow_training.json").read_text()) for i in (star_id, adore_id)}
    assert (logs[star_id]["loss"], logs[adore_id]["loss"]) == ("star", "lambdaloss")
    catalog = api.catalog(star_sample["store"])
    ancestors = {d["dataset_id"] for d in catalog.lineage(adore_id)}
    assert {star_id, index_id} <= ancestors
    assert api.run(star_sample["config"], [], store=star_sample["store"]).computed == set()

    out = tmp_path / "exported"
    code, stdout, err = cli("export", first.run_id, "--system", "star-adore", "--out", out, "--store",
                            star_sample["store"])
    assert code == 0, err
    assert "encode_query" in (out / "README.md").read_text()
    exported = SentenceTransformer(str(out), device="cpu")

    def table(dataset_id):
        return pq.read_table(store.object_dir(dataset_id) / TABLE_FILE)

    # documents: the stored embeddings the run searched
    emb = embedding_matrix(table(index_id))
    corpus = table(first.stage("ingest").outputs["corpus"])
    texts = passage_texts(corpus)
    np.testing.assert_allclose(exported.encode_document(texts, normalize_embeddings=True), emb, atol=1e-5)
    # queries: the run's scores are the exported query embeddings against those documents
    ranking = table(first.stage("dense_search[star-adore]").outputs["run"]).to_pylist()
    queries = table(first.stage("select_queries[test]").outputs["queries"])
    q = exported.encode_query(queries.column("text").to_pylist(), normalize_embeddings=True)
    qi = {x: i for i, x in enumerate(queries.column("query_id").to_pylist())}
    di = {d: i for i, d in enumerate(corpus.column("doc_id").to_pylist())}
    got = [float(q[qi[r["query_id"]]] @ emb[di[r["doc_id"]]]) for r in ranking]
    np.testing.assert_allclose(got, [r["score"] for r in ranking], atol=1e-4)
    assert not np.allclose(q, exported.encode_document(queries.column("text").to_pylist(), normalize_embeddings=True),
                           atol=1e-4)  # two encoders, not one


def test_the_run_estimate_counts_the_trainers_steps_from_their_params(star_sample, tmp_path):
    from irflow.tools import estimate

    over = ["star.steps=null", "star.epochs=3", "adore.steps=null", "adore.epochs=2"]
    plan = api.status(star_sample["config"], over, store=tmp_path / "store")
    params = {p.name: p.params for p in plan}
    assert params["train_dual_encoder[star]"]["epochs"] == 3
    c = api.load_config(star_sample["config"], over)
    size = estimate.corpus_size(c.dataset)
    assert len(size.train_positives) == 12  # the slice's train queries, each with its positives counted
    hw = estimate.hardware()
    rows = {e.stage: e for e in estimate.estimate(c, list(params), size, hw, params)}
    assert rows["train_query_encoder[adore]"].work == "4 steps of 8"  # 2 epochs of 12 queries, 8 a step
    searched = estimate.searched_queries(plan, size)  # a fresh store: the run's own select_queries make them
    assert searched["dense_search[star-negatives]"] == 12 and "dense_search[star]" not in searched
    star = rows["train_dual_encoder[star]"]
    lines = size.train_pairs() * c.star.negative_lines
    assert star.work == f"{3 * math.ceil(lines / 8)} steps of 8"
    minilm = c.model_copy(update={"base_model": "all-MiniLM-L6-v2"})  # a real model's size: seconds, not hundredths
    label, star_params = "train_dual_encoder[star]", params["train_dual_encoder[star]"]
    e3, e6, e9 = (estimate.estimate(minilm, [label], size, hw, {label: {**star_params, "epochs": n}})[0].seconds
                  for n in (3, 6, 9))
    assert e9 - e6 == pytest.approx(e6 - e3, abs=0.2) and e6 - e3 > 1  # each 3 epochs cost the same time
    # no params given: the estimate plans the config itself, and counts the same steps
    assert estimate.estimate(minilm, [label], size, hw)[0].work == star.work
