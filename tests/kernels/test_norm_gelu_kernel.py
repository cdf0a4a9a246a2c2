"""The CPU LayerNorm and bias + GeLU kernels (mindformers_gptlocal/kernels/cells/norm_gelu.py): outputs and every gradient
against MindSpore's ops (the plain path) and a float64 reference, on odd shapes and on the multi-threaded path; a
tiny model (tanh and quick GeLU, LoRA on fc1) trains with the plain path's losses step for step; the switches keep
the plain path."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.cells import norm_gelu
from mindformers_gptlocal.model.layers import TanhGeLU
from conftest import TINY
from references import trains_like_plain

# T * H >= 32768 runs on several threads (common.h threads_for); 3 threads split 131 rows unevenly
SHAPES = [(3, 7, 77), (131, 257)]


def _grads(fn, args, weight):
    """fn's output and the gradients of sum(fn(*args) * weight) for every argument."""
    value = fn(*args)
    grads = ms.grad(lambda *a: (fn(*a) * weight).sum(), tuple(range(len(args))))(*args)
    return value.asnumpy(), [g.asnumpy() for g in grads]


def _close(actual, expected, name):
    """Within 1e-5 of the reference, relative to its largest value where that is above 1 (the parameter
    gradients are sums over up to 131 rows, whose order differs)."""
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, atol=1e-5 * scale, rtol=0, err_msg=name)


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    width = shape[-1]
    x = (rng.standard_normal(shape) * 2.5 + 0.5).astype(np.float32)
    return (x, rng.standard_normal(width).astype(np.float32), rng.standard_normal(width).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def _layernorm64(x, gamma, beta, weight, eps=1e-5):
    """float64 LayerNorm and its gradients of sum(y * weight)."""
    x, gamma, beta, weight = (a.astype(np.float64) for a in (x, gamma, beta, weight))
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    g = weight * gamma
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    axes = tuple(range(x.ndim - 1))
    return xhat * gamma + beta, [dx, (weight * xhat).sum(axes), weight.sum(axes)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_layernorm_matches_mindspore_and_float64(library, pynative_mode, shape, threads):
    x, gamma, beta, weight = _data(shape)
    kernel = norm_gelu.CPULayerNorm(library, 1e-5, threads=threads)
    plain = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5)
    args = tuple(Tensor(a) for a in (x, gamma, beta))
    got, got_grads = _grads(kernel, args, Tensor(weight))
    want, want_grads = _grads(lambda *a: plain(*a)[0], args, Tensor(weight))
    exact, exact_grads = _layernorm64(x, gamma, beta, weight)
    _close(got, want, "y vs MindSpore")
    _close(got, exact, "y vs float64")
    for name, actual, expected, precise in zip(("dx", "dgamma", "dbeta"), got_grads, want_grads, exact_grads):
        _close(actual, expected, name + " vs MindSpore")
        _close(actual, precise, name + " vs float64")


def _gelu64(u, form):
    if form == "quick":
        return u / (1.0 + np.exp(-1.702 * u))
    return 0.5 * u * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (u + 0.044715 * u ** 3)))


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
    u = x.astype(np.float64) + bias
    exact = _gelu64(u, form)
    step = 1e-6  # central difference of the float64 form: the slope
    slope = (_gelu64(u + step, form) - _gelu64(u - step, form)) / (2 * step)
    dx = weight * slope
    _close(got, want, "y vs MindSpore")
    _close(got, exact, "y vs float64")
    _close(got_grads[0], want_grads[0], "dx vs MindSpore")
    _close(got_grads[0], dx, "dx vs float64")
    _close(got_grads[1], want_grads[1], "dbias vs MindSpore")
    _close(got_grads[1], dx.reshape(-1, shape[-1]).sum(0), "dbias vs float64")


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
    """Losses step for step (3 AdamW steps) and every parameter's first-step gradient within 1e-5 of the plain
    path; the quick_gelu case with LoRA on fc1 and fc2 (fc1's low-rank update passes through the fused bias)."""
    fused, plain = _model_pair(**case)
    ids = Tensor(np.random.default_rng(0).integers(1, TINY["vocab_size"], (2, SEQ + 1)).astype(np.int32))
    batch = (ids[:, :-1], ids[:, 1:])
    grads, plain_grads = trains_like_plain(fused, plain, [batch], 1e-2)
    for name in plain_grads:
        _close(grads[name], plain_grads[name], name)


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
