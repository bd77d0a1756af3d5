"""How often the run's selection picks a trained model that is no better than the start: the null case,
simulated with a real run's own per-query scores.

From a finished run without labels (its proxy's per-query nDCG@10 of the starting model and of a trained
model), k null candidates are made by swapping, held-out document by held-out document, the start's and
the trained model's values at random (under "no real difference" the two are exchangeable, and a
document's queries move together: a sign flip of the paired differences, per document). Each trial asks the selection rule whether to ship a
candidate. Reported per k: the rate of false selection by irflow's rule (per-document units, Holm over
the k candidates, at least MIN_UNITS units) and by the earlier rule (per-query paired t-test of the best
candidate alone, no correction).

    python bench/selection_null.py --store STORE --run RUN_ID [--trained gpl-student] --out bench/results/selection_null.json
"""

from __future__ import annotations

import argparse
import random

import harness  # noqa: F401 -- first: offline environment, this checkout on sys.path

from irflow.engine.catalog import Catalog
from irflow.sources.corpus_sources import document_id
from irflow.decide.selection import select


def per_query(catalog: Catalog, run_id: str, metric: str = "ndcg@10") -> tuple[dict, dict]:
    """(system -> {query: value}, query -> held-out document) of a run's proxy evaluation."""
    values: dict[str, dict[str, float]] = {}
    units: dict[str, str] = {}
    for s in catalog.stage_runs(run_id, with_inputs=True):
        if not s["name"].startswith("evaluate"):
            continue
        t = catalog.ref(s["outputs"]["per_query"]).table()
        for system, q, m, v in zip(*(t.column(c).to_pylist() for c in ("system", "query_id", "metric", "value"))):
            if m == metric:
                values.setdefault(system, {})[q] = v
        r = catalog.ref(s["inputs"]["qrels"][0]).table(columns=["query_id", "doc_id"])
        units.update({q: document_id(d) for q, d in zip(r.column("query_id").to_pylist(), r.column("doc_id").to_pylist())})
    return values, units


def simulate(start: dict, trained: dict, units: dict, k: int, trials: int, seed: int) -> dict:
    rng = random.Random(seed)
    docs = sorted({units[q] for q in start})
    new = old = 0
    for _ in range(trials):
        systems = {"start": start}
        for c in range(k):
            # the real differences, each held-out document's signs flipped at random: no real difference left
            sign = {d: rng.choice((-1.0, 1.0)) for d in docs}
            systems[f"c{c}"] = {q: start[q] + sign[units[q]] * (trained[q] - start[q]) for q in start}
        new += select(systems, "start", "proxy", units=units, unit_name="held-out documents").system != "start"
        best = max((c for c in systems if c != "start"), key=lambda c: sum(systems[c].values()))
        old += select({"start": start, best: systems[best]}, "start", "proxy", min_units=0).system != "start"
    return {"k": k, "trials": trials, "false_selection": new / trials, "false_selection_old_rule": old / trials}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--trained", default="gpl-student")
    ap.add_argument("--start", default=None, help="the starting model's system (default: the run's selection's)")
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    catalog = Catalog(f"{args.store}/catalog.duckdb")
    values, units = per_query(catalog, args.run)
    start_system = args.start or catalog.selection(args.run)["start_system"]
    start, trained = values[start_system], values[args.trained]
    rows = [simulate(start, trained, units, k, args.trials, seed=k) for k in (1, 2, 3, 5)]
    harness.table(["k", "false selection (irflow)", "false selection (old rule)"],
                  [[r["k"], f"{r['false_selection']:.3f}", f"{r['false_selection_old_rule']:.3f}"] for r in rows])
    harness.write_json(args.out, {"store": args.store, "run": args.run, "start": start_system, "trained": args.trained,
                                  "queries": len(start), "documents": len({units[q] for q in start}), "rows": rows,
                                  "machine": harness.machine()})


if __name__ == "__main__":
    main()
