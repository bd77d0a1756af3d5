"""Cache keys, and why a stage is stale: what ``irflow.engine.runner`` keys a stage's results on.

    cache key = sha256(canonical JSON of {stage, declared code version, params, input ids by role})

Canonical JSON sorts keys, has no spaces and writes what JSON cannot hold (a path) as its ``str``: the
same payload is the same key in every process. ``why_stale`` explains a miss by diffing a key's
payload with the one its stage recorded the last time it ran (``irflow status`` prints it).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from irflow.engine.catalog import Catalog
    from irflow.engine.store import DatasetRef


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def key_payload(stage: str, version: str, params: dict, inputs: dict[str, list[DatasetRef]]) -> dict:
    """What a cache key is made of: stage, declared code version, params, input dataset ids."""
    return {
        "stage": stage,
        "version": version,
        "cfg": params,
        "inputs": {role: [r.id for r in refs] for role, refs in sorted(inputs.items())},
    }


def cache_key(stage: str, version: str, params: dict, inputs: dict[str, list[DatasetRef]]) -> str:
    """The cache key of a stage (its name and code version) on keyed ``params`` and ``inputs``
    (``irflow.engine.stage.Stage.key``)."""
    return hash_payload(key_payload(stage, version, params, inputs))


def hash_payload(payload: dict) -> str:
    return hashlib.sha256(canonical(payload).encode()).hexdigest()


def config_changes(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every leaf that differs; nested sections are walked,
    so a changed teacher weight reads `teacher.weights.bm25: 0.3 -> 0.5`, not two whole dicts."""
    out = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", a, b))
    return out


def why_stale(catalog: Catalog, stage_label, detail, hit, forced, pending_inputs, damage=()) -> list[str]:
    """Human-readable reasons, from diffing this key's ingredients (``detail``, a ``key_payload``)
    with the last execution's."""
    if forced:
        return ["forced (--from)"]
    if pending_inputs:
        upstream = sorted({i[1:].split(":")[0] for ids in detail["inputs"].values() for i in ids
                           if i.startswith("<")})
        return ["upstream is stale: " + ", ".join(upstream)]
    if damage:
        return [f"stored {ref.id} is {problem}" for ref, problem in damage]
    if hit:
        return ["its output is missing from the store"]
    last = catalog.last_stage_detail(stage_label)
    if last is None:
        return ["never run"]
    reasons = []
    if last.get("version") != detail["version"]:
        reasons.append(f"code version {last.get('version')} -> {detail['version']}")
    reasons += [f"cfg.{path}: {a!r} -> {b!r}" for path, a, b in config_changes(last.get("cfg", {}), detail["cfg"])]
    old_in, new_in = last.get("inputs", {}), detail["inputs"]
    for role in sorted(set(old_in) | set(new_in)):
        if old_in.get(role) != new_in.get(role):
            reasons.append(f"input {role}: {old_in.get(role)} -> {new_in.get(role)}")
    return reasons or ["no cached result for this key"]
