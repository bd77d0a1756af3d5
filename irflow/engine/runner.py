"""The runner: a stage call's cache protocol, and the run it belongs to.

For a stage call (``irflow.engine.stage``'s declarations) in a run: its key (params, input ids, code version),
a lookup in the catalog, a lock per key (threads of this process and other processes), the computation
(here, or in shards on the run's executor: ``irflow.engine.executors``), its outputs validated against their
contracts and published atomically, and its record (lineage, warnings, runtime). A dry run plans
instead (cached or stale, and why); ``--to`` skips what its targets do not need.

    cache key = sha256(stage name, declared code version, params.key_dump(), ids of the input datasets by role)

Input ids are content fingerprints (a model named in a config enters as an input too, by the
fingerprint of its weights), so the key changes exactly when something the stage reads changes --
unlike Prefect's default cache policy (which includes the run id and pickles inputs) or GPL's
"skip if the output file exists". Runtime settings (device, precision, threads) are not keyed; they
are recorded per stage run. A hit is reused only if its files are still in the store; a hit whose
files no longer match their digest is set aside and recomputed (see irflow.engine.store), and so is never
used; one computation of a key at a time (a file lock per key between processes, a lock per key
between the threads of one), so identical runs started together compute each stage once.

A stage called in a recipe runs as a Prefect task (``call``); with an executor that runs stages at once
(``concurrent_stages`` above 1: ray's ``runtime.ray.concurrent_stages``) it is submitted and a ``Deferred``
stands for its refs, so that stages that do not read each other's outputs run at the same time
(``irflow.engine.branches``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

import pyarrow as pa

from irflow.engine import pace
from irflow.engine.cache import hash_payload, why_stale
from irflow.engine.catalog import Catalog, now
from irflow.engine.errors import DataError, StageFailed
from irflow.engine.executors import executor_for
from irflow.engine.params import Params
from irflow.engine.processes import check_interrupted, file_lock, release_memory
from irflow.engine.runtime import RuntimeConfig, load_average, resolve_device
from irflow.engine.stage import ONNX_EXPORT, PENDING, Output, Stage, _as_list
from irflow.engine.store import TABLE_FILE, DatasetRef, Store, remove_tree, tree_size, write_parts
from irflow.engine.worker import warnings_logged

log = logging.getLogger("irflow")


class Run:
    """One execution of a recipe: where (store), which (run id), how (runtime), what to force.

    ``force`` holds stage names (``mine_negatives``, or one call of it: ``mine_negatives[bm25]``) to
    recompute even if cached (``irflow run --from STAGE``); everything downstream of a forced stage is
    forced too (tracked through its output ids in the catalog). ``dry_run`` (``irflow status``) reports cached/stale per stage and computes nothing.
    ``only`` (``--to STAGE``: the stage labels it needs, see ``irflow.recipes.base.upstream``) skips every other
    stage: a skipped call returns placeholder refs, records nothing and is listed in ``skipped``.
    ``branches`` (set by ``irflow.engine.branches`` while an executor runs stages at once) makes stage calls
    run at once; ``error`` and ``failed`` are then the first failure, whichever thread saw it.
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
        self.error: BaseException | None = None  # the first failure (stages may run at once: irflow.engine.branches)
        self.branches = None  # irflow.engine.branches.Branches while stage calls run at once
        self.executor = executor_for(self.runtime)  # where shards (and, for some, stages at once) run
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
        from irflow.engine.models import model_ref

        ref = model_ref(name, self.store_root, where)
        if not self.dry_run:
            self.catalog.record_external(ref, self.run_id, {"name": name, "config_key": where})
        return ref

    def external(self, ref: DatasetRef, params: dict) -> DatasetRef:
        """Record a ref that no stage made (a dataset source) so that lineage can end at it."""
        if not self.dry_run:
            self.catalog.record_external(ref, self.run_id, params)
        return ref

    # the stage calls of this run (irflow.engine.stage's Stage delegates here: a declaration does not run)
    def execute_stage(self, stage: Stage, params, tag: str | None, inputs: dict, *, needed: bool = False):
        return execute(stage, self, params, tag, inputs, needed=needed)

    def call_stage(self, stage: Stage, params, tag: str | None, inputs: dict):
        return call(stage, self, params, tag=tag, **inputs)

    def stage_task(self, stage: Stage):
        return stage_task(stage)


# Stages that compute with torch in this process (``work`` set, not sharded) take turns, also when
# stages run at once (irflow.engine.branches): torch.set_num_threads and a GPU's memory are the process's.
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



def _placeholders(stage: Stage, stage_label: str) -> dict[str, DatasetRef]:
    """Refs standing for outputs that are not computed here (stale in a dry run, or skipped)."""
    return {o.name: DatasetRef(f"<{stage_label}:{o.name}>", o.name, PENDING, o.contract, "")
            for o in stage.outputs}

def execute(stage: Stage, run: Run, params: Params | dict, tag: str | None, inputs: dict, *,
            needed: bool = False) -> tuple[Any, str]:
    """(the output ref, or a dict of them; status: computed | cached | stale | skipped). ``needed``:
    run even if ``--to`` leaves it out (a stage another stage's computation asks for: export_onnx)."""
    check_interrupted()
    params, inputs = stage._check(params, inputs)
    store, catalog = run.store, run.catalog
    stage_label = stage.run_name(tag)
    if run.skips(stage_label) and not needed:
        refs = _placeholders(stage, stage_label)
        entry = {"name": stage_label, "inputs": _ids(inputs), "outputs": {k: r.id for k, r in refs.items()}}
        if run.dry_run:
            run.plan.append({**entry, "status": "skipped", "why": ["not needed for --to"],
                             "datasets": _describe(inputs, refs), "params": params.model_dump(mode="json")})
        else:
            run.skipped.append(entry)
        return _result(stage, refs), "skipped"
    input_ids = [r.id for v in inputs.values() for r in _as_list(v)]
    detail = stage.key_payload(params, inputs)
    key = hash_payload(detail)  # = stage.key(params, inputs), the payload kept for the catalog
    clock = _Clock()

    # taints are recorded only below a forced stage: without --from there are none to look up
    forced = bool({stage.name, stage_label} & run.force) or (bool(run.force)
                                                            and catalog.tainted(run.run_id, input_ids))
    pending_inputs = any(r.kind == PENDING for v in inputs.values() for r in _as_list(v))
    provenance = None
    if run.dry_run:
        hit = {} if forced or pending_inputs else catalog.lookup(key)
        damage = _damage(stage, store, hit)
        if hit and not damage:
            refs, status = {o.name: hit[o.name] for o in stage.outputs}, "cached"
        else:
            refs = _placeholders(stage, stage_label)
            status = "stale"
            detail["why"] = why_stale(catalog, stage_label, detail, hit, forced, pending_inputs, damage)
        # inputs and outputs by id, and what each id is: enough to draw the plan (irflow.tools.dag)
        run.plan.append({"name": stage_label, "status": status, "why": detail.get("why", []),
                         "inputs": _ids(inputs), "outputs": {k: r.id for k, r in refs.items()},
                         "datasets": _describe(inputs, refs), "params": params.model_dump(mode="json")})
        return _result(stage, refs), status

    # One computation per key at a time: a second call of the same key in this process (stages
    # run at once: irflow.engine.branches), or a second run started alongside, waits here for the first
    # one's result and reuses it, instead of computing the same thing again (the kernel drops the
    # file lock of a process that dies, so a killed run never blocks the next one).
    with _key_lock(key) as lock, \
            _turn(lock, f"{stage_label}: waiting for another stage of this run computing the same key") as waited, \
            file_lock(store.root / "locks" / f"{key[:32]}.lock",
                      waiting=f"{stage_label}: waiting for another process computing the same stage"):
        clock.skip(waited)
        hit = {} if forced else catalog.lookup(key)
        damage = _damage(stage, store, hit)
        for ref, problem in damage:
            log.warning("%s: stored %s is %s; it is set aside and recomputed", stage_label, ref.id, problem)
            store.set_aside(ref)
        if damage:
            detail["recomputed"] = [f"{ref.id}: {problem}" for ref, problem in damage]
        if hit and not damage:
            refs = {o.name: hit[o.name] for o in stage.outputs}
            status = "cached"
            log.info("%s: cached (%s)", stage_label, ", ".join(r.id for r in refs.values()))
            # What its computation warned about still holds for these datasets: said again, so that
            # a run that reuses them warns as the run that made them did.
            for message, made_by in catalog.warnings_of([r.id for r in refs.values()]):
                log.warning("%s (%s: cached, as computed by run %s)", message, stage_label, made_by)
        else:
            try:
                _check_inputs(store, stage_label, inputs)
                with (_turn(_DRIVER_TORCH, f"{stage_label}: waiting for another stage computing with "
                                           f"torch in this process") if stage.work and not stage.shard
                      else contextlib.nullcontext(0.0)) as waited:
                    clock.skip(waited)
                    check_interrupted()
                    pace.stage_started(run.run_id, stage_label)
                    onnx_models = _onnx_models(stage, run, params, inputs)
                    with pace.computing(run.run_id, stage_label):
                        refs, provenance = _compute(stage, run, store, catalog, key, params, inputs, stage_label,
                                                    onnx_models, detail, reuse_rows=not forced)
            except Exception as e:
                # A Ctrl-C that a library turned into its own error anywhere in the computation (the
                # stage's function, but also staging its outputs: a DuckDB contract query raises
                # InvalidInputException) is still a Ctrl-C: the run is interrupted, no stage failed.
                check_interrupted()
                # kept for the run's row (not stage_runs: only results go there), so that its graph
                # shows where it failed (irflow.tools.dag)
                run.fail(e, {"name": stage_label, "inputs": _ids(inputs), "seconds": clock.seconds()})
                raise
            release_memory()
            status = "computed"
            if forced:
                catalog.taint(run.run_id, [r.id for r in refs.values()])
    catalog.record_stage_run(run.run_id, stage_label, key, status, {k: r.id for k, r in refs.items()},
                             clock.seconds(), clock.started, detail, provenance)
    if status == "computed":
        pace.stage_done(run.run_id, stage_label, clock.seconds())
    return _result(stage, refs), status

def _result(stage: Stage, refs: dict[str, DatasetRef]):
    return refs[stage.outputs[0].name] if len(stage.outputs) == 1 else refs

def _damage(stage: Stage, store: Store, hit: dict) -> list[tuple[DatasetRef, str]]:
    """(ref, what is wrong) for each cached output that is missing or no longer matches its digest."""
    if not hit:
        return []
    out = []
    for o in stage.outputs:
        ref = hit.get(o.name)
        if ref is None:
            continue
        problem = "missing" if not Path(ref.path).exists() else store.check(ref)
        if problem:
            out.append((ref, problem))
    return out

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

def _onnx_models(stage: Stage, run: Run, params: Params, inputs: dict) -> dict[str, str]:
    """source model path -> exported ONNX model directory, for each model input this stage runs on
    ONNX Runtime: all of them with ``runtime.backend: onnx``, and those whose ``quantization`` is
    int8 (``onnx=``: params -> {input role: (task, quantization)}). Each export is the export_onnx
    stage, run here (in the driver: it records lineage in the catalog) and cached in the store under
    (source model id, opset, quantization), so a model is exported once for every later stage and run."""
    if stage.onnx is None:
        return {}
    export, export_params = ONNX_EXPORT["stage"], ONNX_EXPORT["params"]
    backend = run.runtime.backend
    if backend == "auto" and resolve_device(run.runtime.device.for_work(stage.work)) != "cpu":
        backend = "torch"  # ONNX Runtime runs on the CPU here: a GPU encodes with torch
    out = {}
    for role, (task, quantization) in stage.onnx(params).items():
        model = inputs.get(role)
        if model is None or (quantization == "none" and backend == "torch"):
            continue
        ref, _ = execute(export, run, export_params(task=task, quantization=quantization),
                                f"{task}-{quantization}", {"model": model}, needed=True)
        if quantization == "none" and backend == "auto" and not _onnx_wins(run, task, model, ref, params):
            continue
        out[model.path] = ref.path
    return out

def _onnx_wins(run: Run, task: str, model: DatasetRef, exported: DatasetRef, params: Params) -> bool:
    """runtime.backend auto: whether ONNX Runtime runs this model faster than torch here (irflow.learn.backend_probe;
    probed once per store, hardware, model, task and thread count)."""
    from irflow.engine import backends
    from irflow.engine.runtime import cpu_model

    threads = run.runtime.cpu_threads()
    length = getattr(params, "max_seq_length", None) or getattr(params, "max_length", None)
    key = f"{cpu_model()} / {threads} threads | {model.id} | {task} | {length} tokens"
    decision = backends.choose(run.store_root, key, lambda: ONNX_EXPORT["probe"](
        model.path, exported.path, task, threads, length))
    return decision["backend"] == "onnx"

def _compute(stage: Stage, run: Run, store: Store, catalog: Catalog, key, params, inputs, stage_label, onnx_models=None,
             detail: dict | None = None, reuse_rows: bool = True):
    load = load_average()  # the machine's load when the stage started: recorded beside its seconds
    if stage.sharded(params):
        return _compute_shards(stage, run, store, catalog, key, params, inputs, stage_label, onnx_models or {},
                               {} if detail is None else detail, reuse_rows, load)
    workdir = store.staging_dir()
    resume_dir = None
    if stage.resumable:
        # Survives a crash (unlike workdir): shards/checkpoints of an interrupted computation
        # with the same key are found here again. Removed once the outputs are published.
        resume_dir = store.root / "partial" / key
        resume_dir.mkdir(parents=True, exist_ok=True)
    rt = stage.runtime(run.runtime, workdir, resume_dir, onnx_models=onnx_models)
    try:
        log.info("%s: computing (%s)", stage_label,
                 f"{rt.device}, {rt.precision}, {rt.threads} threads{_backend(rt)}" if stage.work
                 else f"{rt.threads} threads")
        try:
            result, warned = stage.compute(params, rt, inputs)
        except StageFailed:
            raise
        except Exception as e:
            # (a Ctrl-C that a library turned into this error is told apart in ``execute``)
            raise StageFailed(stage_label, e) from e
        # Validate and stage every output before publishing any: a stage whose second output
        # breaks its contract must leave nothing of its first one in the store.
        staged: dict[str, tuple[Path, int | None]] = {}
        try:
            for o in stage.outputs:
                value = result[o.name]
                if o.kind == "table":
                    if not isinstance(value, (pa.Table, Path, str)):
                        raise TypeError(f"stage {stage.name} output {o.name}: expected a table, got {type(value)}")
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
        published = _publish(stage, store, staged)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    provenance = {**rt.provenance(), "load": [load, load_average()]}
    _record(stage, run, catalog, stage_label, key, params, inputs, published, provenance, warned)
    if resume_dir is not None:
        remove_tree(resume_dir)
    return {name: p[0] for name, p in published.items()}, provenance

def _publish(stage: Stage, store: Store, staged: dict[str, tuple[Path, int | None]]
             ) -> dict[str, tuple[DatasetRef, int | None, int]]:
    """Every staged output into the store, in declared order: output -> (ref, rows, bytes)."""
    published = {}
    for o in stage.outputs:
        staging, rows = staged[o.name]
        size = tree_size(staging)
        published[o.name] = (store.publish(_ds_name(stage, o), o.kind, o.contract, staging), rows, size)
    return published

def _record(stage: Stage, run: Run, catalog: Catalog, stage_label: str, key: str, params, inputs: dict,
            published: dict, provenance: dict, warned: list[str]) -> None:
    """The outputs' lineage in the catalog: this stage, its key, params, run and input ids, and what
    the computation warned about."""
    parents = {role: [r.id for r in _as_list(v)] for role, v in inputs.items()}
    catalog.record_outputs(stage=stage_label, cache_key=key, code_version=stage.version,
                           params=params.key_dump(), run_id=run.run_id, outputs=published, parents=parents,
                           runtime=provenance, warnings=warned)

def _compute_shards(stage: Stage, run: Run, store: Store, catalog: Catalog, key, params, inputs, stage_label,
                    onnx_models: dict[str, str], detail: dict, reuse_rows: bool = True, load: float | None = None):
    """A sharded stage (see irflow.engine.shards): parts into partial/<key>, each output assembled from its
    parts, then published (every output assembled and checked before any is published). A stage with a
    row map (``irflow.engine.row_reuse``) computes only the input rows an earlier computation of its family did
    not, and ``detail["rows"]`` says how many of each."""
    from irflow.engine import row_reuse, shards
    from irflow.engine.errors import UserError

    parts_dir = store.root / "partial" / key
    parts_dir.mkdir(parents=True, exist_ok=True)
    rt = stage.runtime(run.runtime, onnx_models=onnx_models)
    role = stage.shard
    total = inputs[role].num_rows()
    reuse, shard_dir, shard_inputs = None, parts_dir, inputs
    if stage.rows is not None and stage.rows.applies(params):
        detail["row_family"] = family = row_reuse.family(stage, params, inputs, role, total)
        earlier = _row_sources(store, catalog, stage, family, role, inputs[role]) \
            if reuse_rows and run.runtime.reuse_rows else []
        reuse = row_reuse.find_reuse(stage, role, inputs, earlier, parts_dir)
        shard_dir = reuse.work
        shard_inputs = {**inputs, role: reuse.todo} if reuse.todo is not None else None
        if reuse.reused:
            log.info("%s: %d of %d %s rows new or changed, %d reused (from run %s)", stage_label, reuse.computed,
                     total, role, reuse.reused, ", ".join(e["run_id"] for e in reuse.earlier))
    log.info("%s: computing (%s)", stage_label,
             f"{rt.device}, {rt.precision}{_backend(rt)}" if stage.work else "cpu")
    try:
        with warnings_logged() as warned:  # the shards' own, also those relayed from Ray workers
            records = [] if shard_inputs is None else shards.compute(
                stage, stage_label, params, shard_inputs, run.runtime, shard_dir, onnx_models, executor=run.executor)
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
        for o in stage.outputs:
            staging = store.staging_dir()
            staged[o.name] = (staging, 0)
            files = [shard_dir / shards.part_names(stage, *r["rows"])[o.name] for r in records]
            rows = files if reuse is None else row_reuse.merged(stage, o.name, reuse, files)
            staged[o.name] = (staging, write_parts(o.contract, rows, staging / TABLE_FILE))
        published = _publish(stage, store, staged)
    except BaseException:
        for staging, _ in staged.values():
            shutil.rmtree(staging, ignore_errors=True)
        raise
    provenance = {**rt.provenance(), "executor": run.runtime.executor, "shard_rows": run.runtime.shard_rows,
                  "shards": len(records), "load": [load, load_average()]}
    detail["rows"] = reuse.record() if reuse is not None else {"input": total, "computed": total, "reused": 0}
    _record(stage, run, catalog, stage_label, key, params, inputs, published, provenance, warned)
    catalog.record_shards(run.run_id, stage_label, key, records)
    remove_tree(parts_dir)
    return {name: p[0] for name, p in published.items()}, provenance

def _row_sources(store: Store, catalog: Catalog, stage: Stage, family: str, role: str, like: DatasetRef) -> list[dict]:
    """The latest earlier computations of a row family whose mapped input and outputs are all still stored
    (``irflow.engine.row_reuse.find_reuse`` reads their rows), newest first: [{input: ref, outputs: {name: ref}, run_id}]."""
    contracts = {o.name: o.contract for o in stage.outputs}
    out = []
    for found in catalog.row_family_sources(family, role):
        refs = {"input": DatasetRef(found["input"], like.name, "table", like.contract,
                                    str(store.object_dir(found["input"])))}
        refs.update({name: DatasetRef(i, name, "table", contracts.get(name), str(store.object_dir(i)))
                     for name, i in found["outputs"].items()})
        if all(Path(r.parquet).exists() for r in refs.values()):
            out.append({"input": refs.pop("input"), "outputs": refs, "run_id": found["run_id"]})
    return out


def stage_task(stage):
    if stage._task is None:
        from prefect import task
        from prefect.cache_policies import NO_CACHE


        # Prefect's own result caching is off: irflow's key is the cache (see module doc).
        @task(name=stage.name, cache_policy=NO_CACHE, persist_result=False,
              task_run_name="{name}", retries=0)
        def run_stage(run: Run, params, tag: str | None, inputs: dict, name: str, branches: tuple | None = None):
            if branches is None:
                result, status = execute(stage, run, params, tag, inputs)
            else:  # submitted by irflow.engine.branches (Branches, submission number): a slot first, or a Cancelled state
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

        stage._task = run_stage
    return stage._task

def call(stage: Stage, run: Run, params: Params | dict, /, *, tag: str | None = None, **inputs):
    if run.dry_run or run.skips(stage.run_name(tag)):  # no Prefect task run for what is not run
        if run.branches is not None:  # a skipped call still names its inputs' ids: it waits for them
            from irflow.engine.branches import resolve

            inputs = resolve(inputs)
        return execute(stage, run, params, tag, inputs)[0]
    if run.branches is not None:  # stages at once (executor ray): a Deferred now, the refs later
        return run.branches.submit(stage, run, params, tag, inputs)
    result = stage_task(stage)(run, params, tag, inputs, name=stage.run_name(tag))
    from prefect.states import State

    return result.result() if isinstance(result, State) else result


def _ids(inputs: dict) -> dict[str, list[str]]:
    return {role: [r.id for r in _as_list(v)] for role, v in sorted(inputs.items())}


def _describe(inputs: dict, outputs: dict[str, DatasetRef]) -> dict[str, dict]:
    """id -> {name, kind, contract} of a stage's input and output refs."""
    refs = [r for v in inputs.values() for r in _as_list(v)] + list(outputs.values())
    return {r.id: {"name": r.name, "kind": r.kind, "contract": r.contract} for r in refs}


def _backend(rt) -> str:
    """How a stage's models run, for its log line: '' (torch), or the backend and how many of its
    models run on ONNX Runtime (backend onnx, or int8 models under backend torch)."""
    return "" if rt.backend == "torch" and not rt.onnx_models else f", {rt.backend} backend" + \
        (f", {len(rt.onnx_models)} model(s) on ONNX Runtime" if rt.onnx_models else "")


def _ds_name(stage: Stage, o: Output) -> str:
    return o.name if len(stage.outputs) > 1 or o.name != "out" else stage.name
