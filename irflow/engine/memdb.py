"""One in-memory DuckDB instance per process, and cheap connections (cursors) to it.

Opening a DuckDB instance costs 20-25 ms on 2 cores (it sets up its built-in catalog of functions
each time), which a run paid hundreds of times: per catalog access, per data-contract validation. A
cursor on a live instance costs well under a millisecond. Users: ``irflow.engine.catalog`` (which ATTACHes
the catalog file to this instance for each access) and ``irflow.data_contracts`` (which registers the
table it checks in a cursor of its own).

A forked child gets an instance of its own on first use: it never touches its parent's.
"""

from __future__ import annotations

import atexit
import os
import threading

import duckdb

_LOCK = threading.Lock()
_INSTANCE: duckdb.DuckDBPyConnection | None = None
_PID: int | None = None


def _instance() -> duckdb.DuckDBPyConnection:
    """This process's in-memory DuckDB (created on first use); call under ``_LOCK``. Only cursors are
    made from it: a DuckDB connection is for one thread at a time, its cursors are one each."""
    global _INSTANCE, _PID
    if _INSTANCE is None or _PID != os.getpid():
        _INSTANCE, _PID = duckdb.connect(":memory:"), os.getpid()
    return _INSTANCE


@atexit.register
def _close() -> None:
    """Closed before the interpreter tears its modules down: an instance still alive then makes
    DuckDB's bindings (nanobind) print a page of "leaked instance" lines as the process exits."""
    global _INSTANCE
    with _LOCK:
        if _INSTANCE is not None and _PID == os.getpid():
            _INSTANCE.close()
        _INSTANCE = None


def cursor() -> duckdb.DuckDBPyConnection:
    """A new connection to this process's instance, for one thread; close it after use. What one
    cursor registers or sets (``register``, ``USE``) the others do not see; what is ATTACHed to the
    instance they all do."""
    with _LOCK:
        return _instance().cursor()
