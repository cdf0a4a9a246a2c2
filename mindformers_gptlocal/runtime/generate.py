"""``generate``: prompts in, token lists out, over the model's runner (``runner.py``), as MindFormers' generate.

``GPTLocalForCausalLM.generate`` (what MindFormers' predict pipeline calls) is this function. The host-side half
(options and their defaults, sampling, the decode loop) is ``generation/``; the compiled half (prefill, one-token
and greedy multi-step decode over the KV cache) is the model's ``ModelRunner`` (``model.kv_cache(batch, length)``).
"""
import numpy as np

from ..generation.loop import check_prompts, decode_loop, new_token_budget, resolve_options


def generate(model, input_ids, generation_config=None, streamer=None, seed=None, stop_when=None, **kwargs):
    """Token lists (prompt + generated, stopping after EOS) for a token list or a batch of lists.

    ``input_ids``: right padding with ``pad_token_id`` is stripped. Options as MindFormers'
    GenerationConfig (max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
    eos_token_id, use_past ...), from ``generation_config``, else the model's, overridden by
    keywords. ``use_past=False`` recomputes the whole sequence per token (the reference for
    tests). ``stop_when(rows, generated)``: called after each new token with the row indices still
    running and their generated tokens so far; the rows it returns True for stop (e.g. a stop
    string). Returns token lists, or a dict {"sequences": ..., "scores": None, "logits": None} with
    ``return_dict_in_generate=True`` (what MindFormers' predict pipeline asks for; MindFormers' model class hands it
    back as its ``GenerateOutput``).
    """
    base = generation_config
    if base is None:  # the model's default: its use_past=False means MindFormers' paged cache, not ours
        base = {k: v for k, v in _config_dict(getattr(model, "generation_config", None)).items() if k != "use_past"}
    options = resolve_options(base, seed=seed, **kwargs)
    prompts = [[int(t) for t in p] for p in _as_prompts(input_ids, options["pad_token_id"])]
    max_new = new_token_budget(prompts, options)
    config = model.config
    positions = getattr(model, "token_positions", config.max_position_embeddings)  # less a prefix-tuning prefix
    check_prompts(prompts, config.vocab_size, positions, max_new,
                  getattr(config, "max_batch_size", 8))
    rng = np.random.default_rng(options["seed"])
    was_training = model.training
    if was_training:  # set_train walks every Cell (~20 ms a call for GPT-2 small): only where the mode changes
        model.set_train(False)
    try:
        decode = _cached if options["use_past"] else _recompute
        sequences = decode(model, prompts, max_new, options, rng, stop_when)
    finally:
        if was_training:
            model.set_train(True)
    if streamer is not None:
        streamer.put(np.asarray(sequences[0]))
        streamer.end()
    return_dict = kwargs.get("return_dict_in_generate")
    if return_dict is None and base is not None:
        return_dict = getattr(base, "return_dict_in_generate", False)
    if return_dict:  # MindFormers' GenerateOutput's fields (its class wraps this dict: mf/model.py)
        return {"sequences": sequences, "scores": None, "logits": None}
    return sequences


def _cached(model, prompts, max_new, options, rng, stop_when=None):
    runner = model.kv_cache(len(prompts), max(len(p) for p in prompts) + max_new)  # runner.py ModelRunner
    logits = runner.prefill(prompts)
    return decode_loop(prompts, max_new, options, rng, logits, runner.decode, stop_when, runner.decode_greedy)


def _recompute(model, prompts, max_new, options, rng, stop_when=None, pad=0):
    """No cache: the whole (right-padded, fixed-width) sequence every step."""
    import mindspore as ms
    width = max(len(p) for p in prompts) + max_new
    sequences = [list(p) for p in prompts]

    def logits_at(cursor):
        block = np.full((len(sequences), width), pad, np.int32)
        for row, seq in enumerate(sequences):
            block[row, :len(seq)] = seq
        full = model(ms.Tensor(block, ms.int32)).asnumpy()
        return full[np.arange(len(sequences)), cursor - 1]

    def step(tokens, positions):  # tokens were placed at ``positions``
        for row, token in enumerate(tokens):
            sequences[row].append(int(token))
        return logits_at(positions + 1)
    return decode_loop(prompts, max_new, options, rng, logits_at(np.array([len(p) for p in prompts])), step,
                       stop_when)


def _config_dict(config):
    if config is None:
        return {}
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _as_prompts(input_ids, pad_token_id):
    """A list of token lists from a list, a batch, or a numpy/Tensor block; trailing padding removed."""
    if hasattr(input_ids, "asnumpy"):
        input_ids = input_ids.asnumpy()
    if isinstance(input_ids, np.ndarray):
        input_ids = input_ids.tolist()
    if input_ids and not isinstance(input_ids[0], (list, tuple)):
        input_ids = [input_ids]
    rows = [list(row) for row in input_ids]
    if pad_token_id is not None and len(rows) > 1:
        rows = [_strip_right(row, pad_token_id) for row in rows]
    return rows


def _strip_right(row, pad):
    end = len(row)
    while end > 1 and row[end - 1] == pad:
        end -= 1
    return row[:end]
