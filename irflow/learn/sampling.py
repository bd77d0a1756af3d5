"""Seeded sampling that does not depend on table order: one RNG per (seed, key...)."""

from __future__ import annotations

import random
from typing import Sequence


def rng(seed, *key: str) -> random.Random:
    return random.Random("\x1f".join([str(seed), *key]))


def sample(pool: Sequence[str], n: int, seed, *key: str) -> list[str]:
    """n distinct items from pool (all of them if fewer), deterministic for (seed, key)."""
    items = sorted(pool)
    return rng(seed, *key).sample(items, min(int(n), len(items)))
