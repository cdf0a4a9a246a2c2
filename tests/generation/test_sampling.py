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


@pytest.mark.parametrize("vocab,penalty,trials", [(201, 1.2, 40), (201, 1.0, 40), (32003, 1.0, 6), (32003, 1.3, 3)])
@pytest.mark.parametrize("top_k,top_p", [(5, None), (40, 0.9), (1, 0.5), (0, 0.8), (None, None), (199, 0.95)])
def test_narrowed_sampling_draws_what_the_full_vocabulary_draws(top_k, top_p, vocab, penalty, trials):
    """next_tokens with top-k narrows each row to its k largest logits (found from a strided sample's bound at a
    large vocabulary) before the temperature, top-p and the draw: the same tokens as the computation over the whole
    vocabulary in float64, draw for draw from the same seed (odd vocabularies, ties at the k-th logit, with and
    without a repetition penalty, a batch of rows); greedy the same argmax."""
    from mindformers_gptlocal.generation.sampling import next_tokens
    options = dict(do_sample=True, temperature=0.7, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
    data = np.random.default_rng(1)
    for trial in range(trials):
        logits = data.normal(size=(3, vocab)).astype(np.float32) * 3.0
        logits[0, 10:14] = logits[0].max() - 0.5  # ties
        if top_k and top_p is None:  # ties at the k-th largest (under top-p, which of tied tokens a sort puts first
            logits[1, [5, 77, vocab - 1]] = np.sort(logits[1])[-top_k]  # is either side's own choice)
        histories = [[1, 2, 3], [], [7, 7, 150]]
        got = next_tokens(logits, histories, options, np.random.default_rng(trial))
        want = _full_vocabulary_tokens(logits, histories, options, np.random.default_rng(trial))
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
        greedy = next_tokens(logits, histories, dict(options, do_sample=False), None)
        want = apply_repetition_penalty(logits.astype(np.float64), histories, penalty).argmax(axis=-1)
        np.testing.assert_array_equal(greedy, want)
