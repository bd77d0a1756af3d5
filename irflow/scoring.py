"""Cross-encoder scoring: one relevance logit per (query, passage) pair.

Any Hugging Face sequence-classification checkpoint with one output logit (the layout of
``cross-encoder/ms-marco-*``, or one made by the ``train_cross_encoder`` stage). Raw logits are
returned, as GPL uses them for margins; ``sigmoid`` of them is the probability RocketQA thresholds.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm


def load_cross_encoder(path: str, device: str = "cpu"):
    """(tokenizer, model) of a 1-logit cross-encoder, on ``device``, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
    if model.config.num_labels != 1:
        raise ValueError(f"cross-encoder {path}: expected one output logit, the model has "
                         f"{model.config.num_labels} labels")
    return tok, model


def cross_encoder_scores(model_path: str, pairs: Sequence[tuple[str, str]], *, batch_size: int,
                         max_length: int, device: str = "cpu", autocast=None,
                         show_progress: bool = True) -> np.ndarray:
    """Raw logits for (query text, passage text) pairs, in input order.

    Pairs are batched in order of length (less padding). ``autocast``: a context manager factory for
    reduced precision (``StageRuntime.autocast``); None runs in fp32.
    """
    import torch

    tok, model = load_cross_encoder(model_path, device)
    n = len(pairs)
    out = np.empty(n, dtype=np.float32)
    order = sorted(range(n), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    with torch.inference_mode(), (autocast() if autocast else contextlib.nullcontext()):
        for start in tqdm(range(0, n, batch_size), desc="cross-encoder scoring", unit=" batch",
                          disable=not show_progress, mininterval=2):
            idx = order[start:start + batch_size]
            enc = tok([pairs[i][0] for i in idx], [pairs[i][1] for i in idx], padding=True,
                      truncation="longest_first", max_length=max_length, return_tensors="pt").to(device)
            out[idx] = model(**enc).logits[:, 0].float().cpu().numpy()
    return out
