"""What the benchmark scripts share: a timed recipe run, the machine it ran on, a table, JSON out.

Import it before irflow: it sets the offline environment and puts this checkout first on sys.path, so
a script measures the irflow beside it. Nothing heavy is imported here (irflow.api only in ``run``).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
DATASETS = (ROOT / ".." / "shared" / "datasets").resolve()
IRFLOW = ROOT / ".venv/bin/irflow"  # the checkout's own command, else the one beside this Python
IRFLOW = IRFLOW if IRFLOW.exists() else Path(sys.executable).with_name("irflow")
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
os.environ.update({k: os.environ.get(k, v) for k, v in ENV.items()})  # defaults: a variable already set wins
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@lru_cache(maxsize=1)
def machine() -> dict:
    """CPU model and the flags that decide precision (AVX2, AVX-512, AVX-512 BF16, AMX), cores, RAM, GPUs
    (nvidia-smi), OS, Python and library versions."""
    info = {k.strip(): v.strip() for f in ("/proc/cpuinfo", "/proc/meminfo") if Path(f).exists()
            for k, _, v in (ln.partition(":") for ln in Path(f).read_text().splitlines()) if v}
    flags = set(info.get("flags", "").split())
    gpus = []
    with suppress(OSError, subprocess.SubprocessError):  # no nvidia-smi: no GPU
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    packages = dict.fromkeys(("torch", "transformers", "sentence-transformers"))
    for p in packages:
        with suppress(PackageNotFoundError):
            packages[p] = version(p)
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "avx2": "avx2" in flags, "avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": "amx_bf16" in flags, "ram_gb": round(int(info.get("MemTotal", "0 kB").split()[0]) / 2**20, 1),
            "gpus": gpus, "platform": platform.platform(), "python": platform.python_version(), **packages}


@dataclass
class Timed:
    """A RunResult (read through: .run_id, .stages, .metrics, .computed, ...), its wall time and load."""

    result: Any
    wall_seconds: float
    load_before: list[float]
    load_after: list[float]

    def __getattr__(self, name: str):
        return getattr(self.result, name)


def timed(call: Callable[[], Any], what: str) -> Timed:
    """Call ``call`` (it returns a RunResult) and time it; logs what it did."""
    log(what)
    before, t0 = loadavg(), time.perf_counter()
    result = call()
    t = Timed(result, time.perf_counter() - t0, before, loadavg())
    log(f"  {t.wall_seconds:.1f} s wall ({result.seconds:.1f} s in the flow), {len(result.stages)} stages, "
        f"{len(result.computed)} computed; load {before[0]} -> {t.load_after[0]}")
    return t


def run(config: str | Path, overrides: list[str] | tuple[str, ...] = (), store: str | Path | None = None,
        force: list[str] | tuple[str, ...] = (), to: list[str] | tuple[str, ...] = ()) -> Timed:
    """``irflow.api.run`` in this process, timed (no Python start-up or imports in the time); ``to``: as
    ``irflow run --to``."""
    from irflow import api

    return timed(lambda: api.run(str(config), overrides=list(overrides), store=store, force=list(force), to=list(to)),
                 f"api.run({str(config)!r}, overrides={list(overrides)}, store={str(store)!r}, force={list(force)}"
                 + (f", to={list(to)})" if to else ")"))


def cli_env() -> dict[str, str]:
    """The environment for an ``irflow`` subprocess: offline, local Prefect (no PREFECT_* of ours), no store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "IRFLOW_STORE"}
    return {**env, **ENV}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from the parent pids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        with suppress(OSError, IndexError):  # a process may end while we read
            children.setdefault(int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
    out = list(children.get(pid, []))
    for c in out:  # breadth first: the list grows while it is walked
        out.extend(children.get(c, []))
    return out


def read_beir(zip_path: str | Path, split: str = "test") -> tuple[list[dict], dict[str, str], dict]:
    """A BEIR zip read with zipfile/json/csv only (no irflow code): the corpus rows in file order,
    {query id: text}, and the qrels of ``split`` as {query id: {doc id: score}}."""
    with zipfile.ZipFile(zip_path) as z:
        def lines(suffix: str) -> list[str]:
            name = min((n for n in z.namelist() if n.endswith(suffix)), key=len)
            return [ln for ln in z.read(name).decode("utf-8").splitlines() if ln.strip()]

        corpus = [json.loads(ln) for ln in lines("corpus.jsonl")]
        queries = {q["_id"]: q["text"] for q in map(json.loads, lines("queries.jsonl"))}
        qrels: dict[str, dict[str, int]] = {}
        for qid, did, score in list(csv.reader(lines(f"qrels/{split}.tsv"), delimiter="\t"))[1:]:  # header
            qrels.setdefault(qid, {})[did] = int(score)
    return corpus, queries, qrels


def table(headers: list[str], rows: list[list]) -> None:
    """Print a markdown table with aligned columns (readable here, pasteable into a README)."""
    cells = [[str(c).replace("|", "\\|").replace("\n", "<br>") for c in [*r, *[""] * (len(headers) - len(r))]]
             for r in [headers, *rows]]
    width = [max(len(r[i]) for r in cells) for i in range(len(headers) - 1)] + [len(cells[0][-1])]  # last: unpadded
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, width)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    print("\n".join(lines), flush=True)


def write_json(path: str | Path, data: dict) -> Path:
    """Write ``data`` (plus ``machine`` unless it has one) to ``path`` atomically: a temp file, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**data, "machine": data.get("machine") or machine()}, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def prior_results(path: str | Path) -> dict:
    """The ``results`` already in a benchmark's JSON (a script adds its runs to them), or {}."""
    path = Path(path)
    return json.loads(path.read_text()).get("results", {}) if path.exists() else {}


def run_log_dir(given: str | None, prefix: str) -> Path:
    """Where each run's stderr goes: ``given``, or a new temporary folder (kept: it is what to read when
    a run fails)."""
    folder = Path(given or tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    log(f"stderr of each run under {folder}")
    return folder


@contextmanager
def data_dir(given: str | None, prefix: str):
    """A folder for generated input data: ``given`` (kept for the next run), or a temporary one removed
    at the end."""
    folder = Path(given) if given else Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    finally:
        if not given:
            shutil.rmtree(folder, ignore_errors=True)
