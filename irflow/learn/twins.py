"""Documents that are one text under two ids: exact twins (equal after normalising case, punctuation and
spaces) and near twins (MinHash estimate of the Jaccard similarity of their word 5-shingles at or above a
threshold, found with ``datasketch``'s LSH: the same page with another footer, a re-export of one manual).

A synthetic held-out evaluation must hold a document out together with its twins, or the model trains on
the held-out text under another id and the evaluation measures memory (``irflow.stages.ingest.holdout``).
"""

from __future__ import annotations

import hashlib
import re

SHINGLE = 5  # words per shingle
PERMUTATIONS = 128  # MinHash permutations: the Jaccard estimate's standard error is about 0.09 at 0.5
_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalise(text: str) -> list[str]:
    """The words of ``text``, lower-cased, without punctuation."""
    return _NON_WORD.sub(" ", text.lower()).split()


def shingles(words: list[str], n: int = SHINGLE) -> set[bytes]:
    if len(words) <= n:
        return {" ".join(words).encode()}
    return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)}


def twin_groups(texts: dict[str, str], jaccard: float = 0.8, seed: int = 1) -> list[set[str]]:
    """Groups (of two or more ids) of ``texts`` (id -> text) that are exact or near twins, closed under the
    relation (a twin of a twin is in the group). Near twins are pairs that LSH proposes and whose MinHash
    Jaccard estimate is at least ``jaccard``."""
    from datasketch import MinHash, MinHashLSH

    parent = {i: i for i in texts}

    def find(i: str) -> str:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    words = {i: normalise(t) for i, t in texts.items()}
    exact: dict[str, str] = {}
    for i in sorted(texts):
        key = hashlib.sha256(" ".join(words[i]).encode()).hexdigest()
        if key in exact:
            union(exact[key], i)
        else:
            exact[key] = i
    if jaccard < 1:
        lsh = MinHashLSH(threshold=jaccard, num_perm=PERMUTATIONS)
        sketches = {}
        for i in exact.values():  # one representative of each exact group
            if not words[i]:
                continue
            m = MinHash(num_perm=PERMUTATIONS, seed=seed)
            m.update_batch(list(shingles(words[i])))
            sketches[i] = m
            for j in lsh.query(m):
                if m.jaccard(sketches[j]) >= jaccard:
                    union(i, j)
            lsh.insert(i, m)
    groups: dict[str, set[str]] = {}
    for i in texts:
        groups.setdefault(find(i), set()).add(i)
    return [g for g in groups.values() if len(g) > 1]
