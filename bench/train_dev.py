"""Choose a recipe's settings on a dev cut of the *train* split, never on test: any config, any keys.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/train_dev.py configs/rocketqa_demo.yaml \
        --variant "base" --variant "lr5e-5; dual_encoder.lr=5e-5; student.lr=5e-5" \
        [--dev-share 0.2] [--seed 7] [--store DIR] [--out FILE] [--set KEY=VALUE ...] [--to STAGE ...]

1. ``irflow.sources.beir.train_dev_split`` writes a BEIR folder from the config's dataset: the train split's judged
   queries cut (seeded) into ``train`` (fit) and ``dev``; the test split's queries and judgements are not
   in it at all.
2. Each variant (``name; key=value; key=value``: ``--set`` overrides, ``;``-separated since values may hold
   commas) runs the recipe through ``irflow.api.run`` with ``dataset.source`` = that folder and
   ``dataset.split=dev``: every system the recipe evaluates (baselines, teachers, students) is read on the
   dev queries. Variants share one store, so what a change does not touch is computed once.
3. Prints a table (nDCG@10 per system and variant, each system's gain over the zero-shot row and the paired
   t-test's p over the dev queries, ``irflow.learn.stats.paired``, as the report page computes it) and
   writes JSON (default ``bench/results/train_dev_<config>.json``; variants of an earlier call are kept
   unless re-run). Record the choice, with its dev numbers, in a comment of the config.

``--on-split SPLIT``: the variants on another held-out split of the config's dataset, whole and with its
own judgements, instead of a cut of train (NFCorpus's ``dev``: graded 1/2 like its test split, while BEIR
flattened its train qrels to 1). Refused for the config's evaluated split.

``--on-test``: once a variant is chosen, the same variants on the config's own evaluated split (what the
bench tables report), in a store of their own.

The dev part is small on small datasets (60 queries of the sample's 300): a gap under ~0.02 there is
within noise (``--seed`` gives another cut).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import yaml

import harness
from harness import ROOT


def parse_variant(spec: str) -> tuple[str, list[str]]:
    name, *sets = [s.strip() for s in spec.split(";")]
    if not name or "=" in name:
        raise SystemExit(f"--variant {spec!r}: give it a name first: 'name; key=value; ...'")
    return name, [s for s in sets if s]


def paired_against_zero_shot(store: Path, run_id: str) -> dict[str, dict]:
    """Each system's per-query nDCG@10 against the zero-shot row's (``irflow.learn.stats.paired``: wins / losses
    and the paired t-test's p), read from the run's evaluate outputs as the report page reads them."""
    return paired_with(per_query_ndcg(store, run_id), "dense-")


def per_query_ndcg(store: Path, run_id: str) -> dict[str, dict[str, float]]:
    """system -> query -> nDCG@10, from the run's evaluate outputs as the report page reads them."""
    from irflow.engine.catalog import Catalog
    from irflow.tools.report import runs as R

    catalog = Catalog(Path(store) / "catalog.duckdb")
    per_query = {}
    for ev in R.evaluations(catalog, run_id):
        per_query.update(R.per_query_values(catalog, ev["per_query"], "ndcg@10"))
    return per_query


def paired_test(a: dict[str, float], b: dict[str, float]) -> dict:
    """``b`` against ``a`` by query (``irflow.learn.stats.paired``), as the benchmarks' JSON keeps it: mean
    difference, wins / losses and the paired t-test's p."""
    from irflow.learn.stats import paired

    t = paired(a, b)
    return {"mean_diff": round(t.mean_diff, 4), "wins": t.wins, "losses": t.losses, "t_pvalue": round(t.t_pvalue, 4)}


def paired_with(per_query: dict[str, dict[str, float]], base: str) -> dict[str, dict]:
    """Every other system against the first whose name starts with ``base`` (``irflow.learn.stats.paired``:
    wins / losses and the paired t-test's p); empty if no system does."""
    from irflow.learn.stats import paired

    ref = next((s for s in per_query if s.startswith(base)), None)
    if ref is None:
        return {}
    out = {}
    for system, values in per_query.items():
        if system != ref:
            t = paired(per_query[ref], values)
            out[system] = {"wins": t.wins, "losses": t.losses, "t_pvalue": round(t.t_pvalue, 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--variant", action="append", default=[], help="name; key=value; ... (repeatable; "
                                                                    "default: one variant 'base', the config as is)")
    ap.add_argument("--set", action="append", default=[], help="override for every variant (e.g. a budget)")
    ap.add_argument("--to", action="append", default=[], help="stop after these stages (as `irflow run --to`; "
                                                              "e.g. evaluate[md0]): only they and what they need run")
    ap.add_argument("--dev-share", type=float, default=0.2)
    ap.add_argument("--max-dev-queries", type=int, default=None)
    ap.add_argument("--seed", type=int, default=7, help="seed of the fit/dev cut")
    ap.add_argument("--store", default=None, help="store shared by the variants (default: "
                                                  "../runs/train-dev-<config>-s<seed> beside the repo)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--on-test", action="store_true", help="after the choice: the same variants on the config's "
                                                         "own dataset and split (test), no cut; writes "
                                                         "bench/results/train_dev_<config>_test.json")
    ap.add_argument("--on-split", default=None, help="evaluate on this held-out split of the config's dataset "
                                                     "(e.g. dev), not on a cut of train; never the evaluated split")
    args = ap.parse_args()

    from irflow import api
    from irflow.sources.beir import train_dev_split
    from irflow.recipes.base import load_config

    config = Path(args.config)
    c = load_config(str(config), args.set)
    stem = config.stem
    train_split = getattr(c, "train_split", None) or "train"
    if args.on_split and (args.on_test or args.on_split in (c.dataset.split, train_split)):
        raise SystemExit(f"--on-split {args.on_split}: choose on a split that is neither the evaluated one "
                         f"('{c.dataset.split}') nor the labelled one; --on-test is for the evaluated split")
    if args.on_split:
        from irflow.sources.beir import dataset_splits
        splits = dataset_splits(c.dataset.source if os.path.isabs(c.dataset.source) else str(Path.cwd() / c.dataset.source))
        if splits is not None and args.on_split not in splits:
            raise SystemExit(f"--on-split {args.on_split}: {c.dataset.source} has no qrels/{args.on_split}.tsv "
                             f"(its splits: {', '.join(splits)})")
    suffix = "-test" if args.on_test else f"-{args.on_split}" if args.on_split else f"-s{args.seed}"
    store = Path(args.store or ROOT.parent / "runs" / f"train-dev-{stem}{suffix}")
    store.mkdir(parents=True, exist_ok=True)
    folder = store / f"data-{c.dataset.display_name}-dev{args.dev_share}-s{args.seed}"
    if args.on_test:
        counts = {"dev_queries": "the test split's"}
        dataset_sets = []
    elif args.on_split:
        counts = {"dev_queries": f"the {args.on_split} split's"}
        dataset_sets = [f"dataset.split={args.on_split}"]
    elif not (folder / "qrels" / "dev.tsv").exists():
        source = c.dataset.source if os.path.isabs(c.dataset.source) else str(Path.cwd() / c.dataset.source)
        counts = train_dev_split(source, folder, train_split=train_split, dev_share=args.dev_share,
                                 seed=args.seed, max_dev_queries=args.max_dev_queries)
        (folder.parent / (folder.name + ".json")).write_text(json.dumps(counts))
    if not (args.on_test or args.on_split):
        counts = json.loads((folder.parent / (folder.name + ".json")).read_text())
        harness.log(f"{c.dataset.display_name}: {counts['fit_queries']} fit / {counts['dev_queries']} dev queries "
                    f"(train split '{train_split}', seed {args.seed}); store {store}")
        dataset_sets = [f"dataset.source={folder}", "dataset.md5=null", "dataset.split=dev",
                        "dataset.limit_queries=null", f"dataset.name={c.dataset.display_name}-dev"]

    out_path = Path(args.out or ROOT / f"bench/results/train_dev_{stem}"
                                     f"{'_test' if args.on_test else f'_{args.on_split}' if args.on_split else ''}.json")
    prior = json.loads(out_path.read_text()) if out_path.exists() else {}
    out = {"config": str(config), "dataset": c.dataset.display_name, "split": counts, "seed": args.seed,
           "dev_share": args.dev_share, "common_sets": args.set, "to": args.to, "variants": prior.get("variants", [])}
    if prior.get("seed") not in (None, args.seed) or prior.get("common_sets", args.set) != args.set:
        out["variants"] = []  # another cut or another budget: earlier rows do not compare
    for spec in args.variant or ["base"]:
        name, sets = parse_variant(spec)
        overrides = [*args.set, *sets, *dataset_sets]
        r = harness.timed(lambda: api.run(str(config), overrides=overrides, store=store, to=args.to),
                          f"{name}: api.run({str(config)!r}, overrides={overrides}, to={args.to})")
        metrics = {m["system"]: {"ndcg@10": round(m["ndcg@10"], 4), "recall@100": round(m["recall@100"], 4)}
                   for m in r.to_dict()["metrics"]}
        for system, test in paired_against_zero_shot(store, r.run_id).items():
            metrics[system]["vs_zero_shot"] = test
        entry = {"name": name, "sets": sets, "run_id": r.run_id, "wall_seconds": round(r.wall_seconds, 1),
                 "computed": len(r.computed), "metrics": metrics, "load_after": r.load_after}
        out["variants"] = [v for v in out["variants"] if v["name"] != name] + [entry]
        harness.write_json(out_path, out)

    systems = list(dict.fromkeys(s for v in out["variants"] for s in v["metrics"]))
    zero = next((s for s in systems if s.startswith("dense-")), None)
    rows = []
    for s in systems:
        row = [s]
        for v in out["variants"]:
            m = v["metrics"].get(s)
            z = v["metrics"].get(zero, {}).get("ndcg@10") if zero else None
            vs = m and m.get("vs_zero_shot")
            row.append("-" if m is None else f"{m['ndcg@10']:.4f}" + (f" ({m['ndcg@10'] - z:+.4f}" + (
                f", p {vs['t_pvalue']:.2f}" if vs else "") + ")" if z is not None and s != zero else ""))
        rows.append(row)
    print(f"\nnDCG@10 on {counts['dev_queries']} {'test' if args.on_test else args.on_split or 'dev'} queries (gain over {zero}, and the "
          f"paired t-test's p over those queries):")
    harness.table(["system", *[v["name"] for v in out["variants"]]], rows)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
