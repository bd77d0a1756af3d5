"""The baselines flow end to end through the CLI, under Prefect, on a real SciFact slice.

A tiny locally built bi-encoder stands in for MiniLM (same SentenceTransformer loading path), so
the whole file runs in about a minute on 2 cores.
"""

import json

import pytest
import yaml

from irflow.testing import beir_slice, make_tiny_bi_encoder
from irflow.testing import run_cli as cli


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_datasets, prefect_harness):
    root = tmp_path_factory.mktemp("flows")
    data = beir_slice(shared_datasets / "scifact.zip", root / "scifact-slice", n_test_queries=15, n_extra_docs=120)
    model_a = make_tiny_bi_encoder(root / "tiny-a", seed=0)
    model_b = make_tiny_bi_encoder(root / "tiny-b", seed=1)
    cfg = {
        "flow": "baselines",
        "dataset": {"name": "scifact-slice", "source": str(data), "split": "test"},
        "bm25": {"variants": ["flat", "multifield"], "top_k": 100},
        "dense": {"model": str(model_a), "batch_size": 32, "top_k": 100},
        "runtime": {"threads": 2},
    }
    config = root / "baselines.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return {"root": root, "config": config, "data": data, "model_b": model_b, "store": root / "store"}




def run_json(*args) -> dict:
    code, out, err = cli("run", *args, "--json")
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def statuses(result) -> dict[str, str]:
    return {s["name"]: s["status"] for s in result["stages"]}


def test_cold_then_cached_then_partial(setup):
    store = setup["store"]
    first = run_json(setup["config"], "--store", store)
    st = statuses(first)
    assert set(st.values()) == {"computed"}
    assert {"ingest", "bm25_search[flat]", "bm25_search[multifield]", "encode_corpus[zero-shot]",
            "dense_search[zero-shot]"} <= set(st)
    systems = {m["system"] for m in first["metrics"]}
    assert systems == {"bm25-flat", "bm25-multifield", "dense-tiny-a"}
    for m in first["metrics"]:
        for key in ("ndcg@10", "recall@100", "map@100", "mrr@10"):
            assert 0.0 <= m[key] <= 1.0
    # BM25 on real SciFact text finds the judged documents among ~150: far from random.
    assert next(m for m in first["metrics"] if m["system"] == "bm25-flat")["ndcg@10"] > 0.3

    second = run_json(setup["config"], "--store", store)
    assert set(statuses(second).values()) == {"cached"}
    assert second["metrics"] == first["metrics"]

    # Change only the dense model: dense stages and their evaluation recompute, nothing else.
    third = run_json(setup["config"], "--store", store, "--set", f"dense.model={setup['model_b']}",
                     "--set", "dense.system=dense-b")
    st3 = statuses(third)
    recomputed = {n for n, s in st3.items() if s == "computed"}
    assert recomputed == {"encode_corpus[zero-shot]", "dense_search[zero-shot]", "evaluate[dense-b]"}


def test_from_stage_forces_descendants(setup):
    store = setup["store"]
    run_json(setup["config"], "--store", store)  # make sure everything is cached
    forced = statuses(run_json(setup["config"], "--store", store, "--from", "bm25_search[flat]"))
    recomputed = {n for n, s in forced.items() if s == "computed"}
    assert recomputed == {"bm25_search[flat]", "evaluate[bm25-flat]"}


def test_status_says_why(setup):
    store = setup["store"]
    run_json(setup["config"], "--store", store)
    code, out, _ = cli("status", setup["config"], "--store", store, "--set", "bm25.k1=1.2", "--json")
    assert code == 0
    plan = {p["name"]: p for p in json.loads(out.strip().splitlines()[-1])}
    assert plan["bm25_index[flat]"]["status"] == "cached"
    assert plan["bm25_search[flat]"]["status"] == "stale"
    assert any("cfg.k1: 0.9 -> 1.2" in w for w in plan["bm25_search[flat]"]["why"])
    assert plan["evaluate[bm25-flat]"]["why"][0].startswith("upstream is stale")
    assert plan["dense_search[zero-shot]"]["status"] == "cached"


def test_lineage_and_sql(setup):
    store = setup["store"]
    result = run_json(setup["config"], "--store", store)
    run_id = next(s["dataset_id"] for s in result["stages"] if s["name"] == "dense_search[zero-shot]")
    code, out, _ = cli("lineage", run_id[:12], "--store", store, "--json")
    assert code == 0
    chain = json.loads(out)
    stages = [n["stage"] for n in chain]
    assert stages[0] == "dense_search[zero-shot]"
    assert {"encode_corpus[zero-shot]", "select_queries[test]", "ingest"} <= set(stages)
    ingest_node = next(n for n in chain if n["stage"] == "ingest")
    assert ingest_node["num_rows"] > 0 and ingest_node["run_id"].startswith("baselines-")

    code, out, _ = cli("sql", "SELECT system, count(DISTINCT query_id) AS q FROM all_run GROUP BY 1 ORDER BY 1",
                       "--store", store, "--json")
    assert code == 0
    rows = json.loads(out)
    assert {r["system"] for r in rows} >= {"bm25-flat", "bm25-multifield", "dense-tiny-a"}
    assert all(r["q"] == 15 for r in rows)
    # The metrics table answers per run, cached or not.
    code, out, _ = cli("sql", f"SELECT count(*) AS n FROM metrics WHERE run_id = '{result['run_id']}'",
                       "--store", store, "--json")
    assert code == 0 and json.loads(out)[0]["n"] == 3 * 4


def test_missing_hub_model_fails_fast(setup, tmp_path):
    code, _, err = cli("run", setup["config"], "--store", tmp_path / "s",
                       "--set", "dense.model=some-org/not-a-local-model")
    assert code == 2
    assert "some-org/not-a-local-model" in err and "dense.model" in err
    assert not (tmp_path / "s" / "objects").exists() or not any((tmp_path / "s" / "objects").iterdir())
