"""The GPL recipe end to end through irflow.api, under Prefect, on a real SciFact slice, with tiny
local models in place of the paper's hub models (same from_pretrained / SentenceTransformer paths).

Checks the partial re-execution contract a user sees in the run result:
- change train.*      -> only training and evaluation of the students recompute
- change the teacher  -> labels, training, evaluation recompute; generation and mining are reused
- change the margin scale -> the labels are re-scaled from the teacher's cached scores (no re-scoring)
- change the generator -> everything that depends on the generated queries recomputes
"""

import pytest

from irflow import api
from irflow.models import ModelNotAvailable
from irflow.testing import run_cli as cli


def run(config, store, *sets, force=()):
    return api.run(config, list(sets), store=store, force=force)


def computed(result) -> set[str]:
    return result.computed


@pytest.fixture(scope="module")
def setup(gpl_sample):
    return gpl_sample


def test_gpl_cold_run_shows_every_system(setup, gpl_sample_run):
    result = gpl_sample_run  # the first run in its store (shared with tests/test_inside.py)
    names = [s.name for s in result.stages]
    for stage in ("generate_queries[t5]", "mine_negatives", "label_scores", "pseudo_label", "train_student[gpl]",
                  "train_student[qgen]", "doc2query_expand", "dense_search[gpl-student]", "evaluate[gpl-student]"):
        assert stage in names
    assert {m["system"] for m in result.metrics} == {
        "bm25-flat", "dense-bi", "hybrid", "bm25-doc2query-flat", "qgen-student", "gpl-student"}
    # Running it again recomputes nothing.
    assert computed(run(setup["config"], setup["store"])) == set()


def test_change_train_recomputes_training_and_evaluation_only(setup):
    run(setup["config"], setup["store"])
    changed = computed(run(setup["config"], setup["store"], "train.lr=3.0e-5"))
    assert changed == {"train_student[gpl]", "train_student[qgen]",
                       "encode_corpus[gpl-student]", "dense_search[gpl-student]", "evaluate[gpl-student]",
                       "encode_corpus[qgen-student]", "dense_search[qgen-student]", "evaluate[qgen-student]"}


def test_change_teacher_reuses_generation_and_mining(setup):
    run(setup["config"], setup["store"])
    changed = computed(run(setup["config"], setup["store"], f"teacher.model={setup['ce_b']}"))
    assert {"label_scores", "pseudo_label", "train_student[gpl]", "evaluate[gpl-student]"} <= changed
    assert not {"generate_queries[t5]", "mine_negatives", "bm25_search[miner-bm25]", "dense_search[miner-bi]",
                "evaluate[bm25-flat]", "evaluate[hybrid]"} & changed


def test_change_generator_recomputes_everything_after_ingest(setup):
    run(setup["config"], setup["store"])
    changed = computed(run(setup["config"], setup["store"], "generate.seed=7"))
    assert {"generate_queries[t5]", "bm25_search[miner-bm25]", "mine_negatives", "label_scores", "pseudo_label",
            "train_student[gpl]", "doc2query_expand", "evaluate[gpl-student]"} <= changed
    # ...but not what never read the generated queries.
    assert not {"ingest", "select_queries[test]", "bm25_search[flat]", "evaluate[bm25-flat]",
                "encode_corpus[zero-shot]"} & changed


def test_change_scale_relabels_without_rescoring(setup):
    run(setup["config"], setup["store"])
    changed = computed(run(setup["config"], setup["store"], "label.scale=0.5"))
    assert {"pseudo_label", "train_student[gpl]", "evaluate[gpl-student]"} <= changed
    # the teacher's scoring is cached; the QGen baseline reads the labels' (query, positive) pairs only,
    # which a scale does not change: label_positives recomputes to the same dataset, and QGen is reused
    assert not {"label_scores", "mine_negatives", "generate_queries[t5]", "train_student[qgen]"} & changed


def test_from_stage_and_status(setup):
    run(setup["config"], setup["store"])
    plan = {p.name: p for p in api.status(setup["config"], ["label.negatives_per_positive=2"], store=setup["store"])}
    assert plan["generate_queries[t5]"].status == "cached"
    assert plan["label_scores"].status == plan["pseudo_label"].status == "stale"
    assert "cfg.negatives_per_positive: 1 -> 2" in plan["label_scores"].why
    forced = computed(run(setup["config"], setup["store"], force=["pseudo_label"]))
    assert "pseudo_label" in forced and "train_student[gpl]" in forced
    assert not {"generate_queries[t5]", "mine_negatives", "label_scores"} & forced


def test_paper_config_fails_fast_offline(tmp_path):
    with pytest.raises(ModelNotAvailable, match="BeIR/query-gen-msmarco-t5-base-v1"):
        api.run("configs/gpl_scifact.yaml", store=tmp_path / "s")
    code, _, err = cli("run", "configs/gpl_scifact.yaml", "--store", tmp_path / "s")
    assert code == 2
    assert "BeIR/query-gen-msmarco-t5-base-v1" in err and "generate.model" in err and "Traceback" not in err
