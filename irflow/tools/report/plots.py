"""Figures of a report, as PNG bytes (matplotlib, Agg: no display) for inlining as base64."""

from __future__ import annotations

import io

import numpy as np


def distribution_png(values: list[float], metric: str, system: str, mean: float, ci: tuple[float, float]) -> bytes:
    """A histogram of one system's per-query ``metric`` values (bins of 0.05 over [0, 1], or over the
    values' range if they leave it), with the mean and its confidence interval marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = np.asarray(values, dtype=float)
    lo, hi = min(0.0, float(v.min())), max(1.0, float(v.max()))
    fig, ax = plt.subplots(figsize=(4.2, 2.1), dpi=90)
    ax.hist(v, bins=np.linspace(lo, hi, 21), color="#4c72b0", edgecolor="white", zorder=2)
    ax.axvspan(ci[0], ci[1], color="#dd8452", alpha=0.25, zorder=1, label=f"95% CI [{ci[0]:.3f}, {ci[1]:.3f}]")
    ax.axvline(mean, color="#dd8452", linewidth=1.5, zorder=3, label=f"mean {mean:.4f}")
    ax.set_xlim(lo, hi)
    ax.set_xlabel(f"{metric} per query ({len(v)} queries)", fontsize=8)
    ax.set_ylabel("queries", fontsize=8)
    ax.set_title(system, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper center", frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    # no Software metadata: the same numbers give the same bytes (and no URL hides in the page)
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
