"""The documentation: generated reference pages match the code, and the site builds offline with --strict."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from irflow import cli
from irflow.dev import docs_gen, recipe_files
from irflow.recipes.base import get_recipe, recipe_names

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = ".venv/bin/python -m irflow.dev.docs_gen (or make docs), then commit the pages"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    """docs/ and mkdocs.yml copied to a temp dir, the generated pages written over the copy."""
    tmp = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "docs", tmp / "docs", symlinks=True)
    shutil.copy(ROOT / "mkdocs.yml", tmp / "mkdocs.yml")
    docs_gen.write(tmp / "docs", tmp / "mkdocs.yml")
    return tmp


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "results" not in p.relative_to(root).parts}


def test_committed_reference_pages_are_current(regenerated):
    committed, fresh = _files(ROOT / "docs"), _files(regenerated / "docs")
    stale = sorted(rel for rel in set(committed) | set(fresh) if committed.get(rel) != fresh.get(rel))
    stale = [f"docs/{rel}" for rel in stale]
    if (ROOT / "mkdocs.yml").read_text() != (regenerated / "mkdocs.yml").read_text():
        stale.append("mkdocs.yml (the nav of the recipes' config pages)")
    assert not stale, f"generated documentation is stale: {', '.join(stale)}; regenerate with: {REGENERATE}"


def _rows(page: Path) -> int:
    """Rows of the config-key tables of a generated recipe page (each row a key)."""
    text = page.read_text().split("## Config keys", 1)[1]
    return sum(1 for line in text.splitlines() if line.startswith("| `"))


def _config_for(name: str) -> Path | None:
    configs = docs_gen.example_configs(name)
    return ROOT / configs[0] if configs else None


@pytest.mark.parametrize("name", recipe_names())
def test_config_reference_lists_every_key_explain_lists(name, capsys):
    page = ROOT / "docs" / "reference" / "config" / f"{name}.md"
    assert page.is_file(), f"no reference page for recipe {name}: regenerate with {REGENERATE}"
    keys = len(get_recipe(name).config_cls.explain())
    assert _rows(page) == keys, f"{page} lists {_rows(page)} keys, the recipe {keys}: regenerate with {REGENERATE}"
    config = _config_for(name)
    if config is not None:  # what `irflow config CONFIG --explain` prints: one line a key
        assert cli.main(["config", str(config), "--explain"]) == 0
        assert len(capsys.readouterr().out.splitlines()) == keys


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_has_its_config_deployment_page_and_rows(name):
    """What CONTRIBUTING.md lists beside a recipe's module (``irflow.dev.recipe_files``)."""
    lacks = recipe_files.missing(ROOT, name)
    assert lacks == [], f"recipe {name} lacks (CONTRIBUTING.md, 'A recipe'): " + "; ".join(lacks)


def test_a_stale_page_is_named(regenerated):
    """A generated page edited by hand (or left behind by a code change) is reported by its path."""
    docs, mkdocs_yml = regenerated / "docs", regenerated / "mkdocs.yml"
    page = docs / "reference" / "cli.md"
    text = page.read_text()
    assert docs_gen.stale(docs, mkdocs_yml) == []
    try:
        page.write_text(text + "\nan edit by hand\n")
        assert docs_gen.stale(docs, mkdocs_yml) == [str(page)]
    finally:
        page.write_text(text)


def test_site_builds_offline_with_strict(regenerated):
    """mkdocs build --strict over the committed docs: every link, anchor, snippet and nav entry resolves.
    No network: proxies point nowhere, so a build that fetched anything would fail."""
    site = regenerated / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert (site / "index.html").is_file()
    assert (site / "reference" / "cli.html").is_file()
