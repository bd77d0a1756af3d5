"""Statistics over per-query metric values: how sure a mean is, and whether one system beats another.

Pure functions. A system's per-query values are a dict ``query_id -> value`` (the evaluate stage's
``per_query`` output, one metric) or an array already aligned by query.

- ``bootstrap_ci``: a percentile-bootstrap confidence interval of the mean over queries.
- ``paired``: two systems on the queries both were evaluated on: wins / ties / losses, the mean
  difference, and two paired significance tests (Student's t and Wilcoxon's signed-rank).
- ``detectable_gain``: the smallest real gain a paired t-test on this many queries would find, 4 times in 5.

Queries, not documents, are the sampling unit: the question these answer is "would the ranking of
systems hold on another sample of queries like these", which is what a test collection can say.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np

Values = Mapping[str, float] | Sequence[float] | np.ndarray

# Bootstrap resamples are drawn in blocks of at most this many values (resamples x queries), so that
# 10,000 resamples of a large query set (MS MARCO dev: 6,980) do not need gigabytes at once.
_BLOCK_VALUES = 2_000_000


def _array(values: Values) -> np.ndarray:
    if isinstance(values, Mapping):
        # sorted by query id: the same dict gives the same array (and so the same bootstrap) whatever
        # order it was built in
        values = [values[q] for q in sorted(values)]
    return np.asarray(values, dtype=np.float64)


def bootstrap_ci(values: Values, level: float = 0.95, resamples: int = 10_000, seed: int = 0
                 ) -> tuple[float, float]:
    """The percentile-bootstrap ``level`` confidence interval of the mean of ``values``.

    Draw ``resamples`` samples of n queries with replacement from the n values, take each sample's
    mean m_1 .. m_B, and return their (1 - level) / 2 and (1 + level) / 2 quantiles (numpy's linear
    interpolation). Seeded: the same values, level, resamples and seed always give the same interval.

    Assumes the queries are an i.i.d. sample of the queries the collection stands for; with a few
    dozen queries the interval is rough (it cannot be wider than the values' range, and it is narrow
    when many queries score the same).
    """
    v = _array(values)
    if v.size == 0:
        raise ValueError("bootstrap_ci: no values")
    if not 0 < level < 1:
        raise ValueError(f"bootstrap_ci: level must be in (0, 1), not {level}")
    if resamples < 1:
        raise ValueError(f"bootstrap_ci: resamples must be at least 1, not {resamples}")
    rng = np.random.default_rng(seed)
    block = max(1, _BLOCK_VALUES // v.size)
    means = np.empty(resamples)
    for start in range(0, resamples, block):
        stop = min(start + block, resamples)
        means[start:stop] = v[rng.integers(0, v.size, size=(stop - start, v.size))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


@dataclass(frozen=True)
class Paired:
    """System B against system A on the queries both were evaluated on (differences are B - A)."""

    n: int                  # queries in common
    wins: int               # B - A > tie
    ties: int               # |B - A| <= tie
    losses: int             # B - A < -tie
    mean_a: float
    mean_b: float
    mean_diff: float        # mean of B - A (= mean_b - mean_a)
    t_pvalue: float         # paired t-test, two-sided
    wilcoxon_pvalue: float  # Wilcoxon signed-rank, two-sided

    def to_dict(self) -> dict:
        return asdict(self)


def paired(a: Mapping[str, float], b: Mapping[str, float], tie: float = 1e-9) -> Paired:
    """Compare system B (``b``) with system A (``a``), query by query, over the queries both have.

    With d_i = b_i - a_i for the n common queries:

    - wins / ties / losses: how many d_i > tie, |d_i| <= tie, d_i < -tie. Differences within ``tie``
      are float noise (two rankings that agree on every judged document score the same) and count as
      0 in both tests below.
    - mean_diff = (1/n) sum d_i.
    - t-test (``scipy.stats.ttest_rel``): t = mean(d) / (s_d / sqrt(n)), s_d the sample standard
      deviation of d (n - 1 in the denominator), two-sided p from Student's t with n - 1 degrees of
      freedom. Assumes the d_i are independent and roughly normal (their mean is, by the central
      limit theorem, with enough queries; per-query nDCG is bounded and often lumpy, so with few
      queries read it with care).
    - Wilcoxon signed-rank (``scipy.stats.wilcoxon``, its defaults: zero differences dropped; for n
      <= 50 without zeros or tied ranks the exact distribution; for n <= 13 with them, every one of
      the 2^m sign patterns of the m non-zero differences (``signed_rank_sign_flip_p``, scipy's
      permutation test computed at once); else the normal approximation): ranks |d_i| and sums the
      ranks of the positive ones. Assumes the d_i are independent and symmetric about their median;
      it tests whether that median is 0, and does not care how large the differences are.

    When every difference is a tie, both p-values are 1.0 (nothing tells the systems apart; scipy
    would say NaN). With fewer than 2 queries in common the t-test is undefined and says NaN.
    """
    common = sorted(set(a) & set(b))
    va = np.array([a[q] for q in common], dtype=np.float64)
    vb = np.array([b[q] for q in common], dtype=np.float64)
    d = vb - va
    d[np.abs(d) <= tie] = 0.0  # ties are exactly 0 for the tests, as they are for the counts
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    n = len(common)
    mean = (lambda x: float(x.mean()) if x.size else math.nan)
    if wins + losses == 0:
        t_p = w_p = 1.0 if n else math.nan
    else:
        from scipy import stats

        # ttest_rel(d, 0) is ttest_rel(b, a) with the ties set to 0 (it tests the differences' mean)
        t_p = float(stats.ttest_rel(d, np.zeros(n)).pvalue) if n >= 2 else math.nan
        nonzero = d[d != 0]
        if n <= 13 and (nonzero.size < n or np.unique(np.abs(nonzero)).size < nonzero.size):
            w_p = signed_rank_sign_flip_p(nonzero)  # what scipy would do, without its per-call overhead
        else:
            w_p = float(stats.wilcoxon(d).pvalue)
    return Paired(n=n, wins=wins, ties=n - wins - losses, losses=losses, mean_a=mean(va), mean_b=mean(vb),
                  mean_diff=mean(d), t_pvalue=t_p, wilcoxon_pvalue=w_p)


def signed_rank_sign_flip_p(d: np.ndarray) -> float:
    """Two-sided p-value of Wilcoxon's signed-rank statistic against all 2^m sign flips of ``d``.

    d holds m non-zero differences (m <= 20). With r_i the rank of |d_i| among them (ties share their
    average rank), T = sum of r_i over d_i > 0. Under H0 (the d_i symmetric about 0) each sign is +
    or - with probability 1/2 independently, so T's null distribution is that of sum_i s_i r_i over
    all s in {0, 1}^m, each pattern equally likely. p = min(1, 2 min(P(T0 <= T), P(T0 >= T))), the
    comparisons with a relative tolerance of 1e-14 for float ranks.

    This is the test ``scipy.stats.wilcoxon`` runs for n <= 13 with zeros or ties (its
    ``PermutationMethod``, exhaustive there since 2^13 is below its 9,999 resamples), with the same
    p-value; scipy evaluates the statistic once per pattern in Python (~2 s at n = 13), this takes a
    matrix product.
    """
    from scipy.stats import rankdata

    d = np.asarray(d, dtype=np.float64)
    m = d.size
    if m == 0:
        return 1.0
    if m > 20:
        raise ValueError(f"signed_rank_sign_flip_p: {m} differences (2^{m} sign patterns); use the normal approximation")
    ranks = rankdata(np.abs(d))
    observed = float(ranks[d > 0].sum())
    patterns = (np.arange(1 << m)[:, None] >> np.arange(m)) & 1
    null = patterns @ ranks
    eps = 1e-14 * max(abs(observed), 1.0)
    p_less, p_greater = np.mean(null <= observed + eps), np.mean(null >= observed - eps)
    return float(min(1.0, 2 * min(p_less, p_greater)))


def detectable_gain(differences: Values, alpha: float = 0.05, power: float = 0.8, tests: int = 1) -> float:
    """The smallest true mean difference that a two-sided paired t-test at level ``alpha / tests`` (Holm's
    first step over ``tests`` comparisons) finds with probability ``power``, for differences as spread as
    these:

        gain = (t_{1 - alpha / (2 tests), n - 1} + t_{power, n - 1}) * s_d / sqrt(n)

    with n the number of differences and s_d their sample standard deviation (the usual power formula for a
    paired design, Student's t in place of the normal). What it says: a real gain well below it is more often
    called noise than found on this many units, so "no gain found" is not "no gain". NaN with fewer than 2
    differences; 0 when they are all equal.
    """
    d = _array(differences)
    if d.size < 2:
        return math.nan
    from scipy import stats

    df = d.size - 1
    t = stats.t.ppf(1 - alpha / (2 * tests), df) + stats.t.ppf(power, df)
    return float(t * d.std(ddof=1) / math.sqrt(d.size))
