"""encode_corpus inside a flow run against the same stage function alone: paired, in one process.

    .venv/bin/python bench/inflow.py [--reps 3] [--config configs/demo_baselines.yaml] [--set runtime.backend=onnx]
        [--store DIR] [--out FILE]

A developer saw ``encode_corpus`` inside ``irflow run`` about 1.5x slower than the same stage function
alone. This runs both in one process, on the same inputs, alternating:

- **flow**: the baselines recipe through ``irflow.api.run`` (Prefect's temporary server, ingest, BM25,
  encode_corpus, dense search, evaluation), as ``irflow run`` does; the
  first time cold, then with ``encode_corpus`` forced (``--from encode_corpus``: it and what follows it
  recompute). The stage function is wrapped: its call inside the flow is timed and its arguments kept.
- **alone**: right after, the same stage function with those same arguments (params, the stage's
  runtime, the input refs: same corpus rows, same model), called directly on the main thread, outside
  Prefect, writing nothing.

Per call: wall seconds of the stage function and of ``encode_texts`` inside it, this process's CPU
seconds, the CPU seconds of its child processes (Prefect's server) over the same interval, torch's
intra-op threads, the thread it ran on, whether a JVM is loaded in this process (BM25's Lucene runs in
a spawned child since 7cf7325; before, it ran in this process), the load average. Writes
``bench/results/inflow.json``.

To time an older commit's code with this probe, run it from a checkout of that commit with the
checkout first on ``sys.path`` (the venv's editable install otherwise imports this one's irflow).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import threading
import time
from pathlib import Path

import harness
from harness import ROOT


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's live child processes (Prefect's server...)."""
    total = 0.0
    for pid in harness.descendants(os.getpid()):
        try:  # /proc/PID/stat: utime and stime are fields 14 and 15 (in clock ticks)
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def jvm_running() -> bool:
    """Whether a JVM (Pyserini's) has started in this process: libjvm is mapped into it."""
    return "libjvm.so" in Path("/proc/self/maps").read_text()


class Probe:
    """Wraps the encode_corpus stage's function and irflow.learn.encoding.encode_texts: times each call,
    keeps the stage function's last arguments."""

    def __init__(self):
        import irflow.learn.encoding
        import irflow.stages.dense as dense

        self.stage = dense.encode_corpus
        self.inner_fn = self.stage.fn
        self.inner_encode = irflow.learn.encoding.encode_texts
        self.last_args = None
        self.calls: list[dict] = []
        self.encode_seconds = 0.0
        probe = self

        def timed_encode(*a, **k):
            t0 = time.perf_counter()
            try:
                return probe.inner_encode(*a, **k)
            finally:
                probe.encode_seconds += time.perf_counter() - t0

        # The stage runner finds a shard's function by the stage's module and name (irflow.engine.shards): the
        # wrapper keeps them, so the lookup finds this stage, whose fn is now the wrapper.
        @functools.wraps(self.inner_fn)
        def timed_stage(params, rt, **inputs):
            probe.last_args = (params, rt, inputs)
            return probe.measure(lambda: probe.inner_fn(params, rt, **inputs))

        dense.encode_texts = timed_encode  # the name the stage module calls
        self.stage.fn = timed_stage

    def measure(self, fn) -> object:
        import torch

        self.encode_seconds = 0.0
        load = harness.loadavg()
        c0, k0, t0 = time.process_time(), children_cpu(), time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        self.calls.append({"seconds": round(wall, 2), "encode_texts_seconds": round(self.encode_seconds, 2),
                           "process_cpu_seconds": round(time.process_time() - c0, 2),
                           "children_cpu_seconds": round(children_cpu() - k0, 2),
                           "torch_threads": torch.get_num_threads(), "thread": threading.current_thread().name,
                           "jvm_running": jvm_running(),
                           "load_before": load, "load_after": harness.loadavg()})
        return out

    def alone(self) -> dict:
        from irflow.engine.worker import torch_threads

        params, rt, inputs = self.last_args
        # The stage runner sets torch's threads around the call (irflow.engine.stage); so does this.
        with torch_threads(rt.threads):
            self.measure(lambda: self.inner_fn(params, rt, **inputs))
        return self.calls[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/demo_baselines.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key=value, as irflow run --set")
    ap.add_argument("--reps", type=int, default=3, help="flow/alone pairs")
    ap.add_argument("--store", default=None, help="a store to (re)use (default: a fresh temporary one); one that "
                                                  "holds the run already: every rep forces encode_corpus")
    ap.add_argument("--out", default=str(ROOT / "bench/results/inflow.json"))
    args = ap.parse_args()

    from irflow import api

    probe = Probe()
    rows = []
    with tempfile.TemporaryDirectory(prefix="irflow-inflow-") as tmp:
        store = Path(args.store or Path(tmp) / "store")
        reused = (store / "catalog.duckdb").exists()
        for rep in range(args.reps):
            force = ["encode_corpus"] if rep or reused else []
            harness.log(f"rep {rep}: flow ({'--from encode_corpus' if force else 'cold'})")
            n = len(probe.calls)
            api.run(args.config, overrides=args.overrides, store=store, force=force)
            if len(probe.calls) != n + 1:
                raise SystemExit(f"encode_corpus ran {len(probe.calls) - n} times in the flow (expected once)")
            flow_row = probe.calls[-1]
            harness.log(f"  flow:  {flow_row}")
            alone_row = probe.alone()
            harness.log(f"  alone: {alone_row}")
            rows.append({"rep": rep, "flow": flow_row, "alone": alone_row,
                         "ratio_flow_to_alone": round(flow_row["seconds"] / alone_row["seconds"], 3)})
    params, rt, inputs = probe.last_args
    passages = inputs["corpus"].num_rows()
    print(f"\nencode_corpus, {passages} passages, backend {rt.backend}, {rt.threads} threads, precision {rt.precision}")
    harness.table(["rep", "flow s", "alone s", "flow/alone", "flow encode_texts s", "alone encode_texts s",
                   "flow thread", "Prefect server CPU s (flow)", "JVM"],
                  [[r["rep"], r["flow"]["seconds"], r["alone"]["seconds"], r["ratio_flow_to_alone"],
                    r["flow"]["encode_texts_seconds"], r["alone"]["encode_texts_seconds"], r["flow"]["thread"],
                    r["flow"]["children_cpu_seconds"], r["flow"]["jvm_running"]] for r in rows])
    harness.write_json(Path(args.out), {"config": args.config, "overrides": args.overrides, "passages": passages,
                                        "runtime": rt.provenance(), "machine": harness.machine(),
                                        "pid": os.getpid(), "rows": rows})


if __name__ == "__main__":
    main()
