"""The CPU LayerNorm and bias + GeLU kernels (mindformers_gptlocal/kernels/cells/norm_gelu.py): outputs and every gradient
against MindSpore's ops (the plain path) and a float64 reference, on odd shapes and on the multi-threaded path; a
tiny model (tanh and quick GeLU, LoRA on fc1) trains with errors against its float64 model of the plain path's size;
the switches keep the plain path."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.cells import norm_gelu
from mindformers_gptlocal.model.layers import TanhGeLU
from conftest import TINY
from references import (MINDSPORE_SIGMOID_ULPS, NORM_ROUNDINGS, assert_kernel_and_plain_within_rounding,
                        assert_within_rounding, float64_weights, gelu_float64, gpt_float64_steps, trains_like_plain)

# T * H >= 32768 runs on several threads (common.h threads_for); 3 threads split 131 rows unevenly
SHAPES = [(3, 7, 77), (131, 257)]


def _grads(fn, args, weight):
    """fn's output and the gradients of sum(fn(*args) * weight) for every argument."""
    value = fn(*args)
    grads = ms.grad(lambda *a: (fn(*a) * weight).sum(), tuple(range(len(args))))(*args)
    return value.asnumpy(), [g.asnumpy() for g in grads]


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    width = shape[-1]
    x = (rng.standard_normal(shape) * 2.5 + 0.5).astype(np.float32)
    return (x, rng.standard_normal(width).astype(np.float32), rng.standard_normal(width).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def _layernorm64(x, gamma, beta, weight, eps=1e-5):
    """float64 LayerNorm and its gradients of sum(y * weight) -> (values, magnitudes, lengths). The mean's error
    (gamma_H mean|x|) shifts x - mean; the variance's (gamma_H mean(x^2), a one-pass E[x^2] - mean^2 included) moves
    rstd by half its relative size: xhat's magnitude |xhat| (1 + mean(x^2) rstd^2) + rstd mean|x|, carried through
    the rest of the chain on absolute values."""
    x, gamma, beta, weight = (a.astype(np.float64) for a in (x, gamma, beta, weight))
    width, rows = x.shape[-1], x.size // x.shape[-1]
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    g = weight * gamma
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    axes = tuple(range(x.ndim - 1))
    m_xhat = np.abs(xhat) * (1 + (x * x).mean(-1, keepdims=True) * rstd ** 2) + rstd * np.abs(x).mean(-1, keepdims=True)
    ag = np.abs(g)
    m_dx = rstd * (ag + ag.mean(-1, keepdims=True) + m_xhat * (ag * m_xhat).mean(-1, keepdims=True))
    values = [xhat * gamma + beta, dx, (weight * xhat).sum(axes), weight.sum(axes)]
    magnitudes = [np.abs(gamma) * m_xhat + np.abs(beta), m_dx, (np.abs(weight) * m_xhat).sum(axes),
                  np.abs(weight).sum(axes)]
    row = width + NORM_ROUNDINGS
    return values, magnitudes, [row, row, rows + row, rows]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_layernorm_matches_mindspore_and_float64(library, pynative_mode, shape, threads):
    x, gamma, beta, weight = _data(shape)
    kernel = norm_gelu.CPULayerNorm(library, 1e-5, threads=threads)
    plain = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5)
    args = tuple(Tensor(a) for a in (x, gamma, beta))
    got, got_grads = _grads(kernel, args, Tensor(weight))
    want, want_grads = _grads(lambda *a: plain(*a)[0], args, Tensor(weight))
    exact, magnitudes, lengths = _layernorm64(x, gamma, beta, weight)
    assert_kernel_and_plain_within_rounding([got] + got_grads, [want] + want_grads, exact, magnitudes, lengths, ("y", "dx", "dgamma", "dbeta"))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", ["tanh", "quick"])
def test_bias_gelu_matches_mindspore_and_float64(library, pynative_mode, shape, form):
    x, bias, _, weight = _data(shape, seed=1)
    x[0, 0] = 60.0  # far tails of the sigmoid
    x[-1, -1] = -60.0
    kernel = norm_gelu.CPUBiasGeLU(library, form, threads=3)
    activation = TanhGeLU() if form == "tanh" else ops.FastGeLU()
    args = (Tensor(x), Tensor(bias))
    got, got_grads = _grads(kernel, args, Tensor(weight))
    want, want_grads = _grads(lambda a, b: activation(a + b), args, Tensor(weight))
    u, rows = x.astype(np.float64) + bias, x.size // shape[-1]
    for name, values, sigmoid in (("kernel", [got] + got_grads, (0, 0)),
                                  ("MindSpore", [want] + want_grads, MINDSPORE_SIGMOID_ULPS)):
        exact, slope, y_bound, slope_bound = gelu_float64(u, form, sigmoid)
        dx, dx_bound = weight * slope, np.abs(weight) * slope_bound  # in units of gamma_1
        for what, actual, precise, bound in zip(("y", "dx"), values, (exact, dx), (y_bound, dx_bound)):
            assert_within_rounding(actual, precise, bound, 1, sides=1, name=f"{what} {name} vs float64")
        # dbias: the column sums of that dx, held to the float64 sums of the dx it returned (the elementwise
        # bounds above, summed over the rows, would be as loose as their worst case times the rows)
        own = values[1].astype(np.float64).reshape(-1, shape[-1])
        assert_within_rounding(values[2], own.sum(0), np.abs(own).sum(0), rows, sides=1, name=f"dbias {name}")


def test_an_overflowed_gradient_stays_non_finite(library, pynative_mode):
    """Loss scaling finds an overflow by the gradients' finiteness: an infinite upstream gradient must leave
    every gradient of both kernels non-finite (never summed or clamped back into range)."""
    x, gamma, beta, weight = _data((5, 33))
    weight[2, 7] = np.inf
    layernorm = norm_gelu.CPULayerNorm(library, 1e-5, threads=1)
    _, grads = _grads(layernorm, tuple(Tensor(a) for a in (x, gamma, beta)), Tensor(weight))
    assert all(not np.isfinite(g).all() for g in grads), [np.isfinite(g).all() for g in grads]
    for form in ("tanh", "quick"):
        _, grads = _grads(norm_gelu.CPUBiasGeLU(library, form, threads=1), (Tensor(x), Tensor(beta)), Tensor(weight))
        assert all(not np.isfinite(g).all() for g in grads), (form, [np.isfinite(g).all() for g in grads])


# ---------------------------------------------------------------------------------------- the model
SEQ = 48


def _model_pair(lora=False, **changes):
    """The model with the kernels (the CPU default) and the same model, same weights, built with
    cpu_kernels {layer_norm: plain, bias_gelu: plain} (MindSpore's LayerNorm, the Add and the composed GeLU)."""
    pet = dict(pet_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=".*linear_fc1|.*linear_fc2",
               freeze_include=["*"], freeze_exclude=["*lora*"]) if lora else None
    values = dict(TINY, max_position_embeddings=SEQ, seq_length=SEQ, pet_config=pet, **changes)
    fused = GPTLocalForCausalLM(GPTLocalConfig(**values))
    plain = GPTLocalForCausalLM(GPTLocalConfig(**values, cpu_kernels={"layer_norm": "plain", "bias_gelu": "plain"}))
    values = dict(fused.parameters_and_names())
    names = [name for name, _ in plain.parameters_and_names()]
    assert sorted(names) == sorted(values)  # same checkpoint names either way
    rng = np.random.default_rng(3)
    for name, param in plain.parameters_and_names():  # non-zero biases and LoRA B: every path carries values
        value = values[name].asnumpy() + (0.1 * rng.standard_normal(param.shape)).astype(np.float32)
        values[name].set_data(Tensor(value))
        param.set_data(Tensor(value))
    layer = fused.model.layers[0]
    assert layer.input_layernorm.kernel is not None and layer.mlp.bias_gelu is not None
    assert plain.model.layers[0].input_layernorm.kernel is None and plain.model.layers[0].mlp.bias_gelu is None
    return fused, plain


@pytest.mark.parametrize("case", [dict(), dict(hidden_act="quick_gelu", lora=True)], ids=["tanh", "quick_lora"])
def test_tiny_training_matches_plain_path(library, graph_mode, case):
    """3 AdamW steps: every trained parameter's first-step gradient and the losses (falling) with errors against the
    float64 model of the same weights (torch, same AdamW) within 8x the plain path's + 4 u of the value
    (``trains_like_plain``); the quick_gelu case with LoRA on fc1 and fc2 (fc1's low-rank update passes through the
    fused bias)."""
    fused, plain = _model_pair(**case)
    ids = Tensor(np.random.default_rng(0).integers(1, TINY["vocab_size"], (2, SEQ + 1)).astype(np.int32))
    batch = (ids[:, :-1], ids[:, 1:])
    trainable = [param.name for param in plain.trainable_params()]
    reference = gpt_float64_steps(float64_weights(plain), batch, plain.config, 3, 1e-2, lora_scale=8 / 4,
                                  trainable=trainable)
    grads, _ = trains_like_plain(fused, plain, [batch], 1e-2, reference)
    assert any("mlp.linear_fc1" in name and np.abs(g).max() > 0 for name, g in grads.items())


def test_switches_and_dtypes_keep_the_plain_path(capfd):
    """cpu_kernels plain, {layer_norm: plain} and {bias_gelu: plain} (each alone), float16 compute, relu and the
    exact GeLU build the plain ops, with no warning."""
    def kernels(**changes):
        layer = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes))).model.layers[0]
        return layer.input_layernorm.kernel is not None, layer.mlp.bias_gelu is not None

    assert kernels() == (True, True)
    assert kernels(hidden_act="relu") == (True, False)
    assert kernels(hidden_act="gelu") == (True, False)
    assert kernels(compute_dtype="float16") == (True, False)  # LayerNorm computes in layernorm_compute_dtype
    assert kernels(cpu_kernels={"layer_norm": "plain", "bias_gelu": "plain"}) == (False, False)
    assert kernels(cpu_kernels={"layer_norm": "plain"}) == (False, True)
    assert kernels(cpu_kernels={"bias_gelu": "plain"}) == (True, False)
    assert kernels(cpu_kernels="plain") == (False, False)
    assert "LayerNorm and bias + GeLU kernels off" not in capfd.readouterr().err
