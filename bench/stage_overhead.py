"""What a run costs besides its models' work: GPL on a small real slice with tiny local models, cold.

    .venv/bin/python bench/stage_overhead.py [--reps 3] [--out bench/results/stage_overhead.json]

The slice (SciFact, 8 test queries, 48 passages) and the tiny T5 / bi-encoder / cross-encoder are the
test suite's GPL sample (``irflow.dev.testing.gpl_sample_config``): every stage of the recipe runs, each on
seconds' worth of model work, so what is left is what every stage of every run pays: Prefect's task, the
catalog, contract checks, Parquet, BM25's child process, the garbage collector. Each rep is a cold run in a new
store through ``irflow.api.run`` (Prefect's temporary server, as ``irflow run``), one after another in
one process; then ``--cached-reps`` re-runs of the last store, which find every stage cached (what a
re-run with nothing changed pays). Prints and writes: wall and flow seconds per rep, per stage its median
seconds, and the cached re-runs' wall seconds.

Results are kept per commit (``git rev-parse --short HEAD`` of this checkout): to time an older commit, run
this file from a checkout of it with that checkout first on ``sys.path`` (``PYTHONPATH=<checkout>``; the
venv's editable install otherwise imports this one's irflow).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import harness
from harness import DATASETS, ROOT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cached-reps", type=int, default=3, help="re-runs of the last store, every stage cached")
    ap.add_argument("--out", default=str(ROOT / "bench/results/stage_overhead.json"))
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    import irflow
    from irflow.dev.testing import gpl_sample_config

    harness.log(f"commit {commit}, irflow from {Path(irflow.__file__).parent}")
    with tempfile.TemporaryDirectory(prefix="stage-overhead-") as tmp:
        config = gpl_sample_config(Path(tmp), DATASETS / "scifact.zip")
        reps = []
        for i in range(args.reps):
            t = harness.run(config, store=Path(tmp) / f"store-{i}")
            assert t.status == "completed" and t.computed, t.status
            reps.append({"wall_seconds": round(t.wall_seconds, 2), "flow_seconds": t.seconds,
                         "stages_computed": len(t.computed), "load_before": t.load_before,
                         "stages": {s.name: s.seconds for s in t.stages}})
        cached = []
        for _ in range(args.cached_reps):
            t = harness.run(config, store=Path(tmp) / f"store-{args.reps - 1}")
            assert t.status == "completed" and not t.computed, (t.status, t.computed)
            cached.append({"wall_seconds": round(t.wall_seconds, 2), "flow_seconds": t.seconds,
                           "stages_cached": len(t.stages), "load_before": t.load_before})
    names = list(reps[0]["stages"])
    per_stage = {n: round(statistics.median(r["stages"][n] for r in reps), 3) for n in names}
    summary = {"reps": args.reps, "wall_seconds_median": round(statistics.median(r["wall_seconds"] for r in reps), 2),
               "flow_seconds_median": round(statistics.median(r["flow_seconds"] for r in reps), 2),
               "stage_seconds_median": per_stage, "runs": reps, "irflow": str(Path(irflow.__file__).parent),
               "cached_wall_seconds_median": round(statistics.median(r["wall_seconds"] for r in cached), 2)
               if cached else None, "cached_runs": cached}
    harness.table(["stage", "median s"], [[n, f"{s:.2f}"] for n, s in per_stage.items()])
    print(f"commit {commit}: wall {[r['wall_seconds'] for r in reps]} s, in the flow "
          f"{[r['flow_seconds'] for r in reps]} s; cached re-runs {[r['wall_seconds'] for r in cached]} s")
    results = harness.prior_results(args.out)
    results[commit] = summary
    harness.write_json(args.out, {"results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
