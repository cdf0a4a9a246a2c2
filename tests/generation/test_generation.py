"""Generation with the explicit KV cache: equal to recomputation, equal to transformers, bad input; through both
runners (``RUNNERS``: the native one, generate's default on CPU, ``runtime/native.py``; the compiled graphs,
``cpu_kernels: {runner: plain}``, ``runtime/runner.py``)."""
import hashlib

import numpy as np
import pytest
import torch
import mindspore as ms

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms
from mindformers_gptlocal.errors import ConfigError, DataError
from conftest import TINY

PROMPTS = [[5, 17, 42, 7, 99, 3, 11], [8, 1], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310], [77]]
RUNNERS = {"native": {}, "compiled": dict(cpu_kernels={"runner": "plain"})}  # model_config keys of each runner
# The references without the cache (the whole sequence through the model's forward each token, and transformers'),
# computed once for both runners: their models hold the same weights (the digest is in the key) and differ only in
# ``cpu_kernels: {runner}``, which picks how the cached path runs, not the forward these references run
REFERENCES = {}


def digest(model):
    """sha256 over the model's weights, in parameter order."""
    hashed = hashlib.sha256()
    for name, param in model.parameters_and_names():
        hashed.update(name.encode())
        hashed.update(param.asnumpy().tobytes())
    return hashed.hexdigest()


def shared(key, compute):
    """``REFERENCES[key]``, computed by ``compute()`` the first time."""
    if key not in REFERENCES:
        REFERENCES[key] = compute()
    return REFERENCES[key]


def recomputed(model, prompts, max_new, label="", **kwargs):
    """``generate(prompts, max_new_tokens=max_new, do_sample=False, use_past=False, **kwargs)``: greedy tokens
    recomputing the whole sequence each step, the cache's reference (``label`` names ``kwargs`` in the key)."""
    key = ("recomputed", digest(model), repr(prompts), max_new, label)
    return shared(key, lambda: model.generate(prompts, max_new_tokens=max_new, do_sample=False, use_past=False,
                                              **kwargs))


@pytest.fixture(scope="module", params=sorted(RUNNERS))
def model(request):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)  # fixed weights: exact-equality checks stay away from chance argmax ties
    lm = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **RUNNERS[request.param])))
    lm.kv_cache(1, 16)
    assert lm._kv_caches.kind == request.param  # pylint: disable=protected-access
    yield lm
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "batch4-ragged"])
def test_cache_gives_the_same_greedy_tokens_as_recomputation(model, prompts):
    cached = model.generate(prompts, max_new_tokens=12, do_sample=False, use_past=True)
    plain = recomputed(model, prompts, 12)
    assert cached == plain
    assert [len(c) for c in cached] == [len(p) + 12 for p in prompts]


def test_greedy_matches_transformers_generate(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=500, n_positions=64, n_embd=64, n_layer=2, n_head=4)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.mul_(8.0 if "wte" in name else 1.0)  # sharper logits: greedy paths that differ early
    hf.save_pretrained(str(tmp_path / "hf"))
    hf_to_ms(str(tmp_path / "hf"), str(tmp_path / "ms"))
    ours = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "ms"))
    prompts = [[5, 17, 42, 7], [8, 1, 2, 9, 33, 41, 250], [499]]
    ours_out = ours.generate(prompts, max_new_tokens=20, do_sample=False)
    for prompt, mine in zip(prompts, ours_out):
        with torch.no_grad():
            reference = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                    pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert mine == reference[0].tolist()


def test_sampling_is_reproducible_with_a_seed(model):
    options = dict(max_new_tokens=16, do_sample=True, temperature=1.5, top_k=50, top_p=0.9, repetition_penalty=1.2)
    first = model.generate(PROMPTS, seed=7, **options)
    again = model.generate(PROMPTS, seed=7, **options)
    other = model.generate(PROMPTS, seed=8, **options)
    assert first == again and first != other
    assert all(0 <= t < TINY["vocab_size"] for row in first for t in row)


def test_eos_stops_a_sequence(model):
    greedy = model.generate(PROMPTS[:1], max_new_tokens=6, do_sample=False)[0]
    eos = greedy[len(PROMPTS[0]) + 2]  # the third generated token
    stopped = model.generate(PROMPTS[:1], max_new_tokens=6, do_sample=False, eos_token_id=eos)[0]
    assert stopped == greedy[:len(PROMPTS[0]) + greedy[len(PROMPTS[0]):].index(eos) + 1]


def test_returns_mindformers_generate_output(model):
    from mindformers.generation.utils import GenerateOutput
    out = model.generate(PROMPTS[:2], max_new_tokens=3, return_dict_in_generate=True)
    assert isinstance(out, GenerateOutput) and out["scores"] is None  # MindFormers' model (mf/model.py)
    assert [len(s) for s in out["sequences"]] == [len(PROMPTS[0]) + 3, len(PROMPTS[1]) + 3]


@pytest.mark.parametrize("prompts,kwargs,error,pattern", [
    ([list(range(60))], dict(max_new_tokens=10), DataError, "exceeds the KV cache"),
    ([[]], {}, DataError, "prompt is empty"),
    ([[1]] * 9, {}, ConfigError, "exceed the configured batch size 8"),
    ([[1, 2, 600]], {}, DataError, "token id 600, outside the vocabulary"),
])
def test_bad_input(model, prompts, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        model.generate(prompts, **kwargs)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random HF GPT-2 (non-trivial biases and norms) and its gpt_local conversion's folder."""
    from conftest import save_hf
    path = tmp_path_factory.mktemp("values")
    hf = save_hf(path / "hf", seed=3, vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    hf_to_ms(str(path / "hf"), str(path / "ms"))
    return hf, str(path / "ms")


@pytest.fixture(scope="module", params=sorted(RUNNERS))
def hf_and_ours(hf_checkpoint, request):
    """The HF GPT-2 and the same weights as gpt_local (each runner), in graph mode."""
    ms.set_context(mode=ms.GRAPH_MODE)
    hf, path = hf_checkpoint
    ours = GPTLocalForCausalLM.from_pretrained(path, **RUNNERS[request.param])
    ours.set_train(False)
    yield hf, ours
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.parametrize("prompts", [[[5, 17, 42, 7, 99]], [[5, 17, 42, 7, 99, 3, 11], [8], [250, 1, 2, 3]]],
                         ids=["single", "ragged"])
def test_every_cached_step_has_the_logits_of_the_full_forward_and_of_transformers(hf_and_ours, prompts):
    """Logits, not greedy tokens: after the prefill and after each of 6 decode steps, each sequence's
    next-token logits equal (fp32) our own uncached forward over the whole sequence and transformers'.
    The decoded tokens are random, so every cache row and position is exercised."""
    hf, ours = hf_and_ours
    steps, width = 6, 64
    weights = digest(ours)
    cache = ours.kv_cache(len(prompts), max(len(p) for p in prompts) + steps)
    logits = cache.prefill(prompts)
    sequences = [list(p) for p in prompts]
    rng = np.random.default_rng(0)
    for step in range(steps + 1):
        block = np.zeros((len(sequences), width), np.int32)  # right padding: causal attention never sees it
        for row, seq in enumerate(sequences):
            block[row, :len(seq)] = seq
        full = shared(("full", weights, block.tobytes(), block.shape),
                      lambda: ours(ms.Tensor(block, ms.int32)).asnumpy())  # noqa: B023 (called here)
        for row, seq in enumerate(sequences):
            reference = shared(("hf", repr(seq)), lambda: hf_logits(hf, seq)[-1])  # noqa: B023 (called here)
            np.testing.assert_allclose(logits[row], full[row, len(seq) - 1], rtol=1e-4, atol=1e-4,
                                       err_msg=f"step {step}, row {row}: cache vs full forward")
            np.testing.assert_allclose(logits[row], reference, rtol=1e-4, atol=1e-4,
                                       err_msg=f"step {step}, row {row}: cache vs transformers")
        if step == steps:
            break
        tokens = rng.integers(0, 300, len(sequences))
        logits = cache.decode(tokens, [len(seq) for seq in sequences])
        for seq, token in zip(sequences, tokens):
            seq.append(int(token))


@pytest.mark.parametrize("prompts", [[[5, 17, 42, 7, 99]], [[5, 17, 42, 7, 99, 3, 11], [8], [250, 1, 2, 3]]],
                         ids=["single", "ragged"])
def test_greedy_steps_on_the_device_have_the_tokens_and_logits_of_one_step_decode_and_transformers(hf_and_ours,
                                                                                                  prompts):
    """``decode_greedy`` runs k greedy steps in one compiled call. Each step's logits equal (to 1e-5) the
    one-step decode's on the same cache and transformers' over the whole sequence, and each picked token
    is their argmax: the cache rows each in-graph step writes are the ones the next step reads."""
    hf, ours = hf_and_ours
    cache = ours.kv_cache(len(prompts), max(len(p) for p in prompts) + 20)
    steps = cache.decode_steps
    assert steps > 1
    first = cache.prefill(prompts).argmax(-1)
    cursor = np.array([len(p) for p in prompts])
    picks, logits = cache.decode_greedy(first, cursor, with_logits=True)
    assert picks.shape == (len(prompts), steps) and logits.shape == (len(prompts), steps, 300)
    cache.prefill(prompts)  # the same cache again, one step a call
    tokens = first
    for step in range(steps):
        single = cache.decode(tokens, cursor + step)
        np.testing.assert_allclose(logits[:, step], single, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
        tokens = single.argmax(-1)
        assert picks[:, step].tolist() == tokens.tolist()
    for row, prompt in enumerate(prompts):
        sequence = list(prompt) + [int(first[row])] + picks[row, :-1].tolist()
        reference = hf_logits(hf, sequence)[len(prompt):]
        np.testing.assert_allclose(logits[row], reference, rtol=1e-4, atol=1e-4, err_msg=f"row {row}")


def hf_logits(hf, sequence):
    """transformers' logits [len(sequence), V] over the whole sequence."""
    with torch.no_grad():
        return hf(torch.tensor([sequence])).logits[0].numpy()


def _one_step_generate(model, prompts, max_new, **kwargs):
    """generate's cached path with one compiled call per token (no device greedy steps): the reference."""
    from mindformers_gptlocal.generation.loop import decode_loop, resolve_options
    options = resolve_options(None, max_new_tokens=max_new, **kwargs)
    cache = model.kv_cache(len(prompts), max(len(p) for p in prompts) + max_new)
    logits = cache.prefill(prompts)
    return decode_loop(prompts, max_new, options, np.random.default_rng(options["seed"]), logits, cache.decode,
                       kwargs.get("stop_when"))


@pytest.mark.parametrize("prompts,max_new,kwargs", [
    (PROMPTS, 13, {}),  # 12 decode steps: one full chunk of 8 and a partial one
    ([list(range(1, 51)), [7, 8]], 14, {}),  # ends at the last cache row: the discarded steps' positions clamp
    (PROMPTS, 10, dict(eos_token_id="third")),  # rows end at EOS inside a chunk
    (PROMPTS, 10, dict(stop_when="second")),  # a stop rule ends rows inside a chunk
], ids=["chunks", "last-row", "eos", "stop_when"])
def test_multi_step_greedy_generate_equals_one_step_and_recomputation(model, prompts, max_new, kwargs):
    reference = recomputed(model, prompts, max_new)
    label = repr(kwargs)
    if kwargs.get("eos_token_id") == "third":
        kwargs = dict(eos_token_id=reference[0][len(prompts[0]) + 2])
    if kwargs.get("stop_when") == "second":
        def stop(rows, generated):
            return [len(g) >= 2 + row for row, g in zip(rows, generated)]
        kwargs = dict(stop_when=stop)
    if kwargs:
        reference = recomputed(model, prompts, max_new, label, **kwargs)
    multi = model.generate(prompts, max_new_tokens=max_new, do_sample=False, **kwargs)
    assert multi == _one_step_generate(model, prompts, max_new, do_sample=False, **kwargs) == reference
    assert model.kv_cache(len(prompts), max(len(p) for p in prompts) + max_new).decode_steps == 8


def test_bucketed_prefill_gives_the_logits_of_the_unpadded_prefill(model):
    """Prompts right-padded to the width bucket (16 for these): the logits after each prompt's last token,
    and the next decode step's, equal (1e-5) those of a prefill exactly as wide as the longest prompt."""
    from mindformers_gptlocal.runtime.runner import prefill_inputs
    cache = model.kv_cache(len(PROMPTS), 40)
    assert cache.widths == [16, 32, 64]
    bucketed = cache.prefill(PROMPTS)
    after_bucketed = cache.decode([1, 2, 3, 4], [len(p) for p in PROMPTS])
    ids, positions, lengths = prefill_inputs(PROMPTS, cache.batch_size, 0)
    assert ids.shape[1] == 11
    exact = cache.step(ids, positions, lengths - 1)
    after_exact = cache.decode([1, 2, 3, 4], [len(p) for p in PROMPTS])
    np.testing.assert_allclose(bucketed, exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after_bucketed, after_exact, rtol=1e-5, atol=1e-5)


def test_varied_prompt_lengths_compile_one_prefill_graph_per_bucket(model):
    """Prompt widths 1..40 through generate (one cache shape): 3 prefill graphs (widths 16, 32, 64) and one
    greedy-steps graph, not one graph per width; the compiled graphs are MindSpore's own per-Cell record. (The
    native runner compiles nothing.)"""
    if model._kv_caches.kind == "native":  # pylint: disable=protected-access
        pytest.skip("the native runner compiles no graph")
    for length in range(1, 41, 3):
        model.generate([list(range(1, length + 1))], max_new_tokens=10, do_sample=False)
    cache = model.kv_cache(1, 50)
    assert cache.max_length == 64
    assert len(cache.compile_cache) == 3  # widths 16, 32, 64
    assert sum(len(g.compile_cache) for g in cache._greedy.values()) == 1
