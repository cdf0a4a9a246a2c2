"""model_config.attention_block_size: query-blocked attention with the scores recomputed in the backward
(model/blockwise_attention.py) gives the plain path's loss and gradients (fp32, max abs diff <= 1e-5)
with the causal mask, packed documents, counter dropout on the probabilities and recompute."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import ConfigError
from references import LossOf, causal_bias, copy_weights
from mindformers_gptlocal.model.blockwise_attention import BlockwiseAttention
from conftest import TINY

SEQ = 40  # block 16: blocks of 16, 16 and 8 rows


def _pair(block_size=16, **changes):
    """A plain model and a blockwise one with the same weights."""
    values = dict(TINY, max_position_embeddings=SEQ, seq_length=SEQ, **changes)
    plain = GPTLocalForCausalLM(GPTLocalConfig(**values))
    blockwise = GPTLocalForCausalLM(GPTLocalConfig(**dict(values, attention_block_size=block_size)))
    copy_weights(plain, blockwise)
    for layer in plain.model.layers:  # the plain matmul + softmax path, not the CPU kernel (its own tests)
        layer.attention.core = layer.attention.plain
    assert type(blockwise.model.layers[0].attention.core).__name__ == "BlockwiseCore"
    assert plain.model.layers[0].attention.core is plain.model.layers[0].attention.plain
    return plain, blockwise


def _loss_and_grads(model, *inputs):
    """One training forward + backward of ``model`` (compiled with ms.jit in graph mode)."""
    model.set_train(True)
    weights = model.trainable_params()
    step = ms.value_and_grad(LossOf(model), None, weights=weights)
    if ms.get_context("mode") == ms.GRAPH_MODE:
        step = ms.jit(step)
    loss, grads = step(*inputs)
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(weights, grads)}


def _assert_same(plain, blockwise, *inputs, reference=None):
    """``blockwise``'s loss and gradients against ``plain``'s (or ``reference``: plain's, computed already)."""
    loss, grads = reference or _loss_and_grads(plain, *inputs)
    loss_b, grads_b = _loss_and_grads(blockwise, *inputs)
    assert abs(loss - loss_b) <= 1e-5, (loss, loss_b)
    worst = max(float(np.abs(grads[name] - grads_b[name]).max()) for name in grads)
    assert worst <= 1e-5, worst
    assert max(float(np.abs(g).max()) for g in grads.values()) > 1e-3  # the gradients are not all ~0
    return loss, grads


def _ids(batch=2):
    return Tensor(np.random.default_rng(0).integers(1, TINY["vocab_size"], (batch, SEQ + 1)).astype(np.int32))


def test_attention_cell_matches_autodiff_of_the_plain_formula(pynative_mode):
    """The Cell alone: forward and its hand-written backward (dQ, dK, dV) against MindSpore's autodiff of
    matmul + softmax, with a causal bias and with a dropout keep mask."""
    rng = np.random.default_rng(1)
    q, k, v, w = (Tensor(rng.standard_normal((2, 3, SEQ, 8)).astype(np.float32)) for _ in range(4))
    bias = causal_bias(SEQ)
    keep = Tensor(rng.random((2, 3, SEQ, SEQ)) < 0.75)
    scale = 1 / np.sqrt(8)
    cell = BlockwiseAttention(16, scale, ms.float32, ms.float32, dropout_scale=1 / 0.75)

    def plain(q, k, v, keep):
        probs = ops.softmax(ops.matmul(q, k.swapaxes(-1, -2)) * scale + bias, -1)
        if keep.ndim == 4:
            probs = probs * ops.cast(keep, ms.float32) * (1 / 0.75)
        return (ops.matmul(probs, v) * w).sum()

    for mask in (Tensor(np.ones((1,), np.bool_)), keep):
        want, want_grads = ms.value_and_grad(plain, (0, 1, 2))(q, k, v, mask)
        got, got_grads = ms.value_and_grad(lambda q, k, v: (cell(q, k, v, bias, mask) * w).sum(), (0, 1, 2))(q, k, v)
        assert abs(float(want.asnumpy()) - float(got.asnumpy())) <= 1e-4 * abs(float(want.asnumpy()))
        for expected, actual in zip(want_grads, got_grads):
            np.testing.assert_allclose(actual.asnumpy(), expected.asnumpy(), atol=1e-5, rtol=0)


def test_training_dropout_and_recompute_match_plain(graph_mode):
    """Causal mask, batch 2: loss and every parameter's gradient (graph mode, as training compiles it); then counter
    dropout on the attention probabilities (and the hidden dropouts) on the same weights: the blockwise path drops
    the same elements; then with every layer recomputed too, against the same plain graph without recompute (whose
    loss and gradients recompute must not change: a recomputed forward drawing other masks would show)."""
    plain, blockwise = _pair()
    _, grads = _assert_same(plain, blockwise, _ids())
    source = plain
    dropout = dict(attention_dropout=0.2, hidden_dropout=0.1)
    plain, blockwise = _pair(**dropout)
    assert blockwise.model.counter_dropout
    for model in (plain, blockwise):  # the same weights (and the dropout models' own counter)
        copy_weights(source, model, keep=("dropout_step",))
    reference = _loss_and_grads(plain, _ids())  # the first step of a fresh counter, as each blockwise model's below
    grads_dropout = _assert_same(plain, blockwise, _ids(), reference=reference)[1]
    largest = max(float(np.abs(g).max()) for g in grads.values())  # dropout did act: the gradients differ (the
    assert max(float(np.abs(grads[n] - grads_dropout[n]).max()) for n in grads) > 0.05 * largest  # loss barely moves)
    parallel = {"recompute": {"recompute": True}}
    values = dict(TINY, max_position_embeddings=SEQ, seq_length=SEQ, attention_block_size=16, **dropout)
    recomputed = GPTLocalForCausalLM(GPTLocalConfig(**values, parallel_config=parallel))
    assert [layer.recompute_mode for layer in recomputed.model.layers] == ["full", "full"]
    assert type(recomputed.model.layers[0].attention.core).__name__ == "BlockwiseCore"
    copy_weights(source, recomputed, keep=("dropout_step",))
    _assert_same(plain, recomputed, _ids(), reference=reference)


def test_packed_documents_match_plain(graph_mode):
    """actual_seq_len (GPTLocalModel.document_mask): attention stays inside each document in both paths."""
    ids = _ids()
    ends = Tensor(np.array([[11, 18, 34, SEQ], [20, 29, SEQ, SEQ]], np.int32))
    _assert_same(*_pair(), ids[:, :-1], ids[:, 1:], None, None, None, ends)


def test_bad_block_size_is_refused_by_name():
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ConfigError, match="attention_block_size"):
            GPTLocalConfig(**dict(TINY, attention_block_size=bad))
    assert GPTLocalConfig(**TINY).attention_block_size == 0


def test_linear_explicit_bias_broadcast_is_exact(pynative_mode):
    """CPU Linear's explicit bias broadcast (less peak memory): the same output bit for bit, the same gradients."""
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.layers import Linear
    rng = np.random.default_rng(2)
    x = Tensor(rng.standard_normal((2, 5, 16)).astype(np.float32))
    results = []
    for broadcast in (False, True):
        # composed_ops: the broadcast before the Add (the provider's choice, bound at build)
        kernels = KernelProvider({"composed_ops": "auto" if broadcast else "plain"}, device_target="CPU")
        linear = Linear(16, 24, 0.02, ms.float32, ms.float32, kernels=kernels)
        assert linear.broadcast_bias == broadcast
        linear.weight.set_data(Tensor(rng.standard_normal((24, 16)).astype(np.float32)) if not results
                               else Tensor(results[0][2]))
        linear.bias.set_data(Tensor(np.linspace(-1, 1, 24).astype(np.float32)))
        out, grads = ms.value_and_grad(lambda v: (linear(v) ** 2).sum(), 0, weights=linear.trainable_params())(x)
        results.append((out.asnumpy(), [g.asnumpy() for g in grads[1]], linear.weight.asnumpy()))
    assert results[0][0] == results[1][0]
    for plain, explicit in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(explicit, plain, rtol=1e-6, atol=1e-6)
