"""Memory benchmark: peak RSS of the baselines flow, and how it grows with the corpus.

    nice -n 10 .venv/bin/python bench/memory.py [--cases sample,scifact,nfcorpus,scifact-before,nfcorpus-before,
                                                 scifact1x,scifact10x] [--out bench/results/memory.json]
                                                [--interval 0.2] [--reps 10] [--max-seq-length 128]
                                                [--keep-stores] [--timeout SECONDS]

Each case is one cold run of the real command, ``.venv/bin/irflow run CONFIG --store <fresh tmp dir>
--set ...`` (HF_HUB_OFFLINE=1, no PREFECT_API_URL, so PREFECT_HOME is inside the fresh store), as a
subprocess of this script. While it runs, this script samples /proc every ``--interval`` seconds: the
irflow process and every descendant (found through the parent pids in /proc/*/stat): Anserini's Java
indexer (``bm25_index``), Prefect's temporary API server (uvicorn), anything else. Per case it records

- ``main_peak_rss``: the irflow process's VmHWM (the kernel's own high-water mark, read from
  /proc/<pid>/status until the process exits; not limited by the sampling interval). Pyserini's
  search JVM (jnius), torch and faiss all live in this process.
- ``tree_peak_rss``: the largest sum of VmRSS over the whole process tree at one sample.
- ``main_peak_anon`` / ``tree_peak_anon``: the same for RssAnon only (sampled), i.e. without
  file-backed pages (mmap'ed Lucene index files, model weights, libraries), which the kernel can
  drop under memory pressure.
- ``java_peak_rss`` / ``prefect_server_peak_rss``: the children's own VmHWM (the largest over the
  Java indexer processes, one per index variant).
- ``wall_seconds``, ``num_docs`` (rows of the stored corpus, from the catalog), ``embeddings_bytes``
  (N x 384 x 4: the float32 MiniLM embeddings) and ``tree_peak_minus_embeddings``.
- ``stages``: per stage (from irflow's "<stage>: computing" log lines on stderr), its seconds and the
  largest main (VmRSS, RssAnon) / tree / Java RSS sampled from its start to the next stage's start; ``tree_peak_stage``
  says in which stage the tree peak fell.

Cases:
- ``sample``: configs/demo_baselines.yaml (the bundled SciFact sample).
- ``rocketqa-sample``: configs/rocketqa_demo.yaml (RocketQA on the sample: trainers, teachers, torchrun-free).
- ``scifact``, ``nfcorpus``: configs/baselines_<ds>.yaml as they are (runtime.jvm_heap: default 2g).
- ``scifact-before``, ``nfcorpus-before``: the same with ``--set runtime.jvm_heap=6g``: what both JVMs
  (the in-process one that searches, and the indexer) get without -Xmx, the JVM's default maximum
  heap, a quarter of physical RAM = 6 GB on this 24 GB machine.
- ``scifact1x``, ``scifact10x``: SciFact written out as a BEIR folder in a temp dir with its corpus
  repeated ``1`` / ``--reps`` times (copy 0 keeps the original ids, copy k gets ``<id>__r<k>``; same
  queries and qrels), run as ``configs/baselines_scifact.yaml --set dataset.source=<dir> --set
  dataset.name=scifact<R>x --set dataset.md5=null --set dense.max_seq_length=<L>`` (the same L on
  both sides; MiniLM at full length would take 30+ minutes for 10x on 2 cores). A folder source is
  keyed by a hash of its files, so the zip's md5 does not apply (and is set to null).

Growth (``summary.growth``): (tree peak - embeddings) at 10x over the same at 1x; the goal is <= 1.3.

Results merge into ``--out`` (a case run again replaces its entry), so cases can be run piecemeal.
Run it under ``nice``: the 10x case alone takes about half an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import harness
from harness import ROOT, log

DIM = 384  # all-MiniLM-L6-v2
GROWTH_TARGET = 1.3
BEFORE_HEAP = "6g"  # the JVM's default max heap here: a quarter of 24 GB

CASES = ("sample", "scifact", "nfcorpus", "scifact-before", "nfcorpus-before", "scifact1x", "scifact10x",
         "rocketqa-sample")
STAGE_LINE = re.compile(r"(?P<stage>[A-Za-z0-9_]+(?:\[[^\]]*\])?): (?P<what>computing|cached)\b")


# ---------------------------------------------------------------------------------------------
# /proc
# ---------------------------------------------------------------------------------------------
def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile of a process in bytes (empty if it is gone). RssFile is
    file-backed pages (mmap'ed Lucene index files, model weights, shared libraries): page cache the
    kernel can drop under pressure; RssAnon is memory the process allocated."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def kind_of(cmdline: str) -> str:
    if "java" in cmdline.split(" ", 1)[0] or "io.anserini" in cmdline:
        return "java"
    if "prefect" in cmdline and ("uvicorn" in cmdline or "server" in cmdline):
        return "prefect_server"
    return "other"


class Sampler(threading.Thread):
    """Samples the RSS of ``pid`` and its descendants every ``interval`` seconds until stopped."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stop = threading.Event()
        self.procs: dict[int, dict] = {}  # pid -> {kind, cmd, hwm, peak_rss}
        self.main_hwm = 0
        self.tree_peak = 0
        self.tree_peak_t = 0.0
        self.samples = 0
        self.main_anon_peak = 0
        self.tree_anon_peak = 0
        self.lock = threading.Lock()
        self.stage = "(start-up)"
        self.stage_peaks: dict[str, dict] = {}
        self.tree_peak_stage = None
        self.t0 = time.perf_counter()

    def set_stage(self, name: str) -> None:
        with self.lock:
            self.stage = name
            self.stage_peaks.setdefault(name, {"start_s": round(time.perf_counter() - self.t0, 1), "main_rss": 0,
                                               "main_anon": 0, "tree_rss": 0, "java_rss": 0})

    def sample(self) -> None:
        with self.lock:
            self._sample()

    def _sample(self) -> None:
        st = _status(self.pid)
        if not st:
            return
        self.main_hwm = max(self.main_hwm, st.get("VmHWM", 0))
        main, main_anon = st.get("VmRSS", 0), st.get("RssAnon", 0)
        tree, tree_anon, java = main, main_anon, 0
        for c in harness.descendants(self.pid):
            cs = _status(c)
            if not cs:
                continue
            info = self.procs.get(c)
            if info is None or not info["cmd"]:  # read again: a child sampled between fork and exec has none
                cmd = _cmdline(c)
                info = self.procs[c] = {"kind": kind_of(cmd), "cmd": cmd[:160], "hwm": 0, "peak_rss": 0,
                                        **({k: info[k] for k in ("hwm", "peak_rss")} if info else {})}
            info["hwm"] = max(info["hwm"], cs.get("VmHWM", 0))
            info["peak_rss"] = max(info["peak_rss"], cs.get("VmRSS", 0))
            tree += cs.get("VmRSS", 0)
            tree_anon += cs.get("RssAnon", 0)
            if info["kind"] == "java":
                java += cs.get("VmRSS", 0)
        self.samples += 1
        self.main_anon_peak = max(self.main_anon_peak, main_anon)
        self.tree_anon_peak = max(self.tree_anon_peak, tree_anon)
        if tree > self.tree_peak:
            self.tree_peak, self.tree_peak_t, self.tree_peak_stage = tree, time.perf_counter() - self.t0, self.stage
        sp = self.stage_peaks.setdefault(self.stage, {"start_s": 0.0, "main_rss": 0, "main_anon": 0, "tree_rss": 0,
                                                      "java_rss": 0})
        sp["main_rss"] = max(sp["main_rss"], main)
        sp["main_anon"] = max(sp["main_anon"], main_anon)
        sp["tree_rss"] = max(sp["tree_rss"], tree)
        sp["java_rss"] = max(sp["java_rss"], java)

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval)

    def peak_of(self, kind: str) -> int:
        return max((max(p["hwm"], p["peak_rss"]) for p in self.procs.values() if p["kind"] == kind), default=0)


# ---------------------------------------------------------------------------------------------
# one case: irflow run as a subprocess, sampled
# ---------------------------------------------------------------------------------------------
def run_case(name: str, config: str, sets: list[str], *, interval: float, keep_store: bool, timeout: float | None,
             log_dir: Path) -> dict:
    store = Path(tempfile.mkdtemp(prefix=f"irflow-mem-{name}-"))
    cmd = [str(harness.IRFLOW), "run", config, "--store", str(store)]
    for s in sets:
        cmd += ["--set", s]
    log(f"[{name}] $ {' '.join(cmd)}")
    stderr_path = log_dir / f"{name}.stderr.log"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=harness.cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    sampler = Sampler(proc.pid, interval)
    sampler.t0 = t0
    sampler.start()
    stdout_lines: list[str] = []

    def read_stderr():
        with open(stderr_path, "w", buffering=1) as f:  # line-buffered: the log can be followed while it runs
            for line in proc.stderr:
                f.write(line)
                m = STAGE_LINE.search(line)
                if m and m.group("what") == "computing":
                    sampler.sample()  # the previous stage's last state
                    sampler.set_stage(m.group("stage"))

    def read_stdout():
        for line in proc.stdout:
            stdout_lines.append(line)

    readers = [threading.Thread(target=read_stderr, daemon=True), threading.Thread(target=read_stdout, daemon=True)]
    for r in readers:
        r.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    for r in readers:
        r.join(timeout=10)
    out = {
        "case": name, "config": config, "sets": sets, "command": " ".join(cmd[1:]), "returncode": rc,
        "wall_seconds": round(wall, 1), "samples": sampler.samples, "interval_s": interval,
        "main_peak_rss": sampler.main_hwm, "tree_peak_rss": sampler.tree_peak,
        "tree_peak_at_s": round(sampler.tree_peak_t, 1), "tree_peak_stage": sampler.tree_peak_stage,
        "main_peak_anon": sampler.main_anon_peak, "tree_peak_anon": sampler.tree_anon_peak,
        "java_peak_rss": sampler.peak_of("java"), "prefect_server_peak_rss": sampler.peak_of("prefect_server"),
        "other_children_peak_rss": sampler.peak_of("other"),
        "children": [{"kind": p["kind"], "hwm": p["hwm"], "peak_rss": p["peak_rss"], "cmd": p["cmd"]}
                     for p in sampler.procs.values() if max(p["hwm"], p["peak_rss"]) > 20 << 20],
        "stderr_log": str(stderr_path),
    }
    if rc != 0:
        err = stderr_path.read_text(errors="replace")
        out["error"] = [l for l in err.splitlines() if "error" in l.lower()][-5:] or err.splitlines()[-10:]
        log(f"[{name}] FAILED rc={rc}: {out['error']}")
    else:
        out.update(from_catalog(store))
        stage_secs = {s["name"]: s["seconds"] for s in out.pop("stage_runs", [])}
        out["stages"] = {k: {**v, "seconds": stage_secs.get(k)} for k, v in sampler.stage_peaks.items()}
        n = out.get("num_docs") or 0
        out["embeddings_bytes"] = n * DIM * 4
        out["tree_peak_minus_embeddings"] = out["tree_peak_rss"] - out["embeddings_bytes"]
        out["main_peak_minus_embeddings"] = out["main_peak_rss"] - out["embeddings_bytes"]
    out["store"] = str(store) if keep_store else None
    if not keep_store:
        shutil.rmtree(store, ignore_errors=True)
        if store.exists():  # published objects are read-only
            subprocess.run(["chmod", "-R", "u+w", str(store)], check=False)
            shutil.rmtree(store, ignore_errors=True)
    log(f"[{name}] rc={rc} {wall:.0f}s main {gb(out['main_peak_rss'])} tree {gb(out['tree_peak_rss'])} "
        f"java {gb(out['java_peak_rss'])} (tree peak in {out['tree_peak_stage']})")
    return out


def from_catalog(store: Path) -> dict:
    """Docs, stage runs and nDCG@10 of the (only) run in a fresh store, read in this process."""
    from irflow.engine.catalog import Catalog

    cat = Catalog(store / "catalog.duckdb")
    con = cat.connect_with_views()
    try:
        run_id = con.execute("select run_id from runs order by started_at desc limit 1").fetchone()[0]
        n = con.execute("select num_rows from datasets where stage = 'ingest' and name = 'corpus' "
                        "order by created_at desc limit 1").fetchone()
        ndcg = dict(con.execute("select system, value from metrics where run_id = ? and metric = 'ndcg@10'",
                                [run_id]).fetchall())
    finally:
        con.close()
    stage_runs = cat.stage_runs(run_id)
    return {"run_id": run_id, "num_docs": int(n[0]) if n else None, "ndcg@10": ndcg, "stage_runs": stage_runs,
            "computed": sum(s["status"] == "computed" for s in stage_runs)}


# ---------------------------------------------------------------------------------------------
# the synthesised corpus
# ---------------------------------------------------------------------------------------------
def write_repeated_scifact(reps: int, parent: Path) -> Path:
    """SciFact as a BEIR folder, corpus repeated ``reps`` times (copy k > 0 under ``<id>__r<k>``)."""
    out = parent / f"scifact{reps}x"
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(harness.DATASETS / "scifact.zip") as z:
        corpus = [line for line in z.read("scifact/corpus.jsonl").decode("utf-8").splitlines() if line.strip()]
        with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
            for k in range(reps):
                for line in corpus:
                    d = json.loads(line)
                    if k:
                        d["_id"] = f"{d['_id']}__r{k}"
                    f.write(json.dumps(d, ensure_ascii=False) + "\n")
        (out / "queries.jsonl").write_bytes(z.read("scifact/queries.jsonl"))
        for split in ("test", "train"):
            (out / "qrels" / f"{split}.tsv").write_bytes(z.read(f"scifact/qrels/{split}.tsv"))
    log(f"wrote {out}: {len(corpus) * reps} passages")
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def gb(b) -> str:
    return "-" if not b else f"{b / 1e9:.2f} GB"


def mb(b) -> str:
    return "-" if b is None else f"{b / 1e6:,.0f}"


def summarise(results: dict) -> dict:
    s: dict = {}
    one, ten = results.get("scifact1x"), results.get("scifact10x")
    if one and ten and one.get("returncode") == 0 and ten.get("returncode") == 0:
        a, b = one["tree_peak_minus_embeddings"], ten["tree_peak_minus_embeddings"]
        am, bm = one["main_peak_minus_embeddings"], ten["main_peak_minus_embeddings"]
        s["growth"] = {
            "tree_minus_embeddings_1x": a, "tree_minus_embeddings_10x": b, "ratio": round(b / a, 3),
            "main_minus_embeddings_1x": am, "main_minus_embeddings_10x": bm, "main_ratio": round(bm / am, 3),
            "tree_peak_ratio": round(ten["tree_peak_rss"] / one["tree_peak_rss"], 3),
            "tree_anon_minus_embeddings_ratio": round((ten["tree_peak_anon"] - ten["embeddings_bytes"])
                                                      / (one["tree_peak_anon"] - one["embeddings_bytes"]), 3),
            "target": GROWTH_TARGET, "meets_target": b / a <= GROWTH_TARGET,
            "reps": ten.get("reps"), "docs": [one.get("num_docs"), ten.get("num_docs")]}
    for ds in ("scifact", "nfcorpus"):
        after, before = results.get(ds), results.get(f"{ds}-before")
        if after and before and after.get("returncode") == 0 and before.get("returncode") == 0:
            s[f"{ds}_before_after"] = {
                "tree_peak_before": before["tree_peak_rss"], "tree_peak_after": after["tree_peak_rss"],
                "tree_peak_ratio_after_before": round(after["tree_peak_rss"] / before["tree_peak_rss"], 3),
                "main_peak_before": before["main_peak_rss"], "main_peak_after": after["main_peak_rss"],
                "java_peak_before": before["java_peak_rss"], "java_peak_after": after["java_peak_rss"]}
    return s


def table(results: dict) -> None:
    rows = []
    for name in CASES + tuple(k for k in results if k not in CASES):
        r = results.get(name)
        if not r:
            continue
        if r.get("returncode") != 0:
            rows.append([name, f"failed rc={r.get('returncode')}: {' / '.join(r.get('error', []))[:200]}"])
            continue
        heap = next((s.split("=", 1)[1] for s in r["sets"] if s.startswith("runtime.jvm_heap=")), "2g (default)")
        rows.append([name, heap, f"{r['num_docs']:,}", f"{r['wall_seconds']:.0f}", mb(r["main_peak_rss"]),
                     mb(r["tree_peak_rss"]), mb(r.get("tree_peak_anon")), mb(r["java_peak_rss"]),
                     mb(r["prefect_server_peak_rss"]), mb(r["embeddings_bytes"]), mb(r["tree_peak_minus_embeddings"]),
                     r["tree_peak_stage"]])
    harness.table(["case", "jvm_heap", "docs", "wall s", "main peak MB", "tree peak MB", "tree anon MB",
                   "java peak MB", "prefect srv MB", "embeddings MB", "tree − emb MB", "tree peak in"], rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between /proc samples")
    ap.add_argument("--reps", type=int, default=10, help="corpus repetitions of the scifact10x case")
    ap.add_argument("--max-seq-length", type=int, default=128,
                    help="dense.max_seq_length of the scifact1x/10x pair (0: the model's own)")
    ap.add_argument("--keep-stores", action="store_true")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per case (default: none)")
    ap.add_argument("--log-dir", default=None, help="where each case's stderr goes (default: a temp dir)")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(CASES)}")
    os.chdir(ROOT)
    out_path = Path(args.out)
    results = harness.prior_results(out_path)
    log_dir = harness.run_log_dir(args.log_dir, "irflow-mem-logs-")
    with harness.data_dir(None, "irflow-mem-data-") as synth:
        for name in cases:
            sets: list[str] = []
            extra = {}
            if name == "sample":
                config = "configs/demo_baselines.yaml"
            elif name == "rocketqa-sample":  # where a training recipe's peak falls, stage by stage
                config = "configs/rocketqa_demo.yaml"
            elif name in ("scifact", "nfcorpus", "scifact-before", "nfcorpus-before"):
                config = f"configs/baselines_{name.split('-')[0]}.yaml"
                if name.endswith("-before"):
                    sets.append(f"runtime.jvm_heap={BEFORE_HEAP}")
            else:
                reps = 1 if name == "scifact1x" else args.reps
                folder = write_repeated_scifact(reps, synth)
                config = "configs/baselines_scifact.yaml"
                sets += [f"dataset.source={folder}", f"dataset.name=scifact{reps}x", "dataset.md5=null"]
                if args.max_seq_length:
                    sets.append(f"dense.max_seq_length={args.max_seq_length}")
                extra = {"reps": reps}
            load0 = harness.loadavg()
            r = run_case(name, config, sets, interval=args.interval, keep_store=args.keep_stores,
                         timeout=args.timeout, log_dir=log_dir)
            r.update(extra, loadavg_start=load0, loadavg_end=harness.loadavg(),
                     finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
            results[name] = r
            data = {
                "description": "peak RSS of cold `irflow run` flows (baselines; rocketqa-sample: the RocketQA demo) "
                               "(bench/memory.py); bytes",
                "environment": {"python": platform.python_version(), "machine": platform.machine(),
                                "cpus": os.cpu_count(),
                                "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                                "before_emulation": f"runtime.jvm_heap={BEFORE_HEAP} (the JVM default, 1/4 of RAM)"},
                "results": results, "summary": summarise(results)}
            harness.write_json(out_path, data)
    table(results)
    g = summarise(results).get("growth")
    if g:
        print(f"\ngrowth 1x -> {g['reps']}x of (tree peak - embeddings): {g['ratio']:.2f} "
              f"({'meets' if g['meets_target'] else 'misses'} <= {GROWTH_TARGET}); main process: {g['main_ratio']:.2f}; "
              f"anonymous memory only: {g['tree_anon_minus_embeddings_ratio']:.2f}")
    print(f"\nwrote {out_path}")
    return 0 if all(results[c].get("returncode") == 0 for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
