"""How far to trust a measured overhead: per-round paired ratios, their range and a 95 % interval.

No longer used by ``ecrec-bench compare``, which reports the median per-round ratio with a bootstrap
interval of that same median (``ecrec.bench.accounting``); kept for its tests and older reports.

``ecrec-bench compare`` times every strategy and a failure-free reference in the same rounds, one
slice each per round, so machine noise of one round hits all of them.  The overhead of a strategy
in round ``r`` is ``reference rate / strategy rate - 1`` of that round; across rounds we report

- the median (the headline figure), the range (min, max), and
- a 95 % interval of the mean (Student's t over the rounds), which says whether the figure is
  distinguishable from zero (``within_noise`` when the interval holds zero).

The difference between two strategies is paired the same way (per round, then the interval), so
"cpr-mfu costs less than cpr" is only claimed when the interval of the difference excludes zero.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

# two-sided 95 % quantiles of Student's t by degrees of freedom (1..30); beyond, the normal's
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (1.96 beyond 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass(frozen=True)
class Spread:
    """A paired figure over rounds: its median, range and 95 % interval of the mean."""

    median: float
    mean: float
    low: float  # range over the rounds
    high: float
    ci95_low: float | None  # None with a single round
    ci95_high: float | None
    rounds: int

    @property
    def within_noise(self) -> bool | None:
        """Whether the 95 % interval holds zero (None when there is no interval)."""
        if self.ci95_low is None or self.ci95_high is None:
            return None
        return self.ci95_low <= 0.0 <= self.ci95_high

    def to_dict(self) -> dict:
        return {**asdict(self), "within_noise": self.within_noise}


def spread(values) -> Spread:
    """Median, range and 95 % t-interval of the mean of per-round values."""
    xs = np.asarray(list(values), dtype=np.float64)
    if xs.size == 0 or not np.all(np.isfinite(xs)):
        raise ValueError(f"need one or more finite values, got {list(values)!r}")
    mean = float(xs.mean())
    if xs.size == 1:
        low = high = None
    else:
        half = t_quantile_975(xs.size - 1) * float(xs.std(ddof=1)) / math.sqrt(xs.size)
        low, high = mean - half, mean + half
    return Spread(median=float(np.median(xs)), mean=mean, low=float(xs.min()), high=float(xs.max()),
                  ci95_low=low, ci95_high=high, rounds=int(xs.size))


def paired_overheads(reference_rates, rates) -> np.ndarray:
    """Per round, ``reference rate / rate - 1`` (rounds paired by position)."""
    ref, mine = np.asarray(list(reference_rates), dtype=np.float64), np.asarray(list(rates), dtype=np.float64)
    if ref.shape != mine.shape or ref.size == 0:
        raise ValueError(f"need the same number (>= 1) of rounds, got {ref.size} and {mine.size}")
    if np.any(ref <= 0) or np.any(mine <= 0):
        raise ValueError("rates must be > 0")
    return ref / mine - 1.0


def overhead_spread(reference_rates, rates) -> Spread:
    """The spread of a strategy's per-round overhead against the reference."""
    return spread(paired_overheads(reference_rates, rates))


def difference_spread(reference_rates, rates_a, rates_b) -> Spread:
    """The spread of ``overhead(a) - overhead(b)``, paired per round."""
    return spread(paired_overheads(reference_rates, rates_a) - paired_overheads(reference_rates, rates_b))
