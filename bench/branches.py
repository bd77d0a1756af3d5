"""Independent branches at once (executor ray): the same cold run with runtime.ray.concurrent_stages 1 and 4.

    python bench/branches.py [--config configs/demo_baselines.yaml] [--repeats 1] [--out bench/results/branches.json]

Each case runs the config cold, in a fresh store, on the run's own local Ray cluster (2 workers, 1
thread each, encode_corpus in shards of ``--shard-rows``), cases alternating when repeated. It reports
the run's wall time, the flow's time, how much of the flow's time had two or more stages running
(from the catalog's stage runs: started + seconds), each stage's span, and whether the datasets and
the metrics are those of the first case. The Ray cluster's start is in every case's time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

RAY = ["runtime.executor=ray", "runtime.ray.workers=2", "runtime.ray.threads_per_worker=1"]


def spans(result) -> dict[str, tuple[datetime, datetime]]:
    out = {}
    for s in result.stages:
        if s.started:
            start = datetime.fromisoformat(s.started)
            out[s.name] = (start, start + timedelta(seconds=s.seconds))
    return out


def overlapped_seconds(intervals: list[tuple[datetime, datetime]]) -> float:
    """Seconds during which at least two of the intervals were open."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    total, open_, last = 0.0, 0, None
    for t, step in events:
        if open_ >= 2 and last is not None:
            total += (t - last).total_seconds()
        open_ += step
        last = t
    return total


def ids(result) -> dict:
    # Lucene's index files differ from build to build (tests/test_ray.py); everything after agrees
    return {s.name: s.outputs for s in result.stages if not s.name.startswith("bm25_index")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo_baselines.yaml")
    ap.add_argument("--shard-rows", type=int, default=340, help="runtime.shard_rows (the sample: 1,358 passages)")
    ap.add_argument("--concurrent", type=int, nargs="+", default=[1, 4], help="runtime.ray.concurrent_stages")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="bench/results/branches.json")
    args = ap.parse_args()
    out = {"config": args.config, "shard_rows": args.shard_rows, "ray": RAY, "runs": []}
    rows, first = [], None
    for rep in range(args.repeats):
        for n in args.concurrent:
            store = tempfile.mkdtemp(prefix=f"irflow-branches-{n}-")
            sets = [*RAY, f"runtime.shard_rows={args.shard_rows}", f"runtime.ray.concurrent_stages={n}"]
            t = harness.run(args.config, sets, store=store)
            ran = spans(t.result)
            both = overlapped_seconds(list(ran.values()))
            first = first or t.result
            case = {"concurrent_stages": n, "repeat": rep, "wall_seconds": round(t.wall_seconds, 1),
                    "flow_seconds": t.result.seconds, "seconds_with_2_or_more_stages_running": round(both, 1),
                    "sum_of_stage_seconds": round(sum(s.seconds for s in t.result.stages), 1),
                    "load_before": t.load_before, "load_after": t.load_after,
                    "stages": {k: {"start_s": round((a - min(x for x, _ in ran.values())).total_seconds(), 1),
                                   "seconds": round((b - a).total_seconds(), 1)} for k, (a, b) in ran.items()},
                    "metrics": {m["system"]: round(m["ndcg@10"], 4) for m in t.metrics},
                    "same_ids_as_first": ids(t.result) == ids(first),
                    "same_metrics_as_first": t.metrics == first.metrics}
            out["runs"].append(case)
            rows.append([n, rep, f"{t.wall_seconds:.1f}", f"{t.result.seconds:.1f}", f"{both:.1f}",
                         f"{case['sum_of_stage_seconds']:.1f}", f"{t.load_before[0]} -> {t.load_after[0]}",
                         case["same_ids_as_first"] and case["same_metrics_as_first"]])
    harness.table(["concurrent_stages", "repeat", "run wall s", "flow s", "s with >= 2 stages running",
                   "sum of stage s", "load (1 min)", "same ids + metrics"], rows)
    print(f"wrote {harness.write_json(args.out, out)}")


if __name__ == "__main__":
    main()
