"""Config files: YAML, one section per stage, overridable with ``--set a.b=value``."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml


class ConfigError(ValueError):
    pass


def load(path: str | Path, overrides: list[str] | None = None) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(cfg, dict) or "flow" not in cfg:
        raise ConfigError(f"{path}: a config is a mapping with a 'flow' key (e.g. flow: baselines)")
    for item in overrides or []:
        apply_override(cfg, item)
    return cfg


def apply_override(cfg: dict, item: str) -> None:
    """``a.b.c=value``; value is parsed as YAML (numbers, lists, null...)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value (e.g. dense.model=/path/to/model)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    node = cfg
    for p in parts[:-1]:
        if not isinstance(node.setdefault(p, {}), dict):
            raise ConfigError(f"--set {key}: '{p}' is not a section")
        node = node[p]
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError:
        node[parts[-1]] = raw


def section(cfg: dict, name: str, defaults: dict | None = None) -> dict:
    out = copy.deepcopy(defaults or {})
    out.update(copy.deepcopy(cfg.get(name) or {}))
    return out
