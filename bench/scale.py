"""Scale benchmark: peak memory and time per stage as the corpus grows to 10x and 100x SciFact.

    nice -n 10 python bench/scale.py --part bm25|dense [--scales 1,10,100] [--out bench/results/scale.json]
                                     [--interval 0.2] [--seed 0] [--keep-stores] [--timeout SECONDS]
                                     [--data-dir DIR] [--log-dir DIR]

Corpus (``synthetic_scifact``): all of SciFact (5183 passages, its queries and qrels, unchanged) plus
``(scale - 1) x 5183`` distractor passages. Each distractor copies the title and text lengths (in words)
of a random real passage and fills them with words drawn from the whole corpus's words (so with
SciFact's word frequencies): text no query was judged against, that BM25 must rank below the real
passages. The metrics stay meaningful (the judged passages are the real ones) and fall only as far as
distractors outrank them. Written as a BEIR folder, so ingest reads it like any dataset.

Part ``bm25``: ``configs/baselines_scifact.yaml`` with the flat BM25 system only (``bm25.variants=[flat]``,
``dense.enabled=false``): ingest -> select_queries -> bm25_index -> bm25_search -> evaluate, one cold
``irflow run`` per scale in a fresh store, sampled by ``memory.run_case`` (peak RSS of the irflow
process and of its whole process tree -- the Java indexer, Prefect's server -- from /proc; per stage
its seconds and the largest RSS sampled while it ran). Growth: tree peak at each scale over the 1x
one; the goal is <= 1.3 at 100x. The subprocess imports the irflow beside this script (PYTHONPATH).

Part ``dense``: the same flow with zero-shot MiniLM added (``dense.max_seq_length=64``: 2 CPU cores
encode ~10x faster than at MiniLM's 256, which is what lets 10x run in a session; the same length at
every scale) and ``runtime.shard_rows=10000``: encode_corpus reads and encodes 10k-passage shards, and
dense_search builds its flat index from the embeddings' row groups. Growth: as for bm25, and also
without the embeddings themselves (N x 384 float32), the one part that must grow.

Results merge into ``--out`` per (part, scale), so scales can be run piecemeal. The 100x case writes
~0.8 GB of JSONL and indexes 518k passages: minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import harness
import memory
from harness import ROOT, log

PARTS = ("bm25", "dense")
GROWTH_TARGET = 1.3
SCIFACT = harness.DATASETS / "scifact.zip"
PART_SETS = {"bm25": ["bm25.variants=[flat]", "dense.enabled=false"],
             "dense": ["bm25.variants=[flat]", "dense.max_seq_length=64", "runtime.shard_rows=10000"]}


def synthetic_scifact(scale: int, parent: Path, seed: int) -> tuple[Path, int]:
    """SciFact as a BEIR folder with ``(scale - 1) x`` its passages added as distractors; returns the
    folder and its number of passages. A folder already complete in ``parent`` is reused."""
    out = parent / f"scifact{scale}x-seed{seed}"
    done = out / "passages.txt"  # written last: a folder without it is incomplete
    if done.exists():
        return out, int(done.read_text())
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(SCIFACT) as z:
        real = [json.loads(ln) for ln in z.read("scifact/corpus.jsonl").decode("utf-8").splitlines() if ln.strip()]
        (out / "queries.jsonl").write_bytes(z.read("scifact/queries.jsonl"))
        for split in ("train", "test"):
            (out / "qrels" / f"{split}.tsv").write_bytes(z.read(f"scifact/qrels/{split}.tsv"))
    words = np.array([w for d in real for w in (d.get("title") or "").split() + d["text"].split()], dtype=object)
    lengths = np.array([(len((d.get("title") or "").split()), len(d["text"].split())) for d in real])
    rng = np.random.default_rng(seed)
    n = len(real) * scale
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for d in real:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
        for start in range(0, n - len(real), 10_000):  # numpy draws in blocks: 518k passages in ~2 minutes here
            shapes = lengths[rng.integers(0, len(lengths), min(10_000, n - len(real) - start))]
            drawn = words[rng.integers(0, len(words), int(shapes.sum()))]
            at = 0
            for k, (title_len, text_len) in enumerate(shapes, start=start):
                f.write(json.dumps({"_id": f"distractor-{k}", "title": " ".join(drawn[at:at + title_len]),
                                    "text": " ".join(drawn[at + title_len:at + title_len + text_len])},
                                   ensure_ascii=False) + "\n")
                at += title_len + text_len
    done.write_text(str(n))
    log(f"wrote {out}: {n:,} passages ({len(real):,} real), {(out / 'corpus.jsonl').stat().st_size / 1e6:,.0f} MB")
    return out, n


def run_scale(part: str, scale: int, folder: Path, args, log_dir: Path) -> dict:
    sets = [f"dataset.source={folder}", f"dataset.name=scifact{scale}x", "dataset.md5=null", *PART_SETS[part]]
    r = memory.run_case(f"{part}-{scale}x", "configs/baselines_scifact.yaml", sets, interval=args.interval,
                        keep_store=args.keep_stores, timeout=args.timeout, log_dir=log_dir)
    if part == "bm25":  # memory.py's embeddings fields are about dense stages, which this part does not run
        for k in ("embeddings_bytes", "tree_peak_minus_embeddings", "main_peak_minus_embeddings"):
            r.pop(k, None)
    return r


def summarise(results: dict) -> dict:
    """Per part: each scale's tree / main peak over the 1x run's."""
    out = {}
    for part in PARTS:
        one = results.get(f"{part}-1x")
        if not one or one.get("returncode") != 0:
            continue
        growth = {}
        for key, r in sorted(results.items(), key=lambda kv: kv[1].get("scale", 0)):
            if key.startswith(f"{part}-") and r.get("returncode") == 0 and r["scale"] > 1:
                growth[f"{r['scale']}x"] = {"tree_peak_ratio": round(r["tree_peak_rss"] / one["tree_peak_rss"], 3),
                                            "main_peak_ratio": round(r["main_peak_rss"] / one["main_peak_rss"], 3),
                                            "meets_target": r["tree_peak_rss"] / one["tree_peak_rss"] <= GROWTH_TARGET}
                if "tree_peak_minus_embeddings" in r and "tree_peak_minus_embeddings" in one:
                    growth[f"{r['scale']}x"]["tree_peak_minus_embeddings_ratio"] = round(
                        r["tree_peak_minus_embeddings"] / one["tree_peak_minus_embeddings"], 3)
        out[part] = {"target": GROWTH_TARGET, "growth": growth}
    return out


def print_tables(results: dict) -> None:
    rows, stage_rows = [], []
    for key, r in sorted(results.items(), key=lambda kv: (kv[1].get("part", ""), kv[1].get("scale", 0))):
        if r.get("returncode") != 0:
            rows.append([key, f"failed rc={r.get('returncode')}: {' / '.join(r.get('error', []))[:200]}"])
            continue
        ndcg = next(iter(r.get("ndcg@10", {}).values()), None)
        rows.append([key, f"{r['num_docs']:,}", f"{r['wall_seconds']:.0f}", memory.mb(r["main_peak_rss"]),
                     memory.mb(r["tree_peak_rss"]), memory.mb(r["tree_peak_anon"]), memory.mb(r["java_peak_rss"]),
                     r["tree_peak_stage"], "-" if ndcg is None else f"{ndcg:.4f}"])
        for stage, s in r.get("stages", {}).items():
            if s.get("seconds") is not None:
                stage_rows.append([key, stage, f"{s['seconds']:.1f}", memory.mb(s["main_rss"]),
                                   memory.mb(s["tree_rss"]), memory.mb(s["java_rss"])])
    harness.table(["case", "docs", "wall s", "main peak MB", "tree peak MB", "tree anon MB", "java peak MB",
                   "tree peak in", "nDCG@10"], rows)
    print()
    harness.table(["case", "stage", "seconds", "main MB", "tree MB", "java MB"], stage_rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", required=True, choices=PARTS)
    ap.add_argument("--scales", default="1,10,100", help="comma-separated corpus multiples of SciFact")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale.json"))
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between /proc samples")
    ap.add_argument("--seed", type=int, default=0, help="seed of the distractors")
    ap.add_argument("--keep-stores", action="store_true")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default: none)")
    ap.add_argument("--log-dir", default=None, help="where each run's stderr goes (default: a temp dir)")
    ap.add_argument("--data-dir", default=None,
                    help="where the synthetic corpora are written and kept for the next run (default: a temp dir, "
                         "removed)")
    args = ap.parse_args()
    scales = [int(s) for s in args.scales.split(",") if s.strip()]
    os.chdir(ROOT)
    # The `irflow` subprocess must import this checkout's irflow, not whichever is installed
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    out_path = Path(args.out)
    results = harness.prior_results(out_path)
    log_dir = harness.run_log_dir(args.log_dir, "irflow-scale-logs-")
    with harness.data_dir(args.data_dir, "irflow-scale-data-") as synth:
        for scale in scales:
            folder, n = synthetic_scifact(scale, synth, args.seed)
            load0 = harness.loadavg()
            r = run_scale(args.part, scale, folder, args, log_dir)
            r.update(part=args.part, scale=scale, passages=n, seed=args.seed, loadavg_start=load0,
                     loadavg_end=harness.loadavg(), finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
            results[f"{args.part}-{scale}x"] = r
            harness.write_json(out_path, {
                "description": "peak RSS and seconds per stage of cold `irflow run` flows over SciFact with "
                               "synthetic distractor passages, at several corpus sizes (bench/scale.py); bytes",
                "results": results, "summary": summarise(results)})
    print_tables(results)
    for part, s in summarise(results).items():
        for scale, g in s["growth"].items():
            print(f"\n{part} {scale}: tree peak {g['tree_peak_ratio']:.2f}x the 1x run's "
                  f"({'meets' if g['meets_target'] else 'misses'} <= {GROWTH_TARGET}); main {g['main_peak_ratio']:.2f}x")
    print(f"\nwrote {out_path}")
    return 0 if all(results[f"{args.part}-{s}x"].get("returncode") == 0 for s in scales) else 1


if __name__ == "__main__":
    sys.exit(main())
