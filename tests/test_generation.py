"""Generation with the explicit KV cache: equal to recomputation, equal to transformers, bad input."""
import pytest
import torch
import mindspore as ms

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms
from mindformers_gptlocal.errors import ConfigError, DataError
from conftest import TINY

PROMPTS = [[5, 17, 42, 7, 99, 3, 11], [8, 1], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310], [77]]


@pytest.fixture(scope="module")
def model():
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)  # fixed weights: exact-equality checks stay away from chance argmax ties
    yield GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "batch4-ragged"])
def test_cache_gives_the_same_greedy_tokens_as_recomputation(model, prompts):
    cached = model.generate(prompts, max_new_tokens=12, do_sample=False, use_past=True)
    plain = model.generate(prompts, max_new_tokens=12, do_sample=False, use_past=False)
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
    out = model.generate(PROMPTS[:2], max_new_tokens=3, return_dict_in_generate=True)
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
