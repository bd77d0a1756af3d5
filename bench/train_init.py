"""Training on the new data: from scratch, or continued from the model in use (``train.init: production``).

SciFact as a user's own documents with a query log (its train queries' texts, no labels; GPL with the
offline config's teacher and labels, ``--steps`` training steps, the proxy evaluation), the way a nightly
schedule sees it:

1. version 1: the first 90% of the documents; GPL, ``promote: {alias: production}`` (the first
   promotion: the run's selected model becomes production);
2. version 2: all documents (10% new); GPL continued from production (``train.init: production``, and
   ``promote`` as a schedule would have it: the run decides whether its model replaces production);
3. version 2 again, GPL from scratch (``train.init: base``, the default; no promotion).

Then, outside the runs, the real test qrels (the BEIR zip) score production (version 1's model), both
version-2 students, zero-shot MiniLM and BM25: nDCG@10 and R@100, paired t-tests of continued against
scratch and of each against zero-shot; and the training stage's seconds of each run.

    python bench/train_init.py --work /work/bench-init --steps 60 --out bench/results/train_init_scifact.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (sets the offline environment first)
from incremental import documents, write  # noqa: E402
from own_corpus import real_scores  # noqa: E402


def config(work: Path, source: Path, log_file: Path, steps: int, name: str, init: str, promote: bool) -> Path:
    c = yaml.safe_load((harness.ROOT / "configs" / "gpl_scifact_offline.yaml").read_text())
    c["dataset"] = {"name": "scifact-own", "source": str(source), "proxy": {"documents": 200},
                    "query_log": str(log_file)}
    c["generate"] = {"source": "unlabelled"}
    c["train"].update(steps=steps, init=init)
    c["train"].setdefault("qgen", {})["enabled"] = False
    c.get("label", {}).pop("positive", None)
    if promote:
        c["promote"] = {"alias": "production"}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(c, sort_keys=False))
    return path


def summary(t) -> dict:
    r = t.result
    return {"run_id": r.run_id, "wall_seconds": round(t.wall_seconds, 1), "computed": len(r.computed),
            "proxy_ndcg@10": {m["system"]: m["ndcg@10"] for m in r.metrics}, "selected": r.selected,
            "promotion": r.promotion,
            "train_seconds": {s.name: s.seconds for s in r.stages if s.name.startswith("train_student")
                              and s.status == "computed"},
            "stage_seconds": {s.name: s.seconds for s in r.stages if s.status == "computed"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="the store and the user's files go here (kept: a second call "
                                                  "reuses every stage)")
    ap.add_argument("--steps", type=int, default=60, help="GPL training steps of each run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from irflow import api
    from irflow.learn.stats import paired

    work, dataset = Path(args.work), "scifact"
    work.mkdir(parents=True, exist_ok=True)
    store, source, log_file = work / "store", work / "my-docs" / "corpus.jsonl", work / "query_log.txt"
    _, queries, train = harness.read_beir(harness.DATASETS / f"{dataset}.zip", "train")
    log_file.write_text("".join(queries[q].replace("\n", " ") + "\n" for q in sorted(train)))
    docs = documents(dataset)
    out: dict = {"dataset": dataset, "steps": args.steps, "documents": {"v1": int(len(docs) * 0.9), "v2": len(docs)},
                 "runs": {}}

    write(docs[: int(len(docs) * 0.9)], source)
    out["runs"]["v1"] = summary(harness.run(config(work, source, log_file, args.steps, "v1", "base", True), store=store))
    harness.write_json(args.out, out)
    write(docs, source)
    out["runs"]["v2-continued"] = summary(
        harness.run(config(work, source, log_file, args.steps, "v2-continued", "production", True), store=store))
    harness.write_json(args.out, out)
    out["runs"]["v2-scratch"] = summary(
        harness.run(config(work, source, log_file, args.steps, "v2-scratch", "base", False), store=store))
    harness.write_json(args.out, out)

    models = {"production-v1": out["runs"]["v1"]["promotion"]["current"],
              "continued-v2": out["runs"]["v2-continued"]["selected"]["models"]["gpl-student"],
              "scratch-v2": out["runs"]["v2-scratch"]["selected"]["models"]["gpl-student"],
              "zero-shot": "all-MiniLM-L6-v2"}
    real, per_query = {}, {}
    for name, model in models.items():
        metrics, pq = real_scores(dataset, model.removeprefix("hub:"), name, store)
        real[name] = {k: metrics[name][k] for k in ("ndcg@10", "recall@100")}
        per_query[name] = pq[name]
        real.setdefault("bm25-flat", {k: metrics["bm25-flat"][k] for k in ("ndcg@10", "recall@100")})
    out["models"] = models
    out["real"] = real
    out["paired"] = {}
    for a, b in (("continued-v2", "scratch-v2"), ("continued-v2", "zero-shot"), ("scratch-v2", "zero-shot"),
                 ("continued-v2", "production-v1")):
        p = paired(per_query[b], per_query[a])
        out["paired"][f"{a} vs {b}"] = {"mean_diff": round(p.mean_diff, 4), "t_pvalue": round(p.t_pvalue, 4),
                                         "wins": p.wins, "losses": p.losses, "n": p.n}
    out["machine"] = harness.machine()
    harness.write_json(args.out, out)
    harness.table(["model", "real nDCG@10", "real R@100"],
                  [[k, f"{v['ndcg@10']:.4f}", f"{v['recall@100']:.4f}"] for k, v in real.items()])
    for k, v in out["paired"].items():
        print(f"{k}: {v['mean_diff']:+.4f} (p {v['t_pvalue']}, {v['wins']} better / {v['losses']} worse)")
    for k, r in out["runs"].items():
        print(f"{k}: train {r['train_seconds']}; selected {r['selected']['system']}; "
              f"promotion {(r['promotion'] or {}).get('reason')}")


if __name__ == "__main__":
    main()
