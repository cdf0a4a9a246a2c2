"""The KV cache's one-row decode attention kernel (kernels/decode_attention.py, opt-in
GPTLOCAL_DECODE_ATTENTION_KERNEL=1) against the plain path's ops
(GQA repeat, BatchMatMul, scale, additive mask, softmax, BatchMatMul; MindSpore, fp32) on odd sizes: GQA and
MHA, a per-row mask (each row its own position, the rows past it never read) and a shared one, a row with every
cache row masked, interior masked rows; and a model whose decode steps (one-token and device-side greedy) run it
gives the logits of the same model built on the plain path (GQA + rope)."""

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels import build
from mindformers_gptlocal.kernels.decode_attention import decode_attention_kernel
from mindformers_gptlocal.model.attention import MASK_VALUE
from conftest import TINY


@pytest.fixture(scope="module", autouse=True)
def pynative():
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setenv("GPTLOCAL_DECODE_ATTENTION_KERNEL", "1")


def plain(q, k, v, bias, scale):
    heads, groups = q.shape[1], k.shape[1]
    if groups != heads:
        shape = (k.shape[0], groups, heads // groups, k.shape[2], k.shape[3])
        k = ops.reshape(ops.broadcast_to(ops.expand_dims(k, 2), shape), (k.shape[0], heads, k.shape[2], k.shape[3]))
        v = ops.reshape(ops.broadcast_to(ops.expand_dims(v, 2), shape), k.shape)
    scores = ops.BatchMatMul(transpose_b=True)(q, k) * scale
    return ops.BatchMatMul()(ops.softmax(scores + ops.broadcast_to(bias, scores.shape), -1), v)


@pytest.mark.parametrize("batch,heads,groups,length,dim,shared", [
    (3, 4, 2, 37, 24, False),   # GQA, odd cache length and head size, per-row mask
    (2, 3, 3, 64, 16, False),   # MHA
    (1, 6, 1, 19, 8, True),     # multi-query, one mask for all rows
])
def test_decode_kernel_equals_the_plain_ops(batch, heads, groups, length, dim, shared):
    assert build.library()[0] is not None, "the kernel library must build here (g++ and oneDNN present)"
    rng = np.random.default_rng(length)
    q = rng.standard_normal((batch, heads, 1, dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, groups, length, dim)).astype(np.float32) for _ in range(2))
    positions = rng.integers(0, length, 1 if shared else batch)
    positions[0] = length - 1  # one row sees every cached row
    bias = np.where(np.arange(length)[None] > positions[:, None], MASK_VALUE, 0.0).astype(np.float32)
    if not shared:
        bias[-1, length // 3] = MASK_VALUE  # an interior masked row (a hole, as a serve slot's could be)
        if batch > 2:
            bias[1] = MASK_VALUE  # every row masked: the plain softmax is uniform there
    bias = bias.reshape(-1, 1, 1, length)
    scale = 1.0 / np.sqrt(dim)
    kernel = decode_attention_kernel(scale, ms.float32)
    args = [Tensor(x) for x in (q, k, v, bias)]
    out = kernel(*args).asnumpy()
    np.testing.assert_allclose(out, plain(*args, scale).asnumpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(out).max() > 0.1


def test_decode_kernel_is_opt_in(monkeypatch):
    monkeypatch.delenv("GPTLOCAL_DECODE_ATTENTION_KERNEL")
    assert decode_attention_kernel(0.125, ms.float32) is None
    ms.set_seed(0)
    assert GPTLocalForCausalLM(GPTLocalConfig(**TINY)).model.layers[0].attention.decode_attention is None


def test_model_decode_steps_equal_the_plain_path_model(monkeypatch):
    """GQA + rope, weights equal by seed: prefill, one-token decode and GreedySteps logits, kernels vs plain."""
    config = dict(TINY, num_query_groups=2, position_embedding_type="rope")

    def built(plain_kernels):
        monkeypatch.setenv("GPTLOCAL_DECODE_ATTENTION_KERNEL", "0" if plain_kernels else "1")
        ms.set_seed(2)
        lm = GPTLocalForCausalLM(GPTLocalConfig(**config))
        lm.set_train(False)
        return lm

    fast, reference = built(False), built(True)
    assert fast.model.layers[0].attention.decode_attention is not None
    assert reference.model.layers[0].attention.decode_attention is None
    prompts = [[5, 17, 42], list(range(1, 20)), [9] * 11]
    results = []
    for lm in (fast, reference):
        cache = lm.kv_cache(len(prompts), 40)
        seen = [cache.prefill(prompts)]
        cursor = np.array([len(p) for p in prompts])
        for step in range(3):
            seen.append(cache.decode(np.array([step + 1, step + 7, step + 300]), cursor))
            cursor = cursor + 1
        seen.append(cache.decode_greedy(np.array([4, 5, 6]), cursor, with_logits=True)[1])
        results.append(seen)
    for index, (a, b) in enumerate(zip(*results)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"call {index}")
