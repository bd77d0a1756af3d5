"""Executors: where a run's work happens, behind one protocol. ``runtime.executor`` names one; the run holds
it (``Run.executor``), chosen once; nothing else compares executor names.

An executor says, for a run:

- ``preflight(rt)``: what must be true before any stage runs (a Ray address that answers); raises
  ``ConfigError`` naming the key;
- ``session(rt)``: a context held around the recipe's body (joining a cluster, starting a pool);
- ``map_shards(stage, label, jobs, rt)``: every shard job of one sharded stage computed, their records
  (``irflow.engine.shards.run_shard`` computes one; a record's ``status`` is computed, resumed or retried);
- ``worker_threads(rt)``: the threads each shard may use;
- ``concurrent_stages(rt)``: how many stage calls may run at once (1: one after another).

A new executor is one class registered with ``@register``::

    @register
    class ThreadsExecutor(LocalExecutor):
        name = "threads"

        def map_shards(self, stage, label, jobs, rt):
            with ThreadPoolExecutor(2) as pool:
                return list(pool.map(run_shard, jobs))
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

EXECUTORS: dict[str, type["Executor"]] = {}


def register(cls: type["Executor"]) -> type["Executor"]:
    EXECUTORS[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(EXECUTORS)


def executor_for(rt) -> "Executor":
    """The executor ``rt.executor`` names."""
    if rt.executor not in EXECUTORS:
        from irflow.engine.errors import ConfigError

        raise ConfigError(f"runtime.executor: '{rt.executor}' is not an executor ({', '.join(names())})")
    return EXECUTORS[rt.executor]()


class Executor:
    name: ClassVar[str]
    remote: ClassVar[bool] = False  # shards run in other processes (the log says how they were spread)

    def preflight(self, rt) -> None:
        return None

    def session(self, rt) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def map_shards(self, stage, label: str, jobs: list, rt) -> list[dict]:
        raise NotImplementedError

    def worker_threads(self, rt) -> int:
        return rt.cpu_threads()

    def concurrent_stages(self, rt) -> int:
        return 1


@register
class LocalExecutor(Executor):
    """Stages and their shards in this process, one after another (the default)."""

    name = "local"

    def map_shards(self, stage, label: str, jobs: list, rt) -> list[dict]:
        from irflow.engine.shards import run_here

        return run_here(jobs)


@register
class RayExecutor(Executor):
    """Shards as Prefect tasks on Ray workers (Prefect's ``RayTaskRunner``), independent stages at once
    (``runtime.ray``)."""

    name = "ray"
    remote = True

    def preflight(self, rt) -> None:
        from irflow.engine import ray_cluster

        if rt.ray.address is not None:
            ray_cluster.check_address(rt.ray.address)
        else:
            ray_cluster.check_local_gpus(rt.ray.gpus_per_shard)

    def session(self, rt) -> Any:
        from irflow.engine.orchestration import api_url
        from irflow.engine.ray_cluster import ray_session

        return ray_session(rt, api_url())

    def map_shards(self, stage, label: str, jobs: list, rt) -> list[dict]:
        from irflow.engine.shards import on_ray, relay_warnings

        done = on_ray(stage, jobs, rt)
        relay_warnings(label, done)
        return done

    def worker_threads(self, rt) -> int:
        from irflow.engine.runtime import available_cpus

        if rt.ray.threads_per_worker:
            return rt.ray.threads_per_worker
        workers = rt.ray.workers or available_cpus()
        return max(1, (rt.threads or available_cpus()) // workers)

    def concurrent_stages(self, rt) -> int:
        return rt.ray.concurrent_stages
