"""The GPL recipe end to end through irflow.api, under Prefect, on a real SciFact slice, with tiny
local models in place of the paper's hub models (same from_pretrained / SentenceTransformer paths).

Checks the partial re-execution contract a user sees in the run result:
- change train.*      -> only training and evaluation of the students recompute
- change the teacher  -> labels, training, evaluation recompute; generation and mining are reused
- change the margin scale -> the labels are re-scaled from the teacher's cached scores (no re-scoring)
- change the generator -> everything that depends on the generated queries recomputes
"""

from pathlib import Path

import pytest

from irflow import api
from irflow.dev.testing import run_cli as cli
from irflow.engine.models import ModelNotAvailable


def run(config, store, *sets, force=()):
    return api.run(config, list(sets), store=store, force=force)


def computed(result) -> set[str]:
    return result.computed


@pytest.fixture(scope="module")
def setup(gpl_sample):
    return gpl_sample


# A test that changes one setting takes ``gpl_sample_run``: the store then holds every output of the config
# as it is (the session's first run made them), so what the changed run computes is what the change made stale.


def test_gpl_cold_run_shows_every_system(setup, gpl_sample_run):
    result = gpl_sample_run  # the first run in its store (shared with tests/test_inside.py)
    names = [s.name for s in result.stages]
    for stage in ("generate_queries[t5]", "mine_negatives", "label_scores", "pseudo_label", "train_student[gpl]",
                  "train_student[qgen]", "doc2query_expand", "dense_search[gpl-student]", "evaluate[gpl-student]"):
        assert stage in names
    assert {m["system"] for m in result.metrics} == {
        "bm25-flat", "dense-bi", "hybrid", "bm25-doc2query-flat", "qgen-student", "gpl-student",
        "hybrid-qgen-student", "hybrid-gpl-student"}
    # Running it again recomputes nothing.
    assert computed(run(setup["config"], setup["store"])) == set()


def test_change_train_recomputes_training_and_evaluation_only(setup, gpl_sample_run):
    changed = computed(run(setup["config"], setup["store"], "train.lr=3.0e-5"))
    assert changed == {"train_student[gpl]", "train_student[qgen]",
                       "encode_corpus[gpl-student]", "dense_search[gpl-student]", "evaluate[gpl-student]",
                       "encode_corpus[qgen-student]", "dense_search[qgen-student]", "evaluate[qgen-student]",
                       # BM25 fused with each student: the students changed, BM25 and the zero-shot hybrid did not
                       "fuse[hybrid-gpl-student]", "evaluate[hybrid-gpl-student]",
                       "fuse[hybrid-qgen-student]", "evaluate[hybrid-qgen-student]"}


def test_bm25_fused_with_each_student_is_the_hybrid_fusion_of_their_stored_runs(setup, gpl_sample_run):
    """hybrid-gpl-student is BM25's test run and the GPL student's, fused as `hybrid` fuses BM25 and the
    zero-shot model (same method and weights); hybrid.students: false leaves those systems out and
    recomputes nothing."""
    from irflow.learn.fusion import fuse_runs

    out = {s.name: s.outputs for s in gpl_sample_run.stages}
    table = lambda stage: _table(setup["store"], out[stage]["run"])  # noqa: E731
    hybrid = api.load_config(setup["config"]).hybrid
    for student in ("gpl-student", "qgen-student"):
        p = hybrid.student_params("bm25-flat", student)
        assert p.system == f"hybrid-{student}" and p.weights == {"bm25-flat": hybrid.sparse_weight, student: 1 - hybrid.sparse_weight}
        want = fuse_runs([table("bm25_search[flat]"), table(f"dense_search[{student}]")], method=p.method,
                         weights=p.weights, rrf_k=p.rrf_k, input_depth=p.input_depth, depth=p.depth,
                         system=p.system)
        got = table(f"fuse[hybrid-{student}]")
        assert got.num_rows == want.num_rows > 0
        assert got.column("doc_id").to_pylist() == want.column("doc_id").to_pylist()
        assert got.column("query_id").to_pylist() == want.column("query_id").to_pylist()
    # the fusion differs from the zero-shot hybrid's: it read the student's run, not the base model's
    assert table("fuse[hybrid-gpl-student]").column("doc_id") != table("fuse[hybrid]").column("doc_id")
    metrics = {m["system"]: m for m in gpl_sample_run.metrics}
    assert 0 < metrics["hybrid-gpl-student"]["ndcg@10"] <= 1

    # a weight of its own for the students' fusions recomputes those and nothing else, at that weight
    weighted = run(setup["config"], setup["store"], "hybrid.student_sparse_weight=0.6")
    assert computed(weighted) == {"fuse[hybrid-gpl-student]", "evaluate[hybrid-gpl-student]",
                                  "fuse[hybrid-qgen-student]", "evaluate[hybrid-qgen-student]"}
    fused = next(s for s in weighted.stages if s.name == "fuse[hybrid-gpl-student]")
    assert _params(setup["store"], fused.outputs["run"])["weights"] == {"bm25-flat": 0.6, "gpl-student": 0.4}

    without = run(setup["config"], setup["store"], "hybrid.students=false")
    assert computed(without) == set()
    assert not {m["system"] for m in without.metrics} & {"hybrid-gpl-student", "hybrid-qgen-student"}


def test_change_teacher_reuses_generation_and_mining(setup, gpl_sample_run):
    changed = computed(run(setup["config"], setup["store"], f"teacher.model={setup['ce_b']}"))
    assert {"label_scores", "pseudo_label", "train_student[gpl]", "evaluate[gpl-student]"} <= changed
    assert not {"generate_queries[t5]", "mine_negatives", "bm25_search[miner-bm25]", "dense_search[miner-bi]",
                "evaluate[bm25-flat]", "evaluate[hybrid]"} & changed


def test_change_generator_recomputes_everything_after_ingest(setup, gpl_sample_run):
    changed = computed(run(setup["config"], setup["store"], "generate.seed=7"))
    assert {"generate_queries[t5]", "bm25_search[miner-bm25]", "mine_negatives", "label_scores", "pseudo_label",
            "train_student[gpl]", "doc2query_expand", "evaluate[gpl-student]"} <= changed
    # ...but not what never read the generated queries.
    assert not {"ingest", "select_queries[test]", "bm25_search[flat]", "evaluate[bm25-flat]",
                "encode_corpus[zero-shot]"} & changed


def test_change_scale_relabels_without_rescoring(setup, gpl_sample_run):
    changed = computed(run(setup["config"], setup["store"], "label.scale=0.5"))
    assert {"pseudo_label", "train_student[gpl]", "evaluate[gpl-student]"} <= changed
    # the teacher's scoring is cached; the QGen baseline reads the labels' (query, positive) pairs only,
    # which a scale does not change: label_positives recomputes to the same dataset, and QGen is reused
    assert not {"label_scores", "mine_negatives", "generate_queries[t5]", "train_student[qgen]"} & changed


def test_students_kept_every_n_steps_are_candidates_of_the_selection(setup, gpl_sample_run, tmp_path):
    """train.candidates_every: 1 (3 steps) keeps the GPL student after steps 1 and 2 as models of their own,
    evaluated beside the final one (not fused with BM25) and candidates of the selection; the final student's
    weights are those of the run that kept none; QGen (no candidates) is reused; an export ships the chosen
    model without the kept ones."""
    from sentence_transformers import SentenceTransformer

    from irflow.tools.export import export

    result = run(setup["config"], setup["store"], "train.candidates_every=1")
    changed = computed(result)
    assert {"train_student[gpl]", "checkpoint_student[gpl-step1]", "checkpoint_student[gpl-step2]",
            "evaluate[gpl-student-step1]", "evaluate[gpl-student-step2]"} <= changed
    assert "train_student[qgen]" not in changed
    systems = {m["system"] for m in result.metrics}
    assert {"gpl-student-step1", "gpl-student-step2", "gpl-student"} <= systems
    assert not any(s.startswith("hybrid-gpl-student-step") for s in systems)
    models = result.selected["models"]
    assert {"gpl-student-step1", "gpl-student-step2", "gpl-student", "qgen-student"} <= set(models)

    catalog = api.catalog(setup["store"])
    path = {s: Path(catalog.dataset(models[s])["path"]) for s in models}
    weights = {s: SentenceTransformer(str(path[s]), device="cpu").state_dict()
               for s in ("gpl-student-step1", "gpl-student-step2", "gpl-student")}
    before = gpl_sample_run.selected["models"]["gpl-student"]
    plain = SentenceTransformer(catalog.dataset(before)["path"], device="cpu").state_dict()
    name = next(k for k in plain if k.endswith("query.weight"))
    assert all(plain[k].equal(weights["gpl-student"][k]) for k in plain)  # keeping candidates changed no weight
    assert not weights["gpl-student-step1"][name].equal(weights["gpl-student-step2"][name])
    assert not weights["gpl-student-step2"][name].equal(weights["gpl-student"][name])
    assert sorted(p.name for p in (path["gpl-student"] / "checkpoints").iterdir()) == ["step-1", "step-2"]
    # a kept student's model is its checkpoint's files linked, not a second copy of its weights on disk
    linked = [f.name for f in path["gpl-student-step1"].rglob("*.safetensors")
              if f.stat().st_ino == (path["gpl-student"] / "checkpoints" / "step-1" /
                                     f.relative_to(path["gpl-student-step1"])).stat().st_ino]
    assert linked

    shipped = export(catalog, result.run_id, tmp_path / "final", system="gpl-student")
    assert not (shipped.out / "checkpoints").exists()
    early = export(catalog, result.run_id, tmp_path / "early", system="gpl-student-step1")
    got = SentenceTransformer(str(early.out), device="cpu").state_dict()
    assert got[name].equal(weights["gpl-student-step1"][name])


def test_from_stage_and_status(setup, gpl_sample_run):
    plan = {p.name: p for p in api.status(setup["config"], ["label.negatives_per_positive=2"], store=setup["store"])}
    assert plan["generate_queries[t5]"].status == "cached"
    assert plan["label_scores"].status == plan["pseudo_label"].status == "stale"
    assert "cfg.negatives_per_positive: 1 -> 2" in plan["label_scores"].why
    forced = computed(run(setup["config"], setup["store"], force=["pseudo_label"]))
    assert "pseudo_label" in forced and "train_student[gpl]" in forced
    assert not {"generate_queries[t5]", "mine_negatives", "label_scores"} & forced


def test_rounds_relabel_with_the_last_student_as_the_dense_miner(setup, gpl_sample_run):
    """rounds: 2 keeps round 1 (the config's run, cached) and adds a round whose dense miner is round 1's
    student: it mines and labels the same queries again and trains on from that student; round_init: base
    trains train.model on round 2's labels instead, which are reused."""
    two = run(setup["config"], setup["store"], "rounds=2")
    changed = computed(two)
    assert {"dense_search[miner-bi-r2]", "mine_negatives[r2]", "label_scores[r2]", "pseudo_label[r2]",
            "train_student[gpl-r2]", "dense_search[gpl-student-r2]", "evaluate[gpl-student-r2]"} <= changed
    assert not {"generate_queries[t5]", "dense_search[miner-bi]", "mine_negatives", "label_scores", "pseudo_label",
                "train_student[gpl]", "train_student[qgen]", "evaluate[gpl-student]"} & changed
    assert {m["system"] for m in two.metrics} >= {"gpl-student", "gpl-student-r2", "qgen-student"}

    from irflow.engine.catalog import Catalog

    out = {s.name: s.outputs for s in two.stages}
    first = out["train_student[gpl]"]["student"]
    # the round-2 miner's corpus embeddings are round 1's student's (the same encoding as its evaluation)
    assert out["encode_corpus[miner-bi-r2]"]["embeddings"] == out["encode_corpus[gpl-student]"]["embeddings"]
    catalog = Catalog(setup["store"] / "catalog.duckdb")
    second = out["train_student[gpl-r2]"]["student"]
    assert ("base_model", first) in catalog.parents(second)  # trained on from round 1's student
    assert ("pseudo_labels", out["pseudo_label[r2]"]["pseudo_labels"]) in catalog.parents(second)
    ancestors = {a["dataset_id"] for a in catalog.lineage(second)}
    assert out["dense_search[miner-bi-r2]"]["run"] in ancestors
    assert out["pseudo_label[r2]"]["pseudo_labels"] != out["pseudo_label"]["pseudo_labels"]

    again = run(setup["config"], setup["store"], "rounds=2", "round_init=base")
    assert "train_student[gpl-r2]" in computed(again)
    assert not {"mine_negatives[r2]", "label_scores[r2]", "pseudo_label[r2]", "train_student[gpl]"} & computed(again)
    from_base = again.stage("train_student[gpl-r2]").outputs["student"]
    assert from_base != second and ("base_model", first) not in catalog.parents(from_base)
    assert ("pseudo_labels", out["pseudo_label[r2]"]["pseudo_labels"]) in catalog.parents(from_base)


def test_paper_config_fails_fast_offline(tmp_path):
    with pytest.raises(ModelNotAvailable, match="BeIR/query-gen-msmarco-t5-base-v1"):
        api.run("configs/gpl_scifact.yaml", store=tmp_path / "s")
    code, _, err = cli("run", "configs/gpl_scifact.yaml", "--store", tmp_path / "s")
    assert code == 2
    assert "BeIR/query-gen-msmarco-t5-base-v1" in err and "generate.model" in err and "Traceback" not in err


def _table(store_dir, dataset_id):
    import pyarrow.parquet as pq

    from irflow.engine.store import TABLE_FILE, Store

    return pq.read_table(Store(store_dir).object_dir(dataset_id) / TABLE_FILE)


def _params(store_dir, dataset_id) -> dict:
    """The params of the stage run that wrote a dataset, as the catalog recorded them."""
    import json

    from irflow.engine.catalog import Catalog

    return json.loads(Catalog(Path(store_dir) / "catalog.duckdb").dataset(dataset_id)["params"])


def _scores(t) -> dict:
    return dict(zip(zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist()),
                    t.column("score").to_pylist()))


def test_fusion_teacher_can_score_every_candidate_with_every_miner(setup):
    """teacher.score_every_candidate: each miner scores every candidate (the mined negatives and the
    generated queries' source passages) instead of giving one it did not return its list's floor; mining
    is reused, and the flag at false keeps the old keys."""
    fusion = "teacher={type: fusion, weights: {bm25: 0.5, bi: 0.5}}"
    own = run(setup["config"], setup["store"], fusion)
    every = run(setup["config"], setup["store"], fusion, "teacher.score_every_candidate=true")
    changed = computed(every)
    assert {"bm25_score[teacher-bm25]", "dense_score[teacher-bi]", "label_scores", "train_student[gpl]"} <= changed
    assert not {"generate_queries[t5]", "bm25_search[miner-bm25]", "encode_corpus[miner-bi]",
                "dense_search[miner-bi]", "mine_negatives"} & changed
    assert computed(run(setup["config"], setup["store"], fusion, "teacher.score_every_candidate=false")) == set()

    store = setup["store"]
    out = {s.name: s.outputs for s in every.stages}
    negatives = _table(store, out["mine_negatives"]["negatives"])
    source = _table(store, out["generate_queries[t5]"]["qrels"])
    wanted = set(zip(negatives.column("query_id").to_pylist(), negatives.column("doc_id").to_pylist())) | set(
        zip(source.column("query_id").to_pylist(), source.column("doc_id").to_pylist()))
    for miner, rescored in (("miner-bm25", "bm25_score[teacher-bm25]"), ("miner-bi", "dense_score[teacher-bi]")):
        listed = _scores(_table(store, out[[n for n in out if n.endswith(f"[{miner}]") and "search" in n][0]]["run"]))
        scored_t = _table(store, out[rescored]["run"])
        scored = _scores(scored_t)
        assert len(scored) == scored_t.num_rows and set(scored) == wanted  # every candidate, once
        floor = {}
        for (q, _), s in listed.items():
            floor[q] = min(floor.get(q, s), s)
        for pair, s in scored.items():
            if pair in listed:  # what the miner returned: the same score
                assert s == pytest.approx(listed[pair], rel=1e-4, abs=1e-4)
            elif pair[0] in floor:  # what it did not return scores no higher than its list's last
                assert s <= floor[pair[0]] + 1e-4
        assert any(p not in listed for p in scored)  # the test means something: some candidate was missing
    # the teacher fused the re-scored runs
    from irflow.engine.catalog import Catalog

    labels = out["label_scores"]["out"]
    parents = {a["dataset_id"] for a in Catalog(store / "catalog.duckdb").lineage(labels)}
    assert out["bm25_score[teacher-bm25]"]["run"] in parents and out["dense_score[teacher-bi]"]["run"] in parents
    assert own.stage("label_scores").outputs["out"] != labels
