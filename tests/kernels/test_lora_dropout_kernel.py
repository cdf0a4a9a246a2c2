"""LoRA's CPU dropout kernel (mindformers_gptlocal/kernels/lora_dropout.py) and LoRALinear's construct: the kernel's
mask is exactly the documented hash (a numpy reimplementation), the backward uses its forward's mask, each call
draws a new one; a LoRALinear with the kernel gives the float64 reference's output and gradients (x, A, B) for
that mask, and one without dropout the reference's too (odd shapes); the switches keep MindSpore's Dropout."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from mindformers_gptlocal.kernels import lora_dropout
from mindformers_gptlocal.model.lora import LoRALinear
from mindformers_gptlocal.model.lora_config import LoraSpec

P = 0.05


def _mix(x):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _mask(config, call, size):
    """keep * 1 / (1 - p) for elements 0 .. size of the flattened input: lora_dropout.cc's formula, in numpy."""
    p, site, seed = (float(v) for v in config[:3])
    with np.errstate(over="ignore"):
        k0 = (_mix(np.uint32(int(seed) * 0x85EBCA6B % 2 ** 32) + np.uint32(0x165667B1))
              ^ np.uint32(int(site) * 0xC2B2AE35 % 2 ** 32)) & np.uint32(0xFFFFFF)
        k1 = np.uint32(call * 0x9E3779B9 % 2 ** 32)
        h = _mix(_mix(np.arange(size, dtype=np.uint32) + k0) ^ k1)
    threshold = np.uint32(min(4294967295.0, p * 4294967296.0))
    return np.where(h >= threshold, np.float32(1.0 / (1.0 - p)), np.float32(0.0))


@pytest.mark.parametrize("shape,threads", [((3, 37, 19), 1), ((3, 129, 301), 3)], ids=["odd", "threads3"])
def test_kernel_mask_is_the_hash_and_the_backward_uses_the_forwards(library, pynative_mode, shape, threads):
    """Forward (y, key) and backward against the numpy hash; a second call draws another mask at rate ~p."""
    cell = lora_dropout.CPULoRADropout(library, P, threads=threads)
    config = cell.config.asnumpy()
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    masks = []
    for call in range(2):
        y, key = cell.forward(Tensor(x), cell.config)
        mask = _mask(config, call, x.size).reshape(shape)
        np.testing.assert_array_equal(key.asnumpy()[1], call)
        np.testing.assert_allclose(y.asnumpy(), x * mask, rtol=1e-6, atol=0)
        dx = cell.backward(Tensor(dy), key, cell.config).asnumpy()
        np.testing.assert_allclose(dx, dy * mask, rtol=1e-6, atol=0)
        masks.append(mask != 0)
    assert abs(1.0 - masks[0].mean() - P) < 0.01 and abs(1.0 - masks[1].mean() - P) < 0.01
    assert 0.06 < (masks[0] != masks[1]).mean() < 0.13  # independent draws differ on ~2p(1-p) of the elements


class _FixedMask(nn.Cell):
    """The reference dropout: multiply by a given mask (already scaled)."""

    def __init__(self, mask):
        super().__init__()
        self.mask = Tensor(mask)

    def construct(self, x):
        return x * self.mask


def _lora_linear(in_features, out_features, dropout, has_bias=True):
    ms.set_seed(3)
    spec = LoraSpec(rank=5, alpha=7.0, dropout=dropout, target_modules=".*", exclude_layers=(), freeze_include=(),
                    freeze_exclude=(), a_init="heuniform", b_init="normal")
    linear = LoRALinear(in_features, out_features, 0.3, ms.float32, ms.float32, has_bias=has_bias, lora=spec)
    rng = np.random.default_rng(1)
    for param in (linear.weight, linear.lora_a, linear.lora_b) + ((linear.bias,) if has_bias else ()):
        param.set_data(Tensor(rng.normal(0, 0.5, param.shape).astype(np.float32)))
    linear.set_train(True)
    return linear


def _reference(linear, x, weight, mask):
    """float64 y = x W^T + b + s B(A(x * mask)) and the gradients of sum(y * weight) for x, A, B."""
    w, a, b = (p.asnumpy().astype(np.float64) for p in (linear.weight, linear.lora_a, linear.lora_b))
    s = linear.scaling
    x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    m = mask.reshape(x2.shape)
    r = weight.reshape(-1, weight.shape[-1]).astype(np.float64)
    xd = x2 * m
    y = x2 @ w.T + s * (xd @ a.T) @ b.T
    if linear.has_bias:
        y = y + linear.bias.asnumpy()
    dx = r @ w + s * ((r @ b) @ a) * m
    return y.reshape(weight.shape), [dx.reshape(x.shape), s * (r @ b).T @ xd, s * r.T @ (xd @ a.T)]


@pytest.mark.parametrize("dropout,has_bias", [(0.0, True), (P, True), (P, False)],
                         ids=["p0", "kernel", "kernel_nobias"])
def test_lora_linear_matches_the_float64_reference(library, pynative_mode, dropout, has_bias):
    """Loss and the gradients of x, lora_a and lora_b within 1e-5 (relative to the largest) of float64, odd shapes;
    with the kernel, for the mask it draws on its first call (a LoRALinear built with the mask as a fixed
    multiply gives the same numbers too)."""
    shape, out_features = (3, 11, 37), 29
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape).astype(np.float32)
    weight = rng.standard_normal(shape[:-1] + (out_features,)).astype(np.float32)
    linear = _lora_linear(shape[-1], out_features, dropout, has_bias)
    uses_kernel = isinstance(linear.lora_dropout, lora_dropout.CPULoRADropout)
    assert uses_kernel == (dropout > 0), type(linear.lora_dropout)
    mask = (_mask(linear.lora_dropout.config.asnumpy(), 0, x.size).reshape(shape) if uses_kernel
            else np.ones(shape, np.float32))
    fixed = _lora_linear(shape[-1], out_features, 0.0, has_bias)
    fixed.lora_dropout = _FixedMask(mask.reshape(-1, shape[-1]))  # the dropout sees x as [T, in]
    expected, expected_grads = _reference(linear, x, weight, mask)
    for cell in (linear, fixed):
        params = (cell.lora_a, cell.lora_b)
        grad_fn = ms.value_and_grad(lambda x_, c=cell: (c(x_) * Tensor(weight)).sum(), 0, params)
        value, (dx, (da, db)) = grad_fn(Tensor(x))
        np.testing.assert_allclose(float(value), (expected * weight).sum(), rtol=1e-5)
        for actual, want, name in zip((dx, da, db), expected_grads, ("x", "lora_a", "lora_b")):
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(actual.asnumpy(), want, atol=1e-5 * scale, rtol=0, err_msg=name)


@pytest.mark.parametrize("env", [{"GPTLOCAL_LORA_DROPOUT_KERNEL": "0"}, {"GPTLOCAL_PLAIN_KERNELS": "1"}],
                         ids=["kernel_off", "plain"])
def test_switches_keep_mindsporess_dropout(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert type(_lora_linear(8, 4, P).lora_dropout) is nn.Dropout  # pylint: disable=unidiomatic-typecheck
