"""What a recipe needs beside its module, in a checkout: the files a newcomer writes by hand for it
(CONTRIBUTING.md lists them). ``tests/test_docs.py`` and ``tests/test_deployments.py`` hold every registered
recipe to ``missing``; ``tests/test_contributing.py`` adds CONTRIBUTING's recipe once and counts the files it
took."""

from __future__ import annotations

import re
from pathlib import Path

import yaml


def configs_of(root: Path, name: str) -> list[str]:
    """The configs in ``root``/configs whose ``flow:`` is ``name``."""
    return [f"configs/{f.name}" for f in sorted((root / "configs").glob("*.yaml"))
            if re.search(rf"^flow:\s*{re.escape(name)}\s*(#.*)?$", f.read_text(encoding="utf-8"), re.M)]


def missing(root: Path, name: str) -> list[str]:
    """'path: what' for each file that recipe ``name`` still lacks under ``root``; [] when it has them all."""
    out = []
    if not configs_of(root, name):
        out.append(f"configs/: a config with flow: {name} (the one its deployment runs)")
    entry = f"irflow/recipes/{name}.py:{name}_flow"
    deployments = yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]
    if not any(d["entrypoint"] == entry for d in deployments):
        out.append(f"prefect.yaml: a deployment of {entry}")
    if not (root / "docs" / "recipes" / f"{name}.md").is_file():
        out.append(f"docs/recipes/{name}.md: its page (its figure, how to run it, what it measured)")
    if f"recipes/{name}.md" not in (root / "mkdocs.yml").read_text():
        out.append(f"mkdocs.yml: recipes/{name}.md in the nav")
    if f"]({name}.md)" not in (root / "docs" / "recipes" / "index.md").read_text():
        out.append(f"docs/recipes/index.md: a row linking {name}.md")
    return out
