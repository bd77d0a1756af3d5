"""What a process that computes shards needs, and nothing of the engine: the per-process model cache
(a model is loaded once per worker, not once per shard), torch's thread count for a computation, and the
warnings a computation logs (recorded with what it made).

Ray workers run with ``IRFLOW_SHARD_WORKER=1`` (``irflow.engine.executors.ray_cluster``); the local executor keeps objects
for the length of one stage's shards (``keeping``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Callable

log = logging.getLogger("irflow")

WORKER_ENV = "IRFLOW_SHARD_WORKER"  # set in Ray workers: objects cached per process (models, indexes)

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


@contextlib.contextmanager
def keeping():
    """Objects made with ``per_worker`` are kept inside the block (this process runs a stage's shards)."""
    global _KEEPING
    _KEEPING += 1
    try:
        yield
    finally:
        _KEEPING -= 1
        if not _KEEPING:
            _PER_WORKER.clear()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads for a computation (process-wide: stages that compute with torch in this
    process take turns, ``irflow.engine.runner``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# what they warn about is the run's, not the computation's in whose thread it was said (the pace's overrun):
# a stage's warnings are kept with its datasets and said again where they are reused
RUN_LOGGERS = frozenset({"irflow.engine.pace"})


class _Warnings(logging.Handler):
    """irflow's warning records, each message once, in order (of one thread only, when ``thread`` is set)."""

    def __init__(self, thread: int | None):
        super().__init__(logging.WARNING)
        self.thread = thread
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.thread is not None and (record.thread != self.thread or record.name in RUN_LOGGERS):
            return
        if record.getMessage() not in self.messages:
            self.messages.append(record.getMessage())


@contextlib.contextmanager
def warnings_logged(every_thread: bool = False):
    """The distinct irflow warnings logged inside the block (a list, filled as they come). By this thread
    only, by default: what a computation warned about, recorded with its datasets (and a Ray shard's, with
    its record), while other stages run at once in other threads (irflow.engine.branches). ``every_thread``: the
    whole process's (a run's, ``api.run``)."""
    handler = _Warnings(None if every_thread else threading.get_ident())
    log.addHandler(handler)
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)
