"""RocketQA and ANCE benchmark on whole BEIR datasets (offline: MiniLM everywhere), and the partial
re-execution stage lists on the bundled sample.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/rocketqa.py --dataset scifact [--store DIR] [--skip-ance | --skip-rocketqa]
        [--set key=value ...] [--ance-set key=value ...] [--to STAGE ...] [--out bench/results/rocketqa_scifact.json]
    HF_HUB_OFFLINE=1 .venv/bin/python bench/rocketqa.py --partial [--out bench/results/rocketqa_partial.json]

Runs ``configs/rocketqa_<ds>_offline.yaml`` and ``configs/ance_<ds>_offline.yaml`` through
``irflow.api.run`` in one store (BM25, the zero-shot run and ingest are shared) and writes:
- the table: nDCG@10 and R@100 per system, in the ablation order (ORDER below);
- wall time per stage (``RunResult.stages``) and the machine's load before/after;
- the denoise audit per teacher: the share of M_D0's top-50 candidates the teacher calls likely
  positives (dropped), by rank bucket, read from the ``audit`` dataset;
- where the histograms are (PNG per denoise teacher).
``--partial`` runs configs/rocketqa_demo.yaml and configs/ance_demo.yaml on the sample, then the
three changes (denoise threshold, M_C's learning rate, one more ANCE round), and
records which stages each recomputed.
"""

from __future__ import annotations

import argparse

import harness
from harness import ROOT

ORDER = ["bm25-flat", "dense-all-MiniLM-L6-v2", "md0", "md0-bm25neg", "md0-hardneg", "md1-ce", "md1-fusion",
         "md1-listwise", "md2", "mc-rerank", "mc-rerank-fused", "ance-warmup", *(f"ance-round{r}" for r in range(1, 11))]
LABELS = {"bm25-flat": "BM25", "dense-all-MiniLM-L6-v2": "zero-shot MiniLM", "md0": "M_D0 in-batch",
          "md0-bm25neg": "+ BM25 negatives", "md0-hardneg": "+ M_D0 hard negatives, not denoised",
          "md1-ce": "M_D1 denoised by M_C", "md1-fusion": "M_D1 denoised by fusion",
          "md1-listwise": "M_D1 listwise KL from M_C (frozen)", "md2": "M_D2 + augmentation",
          "mc-rerank": "M_C re-ranking M_D0 top-100", "mc-rerank-fused": "M_C re-ranking fused with M_D0's scores",
          "ance-warmup": "ANCE warm-up (BM25 negatives)",
          **{f"ance-round{r}": f"ANCE round {r}" for r in range(1, 11)}}


def audit_summary(store: str, result) -> dict:
    """Per denoise teacher: candidates, judged positives, dropped and kept by rank bucket, and the teacher's
    order of the labelled lists (``irflow.learn.teachers.list_order_check``, what the stage warns on)."""
    import duckdb

    import pyarrow.parquet as pq

    from irflow.engine.store import TABLE_FILE, Store
    from irflow.learn.teachers import teacher_scores_check

    s = Store(store)
    out = {}
    for st in result.stages:
        if not st.name.startswith("denoise["):
            continue
        path = s.object_dir(st.outputs["audit"]) / TABLE_FILE
        rows = duckdb.sql(f"SELECT bucket, sum(candidates) c, sum(known_positives) p, sum(dropped) d, sum(kept) k "
                          f"FROM '{path}' GROUP BY bucket ORDER BY min(CAST(split_part(bucket, '-', 1) AS INT))"
                          ).fetchall()
        out[st.name] = [{"bucket": b, "candidates": int(c), "judged_positives": int(p), "dropped": int(d),
                         "kept": int(k), "dropped_share": round(d / c, 4) if c else None,
                         "dropped_share_of_unjudged": round(d / (c - p), 4) if c - p else None}
                        for b, c, p, d, k in rows]
        out[st.name + ":histogram"] = str(s.object_dir(st.outputs["histogram"]) / "histogram.png")
        scores = pq.read_table(s.object_dir(st.outputs["scores"]) / TABLE_FILE,
                               columns=["query_id", "rank", "score", "positive"])
        check = teacher_scores_check(scores)
        out[st.name + ":teacher_check"] = {**check.to_dict(), "problem": check.problem()}  # bench/teacher_check.py
    return out


def label(system: str) -> str:
    """A system's row label; ``hybrid`` / ``hybrid-<model>`` (``hybrid.enabled``): BM25 fused with that model."""
    if system == "hybrid":
        return "BM25 + zero-shot MiniLM, fused (no training)"
    if system.startswith("hybrid-"):
        return "BM25 + [" + LABELS.get(system.removeprefix("hybrid-"), system.removeprefix("hybrid-")) + "], fused"
    return LABELS.get(system, system)


def table(metrics: list[dict]) -> list[dict]:
    by = {m["system"]: m for m in metrics}
    order = [s for s in ORDER if s in by] + [s for s in by if s not in ORDER]
    return [{"system": s, "label": label(s), "ndcg@10": round(by[s]["ndcg@10"], 4),
             "recall@100": round(by[s]["recall@100"], 4)} for s in order]


def bench_dataset(ds: str, store: str, sets: dict[str, list[str]], flows: tuple[str, ...],
                  to: list[str] = ()) -> dict:
    """Each of ``flows`` on dataset ``ds`` in one store; ``sets``: config overrides per flow; ``to``: only
    these stages and what they need (``irflow run --to``). Each run's systems get their paired tests
    (``quality.paired_in_store``: against zero-shot, and a BM25 fusion against BM25 and the zero-shot one)."""
    from quality import paired_in_store

    out = {"dataset": ds, "machine": harness.machine(), "store": store, "overrides": sets.get("rocketqa", []),
           "overrides_ance": sets.get("ance", []), "to": list(to), "runs": {}}
    metrics = []
    for flow in flows:
        config = f"configs/{flow}_{ds}_offline.yaml"
        result = harness.run(ROOT / config, sets.get(flow, []), store, to=to)
        out["runs"][flow] = {"config": config, "run_id": result.run_id, "wall_seconds": round(result.wall_seconds, 1),
                             "paired": paired_in_store(f"{store}:{result.run_id}")["systems"],
                             "load_before": result.load_before, "load_after": result.load_after,
                             "stages": [{"stage": s.name, "status": s.status, "seconds": round(s.seconds, 1),
                                         "device": (s.runtime or {}).get("device"),
                                         "precision": (s.runtime or {}).get("precision")} for s in result.stages]}
        if flow == "rocketqa":
            out["denoise_audit"] = audit_summary(store, result)
        metrics += [m for m in result.metrics if not any(m["system"] == x["system"] for x in metrics)]
    out["table"] = table(metrics)
    return out


def bench_partial(store: str, only: str | None = None, out_path: str | None = None,
                  cases_named: list[str] = ()) -> dict:
    cases = [("rocketqa", "configs/rocketqa_demo.yaml", []),
             ("rocketqa: denoise.negative_threshold 0.1 -> 0.05", "configs/rocketqa_demo.yaml",
              ["denoise.negative_threshold=0.05"]),
             ("rocketqa: cross_encoder.lr 3e-5 -> 2e-5", "configs/rocketqa_demo.yaml", ["cross_encoder.lr=2.0e-5"]),
             ("ance", "configs/ance_demo.yaml", []),
             ("ance: rounds 2 -> 3", "configs/ance_demo.yaml", ["rounds=3"])]
    out = []
    for name, config, sets in cases:
        if (only and not name.startswith(only)) or (cases_named and name not in cases_named):
            continue
        result = harness.run(ROOT / config, sets, store)
        out.append({"case": name, "overrides": sets, "wall_seconds": round(result.wall_seconds, 1),
                    "computed": sorted(result.computed), "cached": len(result.cached), "table": table(result.metrics)})
        harness.log(f"{name}: computed {sorted(result.computed)}")
        if out_path:  # after every case: a long benchmark that dies keeps what it measured
            harness.write_json(out_path, {"store": store, "cases": out})
    return {"store": store, "cases": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="scifact")
    ap.add_argument("--partial", action="store_true")
    ap.add_argument("--only", default=None, help="--partial: only the cases whose name starts with this")
    ap.add_argument("--case", action="append", default=[], help="--partial: only the cases of exactly these names")
    ap.add_argument("--store", default=None)
    ap.add_argument("--skip-ance", action="store_true")
    ap.add_argument("--skip-rocketqa", action="store_true", help="ANCE only (e.g. RocketQA measured before)")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="key=value for RocketQA's config only (its keys, e.g. denoise.*, are not ANCE's)")
    ap.add_argument("--ance-set", dest="ance_sets", action="append", default=[],
                    help="key=value for ANCE's config (e.g. hybrid.enabled=true, runtime.threads=1)")
    ap.add_argument("--to", action="append", default=[], help="only these stages and what they need "
                                                              "(as irflow run --to; e.g. evaluate[hybrid-md0])")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.partial:
        store = a.store or str(ROOT / "store-bench-partial")
        out = a.out or str(ROOT / "bench/results/rocketqa_partial.json")
        res = bench_partial(store, a.only, out, a.case)
    else:
        store = a.store or str(ROOT / f"store-bench-{a.dataset}")
        flows = tuple(f for f, skip in (("rocketqa", a.skip_rocketqa), ("ance", a.skip_ance)) if not skip)
        res = bench_dataset(a.dataset, store, {"rocketqa": a.sets, "ance": a.ance_sets}, flows, a.to)
        out = a.out or str(ROOT / f"bench/results/rocketqa_{a.dataset}.json")
        harness.table(["system", "nDCG@10", "R@100"],
                      [[r["label"], f"{r['ndcg@10']:.4f}", f"{r['recall@100']:.4f}"] for r in res["table"]])
    print(f"wrote {harness.write_json(out, res)}")


if __name__ == "__main__":
    main()
