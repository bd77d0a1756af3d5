"""GPL with model-free queries (ICT, cropping) against zero-shot: does adapting without a query log help?

    HF_HUB_OFFLINE=1 .venv/bin/python bench/model_free.py [--datasets scifact,nfcorpus] [--sources ict,crop]
        [--store-prefix /work/runs/gpl-] [--out bench/results/model_free.json] [--set KEY=VALUE ...]

For each dataset, ``configs/gpl_<ds>_offline.yaml`` with ``generate`` replaced by ``{source: <src>}``
(one query per passage, the dataset's train query texts unused) and the QGen baseline off; everything
else (miners, fusion teacher, Margin-MSE, steps) as the config. Runs share one store per dataset
(``<store-prefix><ds>``), so ingest, BM25, the zero-shot encoding and the baselines are computed once.
Prints nDCG@10 / R@100 of zero-shot, BM25, the fusion teacher and the GPL student per source (with the
paired t-test of each against zero-shot over the test queries), and
writes JSON after each run (so a cut-off keeps what finished). The numbers the recipe's warning cites
(``irflow/measured/model_free.json``) come from this file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness
from harness import ROOT
from train_dev import paired_against_zero_shot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="scifact,nfcorpus")
    ap.add_argument("--sources", default="ict,crop")
    ap.add_argument("--store-prefix", default=str(ROOT.parent / "runs" / "gpl-"))
    ap.add_argument("--set", action="append", default=[], help="extra override for every run")
    ap.add_argument("--out", default=str(ROOT / "bench/results/model_free.json"))
    args = ap.parse_args()

    from irflow.recipes.base import load_config

    prior = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    out = {"machine": harness.machine(), "runs": prior.get("runs", [])}
    keep = ("bm25-flat", "dense-all-MiniLM-L6-v2", "hybrid", "gpl-student")
    rows = []
    for ds in args.datasets.split(","):
        store = f"{args.store_prefix}{ds}"
        for src in args.sources.split(","):
            sets = [f"generate={{source: {src}}}", "train.qgen.enabled=false", *args.set]
            config = f"configs/gpl_{ds}_offline.yaml"
            # the fusion teacher's kind: each miner's own list fused ("own") or every candidate scored by both
            teacher = "every" if getattr(load_config(config, sets).teacher, "score_every_candidate", False) \
                else "own"
            harness.log(f"== GPL on {ds}, queries from {src}, teacher {teacher} (store {store}); {sets}")
            r = harness.run(config, sets, store)
            res = r.to_dict()
            metrics = {m["system"]: {"ndcg@10": round(m["ndcg@10"], 4), "recall@100": round(m["recall@100"], 4)}
                       for m in res["metrics"] if m["system"] in keep}
            for system, test in paired_against_zero_shot(Path(store), r.run_id).items():  # is the gap real?
                if system in metrics:
                    metrics[system]["vs_zero_shot"] = test
            entry = {"dataset": ds, "source": src, "teacher": teacher, "overrides": sets, "run_id": res["run_id"],
                     "wall_seconds": round(r.wall_seconds, 1), "computed": res.get("computed"),
                     "metrics": metrics, "load_before": r.load_before, "load_after": r.load_after}
            out["runs"] = [e for e in out["runs"] if (e["dataset"], e["source"], e["teacher"], e["overrides"]) !=
                           (ds, src, teacher, sets)] + [entry]
            harness.write_json(args.out, out)
            z, s = metrics["dense-all-MiniLM-L6-v2"]["ndcg@10"], metrics["gpl-student"]["ndcg@10"]
            p = metrics["gpl-student"].get("vs_zero_shot", {}).get("t_pvalue")
            rows.append([ds, src, teacher, z, metrics["bm25-flat"]["ndcg@10"], metrics["hybrid"]["ndcg@10"], s,
                         f"{s - z:+.4f}", p, entry["wall_seconds"]])
            harness.table(["dataset", "queries", "teacher", "zero-shot", "BM25", "fusion", "GPL student", "vs zero-shot",
                           "paired p", "wall s"], rows)


if __name__ == "__main__":
    main()
