"""The decode loop: prompts in, token ids out, over any step function that gives next-token logits.

Options are MindFormers' GenerationConfig names: max_new_tokens / max_length, do_sample,
temperature, top_k, top_p, repetition_penalty, eos_token_id, pad_token_id, use_past (cache on/off),
seed. Nothing here knows the model: ``runtime/generate.py`` hands in its runner's steps.
"""
import numpy as np

from ..errors import ConfigError, DataError
from .defaults import LIBRARY, LIBRARY_NEW_TOKENS
from .sampling import next_tokens
from .stopping import StopRule


def resolve_options(base=None, **overrides):
    """``defaults.LIBRARY`` <- a GenerationConfig / dict <- keyword overrides (None values do not override)."""
    options = dict(LIBRARY)
    if base is not None:
        items = base.to_dict() if hasattr(base, "to_dict") else dict(base)
        options.update({k: v for k, v in items.items() if k in LIBRARY and v is not None})
    options.update({k: v for k, v in overrides.items() if k in LIBRARY and v is not None})
    eos = options["eos_token_id"]
    options["eos_token_id"] = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    options["top_k"] = int(options["top_k"] or 0)
    return options


def new_token_budget(prompts, options):
    """max_new_tokens, or what max_length leaves after the longest prompt (at least 1), or
    ``defaults.LIBRARY_NEW_TOKENS``."""
    if options["max_new_tokens"] is not None:
        return options["max_new_tokens"]
    longest = max((len(p) for p in prompts), default=0)
    return max(options["max_length"] - longest, 1) if options["max_length"] else LIBRARY_NEW_TOKENS


def check_prompts(prompts, vocab_size, max_positions, max_new_tokens, max_batch_size):
    """One clear error for each prompt batch the cache cannot serve."""
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise DataError("generate: a prompt is empty; give at least one token per prompt.")
    if len(prompts) > max_batch_size:
        raise ConfigError(f"generate: {len(prompts)} prompts exceed the configured batch size {max_batch_size} "
                          f"(model_config.max_batch_size); split the prompts or raise max_batch_size.")
    for row, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise DataError(f"generate: prompt {row} holds token id {bad[0]}, outside the vocabulary "
                            f"(vocab_size {vocab_size}); encode it with the model's tokenizer.")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_positions:
        raise DataError(f"generate: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                        f"KV cache of max_position_embeddings={max_positions} positions; shorten "
                        f"the prompt or lower max_new_tokens.")


def is_greedy(options):
    """Whether every pick is the plain argmax of the logits (what ``greedy_steps`` computes on the device)."""
    return not options["do_sample"] and options["repetition_penalty"] == 1.0


def decode_loop(prompts, max_new, options, rng, logits, step, stop_when=None, greedy_steps=None):
    """Pick, append, stop (``stopping.StopRule``: at EOS, at a stop string, after max_new tokens). ``logits``: [B, V]
    after each prompt; ``step(tokens, positions)`` places one token per sequence at ``positions`` and returns the next
    logits. ``stop_when(rows, generated)`` (optional: the stop-string check) is asked after each new token for the
    rows still running whose token is not EOS, with their generated tokens so far, and ends the rows it returns True
    for. ``greedy_steps(tokens, positions)`` (optional, used only when ``is_greedy(options)``) places the tokens and
    returns the next k greedy picks [B, k] at once; they are taken one by one exactly as picks from ``step``
    would be, and the picks of a finished row (or past max_new) are discarded, so the result is the same."""
    outputs = [list(p) for p in prompts]
    done = np.zeros(len(prompts), bool)
    cursor = np.array([len(p) for p in prompts], np.int32)
    rule = StopRule(options["eos_token_id"], max_new)
    chunked = greedy_steps is not None and is_greedy(options)
    queued = [next_tokens(logits, outputs, options, rng)]
    for produced in range(1, max_new + 1):
        tokens = queued.pop(0)
        running = np.flatnonzero(~done).tolist()
        for row in running:
            outputs[row].append(int(tokens[row]))
        matched = set()
        asked = [row for row in running if not rule.is_eos(tokens[row])]
        if stop_when is not None and asked:
            hits = stop_when(asked, [outputs[row][len(prompts[row]):] for row in asked])
            matched = {row for row, hit in zip(asked, hits) if hit}
        for row in running:
            done[row] = rule.finish(tokens[row], produced, row in matched) is not None
        if done.all():
            break
        if queued:
            continue
        if chunked:
            picks = np.asarray(greedy_steps(np.asarray(tokens, np.int32), cursor))
            queued = list(picks.T)
            cursor = cursor + picks.shape[1]
        else:
            logits = step(np.asarray(tokens, np.int32), cursor)
            queued = [next_tokens(logits, outputs, options, rng)]
            cursor = cursor + 1
    return outputs
