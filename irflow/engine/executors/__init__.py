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

An executor with settings of its own declares their model as ``settings``: it is the config's
``runtime.<name>`` section (``RayExecutor.settings`` is ``runtime.ray``), read with ``settings_of(rt)``.
``irflow.engine.runtime`` imports this package's modules to build ``RuntimeConfig``, so an executor's module
imports the runtime (and what imports it at the top, as the runner does) inside its functions only;
``irflow.engine.shards`` does not, and may be imported at the top (``ray.py``).

A new executor is one module in this package holding one class registered with ``@register``
(``local.py``, ``ray.py``); the package's modules are imported when ``irflow.engine.runtime`` is first
imported (its ``RuntimeConfig`` has a section per executor with settings), as recipes are found
(CONTRIBUTING.md shows a third)::

    @register
    class ThreadsExecutor(LocalExecutor):
        name = "threads"

        def map_shards(self, stage, label, jobs, rt):
            with ThreadPoolExecutor(2) as pool:
                return list(pool.map(run_shard, jobs))
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

EXECUTORS: dict[str, type["Executor"]] = {}


def register(cls: type["Executor"]) -> type["Executor"]:
    EXECUTORS[cls.name] = cls
    return cls


_DISCOVERED = False


def _discover() -> None:
    """Import every module of this package once: each executor registers itself."""
    global _DISCOVERED
    if not _DISCOVERED:
        from irflow.engine.registry import import_modules

        import_modules(__name__)
        _DISCOVERED = True


def names() -> list[str]:
    _discover()
    return sorted(EXECUTORS)


def known(name: str) -> bool:
    """Whether ``name`` is a registered executor (this package's modules imported first)."""
    _discover()
    return name in EXECUTORS


def settings_models(taken: set[str] = frozenset()) -> dict[str, type]:
    """Executor name -> the model of its ``runtime.<name>`` section, for those with settings; ``taken``: the
    runtime's own keys, which no executor with settings may be named."""
    _discover()
    out = {name: EXECUTORS[name].settings for name in sorted(EXECUTORS) if EXECUTORS[name].settings is not None}
    clash = sorted(set(out) & set(taken))
    if clash:
        raise TypeError(f"executor {clash[0]!r} has settings, but runtime.{clash[0]} is already a runtime setting: "
                        "name the executor otherwise")
    return out


def executor_for(rt) -> "Executor":
    """The executor ``rt.executor`` names."""
    _discover()
    if rt.executor not in EXECUTORS:
        from irflow.engine.errors import ConfigError

        raise ConfigError(f"runtime.executor: '{rt.executor}' is not an executor ({', '.join(names())})")
    return EXECUTORS[rt.executor]()


class Executor:
    name: ClassVar[str]
    remote: ClassVar[bool] = False  # shards run in other processes (the log says how they were spread)
    settings: ClassVar[type | None] = None  # the model of its runtime.<name> section (a Params), if it has one

    def settings_of(self, rt):
        """Its ``runtime.<name>`` section of ``rt`` (its defaults where ``rt``'s model predates the executor's
        module: one loaded after ``irflow.engine.runtime`` was read); None for an executor without settings."""
        section = getattr(rt, self.name, None)
        if section is None and self.settings is not None:
            section = self.settings()
        return section

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
