"""A cron schedule starts real runs: a real Prefect server (not the test harness), its scheduler creating
flow runs of small configs, both ways users schedule one -- `irflow serve --cron` and a deployment of
prefect.yaml with its schedule switched on, served by a process worker -- and each run completing with
every stage cached. The served config reads a folder of the user's documents: documents added to it
between two scheduled runs are the only passages the next run encodes (irflow.engine.row_reuse).

Why this test exists: with SQLAlchemy 2.1 in the lock, Prefect 3.8's scheduler service failed on every
loop (`InvalidRequestError: Can't evaluate bulk DML statement`), so no schedule ever created a run while
the deployments, the API and a flow called directly all looked healthy. Only the scheduler creating a run
shows it. The same server is asked once for what users read after a scheduled run: the run-summary
artifact and the UI's page of the run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from irflow.dev.testing import beir_slice, make_tiny_bi_encoder, scifact_docs
from irflow.engine.catalog import Catalog

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CRON = "* * * * *"
DEADLINE_S = 170  # the next minute boundary (<= 60 s), the scheduler's loop, the worker's poll, a cached run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    e.update(HF_HUB_OFFLINE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1",
             PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # the worker starts `python -m prefect...`
    e.update(extra)
    return e


def _api(url: str, path: str, body: dict | None = None, accept: str = "application/json"):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Accept": accept},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
    return json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode()


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def test_a_cron_schedule_creates_runs_that_complete_cached(tmp_path, shared_datasets):
    data = beir_slice(shared_datasets / "scifact.zip", tmp_path / "slice", n_test_queries=3, n_extra_docs=12, seed=3)
    bi = make_tiny_bi_encoder(tmp_path / "bi", normalize=True)
    config, store = tmp_path / "baselines.yaml", tmp_path / "store"
    config.write_text(yaml.safe_dump({
        "flow": "baselines", "dataset": {"name": "slice", "source": str(data), "split": "test"},
        "bm25": {"variants": ["flat"]}, "dense": {"model": str(bi), "batch_size": 32}, "runtime": {"threads": 1}}))
    # a folder of the user's own documents (no labels: a proxy evaluation), which gains documents later
    docs, folder = scifact_docs(36), tmp_path / "my-docs"
    folder.mkdir()

    def write_docs(a: int, b: int) -> None:
        for d, title, text in zip(*(docs.column(c).to_pylist()[a:b] for c in ("doc_id", "title", "text"))):
            (folder / f"{d}.txt").write_text(f"{title}\n\n{text}\n")

    write_docs(0, 30)
    own, own_store = tmp_path / "own.yaml", tmp_path / "own-store"
    own.write_text(yaml.safe_dump({
        "flow": "baselines", "dataset": {"name": "my-docs", "source": str(folder), "proxy": {"documents": 6}},
        "bm25": {"variants": ["flat"]}, "dense": {"model": str(bi), "batch_size": 32}, "runtime": {"threads": 1}}))

    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    logs = {n: tmp_path / f"{n}.log" for n in ("server", "serve", "worker")}
    procs: list[subprocess.Popen] = []

    def start(name, argv, env, cwd=ROOT):
        p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=logs[name].open("w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        procs.append(p)
        return p

    # the server (loop of its scheduler 5 s, not 60) and, meanwhile, the config's first run (its own
    # temporary Prefect server): the scheduled runs then find everything cached
    server = start("server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                   _env(PREFECT_HOME=str(tmp_path / "server-home"), PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5",
                        PREFECT_UI_ENABLED="true"))
    # (both configs' first runs at once, beside the server starting: they share nothing)
    first = [subprocess.Popen([sys.executable, "-m", "irflow.cli", "run", str(c), "--store", str(s)], env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for c, s in ((config, store), (own, own_store))]
    try:
        errors = [f.communicate(timeout=300)[1] for f in first]
        assert all(f.returncode == 0 for f in first), [e[-3000:] for e in errors]
        for _ in range(120):
            try:
                if _api(url, "/health") is True:
                    break
            except OSError:
                pass
            assert server.poll() is None, _tail(logs["server"])
            time.sleep(1)
        client_env = _env(PREFECT_API_URL=url, PREFECT_HOME=str(tmp_path / "client-home"))

        # 1. irflow serve --cron: a deployment served by this process
        start("serve", [sys.executable, "-m", "irflow.cli", "serve", str(own), "--cron", CRON, "--store",
                        str(own_store), "--name", "every-minute"], client_env, cwd=tmp_path)

        # 2. one of prefect.yaml's deployments, its schedule switched on, deployed and run by a process worker
        spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
        dep = next(d for d in spec["deployments"] if d["entrypoint"].endswith("baselines.py:baselines_flow"))
        dep.update(parameters={"config": str(config), "overrides": [], "store": str(store)},
                   schedules=[{"cron": CRON, "timezone": "UTC", "active": True}])
        spec["deployments"] = [dep]
        prefect_file = tmp_path / "prefect.yaml"
        prefect_file.write_text(yaml.safe_dump(spec, sort_keys=False))
        pool = dep["work_pool"]["name"]
        for argv in (["work-pool", "create", pool, "--type", "process"],
                     ["--no-prompt", "deploy", "--prefect-file", str(prefect_file), "--name", dep["name"]]):
            r = subprocess.run([str(BIN / "prefect"), *argv], env=dict(client_env, IRFLOW_HOME=str(ROOT)), cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        start("worker", [str(BIN / "prefect"), "worker", "start", "--pool", pool], client_env)

        # the scheduler creates runs of both deployments; each completes
        deployments = {d["name"]: d["id"] for d in _api(url, "/deployments/filter", {})}
        assert set(deployments) == {"every-minute", dep["name"]}, deployments
        done: dict[str, dict] = {}
        seen: list[dict] = []
        t0 = time.monotonic()
        while len(done) < 2 and time.monotonic() - t0 < DEADLINE_S:
            seen = _api(url, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": list(deployments.values())}}})
            for fr in seen:
                assert fr["state_type"] not in ("FAILED", "CRASHED"), (fr["name"], fr["state"], _tail(logs["worker"]),
                                                                        _tail(logs["serve"]))
                if fr["state_type"] == "COMPLETED" and fr["auto_scheduled"]:
                    done.setdefault(fr["deployment_id"], fr)
            time.sleep(3)
        assert len(done) == 2, (f"after {DEADLINE_S} s, runs of {len(done)} of 2 scheduled deployments completed; "
                                f"flow runs: {[(f['name'], f['state_type']) for f in seen]}\n"
                                f"server log:\n{_tail(logs['server'])}")

        for run in done.values():
            # every stage was reused: a scheduled run of an unchanged config recomputes nothing
            tasks = _api(url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
            assert tasks and {t["state"]["name"] for t in tasks} == {"Cached"}, [(t["name"], t["state"]["name"]) for t in tasks]
            # what a user reads after it: the run's summary artifact, and the UI's page of the run
            arts = _api(url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
            assert any(a["key"] == "run-summary" and "cached" in a["data"] for a in arts), arts
        # a browser's request (Accept: text/html) for the run's page gets the UI's app
        page = _api(f"http://127.0.0.1:{port}", f"/runs/flow-run/{run['id']}", accept="text/html")
        assert "<html" in page.lower() and "prefect" in page.lower()

        # 6 documents join the folder: the next scheduled run encodes those passages only
        write_docs(30, 36)
        changed_at = time.time()
        served = deployments["every-minute"]
        later = None
        while later is None and time.time() - changed_at < DEADLINE_S:
            for fr in _api(url, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [served]}}}):
                assert fr["state_type"] not in ("FAILED", "CRASHED"), (fr["name"], fr["state"], _tail(logs["serve"]))
                started = fr["start_time"] and time.mktime(time.strptime(fr["start_time"][:19], "%Y-%m-%dT%H:%M:%S"))
                if fr["state_type"] == "COMPLETED" and started and started - time.timezone > changed_at:
                    later = fr
            time.sleep(3)
        assert later is not None, f"no scheduled run after the folder changed:\n{_tail(logs['serve'])}"
        catalog = Catalog(own_store / "catalog.duckdb")
        with catalog.connect() as con:
            run_id = con.execute("SELECT run_id FROM runs WHERE prefect_flow_run_id = ?", [later["id"]]).fetchone()[0]
        stages = {s["name"]: s for s in catalog.stage_runs(run_id)}
        encoded = stages["encode_corpus[zero-shot]"]
        assert encoded["status"] == "computed" and encoded["rows"]["computed"] == 6, encoded
        assert encoded["rows"]["reused"] == 30
    finally:
        for p in reversed(procs):
            _stop(p)
    assert all(p.poll() is not None for p in procs)
