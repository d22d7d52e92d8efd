"""Repeated measurements: median, range and relative spread, ratios between two methods
measured side by side, and whether two runs differ by more than their noise.

A speed measured once on a shared 2-core machine can be off by a factor of two; the same
measurement repeated tells how far to trust it. The ratio of two methods is taken per
repeat (both timed in the same stretch of machine time) and summarised by the median of
those ratios and their range.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

UNSTABLE_SPREAD = 0.15
"""Repeats of one measurement whose range exceeds this share of their median disagree."""
NOISE_FLOOR = 0.05
"""Two runs' medians closer than this (relative) are never called a change."""


AGREEING_FACTOR = 2.0
"""Ratios within this factor of each other, all on one side of 1x, tell one story (a speedup of
"more than 3x", not a verdict on its second digit)."""


@dataclass(frozen=True)
class Spread:
    """Median, minimum and maximum of repeated values of one quantity."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        finite = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(finite), min(finite), max(finite), len(finite))

    @property
    def relative(self) -> float:
        """(high - low) / median: 0 for one value, nan where the median is 0 or undefined."""
        if not self.count or not self.median:
            return math.nan
        return (self.high - self.low) / abs(self.median)

    @property
    def unstable(self) -> bool:
        """Whether the repeats disagree by more than :data:`UNSTABLE_SPREAD`."""
        return self.count > 1 and self.relative > UNSTABLE_SPREAD

    @property
    def agrees(self) -> bool:
        """For ratios (speedups): whether every repeat tells the same story even where they
        spread, being on the same side of 1x and within :data:`AGREEING_FACTOR` of each
        other (3.36x and 4.13x agree; 0.9x and 1.2x, or 2x and 5x, do not)."""
        if not self.count:
            return False
        same_side = (self.low > 1) == (self.high > 1)
        return same_side and self.high <= AGREEING_FACTOR * self.low

    @classmethod
    def from_dict(cls, data: dict) -> Spread:
        """The spread :meth:`as_dict` recorded."""

        def number(name: str) -> float:
            value = data.get(name)
            return math.nan if value is None else float(value)

        return cls(number("median"), number("low"), number("high"), int(data.get("repeats", 0)))

    def as_dict(self, digits: int = 4) -> dict:
        def rounded(value: float) -> float | None:
            return None if math.isnan(value) else round(value, digits)

        return {
            "median": rounded(self.median),
            "low": rounded(self.low),
            "high": rounded(self.high),
            "relative_spread": rounded(self.relative),
            "repeats": self.count,
        }

    def describe(self, fmt: str = ".2f", unit: str = "") -> str:
        """``2.10x (1.95-2.20x over 3 repeats)``, or the value alone for one repeat."""
        if self.count <= 1:
            return f"{self.median:{fmt}}{unit}"
        return (
            f"{self.median:{fmt}}{unit} ({self.low:{fmt}}-{self.high:{fmt}}{unit} over "
            f"{self.count} repeats)"
        )


def ratio_spread(numerators: Sequence[float], denominators: Sequence[float]) -> Spread:
    """The :class:`Spread` of per-repeat ratios ``numerators[i] / denominators[i]`` (repeats
    with a zero or missing denominator left out)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators")
    return Spread.of([n / d for n, d in zip(numerators, denominators, strict=True) if d])


@dataclass(frozen=True)
class Change:
    """How a quantity moved from an old run to a new one."""

    ratio: float  # new median / old median
    old: Spread
    new: Spread

    @property
    def significant(self) -> bool:
        """Larger than the noise: the two runs' ranges do not overlap and the medians differ
        by more than :data:`NOISE_FLOOR`. With one repeat on a side, its range is taken to be
        :data:`UNSTABLE_SPREAD` wide around its value, so that a single sample never decides."""
        if math.isnan(self.ratio) or abs(self.ratio - 1) <= NOISE_FLOOR:
            return False
        old_low, old_high = _range(self.old)
        new_low, new_high = _range(self.new)
        return new_low > old_high or new_high < old_low

    @property
    def verdict(self) -> str:
        if not self.significant:
            return "~"
        return "faster" if self.ratio > 1 else "slower"


def compare(old: Spread, new: Spread) -> Change:
    """The :class:`Change` from an old run's repeats to a new run's."""
    ratio = new.median / old.median if old.median else math.nan
    return Change(ratio, old, new)


def _range(spread: Spread) -> tuple[float, float]:
    if spread.count > 1:
        return spread.low, spread.high
    half = UNSTABLE_SPREAD / 2 * abs(spread.median)
    return spread.median - half, spread.median + half
