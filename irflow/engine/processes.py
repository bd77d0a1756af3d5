"""Process hygiene: children that die with their parent, file locks, leftovers of dead processes.

A run killed with ``kill -9`` gets no chance to clean up, so the cleaning is arranged beforehand or
done by the next process:

- children (Prefect's temporary API server, the Java indexer, torchrun, a local Ray cluster) are
  started with Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``, set by ``setpriv`` before it
  execs the child): the kernel signals them when the thread that started them dies, however it dies;
- staging dirs are named ``tmp/<pid>-<uuid>``; a later run (or ``irflow gc``) removes those of
  processes that no longer exist;
- the run row of a dead process is marked ``interrupted`` by the next run (see Catalog.start_run);
- locks are ``flock``s, which the kernel releases when their holder dies: a killed run never
  leaves a lock behind.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("irflow")

_PR_SET_PDEATHSIG = 1


# Ctrl-C, remembered. Python raises KeyboardInterrupt at the main thread's next bytecode; if that
# bytecode belongs to a finaliser (a progress bar's __del__ run by the garbage collector, say), the
# exception is printed as "ignored" and the run goes on as if nothing happened -- it did, once in CI:
# exit 0 after a Ctrl-C. The handler also sets this flag, and stage boundaries and training/encoding
# loops check it, so a swallowed interrupt still stops the run at the next check.
_interrupted = False


def install_interrupt_handler() -> None:
    """SIGINT raises KeyboardInterrupt (as Python's default does) and is remembered for
    ``check_interrupted``. Installed by the CLI only: a library caller keeps its own handler."""

    global _interrupted

    def on_sigint(signum, frame):
        global _interrupted
        _interrupted = True
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # only there can handlers be set
        _interrupted = False
        signal.signal(signal.SIGINT, on_sigint)
        # The swallowed interrupt's "Exception ignored in: <... __del__>" traceback is not news to the
        # user (it was seen in CI, from asyncio's _SelectorTransport.__del__): the flag carries it on.
        previous = sys.unraisablehook

        def unraisable(u):
            if not (_interrupted and isinstance(u.exc_value, KeyboardInterrupt)):
                previous(u)

        sys.unraisablehook = unraisable


def interrupted() -> bool:
    """Whether a Ctrl-C came (since the CLI's handler was installed)."""
    return _interrupted


# A run whose stages run in threads (irflow.engine.branches) is stopped by its own event: the Ctrl-C reaches
# the main thread only, and a library caller has no handler to set the flag above. Stage threads see
# the event of the run that started them (Prefect copies the context into each thread).
_abort: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("irflow_abort", default=None)


def check_interrupted() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came and was swallowed on its way, or if the run of this
    thread's stage was stopped (``abort_on``)."""
    if _interrupted:
        raise KeyboardInterrupt
    event = _abort.get()
    if event is not None and event.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def abort_on(event: threading.Event):
    """``check_interrupted`` in this context, and in the threads started from it with a copy of it
    (Prefect's task runners), also raises once ``event`` is set."""
    token = _abort.set(event)
    try:
        yield
    finally:
        _abort.reset(token)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM  # exists, owned by someone else
    # a zombie (dead, not yet reaped by its parent) is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """This process gets ``sig`` when the thread that started it dies (Linux; elsewhere nothing).
    For a child that runs Python anyway (a spawned pool's initializer)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


_MAIN_LOCK = threading.Lock()


def run_in_spawned_child(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a fresh spawned Python process that dies with this one; its result.

    A spawned child re-runs the caller's ``__main__`` module before ``fn``: a script read on standard input
    (``python - <<EOF``) cannot be re-run (the child dies: BrokenProcessPool), and a script without an
    ``if __name__ == "__main__"`` guard would run again, whole, in the child. ``fn`` lives in irflow and needs
    nothing of ``__main__``, so the child is started with ``__main__``'s file hidden from multiprocessing
    (under a lock: stages run in threads) and imports irflow alone."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=set_parent_death_signal) as pool:
        main = sys.modules.get("__main__")
        with _MAIN_LOCK:
            saved = {k: main.__dict__.pop(k) for k in ("__file__",) if main is not None and k in main.__dict__}
            spec = getattr(main, "__spec__", None)
            if main is not None:
                main.__spec__ = None
            try:
                future = pool.submit(fn, *args, **kwargs)  # the child process starts here
            finally:
                if main is not None:
                    main.__dict__.update(saved)
                    main.__spec__ = spec
        return future.result()


def dying_with_parent(cmd: list[str], sig: int = signal.SIGTERM,
                      own_session: bool = False) -> tuple[list[str], dict]:
    """``cmd`` and the Popen keywords that start it so that it gets ``sig`` when the thread that
    starts it dies, however that thread dies (Linux). ``own_session``: the child does not get the
    terminal's Ctrl-C (its parent stops it when the parent is done).

    Through util-linux's ``setpriv --pdeathsig``, which sets the signal and execs ``cmd``, so that no
    Python runs in the forked child. A ``preexec_fn`` would, between fork and exec, in a copy of a
    process that has threads (Ray's, Prefect's, a run's branches): a lock another thread held at the
    fork (the loader's, the allocator's) stays held in the child for good. Where setpriv is missing,
    that ``preexec_fn`` is the fallback."""
    kwargs: dict = {"start_new_session": True} if own_session else {}
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if setpriv:
        name = signal.Signals(sig).name.removeprefix("SIG")
        return [setpriv, "--pdeathsig", name, "--", *map(str, cmd)], kwargs
    return list(cmd), {**kwargs, "preexec_fn": lambda: set_parent_death_signal(sig)}


@contextlib.contextmanager
def older_objects_frozen():
    """While a run's stages run, the objects that exist at its start (modules, classes, Prefect's and
    torch's state, a caller's own objects) are left out of the cyclic garbage collector's scans
    (``gc.freeze``): ``release_memory``'s collection after each stage then walks only what stages made
    since. A full collection walked them all: 0.64 s per stage in a GPL sample run (30 stages, 19 s of
    its 67). Frozen objects are still freed by reference counting; only one in a reference cycle that
    dies while frozen waits for the unfreeze at the end."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def release_memory() -> None:
    """Give the memory a finished stage freed back to the system. Collects reference cycles, then
    asks glibc to return its free pages (``malloc_trim``): glibc keeps freed memory in its arenas
    (one per thread that allocated; Prefect runs stages in worker threads) for reuse by the same
    arena, so a trainer's gigabytes of freed activations otherwise stay resident, beside the search
    JVM's and the next stage's memory (the RocketQA demo crept from 0.6 to 2.2 GiB between stages).
    Elsewhere than glibc only the collection runs."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter: a block this large or larger gets a mapping of its own
TRAINING_MMAP_THRESHOLD = 16 * 2**20
HEAP_MMAP_THRESHOLD = 32 * 2**20  # where glibc's own threshold ends up once blocks that large have been freed


@contextlib.contextmanager
def steady_heap(device: str):
    """For a CPU training: blocks of 16 MiB or more (a step's attention scores and feed-forward activations) in
    mappings of their own, returned to the system when freed. glibc raises its threshold as such blocks are
    freed, to 32 MiB, and then serves them from its heap, where each step's mix of sizes fragments it: the
    process's peak memory grows past what a step holds (``bench/train_speed.py``: a MiniLM step of 16 triples at 200
    tokens peaked at 1.10x the library's memory without this, 0.95x with it). After the training the threshold
    stays at 32 MiB, where glibc's own would be. Elsewhere than glibc, or on a GPU: nothing."""
    libc = None
    if not str(device).startswith("cuda"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            if libc.mallopt(M_MMAP_THRESHOLD, TRAINING_MMAP_THRESHOLD) != 1:
                libc = None
        except (OSError, AttributeError):
            libc = None
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)


@contextlib.contextmanager
def file_lock(path: Path, waiting: str | None = None):
    """An exclusive ``flock`` on ``path`` (created if needed). If another process holds it, log
    ``waiting`` once and block until it is released (or its holder dies)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                log.info(waiting)
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            if waiting:
                log.info("%s: done waiting (%.1f s)", waiting.split(":")[0], time.monotonic() - t0)
        yield
    finally:
        os.close(fd)  # releases the lock


def locked_elsewhere(path: Path) -> bool:
    """Whether some process holds the flock on ``path`` now."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def owner_pid(name: str) -> int | None:
    """The pid in a staging dir's name (``<pid>-<uuid>``), if it has one."""
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def start_prefect_server(prefect_home: Path) -> None:
    """Start Prefect's temporary API server for this process, if no PREFECT_API_URL is set.

    Prefect would start it on first use anyway; we start it here so that (a) it dies with us (the
    parent-death signal: a killed run leaves no uvicorn behind) and (b) two runs starting together
    on one store do not race on the SQLite migrations of their shared Prefect database: starting is
    serialised with a lock in PREFECT_HOME, and the second server finds the database migrated.
    """
    if os.environ.get("PREFECT_API_URL"):
        return
    from prefect.server.api import server as prefect_server

    srv = prefect_server.SubprocessASGIServer()
    if srv.running:
        return
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        # Its own session: a Ctrl-C meant for the run must not take the server down under it (the
        # run would then hang retrying its API calls); the run stops it on the way out (atexit).
        args, extra = dying_with_parent(args, signal.SIGTERM, own_session=True)
        return real_popen(args, **{**extra, **kwargs})

    with file_lock(Path(prefect_home) / "irflow-server-start.lock",
                   waiting="prefect: waiting for another run's temporary Prefect server to start"):
        prefect_server.subprocess.Popen = popen  # only for this call: Prefect's Popen of uvicorn
        try:
            srv.start()
        finally:
            prefect_server.subprocess.Popen = real_popen
