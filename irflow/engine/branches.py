"""Independent branches at once: stage calls return at once and run as Prefect futures.

With an executor whose ``concurrent_stages`` is above 1 (ray, with ``runtime.ray.concurrent_stages`` above 1), a
stage call in a recipe
body does not wait for its stage. It submits the stage's Prefect task to a thread pool of the flow's
process and returns a ``Deferred``: a stand-in for the stage's output ref (for a multi-output stage,
for its dict of refs: ``gen["queries"]`` is a Deferred too, and waits for nothing). A Deferred given
to the next stage call goes to Prefect as the upstream future, so Prefect waits for it (and draws the
edge in its UI); anything else that reads it (``ref.id``, ``ref.table()``, the report reading the
metrics) waits for it. A body thus still reads top-down, and the stages that do not read each other's
outputs -- GPL's miners, the BM25 and dense baselines, RocketQA's M_D0 ablations -- run together.

- At most ``concurrent_stages`` stages run at once (a semaphore; a stage still waiting for its inputs
  holds no slot). A stage runs in a thread here; its heavy work goes to the executor as shards: this
  overlaps stages, not the shards of one stage.
- Stages that compute with torch in this process (``work`` set, not sharded: the trainers, a teacher
  that is not sharded) take turns (``irflow.engine.runner``): torch's thread count (``torch.set_num_threads``)
  and a GPU's memory belong to the process, not to a thread, so two of them at once would fight over
  both. Two calls with the same cache key (an encode_corpus that a miner and an evaluated system
  share) compute once: the second waits for the first and finds its result cached.
- The catalog is one DuckDB file behind a lock of the process (``irflow.engine.catalog``). A stage run
  records when it started and how long it ran, not counting its waits for the turns above: the
  overlap is in ``stage_runs`` (``started_at``, ``seconds``).
- The first stage that fails fails the run with its own error (``StageFailed`` naming it, the run's
  ``failed_stage``): nothing starts after it, the body stops at its next stage call or read, and the
  stages already running finish (and are cached for the next run) before the run ends.
- A Ctrl-C stops the run at once: nothing new starts, the running stages stop at their next
  interruption check (``irflow.engine.processes.check_interrupted``), and the run's Ray cluster goes with
  the run (shards in flight are dropped; finished parts stay for the next run).

Dry runs (``irflow status``), the calls that ``--to`` skips, executor local and
``concurrent_stages: 1`` are not deferred: a stage call runs its stage and returns its refs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

from irflow.engine.processes import abort_on, check_interrupted

log = logging.getLogger("irflow")

POLL_SECONDS = 0.2  # how often a wait looks for a failure elsewhere or a Ctrl-C


class Deferred:
    """The output of a stage call that may still be running: a ``DatasetRef`` (or a dict of them, by
    output name) once it is done. Reading an attribute (``.id``, ``.table()``) waits for it;
    ``deferred["name"]`` of a multi-output stage is the Deferred of that output and waits for nothing."""

    __slots__ = ("_branches", "_future", "_label", "_outputs", "_name")

    def __init__(self, branches: "Branches", future, label: str, outputs: tuple[str, ...] | None,
                 name: str | None = None):
        self._branches = branches
        self._future = future  # the stage's Prefect future
        self._label = label
        self._outputs = outputs  # a multi-output stage's output names (None: one output)
        self._name = name  # this output of it

    def __getitem__(self, name: str) -> "Deferred":
        if self._outputs is None or self._name is not None:
            return self.value()[name]
        if name not in self._outputs:
            raise KeyError(f"{name!r}: {self._label} outputs {', '.join(self._outputs)}")
        return Deferred(self._branches, self._future, self._label, self._outputs, name)

    def value(self):
        """The ref (or dict of refs), once the stage is done; raises the run's first failure."""
        result = self._branches.result(self._future)
        return result if self._name is None else result[self._name]

    def for_prefect(self):
        """What stands for it in a task's parameters: Prefect resolves futures, also inside a dataclass."""
        return self._future if self._name is None else _Pick(self._future, self._name)

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # copy/pickle/IPython probes: no reason to wait for the stage
            raise AttributeError(attr)
        return getattr(self.value(), attr)

    def __iter__(self):
        return iter(self.value())

    def __len__(self):
        return len(self.value())

    def __contains__(self, item):
        return item in self.value()

    def __repr__(self) -> str:
        what = self._label if self._name is None else f"{self._label}[{self._name!r}]"
        return f"Deferred({what}, {'done' if self._future.wrapped_future.done() else 'pending'})"


@dataclass(frozen=True)
class _Pick:
    """One output of a multi-output stage's future, in a task's parameters (Prefect replaces ``of``
    with the stage's dict of refs before the task runs)."""

    of: Any
    name: str


def resolve(value):
    """``value`` with every Deferred in it (in lists, tuples, dicts) replaced by what it stands for."""
    if isinstance(value, Deferred):
        return value.value()
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(v) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    return value


def _for_prefect(value):
    if isinstance(value, Deferred):
        return value.for_prefect()
    if isinstance(value, (list, tuple)):
        return type(value)(_for_prefect(v) for v in value)
    return value


def _picked(value):
    if isinstance(value, _Pick):
        return value.of[value.name]
    if isinstance(value, (list, tuple)):
        return type(value)(_picked(v) for v in value)
    return value


class _Slots:
    """At most ``n`` holders; among the stages waiting for a slot, the one submitted first goes first
    (the body's order), whichever thread came to ask first. (A stage whose thread has not asked yet --
    Prefect is still creating its task run -- can be passed by a later one.)"""

    def __init__(self, n: int):
        self._free = n
        self._waiting: list[int] = []  # a heap of submission numbers
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, number: int):
        with self._cond:
            heapq.heappush(self._waiting, number)
            while not (self._free and self._waiting[0] == number):
                self._cond.wait()
            heapq.heappop(self._waiting)
            self._free -= 1
            self._cond.notify_all()  # the next in line may go too, if a slot is left
        try:
            yield
        finally:
            with self._cond:
                self._free += 1
                self._cond.notify_all()


class Branches:
    """The stage calls of one run, submitted as Prefect tasks to a thread pool (see the module doc).

    ``with Branches(run, limit):`` sets ``run.branches`` (stage calls then submit here); leaving the
    block normally waits for every stage and raises the first failure; leaving it on an error waits
    for the running stages; on a Ctrl-C it waits for nothing."""

    def __init__(self, run, limit: int):
        if limit < 1:
            raise ValueError("concurrent stages: at least 1")
        self.run = run
        self.limit = limit
        self._slots = _Slots(limit)
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._futures: list = []
        self._running: dict[str, int] = {}  # labels of the stages running now
        self.abort = threading.Event()  # set on a Ctrl-C: stage threads stop at their next check
        self._runner = None
        self._stack: contextlib.ExitStack | None = None

    def __reduce__(self):
        # Prefect's task context (a stage's parameters included) is pickled into each Ray shard task;
        # there the Branches of the driver are of no use: they arrive as None.
        return _detached, ()

    # ---- the body's side --------------------------------------------------------------------
    def __enter__(self) -> "Branches":
        from prefect.task_runners import ThreadPoolTaskRunner

        # Threads waiting for their inputs hold no slot; the pool is wide so that a stage whose inputs
        # are ready never queues behind stages that wait. (Any width works: the body submits upstream
        # stages first and the pool starts them in order, so a waiting thread's inputs are running.)
        runner = ThreadPoolTaskRunner(max_workers=max(32, 8 * self.limit))
        with contextlib.ExitStack() as stack:
            stack.enter_context(abort_on(self.abort))
            self._runner = runner.__enter__()
            self._stack = stack.pop_all()
        self.run.branches = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.run.branches = None
        stopped = exc_type is not None and not issubclass(exc_type, Exception)
        try:
            if exc_type is None:
                try:
                    self.wait()  # raises the first failure
                except Exception:
                    self._drain()
                    raise
            elif stopped:  # a Ctrl-C (or a SystemExit): stop what runs, wait for nothing
                self.abort.set()
            else:
                self._drain()
        except BaseException as e:
            if not isinstance(e, Exception):  # a Ctrl-C while waiting
                stopped = True
                self.abort.set()
            raise
        finally:
            executor = self._runner._executor
            self._runner._executor = None
            if executor is not None:
                # Not-yet-started tasks are dropped; after a Ctrl-C the running ones are not waited
                # for (a thread in a shard's ray.get ends when the run's Ray session does).
                executor.shutdown(wait=not stopped, cancel_futures=True)
            self._runner.__exit__(None, None, None)
            self._stack.close()

    def submit(self, stage, run, params, tag: str | None, inputs: dict) -> Deferred:
        """Submit one stage call; returns at once (raises the run's first failure if there is one)."""
        self.raise_if_failed()
        params, inputs = stage._check(params, inputs)  # a wrong call fails here, at the body's line
        label = stage.run_name(tag)
        parameters = {"run": run, "params": params, "tag": tag,
                      "inputs": {role: _for_prefect(v) for role, v in inputs.items()}, "name": label,
                      "branches": (self, next(self._numbers))}
        future = self._runner.submit(run.stage_task(stage), parameters=parameters)
        with self._lock:
            self._futures.append(future)
        outputs = tuple(o.name for o in stage.outputs) if len(stage.outputs) > 1 else None
        return Deferred(self, future, label, outputs)

    def result(self, future):
        """A stage's result, once it is done (the body waits here, watching for failures and Ctrl-C)."""
        while True:
            self.raise_if_failed()
            done, _ = concurrent.futures.wait([future.wrapped_future], timeout=POLL_SECONDS)
            if done:
                break
        self.raise_if_failed()
        return future.result()

    def raise_if_failed(self) -> None:
        check_interrupted()
        if self.abort.is_set():
            raise KeyboardInterrupt
        if self.run.error is not None:
            raise self.run.error

    def wait(self) -> None:
        """Every submitted stage done; the first failure raised."""
        for future in list(self._futures):
            self.result(future)
        self.raise_if_failed()

    def _drain(self) -> None:
        """After a failure: wait for the stages still running (the others are not started)."""
        running = self.running()
        if running:
            log.info("waiting for the stage(s) still running to finish: %s", ", ".join(running))
        pending = [f.wrapped_future for f in self._futures]
        while pending:
            check_interrupted()
            _, pending = concurrent.futures.wait(pending, timeout=POLL_SECONDS)

    def running(self) -> list[str]:
        with self._lock:
            return sorted(self._running)

    # ---- the stage's side (in a thread of the pool) ---------------------------------------------
    def run_stage(self, stage, run, params, tag: str | None, inputs: dict, label: str, number: int):
        """Run one submitted stage call (its Prefect task's body): a slot, then ``stage.execute``'s
        (refs, status); a Cancelled state if the run failed or stopped before it started."""
        from prefect.states import Cancelled

        inputs = {role: _picked(v) for role, v in inputs.items()}
        with self._slots.hold(number):
            if self.abort.is_set() or run.error is not None:
                why = "the run was interrupted" if self.abort.is_set() else f"{_failed_name(run)} failed"
                return Cancelled(message=f"irflow: not started: {why}")
            with self._lock:
                self._running[label] = self._running.get(label, 0) + 1
            try:
                return stage.execute(run, params, tag, inputs)
            except Exception as e:
                first = run.error is None or run.error is e
                run.fail(e)  # no-op unless it is the first failure (execute records its own first)
                if first:
                    others = [s for s in self.running() if s != label]
                    log.info("%s failed: nothing new starts%s", label,
                             f"; waiting for {', '.join(others)}" if others else "")
                raise
            except BaseException:
                self.abort.set()  # a Ctrl-C seen in a stage's thread stops every branch
                raise
            finally:
                with self._lock:
                    self._running[label] -= 1
                    if not self._running[label]:
                        del self._running[label]


def _detached():
    return None


def _failed_name(run) -> str:
    return run.failed["name"] if run.failed else "a stage"


def branches_for(run, runtime) -> contextlib.AbstractContextManager:
    """The run's Branches when its executor runs stages at once (ray: ``concurrent_stages`` > 1), else a
    context that changes nothing (stage calls run one after another)."""
    limit = run.executor.concurrent_stages(runtime)
    if limit <= 1 or run.dry_run:
        return contextlib.nullcontext()
    return Branches(run, limit)
