"""executor ray: the Ray cluster a run's shards go to, joined once per run (``ray_session``).

``runtime.ray.address: null`` starts a local cluster for the run. It is started by a small watchdog
process (``python -m irflow.engine.executors.ray_cluster``) rather than by ``ray.init()`` in the run's own process: a
run killed with kill -9 leaves Ray's agents behind when Ray started them itself (checked: after a
kill -9 of the driver, gcs_server and raylet went, ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``
stayed, reparented to init). The watchdog is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so
every process of the cluster stays its descendant; when the run ends -- normally, by Ctrl-C, or
killed -- its pipe closes or its parent changes, and it stops every descendant (TERM, then KILL).

An ``address`` ('auto', 'host:6379', 'ray://host:10001') joins a cluster someone else runs; it is
checked before any stage runs and left running afterwards. The store must then be on a filesystem
every node sees: shards read their inputs and write their parts there.

Shard workers get the run's Prefect API (``PREFECT_API_URL``): without it each Ray worker starts a
temporary Prefect server of its own (minutes each on a busy machine, task runs recorded in
throw-away databases).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from irflow.engine.errors import ConfigError

log = logging.getLogger("irflow.ray")

_PR_SET_CHILD_SUBREAPER = 36
PROBE_SECONDS = 45
# What shard workers must see as the run does (a joined cluster's workers do not inherit our env).
_PASSED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "TOKENIZERS_PARALLELISM", "OPENAI_API_KEY",
               "PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_LOGGING_LEVEL", "IRFLOW_SHARED_DATASETS")


def check_address(address: str) -> None:
    """Raise ConfigError (one line naming the address) if no Ray cluster answers there."""
    if address == "auto":
        if os.environ.get("RAY_ADDRESS"):
            return check_address(os.environ["RAY_ADDRESS"])
        if Path("/tmp/ray/ray_current_cluster").exists():
            return
        raise ConfigError("runtime.ray.address: 'auto', but no Ray cluster runs on this machine (no RAY_ADDRESS, "
                          "no /tmp/ray/ray_current_cluster); start one with `ray start --head`, or leave "
                          "runtime.ray.address null for a local cluster of the run's own")
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"runtime.ray.address: '{address}' is not 'auto', 'host:port' or 'ray://host:port'")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(f"runtime.ray.address: cannot reach a Ray cluster at {address} ({e})") from None
    # A port that accepts a connection is not yet a Ray cluster (a proxy accepts anything): join it
    # once, in a throw-away process, with a deadline (Ray itself retries a silent address for minutes).
    probe = "import sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR'); ray.shutdown()"
    try:
        proc = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True,
                              timeout=PROBE_SECONDS, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"runtime.ray.address: cannot reach a Ray cluster at {address} (no answer from Ray "
                          f"in {PROBE_SECONDS} s)") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        raise ConfigError(f"runtime.ray.address: cannot reach a Ray cluster at {address} ({last})")


def check_local_gpus(gpus_per_shard: float) -> None:
    if gpus_per_shard > 0:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"runtime.ray.gpus_per_shard: {gpus_per_shard}, but this machine has no CUDA GPU "
                              f"for its local Ray cluster; set it to 0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_cluster(cpus: int, gpus: int):
    """A Ray cluster on this machine for as long as the block runs (and not a moment after the run's
    process dies). Yields its address."""
    from irflow.engine.processes import dying_with_parent

    argv, dying = dying_with_parent([sys.executable, "-m", "irflow.engine.executors.ray_cluster", str(cpus), str(gpus)],
                                    signal.SIGTERM, own_session=True)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **dying)
    try:
        line = proc.stdout.readline().strip()
        if not line.startswith("address "):
            proc.wait(timeout=30)
            raise RuntimeError(f"the local Ray cluster did not start (rc {proc.returncode}): {line}")
        yield line.split(" ", 1)[1]
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the watchdog stops the cluster
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def ray_session(settings, prefect_api_url: str | None):
    """Ray joined for the run (a local cluster started first if ``settings``, the run's ``runtime.ray``, sets no
    address); left at the end."""
    import ray

    from irflow.engine.runtime import available_cpus
    from irflow.engine.worker import WORKER_ENV

    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env[WORKER_ENV] = "1"
    if prefect_api_url:
        env["PREFECT_API_URL"] = prefect_api_url
    r = settings
    with contextlib.ExitStack() as stack:
        address = r.address
        if address is None:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a run's own cluster: no token warning
            check_local_gpus(r.gpus_per_shard)
            cpus = r.workers or available_cpus()
            gpus = _cuda_devices() if r.gpus_per_shard else 0
            t0 = time.perf_counter()
            address = stack.enter_context(local_cluster(cpus, gpus))
            log.info("ray: local cluster at %s (%d CPU slots, %d GPUs) up in %.1f s", address, cpus, gpus,
                     time.perf_counter() - t0)
        ray.init(address=address, runtime_env={"env_vars": env}, logging_level=logging.WARNING,
                 log_to_driver=True)
        stack.callback(ray.shutdown)
        if r.gpus_per_shard and not ray.cluster_resources().get("GPU"):
            raise ConfigError(f"runtime.ray.gpus_per_shard: {r.gpus_per_shard}, but the Ray cluster at {address} "
                              f"has no GPU; set it to 0")
        yield address


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


# ---- the watchdog (python -m irflow.engine.executors.ray_cluster CPUS GPUS) -----------------------------------------
def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop_all(grace: float = 3.0) -> None:
    """TERM every descendant, then KILL what is left, until none is left (orphans come back to us)."""
    me = os.getpid()
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM
    while pids := _descendants(me):
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, sig)
        time.sleep(0.2)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if time.monotonic() > deadline:
            sig = signal.SIGKILL


def _watchdog(cpus: int, gpus: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    parent = os.getppid()
    stop = []
    # TERM (the run's parent-death signal) asks for a stop; the stop itself must not be cut short by a
    # second signal (gcs_server has been seen to outlive a TERM: only the KILL that follows ends it).
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
           f"--port={port}", f"--num-cpus={cpus}", f"--num-gpus={gpus}", "--include-dashboard=false",
           f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
           "--disable-usage-stats"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            print(f"failed: ray start: {(proc.stderr or proc.stdout)[-1500:]}", flush=True)
            return
        print(f"address 127.0.0.1:{port}", flush=True)
        while os.getppid() == parent and not stop:
            ready, _, _ = select.select([sys.stdin], [], [], 1.0)
            if ready and not sys.stdin.readline():
                break  # the run closed its end (done, or dead)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_all()


if __name__ == "__main__":
    _watchdog(int(sys.argv[1]), int(sys.argv[2]))
