"""STAR and STAR + ADORE against ANCE, zero-shot and BM25 on whole BEIR datasets (offline: MiniLM everywhere).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/star_adore.py --dataset scifact [--store DIR] [--skip-ance]
        [--set key=value ...] [--ance-set key=value ...] [--out bench/results/star_adore_scifact.json]
    HF_HUB_OFFLINE=1 .venv/bin/python bench/star_adore.py --sample [--out ...]   # a smoke run on the bundled sample

Runs ``configs/star_<ds>.yaml`` and ``configs/ance_<ds>_offline.yaml`` through ``irflow.api.run`` in one store
(ingest, BM25 and the zero-shot model's corpus encoding are computed once) and writes:
- the table: nDCG@10 and R@100 per system: BM25, zero-shot MiniLM, ANCE's warm-up and last round, STAR,
  STAR + ADORE (the asymmetric model: ADORE's query encoder over STAR's frozen corpus embeddings);
- paired t-tests over the test queries (``irflow.learn.stats.paired`` on each run's per-query values, both metrics):
  STAR and STAR + ADORE against zero-shot, BM25 and ANCE's last round, and STAR + ADORE against STAR (what
  ADORE adds); wins / losses and p;
- wall time per stage (``RunResult.stages``), the machine and its load before / after.
ANCE is the closest relative: both give a dual encoder the hard negatives of a dense retriever's own ranking;
ANCE re-encodes the corpus every round, ADORE never does (its documents are frozen). ``--sample`` runs the
recipe on ``irflow/samples/scifact-sample.zip`` with a few steps (minutes): the script's path, not a result.
"""

from __future__ import annotations

import argparse

import harness
from harness import ROOT

ZERO_SHOT = "dense-all-MiniLM-L6-v2"
METRICS = ("ndcg@10", "recall@100")
SAMPLE_SETS = ["dataset.source=irflow/samples/scifact-sample.zip", "dataset.name=scifact-sample", "star.steps=4",
               "star.batch_size=16", "star.passage_max_length=64", "adore.steps=4", "adore.batch_size=16",
               "adore.depth=50", "star.depth=50", "dense.max_seq_length=64"]
SAMPLE_ANCE_SETS = ["dataset.source=irflow/samples/scifact-sample.zip", "dataset.name=scifact-sample", "rounds=1",
                    "warmup.steps=4", "warmup.batch_size=16", "warmup.passage_max_length=64", "round.steps=4",
                    "round.batch_size=16", "round.passage_max_length=64", "round.depth=50",
                    "dense.max_seq_length=64"]


def label(system: str, last_round: str | None) -> str:
    return {"bm25-flat": "BM25", ZERO_SHOT: "zero-shot MiniLM", "ance-warmup": "ANCE warm-up (BM25 negatives)",
            "star": "STAR (static hard + random negatives)",
            "star-adore": "STAR + ADORE (query encoder over STAR's frozen index)"}.get(
        system, f"ANCE {system.removeprefix('ance-')}" + (" (last)" if system == last_round else ""))


def per_query(store: str, run_id: str) -> dict[str, dict[str, dict[str, float]]]:
    """metric -> system -> query -> value, from the run's evaluate outputs (as the report page reads them)."""
    from pathlib import Path

    from irflow.engine.catalog import Catalog
    from irflow.tools.report import runs as R

    catalog = Catalog(Path(store) / "catalog.duckdb")
    out: dict = {m: {} for m in METRICS}
    for ev in R.evaluations(catalog, run_id):
        for m in METRICS:
            out[m].update(R.per_query_values(catalog, ev["per_query"], m))
    return out


def comparisons(systems: set[str], last_round: str | None) -> list[tuple[str, str]]:
    """(system, against) pairs: each STAR model against zero-shot, BM25 and ANCE's last round; ADORE against STAR."""
    pairs = []
    for s in ("star", "star-adore"):
        for base in (ZERO_SHOT, "bm25-flat", last_round):
            if s in systems and base in systems:
                pairs.append((s, base))
    if {"star", "star-adore"} <= systems:
        pairs.append(("star-adore", "star"))
    return pairs


def paired_tests(values: dict, pairs: list[tuple[str, str]]) -> list[dict]:
    from irflow.learn.stats import paired

    out = []
    for system, base in pairs:
        row = {"system": system, "against": base}
        for m in METRICS:
            t = paired(values[m][base], values[m][system])
            row[m] = {"mean_diff": round(t.mean_diff, 4), "wins": t.wins, "losses": t.losses, "n": t.n,
                      "t_pvalue": round(t.t_pvalue, 4)}
        out.append(row)
    return out


def bench(dataset: str, store: str, sets: dict[str, list[str]], skip_ance: bool, sample: bool) -> dict:
    out = {"dataset": "scifact-sample" if sample else dataset, "machine": harness.machine(), "store": store,
           "overrides": sets["star"], "overrides_ance": sets["ance"], "runs": {}}
    flows = [("star", f"configs/star_{dataset}.yaml")]
    if not skip_ance:
        flows.append(("ance", f"configs/ance_{dataset}_offline.yaml"))
    values: dict = {m: {} for m in METRICS}
    metrics: dict[str, dict] = {}
    for flow, config in flows:
        result = harness.run(ROOT / config, sets[flow], store)
        out["runs"][flow] = {"config": config, "run_id": result.run_id, "wall_seconds": round(result.wall_seconds, 1),
                             "selected": (result.selected or {}).get("system"),
                             "load_before": result.load_before, "load_after": result.load_after,
                             "stages": [{"stage": s.name, "status": s.status, "seconds": round(s.seconds, 1),
                                         "device": (s.runtime or {}).get("device"),
                                         "precision": (s.runtime or {}).get("precision")} for s in result.stages]}
        got = per_query(store, result.run_id)
        for m in METRICS:
            for system, v in got[m].items():
                values[m].setdefault(system, v)  # shared systems (BM25, zero-shot): the same values in both runs
        for m in result.metrics:
            metrics.setdefault(m["system"], m)
    rounds = sorted((s for s in metrics if s.startswith("ance-round")), key=lambda s: int(s.removeprefix("ance-round")))
    last_round = rounds[-1] if rounds else None
    order = [s for s in ("bm25-flat", ZERO_SHOT, "ance-warmup", *rounds, "star", "star-adore") if s in metrics]
    out["table"] = [{"system": s, "label": label(s, last_round), **{m: round(metrics[s][m], 4) for m in METRICS}}
                    for s in order]
    out["paired"] = paired_tests(values, comparisons(set(metrics), last_round))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="scifact", choices=("scifact", "nfcorpus"))
    ap.add_argument("--sample", action="store_true", help="a smoke run on the bundled sample (SciFact's configs, "
                                                          "a few steps)")
    ap.add_argument("--store", default=None)
    ap.add_argument("--skip-ance", action="store_true", help="STAR + ADORE only (ANCE measured before, or not wanted)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="key=value for the STAR config")
    ap.add_argument("--ance-set", dest="ance_sets", action="append", default=[], help="key=value for ANCE's config")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dataset = "scifact" if a.sample else a.dataset
    name = "sample" if a.sample else dataset
    store = a.store or str(ROOT / f"store-bench-star-{name}")
    sets = {"star": (SAMPLE_SETS if a.sample else []) + a.sets,
            "ance": (SAMPLE_ANCE_SETS if a.sample else []) + a.ance_sets}
    res = bench(dataset, store, sets, a.skip_ance, a.sample)
    harness.table(["system", "nDCG@10", "R@100"],
                  [[r["label"], f"{r['ndcg@10']:.4f}", f"{r['recall@100']:.4f}"] for r in res["table"]])
    print()
    harness.table(["system", "against", "nDCG@10 diff", "wins/losses", "p", "R@100 diff", "p"],
                  [[t["system"], t["against"], f"{t['ndcg@10']['mean_diff']:+.4f}",
                    f"{t['ndcg@10']['wins']}/{t['ndcg@10']['losses']}", f"{t['ndcg@10']['t_pvalue']:.3g}",
                    f"{t['recall@100']['mean_diff']:+.4f}", f"{t['recall@100']['t_pvalue']:.3g}"]
                   for t in res["paired"]])
    out = a.out or str(ROOT / f"bench/results/star_adore_{name}.json")
    print(f"wrote {harness.write_json(out, res)}")


if __name__ == "__main__":
    main()
