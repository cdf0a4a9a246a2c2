"""Linear's GEMM kernel with the bias inside (kernels/cells/linear.py, cpu_linear.cc) against MindSpore's MatMul + Add (the
plain path of model/layers.py Linear) and float64, forward and gradients, on odd shapes; Linear and the output head
choosing it by their compiled graph's static row count (inference only with ``model_config.cpu_kernels``
``{linear: auto}``, the default; every graph with ``kernel``, never with ``plain``); the key's values."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.kernels import provider
from mindformers_gptlocal.kernels.cells import linear
from mindformers_gptlocal.kernels.provider import KernelProvider, read_cpu_kernels
from mindformers_gptlocal.model.layers import Linear, use_gemm
from conftest import TINY
from references import assert_within_rounding

IN, OUT = 77, 109  # not multiples of 8; 33 x 109 x 77 multiply-adds run on 2 threads (common.h gemm_threads):
# 7 groups of 16 columns split 4 + 3, the bias copied per block


def _close(actual, expected, name):
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, atol=1e-5 * scale, rtol=0, err_msg=name)


@pytest.mark.parametrize("rows", [1, 3, 33])
def test_bias_inside_matches_matmul_add_and_float64(library, pynative_mode, rows):
    """x W^T + b in one kernel call, and dx, dW, db, against MatMul + Add and float64."""
    rng = np.random.default_rng(rows)
    x, w = rng.standard_normal((rows, IN)).astype(np.float32), rng.standard_normal((OUT, IN)).astype(np.float32)
    b, weight = rng.standard_normal(OUT).astype(np.float32), rng.standard_normal((rows, OUT)).astype(np.float32)
    args = tuple(Tensor(a) for a in (x, w, b))
    kernel = linear.CPULinearGEMM(library, threads=2)
    matmul = ops.MatMul(transpose_b=True)

    def grads(fn):
        value = fn(*args)
        got = ms.grad(lambda *a: (fn(*a) * Tensor(weight)).sum(), (0, 1, 2))(*args)
        return [value.asnumpy()] + [g.asnumpy() for g in got]

    got, want = grads(kernel), grads(lambda x_, w_, b_: matmul(x_, w_) + b_)
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, weight))
    exact = [x64 @ w64.T + b, g64 @ w64, g64.T @ x64, g64.sum(0)]
    ax, aw, ag = np.abs(x64), np.abs(w64), np.abs(g64)
    magnitudes = [ax @ aw.T + np.abs(b), ag @ aw, ag.T @ ax, ag.sum(0)]  # each element's sum of |terms|
    for name, actual, expected, precise, magnitude, length in zip(("y", "dx", "dw", "db"), got, want, exact,
                                                                  magnitudes, (IN + 1, OUT, rows, rows)):
        assert_within_rounding(actual, expected, magnitude, length, name=name + " vs MindSpore")
        assert_within_rounding(actual, precise, magnitude, length, sides=1, name=name + " vs float64")
    assert_within_rounding(kernel(args[0], args[1]).asnumpy(), x64 @ w64.T, ax @ aw.T, IN, sides=1,
                           name="y without bias")  # the four-parameter call still


class _Marked(linear.CPULinearGEMM):
    """The real kernel, its output doubled: tells which path a compiled graph took (values alone cannot: both
    paths agree to 1e-6)."""

    def construct(self, x, weight, bias=None):
        return 2.0 * super().construct(x, weight, bias)


def _marked_linear(library, mode):
    """A Linear built with ``cpu_kernels: {linear: mode}`` (None: the default provider, ``auto``), its gemm marked,
    and its (W, b) in float64."""
    kernels = KernelProvider() if mode is None else KernelProvider({"linear": mode})
    layer = Linear(IN, OUT, 0.5, ms.float32, ms.float32, kernels=kernels)
    assert layer.gemm is not None
    layer.gemm = _Marked(library)
    bias = np.random.default_rng(7).standard_normal(OUT).astype(np.float32)
    layer.bias.set_data(Tensor(bias))
    return layer, layer.weight.asnumpy().astype(np.float64), bias.astype(np.float64)


def _check(layer, weight, bias, shape, kernel_expected):
    """layer(x) == x W^T + b (float64), doubled where the kernel ran."""
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    want = (x.astype(np.float64) @ weight.T + bias) * (2.0 if kernel_expected else 1.0)
    _close(layer(Tensor(x)).asnumpy(), want, f"training={layer.training} shape={shape}")


def test_linear_picks_the_kernel_by_static_rows_in_inference(library, graph_mode):
    """Default (auto): compiled inference graphs of >= LINEAR_GEMM_ROWS rows run the kernel (bias inside), fewer rows
    and training graphs MatMul; [B, S, in] inputs count as B * S rows."""
    threshold = provider.LINEAR_GEMM_ROWS
    layer, weight, bias = _marked_linear(library, None)
    assert layer.gemm_rule == provider.LINEAR_RULE == (threshold, 0)
    layer.set_train(False)
    _check(layer, weight, bias, (threshold - 1, 1, IN), False)
    _check(layer, weight, bias, (2, threshold // 2, IN), True)  # exactly the threshold
    layer.set_train(True)
    _check(layer, weight, bias, (2, threshold // 2, IN), False)


def test_always_and_never(library, pynative_mode):
    """cpu_kernels {linear: kernel}: the kernel in every graph, one row and training too; plain builds none; anything
    else is refused naming the key and the allowed values."""
    assert _marked_linear(library, "auto")[0].gemm_rule == (provider.LINEAR_GEMM_ROWS, 0)
    layer, weight, bias = _marked_linear(library, "kernel")
    assert layer.gemm_rule == provider.EVERY_GRAPH
    for train in (False, True):
        layer.set_train(train)
        _check(layer, weight, bias, (1, IN), True)
    assert Linear(IN, OUT, 0.5, ms.float32, ms.float32, kernels=KernelProvider({"linear": "plain"})).gemm is None
    rules = (None, (0, 0), (5, 0), (6, 0))
    assert [use_gemm(rule, False, 5) for rule in rules] == [False, True, True, False]
    assert [use_gemm(rule, True, 99) for rule in rules[:3]] == [False, True, False]
    # the head's rule (HEAD_RULE: from 16 rows and at up to HEAD_GEMM_FEW_ROWS, 2), inference graphs only
    head = provider.HEAD_RULE
    assert head == (16, 2)
    assert [use_gemm(head, False, rows) for rows in (1, 2, 3, 15, 16)] == [True, True, False, False, True]
    assert [use_gemm(rule, True, 1) for rule in (None, (0, 2), head)] == [False, True, False]
    with pytest.raises(ConfigError, match=r"model_config.cpu_kernels.linear is 'yes'; set one of auto, kernel, plain"):
        read_cpu_kernels({"linear": "yes"})


def test_model_builds_the_row_thresholds():
    """A tiny GPT-2's Linears and head get the default thresholds (their values against transformers by default:
    tests/generation/test_generation.py, tests/checkpoint's conversions), none with cpu_kernels {linear: plain}."""
    config = GPTLocalConfig(**TINY)
    model = GPTLocalForCausalLM(config)
    layer = model.model.layers[0]
    assert [layer.attention.linear_qkv.gemm_rule, layer.mlp.linear_fc2.gemm_rule, model.head_gemm_rule] == [
        provider.LINEAR_RULE, provider.LINEAR_RULE, provider.HEAD_RULE]
    plain = GPTLocalForCausalLM(GPTLocalConfig(**TINY, cpu_kernels={"linear": "plain"}))
    assert plain.head_gemm is None and plain.model.layers[0].attention.linear_qkv.gemm_rule is None


def test_compiled_training_graph_with_and_without_bias(library, graph_mode):
    """One compiled training graph holding the kernel's forward with the bias and without it (cpu_kernels
    {linear: kernel}): each keeps its own backward (the two share one C++ forward; two AOT Customs of one symbol
    once shared a bprop there, a TypeError), loss and gradients as MatMul + Add's."""
    from mindspore import nn

    class Two(nn.Cell):
        def __init__(self, mode):
            super().__init__()
            kernels = KernelProvider({"linear": mode})
            self.first = Linear(IN, OUT, 0.5, ms.float32, ms.float32, kernels=kernels)
            self.second = Linear(OUT, IN, 0.5, ms.float32, ms.float32, has_bias=False, kernels=kernels)

        def construct(self, x):
            return (self.second(self.first(x)) ** 2).sum()

    x = Tensor(np.random.default_rng(5).standard_normal((9, IN)).astype(np.float32))
    results = []
    for mode in ("kernel", "plain"):
        ms.set_seed(0)
        net = Two(mode)
        net.first.bias.set_data(Tensor(np.random.default_rng(6).standard_normal(OUT).astype(np.float32)))
        assert (net.first.gemm is not None) == (mode == "kernel")
        net.set_train(True)
        loss, grads = ms.value_and_grad(net, None, net.trainable_params())(x)
        results.append([loss.asnumpy()] + [g.asnumpy() for g in grads])
    for got, want in zip(*results):
        _close(got / max(1.0, float(np.abs(want).max())), want / max(1.0, float(np.abs(want).max())), "training")


def test_the_head_runs_the_kernel_at_one_and_two_rows_in_inference(graph_mode):
    """cpu_kernels auto: an inference graph's head of 1 or 2 rows (the decode step at batch 1, 2) runs the GEMM kernel
    (HEAD_RULE), 3-15 rows MatMul: with the head kernel's argument vector broken, a batch-4 prefill of 3
    tokens (12 rows) and its decode steps (4 rows) run, a batch-1 or batch-2 decode fails (the compiled runner's
    graphs: ``cpu_kernels: {runner: plain}``)."""
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, cpu_kernels={"runner": "plain"}), inference=True)
    model.set_train(False)
    model.head_gemm.config = Tensor(np.ones(1, np.float32))  # a call of the head's kernel now fails
    runner = model.kv_cache(4, 30)
    logits = runner.prefill([[1, 2, 3]] * 4)
    runner.decode(logits.argmax(-1), np.array([3] * 4))
    for batch in (1, 2):
        with pytest.raises(RuntimeError):
            small = model.kv_cache(batch, 30)
            small.decode(small.prefill([[1, 2, 3]] * batch).argmax(-1), np.array([3] * batch))
