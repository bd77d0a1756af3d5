"""What do digest checks cost? The GPL demo cold, then fully cached, with the time spent in
`Store.check` (re-hashing objects before they are reused or read) measured inside the run.

    .venv/bin/python bench/verify_cost.py [--config configs/demo.yaml] [--store DIR] [--out JSON]

With an existing --store holding a cold run of the config, the cold run is not repeated: its time is
read from the catalog. Also times `irflow verify` (every object re-hashed) on the same store.
The goal: checks on a fully cached re-run cost <= 5% of the cold run.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import harness


def timed_checks():
    """Wrap Store.check to add up its wall time (calls, seconds, bytes hashed)."""
    import time

    from irflow.engine import store as store_mod

    stats = {"calls": 0, "seconds": 0.0, "hashed_bytes": 0}
    real_check, real_fp = store_mod.Store.check, store_mod.fingerprint_dir

    def check(self, ref, *args, **kwargs):  # as Store.check (maintenance.verify passes rehash=True)
        t0 = time.perf_counter()
        try:
            return real_check(self, ref, *args, **kwargs)
        finally:
            stats["calls"] += 1
            stats["seconds"] += time.perf_counter() - t0

    def fingerprint(path):
        stats["hashed_bytes"] += store_mod.tree_size(path)
        return real_fp(path)

    store_mod.Store.check = check
    store_mod.fingerprint_dir = fingerprint
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--store", help="a store with a cold run of the config already in it (else a fresh one)")
    ap.add_argument("--out", default="bench/results/verify.json")
    args = ap.parse_args()

    from irflow import api

    from irflow.tools import maintenance

    from irflow.engine import store as store_mod  # noqa: F401 -- api first: the checks are wrapped after
    from irflow.engine.catalog import Catalog

    root = args.store or tempfile.mkdtemp(prefix="irflow-verify-")
    cat_path = Path(root) / "catalog.duckdb"
    cold = None
    if cat_path.exists():
        with Catalog(cat_path).connect() as con:
            # the first completed run (a cold run computes nearly everything; a stage may reuse another's output)
            row = con.execute("SELECT run_id, epoch(finished_at - started_at) FROM runs WHERE status = 'completed' "
                              "ORDER BY started_at LIMIT 1").fetchone()
        if row:
            cold = {"run_id": row[0], "seconds": round(row[1], 1), "from": "catalog"}
    stats = timed_checks()
    if cold is None:
        r = harness.run(args.config, store=root)
        cold = {"run_id": r.run_id, "seconds": round(r.wall_seconds, 1), "from": "this script",
                "check_seconds": round(stats["seconds"], 2), "check_calls": stats["calls"]}
    runs = []
    for _ in range(2):
        stats.update(calls=0, seconds=0.0, hashed_bytes=0)
        store_mod._VERIFIED.clear()  # as in a new `irflow run` process: nothing verified yet
        r = harness.run(args.config, store=root)
        assert not r.computed, f"not fully cached: {sorted(r.computed)}"
        runs.append({"run_id": r.run_id, "wall_seconds": round(r.wall_seconds, 2), "stages": len(r.stages),
                     "check_calls": stats["calls"], "check_seconds": round(stats["seconds"], 3),
                     "hashed_mb": round(stats["hashed_bytes"] / 1e6, 1), "load_after": r.load_after})
    rep = maintenance.verify(root)
    m = harness.machine()
    result = {
        "config": args.config, "store": root, "cpu": m["cpu"], "cores": m["cores"], "cold": cold, "cached_runs": runs,
        "check_share_of_cold": round(runs[0]["check_seconds"] / cold["seconds"], 4),
        "check_share_of_cached_run": round(runs[0]["check_seconds"] / runs[0]["wall_seconds"], 4),
        "verify": {"objects": rep.checked, "mb": round(rep.bytes / 1e6, 1), "seconds": rep.seconds,
                   "mb_per_s": round(rep.bytes / 1e6 / rep.seconds, 1) if rep.seconds else None, "ok": rep.ok},
    }
    harness.table(["run", "wall s", "stages", "checks", "check s", "hashed MB"],
                  [["cold", cold["seconds"], "", cold.get("check_calls", ""), cold.get("check_seconds", ""), ""]]
                  + [[f"cached {i + 1}", c["wall_seconds"], c["stages"], c["check_calls"], c["check_seconds"],
                      c["hashed_mb"]] for i, c in enumerate(runs)])
    print(f"\ndigest checks on a fully cached re-run: {runs[0]['check_seconds']:.2f} s for {runs[0]['hashed_mb']} MB "
          f"({runs[0]['check_calls']} checks) = {100 * result['check_share_of_cold']:.2f}% of the cold run "
          f"({cold['seconds']} s); the whole re-run took {runs[0]['wall_seconds']} s; `irflow verify`: "
          f"{rep.checked} objects in {rep.seconds} s")
    print(f"wrote {harness.write_json(args.out, result)}")


if __name__ == "__main__":
    main()
