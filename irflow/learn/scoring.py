"""Cross-encoder scoring: one relevance score per (query, passage) pair.

Any Hugging Face sequence-classification checkpoint with one output logit (the layout of
``cross-encoder/ms-marco-*``, or one made by the ``train_cross_encoder`` stage) or two labels
(RocketQA's cross-encoders; the score is ``logit[1] - logit[0]``, so that its sigmoid is the softmax
probability of label 1). Raw scores are returned, as GPL uses them for margins; ``sigmoid`` of them
is the probability RocketQA thresholds.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from irflow.learn.cross_encoders import NotACrossEncoder, check_cross_encoder, load_cross_encoder  # noqa: F401

log = logging.getLogger("irflow.pseudo_label")  # named after the labelling stage, whose warning this is


def relevance(logits):
    """One score per row: the logit of a 1-logit head, ``l1 - l0`` of a 2-label head."""
    return logits[:, 0] if logits.shape[1] == 1 else logits[:, 1] - logits[:, 0]


def cross_encoder_scores(model_path: str, pairs: Sequence[tuple[str, str]], *, batch_size: int,
                         max_length: int, device: str = "cpu", autocast=None,
                         show_progress: bool = True, onnx: str | None = None, threads: int = 1) -> np.ndarray:
    """Raw logits for (query text, passage text) pairs, in input order.

    Pairs are batched by token length, each batch padded to its length bucket
    (``irflow.learn.encoding.length_batches``) and filled up to ``batch_size`` rows (repeating its first
    pair, whose extra scores are dropped): every batch of a bucket has one shape, so a pair's score
    does not depend on the other pairs of its batch, and scoring in shards gives the scores of scoring
    all at once, bit for bit on CPU. (Without the fill a short last batch changed the last bits of a
    score: the kernels a matmul takes depend on its row count; GPL's teacher in shards of 16 queries
    differed in 2 of 146 scores.) ``autocast``: a context manager factory for reduced precision
    (``StageRuntime.autocast``); None runs in fp32. ``onnx``: the model's exported directory
    (``StageRuntime.onnx_model``): scored on ONNX Runtime with ``threads`` threads, same batches
    (``irflow.learn.onnx_inference``).
    """
    import torch

    from irflow.engine.worker import per_worker

    if onnx:
        from irflow.learn import onnx_inference

        model = per_worker(("onnx", onnx, threads, None), lambda: onnx_inference.load(onnx, threads))
        tok = model.tokenizer
    else:
        tok, model = per_worker(("cross_encoder", model_path, device), lambda: load_cross_encoder(model_path, device))
    from irflow.learn.encoding import length_batches, token_lengths

    n = len(pairs)
    out = np.empty(n, dtype=np.float32)
    if not n:
        return out
    lengths = token_lengths(tok, [q for q, _ in pairs], [d for _, d in pairs], truncation="longest_first",
                            max_length=max_length)
    with torch.inference_mode(), (autocast() if autocast and not onnx else contextlib.nullcontext()):
        for padded, idx in tqdm(length_batches(lengths, batch_size, max_length), desc="cross-encoder scoring",
                                unit=" batch", disable=not show_progress, mininterval=2):
            if onnx:
                # int8 runs pair by pair (onnx_inference: batch invariance), so no fill is needed there
                rows = idx if model.row_wise else idx + idx[:1] * (batch_size - len(idx))
                out[idx] = relevance(model.logits([pairs[i] for i in rows], padded).astype(np.float32))[:len(idx)]
                continue
            rows = idx + idx[:1] * (batch_size - len(idx))  # one shape per bucket (see above)
            enc = tok([pairs[i][0] for i in rows], [pairs[i][1] for i in rows], padding="max_length",
                      truncation="longest_first", max_length=padded, return_tensors="pt").to(device)
            out[idx] = relevance(model(**enc).logits.float()).cpu().numpy()[:len(idx)]
    return out


def least_squares_scale(teacher_margins: np.ndarray, student_margins: np.ndarray) -> float:
    """argmin_a sum (a * t - s)^2 = <t, s> / <t, t>: the factor that puts a teacher's margins ``t`` in the
    units of the margins ``s`` a student regresses on (pseudo-labels, TAS-B's second teacher).

    If teacher and student disagree on the sample (a <= 0), falls back to the ratio of RMS values
    so the scaled margins still have the student's magnitude (with a warning).
    """
    t = np.asarray(teacher_margins, dtype=np.float64)
    s = np.asarray(student_margins, dtype=np.float64)
    tt = float(t @ t)
    if tt == 0.0:
        return 1.0
    a = float(t @ s) / tt
    if a <= 0:
        a = float(np.sqrt((s @ s) / tt)) or 1.0
        log.warning("scale: teacher and student margins are not positively related on the sample; "
                    "using the RMS ratio %.4g instead of least squares", a)
    return a
