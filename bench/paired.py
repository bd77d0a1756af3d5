"""Is system A better than system B on these queries? Paired tests between every two systems of a run.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/paired.py bench/results/train_dev_ance_nfcorpus_offline_test_460.json \
        --store /work/runs/ance-nfcorpus-460 [--variant NAME] [--out bench/results/paired_ance_nfcorpus_460.json]

``train_dev.py`` records each system against zero-shot only. This reads one of its variants' run (the
first, or ``--variant``) from the store, takes every system's per-query nDCG@10 from the run's evaluate
outputs (as the report page reads them), and runs ``irflow.learn.stats.paired`` on every ordered pair of systems
in the file's order: the mean difference, the queries where the later system is better / worse, and the
paired t-test's p. Used to say whether ANCE's round 1 beats its warm-up (the refresh's direction), or a
student beats BM25, beyond chance. ``--with`` adds another file's run in the same store (its systems that
differ, named '<variant>: <system>'): ANCE's rounds against the control trained without a refresh
(``round.negatives=warmup``); ``--with-variant`` picks which of its variants, so two variants of one file pair
too (GPL's ``train.lr=5e-5`` against the config on SciFact's dev cut). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness
from train_dev import per_query_ndcg


def every_pair(per_query: dict[str, dict[str, float]]) -> tuple[list[dict], list[list[str]]]:
    """``irflow.learn.stats.paired`` on every two systems of ``per_query`` (system -> {query: nDCG@10}), each later one
    against each earlier one: (JSON records, table rows)."""
    from irflow.learn.stats import paired

    systems, pairs, rows = list(per_query), [], []
    for i, base in enumerate(systems):
        for other in systems[i + 1:]:
            t = paired(per_query[base], per_query[other])
            pairs.append({"system": other, "against": base, "mean_diff": round(t.mean_diff, 4),
                          "wins": t.wins, "losses": t.losses, "t_pvalue": round(t.t_pvalue, 4)})
            rows.append([other, base, f"{t.mean_diff:+.4f}", f"{t.wins} / {t.losses}", f"{t.t_pvalue:.4f}"])
    return pairs, rows


def variant(file: str, name: str | None) -> dict:
    """The variant ``name`` (default: the first) of a train_dev.py result file."""
    d = json.loads(Path(file).read_text())
    v = next((v for v in d["variants"] if name in (None, v["name"])), None)
    if v is None:
        raise SystemExit(f"{file}: no variant {name!r} (it has: {[x['name'] for x in d['variants']]})")
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a bench/train_dev.py result file")
    ap.add_argument("--store", required=True, help="the store its runs are in")
    ap.add_argument("--variant", default=None, help="the variant's name (default: the file's first)")
    ap.add_argument("--with", dest="other", default=None,
                    help="another train_dev.py result file whose first variant ran in the same store: its systems "
                         "that differ from this run's join as '<variant>: <system>' (a control's rounds against "
                         "the rounds)")
    ap.add_argument("--with-variant", action="append", default=[],
                    help="which variant of the --with file (default: its first; repeatable); with --with naming this "
                         "same file, variants' systems are paired (settings against the config on a dev cut)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.with_variant and not args.other:
        ap.error("--with-variant names variants of the --with file: give --with FILE too")

    v = variant(args.file, args.variant)
    per_query = per_query_ndcg(Path(args.store), v["run_id"])
    systems = {s: per_query[s] for s in v["metrics"] if s in per_query}
    if args.other:
        joined = [variant(args.other, name) for name in args.with_variant or [None]]
        for w in joined:
            theirs = per_query_ndcg(Path(args.store), w["run_id"])
            systems |= {f"{w['name']}: {s}": theirs[s] for s in w["metrics"]
                        if s in theirs and theirs[s] != systems.get(s)}
    pairs, rows = every_pair(systems)
    print(f"{v['name']} ({v['run_id']}), nDCG@10 over {len(next(iter(per_query.values())))} queries:")
    harness.table(["system", "against", "difference", "better / worse", "p"], rows)
    out = Path(args.out or Path(args.file).with_name("paired_" + Path(args.file).name.removeprefix("train_dev_")))
    harness.write_json(out, {"file": Path(args.file).name, "store": args.store, "variant": v["name"],
                             "run_id": v["run_id"], "with": args.other and Path(args.other).name,
                             "with_variants": [w["name"] for w in joined] if args.other else [], "pairs": pairs})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
