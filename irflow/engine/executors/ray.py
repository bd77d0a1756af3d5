"""Executor ray: each shard a Prefect task on Ray workers (Prefect's ``RayTaskRunner``), independent stages
at once. Its settings are the ``runtime.ray`` section (``RayConfig``, ``RayExecutor.settings``). The run's cluster
(started, watched and stopped, or an existing one joined) is ``irflow.engine.executors.ray_cluster``'s."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import Field, PositiveInt

from irflow.engine.executors import Executor, register
from irflow.engine.params import Params
from irflow.engine.shards import ShardFailed, ShardJob, relay_warnings, run_shard

log = logging.getLogger("irflow.shards")


class RayConfig(Params):
    """The Ray cluster of executor ray: where its shards run."""

    address: str | None = Field(None, description="null: start a local Ray cluster for this run and stop it "
                                                  "when the run ends (also on Ctrl-C or kill -9 of the run); "
                                                  "'auto', 'host:6379' or 'ray://host:10001': join an existing "
                                                  "cluster (it is left running)")
    workers: PositiveInt | None = Field(None, description="local cluster: CPU slots, i.e. shards running at "
                                                          "once (null: every CPU of this process)")
    threads_per_worker: PositiveInt | None = Field(None, description="torch/faiss threads in each shard task "
                                                                     "(null: CPUs divided by workers, at least 1)")
    gpus_per_shard: float = Field(0.0, ge=0, description="GPUs each shard of a device stage asks Ray for "
                                                         "(Ray's num_gpus; fractions share a GPU; 0: CPU)")
    concurrent_stages: PositiveInt = Field(4, description="stages that do not read each other's outputs run at "
                                                          "the same time, at most this many (their shards share "
                                                          "the workers; stages that compute with torch in the "
                                                          "run's process take turns); 1: one after another")


@register
class RayExecutor(Executor):
    """Shards as Prefect tasks on Ray workers (Prefect's ``RayTaskRunner``), independent stages at once
    (``runtime.ray``)."""

    name = "ray"
    remote = True
    settings = RayConfig  # runtime.ray

    def preflight(self, rt) -> None:
        from irflow.engine.executors import ray_cluster

        r = self.settings_of(rt)
        if r.address is not None:
            ray_cluster.check_address(r.address)
        else:
            ray_cluster.check_local_gpus(r.gpus_per_shard)

    def session(self, rt) -> Any:
        from irflow.engine.executors.ray_cluster import ray_session
        from irflow.engine.orchestration import api_url

        return ray_session(self.settings_of(rt), api_url())

    def map_shards(self, stage, label: str, jobs: list, rt) -> list[dict]:
        done = on_ray(stage, jobs, self.settings_of(rt).gpus_per_shard)
        relay_warnings(label, done)
        return done

    def worker_threads(self, rt) -> int:
        from irflow.engine.runtime import available_cpus

        r = self.settings_of(rt)
        if r.threads_per_worker:
            return r.threads_per_worker
        workers = r.workers or available_cpus()
        return max(1, (rt.threads or available_cpus()) // workers)

    def concurrent_stages(self, rt) -> int:
        return self.settings_of(rt).concurrent_stages


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


#: How often a shard whose worker was lost (a killed process, a preempted node) is computed again within
#: the run before the stage fails: a shard that raises is retried by Prefect (``shard_task``), but a worker
#: that dies takes Prefect's retry with it.
LOST_WORKER_RETRIES = 2
_LOST_WORKER = {"WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError", "ActorDiedError", "RayActorError",
                "OwnerDiedError", "ObjectLostError", "ObjectReconstructionFailedError"}


def lost_worker(e: BaseException | None) -> bool:
    """Whether ``e`` (or what it wraps) says the shard's worker died, rather than that the shard failed."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ in _LOST_WORKER:
            return True
        e = e.__cause__ or e.__context__
    return False


def on_ray(stage, jobs: list[ShardJob], gpus_per_shard: float) -> list[dict]:
    """Every job as a Prefect task on the run's Ray (``gpus_per_shard`` for a stage that computes with torch);
    a shard whose worker is lost is submitted again (at most ``LOST_WORKER_RETRIES`` times) and its record
    says ``retried``."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("runtime.executor ray: Ray is not joined (shards run inside `irflow run` / api.run, "
                           "which join the run's cluster)")
    gpus = gpus_per_shard if stage.work else 0.0
    done: list[dict] = []
    lost_times: dict[int, int] = {}
    pending = jobs
    while pending:
        finished, failed = _submit(pending, gpus)
        done += finished
        lost = [(job, e) for job, e in failed if lost_worker(e)]
        other = [(job, e) for job, e in failed if not lost_worker(e)]
        given_up = [(job, e) for job, e in lost if lost_times.get(job.index, 0) >= LOST_WORKER_RETRIES]
        if other or given_up:
            job, e = (other or given_up)[0]
            why = f" (its worker was lost {LOST_WORKER_RETRIES + 1} times)" if not other else ""
            raise ShardFailed(f"shard {job.index} (rows {job.start}-{job.stop} of {job.role}) failed{why}: "
                              f"{type(e).__name__}: {e}" + (f" ({len(failed) - 1} more shard(s) failed)"
                                                            if len(failed) > 1 else ""), e) from e
        for job, e in lost:
            lost_times[job.index] = lost_times.get(job.index, 0) + 1
            log.warning("%s: shard %d (rows %d-%d) lost its worker (%s): computing it again (%d of %d)", job.label,
                        job.index, job.start, job.stop, type(e).__name__, lost_times[job.index],
                        LOST_WORKER_RETRIES)
        pending = [job for job, _ in lost]
    for r in done:
        if lost_times.get(r["index"]):
            r["status"] = "retried"
    return done


def _submit(jobs: list[ShardJob], gpus: float) -> tuple[list[dict], list[tuple[ShardJob, BaseException]]]:
    """Run ``jobs`` as Prefect tasks on the joined Ray; wait for every one: (records, failures)."""
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

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
        except Exception as e:  # noqa: BLE001 -- every shard is waited for, then the failures are sorted
            failed.append((job, e))
    return done, failed
