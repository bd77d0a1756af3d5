"""Figures written next to datasets (PNG + the numbers behind them as JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def probability_histogram(out_dir: Path, groups: dict[str, np.ndarray], threshold_lines: dict[str, float],
                          title: str, bins: int = 20) -> Path:
    """A histogram of probabilities in [0, 1], one series per group, vertical lines at thresholds.
    Writes ``histogram.png`` and ``histogram.json`` (bin edges and counts per group) into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    edges = np.linspace(0.0, 1.0, bins + 1)
    counts = {name: np.histogram(np.clip(v, 0, 1), bins=edges)[0].tolist() for name, v in groups.items()}
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    centers = (edges[:-1] + edges[1:]) / 2
    width = (edges[1] - edges[0]) / max(len(groups), 1)
    for k, (name, c) in enumerate(counts.items()):
        ax.bar(centers - (edges[1] - edges[0]) / 2 + width * (k + 0.5), c, width=width, label=f"{name} ({sum(c)})")
    for name, x in threshold_lines.items():
        ax.axvline(x, color="k", linestyle="--", linewidth=1)
        ax.text(x, ax.get_ylim()[1] * 0.95, f" {name}", fontsize=8, va="top")
    ax.set_yscale("symlog")
    ax.set_xlabel("teacher probability of relevance")
    ax.set_ylabel("pairs")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = out_dir / "histogram.png"
    # Fixed metadata: the same numbers give the same bytes (a cache hit compares digests).
    fig.savefig(png, metadata={"Software": None})
    plt.close(fig)
    (out_dir / "histogram.json").write_text(json.dumps({"title": title, "edges": edges.tolist(), "counts": counts,
                                                       "thresholds": threshold_lines}, indent=1))
    return png
