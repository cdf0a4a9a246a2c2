"""Test helpers shared by the generation tests' references (tests/generation/): a compiled runner's greedy tokens and
greedy graph at a chosen cost.

- ``generate_one_step``: ``model.generate`` with every greedy token picked after a one-token decode step (the runner's
  ``decode`` graph, which the caller has compiled already) instead of the unrolled greedy graph (``decode_greedy``):
  the compiled runner's tokens without compiling its largest graph. The greedy graph gives exactly these tokens:
  tests/generation/test_generation.py test_multi_step_greedy_generate_equals_one_step_and_recomputation.
- ``unrolled``: a runner whose greedy graph unrolls ``steps`` decode steps for the duration of a ``with`` block (a
  greedy graph's compile costs about one one-token graph per step unrolled).
"""
import contextlib

import pytest


def generate_one_step(model, prompts, **options):
    """``model.generate(prompts, **options)`` (greedy: ``do_sample=False``) with the runner's ``decode_greedy`` off, so
    generate's own loop (``generation/loop.py`` ``decode_loop``) picks every token after a ``decode`` call; checked
    to compile no greedy graph."""
    assert options.get("do_sample") is False, "one-token greedy steps: do_sample=False"
    runner = model.kv_cache(len(prompts), max(len(p) for p in prompts) + options["max_new_tokens"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "decode_greedy", None)  # decode_loop then steps one token a call
        out = model.generate(prompts, **options)
    assert not getattr(runner, "_greedy", None), "a greedy graph was compiled"
    return out


@contextlib.contextmanager
def unrolled(runner, steps):
    """``runner.decode_steps`` (how many steps ``decode_greedy`` unrolls) ``steps`` inside the block, its own after
    (a runner of the model's pool is shared: ``generate`` later gets its own count and greedy graphs back, the
    shorter graphs compiled in the block are dropped)."""
    own, graphs = runner.decode_steps, dict(runner._greedy)  # pylint: disable=protected-access
    assert 1 < steps < own, (steps, own)
    runner.decode_steps = steps
    try:
        yield runner
    finally:
        runner.decode_steps = own
        runner._greedy = graphs  # pylint: disable=protected-access
