"""GPL benchmark: the offline recipe on whole BEIR datasets, plus partial re-execution cases.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/gpl.py [--datasets scifact,nfcorpus] [--store DIR]
                                                   [--out bench/results/gpl.json] [--skip-partial]

Every run goes through the Python API, in this process:
``irflow.api.run(config, overrides=[...], store=..., force=[...]) -> RunResult``.

1. For each dataset, ``configs/gpl_<ds>_offline.yaml`` in a fresh store unless --store:
   nDCG@10 / R@100 of BM25, zero-shot MiniLM, hybrid, QGen-style MNRL student and the GPL student side
   by side, per-stage wall time (``Catalog.stage_runs``, with each stage's first output's row count
   from the catalog), and derived throughput (training examples/s, labelled pairs/s).
2. Partial re-execution on the bundled sample (configs/demo.yaml with short training): the stage lists
   (``RunResult.computed`` / ``.cached``) after changing train.*, the teacher, the generator, and with
   ``force=["pseudo_label"]`` (the CLI's ``--from pseudo_label``).
Prints a table and writes JSON. ``wall_seconds`` is the ``api.run`` call (no Python start-up or
imports: bench/baselines.py measures whole processes). Wall times are on whatever else the machine is
doing: see ``load_before`` / ``load_after``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import harness
from harness import ROOT

ZERO_SHOT_REFERENCE = {"scifact": 0.6451, "nfcorpus": 0.3159}  # task statement / notes (MiniLM zero-shot)


def irflow_run(config: str, store: str, *sets: str, force: tuple[str, ...] = ()) -> dict:
    """``api.run`` in this process; the RunResult as a dict (``to_dict``) plus ``wall_seconds``."""
    r = harness.run(config, sets, store, force)
    return {**r.to_dict(), "wall_seconds": round(r.wall_seconds, 1)}


def stage_rows(store: str, run_id: str) -> list[dict]:
    """Per-stage status, seconds, and the row count / params of its (first) output, from the catalog."""
    from irflow.engine.catalog import Catalog

    catalog = Catalog(Path(store) / "catalog.duckdb")
    rows = []
    for s in catalog.stage_runs(run_id):
        first = catalog.dataset(next(iter(s["outputs"].values()))) if s["outputs"] else None
        params = json.loads(first["params"] or "{}") if first else {}
        row = {"stage": s["name"], "status": s["status"], "seconds": s["seconds"],
               "num_rows": first and first["num_rows"], "params": params}
        if first and first["kind"] == "model":  # a trained student: its steps as trained (steps may be null)
            info = Path(first["path"]) / "irflow_training.json"
            if info.exists():
                row["trained_steps"] = json.loads(info.read_text()).get("steps")
        if s.get("runtime"):
            row["runtime"] = {k: s["runtime"].get(k) for k in ("device", "precision", "threads")}
        rows.append(row)
    return rows


def bench_dataset(ds: str, store: str) -> dict:
    harness.log(f"== GPL offline on whole {ds} (store {store})")
    result = irflow_run(f"configs/gpl_{ds}_offline.yaml", store)
    stages = stage_rows(store, result["run_id"])
    by_name = {s["stage"]: s for s in stages}
    derived = {}
    for stage, key in (("train_student[gpl]", "gpl"), ("train_student[qgen]", "qgen")):
        s = by_name.get(stage)
        steps = s and (s.get("trained_steps") or s["params"].get("steps"))
        if s and s["status"] == "computed" and steps:
            batch = s["params"]["batch_size"]
            derived[f"{key}_training_examples_per_s"] = round(steps * batch / s["seconds"], 2)
            derived[f"{key}_seconds_per_step"] = round(s["seconds"] / steps, 2)
    pl = by_name.get("label_scores")  # the teacher's scoring (pseudo_label then only scales)
    if pl and pl["num_rows"] and pl["status"] == "computed":
        derived["teacher_pairs_scored_per_s"] = round(2 * pl["num_rows"] / pl["seconds"], 1)
    metrics = {m["system"]: m for m in result["metrics"]}
    gpl, zs = metrics.get("gpl-student", {}), metrics.get("dense-all-MiniLM-L6-v2", {})
    return {
        "run_id": result["run_id"], "wall_seconds": result["wall_seconds"], "flow_seconds": result["seconds"],
        "metrics": result["metrics"],
        "stages": [{k: v for k, v in st.items() if k != "params"} for st in stages], "derived": derived,
        "gpl_beats_zero_shot": bool(gpl and zs and gpl["ndcg@10"] > zs["ndcg@10"]),
        "zero_shot_reference_ndcg@10": ZERO_SHOT_REFERENCE.get(ds),
    }


def partial_reexecution(store: str) -> dict:
    """The demo DAG on the bundled sample with short training, and the stage lists of each change."""
    base = ("train.steps=4", "train.qgen.steps=3", "train.checkpoint_every=2")
    cases = {}

    def record(name, res):
        cases[name] = {"computed": [s["name"] for s in res["stages"] if s["status"] == "computed"],
                       "cached": [s["name"] for s in res["stages"] if s["status"] == "cached"],
                       "wall_seconds": res["wall_seconds"], "run_id": res["run_id"]}
        harness.log(f"  {name}: computed {cases[name]['computed']}")

    harness.log("== partial re-execution (configs/demo.yaml, short training)")
    record("cold", irflow_run("configs/demo.yaml", store, *base))
    record("same again", irflow_run("configs/demo.yaml", store, *base))
    record("train.lr changed", irflow_run("configs/demo.yaml", store, *base, "train.lr=3.0e-5"))
    record("teacher changed (weights)", irflow_run("configs/demo.yaml", store, *base,
                                                   "teacher.weights={bm25: 0.5, minilm: 0.5}"))
    # the whole section: `generate.source=ict` alone keeps demo.yaml's `generate.split`, which ICT does not have
    record("generator changed (source: ict)", irflow_run("configs/demo.yaml", store, *base,
                                                         "generate={source: ict}"))
    record("--from pseudo_label", irflow_run("configs/demo.yaml", store, *base, force=("pseudo_label",)))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="scifact,nfcorpus", help="comma-separated; empty: none")
    ap.add_argument("--store", help="store dir (default: a fresh temp dir per dataset)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpl.json"))
    ap.add_argument("--skip-partial", action="store_true")
    args = ap.parse_args()
    args.out = str(Path(args.out).resolve())
    args.store = args.store and str(Path(args.store).resolve())
    # configs name their dataset sources relative to the repository root (irflow resolves them against the cwd)
    os.chdir(ROOT)

    m = harness.machine()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": m["cores"], "python": m["python"],
              "torch": m["torch"], "load_before": harness.loadavg(), "datasets": {}}
    for ds in [d for d in args.datasets.split(",") if d]:
        store = args.store or tempfile.mkdtemp(prefix=f"irflow-gpl-{ds}-")
        report["datasets"][ds] = bench_dataset(ds, store)
        harness.write_json(args.out, report)
    if not args.skip_partial:
        report["partial_reexecution"] = partial_reexecution(args.store or tempfile.mkdtemp(prefix="irflow-gpl-demo-"))
    report["load_after"] = harness.loadavg()
    harness.write_json(args.out, report)

    for ds, r in report["datasets"].items():
        print(f"\n{ds}: nDCG@10 / R@100 on the test split (run {r['run_id']}, {r['wall_seconds']} s); GPL student "
              f"beats zero-shot: {r['gpl_beats_zero_shot']}; derived: {r['derived']}")
        harness.table(["system", "nDCG@10", "R@100"],
                      [[m["system"], f"{m['ndcg@10']:.4f}", f"{m['recall@100']:.4f}"] for m in r["metrics"]])
    if report.get("partial_reexecution"):
        print("\npartial re-execution (configs/demo.yaml)")
        harness.table(["change", "computed", "cached", "wall s"],
                      [[name, len(c["computed"]), len(c["cached"]), c["wall_seconds"]]
                       for name, c in report["partial_reexecution"].items()])
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
