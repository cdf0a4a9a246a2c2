"""Choosing the next token from logits, with MindFormers' GenerationConfig options and their
Hugging Face meanings: greedy, sampling (temperature, top-k, top-p), repetition penalty; and the one temperature rule
(``sampling_options``: temperature 0 is greedy) the CLI, the server and the eval read their flags and fields by.

Runs on the host in numpy: logits of one step are [batch, vocab], small next to the model.
"""
import numpy as np


def sampling_options(temperature, top_k=None, top_p=None, do_sample=True):
    """The temperature rule of every way in (litgpt's ``generate``, the OpenAI API, lm-eval's gen_kwargs): temperature
    0, or ``do_sample`` False, is greedy (the most likely token each step); above 0, sampled at that temperature among
    ``top_k`` / ``top_p`` (None: not set here). Returns the options it sets: ``{"do_sample": False}``, or
    ``{"do_sample": True, "temperature": t}`` with ``top_k`` / ``top_p`` when given."""
    if not do_sample or not temperature > 0:
        return {"do_sample": False}
    chosen = {"do_sample": True, "temperature": float(temperature), "top_k": top_k, "top_p": top_p}
    return {key: value for key, value in chosen.items() if value is not None}


def apply_repetition_penalty(logits, histories, penalty):
    """HF semantics: a seen token's logit is divided by penalty if positive, multiplied if negative."""
    if penalty == 1.0:
        return logits
    logits = logits.copy()
    for row, seen in enumerate(histories):
        tokens = np.unique(np.asarray(seen, np.int64))
        values = logits[row, tokens]
        logits[row, tokens] = np.where(values > 0, values / penalty, values * penalty)
    return logits


def _top_k(logits, k):
    if not k or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k, axis=-1)[:, -k][:, None]
    return np.where(logits < kth, -np.inf, logits)


def _top_p(logits, p):
    if p is None or p >= 1.0:
        return logits
    order = np.argsort(-logits, axis=-1)
    sorted_logits = np.take_along_axis(logits, order, axis=-1)
    probs = np.exp(sorted_logits - sorted_logits[:, :1])
    probs /= probs.sum(axis=-1, keepdims=True)
    cumulative = np.cumsum(probs, axis=-1)
    drop_sorted = cumulative - probs > p  # keep the smallest prefix whose mass reaches p (always >= 1 token)
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, -np.inf, logits)


def _kth_largest(scores, k):
    """Each row's k-th largest value (``np.partition``'s), for k well below the vocabulary: a bound is taken from a
    strided sample of the row (its k-th largest: at least k of the row's values are at or above it), and the k-th
    largest is found among the values at or above that bound only (~V / 16 of them), where a partition of the whole
    row takes ~0.3 ms at V 32,000. Returns (bounds [B], the candidates' indices by row)."""
    stride = scores.shape[-1] // (16 * k)
    floors = np.partition(scores[:, ::stride], -k, axis=-1)[:, -k] if stride >= 2 else None
    bounds, candidates = np.empty(len(scores), scores.dtype), []
    for index, row in enumerate(scores):
        found = np.flatnonzero(row >= floors[index]) if floors is not None else None
        if found is None or found.size < k:  # no sample bound (a small vocabulary), or a nan in the sample
            found = np.arange(row.size)
        bounds[index] = np.partition(row[found], -k)[-k]
        candidates.append(found)
    return bounds, candidates


def next_tokens(logits, histories, options, rng):
    """Pick one token per row. ``options``: do_sample, temperature, top_k, top_p, repetition_penalty.

    With ``top_k`` the rows are narrowed to their k largest logits (and ties) first, in vocabulary order: every other
    token has probability 0, so the temperature, top-p, the softmax and the draw run over those k instead of the
    whole vocabulary (GPT-2's 50,257: a full sort per token took longer than a decode step), with the same draw from
    ``rng`` (the cumulative sums over the zeros are the same; only a sum's rounding order differs). The k are chosen
    on the logits as they come (float32) where there is no repetition penalty: dividing by a temperature keeps their
    order and ties, so the same k survive."""
    penalty = options["repetition_penalty"]
    scores = logits if penalty == 1.0 else apply_repetition_penalty(logits.astype(np.float64), histories, penalty)
    if not options["do_sample"]:
        return scores.argmax(axis=-1)
    temperature = max(options["temperature"], 1e-6)
    k = options["top_k"]
    if not k or k >= scores.shape[-1]:
        return np.array([_draw(row.astype(np.float64) / temperature, options["top_p"], rng) for row in scores])
    bounds, candidates = _kth_largest(scores, k)
    picks = []
    for row, bound, found in zip(scores, bounds, candidates):
        kept = found[row[found] >= bound]  # _top_k's survivors, in vocabulary order
        picks.append(kept[_draw(row[kept].astype(np.float64) / temperature, options["top_p"], rng)])
    return np.array(picks)


def _draw(row, top_p, rng):
    """One index of ``row`` (logits): top-p, then a draw from the softmax."""
    row = _top_p(row[None], top_p)[0]
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    return rng.choice(probs.shape[-1], p=probs)
