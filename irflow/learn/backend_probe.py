"""``runtime.backend: auto``: torch or ONNX Runtime, whichever runs a model faster on this hardware.

ONNX Runtime is not faster everywhere: encoding the bundled sample's corpus on 2 idle cores it was slower
than torch on an Intel Xeon with AMX and faster on an AMD EPYC with AVX-512 (docs/how-to/onnx.md has the
measured seconds per kind of CPU). So ``auto`` times both on the same texts before a model's first stage
(``PROBE_TEXTS`` real passages from the bundled sample, at the stage's sequence length, after a warm-up
batch) and runs the faster one; ONNX Runtime only when it is at least ``irflow.engine.backends.MARGIN`` times faster (torch is
the reference path, and the probe has noise). The decision is remembered in the store per hardware,
model, task and thread count (``irflow.engine.backends``), said in the log, and recorded as each
stage run's ``backend``. Both backends are exact (fp32, allclose), so the choice is runtime, never keyed.
"""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

PROBE_TEXTS = 64
SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "scifact-sample.zip"


def sample_texts(n: int = PROBE_TEXTS) -> list[str]:
    """The first ``n`` passages (title and text) of the bundled sample: real text of a passage's length."""
    with zipfile.ZipFile(SAMPLE) as z:
        name = min((x for x in z.namelist() if x.endswith("corpus.jsonl")), key=len)
        lines = z.read(name).decode("utf-8").splitlines()[:n]
    return [f"{d.get('title', '')} {d['text']}".strip() for d in map(json.loads, lines)]


def _timed(call) -> float:
    call(8)  # warm-up: the first calls allocate and pick kernels
    t0 = time.perf_counter()
    call(None)
    return time.perf_counter() - t0


def time_backends(model_path: str, onnx_path: str, task: str, threads: int, max_length: int | None) -> dict:
    """Seconds each backend takes for the probe's texts: {"torch": s, "onnx": s}."""
    from irflow.engine.worker import torch_threads
    from irflow.learn import onnx_inference

    texts = sample_texts()
    length = max_length or 256
    if task == "embed":
        from sentence_transformers import SentenceTransformer

        from irflow.learn.encoding import encode_texts

        st = SentenceTransformer(model_path, device="cpu")
        st.max_seq_length = length
        models = {False: st, True: onnx_inference.load(onnx_path, threads, length)}

        def run(onnx: bool, n: int | None):
            encode_texts(models[onnx], texts[:n] if n else texts, 32, False, desc="backend probe", task="document")
    else:
        from irflow.learn.scoring import cross_encoder_scores

        pairs = [(" ".join(t.split()[:12]), t) for t in texts]

        def run(onnx: bool, n: int | None):
            cross_encoder_scores(model_path, pairs[:n] if n else pairs, batch_size=32, max_length=length,
                                 show_progress=False, onnx=onnx_path if onnx else None, threads=threads)
    with torch_threads(threads):
        torch_s = _timed(lambda n: run(False, n))
    onnx_s = _timed(lambda n: run(True, n))
    return {"torch": round(torch_s, 3), "onnx": round(onnx_s, 3), "texts": len(texts)}
