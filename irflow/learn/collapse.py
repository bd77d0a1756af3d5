"""Embedding collapse: a trained encoder that maps every text to nearly one direction.

A pairwise loss can fall while the model learns nothing: RankNet's ``log(1 + exp(s- - s+))`` is
``log 2`` when the two scores tie, so if most positives start below their hard negatives (a larger first
loss), pulling every embedding onto one direction is the cheaper way down. Retrieval then ranks by
whatever is left (hubs: the same passages in every query's top 10). ``mean_cosine`` is the sign to watch:
the mean cosine between two different texts' embeddings: low for a healthy MiniLM, near 1 for a collapsed
STAR (bench/results/star_collapse_nfcorpus.json has both).
"""

from __future__ import annotations

import numpy as np

# Warn when the mean cosine ends at least this high ...
COLLAPSED = 0.9
# ... and what was left of the spread (1 - mean cosine) shrank to at most this share of the base model's: some models
# start anisotropic (a random tiny BERT, the tests'), and a cosine that only rose from there is no collapse.
SHRANK = 0.25
# passages whose embeddings' mean cosine is measured before and after training: ~5 s on 2 CPU cores
COSINE_PROBE = 128


def mean_cosine(vectors) -> float:
    """Mean cosine similarity over the distinct pairs of ``vectors`` (n, d), n >= 2: 1.0 when they all
    point one way, about 0 for random directions."""
    v = np.asarray(vectors, dtype=np.float64)
    if v.ndim != 2 or v.shape[0] < 2:
        raise ValueError(f"mean_cosine needs at least 2 vectors, got shape {v.shape}")
    u = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    n = u.shape[0]
    total = float(np.square(u.sum(0)).sum())  # sum over all (i, j) of cos(i, j), the n self-pairs included
    return (total - n) / (n * (n - 1))


def collapse_warning(before: float, after: float, what: str, loss: list[float] | None = None,
                     tie: float | None = None) -> str | None:
    """The warning for a model whose ``what`` embeddings' mean cosine went from ``before`` (the base model) to
    ``after`` (trained), or None when they did not collapse. ``loss``: the loss per step; ``tie``: the
    loss's value when every score ties (when the loss has one)."""
    if not (after >= COLLAPSED and 1 - after <= SHRANK * (1 - before)):  # False for nan: nothing measured
        return None
    msg = (f"the trained model's embeddings collapsed: the mean cosine between two of {what} is {after:.2f} "
           f"(base model {before:.2f}), so it ranks by little more than a passage's place on that one "
           f"direction")
    if loss:
        head, tail = loss[:10], loss[-10:]
        msg += f"; the loss went from {sum(head) / len(head):.3g} to {sum(tail) / len(tail):.3g}"
        if tie is not None:
            msg += f" (every score tied: {tie:.3g})"
    return msg + (". A usual cause: most positives start below their hard negatives, so tying every score is "
                  "the cheaper way down; a softmax loss on the same lines (loss: infonce) or surer positives "
                  "avoid it")
