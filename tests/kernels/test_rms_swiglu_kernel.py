"""The CPU RMSNorm and SwiGLU kernels (mindformers_gptlocal/kernels/cells/rms_swiglu.py) and Linear's GEMM kernel
(kernels/cells/linear.py): outputs and every gradient against MindSpore's ops (the plain path of model/layers.py RMSNorm
and Linear, model/layers.py SiLU + Mul) and a float64 reference, on odd shapes and the multi-threaded path; a
tiny Llama-style model's logits, losses and gradients with the kernels equal the plain path's; the switches keep
the plain path."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.cells import linear, rms_swiglu
from mindformers_gptlocal.model.layers import SiLU
from conftest import TINY
from references import (MINDSPORE_SIGMOID_ULPS, NORM_ROUNDINGS, assert_error_of_plain_size,
                        assert_kernel_and_plain_within_rounding, assert_within_rounding, float64_weights,
                        gelu_float64, gpt_float64_logits, gpt_float64_steps, trains_like_plain)

# T * H >= 32768 runs on several threads (common.h threads_for); 3 threads split 131 rows unevenly
SHAPES = [(3, 7, 77), (131, 257)]
LLAMA = dict(position_embedding_type="rope", num_query_groups=2, hidden_act="swiglu", normalization="RMSNorm",
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=176)


def _grads(fn, args, weight):
    """fn's output and the gradients of sum(fn(*args) * weight) for every argument."""
    value = fn(*args)
    grads = ms.grad(lambda *a: (fn(*a) * weight).sum(), tuple(range(len(args))))(*args)
    return value.asnumpy(), [g.asnumpy() for g in grads]


def _plain_rmsnorm(eps):
    """model/layers.py RMSNorm's plain ops, with the kernel off."""
    square, mean, rsqrt = ops.Square(), ops.ReduceMean(keep_dims=True), ops.Rsqrt()
    return lambda x, w: x * rsqrt(mean(square(x), -1) + eps) * w


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_rmsnorm_matches_mindspore_and_float64(library, pynative_mode, shape, threads):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 2.5 + 0.5).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    weight = rng.standard_normal(shape).astype(np.float32)
    eps = 1e-6
    args = (Tensor(x), Tensor(w))
    got, got_grads = _grads(rms_swiglu.CPURMSNorm(library, eps, threads=threads), args, Tensor(weight))
    want, want_grads = _grads(_plain_rmsnorm(eps), args, Tensor(weight))
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, weight))
    rstd = 1.0 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps)
    xhat = x64 * rstd
    g = g64 * w64
    exact = [xhat * w64, rstd * (g - xhat * (g * xhat).mean(-1, keepdims=True)),
             (g64 * xhat).sum(tuple(range(x.ndim - 1)))]
    # the mean of squares sums positive terms: rstd's relative error is gamma of the row's length and the roundings
    # after it; each value's magnitude is its chain on absolute values
    ag, axhat = np.abs(g), np.abs(xhat)
    magnitudes = [np.abs(exact[0]), rstd * (ag + axhat * (ag * axhat).mean(-1, keepdims=True)),
                  (np.abs(g64) * axhat).sum(tuple(range(x.ndim - 1)))]
    row = shape[-1] + NORM_ROUNDINGS
    assert_kernel_and_plain_within_rounding([got] + got_grads, [want] + want_grads, exact, magnitudes, [row, row, x.size // shape[-1] + row],
             ("y", "dx", "dweight"))


@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_matches_mindspore_and_float64(library, pynative_mode, shape):
    rng = np.random.default_rng(1)
    gate = (rng.standard_normal(shape) * 3).astype(np.float32)
    gate.flat[0], gate.flat[-1] = 60.0, -60.0  # far tails of the sigmoid
    up = rng.standard_normal(shape).astype(np.float32)
    weight = rng.standard_normal(shape).astype(np.float32)
    silu = SiLU()
    args = (Tensor(gate), Tensor(up))
    got, got_grads = _grads(rms_swiglu.CPUSwiGLU(library, threads=3), args, Tensor(weight))
    want, want_grads = _grads(lambda g, u: silu(g) * u, args, Tensor(weight))
    g64, u64, w64 = (a.astype(np.float64) for a in (gate, up, weight))
    for name, values, sigmoid in (("kernel", [got] + got_grads, (0, 0)),
                                  ("MindSpore", [want] + want_grads, MINDSPORE_SIGMOID_ULPS)):
        # silu(g) = g sigmoid(g), GeLU's sigmoid form with z = g; bounds in units of gamma_1; * up, * dy: 1 each
        silu, slope, silu_bound, slope_bound = gelu_float64(g64, "silu", sigmoid)
        exact = [silu * u64, w64 * u64 * slope, w64 * silu]
        bounds = [np.abs(u64) * (silu_bound + np.abs(silu)), np.abs(w64 * u64) * (slope_bound + 2 * np.abs(slope)),
                  np.abs(w64) * (silu_bound + np.abs(silu))]
        for what, actual, precise, bound in zip(("y", "dgate", "dup"), values, exact, bounds):
            assert_within_rounding(actual, precise, bound, 1, sides=1, name=f"{what} {name} vs float64")


@pytest.mark.parametrize("rows,inner,out,threads", [(5, 33, 17, 1), (67, 129, 300, 3), (1, 64, 1000, 2)])
def test_linear_gemm_matches_matmul_and_float64(library, pynative_mode, rows, inner, out, threads):
    """x W^T and both gradients; odd sizes, column blocks that do not divide evenly, a one-row (decode) GEMV."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    w = rng.standard_normal((out, inner)).astype(np.float32)
    weight = rng.standard_normal((rows, out)).astype(np.float32)
    args = (Tensor(x), Tensor(w))
    got, got_grads = _grads(linear.CPULinearGEMM(library, threads=threads), args, Tensor(weight))
    want, want_grads = _grads(ops.MatMul(transpose_b=True), args, Tensor(weight))
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, weight))
    ax, aw, ag = np.abs(x64), np.abs(w64), np.abs(g64)
    assert_kernel_and_plain_within_rounding([got] + got_grads, [want] + want_grads, [x64 @ w64.T, g64 @ w64, g64.T @ x64],
             [ax @ aw.T, ag @ aw, ag.T @ ax], [inner, out, rows], ("y", "dx", "dw"))


def test_an_overflowed_gradient_stays_non_finite(library, pynative_mode):
    """An infinite upstream gradient leaves every gradient of both kernels non-finite (loss scaling's check)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 33)).astype(np.float32)
    weight = rng.standard_normal((5, 33)).astype(np.float32)
    weight[2, 7] = np.inf
    for kernel, args in ((rms_swiglu.CPURMSNorm(library, 1e-6, threads=1), (x, x[0])),
                         (rms_swiglu.CPUSwiGLU(library, threads=1), (x, x + 1)),
                         (linear.CPULinearGEMM(library, threads=1), (x, (x[:4].T @ x[:4]).astype(np.float32)))):
        _, grads = _grads(kernel, tuple(Tensor(a) for a in args), Tensor(weight))
        assert all(not np.isfinite(g).all() for g in grads), (kernel, [np.isfinite(g).all() for g in grads])


# ---------------------------------------------------------------------------------------- the model
SEQ = 48


def _model_pair():
    """A tiny Llama-style model with the kernels (RMSNorm/SwiGLU: the CPU default; the Linear GEMM in every graph:
    cpu_kernels {linear: kernel}) and the same model, same weights, built with cpu_kernels {rms_norm: plain,
    swiglu: plain, linear: plain}."""
    values = dict(TINY, max_position_embeddings=SEQ, seq_length=SEQ, **LLAMA)
    fused = GPTLocalForCausalLM(GPTLocalConfig(**values, cpu_kernels={"linear": "kernel"}))
    plain = GPTLocalForCausalLM(GPTLocalConfig(**values, cpu_kernels={"rms_norm": "plain", "swiglu": "plain",
                                                                      "linear": "plain"}))
    values = dict(fused.parameters_and_names())
    assert sorted(name for name, _ in plain.parameters_and_names()) == sorted(values)
    rng = np.random.default_rng(3)
    for name, param in plain.parameters_and_names():  # norm weights away from 1: every path carries values
        value = values[name].asnumpy() + (0.1 * rng.standard_normal(param.shape)).astype(np.float32)
        values[name].set_data(Tensor(value))
        param.set_data(Tensor(value))
    layer, plain_layer = fused.model.layers[0], plain.model.layers[0]
    assert layer.input_layernorm.kernel is not None and layer.mlp.swiglu is not None
    assert layer.mlp.linear_gate.gemm is not None and layer.attention.linear_qkv.gemm is not None
    assert plain_layer.input_layernorm.kernel is None and plain_layer.mlp.swiglu is None
    assert plain_layer.mlp.linear_gate.gemm is None
    return fused, plain


def test_tiny_llama_logits_and_training_match_plain_path(library, pynative_mode):
    """Logits of an odd-length batch (PYNATIVE: no compile), then 3 AdamW steps (compiled by ``train_steps``' ms.jit):
    the logits, every first-step gradient and the losses (falling) with errors against the float64 model of the same
    weights (torch, same AdamW) within 8x the plain path's + 4 u of the value (``assert_error_of_plain_size``)."""
    fused, plain = _model_pair()
    weights = float64_weights(plain)
    rng = np.random.default_rng(0)
    odd = Tensor(rng.integers(1, TINY["vocab_size"], (3, 37)).astype(np.int32))
    for model in (fused, plain):
        model.set_train(False)
    exact_logits = gpt_float64_logits(weights, odd, plain.config)
    assert_error_of_plain_size(fused(odd).asnumpy(), plain(odd).asnumpy(), exact_logits, "logits")
    ids = Tensor(rng.integers(1, TINY["vocab_size"], (2, SEQ + 1)).astype(np.int32))
    batch = (ids[:, :-1], ids[:, 1:])
    trains_like_plain(fused, plain, [batch], 1e-2, gpt_float64_steps(weights, batch, plain.config, 3, 1e-2))


def test_switches_and_dtypes_keep_the_plain_path(capfd):
    """cpu_kernels plain, {rms_norm: plain, swiglu: plain} (and each alone) and float16 compute build the plain ops,
    with no warning; {layer_norm: plain, bias_gelu: plain} (GPT-2's two kernels) leaves these on; the Linear GEMM is
    built by default (used by row count: tests/kernels/test_linear_gemm_kernel.py) and with {linear: kernel}, not
    with {linear: plain}."""
    def kernels(**changes):
        layer = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **LLAMA, **changes))).model.layers[0]
        return (layer.input_layernorm.kernel is not None, layer.mlp.swiglu is not None,
                layer.mlp.linear_fc2.gemm is not None)

    assert kernels() == (True, True, True)
    assert kernels(cpu_kernels={"linear": "plain"}) == (True, True, False)
    assert kernels(cpu_kernels={"linear": "kernel"}) == (True, True, True)
    assert kernels(compute_dtype="float16") == (True, False, False)  # RMSNorm computes in layernorm_compute_dtype
    assert kernels(layernorm_compute_dtype="float16") == (False, True, True)
    assert kernels(cpu_kernels={"layer_norm": "plain", "bias_gelu": "plain"}) == (True, True, True)
    assert kernels(cpu_kernels={"rms_norm": "plain", "swiglu": "plain"}) == (False, False, True)
    assert kernels(cpu_kernels={"rms_norm": "plain"}) == (False, True, True)
    assert kernels(cpu_kernels={"swiglu": "plain"}) == (True, False, True)
    assert kernels(cpu_kernels={"rms_norm": "plain", "swiglu": "plain", "linear": "plain"}) == (False, False, False)
    assert kernels(cpu_kernels="plain") == (False, False, False)
    assert "kernels off" not in capfd.readouterr().err and "kernel off" not in capfd.readouterr().err
