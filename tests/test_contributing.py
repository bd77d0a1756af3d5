"""CONTRIBUTING.md's code runs as written: its stage, its recipe and its executor, loaded as the modules
they say they are, run the recipe on a slice of SciFact through the executor's pool."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pyarrow.compute as pc

from irflow import api
from irflow.dev.testing import beir_slice
from irflow.engine.executors import EXECUTORS

ROOT = Path(__file__).resolve().parents[1]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "CONTRIBUTING.md").read_text(), flags=re.S)


def _load(name: str, code: str, folder: Path):
    path = folder / (name.rsplit(".", 1)[-1] + ".py")
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_contributings_stage_recipe_and_executor_run_as_written(tmp_path, shared_datasets, prefect_harness):
    from irflow.recipes import base as recipes

    import irflow.engine.executors as executors

    stage_code, recipe_code, executor_code = _blocks()
    # the executor as a module of the executors package, found by the package's discovery
    (tmp_path / "executors").mkdir()
    (tmp_path / "executors" / "threads.py").write_text(executor_code)
    executors.__path__.append(str(tmp_path / "executors"))
    executors._DISCOVERED = False
    try:
        _load("irflow.stages.lowercase", stage_code, tmp_path)
        _load("irflow.recipes.lowercased", recipe_code, tmp_path)
        data = beir_slice(shared_datasets / "scifact.zip", tmp_path / "slice", n_test_queries=6, n_extra_docs=40,
                          seed=2)
        cfg = {"flow": "lowercased", "dataset": {"name": "slice", "source": str(data)},
               "bm25": {"variants": ["flat"]}, "runtime": {"executor": "threads", "shard_rows": 16, "threads": 1}}
        r = api.run(cfg, store=tmp_path / "store")
        lowered = next(s for s in r.stages if s.name == "lowercase")
        assert lowered.status == "computed" and r.metrics and r.metrics[0]["system"] == "bm25-flat"
        catalog = api.catalog(tmp_path / "store")
        corpus = catalog.ref(lowered.outputs["corpus"]).table()
        assert corpus.num_rows > 16  # more than one shard went through the pool
        assert pc.all(pc.equal(corpus["text"], pc.utf8_lower(corpus["text"]))).as_py()
        shards = [s for s in catalog.stage_runs(r.run_id) if s["name"] == "lowercase"][0]["shards"]
        assert len(shards) >= 2
        assert "threads" in executors.names()
    finally:
        recipes._REGISTRY.pop("lowercased", None)
        EXECUTORS.pop("threads", None)
        executors.__path__.remove(str(tmp_path / "executors"))
        for name in ("irflow.stages.lowercase", "irflow.recipes.lowercased", "irflow.engine.executors.threads"):
            sys.modules.pop(name, None)
