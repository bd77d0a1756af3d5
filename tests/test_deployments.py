"""prefect.yaml: every deployment points at a recipe's own flow, a real config, and parameters the flow takes."""

import inspect
import os
from pathlib import Path

import pytest
import yaml

from irflow.engine.errors import ConfigError
from irflow.recipes.base import load_config

ROOT = Path(__file__).resolve().parents[1]


def _deployments():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return spec, spec["deployments"]


def _flow(entrypoint: str):
    import importlib.util

    from prefect import Flow

    path, func = entrypoint.split(":")
    mod_spec = importlib.util.spec_from_file_location("entry", ROOT / path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    obj = getattr(mod, func)
    assert isinstance(obj, Flow), f"{entrypoint} is not a Prefect flow"
    return obj


@pytest.mark.parametrize("dep", _deployments()[1], ids=lambda d: d["name"])
def test_deployment_points_at_a_flow_and_a_loadable_config(dep):
    from prefect.client.schemas.schedules import CronSchedule

    flow = _flow(dep["entrypoint"])
    params = dep["parameters"]
    inspect.signature(flow.fn).bind(**params)  # raises TypeError on an unknown/missing parameter
    cfg = load_config(ROOT / params["config"], params.get("overrides"))
    assert cfg.flow == flow.name  # the recipe's own flow runs its config: its stages are the flow's task runs
    assert dep["work_pool"]["name"] == "irflow-local"  # the pool `make deploy` creates and `make worker` serves
    for s in dep.get("schedules") or []:
        CronSchedule(cron=s["cron"], timezone=s.get("timezone"))  # raises on an invalid cron


def test_pull_step_resolves_to_this_checkout(monkeypatch, tmp_path):
    from prefect.deployments.steps.pull import set_working_directory
    from prefect.utilities.templating import apply_values

    spec, _ = _deployments()
    # what `make deploy` does: IRFLOW_HOME is the checkout; Prefect reads `{{ $VAR }}` from os.environ
    monkeypatch.setenv("IRFLOW_HOME", str(ROOT))
    pull = apply_values(spec["pull"], dict(os.environ))
    [step] = pull
    directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
    monkeypatch.chdir(tmp_path)
    out = set_working_directory(directory)
    assert Path(out["directory"]) == ROOT and Path.cwd() == ROOT


def test_a_deployed_run_fails_with_the_cli_message(tmp_path, prefect_harness):
    """What a worker runs: the recipe flow on a config. A bad config fails the flow run (not a generic
    RuntimeError from a CLI inside a flow) with the message the CLI would print."""
    from irflow.recipes.gpl import gpl_flow

    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "demo.yaml").read_text().replace("lr: 2.0e-5", "lrr: 2.0e-5"))
    state = gpl_flow(config=str(bad), store=str(tmp_path / "store"), return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match=r"train.lrr: unknown key \(did you mean 'lr'\?\)"):
        state.result()
    with pytest.raises(ConfigError, match="config is for flow 'gpl', not 'baselines'"):
        from irflow.recipes.baselines import baselines_flow

        baselines_flow.fn(config=str(ROOT / "configs" / "demo.yaml"), store=str(tmp_path / "store"))


def test_prefect_server_answers_what_deploy_and_worker_ask(prefect_harness):
    """`prefect deploy` and `prefect deployment ls` send filters with explicit nulls (limit=None);
    with fastapi >= 0.151 Prefect 3.8's server answered those with 422, which broke `make deploy`
    while the ephemeral runs still worked. Same calls, through Prefect's client, on a real server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import WorkerFilter

    spec, deployments = _deployments()
    dep = deployments[0]
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=dep["work_pool"]["name"], type="process"), overwrite=True)
        flow_id = client.create_flow_from_name("baselines")
        client.create_deployment(flow_id=flow_id, name=dep["name"], entrypoint=dep["entrypoint"],
                                 parameters=dep["parameters"], work_pool_name=dep["work_pool"]["name"])
        names = [d.name for d in client.read_deployments()]
        workers = client.read_workers_for_work_pool(dep["work_pool"]["name"],
                                                    worker_filter=WorkerFilter(status={"any_": ["ONLINE"]}))
    assert dep["name"] in names
    assert workers == []


def test_every_registered_recipe_has_a_deployment_of_its_own_flow():
    """Recipes register themselves where they are defined; prefect.yaml must deploy each one's flow."""
    from irflow.recipes.base import recipe_names

    from irflow.dev.recipe_files import missing

    lacking = [n for n in recipe_names() if any(m.startswith("prefect.yaml") for m in missing(ROOT, n))]
    assert not lacking, f"recipes without a deployment in prefect.yaml: {lacking}"


def test_a_recipe_module_with_postponed_annotations_is_refused_at_import(tmp_path):
    import importlib.util

    src = tmp_path / "myrecipe.py"
    src.write_text("from __future__ import annotations\n"
                   "from irflow.recipes.base import RecipeConfig, recipe\n"
                   "class C(RecipeConfig):\n    pass\n"
                   "@recipe('mine', C)\ndef mine(c, run):\n    return []\n")
    spec = importlib.util.spec_from_file_location("myrecipe", src)
    with pytest.raises(TypeError, match="drop `from __future__ import annotations`"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
