"""Stages: plain functions of (params, runtime, input refs), cached on what they read.

    @stage("bm25_search", version="2", outputs=Output("run", "run"))
    def bm25_search(p: BM25SearchParams, rt: StageRuntime, *, bm25_index: DatasetRef,
                    queries: DatasetRef) -> pa.Table: ...

The first argument's type is the stage's params model (a ``irflow.params.Params``); the keyword-only
arguments are its inputs, by role (a default of None makes an input optional). The runner here does
the rest:

    cache key = sha256(stage name, declared code version, params.model_dump(mode="json"),
                       ids of the input datasets by role)

Input ids are content fingerprints (a model named in a config enters as an input too, by the
fingerprint of its weights), so the key changes exactly when something the stage reads changes --
unlike Prefect's default cache policy (which includes the run id and pickles inputs) or GPL's
"skip if the output file exists". Runtime settings (device, precision, threads) are not keyed; they
are recorded per stage run. A hit is reused only if its files are still in the store; a miss
computes, validates each output against its contract, publishes atomically and records lineage.
A hit whose files no longer match their digest is set aside and recomputed (see irflow.store), and
so is never used; one computation of a key at a time (a file lock per key between processes, a lock
per key between the threads of one), so identical runs started together compute each stage once.

Calling a stage inside a recipe, ``bm25_search(run, params, tag="flat", bm25_index=..., queries=...)``,
runs it as a Prefect task and returns its refs; with executor ray (``runtime.ray.concurrent_stages``
above 1) it submits the task and returns at once a ``Deferred`` standing for them, so that stages
that do not read each other's outputs run at the same time (``irflow.branches``).
``stage.run(run, params, ...)`` runs it without Prefect (same caching);
``stage.fn(params, StageRuntime(), ...)`` is the plain function.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import shutil
import threading
import time
import typing
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from irflow.cache import cache_key, hash_payload, key_payload, why_stale
from irflow.catalog import Catalog, now
from irflow.errors import DataError, StageFailed
from irflow.params import Params
from irflow.processes import check_interrupted, file_lock, release_memory
from irflow.runtime import RuntimeConfig, stage_runtime
from irflow.executors import executor_for
from irflow.labels import label as make_label
from irflow.worker import torch_threads, warnings_logged  # noqa: F401 -- part of this module's API
from irflow.store import TABLE_FILE, DatasetRef, Store, remove_tree, tree_size, write_parts

log = logging.getLogger("irflow")


@dataclass(frozen=True)
class Output:
    """What a stage output is: a table under a contract, or a directory (model / index)."""

    name: str
    contract: str | None = None  # tables
    kind: str = "table"  # "table" | "model" | "index"
    check: Callable[[Path], None] | None = None  # directories: called before publishing


PENDING = "pending"  # kind of a placeholder ref in a dry run: "this would be recomputed"


class Run:
    """One execution of a recipe: where (store), which (run id), how (runtime), what to force.

    ``force`` holds stage names (``mine_negatives``, or one call of it: ``mine_negatives[bm25]``) to
    recompute even if cached (``irflow run --from STAGE``); everything downstream of a forced stage is
    forced too (tracked through its output ids in the catalog). ``dry_run`` (``irflow status``) reports cached/stale per stage and computes nothing.
    ``only`` (``--to STAGE``: the stage labels it needs, see ``irflow.recipe.upstream``) skips every other
    stage: a skipped call returns placeholder refs, records nothing and is listed in ``skipped``.
    ``branches`` (set by ``irflow.recipe.execute`` with executor ray) makes stage calls run at once
    (``irflow.branches``); ``error`` and ``failed`` are then the first failure, whichever thread saw it.
    """

    def __init__(self, store_root: str | Path, run_id: str, *, runtime: RuntimeConfig | None = None,
                 force: set[str] | frozenset[str] = frozenset(), dry_run: bool = False,
                 only: set[str] | frozenset[str] | None = None):
        self.store_root = str(Path(store_root).resolve())
        self.run_id = run_id
        self.runtime = runtime or RuntimeConfig()
        self.force = set(force)
        self.dry_run = dry_run
        self.only = None if only is None else set(only)
        self.plan: list[dict] = []  # dry-run results, in stage order
        self.skipped: list[dict] = []  # stages left out by `only`: {name, inputs, outputs}
        self.failed: dict | None = None  # the stage that failed: {name, inputs, seconds}
        self.error: BaseException | None = None  # the first failure (stages may run at once: irflow.branches)
        self.branches = None  # irflow.branches.Branches while stage calls run at once
        self.executor = executor_for(self.runtime)  # where shards (and, for some, stages at once) run
        # what a recipe says about its evaluated dense models (irflow.selection picks the one to ship):
        # system -> model ref, the system training started from, and what the evaluation measured
        self.dense_models: dict[str, DatasetRef] = {}
        self.start_system: str | None = None
        self.evaluation: str = "labelled"
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # A Run travels with Prefect's task context to Ray shard workers (cloudpickle): without the
        # driver's lock, its branches and its error (not needed there, and not all picklable).
        state = self.__dict__.copy()
        state.update(_lock=None, branches=None, error=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def fail(self, error: BaseException, failed: dict | None = None) -> None:
        """Record a stage's failure, if it is the run's first (``failed``: the stage, for its graph)."""
        with self._lock:
            if self.error is None:
                self.error = error
                if failed is not None:
                    self.failed = failed

    def skips(self, stage_label: str) -> bool:
        return self.only is not None and stage_label not in self.only

    @cached_property
    def store(self) -> Store:
        return Store(self.store_root)

    @cached_property
    def catalog(self) -> Catalog:
        return Catalog(self.store.catalog_path)

    def model(self, name: str, where: str) -> DatasetRef:
        """A model named in the config (``where`` is its config key), as an input ref: a stored model,
        a local directory (keyed by a fingerprint of its files) or a hub id. Fails with
        ``ModelNotAvailable`` naming it if it cannot be had here."""
        from irflow.models import model_ref

        ref = model_ref(name, self.store_root, where)
        if not self.dry_run:
            self.catalog.record_external(ref, self.run_id, {"name": name, "config_key": where})
        return ref

    def external(self, ref: DatasetRef, params: dict) -> DatasetRef:
        """Record a ref that no stage made (a dataset source) so that lineage can end at it."""
        if not self.dry_run:
            self.catalog.record_external(ref, self.run_id, params)
        return ref


def _as_list(v) -> list[DatasetRef]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


#: The stage that exports a model for the stages declared with ``onnx=`` (and its params model):
#: ``irflow.tasks.export_onnx`` registers itself here when ``irflow.tasks`` is imported.
ONNX_EXPORT: dict[str, Any] = {}


# Stages that compute with torch in this process (``work`` set, not sharded) take turns, also when
# stages run at once (irflow.branches): torch.set_num_threads and a GPU's memory are the process's.
_DRIVER_TORCH = threading.RLock()
_KEY_LOCKS: dict[str, list] = {}  # cache key -> [lock, holders and waiters]: one computation per key
_KEY_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _key_lock(key: str):
    with _KEY_LOCKS_GUARD:
        entry = _KEY_LOCKS.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
    try:
        yield entry[0]
    finally:
        with _KEY_LOCKS_GUARD:
            entry[1] -= 1
            if not entry[1]:
                del _KEY_LOCKS[key]


@contextlib.contextmanager
def _turn(lock, waiting: str):
    """Hold ``lock``; yields the seconds spent waiting for it (``waiting`` is logged if it must wait)."""
    waited = 0.0
    if not lock.acquire(blocking=False):
        log.info(waiting)
        t = time.perf_counter()
        lock.acquire()
        waited = time.perf_counter() - t
        log.info("%s: done waiting (%.1f s)", waiting.split(":")[0], waited)
    try:
        yield waited
    finally:
        lock.release()


class _Clock:
    """When a stage run started and how long it took, not counting its waits for other stages of the
    run (``skip``): what the catalog records, so that stages that ran at once show as overlapping."""

    def __init__(self):
        self.started, self._t0 = now(), time.perf_counter()

    def skip(self, seconds: float) -> None:
        if seconds:
            self.started += timedelta(seconds=seconds)
            self._t0 += seconds

    def seconds(self) -> float:
        return round(time.perf_counter() - self._t0, 3)


class Stage:
    """A declared stage (see the module doc)."""

    def __init__(self, fn: Callable, name: str, version: str, outputs: list[Output], work: str | None,
                 resumable: bool, shard: str | None = None, shard_when: Callable[[Params], bool] | None = None,
                 shard_align: Callable[[Params], int] | None = None,
                 onnx: Callable[[Params], dict[str, tuple[str, str]]] | None = None):
        self.fn = fn
        self.onnx = onnx
        self.shard = shard
        self.shard_when = shard_when
        self.shard_align = shard_align
        self.name = name
        self.version = version
        self.outputs = outputs
        self.work = work
        self.resumable = resumable
        self.__doc__ = fn.__doc__
        self._task = None
        hints = typing.get_type_hints(fn, include_extras=True)  # keep union discriminators
        params = list(inspect.signature(fn).parameters.values())
        if len(params) < 2 or params[0].kind is inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"stage {name}: signature must be (params, rt, *, inputs...)")
        # A Params model, or a discriminated union of them (a field that selects a kind: a source, a teacher).
        self.params_type = hints.get(params[0].name)
        self.params_members = _params_members(self.params_type)
        if not self.params_members:
            raise TypeError(f"stage {name}: its first argument must be annotated with a Params model (or a union)")
        self._adapter = None
        kw = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        self.required_inputs = {p.name for p in kw if p.default is inspect.Parameter.empty}
        self.optional_inputs = {p.name for p in kw if p.default is not inspect.Parameter.empty}
        if shard is not None and (shard not in self.required_inputs or any(o.kind != "table" for o in outputs)):
            raise TypeError(f"stage {name}: shard= names a required input of a stage whose outputs are tables")
        if shard is None and (shard_when or shard_align):
            raise TypeError(f"stage {name}: shard_when= and shard_align= need shard=")
        if onnx is not None and work is None:
            raise TypeError(f"stage {name}: onnx= is for stages that run models (work encode or score)")

    def run_name(self, tag: str | None) -> str:
        """The name of one call in a run: ``bm25_search[flat]`` (the tag tells calls apart)."""
        return make_label(self.name, tag)

    def _check(self, params, inputs: dict) -> tuple[Params, dict]:
        # Exactly a member class: a config section that subclasses one (and adds recipe-level fields,
        # like the model to load) must be projected with `.to(...)`, or its extra fields would be keyed.
        if type(params) not in self.params_members:
            if self._adapter is None:
                from pydantic import TypeAdapter

                self._adapter = TypeAdapter(self.params_type)
            params = self._adapter.validate_python(params.model_dump() if isinstance(params, Params) else params)
        unknown = set(inputs) - self.required_inputs - self.optional_inputs
        if unknown:
            raise TypeError(f"stage {self.name}: unknown input(s) {sorted(unknown)}; it reads "
                            f"{sorted(self.required_inputs | self.optional_inputs)}")
        inputs = {k: v for k, v in inputs.items() if v is not None}
        missing = self.required_inputs - set(inputs)
        if missing:
            raise TypeError(f"stage {self.name}: missing input(s) {sorted(missing)}")
        return params, inputs

    def key(self, params: Params, inputs: dict[str, Any]) -> str:
        return cache_key(self.name, self.version, params.key_dump(), {k: _as_list(v) for k, v in inputs.items()})

    # -- execution ------------------------------------------------------------------------
    def run(self, run: Run, params: Params | dict, /, *, tag: str | None = None, **inputs) -> Any:
        return self.execute(run, params, tag, inputs)[0]

    def _placeholders(self, stage_label: str) -> dict[str, DatasetRef]:
        """Refs standing for outputs that are not computed here (stale in a dry run, or skipped)."""
        return {o.name: DatasetRef(f"<{stage_label}:{o.name}>", o.name, PENDING, o.contract, "")
                for o in self.outputs}

    def execute(self, run: Run, params: Params | dict, tag: str | None, inputs: dict, *,
                needed: bool = False) -> tuple[Any, str]:
        """(the output ref, or a dict of them; status: computed | cached | stale | skipped). ``needed``:
        run even if ``--to`` leaves it out (a stage another stage's computation asks for: export_onnx)."""
        check_interrupted()
        params, inputs = self._check(params, inputs)
        store, catalog = run.store, run.catalog
        stage_label = self.run_name(tag)
        if run.skips(stage_label) and not needed:
            refs = self._placeholders(stage_label)
            entry = {"name": stage_label, "inputs": _ids(inputs), "outputs": {k: r.id for k, r in refs.items()}}
            if run.dry_run:
                run.plan.append({**entry, "status": "skipped", "why": ["not needed for --to"],
                                 "datasets": _describe(inputs, refs)})
            else:
                run.skipped.append(entry)
            return self._result(refs), "skipped"
        input_ids = [r.id for v in inputs.values() for r in _as_list(v)]
        detail = key_payload(self.name, self.version, params.key_dump(), {k: _as_list(v) for k, v in inputs.items()})
        key = hash_payload(detail)  # = self.key(params, inputs), without dumping the params twice
        clock = _Clock()

        # taints are recorded only below a forced stage: without --from there are none to look up
        forced = bool({self.name, stage_label} & run.force) or (bool(run.force)
                                                                and catalog.tainted(run.run_id, input_ids))
        pending_inputs = any(r.kind == PENDING for v in inputs.values() for r in _as_list(v))
        provenance = None
        if run.dry_run:
            hit = {} if forced or pending_inputs else catalog.lookup(key)
            damage = self._damage(store, hit)
            if hit and not damage:
                refs, status = {o.name: hit[o.name] for o in self.outputs}, "cached"
            else:
                refs = self._placeholders(stage_label)
                status = "stale"
                detail["why"] = why_stale(catalog, stage_label, detail, hit, forced, pending_inputs, damage)
            # inputs and outputs by id, and what each id is: enough to draw the plan (irflow.dag)
            run.plan.append({"name": stage_label, "status": status, "why": detail.get("why", []),
                             "inputs": _ids(inputs), "outputs": {k: r.id for k, r in refs.items()},
                             "datasets": _describe(inputs, refs)})
            return self._result(refs), status

        # One computation per key at a time: a second call of the same key in this process (stages
        # run at once: irflow.branches), or a second run started alongside, waits here for the first
        # one's result and reuses it, instead of computing the same thing again (the kernel drops the
        # file lock of a process that dies, so a killed run never blocks the next one).
        with _key_lock(key) as lock, \
                _turn(lock, f"{stage_label}: waiting for another stage of this run computing the same key") as waited, \
                file_lock(store.root / "locks" / f"{key[:32]}.lock",
                          waiting=f"{stage_label}: waiting for another process computing the same stage"):
            clock.skip(waited)
            hit = {} if forced else catalog.lookup(key)
            damage = self._damage(store, hit)
            for ref, problem in damage:
                log.warning("%s: stored %s is %s; it is set aside and recomputed", stage_label, ref.id, problem)
                store.set_aside(ref)
            if damage:
                detail["recomputed"] = [f"{ref.id}: {problem}" for ref, problem in damage]
            if hit and not damage:
                refs = {o.name: hit[o.name] for o in self.outputs}
                status = "cached"
                log.info("%s: cached (%s)", stage_label, ", ".join(r.id for r in refs.values()))
                # What its computation warned about still holds for these datasets: said again, so that
                # a run that reuses them warns as the run that made them did.
                for message, made_by in catalog.warnings_of([r.id for r in refs.values()]):
                    log.warning("%s (%s: cached, as computed by run %s)", message, stage_label, made_by)
            else:
                try:
                    self._check_inputs(store, stage_label, inputs)
                    with (_turn(_DRIVER_TORCH, f"{stage_label}: waiting for another stage computing with "
                                               f"torch in this process") if self.work and not self.shard
                          else contextlib.nullcontext(0.0)) as waited:
                        clock.skip(waited)
                        check_interrupted()
                        onnx_models = self._onnx_models(run, params, inputs)
                        refs, provenance = self._compute(run, store, catalog, key, params, inputs, stage_label,
                                                         onnx_models)
                except Exception as e:
                    # A Ctrl-C that a library turned into its own error anywhere in the computation (the
                    # stage's function, but also staging its outputs: a DuckDB contract query raises
                    # InvalidInputException) is still a Ctrl-C: the run is interrupted, no stage failed.
                    check_interrupted()
                    # kept for the run's row (not stage_runs: only results go there), so that its graph
                    # shows where it failed (irflow.dag)
                    run.fail(e, {"name": stage_label, "inputs": _ids(inputs), "seconds": clock.seconds()})
                    raise
                release_memory()
                status = "computed"
                if forced:
                    catalog.taint(run.run_id, [r.id for r in refs.values()])
        catalog.record_stage_run(run.run_id, stage_label, key, status, {k: r.id for k, r in refs.items()},
                                 clock.seconds(), clock.started, detail, provenance)
        return self._result(refs), status

    def _result(self, refs: dict[str, DatasetRef]):
        return refs[self.outputs[0].name] if len(self.outputs) == 1 else refs

    def _damage(self, store: Store, hit: dict) -> list[tuple[DatasetRef, str]]:
        """(ref, what is wrong) for each cached output that is missing or no longer matches its digest."""
        if not hit:
            return []
        out = []
        for o in self.outputs:
            ref = hit.get(o.name)
            if ref is None:
                continue
            problem = "missing" if not Path(ref.path).exists() else store.check(ref)
            if problem:
                out.append((ref, problem))
        return out

    @staticmethod
    def _check_inputs(store: Store, stage_label: str, inputs: dict) -> None:
        """An input that no longer matches its digest is never read: it is set aside (the next run
        recomputes it) and the stage stops naming it."""
        for role, v in inputs.items():
            for ref in _as_list(v):
                problem = store.check(ref)
                if problem:
                    store.set_aside(ref)
                    raise StageFailed(stage_label, DataError(
                        f"input {role} {ref.id} is {problem}; it was set aside, run again to recompute it"))

    def sharded(self, params: Params) -> bool:
        """Whether these params are computed in shards (``shard``, and ``shard_when`` says yes)."""
        return bool(self.shard) and (self.shard_when is None or bool(self.shard_when(params)))

    def _onnx_models(self, run: Run, params: Params, inputs: dict) -> dict[str, str]:
        """source model path -> exported ONNX model directory, for each model input this stage runs on
        ONNX Runtime: all of them with ``runtime.backend: onnx``, and those whose ``quantization`` is
        int8 (``onnx=``: params -> {input role: (task, quantization)}). Each export is the export_onnx
        stage, run here (in the driver: it records lineage in the catalog) and cached in the store under
        (source model id, opset, quantization), so a model is exported once for every later stage and run."""
        if self.onnx is None:
            return {}
        export, export_params = ONNX_EXPORT["stage"], ONNX_EXPORT["params"]
        out = {}
        for role, (task, quantization) in self.onnx(params).items():
            model = inputs.get(role)
            if model is None or (quantization == "none" and run.runtime.backend != "onnx"):
                continue
            ref, _ = export.execute(run, export_params(task=task, quantization=quantization),
                                    f"{task}-{quantization}", {"model": model}, needed=True)
            out[model.path] = ref.path
        return out

    def _compute(self, run: Run, store: Store, catalog: Catalog, key, params, inputs, stage_label, onnx_models=None):
        if self.sharded(params):
            return self._compute_shards(run, store, catalog, key, params, inputs, stage_label, onnx_models or {})
        workdir = store.staging_dir()
        resume_dir = None
        if self.resumable:
            # Survives a crash (unlike workdir): shards/checkpoints of an interrupted computation
            # with the same key are found here again. Removed once the outputs are published.
            resume_dir = store.root / "partial" / key
            resume_dir.mkdir(parents=True, exist_ok=True)
        rt = replace(stage_runtime(run.runtime, self.work, workdir, resume_dir,
                                   onnx_capable=self.onnx is not None), onnx_models=onnx_models or {})
        try:
            log.info("%s: computing (%s)", stage_label,
                     f"{rt.device}, {rt.precision}, {rt.threads} threads{_backend(rt)}" if self.work
                     else f"{rt.threads} threads")
            try:
                with torch_threads(rt.threads) if self.work else contextlib.nullcontext(), \
                        warnings_logged() as warned:
                    result = self.fn(params, rt, **inputs)
            except StageFailed:
                raise
            except Exception as e:
                # (a Ctrl-C that a library turned into this error is told apart in ``execute``)
                raise StageFailed(stage_label, e) from e
            check_interrupted()  # a Ctrl-C swallowed during the computation: publish nothing
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
            published = self._publish(store, staged)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        provenance = rt.provenance()
        self._record(run, catalog, stage_label, key, params, inputs, published, provenance, warned)
        if resume_dir is not None:
            remove_tree(resume_dir)
        return {name: p[0] for name, p in published.items()}, provenance

    def _publish(self, store: Store, staged: dict[str, tuple[Path, int | None]]
                 ) -> dict[str, tuple[DatasetRef, int | None, int]]:
        """Every staged output into the store, in declared order: output -> (ref, rows, bytes)."""
        published = {}
        for o in self.outputs:
            staging, rows = staged[o.name]
            size = tree_size(staging)
            published[o.name] = (store.publish(_ds_name(self, o), o.kind, o.contract, staging), rows, size)
        return published

    def _record(self, run: Run, catalog: Catalog, stage_label: str, key: str, params, inputs: dict,
                published: dict, provenance: dict, warned: list[str]) -> None:
        """The outputs' lineage in the catalog: this stage, its key, params, run and input ids, and what
        the computation warned about."""
        parents = {role: [r.id for r in _as_list(v)] for role, v in inputs.items()}
        catalog.record_outputs(stage=stage_label, cache_key=key, code_version=self.version,
                               params=params.key_dump(), run_id=run.run_id, outputs=published, parents=parents,
                               runtime=provenance, warnings=warned)

    def _compute_shards(self, run: Run, store: Store, catalog: Catalog, key, params, inputs, stage_label,
                        onnx_models: dict[str, str]):
        """A sharded stage (see irflow.shards): parts into partial/<key>, each output assembled from its
        parts, then published (every output assembled and checked before any is published)."""
        from irflow import shards
        from irflow.errors import UserError

        parts_dir = store.root / "partial" / key
        parts_dir.mkdir(parents=True, exist_ok=True)
        rt = replace(stage_runtime(run.runtime, self.work, onnx_capable=self.onnx is not None), onnx_models=onnx_models)
        log.info("%s: computing (%s)", stage_label,
                 f"{rt.device}, {rt.precision}{_backend(rt)}" if self.work else "cpu")
        try:
            with warnings_logged() as warned:  # the shards' own, also those relayed from Ray workers
                records = shards.compute(self, stage_label, params, inputs, run.runtime, parts_dir, onnx_models,
                                         executor=run.executor)
        except shards.ShardFailed as e:
            check_interrupted()
            # A user error (a model that cannot be loaded, data that cannot support the params) is the
            # stage's, as unsharded: the CLI says it in one line; the shard's rows are in the log.
            if isinstance(e.cause, UserError):
                log.error("%s: %s", stage_label, e)
                raise StageFailed(stage_label, e.cause) from e
            raise StageFailed(stage_label, e) from e
        check_interrupted()
        staged: dict[str, tuple[Path, int]] = {}
        try:
            for o in self.outputs:
                staging = store.staging_dir()
                staged[o.name] = (staging, 0)
                files = [parts_dir / shards.part_names(self, *r["rows"])[o.name] for r in records]
                staged[o.name] = (staging, write_parts(o.contract, files, staging / TABLE_FILE))
            published = self._publish(store, staged)
        except BaseException:
            for staging, _ in staged.values():
                shutil.rmtree(staging, ignore_errors=True)
            raise
        provenance = {**rt.provenance(), "executor": run.runtime.executor, "shard_rows": run.runtime.shard_rows,
                      "shards": len(records)}
        self._record(run, catalog, stage_label, key, params, inputs, published, provenance, warned)
        catalog.record_shards(run.run_id, stage_label, key, records)
        remove_tree(parts_dir)
        return {name: p[0] for name, p in published.items()}, provenance

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
            def run_stage(run: Run, params, tag: str | None, inputs: dict, name: str, branches: tuple | None = None):
                if branches is None:
                    result, status = stage.execute(run, params, tag, inputs)
                else:  # submitted by irflow.branches (Branches, submission number): a slot first, or a Cancelled state
                    out = branches[0].run_stage(stage, run, params, tag, inputs, name, branches[1])
                    if not isinstance(out, tuple):
                        return out
                    result, status = out
                if status == "cached":
                    # A task that returns a state ends in it: Prefect's UI then says "Cached", as for
                    # its own cache hits, instead of "Completed" (the caller gets the state back).
                    from prefect.states import Completed

                    return Completed(name="Cached", data=result, message="irflow: cached, not recomputed")
                return result

            self._task = run_stage
        return self._task

    def __call__(self, run: Run, params: Params | dict, /, *, tag: str | None = None, **inputs):
        if run.dry_run or run.skips(self.run_name(tag)):  # no Prefect task run for what is not run
            if run.branches is not None:  # a skipped call still names its inputs' ids: it waits for them
                from irflow.branches import resolve

                inputs = resolve(inputs)
            return self.run(run, params, tag=tag, **inputs)
        if run.branches is not None:  # stages at once (executor ray): a Deferred now, the refs later
            return run.branches.submit(self, run, params, tag, inputs)
        result = self.task(run, params, tag, inputs, name=self.run_name(tag))
        from prefect.states import State

        return result.result() if isinstance(result, State) else result


def _ids(inputs: dict) -> dict[str, list[str]]:
    return {role: [r.id for r in _as_list(v)] for role, v in sorted(inputs.items())}


def _describe(inputs: dict, outputs: dict[str, DatasetRef]) -> dict[str, dict]:
    """id -> {name, kind, contract} of a stage's input and output refs."""
    refs = [r for v in inputs.values() for r in _as_list(v)] + list(outputs.values())
    return {r.id: {"name": r.name, "kind": r.kind, "contract": r.contract} for r in refs}


def _params_members(ann) -> tuple[type, ...]:
    if isinstance(ann, type):
        return (ann,) if issubclass(ann, Params) else ()
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Annotated:
        return _params_members(args[0])
    members = tuple(m for a in args for m in _params_members(a))
    return members if args and len(members) == len(args) else ()


def _backend(rt) -> str:
    """How a stage's models run, for its log line: '' (torch), or the backend and how many of its
    models run on ONNX Runtime (backend onnx, or int8 models under backend torch)."""
    return "" if rt.backend == "torch" and not rt.onnx_models else f", {rt.backend} backend" + \
        (f", {len(rt.onnx_models)} model(s) on ONNX Runtime" if rt.onnx_models else "")


def _ds_name(stage: Stage, o: Output) -> str:
    return o.name if len(stage.outputs) > 1 or o.name != "out" else stage.name


def stage(name: str, version: str, outputs: list[Output] | Output, *, work: str | None = None,
          resumable: bool = False, shard: str | None = None, shard_when: Callable[[Params], bool] | None = None,
          shard_align: Callable[[Params], int] | None = None,
          onnx: Callable[[Params], dict[str, tuple[str, str]]] | None = None) -> Callable[[Callable], Stage]:
    """Declare a stage: ``@stage("bm25_search", version="1", outputs=Output("run", "run"))``.

    ``work`` is the kind of work it does on a device (encode, score, generate, train; None for
    CPU-only stages): it picks the runtime's device and precision. ``resumable`` gives it a
    ``rt.resume_dir`` that survives a crash. Bump ``version`` whenever a change to the code changes
    what the stage outputs. ``shard`` names the input it maps over, row range by row range
    (``irflow.shards``): each output's rows for input rows [a, b) must depend on no other row of that
    input and come in its order (a shard's slice still says where it starts and how many rows the whole
    input has: ``DatasetRef.row_offset``, ``DatasetRef.total_rows``). Every output of a sharded stage is
    a table; each shard writes one part per output. ``shard_when(params)``: whether these params are
    sharded (False: the stage is computed whole, e.g. a source that does not read that input);
    ``shard_align(params)``: shards start at multiples of that many rows (``runtime.shard_rows`` is
    rounded up to one), e.g. the stage's batch size when a batch's result depends on the batch.
    ``onnx(params)``: the model inputs the stage runs inference with, ``{role: (task, quantization)}``
    (task embed: a bi-encoder, score: a cross-encoder; quantization: the params' none | int8): the runner
    exports those it runs on ONNX Runtime (``runtime.backend: onnx``, or int8) before computing, and the
    stage finds them with ``rt.onnx_model(model)`` (``irflow.onnx_inference``).
    """
    outs = [outputs] if isinstance(outputs, Output) else list(outputs)

    def wrap(fn: Callable) -> Stage:
        return Stage(fn, name, version, outs, work, resumable, shard, shard_when, shard_align, onnx)

    return wrap
