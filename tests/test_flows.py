"""The baselines recipe end to end through irflow.api (and the CLI where exit codes matter), under
Prefect, on a real SciFact slice.

A tiny locally built bi-encoder stands in for MiniLM (same SentenceTransformer loading path), so
the whole file runs in about a minute on 2 cores.
"""

import json

import pytest
import yaml

from irflow import api
from irflow.dev.testing import beir_slice, make_tiny_bi_encoder
from irflow.dev.testing import run_cli as cli
from irflow.engine.errors import ConfigError
from irflow.engine.models import ModelNotAvailable


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_datasets, prefect_harness):
    root = tmp_path_factory.mktemp("flows")
    data = beir_slice(shared_datasets / "scifact.zip", root / "scifact-slice", n_test_queries=15, n_extra_docs=120)
    model_a = make_tiny_bi_encoder(root / "tiny-a", seed=0)
    model_b = make_tiny_bi_encoder(root / "tiny-b", seed=1)
    cfg = {
        "flow": "baselines",
        "dataset": {"name": "scifact-slice", "source": str(data), "split": "test"},
        "bm25": {"variants": ["flat", "multifield"], "depth": 100},
        "dense": {"model": str(model_a), "batch_size": 32, "depth": 100},
        "runtime": {"threads": 2},
    }
    config = root / "baselines.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return {"root": root, "config": config, "data": data, "model_b": model_b, "store": root / "store"}




def test_cold_then_cached_then_partial(setup):
    store = setup["store"]
    first = api.run(setup["config"], store=store)
    assert first.status == "completed" and first.cached == set()
    assert {"ingest", "bm25_search[flat]", "bm25_search[multifield]", "encode_corpus[zero-shot]",
            "dense_search[zero-shot]"} <= first.computed
    assert {m["system"] for m in first.metrics} == {"bm25-flat", "bm25-multifield", "dense-tiny-a"}
    for m in first.metrics:
        for key in ("ndcg@10", "recall@100", "map@100", "mrr@10"):
            assert 0.0 <= m[key] <= 1.0
    # BM25 on real SciFact text finds the judged documents among ~150: far from random.
    assert first.metric("bm25-flat") > 0.3
    # every computed stage says where and how it ran (the runtime is recorded, not keyed)
    enc = first.stage("encode_corpus[zero-shot]")
    assert enc.runtime["device"] == "cpu" and enc.runtime["precision"] == "fp32"

    second = api.run(setup["config"], store=store)
    assert second.computed == set() and second.metrics == first.metrics

    # Change only the dense model: dense stages and their evaluation recompute, nothing else.
    third = api.run(setup["config"], [f"dense.model={setup['model_b']}", "dense.system=dense-b"], store=store)
    assert third.computed == {"encode_corpus[zero-shot]", "dense_search[zero-shot]", "evaluate[dense-b]"}

    # A config given as a mapping runs the same recipe, from the same cache.
    as_dict = api.run(yaml.safe_load(setup["config"].read_text()), store=store)
    assert as_dict.computed == set() and as_dict.metrics == first.metrics


def test_stages_run_with_the_older_objects_frozen_out_of_the_collector(setup, monkeypatch):
    """release_memory's gc.collect() after each computed stage walked every object of torch, transformers
    and Prefect (0.64 s a stage, bench/README.md): a run freezes the objects it starts with out of the
    collector's scans, and unfreezes them at its end."""
    import gc

    from irflow.engine import runner as stage

    frozen_at_release = []
    release = stage.release_memory
    monkeypatch.setattr(stage, "release_memory", lambda: (frozen_at_release.append(gc.get_freeze_count()), release()))
    before = gc.get_freeze_count()
    forced = api.run(setup["config"], store=setup["store"], force=["bm25_search[flat]"])
    assert forced.computed == {"bm25_search[flat]", "evaluate[bm25-flat]"}
    assert len(frozen_at_release) == 2 and all(n > 10_000 for n in frozen_at_release), frozen_at_release
    assert gc.get_freeze_count() == before


def test_a_ctrl_c_turned_into_an_error_outside_a_stage_marks_the_run_interrupted(setup, monkeypatch):
    """A Ctrl-C can land outside any stage (here in the report after the stages, in a DuckDB query that
    makes it its own error): the run row says interrupted, as the CLI does, not failed."""
    from irflow.engine import processes
    from irflow.engine.catalog import Catalog
    from irflow.stages import report

    def ctrl_c_in_the_report(run, evaluations, selected=None):
        processes._interrupted = True  # what the CLI's SIGINT handler does
        raise RuntimeError("Invalid Input Error: query interrupted")

    monkeypatch.setattr(processes, "_interrupted", False)
    monkeypatch.setattr(report, "report", ctrl_c_in_the_report)
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        api.run(setup["config"], store=setup["store"], run_id="interrupted-in-report")
    monkeypatch.setattr(processes, "_interrupted", False)
    with Catalog(setup["store"] / "catalog.duckdb").connect() as con:
        assert con.execute("SELECT status FROM runs WHERE run_id = 'interrupted-in-report'").fetchall() == [
            ("interrupted",)]


def test_prefect_shows_one_task_run_per_stage(setup):
    """The recipe's flow is what Prefect runs (CLI, API and deployments alike): its UI lists one task
    run per stage, named after it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    result = api.run(setup["config"], store=setup["store"])
    assert result.prefect_flow_run_id
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(result.prefect_flow_run_id)
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    assert flow_run.name == result.run_id
    assert {t.name for t in task_runs} == {s.name for s in result.stages}
    assert all(t.state.is_completed() for t in task_runs)


def test_from_stage_forces_descendants(setup):
    store = setup["store"]
    api.run(setup["config"], store=store)  # make sure everything is cached
    forced = api.run(setup["config"], store=store, force=["bm25_search[flat]"])
    assert forced.computed == {"bm25_search[flat]", "evaluate[bm25-flat]"}
    # an unknown stage is an error that lists the stages, before anything runs
    with pytest.raises(ConfigError, match=r"bm25_serach.*did you mean bm25_search.*its stages: ingest"):
        api.run(setup["config"], store=store, force=["bm25_serach"])


def test_status_says_why(setup):
    store = setup["store"]
    api.run(setup["config"], store=store)
    plan = {p.name: p for p in api.status(setup["config"], ["bm25.k1=1.2"], store=store)}
    assert plan["bm25_index[flat]"].status == "cached"
    assert plan["bm25_search[flat]"].status == "stale"
    assert any("cfg.k1: 0.9 -> 1.2" in w for w in plan["bm25_search[flat]"].why)
    assert plan["evaluate[bm25-flat]"].why[0].startswith("upstream is stale")
    assert plan["dense_search[zero-shot]"].status == "cached"
    # the CLI prints the same plan
    code, out, _ = cli("status", setup["config"], "--store", store, "--set", "bm25.k1=1.2", "--json")
    assert code == 0 and {p["name"]: p["status"] for p in json.loads(out)} == {n: p.status for n, p in plan.items()}


def test_lineage_and_sql(setup):
    store = setup["store"]
    result = api.run(setup["config"], store=store)
    run_id = result.stage("dense_search[zero-shot]").dataset_id
    code, out, _ = cli("lineage", run_id[:12], "--store", store, "--json")
    assert code == 0
    chain = json.loads(out)
    stages = [n["stage"] for n in chain]
    assert stages[0] == "dense_search[zero-shot]"
    assert {"encode_corpus[zero-shot]", "select_queries[test]", "ingest", "external"} <= set(stages)
    ingest_node = next(n for n in chain if n["stage"] == "ingest")
    assert ingest_node["num_rows"] > 0 and ingest_node["run_id"].startswith("baselines-")
    # the model and the dataset source are where lineage ends, by content id
    model_node = next(n for n in chain if n["kind"] == "model")
    assert model_node["dataset_id"].startswith("dir:sha256:") and json.loads(model_node["params"])["config_key"] == \
        "dense.model"
    # the text view shows the runtime of each computed dataset
    code, out, _ = cli("lineage", run_id[:12], "--store", store)
    assert code == 0 and "runtime cpu, fp32" in out and "torch 2." in out

    code, out, _ = cli("sql", "SELECT system, count(DISTINCT query_id) AS q FROM all_run GROUP BY 1 ORDER BY 1",
                       "--store", store, "--json")
    assert code == 0
    rows = json.loads(out)
    assert {r["system"] for r in rows} >= {"bm25-flat", "bm25-multifield", "dense-tiny-a"}
    assert all(r["q"] == 15 for r in rows)
    # The metrics table answers per run, cached or not.
    code, out, _ = cli("sql", f"SELECT count(*) AS n FROM metrics WHERE run_id = '{result.run_id}'",
                       "--store", store, "--json")
    assert code == 0 and json.loads(out)[0]["n"] == 3 * 4
    # several statements: each one's result, in order
    code, out, _ = cli("sql", "SELECT 1 AS a; SELECT 2 AS b", "--store", store, "--json")
    assert code == 0 and [json.loads(line) for line in out.splitlines()] == [[{"a": 1}], [{"b": 2}]]


def test_missing_hub_model_fails_fast(setup, tmp_path):
    with pytest.raises(ModelNotAvailable, match="dense.model: model 'some-org/not-a-local-model'"):
        api.run(setup["config"], ["dense.model=some-org/not-a-local-model"], store=tmp_path / "s")
    code, _, err = cli("run", setup["config"], "--store", tmp_path / "s",
                       "--set", "dense.model=some-org/not-a-local-model")
    assert code == 2
    assert "some-org/not-a-local-model" in err and "dense.model" in err and "Traceback" not in err
    assert not (tmp_path / "s" / "objects").exists() or not any((tmp_path / "s" / "objects").iterdir())
