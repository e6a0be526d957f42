"""minilib: small stdlib-only helpers.

Modules:
  text       slugs, case conversion, wrapping, truncation, word counts
  intervals  clamping, gcd/lcm, primes, rounding and closed numeric intervals
  durations  durations like '1h30m' and calendar dates like '2024-02-29'
  stats      means, medians, percentiles and list helpers (chunks, windows, flatten)
  config     a small INI reader and writer with typed getters
"""

__version__ = "0.1"
