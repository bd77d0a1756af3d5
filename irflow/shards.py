"""Sharded stages: one stage computed as row-range shards of one input, then assembled.

A stage declared with ``shard="corpus"`` (encode_corpus) or ``shard="queries"`` (the searches and
the cross-encoder scorers) is a map over that input's rows: rows [a, b) of the input give rows of the
output that depend on nothing else in the input, in the input's order. The runner then computes it as
shards of ``runtime.shard_rows`` input rows:

- each shard reads only its row range (``DatasetRef.slice``: the Parquet row groups that hold it) and
  writes its part, validated against the output's contract, into ``<store>/partial/<stage key>/``
  (written to a temporary name, then renamed: a part is whole or absent);
- a part already there is reused, so a run killed mid-stage resumes with the missing shards only;
- with ``runtime.executor: ray`` the shards are Prefect tasks on the flow's ``RayTaskRunner`` (they
  return a small record, never a table: Ray keeps returned objects in the driver, prefect-ray#93);
  with ``local`` they run here, one after another;
- the parts are assembled, in order and streaming, into one table with fixed row groups
  (``irflow.store.write_parts``): the same rows give the same bytes and the same content id whether
  they came in 1 shard or 100, so everything downstream stays cached.

A shard that raises is retried once (Prefect's retry, on Ray); if it fails again, or its worker is
lost, the stage fails naming the shard's row range and nothing is published: the finished parts stay,
and the next run computes only the missing ones.
The key of a sharded stage is the key of the whole stage: shard_rows, the executor and the workers
are runtime, never keyed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from irflow.params import Params
from irflow.runtime import RuntimeConfig
from irflow.store import DatasetRef

log = logging.getLogger("irflow.shards")

WORKER_ENV = "IRFLOW_SHARD_WORKER"  # set in Ray workers: objects cached per process (models, indexes)


@dataclass(frozen=True)
class ShardJob:
    """Everything one shard needs, small and picklable (it travels to a Ray worker)."""

    module: str  # where the stage is declared, to find it again in a worker process
    attr: str
    label: str  # the stage call's name in the run, e.g. encode_corpus[zero-shot]
    index: int
    start: int
    stop: int
    role: str  # the sharded input
    params: Params
    inputs: dict
    part: str  # where the part goes
    runtime: RuntimeConfig
    threads: int


def plan(num_rows: int, shard_rows: int) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of ``shard_rows`` rows (the last one shorter); one empty range for an
    empty input, so that the stage still runs once and says what it thinks of empty input."""
    if num_rows == 0:
        return [(0, 0)]
    return [(a, min(a + shard_rows, num_rows)) for a in range(0, num_rows, shard_rows)]


def part_name(start: int, stop: int) -> str:
    return f"part-{start:012d}-{stop:012d}.parquet"


def run_shard(job: ShardJob) -> dict:
    """Compute one shard in this process and write its part. Returns the shard's record."""
    from irflow.processes import check_interrupted
    from irflow.runtime import stage_runtime
    from irflow.stage import torch_threads
    from irflow.store import write_parts

    stage = getattr(importlib.import_module(job.module), job.attr)
    t0 = time.perf_counter()
    part = Path(job.part)
    workdir = part.parent / f".work-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    try:
        rt = replace(stage_runtime(job.runtime, stage.work, workdir), threads=job.threads)
        inputs = {**job.inputs, job.role: job.inputs[job.role].slice(job.start, job.stop)}
        with torch_threads(rt.threads) if stage.work else contextlib.nullcontext():
            result = stage.fn(job.params, rt, **inputs)
        check_interrupted()
        if isinstance(result, dict):
            result = result[stage.outputs[0].name]
        tmp = part.with_name(f".{part.name}.{os.getpid()}.tmp")
        # Conformed and checked as the whole output will be -- except that a shard may be empty (a
        # query shard none of whose queries is judged); the assembled output is checked whole.
        empty = isinstance(result, pa.Table) and result.num_rows == 0
        rows = write_parts(stage.outputs[0].contract, [result], tmp, check=not empty)
        os.replace(tmp, part)  # whole or absent: a killed shard leaves no part
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"index": job.index, "rows": [job.start, job.stop], "output_rows": rows, "host": socket.gethostname(),
            "pid": os.getpid(), "device": rt.device, "seconds": round(time.perf_counter() - t0, 3),
            "status": "computed"}


# ---- objects kept per worker process -------------------------------------------------------------
_PER_WORKER: dict[Any, Any] = {}
_PER_WORKER_MAX = 2  # a dense search holds its model and its index


_KEEPING = 0  # > 0 while this process runs the shards of one stage itself (executor local)


def per_worker(key: Any, make: Callable[[], Any]) -> Any:
    """``make()``, kept for the next shard when this process is a shard worker (a model is loaded once
    per worker, not once per shard), or while it runs a stage's shards itself. Otherwise nothing is
    kept: in the flow's own process a stage's model must not outlive the stage (memory)."""
    if os.environ.get(WORKER_ENV) != "1" and not _KEEPING:
        return make()
    if key not in _PER_WORKER:
        while len(_PER_WORKER) >= _PER_WORKER_MAX:
            _PER_WORKER.pop(next(iter(_PER_WORKER)))
        _PER_WORKER[key] = make()
    return _PER_WORKER[key]


# ---- running every shard of a stage ---------------------------------------------------------------
class ShardFailed(RuntimeError):
    pass


def compute(stage, label: str, params: Params, inputs: dict, runtime: RuntimeConfig, resume_dir: Path,
            ) -> list[dict]:
    """Every shard's part in ``resume_dir`` (computing the missing ones); their records, in order."""
    role = stage.shard
    ranges = plan(inputs[role].num_rows(), runtime.shard_rows)
    records: list[dict | None] = [None] * len(ranges)
    jobs = []
    for i, (a, b) in enumerate(ranges):
        part = resume_dir / part_name(a, b)
        if part.exists():
            records[i] = {"index": i, "rows": [a, b], "host": None, "pid": None, "device": None, "seconds": 0.0,
                          "status": "resumed"}
            continue
        jobs.append(ShardJob(stage.fn.__module__, stage.fn.__name__, label, i, a, b, role, params, inputs, str(part),
                             runtime, worker_threads(runtime)))
    if len(ranges) > 1 or runtime.executor == "ray":
        log.info("%s: %d shard(s) of %d %s rows (%d to compute, %d resumed), executor %s", label, len(ranges),
                 runtime.shard_rows, role, len(jobs), len(ranges) - len(jobs), runtime.executor)
    if runtime.executor == "ray" and jobs:
        done = _on_ray(stage, jobs, runtime)
    else:
        done = _here(jobs)
    for r in done:
        records[r["index"]] = r
    return records  # type: ignore[return-value]


def _here(jobs: list[ShardJob]) -> list[dict]:
    """The shards in this process, one after another, the stage's model and index kept between them."""
    global _KEEPING
    _KEEPING += 1
    try:
        done = []
        for job in jobs:
            try:
                done.append(run_shard(job))
            except Exception as e:
                raise ShardFailed(f"shard {job.index} (rows {job.start}-{job.stop} of {job.role}) failed: "
                                  f"{type(e).__name__}: {e}") from e
        return done
    finally:
        _KEEPING -= 1
        if not _KEEPING:
            _PER_WORKER.clear()


def worker_threads(runtime: RuntimeConfig) -> int:
    from irflow.runtime import available_cpus

    if runtime.executor != "ray":
        return runtime.cpu_threads()
    if runtime.ray.threads_per_worker:
        return runtime.ray.threads_per_worker
    workers = runtime.ray.workers or available_cpus()
    return max(1, (runtime.threads or available_cpus()) // workers)


_SHARD_TASK = None


def shard_task():
    """The Prefect task one shard runs as (on a Ray worker). Prefect retries it once: a shard lost with
    its worker is computed again; irflow's own parts, not Prefect's results, are what a re-run reuses."""
    global _SHARD_TASK
    if _SHARD_TASK is None:
        from prefect import task
        from prefect.cache_policies import NO_CACHE

        @task(name="shard", cache_policy=NO_CACHE, persist_result=False, retries=1,
              task_run_name="{job.label} rows {job.start}-{job.stop}")
        def shard(job: ShardJob) -> dict:
            return run_shard(job)

        _SHARD_TASK = shard
    return _SHARD_TASK


def _on_ray(stage, jobs: list[ShardJob], runtime: RuntimeConfig) -> list[dict]:
    import ray
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    if not ray.is_initialized():
        raise RuntimeError("runtime.executor ray: Ray is not joined (shards run inside `irflow run` / api.run, "
                           "which join the run's cluster)")
    gpus = runtime.ray.gpus_per_shard if stage.work else 0.0
    task = shard_task()
    # Ray does not retry a shard itself (max_retries 0): Prefect retries it once, and a Ray retry of a
    # task Prefect saw finish is an illegal state change for Prefect (prefect-ray#82).
    options = {"num_cpus": 1, "max_retries": 0, **({"num_gpus": gpus} if gpus else {})}
    with RayTaskRunner() as runner, remote_options(**options):  # the run's Ray, already joined
        futures = [(job, runner.submit(task, parameters={"job": job})) for job in jobs]
    done, failed = [], []
    for job, f in futures:
        try:
            done.append(f.result())
        except Exception as e:  # noqa: BLE001 -- every shard is waited for, then the first failure is raised
            failed.append((job, e))
    if failed:
        job, e = failed[0]
        raise ShardFailed(f"shard {job.index} (rows {job.start}-{job.stop} of {job.role}) failed: "
                          f"{type(e).__name__}: {e}" + (f" ({len(failed) - 1} more shard(s) failed)"
                                                        if len(failed) > 1 else "")) from e
    return done
