"""Noise as data: medians with bootstrap confidence intervals, ratios, and the geometric mean
of ratios with its interval.

A timing is a distribution: each function is measured in rounds, interleaved with the
functions it is compared with, their order reversed every round. The unit is a pair of
rounds (rounds 1 and 2, 3 and 4, ...): in it every function ran once in each position, so
what a position adds cancels. On an H200 (call mode, BENCHMARKS.md), SDPA timed against
itself gave rounds' ratios in two clusters 1.0-5.4% apart, by which copy ran first, with a
pause before each round (the stopping rule's three bootstraps, or a 3-ms sleep), and 0.05-0.4%
apart without one; the shipped seed against SDPA, 0.6-2.0% apart on average over three
processes on 13 of 14 configs. A median over single rounds lands in either cluster by chance
and its interval is wide. An odd last round counts as a unit of its own.

The median over units counts; its interval is a percentile bootstrap of the median (95%). A
ratio of two functions measured in the same rounds is the median of the units' own ratios
(each pair's total time over the other's), its interval a bootstrap over the units (paired: a
slow round slows both, and cancels). Where a host switches between a fast and a slow state
from one batch to the next, each function's own median can land in either state, and their
ratio with it; the units' ratios mostly compare like with like, so their median does not. A
ratio of functions measured apart (another process) is the ratio of the medians, each side
resampled alone. The bootstrap's own random numbers come from a fixed seed, so the same
samples always give the same interval.
"""
from __future__ import annotations

import functools
import math
import statistics
from typing import Any, Sequence

from .types import geometric_mean

CONFIDENCE = 0.95
RESAMPLES = 300
Z = 1.959963984540054              # the normal quantile of 97.5%
Interval = tuple[float, float]


def _quantiles(values: Any) -> Interval:
    import numpy as np
    lo, hi = np.quantile(values, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return float(lo), float(hi)


def _resampled_medians(samples: Sequence[float], picks: Any) -> Any:
    import numpy as np
    return np.median(np.asarray(samples, dtype=float)[picks], axis=1)


@functools.lru_cache(maxsize=256)
def _picks(n: int, seed: int) -> Any:
    """Returns RESAMPLES rows of n indices drawn with replacement (a fixed seed per size;
    kept, since the stopping rule asks between rounds and its pause shows in the next one)."""
    import numpy as np
    picks = np.random.default_rng(seed).integers(0, n, size=(RESAMPLES, n))
    picks.flags.writeable = False
    return picks


def units(samples: Sequence[float]) -> list[float]:
    """Returns one function's rounds as units: each pair of rounds' mean, an odd last alone."""
    s = list(samples)
    return [(s[i] + s[i + 1]) / 2 for i in range(0, len(s) - 1, 2)] + s[len(s) - len(s) % 2:]


def ratio_units(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Returns the units' ratios of two functions timed in the same rounds: each pair of
    rounds' total time of one over the other's, an odd last round alone."""
    return [a / b for a, b in zip(units(num), units(den))]


def center(samples: Sequence[float]) -> tuple[float, Interval | None]:
    """Returns a function's time over its rounds: the median of its units, and its interval."""
    u = units(samples)
    return statistics.median(u), median_ci(u)


def median_ci(samples: Sequence[float]) -> Interval | None:
    """Returns the 95% bootstrap interval of the median (None for fewer than 2 samples)."""
    if len(samples) < 2:
        return None
    return _quantiles(_resampled_medians(samples, _picks(len(samples), len(samples))))


def ratio(num: Sequence[float], den: Sequence[float], paired: bool) -> tuple[float, Interval | None]:
    """Returns num / den and its 95% bootstrap interval.

    Paired (both measured in the same interleaved rounds, same length): the median of the
    units' ratios, the units resampled; otherwise the ratio of the two functions' centers,
    each side resampled alone."""
    if paired and len(num) == len(den) and num and min(den) > 0:
        ratios = ratio_units(num, den)
        point = statistics.median(ratios)
        if len(ratios) < 2:
            return point, None
        picks = _picks(len(ratios), len(ratios) * 1000 + len(ratios))
        return point, _quantiles(_resampled_medians(ratios, picks))
    top_u, bottom_u = units(num), units(den)
    point = statistics.median(top_u) / statistics.median(bottom_u)
    if len(top_u) < 2 or len(bottom_u) < 2:
        return point, None
    top = _resampled_medians(top_u, _picks(len(top_u), len(top_u) * 1000 + len(bottom_u)))
    bottom = _resampled_medians(bottom_u, _picks(len(bottom_u),
                                                 len(bottom_u) * 1000 + len(top_u) + 1))
    return point, _quantiles(top / bottom)


def ratio_of_intervals(num: float, num_ci: Interval | None, den: float,
                       den_ci: Interval | None) -> Interval | None:
    """Returns an interval for num/den from each side's own interval, taken as independent
    (their log half-widths add in quadrature); None if either is missing."""
    if num_ci is None or den_ci is None or min(num, den, *num_ci, *den_ci) <= 0:
        return None
    se = math.hypot(_log_se(num, num_ci), _log_se(den, den_ci))
    point = num / den
    return point * math.exp(-Z * se), point * math.exp(Z * se)


def _log_se(point: float, ci: Interval) -> float:
    """The standard error in log space implied by an interval around `point`."""
    return max(math.log(ci[1] / point), math.log(point / ci[0]), 0.0) / Z


def geomean_ci(points: Sequence[float], cis: Sequence[Interval | None]) -> Interval | None:
    """Returns an interval for the geometric mean of independent ratios, from theirs."""
    if not points or any(c is None for c in cis) or min(points) <= 0:
        return None
    n = len(points)
    g = geometric_mean(points)
    se = math.sqrt(sum(_log_se(p, c) ** 2 for p, c in zip(points, cis))) / n  # type: ignore[arg-type]
    return g * math.exp(-Z * se), g * math.exp(Z * se)


def rel_half_width(point: float, ci: Interval | None) -> float:
    """Returns the larger relative distance from `point` to an end of its interval."""
    if ci is None or point <= 0:
        return math.inf
    return max(ci[1] / point - 1, 1 - ci[0] / point)


def plus_minus(point: float, ci: Interval | None) -> float | None:
    """Returns the half-width of an interval in the point's units, for `0.94x ± 0.01`."""
    if ci is None:
        return None
    return max(ci[1] - point, point - ci[0])
