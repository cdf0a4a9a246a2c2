"""Sampling filters against transformers' logits processors on the same logits: the same tokens survive
top-k and top-p, and the repetition penalty gives the same values."""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from mindformers_gptlocal.generation.sampling import _top_k, _top_p, apply_repetition_penalty


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=(6, 200)) * 3.0


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.9, 0.99])
def test_top_p_keeps_what_transformers_keeps(logits, p):
    ours = np.isfinite(_top_p(logits, p))
    theirs = np.isfinite(TopPLogitsWarper(top_p=p)(None, torch.from_numpy(logits)).numpy())
    assert ours.sum() >= len(logits)  # at least one token per row
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("k", [1, 5, 50])
def test_top_k_keeps_what_transformers_keeps(logits, k):
    ours = np.isfinite(_top_k(logits, k))
    theirs = np.isfinite(TopKLogitsWarper(top_k=k)(None, torch.from_numpy(logits)).numpy())
    np.testing.assert_array_equal(ours, theirs)
    assert (ours.sum(axis=-1) == k).all()


@pytest.mark.parametrize("penalty", [0.8, 1.3])
def test_repetition_penalty_equals_transformers(logits, penalty):
    histories = [[1, 5, 5, 199], [0], [7, 8, 9], [3], [150, 2], [4, 4, 4]]
    ours = apply_repetition_penalty(logits, histories, penalty)
    for row, seen in enumerate(histories):
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seen]), torch.from_numpy(logits[row:row + 1]))
        np.testing.assert_allclose(ours[row], theirs[0].numpy(), rtol=0, atol=0)


def _full_vocabulary_tokens(logits, histories, options, rng):
    """next_tokens as it was before top-k narrowed the rows: every filter and the draw over the whole vocabulary."""
    logits = apply_repetition_penalty(logits.astype(np.float64), histories, options["repetition_penalty"])
    logits = logits / max(options["temperature"], 1e-6)
    logits = _top_p(_top_k(logits, options["top_k"]), options["top_p"])
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs])


@pytest.mark.parametrize("top_k,top_p", [(5, None), (40, 0.9), (1, 0.5), (0, 0.8), (None, None), (199, 0.95)])
def test_narrowed_sampling_draws_what_the_full_vocabulary_draws(top_k, top_p):
    """next_tokens with top-k narrows each row to its k largest logits before top-p and the draw: the same tokens
    as the computation over the whole vocabulary, draw for draw from the same seed (odd vocabulary, ties at the k-th
    logit, a repetition penalty, a batch of rows)."""
    from mindformers_gptlocal.generation.sampling import next_tokens
    options = dict(do_sample=True, temperature=0.7, top_k=top_k, top_p=top_p, repetition_penalty=1.2)
    data = np.random.default_rng(1)
    for trial in range(40):
        logits = data.normal(size=(3, 201)).astype(np.float32) * 3.0
        logits[0, 10:14] = logits[0].max() - 0.5  # ties
        histories = [[1, 2, 3], [], [7, 7, 150]]
        got = next_tokens(logits, histories, options, np.random.default_rng(trial))
        want = _full_vocabulary_tokens(logits, histories, options, np.random.default_rng(trial))
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
