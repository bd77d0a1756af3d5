"""When a run keeps its start, it says which real gain it could have missed: is that figure right?

The selection (``irflow.decide.selection``) keeps the starting model unless a trained one beats it beyond
noise, and then says "with N units, a real gain of about G or more is found 4 times in 5" (``detectable_gain``: the
paired t-test's power formula, at Holm's first step over the run's trained models). This bench checks G on
the per-query scores ``bench/proxy_agreement.py`` stored (SciFact and NFCorpus as unlabelled documents, every
run's models on every proxy): per run and proxy, the run's candidates are made again from the run's own
per-query differences, centred, each candidate's signs flipped at random per unit (no real difference left), and one
of them shifted by a known gain; the rule is asked to select. Reported: G as the run would print it, and how
often the shifted candidate is selected at G / 2, G and 2 G (the figure is right when that is about 80% at G).

    python bench/selection_power.py bench/results/proxy_agreement_scifact_more.json \\
        bench/results/proxy_agreement_nfcorpus_more.json --out bench/results/selection_power.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import harness  # noqa: F401 -- first: offline environment, this checkout on sys.path

from irflow.decide.selection import select
from proxy_agreement import run_candidates, stored_units

PROXIES = ("ict", "log-teacher")  # the default, and the one that ranks models as the qrels do


def power(start: dict, best: dict, k: int, units: dict, gain: float, trials: int, rng: random.Random) -> float:
    """How often the rule selects the candidate with a real gain of ``gain``, among k made from the best
    trained model's differences (centred on their mean and their signs flipped per unit: their real difference
    removed, their spread kept)."""
    docs = sorted({units[q] for q in start})
    mean = sum(best[q] - start[q] for q in start) / len(start)
    unit_name = "held-out documents" if any(units[q] != q for q in start) else "queries"
    hits = 0
    for _ in range(trials):
        systems = {"start": start}
        for c in range(k):
            sign = {d: rng.choice((-1.0, 1.0)) for d in docs}
            shift = gain if c == 0 else 0.0
            systems[f"c{c}"] = {q: start[q] + sign[units[q]] * (best[q] - start[q] - mean) + shift for q in start}
        hits += select(systems, "start", "proxy", units=units, unit_name=unit_name).system == "c0"
    return hits / trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="proxy_agreement.py results")
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows, table = [], []
    for path in args.results:
        out = json.loads(Path(path).read_text())
        units, pq = stored_units(out), out["per_query"]
        real = {n: sum(s["real"].values()) / len(s["real"]) for n, s in pq.items()}
        for proxy in PROXIES:
            for run, *_ in out["runs_config"]:
                start, cands = run_candidates(out["models"], run)
                if not cands:
                    continue
                values = {n: pq[n][proxy] for n in [start, *cands]}
                u = {q: units[q] for q in values[start]}
                unit_name = "held-out documents" if any(u[q] != q for q in u) else "queries"
                sel = select(values, start, f"proxy {proxy}", units=u, unit_name=unit_name)
                g = sel.detectable_gain
                rng = random.Random(7)
                found = {f"{f:g}G": round(power(values[start], values[sel.best_trained], len(cands), u, f * g,
                                                args.trials, rng), 3) for f in (0.5, 1, 2)}
                row = {"dataset": out["dataset"], "proxy": proxy, "run": run, "candidates": len(cands),
                       "units": len({u[q] for q in u}), "selected": sel.system, "best_trained": sel.best_trained,
                       "proxy_gain": round(sel.best_trained_value - sel.start_value, 4),
                       "real_gain_of_best_trained": round(real[sel.best_trained] - real[start], 4),
                       "detectable_gain": round(g, 4), "selected_at": found}
                rows.append(row)
                table.append([out["dataset"], proxy, run, len(cands), row["units"], sel.system,
                              f"{row['proxy_gain']:+.4f}", f"{row['real_gain_of_best_trained']:+.4f}", f"{g:.4f}",
                              found["0.5G"], found["1G"], found["2G"]])
                harness.log(" ".join(map(str, table[-1])))
    harness.table(["dataset", "proxy", "run", "trained", "units", "selected (no same-kind caveat)", "best's proxy gain",
                   "its real gain", "detectable gain G (printed)", "found at G/2", "at G", "at 2G"], table)
    at_g = [r["selected_at"]["1G"] for r in rows]
    summary = {"cases": len(rows), "found_at_G_median": sorted(at_g)[len(at_g) // 2],
               "found_at_G_range": [min(at_g), max(at_g)], "units_needed": {}}
    # G shrinks as 1 / sqrt(units): the units a run would need to find a real gain of 0.02 or 0.005 4 times in 5
    for (dataset, proxy) in sorted({(r["dataset"], r["proxy"]) for r in rows}):
        mine = sorted(r["detectable_gain"] * r["units"] ** 0.5 for r in rows
                      if (r["dataset"], r["proxy"]) == (dataset, proxy))
        scale = mine[len(mine) // 2]  # G * sqrt(units), the median over the runs
        summary["units_needed"][f"{dataset} {proxy}"] = {f"gain {g}": round((scale / g) ** 2) for g in (0.02, 0.005)}
        summary.setdefault("gain_times_sqrt_units", {})[f"{dataset} {proxy}"] = round(scale, 3)
    print(summary)
    harness.write_json(args.out, {"results": args.results, "trials": args.trials, "rows": rows, "summary": summary,
                                  "machine": harness.machine()})


if __name__ == "__main__":
    main()
