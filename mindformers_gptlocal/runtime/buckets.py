"""Shape buckets: the few widths (and batch sizes) compiled, so varied prompt lengths share graphs.

Pure Python, one home for every user: ``runner.py`` (the runner's prefill widths: ``generate``),
``serve/scheduler.py`` (the server's prompt widths and batch sizes) and ``evaluation/harness.py`` (the scorer's
widths, ``length_bucket``).
"""

SMALLEST_WIDTH = 16


def buckets(limit, start, factor, given=None, minimum=None):
    """``given`` (sorted, deduplicated, capped at ``limit``, values below ``minimum`` dropped) or start,
    start * factor, ... below ``limit``; always ending at ``limit``."""
    if given:
        values = sorted({min(int(v), limit) for v in given if minimum is None or int(v) >= minimum})
    else:
        values, v = [], start
        while v < limit:
            values.append(v)
            v *= factor
    if not values or values[-1] != limit:
        values.append(limit)
    return values


def width_buckets(limit, smallest=SMALLEST_WIDTH, given=None):
    """Prompt widths compiled: ``given`` or powers of two from ``smallest``, always ending at ``limit`` (the
    cache length)."""
    return buckets(limit, smallest, 2, given)


def bucket_of(length, widths):
    """The smallest of ``widths`` (ascending) that holds ``length``."""
    for width in widths:
        if width >= length:
            return width
    raise ValueError(f"{length} exceeds the largest bucket {widths[-1]}")


def length_bucket(length, limit):
    """Padded width for a batch of ``length`` tokens: 16, 24, 32, 48, 64, 96, ... capped at ``limit`` (one
    compiled graph per bucket instead of one per length; right padding does not change a causal LM's output)."""
    width = 16
    while width < length:
        width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return min(width, limit)
