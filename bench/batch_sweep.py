"""Effective-batch sweep for RocketQA's M_D0 (InfoNCE, in-batch negatives) on a whole BEIR dataset.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/batch_sweep.py [--config configs/rocketqa_scifact_offline.yaml]
        [--batches 32 128 512] [--mini-batch 32] [--store store-bench-scifact] [--set key=value ...]
        [--out bench/results/batch_sweep_scifact.json]

Every batch size trains M_D0 exactly as the RocketQA config's `dual_encoder` section says (same
epochs, lr, lengths, seed), changing only `batch_size`; batches above `--mini-batch` go through
GradCache (`mini_batch`), which gives the same gradients as the full batch (tests/test_dual_encoder.py)
in bounded memory. Each query of a batch of B scores B passages: B - 1 in-batch negatives. At a fixed
number of epochs a larger batch also means fewer optimiser steps (printed): that is the trade the
sweep measures, at equal compute.

The stages are the engine's (train_dual_encoder, encode_corpus, dense_search, evaluate), keyed as in
the recipe: in the store of `bench/rocketqa.py`, the configured batch size (M_D0 itself), BM25 and the
zero-shot run are cache hits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness
from harness import ROOT


def sweep_body(batches: list[int], mini_batch: int):
    from irflow.learn.dual_encoder import TrainDualEncoderParams
    from irflow.recipes.common import evaluate_systems, labelled_queries, test_systems
    from irflow.recipes.dataset import ingest
    from irflow.stages.train_dual_encoder import train_dual_encoder

    def body(c, run):
        data = ingest(run, c.dataset)
        base = run.model(c.base_model, "base_model")
        train_q = labelled_queries(run, data, c.train_split)
        systems = {}
        for b in batches:
            p = c.dual_encoder.to(TrainDualEncoderParams, negatives_per_line=0, batch_size=b,
                                  mini_batch=mini_batch if b > mini_batch else None)
            name = "md0" if b == c.dual_encoder.batch_size else f"md0-batch{b}"
            systems[name] = train_dual_encoder(run, p, tag=name, queries=[train_q], corpus=data.corpus,
                                               base_model=base, qrels=[data.qrels])["model"]
        return evaluate_systems(run, c.evaluate, data, test_systems(run, c, data, base, systems))

    return body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/rocketqa_scifact_offline.yaml")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--mini-batch", type=int, default=32)
    ap.add_argument("--store", default=str(ROOT / "store-bench-scifact"))
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--out", default=str(ROOT / "bench/results/batch_sweep_scifact.json"))
    args = ap.parse_args()

    from prefect import flow

    from irflow.engine.orchestration import configure
    from irflow.recipes.base import Recipe, execute, load_config

    configure(args.store)
    c = load_config(str(ROOT / args.config), args.sets)
    recipe = Recipe("md0-batch-sweep", type(c), sweep_body(args.batches, args.mini_batch))
    result = harness.timed(lambda: flow(name="md0-batch-sweep", persist_result=False)(
        lambda: execute(recipe, c, args.store, config_path=str(ROOT / args.config)))(),
        f"md0 batch sweep {args.batches} on {args.config} (store {args.store})")

    rows = []
    by = {m["system"]: m for m in result.metrics}
    for b in args.batches:
        name = "md0" if b == c.dual_encoder.batch_size else f"md0-batch{b}"
        st = result.stage(f"train_dual_encoder[{name}]")
        # the training's own summary (steps, examples), written next to the model
        info_file = Path(args.store) / "objects" / st.outputs["model"] / "irflow_training.json"
        info = json.loads(info_file.read_text()) if info_file.exists() else {}
        rows.append({"batch": b, "mini_batch": args.mini_batch if b > args.mini_batch else None,
                     "in_batch_negatives_per_query": b - 1, "steps": info.get("steps"),
                     "examples": info.get("examples"), "train_status": st.status,
                     "train_seconds": st.seconds, "ndcg@10": by[name]["ndcg@10"],
                     "recall@100": by[name]["recall@100"]})
    out = {"config": args.config, "overrides": args.sets, "store": args.store, "run_id": result.run_id,
           "wall_seconds": round(result.wall_seconds, 1), "load_before": result.load_before,
           "load_after": result.load_after,
           "sweep": rows, "reference": {s: {"ndcg@10": by[s]["ndcg@10"], "recall@100": by[s]["recall@100"]}
                                         for s in by if not s.startswith("md0")},
           "stages": [{"stage": s.name, "status": s.status, "seconds": s.seconds} for s in result.stages]}
    harness.table(["batch", "steps", "nDCG@10", "R@100", "train s"],
                  [[r["batch"], r["steps"], f"{r['ndcg@10']:.4f}", f"{r['recall@100']:.4f}", r["train_seconds"]]
                   for r in rows])
    print("wrote", harness.write_json(args.out, out))


if __name__ == "__main__":
    main()
