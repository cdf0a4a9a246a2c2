"""The KV cache's prefill through the fused CPU attention kernel (``KVCache.prefill``: ``fresh_prefill=True``) against
its plain reference, the cache's own call at the same positions (``KVCache.step``: plain ops over all L rows,
rows past each query masked): the same logits, the same keys/values written, the same decode logits afterwards;
GPT-2 (MHA, learned positions) and a GQA + rope model; odd prompt lengths across width buckets; stale rows of an
earlier, longer prompt batch in the cache. Where the kernel cannot serve the prefill (prefix tuning), the plain
path is used."""
import numpy as np
import pytest
import mindspore as ms

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.runtime.buckets import bucket_of
from mindformers_gptlocal.runtime.runner import prefill_inputs
from conftest import TINY

# (architecture, mode): GPT-2 from a GRAPH-mode caller (as ``gptlocal generate``); GQA + rope from a PyNative one
# (MindSpore's default: the runner compiles its graphs whatever the caller's mode, runtime/runner.py compiled_call,
# so both compile the same three graphs: the fused prefill, the plain step and the one-token step)
# (the compiled runner's prefill graphs: cpu_kernels {runner: plain}; on CPU generate's default is the native runner)
COMPILED = {"runner": "plain"}
ARCHS = {"gpt2-graph": (dict(cpu_kernels=COMPILED), ms.GRAPH_MODE),
         "gqa-rope-pynative": (dict(num_query_groups=2, position_embedding_type="rope", cpu_kernels=COMPILED),
                               ms.PYNATIVE_MODE)}
# ragged, odd lengths (1, 7, 17, 33: width bucket 64), one at a bucket edge (16)
PROMPTS = [[5, 17, 42, 7, 99, 3, 11], [8], list(range(100, 133)), list(range(200, 216)), list(range(300, 317))]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request):
    arch, mode = ARCHS[request.param]
    ms.set_context(mode=mode)
    ms.set_seed(1)
    lm = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **arch)))
    lm.set_train(False)
    yield lm
    ms.set_context(mode=ms.PYNATIVE_MODE)


def caches(cache, width):
    """The written rows 0..width-1 of every layer's key and value caches, as numpy."""
    return [c.asnumpy()[:, :, :width] for c in (*cache.key_caches, *cache.value_caches)]


def test_kernel_prefill_equals_the_plain_cached_prefill(model):
    prompts = PROMPTS
    cache = model.kv_cache(len(prompts), 60)
    assert cache.fresh_kernel, "the fused kernel must serve the prefill on CPU (kernels built)"
    rng = np.random.default_rng(0)
    stale = [rng.integers(0, TINY["vocab_size"], 40).tolist() for _ in prompts]  # longer: stale rows past the prompts
    cache.prefill(stale)
    width = bucket_of(max(len(p) for p in prompts), cache.widths)
    ids, positions, lengths = prefill_inputs(prompts, cache.batch_size, 0, width)
    tokens = [rng.integers(0, TINY["vocab_size"], len(prompts)) for _ in range(3)]

    def run(prefill):
        first = prefill()
        written = caches(cache, width)
        steps = [cache.decode(t, lengths + i) for i, t in enumerate(tokens)]
        return first, written, steps

    fast = run(lambda: cache.prefill(prompts))
    cache.prefill(stale)
    plain = run(lambda: cache.step(ids, positions, lengths - 1))
    assert np.abs(plain[0]).max() > 0.1  # real logits, not zeros
    np.testing.assert_allclose(fast[0], plain[0], rtol=1e-5, atol=1e-5, err_msg="prefill logits")
    for index, (a, b) in enumerate(zip(fast[1], plain[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"cache tensor {index} rows 0..W-1")
    for step, (a, b) in enumerate(zip(fast[2], plain[2])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"decode step {step} after the prefill")


def test_prefix_tuning_keeps_the_plain_prefill():
    """The prefix rows come before the prompt, so the prefill is not fresh causal attention: plain path (one graph: the
    prefill runs the plain step's)."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_seed(0)
    lm = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, seq_length=48), pet_config=dict(
        pet_type="ptuning2", pre_seq_len=3, prefix_projection=False, dropout_prob=0.0)))
    lm.set_train(False)
    cache = lm.kv_cache(1, 20)
    assert not cache.fresh_kernel
    prompt = [[5, 17, 42, 7]]
    ids, positions, lengths = prefill_inputs(prompt, 1, 0, bucket_of(4, cache.widths))
    np.testing.assert_array_equal(cache.prefill(prompt), cache.step(ids, positions, lengths - 1))
