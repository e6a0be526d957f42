"""Summary statistics and list helpers."""


def mean(values):
    """The arithmetic mean of a non-empty iterable."""
    values = list(values)
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)


def median(values):
    """The middle value (the mean of the two middle values for an even count)."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    if n % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def mode(values):
    """The most frequent value; a tie goes to the value seen first."""
    counts = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    if not counts:
        raise ValueError("mode of no values")
    best, best_count = None, 0
    for v, c in counts.items():
        if c > best_count:
            best, best_count = v, c
    return best


def variance(values, sample=False):
    """The population variance, or the sample variance (n - 1 denominator) with `sample`."""
    values = list(values)
    n = len(values)
    if n < 2 if sample else n < 1:
        raise ValueError(f"variance needs more values, got {n}")
    m = mean(values)
    squares = sum((v - m) ** 2 for v in values)
    return squares / (n - 1 if sample else n)


def percentile(values, q):
    """The `q`-th percentile (0 <= q <= 100), linearly interpolated between ranks."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac = pos - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def chunks(items, size):
    """`items` cut into lists of `size` items; the last one may be shorter."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    items = list(items)
    return [items[i : i + size] for i in range(0, len(items), size)]


def windows(items, size, step=1):
    """Sliding windows of `size` items starting every `step` items; a short tail is dropped."""
    if size < 1 or step < 1:
        raise ValueError(f"size and step must be >= 1, got {size} and {step}")
    items = list(items)
    return [items[i : i + size] for i in range(0, len(items) - size + 1, step)]


def flatten(nested):
    """The items of arbitrarily nested lists and tuples, depth first."""
    out = []
    for item in nested:
        if isinstance(item, (list, tuple)):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out


def top_k(counts, k):
    """The `k` (key, count) pairs of `counts` with the largest counts; ties by key."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ranked[:k]


def group_by(items, key):
    """{key(item): [items with that key]} in order of first appearance."""
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups
