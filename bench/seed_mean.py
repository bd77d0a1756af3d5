"""Is a gap that no single seed shows beyond chance real over seeds? Each query's nDCG@10 averaged over seeds.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/seed_mean.py bench/results/train_dev_ance_nfcorpus_offline_test_seeds.json \
        [more seed files ...] --store /work/runs/bench-nfcorpus [--out bench/results/seed_mean_nfcorpus.json]

Reads ``train_dev.py`` result files whose variants are the same config at different seeds (run ids, one
store), takes every system's per-query nDCG@10 from each run's evaluate outputs (as the report page reads
them), averages each query over the seeds, and compares that mean with the zero-shot row's per-query
nDCG@10 (the same in every seed: nothing trained) by ``irflow.learn.stats.paired``: wins / losses and the paired
t-test's p over the queries. Averaging over seeds takes out the seed's share of each query's variance,
so a gap that holds at every seed shows more clearly than in any one run; it says nothing about seeds
not run. ``--arm key=value`` keeps the runs that set that override apart (ANCE's control without a refresh
against its rounds, each averaged over its own seeds). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness
from harness import ROOT
from paired import every_pair
from train_dev import per_query_ndcg

ZERO = "dense-"


def seed_mean_against(ref: dict[str, float], seeds: list[dict[str, float]]):
    """(each query's value averaged over ``seeds``, its ``irflow.learn.stats.paired`` test against ``ref``), over the
    queries every run and ``ref`` have."""
    from irflow.learn.stats import paired

    queries = sorted(set(ref).intersection(*seeds))
    mean = {q: sum(s[q] for s in seeds) / len(seeds) for q in queries}
    return mean, paired({q: ref[q] for q in queries}, mean)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="train_dev.py result files (variants = seeds)")
    ap.add_argument("--store", required=True, help="the store the runs are in")
    ap.add_argument("--arm", action="append", default=[],
                    help="an override (key=value) that makes a second arm: the systems of the variants that set "
                         "it are named '<system> [key=value]' and averaged apart (a control against the method, "
                         "e.g. round.negatives=warmup)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    per_seed: dict[str, list[dict[str, float]]] = {}  # system -> one {query: nDCG@10} per seed
    zero: dict[str, float] | None = None
    zero_name = None
    sources = []
    for f in args.files:
        d = json.loads(Path(f).read_text())
        for v in d["variants"]:
            sources.append({"file": Path(f).name, "variant": v["name"], "sets": v["sets"], "run_id": v["run_id"]})
            arm = "".join(f" [{a}]" for a in args.arm if a in v["sets"])
            for system, values in per_query_ndcg(Path(args.store), v["run_id"]).items():
                if system.startswith(ZERO):
                    if zero is not None and values != zero:
                        raise SystemExit(f"{v['run_id']}: its zero-shot row differs from the first run's: "
                                         "not the same evaluation")
                    zero, zero_name = values, system
                elif system.startswith(("bm25", "hybrid", "fusion", "mc-rerank")):
                    continue  # untrained rows: the same at every seed
                else:
                    per_seed.setdefault(system + arm, []).append(values)
    if zero is None:
        raise SystemExit("no zero-shot row in these runs")
    # a system trained in one of the runs only (a seed run that stopped at the students, say) has no mean to take
    single = sorted(system for system, seeds in per_seed.items() if len(seeds) < 2)
    rows, out = [], {"store": args.store, "zero_shot": zero_name, "runs": sources, "systems": {},
                     "one_run_only": single}
    z_mean = sum(zero.values()) / len(zero)
    means: dict[str, dict[str, float]] = {}  # system -> each query's nDCG@10 averaged over its seeds
    for system, seeds in per_seed.items():
        if system in single:
            continue
        mean, t = seed_mean_against(zero, seeds)
        means[system] = mean
        queries = list(mean)
        each = [round(sum(s[q] for q in queries) / len(queries), 4) for s in seeds]
        m = sum(mean.values()) / len(mean)
        out["systems"][system] = {"seeds": len(seeds), "ndcg@10_each": each, "ndcg@10_mean": round(m, 4),
                                  "zero_shot": round(z_mean, 4), "gain": round(m - z_mean, 4), "wins": t.wins,
                                  "losses": t.losses, "t_pvalue": round(t.t_pvalue, 4), "queries": len(queries)}
        rows.append([system, len(seeds), " / ".join(f"{x:.4f}" for x in each), f"{m:.4f}", f"{m - z_mean:+.4f}",
                     f"{t.wins} / {t.losses}", f"{t.t_pvalue:.3f}"])
    print(f"each query's nDCG@10 averaged over seeds, against {zero_name} ({z_mean:.4f}):")
    harness.table(["system", "seeds", "each seed", "mean", "vs zero-shot", "wins / losses", "p"], rows)
    if single:
        print(f"in one run only, not averaged: {', '.join(single)}")
    # the trained systems against each other, each query averaged over seeds (is denoising's gain real?)
    out["pairs"], pair_rows = every_pair(means)
    if pair_rows:
        print("the averaged systems against each other:")
        harness.table(["system", "against", "difference", "better / worse", "p"], pair_rows)
    if args.out:
        harness.write_json(Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out, out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
