"""Screenshots a person looks at: an irflow report page, and Prefect's UI after a re-run (cached stages).

    python bench/screenshots.py report --store STORE [--run latest] [--out bench/results/report.png]
    python bench/screenshots.py prefect-ui [--config configs/demo_baselines.yaml] [--out bench/results/prefect_cached.png]

``report`` writes ``irflow report RUN`` into a temp dir and has headless Chromium take a full-page
screenshot of it (``file://``: the page is self-contained, so nothing else is served).

``prefect-ui`` starts ``prefect server start`` (its UI on, a fresh ``PREFECT_HOME`` in a temp dir, a
free port), runs ``irflow run CONFIG`` twice against it (``PREFECT_API_URL``; the second run finds
every stage cached), and screenshots the second flow run's page. Prefect's UI is a JavaScript app:
Chromium is given a virtual-time budget to render it. It also writes what the server says about the
second run's task states (``<out>.json``: names and counts), so the picture's claim is checked in text.

Chromium and Graphviz come from Debian's packages (``apt-get install chromium graphviz``); neither is
needed by irflow itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import harness
from harness import IRFLOW, ROOT, log


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    sys.exit("screenshots: no Chromium on PATH (Debian: apt-get install chromium)")


def screenshot(url: str, out: Path, width: int = 1400, height: int = 2400, budget_ms: int = 0) -> None:
    cmd = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--window-size={width},{height}", f"--screenshot={out}"]
    if budget_ms:
        cmd.append(f"--virtual-time-budget={budget_ms}")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd + [url], check=True, capture_output=True, timeout=180)
    log(f"wrote {out} ({out.stat().st_size:,} bytes) of {url}")


def cmd_report(args) -> None:
    out_dir = Path(tempfile.mkdtemp(prefix="irflow-report-"))
    subprocess.run([str(IRFLOW), "report", args.run, "--store", args.store, "--out", str(out_dir)], check=True)
    screenshot((out_dir / "index.html").as_uri(), Path(args.out), height=args.height)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_prefect_ui(args) -> None:
    home = Path(tempfile.mkdtemp(prefix="irflow-prefect-ui-"))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(home / "prefect"), PREFECT_UI_ENABLED="true",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_API_URL=api)
    server = subprocess.Popen([str(IRFLOW.with_name("prefect")), "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(180):  # a busy machine: up to 3 minutes
            try:
                urllib.request.urlopen(f"{api}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            sys.exit("screenshots: prefect server did not answer in 180 s")
        store = home / "store"
        results = []
        for attempt in ("first", "second"):
            proc = subprocess.run([str(IRFLOW), "run", args.config, "--store", str(store), "--json"], env=env,
                                  capture_output=True, text=True, check=True)
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            log(f"{attempt} run: {results[-1]['run_id']} computed {len(results[-1].get('computed', []))}")
        flow_run = results[-1]["prefect_flow_run_id"]
        states = task_states(api, flow_run)
        screenshot(f"http://127.0.0.1:{port}/runs/flow-run/{flow_run}", Path(args.out), width=1600,
                   height=args.height, budget_ms=20000)
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"config": args.config, "flow_run_id": flow_run, "task_state_names": dict(Counter(states)),
             "machine": harness.machine()}, indent=2))
        log(f"second run's task states: {dict(Counter(states))}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)


def task_states(api: str, flow_run_id: str) -> list[str]:
    body = json.dumps({"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200}).encode()
    req = urllib.request.Request(f"{api}/task_runs/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [t["state"]["name"] for t in json.load(r)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("report")
    r.add_argument("--store", required=True)
    r.add_argument("--run", default="latest")
    r.add_argument("--out", default=str(ROOT / "bench" / "results" / "report.png"))
    r.add_argument("--height", type=int, default=6000)
    p = sub.add_parser("prefect-ui")
    p.add_argument("--config", default="configs/demo_baselines.yaml")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefect_cached.png"))
    p.add_argument("--height", type=int, default=1100)
    args = ap.parse_args()
    os.chdir(ROOT)
    {"report": cmd_report, "prefect-ui": cmd_prefect_ui}[args.what](args)


if __name__ == "__main__":
    main()
