"""What registers itself on import (recipes, executors) is found by importing every module of its package."""

from __future__ import annotations

import importlib
import pkgutil


def import_modules(package: str) -> None:
    """Import every module of ``package`` (each registers what it declares)."""
    for m in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{m.name}")
