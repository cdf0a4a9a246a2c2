"""generate(): prompts in, token ids out, with the explicit KV cache (or without, for checking).

Options are MindFormers' GenerationConfig names: max_new_tokens / max_length, do_sample,
temperature, top_k, top_p, repetition_penalty, eos_token_id, pad_token_id, use_past (cache on/off).
"""
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor

from ..errors import ConfigError, DataError
from .decoding import next_tokens
from .kv_cache import CachedDecoder, prefill_inputs, run_step

CACHE_BUCKET = 64
DEFAULTS = {"max_new_tokens": None, "max_length": None, "do_sample": False, "temperature": 1.0, "top_k": 0,
            "top_p": 1.0, "repetition_penalty": 1.0, "eos_token_id": None, "pad_token_id": None,
            "use_past": True, "seed": None}


def resolve_options(base=None, **overrides):
    """DEFAULTS <- a GenerationConfig / dict <- keyword overrides (None values do not override)."""
    options = dict(DEFAULTS)
    if base is not None:
        items = base.to_dict() if hasattr(base, "to_dict") else dict(base)
        options.update({k: v for k, v in items.items() if k in DEFAULTS and v is not None})
    options.update({k: v for k, v in overrides.items() if k in DEFAULTS and v is not None})
    eos = options["eos_token_id"]
    options["eos_token_id"] = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    options["top_k"] = int(options["top_k"] or 0)
    return options


def check_prompts(prompts, config, max_new_tokens, max_batch_size):
    """One clear error for each prompt batch the cache cannot serve."""
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise DataError("generate: a prompt is empty; give at least one token per prompt.")
    if len(prompts) > max_batch_size:
        raise ConfigError(f"generate: {len(prompts)} prompts exceed the configured batch size {max_batch_size} "
                          f"(model_config.max_batch_size); split the prompts or raise max_batch_size.")
    for row, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise DataError(f"generate: prompt {row} holds token id {bad[0]}, outside the vocabulary "
                            f"(vocab_size {config.vocab_size}); encode it with the model's tokenizer.")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_position_embeddings:
        raise DataError(f"generate: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                        f"KV cache of max_position_embeddings={config.max_position_embeddings} positions; shorten "
                        f"the prompt or lower max_new_tokens.")


def generate_ids(model, prompts, options):
    """Token lists (prompt + generated, stopping after EOS) for each prompt."""
    config = model.config
    prompts = [[int(t) for t in p] for p in prompts]
    longest = max((len(p) for p in prompts), default=0)
    max_new = options["max_new_tokens"]
    if max_new is None:
        max_new = max(options["max_length"] - longest, 1) if options["max_length"] else 32
    check_prompts(prompts, config, max_new, getattr(config, "max_batch_size", 8))
    rng = np.random.default_rng(options["seed"])
    pad = 0  # filler for the right-padded block: never attended to, and always inside the vocabulary
    was_training = model.training
    model.set_train(False)
    try:
        if options["use_past"]:
            return _cached(model, prompts, max_new, options, rng, pad)
        return _recompute(model, prompts, max_new, options, rng, pad)
    finally:
        model.set_train(was_training)


def cache_length(needed, limit, bucket=CACHE_BUCKET):
    """Cache rows to allocate: ``needed`` rounded up to a bucket (so nearby lengths share one compiled
    graph), capped at max_position_embeddings."""
    return min(limit, -(-needed // bucket) * bucket)


def _cached(model, prompts, max_new, options, rng, pad):
    batch = len(prompts)
    needed = max(len(p) for p in prompts) + max_new
    decoder = cached_decoder(model, batch, cache_length(needed, model.config.max_position_embeddings))
    started = time.perf_counter()
    ids, positions, lengths = prefill_inputs(prompts, batch, pad)
    logits = run_step(decoder, ids, positions, lengths - 1)
    prefilled = time.perf_counter()
    outputs = _loop(prompts, max_new, options, rng, logits,
                    lambda tokens, cursor: run_step(decoder, tokens[:, None], cursor[:, None], np.zeros(batch)))
    model.last_generate_timing = {"prefill_s": prefilled - started, "decode_s": time.perf_counter() - prefilled,
                                  "new_tokens": max(len(o) for o in outputs) - max(len(p) for p in prompts)}
    return outputs


def _recompute(model, prompts, max_new, options, rng, pad):
    """No cache: the whole (right-padded, fixed-width) sequence every step. The reference for tests."""
    width = max(len(p) for p in prompts) + max_new
    sequences = [list(p) for p in prompts]

    def logits_at(cursor):
        block = np.full((len(sequences), width), pad, np.int32)
        for row, seq in enumerate(sequences):
            block[row, :len(seq)] = seq
        full = model(Tensor(block, ms.int32)).asnumpy()
        return full[np.arange(len(sequences)), cursor - 1]

    first = logits_at(np.array([len(p) for p in prompts]))

    def step(tokens, cursor):  # tokens were placed at positions ``cursor``
        for row, token in enumerate(tokens):
            sequences[row].append(int(token))
        return logits_at(cursor + 1)
    return _loop(prompts, max_new, options, rng, first, step)


def _loop(prompts, max_new, options, rng, logits, step):
    """Shared decode loop: pick, append, stop at EOS or max_new tokens; ``step`` gives the next logits."""
    outputs = [list(p) for p in prompts]
    done = np.zeros(len(prompts), bool)
    cursor = np.array([len(p) for p in prompts], np.int32)
    for produced in range(max_new):
        tokens = next_tokens(logits, outputs, options, rng)
        for row, token in enumerate(tokens):
            if not done[row]:
                outputs[row].append(int(token))
                done[row] = int(token) in options["eos_token_id"]
        if done.all() or produced == max_new - 1:
            break
        logits = step(np.asarray(tokens, np.int32), cursor)
        cursor = cursor + 1
    return outputs


def cached_decoder(model, batch_size, max_length, keep=4):
    """The model's CachedDecoder for this shape, built once and reused (no recompile per call)."""
    decoders = model.__dict__.setdefault("_gptlocal_decoders", {})
    key = (batch_size, max_length)
    if key not in decoders:
        while len(decoders) >= keep:
            decoders.pop(next(iter(decoders)))
        decoders[key] = CachedDecoder(model, batch_size, max_length)
    return decoders[key]
