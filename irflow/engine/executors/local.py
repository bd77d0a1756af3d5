"""The default executor: stages and their shards in this process, one after another."""

from __future__ import annotations

from irflow.engine.executors import Executor, register


@register
class LocalExecutor(Executor):
    """Stages and their shards in this process, one after another (the default)."""

    name = "local"

    def map_shards(self, stage, label: str, jobs: list, rt) -> list[dict]:
        from irflow.engine.shards import run_here

        return run_here(jobs)
