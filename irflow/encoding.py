"""Bi-encoder encoding: length-sorted batches, a progress bar, float32 output in input order."""

from __future__ import annotations

import contextlib

import numpy as np
from tqdm.auto import tqdm

from irflow.processes import check_interrupted


def embedding_dim(st_model) -> int:
    # sentence-transformers >= 6 renamed the method; keep working with both.
    get = getattr(st_model, "get_embedding_dimension", None) or st_model.get_sentence_embedding_dimension
    return int(get())


def encode_texts(st_model, texts: list[str], batch_size: int, normalize: bool, desc: str = "encode",
                 autocast=None) -> np.ndarray:
    """Texts sorted by length before batching, so each batch pads to similar lengths (what
    ``SentenceTransformer.encode`` does inside one call; done here over all texts so the progress bar
    counts texts). ``autocast``: a context manager factory for reduced precision (None: fp32)."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    out = np.zeros((len(texts), embedding_dim(st_model)), dtype=np.float32)
    with tqdm(total=len(texts), desc=desc, unit=" texts", mininterval=2) as bar, \
            (autocast() if autocast else contextlib.nullcontext()):
        for start in range(0, len(texts), batch_size):
            check_interrupted()
            idx = order[start:start + batch_size]
            emb = st_model.encode([texts[i] for i in idx], batch_size=len(idx), convert_to_tensor=True,
                                  normalize_embeddings=normalize, show_progress_bar=False)
            out[idx] = emb.float().cpu().numpy()
            bar.update(len(idx))
    return out
