"""A run's graph (irflow.tools.dag, `irflow dag`, `irflow status --graph`), `--to`, and what Prefect shows of a
run (cached stages named "Cached", a summary artifact), on the baselines recipe over a real SciFact
slice with a tiny bi-encoder (as tests/test_flows.py), plus a failed toy stage and a tiny trained model
run without Prefect.
"""

import json
import shutil
import xml.etree.ElementTree as ET
from typing import Literal

import pytest
import yaml
from pydantic import Field

from irflow import api
from irflow.dev.testing import beir_slice, ingest_folder, make_tiny_bi_encoder
from irflow.dev.testing import run_cli as cli
from irflow.engine.catalog import Catalog
from irflow.engine.errors import ConfigError, DataError, StageFailed, UserError
from irflow.engine.params import Params
from irflow.engine.runner import Run
from irflow.engine.stage import Output, stage
from irflow.recipes.base import Recipe, RecipeConfig, execute, upstream
from irflow.tools import dag

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_datasets, prefect_harness):
    root = tmp_path_factory.mktemp("dag")
    data = beir_slice(shared_datasets / "scifact.zip", root / "scifact-slice", n_test_queries=10, n_extra_docs=60)
    model = make_tiny_bi_encoder(root / "tiny", seed=0)
    cfg = {
        "flow": "baselines",
        "dataset": {"name": "scifact-slice", "source": str(data), "split": "test"},
        "bm25": {"variants": ["flat"], "depth": 50},
        "dense": {"model": str(model), "batch_size": 32, "depth": 50},
        "runtime": {"threads": 2},
    }
    config = root / "baselines.yaml"
    config.write_text(yaml.safe_dump(cfg))
    store = root / "store"
    first = api.run(config, store=store)
    return {"root": root, "config": config, "data": data, "model": model, "store": store, "first": first,
            "catalog": Catalog(store / "catalog.duckdb")}


def svg_stages(svg: str) -> dict[str, dict]:
    """label -> {status, title} of each stage box in an SVG (which must parse as XML)."""
    tree = ET.fromstring(svg)
    out = {}
    for g in tree.iter(f"{SVG}g"):
        if "stage" in (g.get("class") or "").split():
            out[g.get("data-label")] = {"status": g.get("data-status"), "title": g.find(f"{SVG}title").text}
    return out


def first_status(rows: list[dict]) -> dict[str, str]:
    out = {}
    for r in rows:
        out.setdefault(r["name"], r["status"])
    return out


def test_run_graph_is_the_catalogs_run(setup):
    first, catalog = setup["first"], setup["catalog"]
    g = dag.run_graph(catalog, first.run_id)
    rows = catalog.stage_runs(first.run_id)
    assert {s.label: s.status for s in g.stages} == first_status(rows) == {s.name: s.status for s in first.stages}
    assert all(s.status == "computed" and s.seconds is not None for s in g.stages)
    keys = {d.key for d in g.datasets}
    for r in rows:  # every output is a node, made by its stage
        for name, did in r["outputs"].items():
            assert did in keys and (f"stage:{r['name']}", did, name) in g.edges
    # what the dense search read: the corpus embeddings and the queries; the model named in the config ends
    # lineage at its config key
    model = next(d for d in g.models())
    assert model.lineage == {"external": str(setup["model"]), "config_key": "dense.model"}
    assert (model.key, "stage:encode_corpus[zero-shot]", "model") in g.edges
    svg = dag.to_svg(g)
    drawn = svg_stages(svg)
    assert {k: v["status"] for k, v in drawn.items()} == first_status(rows)
    # edges point at nodes that exist, and the layout keeps an edge's source left of its target
    boxes = dag.layout(g)
    assert all(boxes[a][0] < boxes[b][0] for a, b, _ in g.edges)
    # top to bottom (for wide graphs): a source above its target, and no two nodes of a layer overlap
    tall = dag.layout(g, "TB")
    assert all(tall[a][1] + tall[a][3] < tall[b][1] for a, b, _ in g.edges)
    layers: dict = {}
    for x, y, w, h in tall.values():
        layers.setdefault(round(y + h / 2, 3), []).append((x, x + w))
    for spans in layers.values():
        spans.sort()
        assert all(a[1] + 2 * dag.ELLIPSE_RIM <= b[0] for a, b in zip(spans, spans[1:]))
    assert svg_stages(dag.to_svg(g, direction="TB")) == drawn


def test_rerun_is_cached_in_the_graph_and_in_prefect(setup, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    first = setup["first"]
    second = api.run(setup["config"], store=setup["store"])
    assert second.computed == set()
    out = tmp_path / "second.svg"
    code, stdout, err = cli("dag", second.run_id[:-2], "--store", setup["store"], "--out", out)
    assert code == 0, err
    drawn = svg_stages(out.read_text())
    assert set(drawn) == {s.name for s in first.stages}
    assert {v["status"] for v in drawn.values()} == {"cached"}

    with get_client(sync_client=True) as client:
        def task_states(flow_run_id):
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return {t.name: (t.state.type.value, t.state.name) for t in runs}

        assert set(task_states(first.prefect_flow_run_id).values()) == {("COMPLETED", "Completed")}
        cached = task_states(second.prefect_flow_run_id)
        assert set(cached) == {s.name for s in second.stages}
        assert set(cached.values()) == {("COMPLETED", "Cached")}
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[second.prefect_flow_run_id])))
    [summary] = [a for a in artifacts if a.key == "run-summary"]
    assert summary.type == "markdown"
    for m in second.metrics:
        assert f"| {m['system']} |" in summary.data and f"{m['ndcg@10']:.4f}" in summary.data
    assert f"irflow report {second.run_id} --store" in summary.data and "0 computed" in summary.data


def test_status_graph_marks_what_status_says(setup, tmp_path):
    out = tmp_path / "plan.svg"
    code, stdout, err = cli("status", setup["config"], "--store", setup["store"], "--set", "bm25.k1=1.2",
                            "--graph", out, "--json")
    assert code == 0, err
    plan = {p["name"]: p for p in json.loads(stdout)}
    drawn = svg_stages(out.read_text())
    assert {k: v["status"] for k, v in drawn.items()} == {n: p["status"] for n, p in plan.items()}
    stale = {n for n, p in plan.items() if p["status"] == "stale"}
    assert stale == {"bm25_search[flat]", "evaluate[bm25-flat]"}
    for name in stale:
        assert plan[name]["why"] and all(reason in drawn[name]["title"] for reason in plan[name]["why"])
    assert "cfg.k1: 0.9 -> 1.2" in drawn["bm25_search[flat]"]["title"]
    # the text of a stale box says its first reason
    assert "stale: cfg.k1: 0.9 -&gt; 1.2" in out.read_text()
    # the plain text says the same as the graph
    code, text, _ = cli("status", setup["config"], "--store", setup["store"], "--set", "bm25.k1=1.2")
    assert code == 0 and "2 of" in text and "cfg.k1: 0.9 -> 1.2" in text


def test_to_stops_after_the_stage(setup, tmp_path):
    store, catalog = setup["store"], setup["catalog"]
    # a changed k1: bm25_search[flat] computes; nothing after it runs
    code, stdout, err = cli("run", setup["config"], "--store", store, "--set", "bm25.k1=1.1", "--to", "bm25_search",
                            "--json")
    assert code == 0, err
    result = json.loads(stdout.splitlines()[-1])
    ran = {s["name"]: s["status"] for s in result["stages"]}
    assert ran == {"ingest": "cached", "select_queries[test]": "cached", "bm25_index[flat]": "cached",
                   "bm25_search[flat]": "computed"}
    assert set(result["skipped"]) == {s.name for s in setup["first"].stages} - set(ran)
    assert f"not run (--to bm25_search): {', '.join(result['skipped'])}" in stdout
    # the catalog knows nothing of the skipped stages for this run, and the run has no metrics
    assert {r["name"] for r in catalog.stage_runs(result["run_id"])} == set(ran)
    assert catalog.run_metrics(result["run_id"]) == []
    # status --to plans the same stages; the run's graph shows where it stopped
    plan = api.status(setup["config"], ["bm25.k1=1.1"], store=store, to=["bm25_search"])
    assert {p.name for p in plan if p.status != "skipped"} == set(ran)
    assert {p.name for p in plan if p.status == "skipped"} == set(result["skipped"])
    g = dag.run_graph(catalog, result["run_id"])
    assert {s.label for s in g.stages if s.status == "skipped"} == set(result["skipped"])
    assert svg_stages(dag.to_svg(g))["evaluate[bm25-flat]"]["status"] == "skipped"
    # the evaluation was skipped, not lost: the next full run computes only it
    assert api.run(setup["config"], ["bm25.k1=1.1"], store=store).computed == {"evaluate[bm25-flat]"}


@pytest.mark.parametrize("command", ["run", "status"])
def test_to_an_unknown_stage_is_one_line(setup, command):
    code, _, err = cli(command, setup["config"], "--store", setup["store"], "--to", "bm25_serach")
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith("irflow: error: --to bm25_serach (did you mean bm25_search?): no such stage")
    assert "its stages: ingest, select_queries[test], bm25_index[flat], bm25_search[flat]" in line


def test_dag_errors_are_one_line(setup, tmp_path, monkeypatch):
    code, _, err = cli("dag", "no-such-run", "--store", setup["store"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("irflow: error: no run 'no-such-run' in ") and "recent runs:" in err
    code, _, err = cli("dag", setup["first"].run_id, "--store", setup["store"], "--out", tmp_path / "no" / "x.svg")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no directory" in err
    monkeypatch.setenv("PATH", str(tmp_path))  # no Graphviz here
    code, _, err = cli("dag", setup["first"].run_id, "--store", setup["store"], "--engine", "dot")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "apt install graphviz" in err


def test_dot_source_names_every_node(setup):
    g = dag.run_graph(setup["catalog"], setup["first"].run_id)
    dot = dag.to_dot(g)
    assert dot.startswith("digraph irflow {") and dot.rstrip().endswith("}")
    for node in [s.key for s in g.stages] + [d.key for d in g.datasets]:
        assert f'"{node}" [' in dot
    assert dot.count(" -> ") == len(g.edges)
    if shutil.which("dot"):  # Graphviz is optional; where it is installed, its SVG has every stage
        tree = ET.fromstring(dag.to_svg(g, engine="dot"))
        titles = {t.text for t in tree.iter(f"{SVG}title")}
        assert {s.key for s in g.stages} <= titles


class ToyParams(Params):
    reason: str = Field("no queries today", description="what the stage fails with")


@stage("toy_fails", version="1", outputs=Output("queries", "queries"))
def toy_fails(p: ToyParams, rt, *, queries):
    raise DataError(p.reason)


class ToyConfig(RecipeConfig):
    flow: Literal["toy"] = Field(description="a recipe that fails in its second stage")
    source: str = Field(description="a BEIR folder")


def toy_body(c: ToyConfig, run: Run) -> list:
    queries = ingest_folder(run, c.source, dangling_qrels="keep")["queries"]
    toy_fails.run(run, ToyParams(), queries=queries)
    return []


def test_a_failed_stage_is_in_the_graph(setup):
    toy = Recipe("toy", ToyConfig, toy_body)
    with pytest.raises(StageFailed, match="no queries today"):
        execute(toy, ToyConfig(flow="toy", source=str(setup["data"])), str(setup["store"]), run_id="toy-failed")
    catalog = setup["catalog"]
    g = dag.run_graph(catalog, "toy-failed")
    assert [(s.label, s.status) for s in g.stages] == [("ingest", "cached"), ("toy_fails", "failed")]
    assert g.title == "run toy-failed (toy, failed)" and g.stage("toy_fails").seconds >= 0
    queries = catalog.stage_runs("toy-failed")[0]["outputs"]["queries"]
    assert (queries, "stage:toy_fails", "queries") in g.edges
    assert svg_stages(dag.to_svg(g))["toy_fails"]["status"] == "failed"
    # a failure is no result: stage_runs has only what the run computed or reused
    assert [r["name"] for r in catalog.stage_runs("toy-failed")] == ["ingest"]


def test_a_trained_model_has_its_lineage(setup):
    from irflow.stages.train_student import TrainStudentParams, train_student

    run = Run(setup["store"], "toy-train")
    data = ingest_folder(run, setup["data"], dangling_qrels="keep")
    base = run.model(str(setup["model"]), "student.base_model")
    params = TrainStudentParams(loss="mnrl", split="test", steps=2, batch_size=4, max_seq_length=32,
                                warmup_steps=0, checkpoint_every=0, similarity="cos")
    student = train_student.run(run, params, tag="mnrl", queries=data["queries"], corpus=data["corpus"],
                                qrels=data["qrels"], base_model=base)["student"]
    g = dag.run_graph(run.catalog, "toy-train")
    node = next(d for d in g.models() if d.key == student.id)
    assert node.lineage["stage"] == "train_student[mnrl]" and node.lineage["run_id"] == "toy-train"
    assert node.lineage["base_model"] == [base.id]
    assert sorted(node.lineage["training_data"]) == sorted(
        [f"corpus: {data['corpus'].id}", f"qrels: {data['qrels'].id}", f"queries: {data['queries'].id}"])
    assert node.lineage["params_digest"] == dag.params_digest(params.key_dump())
    title, html = dag.dag_section(run.catalog, "toy-train")
    assert title == "Pipeline"
    ET.fromstring(html[html.index("<svg"):html.index("</svg>") + 6])
    assert student.id in html and node.lineage["params_digest"] in html and base.id in html
    with pytest.raises(UserError, match="no run 'nope'"):
        dag.run_graph(run.catalog, "nope")


def test_upstream_follows_ids_not_order():
    """--to's stage set from a plan: what the target reads, transitively; a name selects every call."""
    plan = [
        {"name": "ingest", "inputs": {"source": ["src"]}, "outputs": {"corpus": "c", "qrels": "q"}},
        {"name": "index[a]", "inputs": {"corpus": ["c"]}, "outputs": {"out": "<index[a]:out>"}},
        {"name": "index[b]", "inputs": {"corpus": ["c"]}, "outputs": {"out": "ib"}},
        {"name": "search[b]", "inputs": {"index": ["ib"]}, "outputs": {"run": "<search[b]:run>"}},
        {"name": "evaluate", "inputs": {"run": ["<search[b]:run>"], "qrels": ["q"]}, "outputs": {"m": "m"}},
    ]
    assert upstream(plan, {"evaluate"}) == {"ingest", "index[b]", "search[b]", "evaluate"}
    assert upstream(plan, {"index"}) == {"ingest", "index[a]", "index[b]"}
    assert upstream(plan, {"index[a]"}) == {"ingest", "index[a]"}
    # Two calls with one key produce one id (a cached corpus encoding, tagged once for the train queries
    # and once for the test queries): a reader of that id needs both, or the one it was planned after
    # is skipped and hands it a placeholder.
    shared = [
        {"name": "ingest", "inputs": {}, "outputs": {"corpus": "c"}},
        {"name": "encode[train]", "inputs": {"corpus": ["c"]}, "outputs": {"emb": "e"}},
        {"name": "search[train]", "inputs": {"emb": ["e"]}, "outputs": {"run": "r1"}},
        {"name": "encode[test]", "inputs": {"corpus": ["c"]}, "outputs": {"emb": "e"}},
        {"name": "search[test]", "inputs": {"emb": ["e"]}, "outputs": {"run": "r2"}},
    ]
    assert upstream(shared, {"search[train]"}) == {"ingest", "encode[train]", "encode[test]", "search[train]"}


def test_to_an_unknown_stage_stops_a_flow_started_directly(setup):
    toy = Recipe("toy", ToyConfig, toy_body)
    with pytest.raises(ConfigError, match="--to nope: no such stage in recipe 'toy'"):
        execute(toy, ToyConfig(flow="toy", source=str(setup["data"])), str(setup["store"]), run_id="toy-to",
                to={"ingest", "nope"})
    assert setup["catalog"].run("toy-to") is None
