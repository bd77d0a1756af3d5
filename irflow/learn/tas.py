"""TAS-B's batches: topic-aware sampling and balanced margin sampling (pure functions, no refs, no config).

Hofstätter, Lin, Yang, Lin, Hanbury (SIGIR 2021), "Efficiently Teaching an Effective Dense Retriever with
Balanced Topic Aware Sampling" (TAS-B); their loader is matchmaker's ``TASBalancedDatasetLoader``.

- Topic-aware sampling (TAS): the training queries are clustered with k-means on a baseline model's
  query embeddings (``kmeans_clusters``); a batch is drawn from ``n`` clusters (``clusters_per_batch``;
  the paper: 1), ``batch_size / n`` rows from each.
- Balanced margin sampling: a query's (positive, negative) pairs are cut into ``h`` equal-width bins of
  their teacher margin (``margin_bins``, over the query's [min, max]); a pair is drawn by drawing a bin
  uniformly among the query's non-empty bins, then a pair uniformly inside it (``BalancedMargins``). With
  ``h = 1`` it is a uniform draw over the query's pairs.

``TASPlan`` turns both into the batches of an epoch, a pure function of (seed, epoch), with the interface
of ``irflow.learn.training.BatchPlan`` (``at``, ``total_steps``): the training loop, its checkpoints and its
resume are unchanged. The rule (the paper samples forever; irflow keeps epochs, so that ``epochs`` and
each row's share of the training keep their meaning):

1. A query with ``r`` training rows has ``r`` slots in an epoch, each resolved to one of its rows by a
   balanced margin draw (with replacement: balancing is over draws, not over rows).
2. Per cluster, its slots are laid out pass by pass (pass ``k``: its queries with more than ``k`` rows, in
   a seeded random order, so a query repeats within a cluster only across passes) and cut into chunks of
   ``batch_size / n`` slots. A cluster's last chunk, if short, is filled with more of the same cluster's
   queries (drawn at random without repeats, cycling when the cluster has fewer queries than the chunk):
   every chunk is one cluster's.
3. Each batch picks ``n`` distinct clusters uniformly at random among the clusters with chunks left and
   takes the next chunk of each. A cluster that runs out of chunks is out for the rest of the epoch: later
   batches continue with the others. When fewer than ``n`` clusters have chunks left, a batch takes more
   chunks of those (so it still spans at most ``n`` clusters); chunks that do not make a whole batch at the
   epoch's end are dropped (GPL's ``drop_last``).

So every batch's queries come from at most ``n`` clusters (exactly one when ``n = 1``), and an epoch has
``sum over clusters of ceil(slots / (batch_size / n)) // n`` steps.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

import numpy as np

from irflow.engine.errors import DataError

#: TAS-B's k: 2,000 clusters of MS MARCO's training queries (some 0.4-0.5M), a few hundred queries a
#: cluster; the default keeps about that ratio (at least 2 clusters, at most one per query).
QUERIES_PER_CLUSTER = 200


def default_clusters(n_queries: int) -> int:
    """k when ``tas.clusters`` is null: ``max(2, n_queries // 200)``, and never more than the queries."""
    return max(1, min(int(n_queries), max(2, int(n_queries) // QUERIES_PER_CLUSTER)))


def kmeans_clusters(embeddings: np.ndarray, k: int, seed: int, iterations: int = 20) -> np.ndarray:
    """The cluster (0..k-1) of each row of ``embeddings``: faiss k-means (spherical: the rows are
    L2-normalised and so are the centroids, i.e. clustered by cosine, topics being directions), each row
    then assigned to its nearest centroid. Deterministic for a seed."""
    import faiss

    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    if not 1 <= k <= len(x):
        raise ValueError(f"k-means: {k} clusters for {len(x)} points")
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    km = faiss.Kmeans(x.shape[1], int(k), niter=int(iterations), seed=int(seed) % 2**31, spherical=True,
                      verbose=False, min_points_per_centroid=1)
    km.train(x)
    _, labels = km.index.search(x, 1)
    return labels.ravel().astype(np.int64)


def margin_bins(margins: Sequence[float], h: int) -> np.ndarray:
    """The bin (0..h-1) of each margin: ``h`` equal-width bins over [min, max] of ``margins`` (the
    maximum falls in the last bin; equal margins all fall in bin 0)."""
    m = np.asarray(margins, dtype=np.float64)
    if m.size == 0:
        return np.zeros(0, dtype=np.int64)
    lo, hi = float(m.min()), float(m.max())
    if hi <= lo:
        return np.zeros(m.size, dtype=np.int64)
    return np.clip(np.floor((m - lo) / (hi - lo) * h), 0, h - 1).astype(np.int64)


class BalancedMargins:
    """Balanced margin sampling: per query, its rows grouped into their margin bins (``margin_bins`` over
    the query's own margins); ``draw`` picks a non-empty bin uniformly, then a row of it uniformly."""

    def __init__(self, queries: Sequence[str], margins: Sequence[float], h: int):
        rows_of: dict[str, list[int]] = defaultdict(list)
        for i, q in enumerate(queries):
            rows_of[q].append(i)
        margins = np.asarray(margins, dtype=np.float64)
        self.bins: dict[str, list[list[int]]] = {}
        for q, rows in rows_of.items():
            ids = margin_bins(margins[rows], h)
            self.bins[q] = [[r for r, b in zip(rows, ids) if b == k] for k in range(h) if (ids == k).any()]

    def draw(self, query: str, rng: np.random.Generator) -> int:
        """One row of ``query``: a non-empty margin bin uniformly, then one of its rows uniformly."""
        bins = self.bins[query]
        rows = bins[int(rng.integers(len(bins)))] if len(bins) > 1 else bins[0]
        return rows[int(rng.integers(len(rows)))] if len(rows) > 1 else rows[0]


class TASPlan:
    """Which training rows make up step ``s`` under TAS-B (the module doc's rule): a pure function of
    (seed, s), with ``irflow.learn.training.BatchPlan``'s interface.

    ``queries[i]`` and ``margins[i]`` are row i's query and teacher margin; ``cluster_of`` each query's
    cluster."""

    def __init__(self, queries: Sequence[str], margins: Sequence[float], cluster_of: Mapping[str, int],
                 batch_size: int, clusters_per_batch: int, bins: int, seed: int):
        if batch_size % clusters_per_batch:
            raise ValueError(f"tas.clusters_per_batch: {clusters_per_batch} does not divide batch_size {batch_size}")
        self.batch_size, self.n, self.seed = int(batch_size), int(clusters_per_batch), int(seed)
        self.chunk = self.batch_size // self.n
        self.balanced = BalancedMargins(queries, margins, bins)
        count: dict[str, int] = defaultdict(int)
        for q in queries:
            count[q] += 1
        self.count = dict(count)
        members: dict[int, list[str]] = defaultdict(list)
        for q in sorted(count):
            members[int(cluster_of[q])].append(q)
        self.members = {c: members[c] for c in sorted(members)}
        chunks = sum(-(-sum(count[q] for q in qs) // self.chunk) for qs in self.members.values())
        self._steps = chunks // self.n
        if self._steps == 0:
            raise DataError(f"tas: {len(queries)} training rows in {len(self.members)} cluster(s) make no batch of "
                            f"{self.n} cluster chunks of {self.chunk} rows (tas.clusters_per_batch)")
        self._epoch, self._batches = -1, []

    def steps_per_epoch(self, epoch: int = 0) -> int:
        return self._steps

    def total_steps(self, p) -> int:
        return int(p.steps) if p.steps else self._steps * int(p.epochs)

    def at(self, step: int) -> list[int]:
        epoch, i = divmod(int(step), self._steps)
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, self.epoch_batches(epoch)
        return self._batches[i]

    def cluster_chunks(self, rng: np.random.Generator) -> dict[int, list[list[str]]]:
        """Each cluster's slots of one epoch (queries, pass by pass) cut into full chunks (rule 2)."""
        out = {}
        for c, qs in self.members.items():
            slots: list[str] = []
            for k in range(max(self.count[q] for q in qs)):
                pool = [q for q in qs if self.count[q] > k]
                slots += [pool[i] for i in rng.permutation(len(pool))]
            while len(slots) % self.chunk:
                short = self.chunk - len(slots) % self.chunk
                slots += [qs[i] for i in rng.permutation(len(qs))[:short]]
            out[c] = [slots[i:i + self.chunk] for i in range(0, len(slots), self.chunk)]
        return out

    def epoch_queries(self, epoch: int) -> tuple[list[list[str]], np.random.Generator]:
        """The batches of one epoch as queries (rule 3), and the epoch's generator, which then resolves
        each slot to a row."""
        rng = np.random.default_rng([self.seed % 2**63, int(epoch)])
        chunks = self.cluster_chunks(rng)
        taken = {c: 0 for c in chunks}
        active = [c for c in chunks]
        batches = []
        for _ in range(self._steps):
            picked = [active[i] for i in rng.choice(len(active), size=min(self.n, len(active)), replace=False)]
            while len(picked) < self.n:  # fewer clusters left than n: more chunks of the ones that remain
                more = [c for c in active if taken[c] + picked.count(c) < len(chunks[c])]
                picked.append(more[int(rng.integers(len(more)))])
            batch = []
            for c in picked:
                batch += chunks[c][taken[c]]
                taken[c] += 1
            active = [c for c in active if taken[c] < len(chunks[c])]
            batches.append(batch)
        return batches, rng

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The batches of one epoch as row indices: each slot resolved by a balanced margin draw."""
        batches, rng = self.epoch_queries(epoch)
        return [[self.balanced.draw(q, rng) for q in batch] for batch in batches]
