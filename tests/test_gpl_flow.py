"""The GPL recipe end to end through irflow.api, under Prefect, on a real SciFact slice, with tiny
local models in place of the paper's hub models (same from_pretrained / SentenceTransformer paths).

Checks the partial re-execution contract a user sees in the run result:
- change train.*      -> only training and evaluation of the students recompute
- change the teacher  -> labels, training, evaluation recompute; generation and mining are reused
- change the generator -> everything that depends on the generated queries recomputes
"""

import pytest
import yaml

from irflow import api
from irflow.models import ModelNotAvailable
from irflow.testing import beir_slice, make_tiny_bi_encoder, make_tiny_cross_encoder, make_tiny_t5
from irflow.testing import run_cli as cli


def run(config, store, *sets, force=()):
    return api.run(config, list(sets), store=store, force=force)


def computed(result) -> set[str]:
    return result.computed


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_datasets, prefect_harness):
    root = tmp_path_factory.mktemp("gpl")
    data = beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=8, n_extra_docs=40, seed=5)
    t5 = make_tiny_t5(root / "t5")
    bi = make_tiny_bi_encoder(root / "bi", normalize=True)
    ce_a = make_tiny_cross_encoder(root / "ce-a", seed=0)
    ce_b = make_tiny_cross_encoder(root / "ce-b", seed=1)
    cfg = {
        "flow": "gpl",
        "dataset": {"name": "slice", "source": str(data), "split": "test"},
        "generate": {"source": "t5", "model": str(t5), "queries_per_passage": 1, "batch_size": 16,
                     "max_length": 12, "shard_size": 32},
        "mine": {"miners": [{"name": "bm25", "type": "bm25"}, {"name": "bi", "type": "dense", "model": str(bi)}],
                 "depth": 10},
        "teacher": {"type": "cross_encoder", "model": str(ce_a), "batch_size": 16, "max_length": 64},
        "label": {"negatives_per_positive": 1},
        "train": {"model": str(bi), "similarity": "dot", "batch_size": 8, "max_seq_length": 48, "warmup_steps": 1,
                  "steps": 3, "checkpoint_every": 2, "qgen": {"steps": 2}},
        "bm25": {"variants": ["flat"], "depth": 100},
        "dense": {"batch_size": 32, "depth": 100},
        "runtime": {"threads": 1},
    }
    config = root / "gpl.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return {"config": config, "store": root / "store", "ce_b": ce_b}


def test_gpl_cold_run_shows_every_system(setup):
    result = run(setup["config"], setup["store"])
    names = [s.name for s in result.stages]
    for stage in ("generate_queries[t5]", "mine_negatives", "pseudo_label", "train_student[gpl]",
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
    assert "pseudo_label" in changed and "train_student[gpl]" in changed and "evaluate[gpl-student]" in changed
    assert not {"generate_queries[t5]", "mine_negatives", "bm25_search[miner-bm25]", "dense_search[miner-bi]",
                "evaluate[bm25-flat]", "evaluate[hybrid]"} & changed


def test_change_generator_recomputes_everything_after_ingest(setup):
    run(setup["config"], setup["store"])
    changed = computed(run(setup["config"], setup["store"], "generate.seed=7"))
    assert {"generate_queries[t5]", "bm25_search[miner-bm25]", "mine_negatives", "pseudo_label",
            "train_student[gpl]", "doc2query_expand", "evaluate[gpl-student]"} <= changed
    # ...but not what never read the generated queries.
    assert not {"ingest", "select_queries[test]", "bm25_search[flat]", "evaluate[bm25-flat]",
                "encode_corpus[zero-shot]"} & changed


def test_from_stage_and_status(setup):
    run(setup["config"], setup["store"])
    plan = {p.name: p for p in api.status(setup["config"], ["label.negatives_per_positive=2"], store=setup["store"])}
    assert plan["generate_queries[t5]"].status == "cached"
    assert plan["pseudo_label"].status == "stale"
    assert "cfg.negatives_per_positive: 1 -> 2" in plan["pseudo_label"].why
    forced = computed(run(setup["config"], setup["store"], force=["pseudo_label"]))
    assert "pseudo_label" in forced and "train_student[gpl]" in forced
    assert "generate_queries[t5]" not in forced and "mine_negatives" not in forced


def test_paper_config_fails_fast_offline(tmp_path):
    with pytest.raises(ModelNotAvailable, match="BeIR/query-gen-msmarco-t5-base-v1"):
        api.run("configs/gpl_scifact.yaml", store=tmp_path / "s")
    code, _, err = cli("run", "configs/gpl_scifact.yaml", "--store", tmp_path / "s")
    assert code == 2
    assert "BeIR/query-gen-msmarco-t5-base-v1" in err and "generate.model" in err and "Traceback" not in err
