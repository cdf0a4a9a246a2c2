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
