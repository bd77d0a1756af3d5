"""Keep it adapted: a corpus that changes, run after run, against cold runs of each version.

SciFact's corpus as a user's own documents (``corpus.jsonl``, no labels: the proxy evaluation), in
versions: 90% -> 95% -> 100% of its documents, then 1% of them edited and 1% deleted. Each version is
written over the same file and run with the same config on one store (what a nightly schedule does);
each later version is also run cold, on a store of its own. For every stage: rows computed and reused
(map stages, irflow.engine.row_reuse) and seconds, incremental against cold; every dataset id and metric of
the incremental run must equal the cold run's.

    python bench/incremental.py --work /work/bench-inc --out bench/results/incremental_scifact.json

The recipe is ``baselines`` on the own corpus (BM25, the zero-shot MiniLM, their fusion; proxy queries
of held-out documents): its map stages are the corpus encoding and the proxy's query generation;
``--recipe gpl`` adds GPL (ICT queries, ``--steps`` training steps: its training and the student's
encoding depend on the whole corpus and recompute).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import zipfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (sets the offline environment first)

EDIT_SUFFIX = " (revised)"


def documents(dataset: str) -> list[dict]:
    with zipfile.ZipFile(harness.DATASETS / f"{dataset}.zip") as z:
        name = min((n for n in z.namelist() if n.endswith("corpus.jsonl")), key=len)
        return [json.loads(line) for line in z.read(name).decode().splitlines() if line.strip()]


def versions(docs: list[dict]) -> dict[str, list[dict]]:
    """90%, 95%, 100% of the documents (in corpus order), then 1% edited and 1% deleted (every 100th)."""
    n = len(docs)
    edited = [dict(d, text=d["text"] + EDIT_SUFFIX) if i % 100 == 0 else d for i, d in enumerate(docs)]
    return {"v90": docs[: int(n * 0.90)], "v95": docs[: int(n * 0.95)], "v100": docs,
            "edit1-del1": [d for i, d in enumerate(edited) if i % 100 != 50]}


def write(docs: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tmp.replace(path)  # a schedule reading the folder sees the old file or the new one, never half


def config(recipe: str, source: Path, work: Path, steps: int) -> Path:
    c = {"flow": recipe, "dataset": {"name": "scifact-own", "source": str(source), "proxy": {"documents": 200}},
         "bm25": {"variants": ["flat"]}, "dense": {"model": "all-MiniLM-L6-v2", "batch_size": 64,
                                                    "max_seq_length": 256}}
    if recipe == "gpl":
        base = yaml.safe_load((harness.ROOT / "configs" / "gpl_scifact_offline.yaml").read_text())
        c.update({k: base[k] for k in ("mine", "teacher", "label", "train") if k in base})
        c["generate"] = {"source": "ict"}
        c["train"]["steps"] = steps
        c.setdefault("label", {}).pop("positive", None)
    path = work / f"{recipe}.yaml"
    path.write_text(yaml.safe_dump(c, sort_keys=False))
    return path


def summary(result) -> dict:
    return {"run_id": result.run_id, "seconds": result.seconds,
            "stages": {s.name: {"status": s.status, "seconds": s.seconds, "rows": s.rows, "outputs": s.outputs}
                       for s in result.stages},
            "metrics": {m["system"]: m["ndcg@10"] for m in result.metrics},
            "selected": (result.selected or {}).get("system")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="scifact", choices=("scifact", "nfcorpus"))
    ap.add_argument("--recipe", default="baselines", choices=("baselines", "gpl"))
    ap.add_argument("--steps", type=int, default=40, help="gpl: training steps")
    ap.add_argument("--limit", type=int, help="the first N documents only (a quick try of the script)")
    ap.add_argument("--work", required=True, help="stores and corpus files go here (emptied first)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--summarize", action="store_true", help="only print (and rewrite) the table of --out")
    args = ap.parse_args()
    if args.summarize:
        out = json.loads(Path(args.out).read_text())
        for e in out["versions"].values():
            if "cold" in e:
                map_stages(e)
        harness.write_json(args.out, out)
        summarize(out)
        return

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    docs = documents(args.dataset)[: args.limit]
    out: dict = {"dataset": args.dataset, "recipe": args.recipe, "documents": len(docs), "versions": {}}
    source = work / "my-docs" / "corpus.jsonl"  # the user's file, rewritten for each version
    cfg = config(args.recipe, source, work, args.steps)
    previous = None
    for name, version in versions(docs).items():
        write(version, source)
        inc = harness.run(cfg, store=work / "store")
        entry = {"documents": len(version), "incremental": summary(inc.result), "wall_incremental": inc.wall_seconds}
        if previous is not None:  # the first version is a cold run already
            cold_source = work / f"cold-{name}" / "corpus.jsonl"
            write(version, cold_source)
            cold_cfg = config(args.recipe, cold_source, work / f"cold-{name}", args.steps)
            cold = harness.run(cold_cfg, store=work / f"cold-{name}" / "store")
            entry.update(cold=summary(cold.result), wall_cold=cold.wall_seconds)
            inc_stages, cold_stages = entry["incremental"]["stages"], entry["cold"]["stages"]
            # the user's file has another path in the cold run: the ingest's source fingerprint differs,
            # its output (the corpus, by content) must not
            entry["same_datasets"] = all(inc_stages[s]["outputs"] == cold_stages[s]["outputs"] for s in inc_stages
                                         if s in cold_stages)
            entry["different"] = [s for s in inc_stages if s in cold_stages
                                  and inc_stages[s]["outputs"] != cold_stages[s]["outputs"]]
            entry["same_metrics"] = entry["incremental"]["metrics"] == entry["cold"]["metrics"]
            entry["changed_fraction"] = _changed(previous, version)
            map_stages(entry)
        out["versions"][name] = entry
        previous = version
        harness.write_json(args.out, out)
    summarize(out)


def row_mapped(label: str) -> bool:
    """Whether a stage label is a call of a stage that reuses rows (a row map: irflow.engine.row_reuse)."""
    from irflow.stages.dense import encode_corpus
    from irflow.stages.generate_queries import generate_queries

    return label.split("[")[0] in {s.name for s in (encode_corpus, generate_queries) if s.rows is not None}


def map_stages(entry: dict) -> None:
    """The row-mapped stages of a version's incremental run against its cold run: rows and seconds."""
    inc_stages, cold_stages = entry["incremental"]["stages"], entry["cold"]["stages"]
    mapped = [s for s in inc_stages if row_mapped(s)]
    inc_map = sum(inc_stages[s]["seconds"] for s in mapped if inc_stages[s]["status"] == "computed")
    cold_map = sum(cold_stages[s]["seconds"] for s in mapped if s in cold_stages)
    entry["map_stages"] = {s: {"rows": inc_stages[s]["rows"], "seconds": inc_stages[s]["seconds"],
                               "cold_seconds": cold_stages.get(s, {}).get("seconds")} for s in mapped}
    entry["map_seconds"] = {"incremental": round(inc_map, 1), "cold": round(cold_map, 1),
                            "ratio": round(inc_map / cold_map, 3) if cold_map else None}


def summarize(out: dict) -> None:
    rows = []
    for name, e in out["versions"].items():
        if "cold" not in e:
            continue
        enc = next((v for s, v in e["map_stages"].items() if s.startswith("encode_corpus")), None)
        rows.append([name, f"{e['changed_fraction']:.1%}", f"{enc['rows']['computed']}/{enc['rows']['input']}" if enc
                     else "-", f"{e['map_seconds']['incremental']:.0f}", f"{e['map_seconds']['cold']:.0f}",
                     f"{e['map_seconds']['ratio']:.2f}", f"{e['wall_incremental']:.0f}", f"{e['wall_cold']:.0f}",
                     _same(e), "yes" if e["same_metrics"] else "NO"])
    harness.table(["version", "changed", "encoded", "map s inc", "map s cold", "ratio", "wall inc", "wall cold",
                   "same ids", "same metrics"], rows)


def _same(e: dict) -> str:
    """Whether every dataset id equals the cold run's. A BM25 index is a Lucene directory whose segment files
    carry a random id and a timestamp: two builds of one corpus never share bytes (their searches do)."""
    if e["same_datasets"]:
        return "yes"
    lucene = [s for s in e["different"] if s.startswith("bm25_index[")]
    if lucene == e["different"]:
        return "yes, but the Lucene index"
    return f"NO: {e['different']}"


def _changed(before: list[dict], after: list[dict]) -> float:
    """Documents of ``after`` that are new or edited since ``before``, plus those deleted, over ``after``."""
    old = {d["_id"]: d for d in before}
    new = {d["_id"]: d for d in after}
    changed = sum(1 for k, d in new.items() if old.get(k) != d) + sum(1 for k in old if k not in new)
    return changed / len(after)


if __name__ == "__main__":
    main()
