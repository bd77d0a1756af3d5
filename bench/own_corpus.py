"""A user with only documents: SciFact / NFCorpus run as unlabelled corpora, the qrels used afterwards.

For each dataset, the corpus alone (``corpus.jsonl`` in a folder, as GPL takes it) goes through GPL with
the offline config's settings (configs/gpl_<dataset>_offline.yaml) and each query source asked for:
``log`` (a query log: the train queries' texts, no labels) and ``ict`` / ``crop`` (model-free). The run
evaluates on its synthetic held-out set (a proxy) and selects a model; ``irflow export`` hands it out.
Then, outside the run, the real test qrels score what the run handed out and every dense model it made
(a baselines run per model on the BEIR zip), and say how far the proxy can be trusted:

- the exported model against the zero-shot model on the real test queries (nDCG@10, paired t-test):
  do no harm means never below beyond noise;
- the proxy's ranking of the systems against the real ranking (Kendall's tau, and whether both pick the
  same best dense model).

    python bench/own_corpus.py --dataset scifact --sources log ict --store /work/bench-own/scifact \\
        --out bench/results/own_corpus_scifact.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zipfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (sets the offline environment first)

GENERATE = {"log": {"source": "unlabelled"}, "ict": {"source": "ict"}, "crop": {"source": "crop"}}


def prepare(dataset: str, work: Path) -> tuple[Path, Path]:
    """The corpus alone in a folder (GPL's input), and the train queries' texts as a query log."""
    docs, log_file = work / "docs", work / "query_log.txt"
    if not (docs / "corpus.jsonl").exists():
        docs.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(harness.DATASETS / f"{dataset}.zip") as z:
            name = min((n for n in z.namelist() if n.endswith("corpus.jsonl")), key=len)
            (docs / "corpus.jsonl").write_bytes(z.read(name))
    if not log_file.exists():
        _, queries, train = harness.read_beir(harness.DATASETS / f"{dataset}.zip", "train")
        log_file.write_text("".join(queries[q].replace("\n", " ") + "\n" for q in sorted(train)))
    return docs, log_file


def config_for(dataset: str, source: str, docs: Path, log_file: Path, work: Path, qgen: bool,
               steps: int | None) -> Path:
    c = yaml.safe_load((harness.ROOT / "configs" / f"gpl_{dataset}_offline.yaml").read_text())
    if steps:
        c["train"]["steps"] = steps
    c["dataset"] = {"name": dataset, "source": str(docs), "proxy": {"documents": 200}}
    if source == "log":
        c["dataset"]["query_log"] = str(log_file)
    c["generate"] = GENERATE[source]
    c["train"].setdefault("qgen", {})["enabled"] = qgen
    c.get("label", {}).pop("positive", None)  # follows the query source
    path = work / f"gpl_{source}.yaml"
    path.write_text(yaml.safe_dump(c, sort_keys=False))
    return path


def real_scores(dataset: str, model: str, system: str, store: Path) -> tuple[dict, dict]:
    """The model (a stored id or a folder) and BM25 on the real test queries: (metrics by system, per-query
    nDCG@10 by system)."""
    from irflow import api
    from irflow.tools.report.runs import per_query_values

    cfg = {"flow": "baselines", "dataset": {"name": dataset, "source": str(harness.DATASETS / f"{dataset}.zip"),
                                            "split": "test"},
           "bm25": {"variants": ["flat"]}, "dense": {"model": model, "system": system, "batch_size": 64,
                                                     "max_seq_length": 256}}
    t = harness.timed(lambda: api.run(cfg, store=store), f"real qrels: {system}")
    catalog = api.catalog(store)
    per_query = {}
    for s in t.result.stages:
        if s.name.startswith("evaluate[") and "per_query" in s.outputs:
            per_query.update(per_query_values(catalog, s.outputs["per_query"], "ndcg@10"))
    return {m["system"]: m for m in t.result.metrics}, per_query


def kendall_tau(a: dict[str, float], b: dict[str, float]) -> float:
    keys = sorted(set(a) & set(b))
    conc = disc = 0
    for i, x in enumerate(keys):
        for y in keys[i + 1:]:
            s = (a[x] - a[y]) * (b[x] - b[y])
            conc += s > 0
            disc += s < 0
    return (conc - disc) / max(1, conc + disc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, choices=("scifact", "nfcorpus"))
    ap.add_argument("--sources", nargs="+", default=["log", "ict"], choices=sorted(GENERATE))
    ap.add_argument("--store", required=True, help="the store (kept: a second call reuses every stage)")
    ap.add_argument("--qgen", action="store_true", help="also train the QGen (MNRL) student")
    ap.add_argument("--steps", type=int, help="GPL training steps (default: the offline config's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from irflow import api

    from irflow.tools import export
    from irflow.learn.stats import paired

    store = Path(args.store)
    work = store.parent / f"{store.name}-inputs"
    work.mkdir(parents=True, exist_ok=True)
    docs, log_file = prepare(args.dataset, work)
    out: dict = {"dataset": args.dataset, "steps": args.steps, "runs": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if Path(args.out).exists():  # sources run before into the same file: the agreement covers them all
        out["runs"] = json.loads(Path(args.out).read_text()).get("runs", {})
    proxy_all, real_all, per_query_real = {}, {}, {}
    for source in args.sources:
        cfg = config_for(args.dataset, source, docs, log_file, work, args.qgen, args.steps)
        t = harness.run(cfg, store=store)
        r = t.result
        exported = store.parent / f"{store.name}-exported-{source}"
        done = export.export(api.catalog(store), r.run_id, exported, force=True)
        proxy = {m["system"]: m["ndcg@10"] for m in r.metrics}
        # the run's dense models and the exported folder, scored on the real test qrels
        real, pq = {}, {}
        for system, model_id in r.selected["models"].items():
            name = system if system == r.selected["start"] else f"{system}-{source}"
            model = model_id.removeprefix("hub:")  # the starting model by its hub id (MiniLM: offline, packaged)
            metrics, per_query = real_scores(args.dataset, model, name, store)
            real[name], pq[name] = metrics[name]["ndcg@10"], per_query[name]
            real.setdefault("bm25-flat", metrics["bm25-flat"]["ndcg@10"])
            pq.setdefault("bm25-flat", per_query["bm25-flat"])
        metrics, per_query = real_scores(args.dataset, str(exported), "exported", store)
        start = r.selected["start"]
        harm = paired(pq[start], per_query["exported"])
        out["runs"][source] = {
            "run_id": r.run_id, "wall_seconds": round(t.wall_seconds, 1), "computed": len(r.computed),
            "evaluation": r.evaluation, "selected": r.selected, "exported": str(done.out),
            "proxy_ndcg@10": proxy, "real_ndcg@10": real,
            "exported_real_ndcg@10": metrics["exported"]["ndcg@10"],
            "exported_vs_zero_shot": {"mean_diff": round(harm.mean_diff, 4), "t_pvalue": round(harm.t_pvalue, 4),
                                      "wins": harm.wins, "losses": harm.losses, "n": harm.n},
            "stage_seconds": {s.name: s.seconds for s in r.stages if s.status == "computed"},
        }
        for system, v in proxy.items():
            key = system if system in (start, "bm25-flat") or system.startswith("hybrid") else f"{system}-{source}"
            proxy_all[key] = v
        real_all.update(real)
        per_query_real.update(pq)
        harness.write_json(args.out, out)
    for source, r in out["runs"].items():
        start = r["selected"]["start"]
        for system, v in r["proxy_ndcg@10"].items():
            key = system if system in (start, "bm25-flat") or system.startswith("hybrid") else f"{system}-{source}"
            proxy_all.setdefault(key, v)
        for system, v in r["real_ndcg@10"].items():
            real_all.setdefault(system, v)
    dense = [s for s in real_all if s != "bm25-flat"]
    both = sorted(set(proxy_all) & set(real_all))
    out["agreement"] = {
        "systems": both, "proxy": {s: proxy_all[s] for s in both}, "real": {s: real_all[s] for s in both},
        "kendall_tau": round(kendall_tau({s: proxy_all[s] for s in both}, {s: real_all[s] for s in both}), 3),
        "kendall_tau_dense": round(kendall_tau({s: proxy_all[s] for s in dense if s in proxy_all},
                                               {s: real_all[s] for s in dense if s in proxy_all}), 3),
        "best_dense_proxy": max((s for s in dense if s in proxy_all), key=proxy_all.get),
        "best_dense_real": max(dense, key=real_all.get),
    }
    harness.write_json(args.out, out)
    harness.table(["system", "proxy nDCG@10", "real nDCG@10"],
                  [[s, f"{proxy_all[s]:.4f}", f"{real_all[s]:.4f}"] for s in both])
    for source, r in out["runs"].items():
        e = r["exported_vs_zero_shot"]
        print(f"{source}: selected {r['selected']['system']}; exported real nDCG@10 {r['exported_real_ndcg@10']:.4f} "
              f"vs zero-shot {r['real_ndcg@10'][r['selected']['start']]:.4f} ({e['mean_diff']:+.4f}, p {e['t_pvalue']})")
    a = out["agreement"]
    print(f"Kendall tau {a['kendall_tau']} (dense only {a['kendall_tau_dense']}); best dense: proxy "
          f"{a['best_dense_proxy']}, real {a['best_dense_real']}")


if __name__ == "__main__":
    main()
