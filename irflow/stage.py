"""Stages: plain functions, cached on what they read, wrapped in thin Prefect tasks.

A stage function takes dataset refs (its inputs, by role) and ``cfg`` (its config section) and
returns its outputs: a ``pyarrow.Table`` or a parquet file for table outputs, a directory for
model/index outputs. The runner here does the rest:

    cache key = sha256(stage name, declared code version, cfg, ids of the input datasets)

Input ids are content fingerprints, so the key changes exactly when something the stage reads
changes -- unlike Prefect's default cache policy (which includes the run id and pickles inputs)
or GPL's "skip if the output file exists". A hit is reused only if its files are still in the
store; a miss computes, validates each output against its contract, publishes atomically and
records lineage in the catalog.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from irflow.catalog import Catalog, now
from irflow.store import DatasetRef, Store

log = logging.getLogger("irflow")


@dataclass(frozen=True)
class Output:
    """What a stage output is: a table under a contract, or a directory (model / index)."""

    name: str
    contract: str | None = None  # tables
    kind: str = "table"  # "table" | "model" | "index"
    check: Callable[[Path], None] | None = None  # directories: called before publishing


@dataclass
class RunContext:
    """Everything a stage needs to know about the run it is part of. Picklable (strings only)."""

    store_root: str
    run_id: str
    # Stage names or labels to recompute even if cached (`irflow run --from STAGE`); everything
    # downstream of a forced stage is forced too (tracked through its output ids in the catalog).
    force: set[str] = field(default_factory=set)
    dry_run: bool = False  # `irflow status`: report cached/stale per stage, compute nothing
    plan: list = field(default_factory=list)  # dry-run results, in stage order

    @property
    def store(self) -> Store:
        return Store(self.store_root)

    @property
    def catalog(self) -> Catalog:
        return Catalog(self.store.catalog_path)


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def keyed(cfg: Any) -> Any:
    """cfg without its run-time hints: keys starting with '_' (a local path, a thread count, a
    device), at any depth, are not part of what a stage computes and are not keyed."""
    if isinstance(cfg, dict):
        return {k: keyed(v) for k, v in cfg.items() if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(cfg, (list, tuple)):
        return [keyed(v) for v in cfg]
    return cfg


def key_payload(stage: str, version: str, cfg: dict, inputs: dict[str, list[DatasetRef]]) -> dict:
    """What a cache key is made of: stage, declared code version, keyed cfg, input dataset ids."""
    return {
        "stage": stage,
        "version": version,
        "cfg": keyed(cfg),
        "inputs": {role: [r.id for r in refs] for role, refs in sorted(inputs.items())},
    }


def cache_key(stage: str, version: str, cfg: dict, inputs: dict[str, list[DatasetRef]]) -> str:
    return hashlib.sha256(canonical(key_payload(stage, version, cfg, inputs)).encode()).hexdigest()


PENDING = "pending"  # kind of a placeholder ref in a dry run: "this would be recomputed"


def _as_list(v) -> list[DatasetRef]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


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


class Stage:
    """A declared stage. ``stage(ctx, cfg=..., label=..., **inputs)`` runs it as a Prefect task;
    ``stage.run(...)`` runs it without Prefect (same caching); ``stage.fn`` is the plain function."""

    def __init__(self, fn: Callable, name: str, version: str, outputs: list[Output]):
        self.fn = fn
        self.name = name
        self.version = version
        self.outputs = outputs
        self.__doc__ = fn.__doc__
        self._task = None

    def label(self, label: str | None) -> str:
        return f"{self.name}[{label}]" if label else self.name

    def key(self, cfg: dict, inputs: dict[str, Any]) -> str:
        return cache_key(self.name, self.version, cfg, {k: _as_list(v) for k, v in inputs.items()})

    # -- execution ------------------------------------------------------------------------
    def run(self, ctx: RunContext, *, cfg: dict, label: str | None = None, **inputs) -> Any:
        store, catalog = ctx.store, ctx.catalog
        stage_label = self.label(label)
        inputs = {k: v for k, v in inputs.items() if v is not None}
        input_ids = [r.id for v in inputs.values() for r in _as_list(v)]
        detail = key_payload(self.name, self.version, cfg, {k: _as_list(v) for k, v in inputs.items()})
        key = self.key(cfg, inputs)
        started, t0 = now(), time.perf_counter()

        forced = bool({self.name, stage_label} & ctx.force) or catalog.tainted(ctx.run_id, input_ids)
        pending_inputs = any(r.kind == PENDING for v in inputs.values() for r in _as_list(v))
        hit = {} if forced or pending_inputs else catalog.lookup(key)
        if hit and all(o.name in hit and Path(hit[o.name].path).exists() for o in self.outputs):
            refs = {o.name: hit[o.name] for o in self.outputs}
            status = "cached"
            log.info("%s: cached (%s)", stage_label, ", ".join(r.id for r in refs.values()))
        elif ctx.dry_run:
            refs = {o.name: DatasetRef(f"<{stage_label}:{o.name}>", o.name, PENDING, o.contract, "")
                    for o in self.outputs}
            status = "stale"
            detail["why"] = self._why_stale(catalog, ctx, stage_label, detail, key, hit, forced, pending_inputs)
        else:
            refs = self._compute(ctx, store, catalog, key, cfg, inputs, stage_label)
            status = "computed"
            if forced:
                catalog.taint(ctx.run_id, [r.id for r in refs.values()])
        if not ctx.dry_run:
            catalog.record_stage_run(ctx.run_id, stage_label, key, status, {k: r.id for k, r in refs.items()},
                                     time.perf_counter() - t0, started, detail)
        else:
            ctx.plan.append({"name": stage_label, "status": status, "why": detail.get("why", [])})
        return refs[self.outputs[0].name] if len(self.outputs) == 1 else refs

    @staticmethod
    def _why_stale(catalog: Catalog, ctx, stage_label, detail, key, hit, forced, pending_inputs) -> list[str]:
        """Human-readable reasons, from diffing this key's ingredients with the last execution's."""
        if forced:
            return ["forced (--from)"]
        if pending_inputs:
            upstream = sorted({i[1:].split(":")[0] for ids in detail["inputs"].values() for i in ids
                               if i.startswith("<")})
            return ["upstream is stale: " + ", ".join(upstream)]
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

    def _compute(self, ctx, store: Store, catalog: Catalog, key, cfg, inputs, stage_label) -> dict[str, DatasetRef]:
        workdir = store.staging_dir()
        try:
            kwargs = dict(inputs, cfg=cfg)
            accepted = inspect.signature(self.fn).parameters
            if "workdir" in accepted:
                kwargs["workdir"] = workdir
            if "resume_dir" in accepted:
                # Survives a crash (unlike workdir): shards/checkpoints of an interrupted computation
                # with the same key are found here again. Removed once the outputs are published.
                resume_dir = store.root / "partial" / key
                resume_dir.mkdir(parents=True, exist_ok=True)
                kwargs["resume_dir"] = resume_dir
            log.info("%s: computing", stage_label)
            result = self.fn(**kwargs)
            if len(self.outputs) == 1 and not isinstance(result, dict):
                result = {self.outputs[0].name: result}
            missing = [o.name for o in self.outputs if o.name not in result]
            if missing:
                raise RuntimeError(f"stage {self.name} did not return outputs {missing}")
            # Validate and stage every output before publishing any: a stage whose second output
            # breaks its contract must leave nothing of its first one in the store.
            staged: dict[str, tuple[Path, int | None]] = {}
            try:
                for o in self.outputs:
                    value = result[o.name]
                    if o.kind == "table":
                        if not isinstance(value, (pa.Table, Path, str)):
                            raise TypeError(f"stage {self.name} output {o.name}: expected a table, got {type(value)}")
                        staged[o.name] = store.stage_table(o.contract, value if isinstance(value, pa.Table)
                                                           else Path(value))
                    else:
                        staging = store.staging_dir()
                        staging.rmdir()
                        shutil.move(str(Path(value)), staging)
                        staged[o.name] = (staging, None)
                        if o.check is not None:
                            o.check(staging)
            except BaseException:
                for staging, _ in staged.values():
                    shutil.rmtree(staging, ignore_errors=True)
                raise
            published: dict[str, tuple[DatasetRef, int | None, int]] = {}
            for o in self.outputs:
                staging, rows = staged[o.name]
                size = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
                ref = store.publish(_ds_name(self, o), o.kind, o.contract, staging)
                published[o.name] = (ref, rows, size)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        parents = {role: [r.id for r in _as_list(v)] for role, v in inputs.items()}
        catalog.record_outputs(stage=stage_label, cache_key=key, code_version=self.version,
                               params=keyed(cfg),
                               run_id=ctx.run_id, outputs=published, parents=parents)
        shutil.rmtree(store.root / "partial" / key, ignore_errors=True)
        return {name: p[0] for name, p in published.items()}

    # -- Prefect --------------------------------------------------------------------------
    @property
    def task(self):
        if self._task is None:
            from prefect import task
            from prefect.cache_policies import NO_CACHE

            stage = self

            # Prefect's own result caching is off: irflow's key is the cache (see module doc).
            @task(name=self.name, cache_policy=NO_CACHE, persist_result=False,
                  task_run_name="{name}", retries=0)
            def run_stage(ctx: RunContext, cfg: dict, label: str | None, inputs: dict, name: str):
                return stage.run(ctx, cfg=cfg, label=label, **inputs)

            self._task = run_stage
        return self._task

    def __call__(self, ctx: RunContext, *, cfg: dict, label: str | None = None, **inputs):
        if ctx.dry_run:  # planning needs no Prefect task runs
            return self.run(ctx, cfg=cfg, label=label, **inputs)
        return self.task(ctx, cfg, label, inputs, name=self.label(label))


def _ds_name(stage: Stage, o: Output) -> str:
    return o.name if len(stage.outputs) > 1 or o.name != "out" else stage.name


def stage(name: str, version: str, outputs: list[Output] | Output) -> Callable[[Callable], Stage]:
    """Declare a stage: ``@stage("bm25_search", version="1", outputs=Output("run", "run"))``.

    Bump ``version`` whenever a change to the code changes what the stage outputs.
    """
    outs = [outputs] if isinstance(outputs, Output) else list(outputs)

    def wrap(fn: Callable) -> Stage:
        return Stage(fn, name, version, outs)

    return wrap
