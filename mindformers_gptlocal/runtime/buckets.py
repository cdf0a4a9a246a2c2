"""Shape buckets: the few widths (and batch sizes) compiled, so varied prompt lengths share graphs; the greedy
steps one call unrolls.

Pure Python, one home for every user: ``runner.py`` (the runner's prefill widths: ``generate``),
``serve/scheduler.py`` (the server's prompt widths and batch sizes) and ``evaluation/harness.py`` (the scorer's
widths, ``length_bucket``); ``greedy_steps`` (``runner.py`` ``GreedySteps``, ``native.py``).
"""

SMALLEST_WIDTH = 16
# The greedy graph (runner.py GreedySteps; the native runner's calls likewise): decode steps unrolled in one call, at
# most GREEDY_STEPS_MAX, and steps x layers at most GREEDY_STEPS_BUDGET (more steps for shallow models, where a step
# is mostly call overhead)
GREEDY_STEPS_BUDGET = 32
GREEDY_STEPS_MAX = 8


def greedy_steps(num_layers):
    """How many greedy decode steps one greedy call unrolls: ``GREEDY_STEPS_BUDGET`` // layers, between 1 and
    ``GREEDY_STEPS_MAX``."""
    return max(1, min(GREEDY_STEPS_MAX, GREEDY_STEPS_BUDGET // max(int(num_layers), 1)))


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
