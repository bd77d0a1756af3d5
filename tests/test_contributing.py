"""CONTRIBUTING.md's code runs as written: its stage, its recipe and its executor, loaded as the modules
they say they are, run the recipe on a slice of SciFact through the executor's pool; and the files a newcomer
touches to add them, counted by adding them once to a copy of the checkout's docs, configs and deployments."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
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
    (tmp_path / "executors" / "pool.py").write_text(executor_code)
    executors.__path__.append(str(tmp_path / "executors"))
    executors._DISCOVERED = False
    try:
        _load("irflow.stages.lowercase", stage_code, tmp_path)
        _load("irflow.recipes.lowercased", recipe_code, tmp_path)
        data = beir_slice(shared_datasets / "scifact.zip", tmp_path / "slice", n_test_queries=6, n_extra_docs=40,
                          seed=2)
        cfg = {"flow": "lowercased", "dataset": {"name": "slice", "source": str(data)},
               "bm25": {"variants": ["flat"]}, "runtime": {"executor": "pool", "shard_rows": 16, "threads": 1}}
        r = api.run(cfg, store=tmp_path / "store")
        lowered = next(s for s in r.stages if s.name == "lowercase")
        assert lowered.status == "computed" and r.metrics and r.metrics[0]["system"] == "bm25-flat"
        catalog = api.catalog(tmp_path / "store")
        corpus = catalog.ref(lowered.outputs["corpus"]).table()
        assert corpus.num_rows > 16  # more than one shard went through the pool
        assert pc.all(pc.equal(corpus["text"], pc.utf8_lower(corpus["text"]))).as_py()
        shards = [s for s in catalog.stage_runs(r.run_id) if s["name"] == "lowercase"][0]["shards"]
        assert len(shards) >= 2
        assert "pool" in executors.names()
        _its_settings_are_a_runtime_section(tmp_path / "executors", cfg)
        _a_newcomer_adds_the_recipe(tmp_path / "checkout", cfg)
    finally:
        recipes._REGISTRY.pop("lowercased", None)
        EXECUTORS.pop("pool", None)
        executors.__path__.remove(str(tmp_path / "executors"))
        for name in ("irflow.stages.lowercase", "irflow.recipes.lowercased", "irflow.engine.executors.pool"):
            sys.modules.pop(name, None)


def _its_settings_are_a_runtime_section(folder: Path, cfg: dict) -> None:
    """In a process where the executor's module is there before the config is read (as one in the package is):
    its ``runtime.pool`` section is checked with the rest of the config and reaches the executor."""
    script = f"""
import json, sys
import irflow.engine.executors as executors
executors.__path__.append({str(folder)!r})
from irflow.recipes.base import load_config
from irflow.engine.errors import ConfigError
from irflow.engine.executors import executor_for
cfg = json.loads(sys.argv[1])
c = load_config(cfg, ["runtime.pool.workers=3"])
print("workers", executor_for(c.runtime).settings_of(c.runtime).workers)
try:
    load_config(cfg, ["runtime.pool.wrkers=3"])
except ConfigError as e:
    print("refused", str(e).splitlines()[0])
"""
    cfg = {**cfg, "flow": "baselines"}
    out = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "workers 3" in lines, out.stdout
    assert any(ln.startswith("refused") and "runtime.pool.wrkers" in ln for ln in lines), out.stdout


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _a_newcomer_adds_the_recipe(root: Path, cfg: dict) -> None:
    """Beside the three modules (one each: the stage, the recipe, the executor), what CONTRIBUTING.md's recipe
    section lists, written once into a copy of the checkout's docs, configs and prefect.yaml: the project's
    checks (``irflow.dev.recipe_files.missing``, ``docs_gen.stale``) name each file until it is there, and
    five files by hand plus the generated pages are what it took."""
    import yaml

    from irflow.dev import docs_gen, recipe_files

    for rel in ("docs", "configs"):
        shutil.copytree(ROOT / rel, root / rel, symlinks=True)
    for rel in ("mkdocs.yml", "prefect.yaml"):
        shutil.copy(ROOT / rel, root / rel)
    before = _digests(root)
    assert [m.split(":")[0] for m in recipe_files.missing(root, "lowercased")] == [
        "configs/", "prefect.yaml", "docs/recipes/lowercased.md", "mkdocs.yml", "docs/recipes/index.md"]
    by_hand = {"configs/lowercased.yaml", "prefect.yaml", "docs/recipes/lowercased.md", "mkdocs.yml",
               "docs/recipes/index.md"}
    (root / "configs" / "lowercased.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k != "runtime"}))
    spec = yaml.safe_load((root / "prefect.yaml").read_text())
    spec["deployments"].append({"name": "lowercased", "entrypoint": "irflow/recipes/lowercased.py:lowercased_flow",
                                "parameters": {"config": "configs/lowercased.yaml", "overrides": [], "store": "store"},
                                "work_pool": {"name": "irflow-local", "work_queue_name": "default"}})
    (root / "prefect.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (root / "docs" / "recipes" / "lowercased.md").write_text(
        '# Lowercased\n\nBM25 over a lowercased corpus.\n\n--8<-- "reference/config/lowercased.md:figure"\n')
    nav = root / "mkdocs.yml"
    nav.write_text(nav.read_text().replace("      - Contriever: recipes/contriever.md\n",
                                           "      - Contriever: recipes/contriever.md\n"
                                           "      - Lowercased: recipes/lowercased.md\n", 1))
    index = root / "docs" / "recipes" / "index.md"
    index.write_text(index.read_text() + "| [Lowercased](lowercased.md) | `lowercased` | nothing: BM25 |\n")
    assert recipe_files.missing(root, "lowercased") == []
    stale = docs_gen.stale(root / "docs", root / "mkdocs.yml")
    assert str(root / "docs" / "reference" / "config" / "lowercased.md") in stale  # until it is generated
    docs_gen.write(root / "docs", root / "mkdocs.yml")
    assert docs_gen.stale(root / "docs", root / "mkdocs.yml") == []
    after = _digests(root)
    touched = {rel for rel in set(before) | set(after) if before.get(rel) != after.get(rel)}
    generated = touched - by_hand
    assert by_hand <= touched and "docs/reference/config/lowercased.md" in generated
    assert all(rel.startswith("docs/reference/") for rel in generated), generated
    print(f"a stage: 1 module; a recipe: 1 module + {len(by_hand)} files by hand + {len(generated)} generated "
          f"({', '.join(sorted(generated))}) and the mkdocs.yml nav's generated part; an executor: 1 module")
