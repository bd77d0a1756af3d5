"""RocketQA and ANCE end to end through irflow.api, under Prefect, on a real SciFact slice with tiny
local models; their data stages (denoise, augment) on real tables; and the refusals a user meets."""

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import yaml

from irflow import api
from irflow.dev.testing import beir_slice
from irflow.dev.testing import run_cli as cli
from irflow.engine.errors import ConfigError
from irflow.engine.store import DatasetRef
from irflow.learn.qrels import judged_positives
from irflow.learn.scoring import NotACrossEncoder
from irflow.learn.teachers import fit_platt, fit_platt_on_lists, sigmoid
from irflow.stages.augment import AugmentSettings, augment_tables
from irflow.stages.denoise import DenoiseParams, denoise_tables
from irflow.stages.score_candidates import candidate_pairs


@pytest.fixture(scope="module")
def setup(rocketqa_sample):
    return rocketqa_sample


def run(setup, flow, *sets):
    return api.run(setup[flow], list(sets), store=setup["store"])


def test_rocketqa_cold_run_every_system_then_fully_cached(setup, rocketqa_sample_run):
    result = rocketqa_sample_run  # the first run in its store (shared with tests/test_inside.py)
    assert {m["system"] for m in result.metrics} == {
        "bm25-flat", "dense-bi", "md0", "md0-bm25neg", "md1-ce", "md1-fusion", "md0-hardneg", "md1-listwise", "md2",
        "mc-rerank"}
    names = {s.name for s in result.stages}
    for stage in ("train_dual_encoder[md0]", "dense_search[md0-train]", "train_cross_encoder", "score_candidates[ce]",
                  "denoise[ce]", "score_candidates[fusion]", "denoise[fusion]", "score_candidates[augment]", "augment",
                  "train_dual_encoder[md2]", "rerank[mc]"):
        assert stage in names
    # M_D0's corpus embeddings are computed once: its train-query retrieval and its test run share them.
    enc = [s for s in result.stages if s.name in ("encode_corpus[md0-train]", "encode_corpus[md0]")]
    assert len({s.dataset_id for s in enc}) == 1 and sorted(s.status for s in enc) == ["cached", "computed"]
    assert run(setup, "rocketqa").computed == set()


def test_denoise_threshold_recomputes_denoise_onward_only(setup):
    first = run(setup, "rocketqa")
    changed = run(setup, "rocketqa", "denoise.negative_threshold=0.95").computed
    downstream = {"denoise[ce]", "denoise[fusion]", "score_candidates[augment]", "augment", "encode_corpus[md1-augment]",
                  "dense_search[md1-augment]"}
    for name in ("md1-ce", "md1-fusion", "md2"):
        downstream |= {f"train_dual_encoder[{name}]", f"encode_corpus[{name}]", f"dense_search[{name}]",
                       f"evaluate[{name}]"}
    assert {"denoise[ce]", "denoise[fusion]"} <= changed <= downstream
    # the teachers' scoring (a cross-encoder over every candidate: denoising's cost) is not redone
    assert not changed & {"score_candidates[ce]", "score_candidates[fusion]", "train_cross_encoder"}
    # What a denoiser's output is identical for is not recomputed either (content ids): everything else
    # of the first run is reused.
    assert {s.name for s in first.stages} - downstream <= run(setup, "rocketqa", "denoise.negative_threshold=0.95").cached


def test_augment_threshold_redecides_without_rescoring(setup, rocketqa_sample_run):
    changed = run(setup, "rocketqa", "augment.negative_threshold=0.3").computed
    assert "augment" in changed
    # M_C's reading of the unlabelled queries' candidates is not redone; only M_D2 can change
    assert changed <= {"augment", "train_dual_encoder[md2]", "encode_corpus[md2]", "dense_search[md2]", "evaluate[md2]"}


def test_cross_encoder_lr_recomputes_from_m_c_onward(setup, rocketqa_sample_run):
    changed = run(setup, "rocketqa", "cross_encoder.lr=5.0e-5").computed
    m_c_onward = {"train_cross_encoder", "rerank[mc]", "evaluate[mc-rerank]", "score_candidates[ce]", "denoise[ce]",
                  "score_candidates[augment]", "augment",
                  "train_dual_encoder[md1-listwise]", "encode_corpus[md1-augment]", "dense_search[md1-augment]"}
    for name in ("md1-ce", "md2", "md1-listwise"):
        m_c_onward |= {f"train_dual_encoder[{name}]", f"encode_corpus[{name}]", f"dense_search[{name}]",
                       f"evaluate[{name}]"}
    # (a student whose denoised data came out identical is reused: ids are content fingerprints)
    assert {"train_cross_encoder", "rerank[mc]", "evaluate[mc-rerank]", "score_candidates[ce]",
            "denoise[ce]"} <= changed <= m_c_onward
    # M_D0, its retrieval, BM25, the fusion denoiser and what it alone feeds are reused.
    assert not changed & {"train_dual_encoder[md0]", "dense_search[md0-train]", "bm25_search[bm25-train]",
                          "score_candidates[fusion]", "denoise[fusion]", "train_dual_encoder[md1-fusion]",
                          "train_dual_encoder[md0-hardneg]",
                          "evaluate[bm25-flat]", "evaluate[md0]"}


def test_m_c_fused_with_m_d0_is_the_weighted_sum_of_their_z_scores_over_the_re_ranked_top(setup, rocketqa_sample_run):
    """cross_encoder.rerank_md0_weight adds one fuse and one evaluate (M_C and M_D0 reused); per query
    the fused order is w z(M_D0) + (1 - w) z(M_C) over the passages M_C re-ranked."""
    import pyarrow.parquet as pq

    from irflow.engine.store import TABLE_FILE, Store

    result = run(setup, "rocketqa", "cross_encoder.rerank_md0_weight=0.3")
    assert result.computed == {"fuse[mc-rerank-fused]", "evaluate[mc-rerank-fused]"}
    assert "mc-rerank-fused" in {m["system"] for m in result.metrics}
    store = Store(setup["store"])
    depth = api.load_config(setup["rocketqa"], []).cross_encoder.rerank.depth

    def rows(stage):
        t = pq.read_table(store.object_dir(result.stage(stage).outputs["run"]) / TABLE_FILE).to_pylist()
        by_q = {}
        for r in t:
            if r["rank"] <= depth:
                by_q.setdefault(r["query_id"], {})[r["doc_id"]] = r["score"]
        return by_q

    md0, mc, fused = rows("dense_search[md0]"), rows("rerank[mc]"), rows("fuse[mc-rerank-fused]")
    assert fused.keys() == mc.keys() and len(fused) > 5

    def z(scores, docs):
        v = np.array([scores[d] for d in docs], dtype=np.float64)
        return (v - v.mean()) / v.std() if v.std() > 0 else np.zeros_like(v)

    moved = 0
    for q, got in fused.items():
        docs = sorted(mc[q])
        assert set(got) == set(docs) == set(md0[q])  # the same candidates, none added or lost
        want = 0.3 * z(md0[q], docs) + 0.7 * z(mc[q], docs)
        np.testing.assert_allclose([got[d] for d in docs], want, atol=1e-4)
        moved += [d for d in sorted(got, key=got.get, reverse=True)] != sorted(mc[q], key=mc[q].get, reverse=True)
    assert moved  # the fusion changed some query's order: it is not M_C's ranking under another name
    code, _, err = cli("config", setup["rocketqa"], "--set", "cross_encoder.rerank_md0_weight=1.5")
    assert code == 2 and "cross_encoder.rerank_md0_weight" in err and "Traceback" not in err


def test_a_listwise_m_c_never_thresholds_raw_logits(setup):
    """A listwise cross-encoder's logits are not probabilities: denoising by M_C, and augmentation labelled
    by it, need Platt calibration (a fusion-only denoiser needs nothing)."""
    listwise = ["cross_encoder.loss=listwise", "denoise.teachers=[cross_encoder, fusion]"]
    with pytest.raises(ConfigError, match="denoise.calibration.method: platt"):
        api.load_config(setup["rocketqa"], listwise)
    c = api.load_config(setup["rocketqa"], [*listwise, "denoise.calibration.method=platt", "augment.enabled=true"])
    assert c.cross_encoder.loss == "listwise"
    assert api.load_config(setup["rocketqa"], ["cross_encoder.loss=listwise", "denoise.teachers=[fusion]",
                                               "augment.enabled=true"]).denoise.teachers == ("fusion",)


def test_platt_calibrated_m_c_labels_augmentation_with_the_fit_it_denoised_with(setup, rocketqa_sample_run):
    """With denoise.calibration.method: platt, M_C's augmentation probabilities are sigmoid(a * score + b),
    (a, b) fitted on the labelled lists M_C scored for denoising -- what a listwise M_C needs. M_C and its
    scoring of the labelled lists are reused; the augment stage reads denoise[ce]'s scores as its
    calibration input."""
    import pyarrow.parquet as pq

    from irflow.engine.store import TABLE_FILE, Store
    from irflow.stages.augment import AugmentParams

    platt = ["denoise.calibration.method=platt"]
    first = run(setup, "rocketqa", *platt)
    assert {"denoise[ce]", "augment"} <= first.computed
    # M_D1-ce changes, and so does what it retrieves to label; M_C and its reading of the labelled lists do not
    assert not first.computed & {"train_cross_encoder", "score_candidates[ce]"}
    store = Store(setup["store"])

    def table(result, stage, output):
        return pq.read_table(store.object_dir(result.stage(stage).outputs[output]) / TABLE_FILE)

    cal = table(first, "denoise[ce]", "scores")
    a, b = fit_platt_on_lists(cal.column("score").to_numpy(), np.array(cal.column("positive").to_pylist(), float),
                              cal.column("rank").to_numpy())
    assert a > 0 and (a, b) != (1.0, 0.0)  # M_C ranks judged positives higher; the fit is not the identity
    scored = table(first, "score_candidates[augment]", "out")
    raw = scored.column("score").to_numpy().astype(np.float64)
    prob = sigmoid(a * raw + b)
    # Thresholds read off the calibrated probabilities; a threshold change re-decides from the same scores.
    t = _thresholds(scored, prob)
    sets = [*platt, f"augment.positive_threshold={t['positive_threshold']}",
            f"augment.negative_threshold={t['negative_threshold']}"]
    result = run(setup, "rocketqa", *sets)
    assert "augment" in result.computed and "score_candidates[augment]" not in result.computed
    plan = {s.name: s for s in api.status(setup["rocketqa"], sets, store=setup["store"])}
    assert plan["augment"].inputs["calibration"] == [result.stage("denoise[ce]").outputs["scores"]]

    c = api.load_config(setup["rocketqa"], sets)
    p = c.augment.to(AugmentParams, calibration=c.denoise.calibration)
    pairs = list(zip(*(scored.column(k).to_pylist() for k in ("query_id", "doc_id", "rank"))))
    want = augment_tables(p, pairs, prob)
    got = table(result, "augment", "qrels").to_pylist()
    assert got == want["qrels"].to_pylist() and 0 < len(got) < len(set(scored.column("query_id").to_pylist()))
    assert table(result, "augment", "negatives").to_pylist() == want["negatives"].to_pylist()
    # the same scores through a plain sigmoid decide otherwise: the calibration is what augment applied
    plain = augment_tables(p, pairs, sigmoid(raw))
    assert (plain["qrels"].to_pylist(), plain["negatives"].to_pylist()) != (got, want["negatives"].to_pylist())


def test_denoise_outputs_are_consistent(setup):
    import pyarrow.parquet as pq

    from irflow.engine.store import TABLE_FILE, Store

    result = run(setup, "rocketqa")
    store = Store(setup["store"])

    def table(stage, output):
        return pq.read_table(store.object_dir(result.stage(stage).outputs[output]) / TABLE_FILE)

    neg, audit, scores = (table("denoise[ce]", o) for o in ("negatives", "audit", "scores"))
    png = store.object_dir(result.stage("denoise[ce]").outputs["histogram"]) / "histogram.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    judged = judged_positives(table("ingest", "qrels"))
    assert neg.num_rows > 0
    for q, d in zip(neg.column("query_id").to_pylist(), neg.column("doc_id").to_pylist()):
        assert d not in judged.get(q, set())
    probs = scores.column("prob").to_numpy()
    assert ((probs >= 0) & (probs <= 1)).all()
    # Every judged positive of a train query was scored too (calibration, listwise distillation).
    scored_pos = {(q, d) for q, d, pos in zip(*(scores.column(c).to_pylist() for c in ("query_id", "doc_id",
                                                                                      "positive"))) if pos}
    assert scored_pos and all(d in judged[q] for q, d in scored_pos)
    # The audit's kept negatives are the denoised (not filled) rows of the negatives table.
    denoised = pc.sum(pc.equal(neg.column("miner"), "denoised")).as_py()
    assert pc.sum(audit.column("kept")).as_py() == denoised
    assert set(audit.column("bucket").to_pylist()) == {"1-5", "6-10", "11-20", "21-50"}


def test_ance_adding_a_round_computes_that_round_and_its_evaluation_only(setup):
    first = run(setup, "ance")
    assert {m["system"] for m in first.metrics} == {"bm25-flat", "dense-bi", "ance-warmup", "ance-round1",
                                                   "ance-round2"}
    changed = run(setup, "ance", "rounds=3").computed
    assert changed == {"dense_search[ance-r3-train]", "mine_negatives[ance-r3]", "train_dual_encoder[ance-round3]",
                       "encode_corpus[ance-round3]", "dense_search[ance-round3]", "evaluate[ance-round3]"}
    # Round 3 retrieved with round 2's model: the encode of its train queries is round 2's evaluation encode.
    second = run(setup, "ance", "rounds=3")
    stage = {s.name: s for s in second.stages}
    assert stage["encode_corpus[ance-r3-train]"].dataset_id == stage["encode_corpus[ance-round2]"].dataset_id


def test_ance_control_trains_the_rounds_on_the_warmup_negatives_without_a_refresh(setup):
    refreshed = run(setup, "ance")
    control = run(setup, "ance", "round.negatives=warmup")
    # No index refresh: no train-query retrieval, no mining of a model's list; the warm-up is reused.
    refresh = {f"{stage}[ance-r{r}{suffix}]" for r in (1, 2)
               for stage, suffix in (("encode_corpus", "-train"), ("dense_search", "-train"), ("mine_negatives", ""))}
    assert refresh <= {s.name for s in refreshed.stages}
    assert not refresh & {s.name for s in control.stages}
    assert "train_dual_encoder[ance-warmup]" in control.cached
    assert {"train_dual_encoder[ance-round1]", "train_dual_encoder[ance-round2]"} <= control.computed
    assert {m["system"] for m in control.metrics} == {m["system"] for m in refreshed.metrics}
    # Each round reads the warm-up's BM25 negatives, and continues from the previous round's model.
    plan = {s.name: s for s in api.status(setup["ance"], ["round.negatives=warmup"], store=setup["store"])}
    bm25_negatives = plan["mine_negatives[bm25]"].outputs["negatives"]
    for r, previous in ((1, "ance-warmup"), (2, "ance-round1")):
        stage = plan[f"train_dual_encoder[ance-round{r}]"]
        assert stage.inputs["negatives"] == [bm25_negatives]
        assert stage.inputs["base_model"] == [plan[f"train_dual_encoder[{previous}]"].outputs["model"]]
    assert refreshed.stage("train_dual_encoder[ance-round1]").outputs["model"] != \
        control.stage("train_dual_encoder[ance-round1]").outputs["model"]


# ---- data stages on real tables ---------------------------------------------------------------------
def test_hybrid_fuses_bm25_with_the_zero_shot_model_and_each_dual_encoder_reusing_what_is_stored(setup,
                                                                                               rocketqa_sample_run):
    """hybrid.enabled (off by default in RocketQA and ANCE) adds a fuse and an evaluate per system and trains
    nothing: `hybrid` (BM25 + the zero-shot model) and hybrid-<model> for each dual encoder, each BM25's test
    run fused with the model's as `hybrid` fuses them. ANCE's `hybrid` reads the same BM25 and zero-shot runs
    here: the very dataset RocketQA's run stored, reused."""
    import pyarrow.parquet as pq

    from irflow.engine.store import TABLE_FILE, Store
    from irflow.learn.fusion import fuse_runs

    duals = ("md0", "md0-bm25neg", "md1-ce", "md1-fusion", "md0-hardneg", "md1-listwise", "md2")
    result = run(setup, "rocketqa", "hybrid.enabled=true")
    systems = ("hybrid", *(f"hybrid-{d}" for d in duals))
    assert result.computed == {f"{stage}[{s}]" for s in systems for stage in ("fuse", "evaluate")}
    metrics = {m["system"]: m["ndcg@10"] for m in result.metrics}
    assert set(systems) <= metrics.keys() and all(0 <= metrics[s] <= 1 for s in systems)

    store = Store(setup["store"])
    table = lambda stage: pq.read_table(store.object_dir(result.stage(stage).outputs["run"]) / TABLE_FILE)  # noqa: E731
    hybrid = api.load_config(setup["rocketqa"], ["hybrid.enabled=true"]).hybrid
    for fused, dense in (("hybrid", "dense_search[zero-shot]"), ("hybrid-md2", "dense_search[md2]")):
        p = hybrid.params("bm25-flat", "dense-bi") if fused == "hybrid" else hybrid.student_params("bm25-flat", "md2")
        assert p.weights == {"bm25-flat": 0.3, "dense-bi" if fused == "hybrid" else "md2": 0.7}
        want = fuse_runs([table("bm25_search[flat]"), table(dense)], method=p.method, weights=p.weights,
                         rrf_k=p.rrf_k, input_depth=p.input_depth, depth=p.depth, system=fused)
        got = table(f"fuse[{fused}]")
        assert got.num_rows == want.num_rows > 0
        assert got.column("doc_id").to_pylist() == want.column("doc_id").to_pylist()
    assert table("fuse[hybrid-md2]").column("doc_id") != table("fuse[hybrid]").column("doc_id")

    plain = run(setup, "ance")  # cached after the ANCE tests above (computed when this test runs alone)
    assert not {m["system"] for m in plain.metrics} & {"hybrid", "hybrid-ance-warmup"}  # off by default
    ance = run(setup, "ance", "hybrid.enabled=true")
    assert ance.computed == {f"{stage}[hybrid-ance-{m}]" for m in ("warmup", "round1", "round2")
                             for stage in ("fuse", "evaluate")}
    assert ance.stage("fuse[hybrid]").outputs["run"] == result.stage("fuse[hybrid]").outputs["run"]


def test_denoise_walks_ranks_with_quota_threshold_and_fill():
    p = DenoiseParams(negative_threshold=0.1,
                      negatives_per_positive=2, fill_ranks=(7, 20), buckets=(3, 6))
    import pyarrow as pa

    docs = [f"d{i}" for i in range(1, 21)]
    run = pa.table({"query_id": ["q"] * 20, "doc_id": docs, "rank": pa.array(range(1, 21), pa.int32())})
    pos = {"q": {"d2"}}
    triples, ranks = candidate_pairs(run, pos, 6)
    assert [t[1] for t in triples] == ["d1", "d2", "d3", "d4", "d5", "d6"]
    prob = {"d1": 0.95, "d2": 0.9, "d3": 0.05, "d4": 0.5, "d5": 0.01, "d6": 0.02}
    out = denoise_tables(p, triples, np.array([prob[t[1]] for t in triples]), np.zeros(6), pos, pos, ranks)
    neg = out["negatives"].to_pylist()
    # quota 2 (1 positive x 2): d3 and d5 (p < 0.1, in rank order); d1 and d4 dropped; d6 over the quota.
    assert [(r["doc_id"], r["miner"], r["rank"]) for r in neg] == [("d3", "denoised", 3), ("d5", "denoised", 5)]
    audit = {r["bucket"]: r for r in out["audit"].to_pylist()}
    assert (audit["1-3"]["candidates"], audit["1-3"]["known_positives"], audit["1-3"]["dropped"],
            audit["1-3"]["kept"]) == (3, 1, 1, 1)
    assert (audit["4-6"]["dropped"], audit["4-6"]["kept"]) == (1, 1)
    # A stricter threshold keeps fewer: the query is filled from ranks 7-20, never a positive.
    strict = p.model_copy(update={"negative_threshold": 0.015})
    out = denoise_tables(strict, triples, np.array([prob[t[1]] for t in triples]), np.zeros(6), pos, pos, ranks)
    rows = out["negatives"].to_pylist()
    assert [r["doc_id"] for r in rows if r["miner"] == "denoised"] == ["d5"]
    fill = [r for r in rows if r["miner"] == "fill"]
    assert len(fill) == 1 and 7 <= fill[0]["rank"] <= 20


def test_augment_keeps_confident_queries_only():
    s = AugmentSettings(positive_threshold=0.9, negative_threshold=0.1, negatives_per_query=2)
    pairs = [("a", "x", 1), ("a", "y", 2), ("a", "z", 3), ("a", "w", 4), ("b", "x", 1), ("b", "y", 2)]
    prob = np.array([0.95, 0.05, 0.5, 0.02, 0.6, 0.01])
    out = augment_tables(s, pairs, prob)
    assert out["qrels"].to_pylist() == [{"query_id": "a", "doc_id": "x", "score": 1, "split": "augmented"}]
    assert sorted(out["negatives"].column("doc_id").to_pylist()) == ["w", "y"]  # z (0.5) is not a negative


# ---- augmentation: the teacher's scoring (score_candidates, split null, sharded) and the decision --------
@pytest.fixture(scope="module")
def unlabelled(tmp_path_factory, shared_datasets):
    """Augmentation's inputs on a real SciFact slice: 14 queries (their labels unused), a word-overlap
    ranking standing in for M_D1's list, a second one (titles only) for the fusion teacher, a tiny M_C."""
    from irflow.dev.testing import ingest_folder, lexical_run, make_tiny_cross_encoder, model
    from irflow.engine.runner import Run
    from irflow.learn.text import passage_texts

    base = tmp_path_factory.mktemp("augment")
    run = Run(str(base / "store"), "augment")
    beir = ingest_folder(run, beir_slice(shared_datasets / "scifact.zip", base / "slice", n_test_queries=6,
                                         n_train_queries=8, n_extra_docs=40, seed=2))
    corpus, queries = beir["corpus"].table(), beir["queries"].table()
    ids = corpus.column("doc_id").to_pylist()
    qtext = dict(zip(queries.column("query_id").to_pylist(), queries.column("text").to_pylist()))
    pub = lambda t: run.store.publish_table("run", "run", t)[0]  # noqa: E731
    return {"run": run, "queries": beir["queries"], "corpus": beir["corpus"], "qrels": beir["qrels"],
            "ranking": pub(lexical_run(qtext, dict(zip(ids, passage_texts(corpus))), "md1", 12)),
            "titles": pub(lexical_run(qtext, dict(zip(ids, corpus.column("title").to_pylist())), "bm25", 12)),
            "ce": model(run, make_tiny_cross_encoder(base / "ce"))}


def _augment_scoring(env, teacher: str, depth: int = 8):
    from irflow.stages.score_candidates import ScoreCandidatesParams

    inputs = dict(ranking=env["ranking"], queries=env["queries"], corpus=env["corpus"])
    if teacher == "cross_encoder":
        spec, inputs["teacher"] = {"type": "cross_encoder", "batch_size": 8, "max_length": 64}, env["ce"]
    else:
        spec, inputs["teacher_rankings"] = {"type": "fusion"}, [env["titles"], env["ranking"]]
    return ScoreCandidatesParams(depth=depth, split=None, teacher=spec), inputs


def _thresholds(scores, prob=None) -> dict:
    """Thresholds from the teacher's own probabilities (``prob``, default the scores' sigmoid), so that some
    queries are kept and some dropped, and negatives are found, whatever the tiny teacher's scale."""
    if prob is None:
        prob = sigmoid(scores.column("score").to_numpy().astype(np.float64))
    top1 = {}
    for q, pr in zip(scores.column("query_id").to_pylist(), prob):
        top1[q] = max(top1.get(q, 0.0), pr)
    return {"positive_threshold": float(np.median(list(top1.values()))),
            "negative_threshold": float(np.quantile(prob, 0.4)), "negatives_per_query": 3, "seed": 9}


@pytest.mark.parametrize("teacher", ["cross_encoder", "fusion"])
def test_augment_scoring_in_shards_gives_the_data_of_one_shard_and_of_the_single_stage(unlabelled, teacher):
    """The teacher's reading of the unlabelled queries' top `depth` in shards of 4 queries publishes the
    scores (and so the augmented qrels and negatives) one shard does; and those equal what the single
    augment stage computed: the ranking's top depth scored at once, probabilities, the same decision."""
    from irflow.engine.runner import Run
    from irflow.engine.runtime import RuntimeConfig, StageRuntime
    from irflow.learn.teachers import teacher_scores
    from irflow.learn.text import doc_texts, query_texts
    from irflow.stages.augment import AugmentParams, augment
    from irflow.stages.score_candidates import score_candidates

    env = unlabelled
    p, inputs = _augment_scoring(env, teacher)
    store, forced = env["run"].store_root, {"score_candidates[augment]"}  # runtime is not keyed: both computed
    one_run = Run(store, f"one-{teacher}", force=forced)
    many_run = Run(store, f"many-{teacher}", runtime=RuntimeConfig(shard_rows=4), force=forced)
    scores = score_candidates.run(one_run, p, tag="augment", **inputs)
    s = scores.table()
    assert s.num_rows == 14 * 8 and set(s.column("query_id").to_pylist()) == set(
        env["queries"].table().column("query_id").to_pylist())  # every query's top 8, nothing judged
    assert not any(s.column("positive").to_pylist()) and max(s.column("rank").to_pylist()) == 8
    a = AugmentParams(**_thresholds(s))
    one = augment.run(one_run, a, scores=scores)
    many = augment.run(many_run, a, scores=score_candidates.run(many_run, p, tag="augment", **inputs))
    done = {run.run_id: run.catalog.stage_runs(run.run_id) for run in (one_run, many_run)}
    assert [len(r["shards"]) for r in done[one_run.run_id]] == [1, 0]
    assert [len(r["shards"]) for r in done[many_run.run_id]] == [4, 0]  # 14 queries in shards of 4
    assert [r["outputs"] for r in done[many_run.run_id]] == [r["outputs"] for r in done[one_run.run_id]]
    assert {k: v.id for k, v in many.items()} == {k: v.id for k, v in one.items()}
    qrels, negatives = one["qrels"].table(), one["negatives"].table()
    assert 0 < qrels.num_rows < 14 and negatives.num_rows > 0

    # what the single stage computed: the ranking's top 8 read at once, raw scores, sigmoid, the decision
    r = env["ranking"].table()
    top = [t for t in zip(*(r.column(c).to_pylist() for c in ("query_id", "doc_id", "rank"))) if t[2] <= 8]
    raw = teacher_scores(p.teacher, [(q, d) for q, d, _ in top], query_texts(env["queries"].table()),
                         doc_texts(env["corpus"].table()), runs=[t.table() for t in inputs.get("teacher_rankings", [])],
                         model=inputs.get("teacher"), rt=StageRuntime())
    expected = augment_tables(a, top, sigmoid(raw))
    assert qrels.to_pylist() == expected["qrels"].to_pylist()
    assert negatives.to_pylist() == expected["negatives"].to_pylist()
    # unlabelled scoring reads no qrels; labelled scoring needs them
    with pytest.raises(ValueError, match="reads no qrels"):
        score_candidates.fn(p, StageRuntime(), qrels=env["qrels"], **inputs)
    with pytest.raises(ValueError, match="needs the qrels input"):
        score_candidates.fn(p.model_copy(update={"split": "train"}), StageRuntime(), **inputs)


def test_an_augment_threshold_change_redecides_without_rescoring(unlabelled):
    from irflow.engine.runner import Run
    from irflow.stages.augment import AugmentParams, augment
    from irflow.stages.score_candidates import score_candidates

    env = unlabelled
    p, inputs = _augment_scoring(env, "fusion", depth=6)
    first = Run(env["run"].store_root, "threshold-1")
    scores = score_candidates.run(first, p, tag="augment", **inputs)
    t = _thresholds(scores.table())
    before = augment.run(first, AugmentParams(**t), scores=scores)
    second = Run(env["run"].store_root, "threshold-2")
    higher = dict(t, positive_threshold=min(1.0, t["positive_threshold"] + 0.02))
    rescored = score_candidates.run(second, p, tag="augment", **inputs)
    after = augment.run(second, AugmentParams(**higher), scores=rescored)
    assert [(r["name"], r["status"]) for r in second.catalog.stage_runs(second.run_id)] == [
        ("score_candidates[augment]", "cached"), ("augment", "computed")]
    assert after["qrels"].table().num_rows < before["qrels"].table().num_rows  # fewer queries confident enough


def test_platt_recovers_a_known_calibration():
    rng = np.random.default_rng(0)
    s = rng.normal(0, 2, 20000)
    y = (rng.random(20000) < sigmoid(1.7 * s - 0.8)).astype(float)
    a, b = fit_platt(s, y)
    assert a == pytest.approx(1.7, abs=0.1) and b == pytest.approx(-0.8, abs=0.1)


def test_platt_converges_where_plain_newton_diverged():
    """Scores shaped like NFCorpus's fusion teacher: unjudged candidates around 1, judged positives both
    high (in the lists) and low (outside them, 43 per query). Plain Newton from a = 1 went to
    a ~ 8e10 here; the fit must be finite and at least as likely as every point of a grid."""
    rng = np.random.default_rng(1)
    s = np.concatenate([rng.normal(1.3, 1.5, 161000), rng.normal(3.9, 3.0, 13000), rng.normal(-1.1, 0.5, 51000)])
    y = np.concatenate([np.zeros(161000), np.ones(13000), np.ones(51000)])
    a, b = fit_platt(s, y)

    def nll(a, b):
        z = a * s + b
        return float(np.sum(y * np.logaddexp(0, -z) + (1 - y) * np.logaddexp(0, z)))

    assert abs(a) < 10 and abs(b) < 10
    best_on_grid = min(nll(ga, gb) for ga in np.linspace(-3, 3, 25) for gb in np.linspace(-3, 3, 25))
    assert nll(a, b) <= best_on_grid + 1e-6 * best_on_grid


def _table_ref(root: Path, name: str, table) -> DatasetRef:
    import pyarrow.parquet as pq

    (root / name).mkdir(parents=True)
    pq.write_table(table, root / name / "data.parquet")
    return DatasetRef(id=name, name=name, kind="table", contract=None, path=str(root / name))


def test_platt_denoising_is_fitted_on_the_lists_not_on_the_positives_outside_them(tmp_path):
    """NFCorpus's shape: many judged positives per query, most of them outside the retriever's top 50,
    where a fusion teacher gives them its floor score. Fitted on every row, the slope turned negative
    (low ranks dropped as likely positives, the top kept as negatives); fitted on the lists, the
    probability rises with the score, and the audit drops fewer unjudged candidates the lower the rank."""
    import pyarrow as pa

    from irflow.engine.runtime import StageRuntime
    from irflow.stages.denoise import denoise

    rng = np.random.default_rng(3)
    qrels, run, scored = [], [], []
    for q in range(120):
        qid = f"q{q}"
        for r in range(1, 201):
            d, score = f"{qid}-d{r}", 4.0 - 0.05 * r + rng.normal(0, 0.7)
            run.append((qid, d, r, score))
            positive = r <= 50 and rng.random() < 0.4 * np.exp(-r / 15)  # judged more often near the top
            if positive:
                qrels.append((qid, d))
            if r <= 50 or positive:
                scored.append((qid, d, r, score, positive))
        for k in range(30):  # judged positives the run missed: rank 0, the fusion's floor
            qrels.append((qid, f"{qid}-missed{k}"))
            scored.append((qid, f"{qid}-missed{k}", 0, -4.0 + rng.normal(0, 0.3), True))
    cols = lambda rows, names: {n: [r[i] for r in rows] for i, n in enumerate(names)}  # noqa: E731
    refs = {
        "qrels": _table_ref(tmp_path, "qrels", pa.table({**cols(qrels, ["query_id", "doc_id"]),
                                                         "score": pa.array([1] * len(qrels), pa.int32()),
                                                         "split": ["train"] * len(qrels)})),
        "ranking": _table_ref(tmp_path, "run", pa.table({**cols(run, ["query_id", "doc_id", "rank", "score"]),
                                                     "system": ["md0"] * len(run)})),
        "scores": _table_ref(tmp_path, "scores", pa.table(cols(scored, ["query_id", "doc_id", "rank", "score",
                                                                        "positive"]))),
    }
    p = DenoiseParams(calibration={"method": "platt"}, fill_ranks=(51, 200))
    out = denoise.fn(p, StageRuntime(workdir=tmp_path / "work"), **refs)

    # the probability rises with the teacher's score (a > 0)
    score, prob = (out["scores"].column(c).to_numpy() for c in ("score", "prob"))
    by_score = prob[np.argsort(score, kind="stable")]
    assert np.all(np.diff(by_score) >= -1e-6) and by_score[-1] > by_score[0] + 0.5  # (float32 ties)
    audit = out["audit"].to_pylist()
    share = {}
    for row in audit:
        b = share.setdefault(row["bucket"], [0, 0])
        b[0] += row["dropped"]
        b[1] += row["candidates"] - row["known_positives"]
    shares = [share[b][0] / share[b][1] for b in ("1-5", "6-10", "11-20", "21-50")]
    assert shares == sorted(shares, reverse=True) and shares[0] > shares[-1], shares


def test_platt_on_lists_refuses_lists_without_a_judged_positive():
    ranks = np.array([1, 2, 3, 0, 0])
    labels = np.array([0.0, 0.0, 0.0, 1.0, 1.0])  # the judged positives are all outside the lists
    with pytest.raises(ValueError, match="0 judged positive"):
        fit_platt_on_lists(np.array([3.0, 2.0, 1.0, -5.0, -5.0]), labels, ranks)


# ---- refusals ---------------------------------------------------------------------------------------
def _cfg(setup, flow="rocketqa", **update):
    cfg = yaml.safe_load(Path(setup[flow]).read_text())
    for k, v in update.items():
        cfg[k] = v
    return cfg


def test_test_split_as_training_or_unlabelled_source_is_refused(setup, tmp_path):
    store = tmp_path / "store"
    with pytest.raises(ConfigError, match="train_split: 'test' is the evaluated split"):
        api.run(_cfg(setup, train_split="test"), store=store)
    with pytest.raises(ConfigError, match="train_split: 'test' is the evaluated split"):
        api.run(_cfg(setup, "ance", train_split="test"), store=store)
    aug = dict(_cfg(setup)["augment"], queries={"source": "unlabelled", "split": "test"})
    with pytest.raises(ConfigError, match="test queries must not be used for training"):
        api.run(_cfg(setup, augment=aug), store=store)
    aug = dict(_cfg(setup)["augment"], queries={"source": "unlabelled", "split": "train"})
    with pytest.raises(ConfigError, match="augment.queries.split: 'train' is the labelled split"):
        api.run(_cfg(setup, augment=aug), store=store)
    assert not store.exists()  # refused before anything was created


def test_thresholds_outside_unit_interval_and_missing_train_split(setup, tmp_path, shared_datasets):
    code, out, err = cli("run", setup["rocketqa"], "--store", tmp_path / "s", "--set", "denoise.negative_threshold=1.5",
                         "--set", "augment.positive_threshold=-0.1")
    assert code == 2 and "denoise.negative_threshold" in err and "augment.positive_threshold" in err
    assert "less than or equal to 1" in err and "Traceback" not in err
    no_train = beir_slice(shared_datasets / "scifact.zip", tmp_path / "no-train", n_test_queries=4, n_extra_docs=10)
    code, out, err = cli("run", setup["rocketqa"], "--store", tmp_path / "s", "--set", f"dataset.source={no_train}")
    assert code == 2 and "train_split: 'train' is not a split of" in err and "(its qrels: test)" in err
    assert not (tmp_path / "s").exists()


def test_a_bi_encoder_given_as_the_cross_encoder_is_refused(setup, tmp_path):
    code, out, err = cli("run", setup["rocketqa"], "--store", tmp_path / "s", "--set", "cross_encoder.train=false",
                         "--set", f"cross_encoder.model={setup['bi']}")
    assert code == 2
    assert "cross_encoder.model" in err and "bi-encoder, not a cross-encoder" in err and "Traceback" not in err
    # A real (tiny) cross-encoder is accepted as M_C without training.
    c = api.load_config(setup["rocketqa"], ["cross_encoder.train=false", f"cross_encoder.model={setup['ce']}"])
    api.preflight(c, str(tmp_path / "s2"))
    with pytest.raises(NotACrossEncoder, match="ForSequenceClassification"):
        from irflow.learn.scoring import check_cross_encoder

        hf = tmp_path / "plain"
        hf.mkdir()
        (hf / "config.json").write_text('{"architectures": ["BertModel"]}')
        check_cross_encoder(str(hf))


def test_hub_configs_fail_fast_offline_naming_the_model(tmp_path):
    for config in ("configs/rocketqa_scifact.yaml", "configs/ance_scifact.yaml"):
        code, out, err = cli("run", config, "--store", tmp_path / "s")
        assert code == 2, err
        assert "base_model" in err and "Traceback" not in err
        assert not (tmp_path / "s").exists()


def test_m_c_is_evaluated_at_the_length_it_was_trained_on(setup):
    """The re-ranking of mc-rerank reads cross_encoder.max_length tokens unless rerank.max_length is
    set (a 128-token M_C scored on 256 tokens sees inputs it was never trained on)."""
    c = api.load_config(setup["rocketqa"], ["cross_encoder.max_length=96"])
    assert c.cross_encoder.rerank.max_length == 96 == c.cross_encoder.scoring().max_length
    c = api.load_config(setup["rocketqa"], ["cross_encoder.max_length=96", "cross_encoder.rerank.max_length=200"])
    assert c.cross_encoder.rerank.max_length == 200
    c = api.load_config(setup["rocketqa"], [])
    assert c.cross_encoder.rerank.max_length == c.cross_encoder.max_length


def _lists(rng, queries=150, depth=50):
    """Retrieved lists whose judged positives sit near the top (the retriever orders them, imperfectly)."""
    qids, ranks, labels = [], [], []
    for q in range(queries):
        for r in range(1, depth + 1):
            qids.append(f"q{q}"), ranks.append(r), labels.append(rng.random() < 0.5 * np.exp(-r / 8))
    return qids, np.array(ranks), np.array(labels, dtype=float)


def test_list_auc_counts_pairs_and_ties_by_hand():
    from irflow.learn.teachers import list_auc

    assert list_auc(np.array([3.0, 2.0, 1.0]), np.array([1, 0, 0])) == 1.0
    assert list_auc(np.array([1.0, 2.0, 3.0]), np.array([1, 0, 0])) == 0.0
    assert list_auc(np.array([2.0, 2.0, 2.0, 2.0]), np.array([1, 1, 0, 0])) == 0.5
    # positives 5 and 2 against negatives 4, 2, 1: 5 beats all three, 2 ties one and beats one -> 4.5 of 6
    assert list_auc(np.array([5.0, 2.0, 4.0, 2.0, 1.0]), np.array([1, 1, 0, 0, 0])) == 4.5 / 6


def test_list_order_check_flags_a_teacher_at_chance_or_below_the_retriever_and_passes_one_that_orders():
    from irflow.learn.teachers import list_order_check

    rng = np.random.default_rng(5)
    qids, ranks, labels = _lists(rng)
    good = labels * 2.0 + rng.normal(0, 0.5, len(labels))  # judged positives clearly higher
    ok = list_order_check(qids, ranks, good, labels)
    assert ok.problem() is None and ok.teacher_auc > ok.list_auc > 0.6 and ok.queries > 100

    prior = np.full(len(labels), -1.3)  # NFCorpus's collapsed M_C: one logit for everything
    flat = list_order_check(qids, ranks, prior, labels)
    assert flat.teacher_auc == 0.5 and "better than chance" in flat.problem()
    noise = list_order_check(qids, ranks, rng.normal(0, 1, len(labels)), labels)
    assert abs(noise.teacher_auc - 0.5) < 0.05 and "better than chance" in noise.problem()

    # informative, but less than the list's own order: a worse judge than the retriever it cleans
    weak = labels * 0.4 + rng.normal(0, 1, len(labels))
    below = list_order_check(qids, ranks, weak, labels)
    assert 0.5 < below.teacher_auc < below.list_auc and "worse than the retriever" in below.problem()
    # judged positives outside the lists (rank 0) are not read: they would flatter any teacher
    outside = list_order_check(qids + ["q0"] * 20, np.r_[ranks, np.zeros(20, int)], np.r_[prior, np.full(20, 9.0)],
                               np.r_[labels, np.ones(20)])
    assert outside.teacher_auc == 0.5


def test_denoising_with_a_teacher_at_chance_warns_with_its_numbers(tmp_path, caplog):
    import logging

    import pyarrow as pa

    from irflow.engine.runtime import StageRuntime
    from irflow.stages.denoise import denoise

    rng = np.random.default_rng(9)
    qids, ranks, labels = _lists(rng, queries=60, depth=30)
    run = pa.table({"query_id": qids, "doc_id": [f"{q}-d{r}" for q, r in zip(qids, ranks)],
                    "rank": pa.array(ranks, pa.int32()), "score": -ranks.astype(float), "system": ["md0"] * len(qids)})
    judged = [(q, f"{q}-d{r}") for q, r, y in zip(qids, ranks, labels) if y]
    qrels = pa.table({"query_id": [q for q, _ in judged], "doc_id": [d for _, d in judged],
                      "score": pa.array([1] * len(judged), pa.int32()), "split": ["train"] * len(judged)})
    refs = {"qrels": _table_ref(tmp_path, "qrels", qrels), "ranking": _table_ref(tmp_path, "run", run)}
    p = DenoiseParams(fill_ranks=None, negatives_per_positive=2)
    for name, score in (("prior", np.full(len(qids), -1.3)), ("ordered", labels * 4.0 - 2.0)):
        scored = pa.table({"query_id": qids, "doc_id": run.column("doc_id"), "rank": pa.array(ranks, pa.int32()),
                           "score": score, "positive": labels.astype(bool)})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="irflow.denoise"):
            denoise.fn(p, StageRuntime(workdir=tmp_path / f"work-{name}"),
                       scores=_table_ref(tmp_path, f"scores-{name}", scored), **refs)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "teacher" in
                    r.getMessage()]
        if name == "prior":
            assert len(warnings) == 1 and "mean AUC 0.500 over" in warnings[0]
            assert "denoise.teachers: [fusion]" in warnings[0]
        else:
            assert warnings == []
            assert any("mean AUC 1.000" in r.getMessage() for r in caplog.records)


def test_the_cli_repeats_a_denoising_teacher_at_chance_after_the_run(setup, rocketqa_sample_run):
    """The sample's M_C (a tiny model, 2 steps) cannot order its lists: `irflow run` says so in place and
    again under the run's summary, where a long run's progress lines cannot bury it."""
    import pyarrow.parquet as pq

    from irflow.engine.store import TABLE_FILE, Store
    from irflow.learn.teachers import teacher_scores_check

    scores = pq.read_table(Store(setup["store"]).object_dir(rocketqa_sample_run.stage("denoise[ce]").outputs["scores"])
                           / TABLE_FILE)
    problem = teacher_scores_check(scores).problem()
    assert problem is not None and "better than chance" in problem
    code, out, err = cli("run", setup["rocketqa"], "--store", setup["store"], "--from", "denoise[ce]", "--to",
                         "denoise[ce]")
    assert code == 0, err
    summary, _, said_again = out.partition("warning(s) during the run (in place in the log above):")
    assert "1 computed" in summary and said_again
    again = [ln.removeprefix("- ") for ln in said_again.strip().splitlines()]
    assert sum(ln.startswith(f"denoise: {problem}. Denoise with a teacher that orders the lists") for ln in again) == 1
    assert len(again) == len(set(again))  # each warning once
