"""Statistics over repeats: a 95 % t-interval per arm and step, and the paired difference of two arms.

Method (docs/harness.md, "Statistics"): for n >= 2 values x_1..x_n (one per repeat) the interval is
``mean ± t(0.975, n − 1) · sd / √n`` with `sd` the sample standard deviation (n − 1 in the
denominator) and `t` Student's t quantile, computed here (`t_quantile`: the regularized incomplete
beta function by its continued fraction, inverted by bisection; no scipy). The paired difference of
arms A and B takes the pairs (A, B) of the same repeat and step (ABAB order puts them side by side in
time) and gives the same interval for the differences A − B. It says:

- `significant`: the interval excludes 0 (or every pair differs by the same non-zero amount);
- `within the noise`: the interval contains 0, so no difference can be claimed;
- `no difference`: every pair is identical (a deterministic quantity, such as the simulator's bytes);
- `no noise estimate`: one pair only (one repeat): a difference is shown, but its noise is unknown;
- `no data`: no pair has both values.

Each interval is at 95 %: in an A/A run about one in twenty intervals excludes 0 by chance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95

SIGNIFICANT = "significant"
WITHIN_NOISE = "within the noise"
NO_DIFFERENCE = "no difference"
NO_NOISE_ESTIMATE = "no noise estimate"
NO_DATA = "no data"
VERDICTS = (SIGNIFICANT, WITHIN_NOISE, NO_DIFFERENCE, NO_NOISE_ESTIMATE, NO_DATA)


# --- Student's t -----------------------------------------------------------------------------------


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (Student's t, `df` degrees of freedom), to about 1e-12."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-13 * max(1.0, high):
            break
    return (low + high) / 2.0


# --- estimates -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A metric over repeats: n, mean, sample sd and the 95 % t-interval (sd and interval None when n < 2)."""

    n: int
    mean: float
    sd: float | None
    low: float | None
    high: float | None

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2.0

    @classmethod
    def of(cls, values: Sequence[float | None], confidence: float = CONFIDENCE) -> Estimate | None:
        known = [float(v) for v in values if v is not None]
        if not known:
            return None
        n = len(known)
        mean = math.fsum(known) / n
        if n < 2:
            return cls(n, mean, None, None, None)
        sd = math.sqrt(math.fsum((v - mean) ** 2 for v in known) / (n - 1))
        half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
        return cls(n, mean, sd, mean - half, mean + half)


@dataclass(frozen=True)
class PairedDifference:
    """A − B over pairs of the same repeat (and step): the estimate of the differences and what it says."""

    a: str
    b: str
    repeats: list[int]  # the repeats that form a pair (both values known)
    estimate: Estimate | None
    verdict: str  # one of VERDICTS

    @classmethod
    def of(cls, a: str, b: str, pairs: dict[int, tuple[float | None, float | None]]) -> PairedDifference:
        """`pairs`: repeat -> (A's value, B's value); a pair with a value missing is left out."""
        repeats = sorted(r for r, (x, y) in pairs.items() if x is not None and y is not None)
        differences = []
        for r in repeats:
            x, y = pairs[r]
            assert x is not None and y is not None
            differences.append(x - y)
        estimate = Estimate.of(differences)
        return cls(a, b, repeats, estimate, verdict_of(estimate, differences))


def verdict_of(estimate: Estimate | None, differences: Sequence[float]) -> str:
    if estimate is None:
        return NO_DATA
    if estimate.n < 2:
        return NO_NOISE_ESTIMATE
    if all(d == differences[0] for d in differences):
        return NO_DIFFERENCE if differences[0] == 0 else SIGNIFICANT
    assert estimate.low is not None and estimate.high is not None
    return SIGNIFICANT if estimate.low > 0 or estimate.high < 0 else WITHIN_NOISE


__all__ = ["CONFIDENCE", "NO_DATA", "NO_DIFFERENCE", "NO_NOISE_ESTIMATE", "SIGNIFICANT", "VERDICTS", "WITHIN_NOISE",
           "Estimate", "PairedDifference", "regularized_beta", "t_cdf", "t_quantile", "verdict_of"]
