"""LoRA's CPU dropout kernel (mindformers_gptlocal/kernels/cells/lora_dropout.py) and LoRALinear's construct: the kernel's
mask is the counter dropout's (model/dropout.py CounterDropout, the plain path) bit for bit, forward and backward, at
any step and for either table rule, and a new step draws a new mask; a LoRALinear with the kernel gives the float64
reference's output and gradients (x, A, B) for that mask, and one without dropout the reference's too (odd shapes);
a tiny LoRA model trains like the plain path step for step; the switches keep the plain counter dropout. The
resume is exact with lora_dropout > 0: tests/peft/test_lora.py, tests/e2e/test_resume_shipped.py."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.cells import lora_dropout
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model.dropout import CounterDropout, lora_dropout_site
from mindformers_gptlocal.model.lora_cells import LoRALinear
from mindformers_gptlocal.peft.lora import LoraSpec
from conftest import TINY

P = 0.05


def _step(value):
    return Tensor(value, ms.int32)


@pytest.mark.parametrize("shape,p,threads", [((3, 37, 19), P, 1), ((3, 129, 301), 0.7, 3)],
                         ids=["odd", "p07_threads3"])
def test_kernel_mask_is_the_counter_dropouts(library, pynative_mode, shape, p, threads):
    """Forward and backward equal the plain CounterDropout's x * mask and dy * mask exactly at steps 0, 1 and
    70000 (past a table's length); other steps draw other masks at rate ~p. p 0.7 keeps where the bits differ."""
    plain = CounterDropout(p, lora_dropout_site(2, "mlp.linear_fc1"), seed=3)
    plain.set_train(True)
    cell = lora_dropout.CPULoRADropout(library, plain, threads=threads)
    cell.set_train(True)
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    masks = []
    for step in (0, 1, 70000):
        y = cell(Tensor(x), _step(step)).asnumpy()
        want = plain(Tensor(x), _step(step)).asnumpy()
        np.testing.assert_array_equal(y, want)
        keep = plain.keep(Tensor(x), _step(step)).asnumpy()
        dx = ms.grad(lambda x_, s=step: (cell(x_, _step(s)) * Tensor(dy)).sum())(Tensor(x)).asnumpy()
        np.testing.assert_array_equal(dx, np.where(keep, dy * np.float32(plain.scale), np.float32(0)))
        masks.append(keep)
    for keep in masks:
        assert abs(1.0 - keep.mean() - p) < 0.02
    for first, second in ((0, 1), (1, 2)):  # a new mask each step: independent draws differ on ~2p(1 - p)
        assert abs((masks[first] != masks[second]).mean() - 2 * p * (1 - p)) < 0.03
    assert np.array_equal(cell(Tensor(x), None).asnumpy(), x)  # no step: no dropout, as the plain Cell


def _lora_linear(in_features, out_features, dropout, has_bias=True, kernels=None):
    ms.set_seed(3)
    spec = LoraSpec(rank=5, alpha=7.0, dropout=dropout, target_modules=".*", exclude_layers=(), freeze_include=(),
                    freeze_exclude=(), a_init="heuniform", b_init="normal")
    kernels = KernelProvider() if kernels is None else kernels  # the default: auto
    linear = LoRALinear(in_features, out_features, 0.3, ms.float32, ms.float32, has_bias=has_bias, kernels=kernels,
                        lora=spec, dropout_site=lora_dropout_site(1, "attention.linear_qkv"))
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
    with the kernel, for the plain counter dropout's mask at the step given."""
    shape, out_features, step = (3, 11, 37), 29, 5
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape).astype(np.float32)
    weight = rng.standard_normal(shape[:-1] + (out_features,)).astype(np.float32)
    linear = _lora_linear(shape[-1], out_features, dropout, has_bias)
    uses_kernel = isinstance(linear.lora_dropout, lora_dropout.CPULoRADropout)
    assert uses_kernel == (dropout > 0), type(linear.lora_dropout)
    if uses_kernel:
        plain = linear.lora_dropout.counter
        mask = plain.keep(Tensor(x), _step(step)).asnumpy() * np.float32(plain.scale)
    else:
        mask = np.ones(shape, np.float32)
    expected, expected_grads = _reference(linear, x, weight, mask)
    params = (linear.lora_a, linear.lora_b)
    grad_fn = ms.value_and_grad(lambda x_: (linear(x_, _step(step)) * Tensor(weight)).sum(), 0, params)
    value, (dx, (da, db)) = grad_fn(Tensor(x))
    np.testing.assert_allclose(float(value), (expected * weight).sum(), rtol=1e-5)
    for actual, want, name in zip((dx, da, db), expected_grads, ("x", "lora_a", "lora_b")):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(actual.asnumpy(), want, atol=1e-5 * scale, rtol=0, err_msg=name)


def test_tiny_lora_model_matches_the_plain_counter_dropout(library, pynative_mode):
    """A tiny LoRA model (dropout 0.3 on qkv, proj, fc1, fc2) with the kernel against the same model with the plain
    counter dropout (cpu_kernels {lora_dropout: plain}): at step 7 of the model's forward counter the loss and the
    adapters' gradients equal the plain path's (1e-5); the loss differs from step 0's and from the loss without
    dropout (the step reaches every LoRALinear), and each forward advances the counter. (GRAPH mode and
    the launcher: the resume tests in tests/peft/test_lora.py and tests/e2e/test_resume_shipped.py.)"""
    from references import LossOf
    pet = dict(pet_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.3, freeze_include=["*"],
               freeze_exclude=["*lora*"], target_modules=".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2")
    values = dict(TINY, num_hidden_layers=1, seq_length=16)
    fast = GPTLocalForCausalLM(GPTLocalConfig(**values, pet_config=pet))
    plain = GPTLocalForCausalLM(GPTLocalConfig(**values, pet_config=pet, cpu_kernels={"lora_dropout": "plain"}))
    assert isinstance(fast.model.layers[0].mlp.linear_fc2.lora_dropout, lora_dropout.CPULoRADropout)
    assert type(plain.model.layers[0].mlp.linear_fc2.lora_dropout) is CounterDropout  # noqa: E721
    rng = np.random.default_rng(3)
    values = dict(fast.parameters_and_names())
    for name, param in plain.parameters_and_names():  # B non-zero, so the dropped inputs change the loss
        if name != "dropout_step":
            value = values[name].asnumpy() + (0.1 * rng.standard_normal(param.shape)).astype(np.float32)
            values[name].set_data(Tensor(value))
            param.set_data(Tensor(value))
    ids = Tensor(rng.integers(1, TINY["vocab_size"], (2, 17)).astype(np.int32))
    batch = (ids[:, :-1], ids[:, 1:])
    results = []
    for model in (fast, plain):
        model.set_train(True)
        model.dropout_step.set_data(_step(7))
        weights = [p for n, p in model.parameters_and_names() if n.endswith(("lora_a", "lora_b"))]
        loss, grads = ms.value_and_grad(LossOf(model), None, weights)(*batch)
        assert int(model.dropout_step.asnumpy()) == 8  # each forward advances the counter
        results.append((float(loss.asnumpy()), [g.asnumpy() for g in grads]))
    (loss, grads), (plain_loss, plain_grads) = results
    assert len(grads) == 8
    np.testing.assert_allclose(loss, plain_loss, atol=1e-5, rtol=0)
    for got, want in zip(grads, plain_grads):
        np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, float(np.abs(want).max())), rtol=0)
    fast.dropout_step.set_data(_step(0))
    other_step = float(LossOf(fast)(*batch).asnumpy())
    for layer in fast.model.layers:  # the same model with every LoRA dropout off
        for linear in (layer.attention.linear_qkv, layer.attention.linear_proj, layer.mlp.linear_fc1,
                       layer.mlp.linear_fc2):
            linear.lora_dropout.set_train(False)
    undropped = float(LossOf(fast)(*batch).asnumpy())
    assert min(abs(loss - other_step), abs(loss - undropped), abs(other_step - undropped)) > 1e-4, \
        (loss, other_step, undropped)


@pytest.mark.parametrize("cpu_kernels", [{"lora_dropout": "plain"}, "plain"], ids=["kernel_off", "plain"])
def test_switches_keep_the_plain_counter_dropout(cpu_kernels):
    kernels = KernelProvider(cpu_kernels)
    plain = _lora_linear(8, 4, P, kernels=kernels).lora_dropout
    assert type(plain) is CounterDropout  # noqa: E721 pylint: disable=unidiomatic-typecheck
    assert isinstance(_lora_linear(8, 4, P).lora_dropout, lora_dropout.CPULoRADropout)  # the default: the kernel
