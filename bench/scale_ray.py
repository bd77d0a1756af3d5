"""Scale-out part (a): the same sharded stages in this process and on a local Ray cluster.

    python bench/scale_ray.py [--config configs/demo_baselines.yaml] [--shard-rows 340] [--out bench/results/scale_ray.json]

For each executor -- local (in-process, threads = CPUs), Ray with 1 worker (threads = CPUs), Ray with
2 workers (1 thread each) -- it runs the config cold in a fresh store and reports the whole run's
wall time, and for encode_corpus (MiniLM over the corpus): the stage's wall time, passages per
second, and the per-shard compute seconds the catalog recorded. The Ray rows include starting the
run's own Ray cluster (``ray start`` under the watchdog) and loading the model once per worker.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

CASES = {
    "local": [],
    "ray-1-worker": ["runtime.executor=ray", "runtime.ray.workers=1", "runtime.ray.threads_per_worker=2"],
    "ray-2-workers": ["runtime.executor=ray", "runtime.ray.workers=2", "runtime.ray.threads_per_worker=1"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo_baselines.yaml")
    ap.add_argument("--shard-rows", type=int, default=340, help="runtime.shard_rows (the sample: 1,358 passages)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default="bench/results/scale_ray.json")
    args = ap.parse_args()
    rows, out = [], {"config": args.config, "shard_rows": args.shard_rows, "cases": {}}
    for name in args.cases:
        store = tempfile.mkdtemp(prefix=f"irflow-scale-{name}-")
        t = harness.run(args.config, [f"runtime.shard_rows={args.shard_rows}", *CASES[name]], store=store)
        enc = next(s for s in t.stages if s.name.startswith("encode_corpus"))
        passages = enc.shards[-1]["rows"][1]
        shard_seconds = [s["seconds"] for s in enc.shards]
        case = {"overrides": CASES[name], "wall_seconds": round(t.wall_seconds, 1), "flow_seconds": t.result.seconds,
                "load_before": t.load_before, "load_after": t.load_after,
                "encode_corpus": {"seconds": enc.seconds, "passages": passages,
                                  "passages_per_second": round(passages / enc.seconds, 1),
                                  "shards": len(enc.shards), "shard_seconds": shard_seconds,
                                  "workers": sorted({s["pid"] for s in enc.shards})},
                "metrics": {m["system"]: round(m["ndcg@10"], 4) for m in t.metrics}}
        out["cases"][name] = case
        rows.append([name, f"{t.wall_seconds:.1f}", f"{enc.seconds:.1f}", f"{passages / enc.seconds:.1f}",
                     f"{len(enc.shards)} x {args.shard_rows}", f"{sum(shard_seconds):.1f}",
                     len(case["encode_corpus"]["workers"]), str(case["metrics"])])
    local = out["cases"].get("local")
    if local:
        for name, case in out["cases"].items():
            case["wall_vs_local"] = round(case["wall_seconds"] / local["wall_seconds"], 3)
            case["same_metrics_as_local"] = case["metrics"] == local["metrics"]
    harness.table(["executor", "run wall s", "encode_corpus s", "passages/s", "shards", "sum of shard s",
                   "worker pids", "nDCG@10"], rows)
    print(f"wrote {harness.write_json(args.out, out)}")


if __name__ == "__main__":
    main()
