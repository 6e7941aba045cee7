"""95 % intervals for the suite's numbers: Wilson score intervals for retrieval accuracy (k of n prompts right) and
percentile-bootstrap intervals for means over rows (KL, top-1 per held-out window).

Wilson (score) interval of a proportion p̂ = k/n at z (1.96 for 95 %):

    centre = (p̂ + z²/(2n)) / (1 + z²/n),   half-width = z / (1 + z²/n) · sqrt(p̂(1 − p̂)/n + z²/(4n²))

It stays inside [0, 1] and is not degenerate at k = 0 or k = n (0 of 100 gives [0, 3.7 %]), unlike the normal
approximation p̂ ± z·sqrt(p̂(1−p̂)/n).

Bootstrap over rows: the rows' values x_1 … x_R (one per held-out row: its mean over tokens, and its token count
w_r), resampled with replacement B times (seeded); the interval is the 2.5 and 97.5 percentiles of the resampled
token-weighted means Σ w x / Σ w. Rows, not tokens, are resampled: tokens of one row are not independent. One
row has no spread to resample: it gets no interval (None), not the point (x, x), which would read as certainty.
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson_interval(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (lo, hi) of k successes in n trials (module doc); n = 0 → (0, 1). ``k`` may be a
    sum of scores in [0, 1] rather than a count (RULER's partial credit): Var(score) ≤ μ(1 − μ), so the binomial
    variance the interval assumes is an upper bound and it errs on the wide side."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval needs 0 <= k <= n, got k={k}, n={n}.")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(
    values, weights=None, *, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float] | None:
    """Percentile-bootstrap interval (lo, hi) of the weighted mean Σ w x / Σ w over rows (module doc); None for a
    single row."""
    x = np.asarray(values, np.float64)
    w = np.ones_like(x) if weights is None else np.asarray(weights, np.float64)
    if x.ndim != 1 or x.shape != w.shape or x.size == 0:
        raise ValueError(f"bootstrap_interval needs matching 1-D values and weights, got {x.shape} and {w.shape}.")
    if x.size == 1:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    means = np.sum(x[idx] * w[idx], axis=1) / np.sum(w[idx], axis=1)
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(lo), float(hi)
