"""Peak memory of measuring pair lengths before cross-encoder scoring: one tokenizer call, or chunks.

    .venv/bin/python bench/token_lengths_memory.py [--dataset nfcorpus] [--depth 50] [--max-length 128]

RocketQA's denoising scores M_D0's top ``depth`` for every train query (NFCorpus: 2,590 x 50 = 129,500
pairs). ``irflow.learn.scoring.cross_encoder_scores`` first measures each pair's token length to batch pairs of
one length together. Done in one tokenizer call, a fast tokenizer holds every pair's encoding until the
call returns; ``irflow.learn.encoding.token_lengths`` tokenises ``LENGTH_CHUNK`` pairs at a time. Each way runs
in a fresh process (its peak RSS is its own) on the same pairs: each train query with ``depth`` passages
of a seeded draw (the length of a pair is what costs, not which passage it is). Checks that both give the
same lengths; writes ``bench/results/token_lengths_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from harness import DATASETS, ROOT

CHILD = """
import hashlib, json, resource, sys, time
sys.path.insert(0, {root!r})
from transformers import AutoTokenizer
from irflow.learn import encoding
from irflow.engine.models import minilm_path
pairs = json.load(open({pairs!r}))
tok = AutoTokenizer.from_pretrained(minilm_path())
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
if {mode!r} == "one call":
    lengths = [len(i) for i in tok([q for q, _ in pairs], [d for _, d in pairs], truncation="longest_first",
                                   max_length={max_length})["input_ids"]]
else:
    lengths = encoding.token_lengths(tok, [q for q, _ in pairs], [d for _, d in pairs], truncation="longest_first",
                                     max_length={max_length})
print(json.dumps({{"seconds": round(time.perf_counter() - t, 1),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                  "peak_before_mb": base // 1024,
                  "lengths_sha256": hashlib.sha256(json.dumps(lengths).encode()).hexdigest()}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="nfcorpus")
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench/results/token_lengths_memory.json"))
    args = ap.parse_args()

    corpus, queries, qrels = harness.read_beir(DATASETS / f"{args.dataset}.zip", "train")
    texts = [f"{d.get('title') or ''} {d.get('text') or ''}".strip() for d in corpus]
    rng = random.Random(0)
    pairs = [(queries[q], texts[i]) for q in sorted(qrels) for i in rng.sample(range(len(texts)), args.depth)]
    path = Path(tempfile.mkdtemp(prefix="irflow-lengths-")) / "pairs.json"
    path.write_text(json.dumps(pairs))
    from irflow.learn import encoding

    out = {"dataset": args.dataset, "pairs": len(pairs), "queries": len(qrels), "depth": args.depth,
           "max_length": args.max_length, "chunk": encoding.LENGTH_CHUNK, "modes": {}}
    for mode in ("one call", "chunks"):
        harness.log(f"{mode}: {len(pairs):,} pairs")
        code = CHILD.format(root=str(ROOT), pairs=str(path), mode=mode, max_length=args.max_length)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out["modes"][mode] = json.loads(r.stdout.strip().splitlines()[-1])
    path.unlink()
    path.parent.rmdir()
    m = out["modes"]
    out["same_lengths"] = m["one call"]["lengths_sha256"] == m["chunks"]["lengths_sha256"]
    out["machine"] = harness.machine()
    harness.table(["mode", "peak RSS (MB)", "before (MB)", "seconds"],
                  [[k, v["peak_rss_mb"], v["peak_before_mb"], v["seconds"]] for k, v in m.items()])
    print(f"same lengths: {out['same_lengths']}")
    harness.write_json(args.out, out)


if __name__ == "__main__":
    main()
