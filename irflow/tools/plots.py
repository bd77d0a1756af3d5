"""Figures of what happened inside a run, as PNG bytes a page can inline.

Pure functions: tables and arrays in (a ``training_losses`` table, pseudo-label margins, a teacher's
scores and the denoise audit), PNG bytes or plain numbers out; nothing here reads the store (that is
``irflow.tools.inside``). The numbers a caption quotes come from the ``*_summary`` functions, so a caption
and its figure never disagree.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: bytes only
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    """The figure as PNG bytes (fixed metadata: the same numbers give the same bytes)."""
    plt = _pyplot()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


# ---- training losses ------------------------------------------------------------------------------
def loss_summary(losses: pa.Table) -> dict:
    """Steps, first and last loss, and the lowest loss and its step, of one ``training_losses`` table."""
    step = losses.column("step").to_numpy()
    loss = losses.column("loss").to_numpy().astype(np.float64)
    best = int(np.nanargmin(loss)) if np.isfinite(loss).any() else 0
    return {"steps": int(len(step)), "first": float(loss[0]), "last": float(loss[-1]),
            "min": float(loss[best]), "min_step": int(step[best])}


def loss_curves(curves: dict[str, pa.Table], columns: int = 3) -> bytes:
    """Loss per step of each trainer, one small panel per trainer (its own y range: a cross-encoder's
    BCE and a dual encoder's InfoNCE are not on one scale), the learning rate in grey on a right axis."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    n = max(len(curves), 1)
    cols = min(columns, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.7 * rows), dpi=100, squeeze=False)
    for ax in axes.flat[len(curves):]:
        ax.set_visible(False)
    for ax, (name, t) in zip(axes.flat, curves.items()):
        step, loss, lr = (t.column(c).to_numpy() for c in ("step", "loss", "lr"))
        ax.plot(step, loss, marker="." if len(step) <= 50 else None, color="C0", linewidth=1)
        ax.set_title(name, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("loss", fontsize=8, color="C0")
        ax.tick_params(labelsize=7)
        lr_ax = ax.twinx()
        lr_ax.plot(step, lr, color="0.6", linewidth=0.8, linestyle="--")
        lr_ax.set_ylabel("lr", fontsize=7, color="0.5")
        lr_ax.tick_params(labelsize=6, colors="0.5")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        lr_ax.yaxis.get_offset_text().set_fontsize(6)
    return _png(fig)


# ---- GPL: the teacher's margins -------------------------------------------------------------------
def margin_summary(margins: np.ndarray) -> dict:
    """Pairs, mean, median, and how many margins are <= 0 (the teacher scores the negative at least as
    high as the positive: a pair that teaches the student the wrong order, or nothing)."""
    m = np.asarray(margins, dtype=np.float64)
    return {"pairs": int(m.size), "mean": float(m.mean()), "median": float(np.median(m)),
            "not_positive": int((m <= 0).sum())}


def margin_histogram(margins: np.ndarray, bins: int = 40) -> bytes:
    """Distribution of pseudo-label margins score(q, pos) - score(q, neg), a line at 0 and at the mean."""
    plt = _pyplot()
    m = np.asarray(margins, dtype=np.float64)
    s = margin_summary(m)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    ax.hist(m, bins=bins, color="C0", alpha=0.85)
    ax.axvline(0.0, color="k", linewidth=1)
    ax.axvline(s["mean"], color="C3", linestyle="--", linewidth=1, label=f"mean {s['mean']:.4g}")
    ax.set_xlabel("margin = teacher score(q, pos) - score(q, neg)")
    ax.set_ylabel("pairs")
    ax.set_title(f"pseudo-label margins ({s['pairs']} pairs; {s['not_positive']} <= 0)", fontsize=10)
    ax.legend(fontsize=8)
    return _png(fig)


# ---- RocketQA: the teacher's probabilities by rank bucket -----------------------------------------
def bucket_bounds(names: list[str]) -> list[tuple[int, int, str]]:
    """(lo, hi, name) of audit bucket names such as "1-5" (``irflow.stages.denoise.bucket_names``)."""
    out = []
    for name in names:
        lo, hi = name.split("-")
        out.append((int(lo), int(hi), name))
    return sorted(out)


def bucket_summary(scores: pa.Table, audit: pa.Table) -> list[dict]:
    """Per rank bucket of the denoised lists, in rank order: the audit's counts summed over queries
    (candidates, known_positives, dropped, kept) and the teacher probabilities of the bucket's
    candidates that are not judged positives (``probs``), from the ``teacher_scores`` table."""
    names = sorted(set(audit.column("bucket").to_pylist()))
    sums = audit.group_by("bucket").aggregate([(c, "sum") for c in ("candidates", "known_positives", "dropped",
                                                                      "kept")])
    by_name = {r["bucket"]: r for r in sums.to_pylist()}
    audited = pc.is_in(scores.column("query_id"), value_set=pc.unique(audit.column("query_id")))
    s = scores.filter(pc.and_(audited, pc.invert(scores.column("positive"))))
    rank, prob = s.column("rank").to_numpy(), s.column("prob").to_numpy()
    out = []
    for lo, hi, name in bucket_bounds(names):
        r = by_name[name]
        out.append({"bucket": name, **{c: int(r[f"{c}_sum"]) for c in ("candidates", "known_positives", "dropped",
                                                                        "kept")},
                    "probs": prob[(rank >= lo) & (rank <= hi)].astype(np.float64)})
    return out


def bucket_probabilities(scores: pa.Table, audit: pa.Table, threshold: float | None = None) -> bytes:
    """Left: the teacher's probability of relevance of the retrieved candidates (judged positives left
    out) per rank bucket, with the denoising threshold; right: what denoising did with each bucket's
    candidates (dropped as likely false negatives, kept as negatives, judged positives, unused: below
    the threshold but past the query's quota)."""
    plt = _pyplot()
    buckets = bucket_summary(scores, audit)
    names = [b["bucket"] for b in buckets]
    x = np.arange(len(buckets))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    data = [b["probs"] if b["probs"].size else np.array([np.nan]) for b in buckets]
    left.boxplot(data, positions=x, widths=0.6, showfliers=False)
    for i, p in enumerate(data):  # every candidate, jittered: small lists show their points
        jitter = np.random.default_rng(i).uniform(-0.2, 0.2, len(p))
        left.scatter(i + jitter, p, s=4, alpha=0.35, color="C0")
    if threshold is not None:
        left.axhline(threshold, color="C3", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
        left.legend(fontsize=8, loc="upper right")
    left.set_xticks(x, names)
    left.set_ylim(-0.03, 1.03)
    left.set_xlabel("retriever rank")
    left.set_ylabel("teacher probability")
    left.set_title("the teacher's probabilities of the candidates (not judged)", fontsize=10)
    parts = [("dropped", "C3"), ("kept", "C2"), ("known_positives", "C1"), ("unused", "0.75")]
    bottom = np.zeros(len(buckets))
    for key, color in parts:
        if key == "unused":
            v = np.array([b["candidates"] - b["known_positives"] - b["dropped"] - b["kept"] for b in buckets])
        else:
            v = np.array([b[key] for b in buckets])
        right.bar(x, v, bottom=bottom, color=color, label=key.replace("_", " "))
        bottom += v
    right.set_xticks(x, names)
    right.set_xlabel("retriever rank")
    right.set_ylabel("candidates (all queries)")
    right.set_title("what denoising did", fontsize=10)
    right.legend(fontsize=8)
    return _png(fig)
