"""Number helpers and closed numeric intervals."""

import math


def clamp(value, low, high):
    """`value` limited to [low, high]."""
    if low > high:
        raise ValueError(f"low {low} > high {high}")
    if value < low:
        return low
    if value > high:
        return high
    return value


def gcd(a, b):
    """Greatest common divisor of two integers (always >= 0; gcd(0, 0) == 0)."""
    a, b = abs(a), abs(b)
    while b:
        a, b = b, a % b
    return a


def lcm(a, b):
    """Least common multiple of two integers (0 when either is 0)."""
    if a == 0 or b == 0:
        return 0
    return abs(a * b) // gcd(a, b)


def is_prime(n):
    """Whether the integer `n` is prime (trial division)."""
    if n < 2:
        return False
    if n < 4:
        return True
    if n % 2 == 0:
        return False
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def round_half_up(x, ndigits=0):
    """`x` rounded to `ndigits` decimals, halves away from minus infinity (2.5 -> 3, -2.5 -> -2)."""
    scale = 10**ndigits
    return math.floor(x * scale + 0.5) / scale


class Interval:
    """The closed interval [start, end]; start <= end."""

    __slots__ = ("start", "end")

    def __init__(self, start, end):
        if start > end:
            raise ValueError(f"start {start} > end {end}")
        self.start = start
        self.end = end

    def __repr__(self):
        return f"Interval({self.start!r}, {self.end!r})"

    def __eq__(self, other):
        if not isinstance(other, Interval):
            return NotImplemented
        return (self.start, self.end) == (other.start, other.end)

    def __hash__(self):
        return hash((self.start, self.end))

    def length(self):
        """end - start."""
        return self.end - self.start

    def contains(self, x):
        """Whether start <= x <= end."""
        return self.start <= x <= self.end

    def overlaps(self, other):
        """Whether the two intervals share a point (touching intervals do)."""
        return self.start <= other.end and other.start <= self.end

    def intersection(self, other):
        """The shared part of the two intervals, or None when they do not overlap."""
        if not self.overlaps(other):
            return None
        return Interval(max(self.start, other.start), min(self.end, other.end))


def merge_intervals(intervals):
    """The union of `intervals` as sorted, disjoint intervals; touching intervals merge."""
    ordered = sorted(intervals, key=lambda iv: (iv.start, iv.end))
    merged = []
    for iv in ordered:
        if merged and iv.start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = Interval(last.start, max(last.end, iv.end))
        else:
            merged.append(iv)
    return merged


def total_covered(intervals):
    """The total length covered by `intervals`, overlaps counted once."""
    return sum(iv.length() for iv in merge_intervals(intervals))
