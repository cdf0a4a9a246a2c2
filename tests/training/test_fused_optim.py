"""GPTLocalAdamW's fused AdamWeightDecay step against MindFormers' AdamW on the same clipped gradients (the train
step clips them first), and with the CPU AdamW kernel the train step gives it (``use_kernels``,
``kernels/cells/train_step.py``) against both."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, ops, Tensor, Parameter

from mindformers.core.optim import AdamW
from mindformers_gptlocal.kernels.cells.train_step import CPUAdamW
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.training.optim import GPTLocalAdamW

# odd sizes: the kernels' 16-wide SIMD loop and their scalar remainder both run; w3 is large enough for the AdamW
# kernel to split it over two threads (odd chunk lengths)
SHAPES = {"w1": (33, 17), "b1": (33,), "w2": (7, 5, 3), "g": (1,), "w3": (203, 199)}
DECAYED = ("w1", "w2", "w3")
STEPS = 8
# clip factors per step: clipping active (< 1) and inactive (just below 1, as MindFormers' ClipGradNorm gives)
COEFFICIENTS = [0.25, 1 / (1 + 1e-6), 0.031, 1 / (1 + 1e-6), 0.9, 0.5, 1 / (1 + 1e-6), 0.0625]


class Params(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        for name, shape in SHAPES.items():
            setattr(self, name, Parameter(Tensor(rng.standard_normal(shape).astype(np.float32)), name=name))


def _gradients(params):
    rng = np.random.default_rng(1)
    return [[(rng.standard_normal(p.shape) * 10.0 ** -(step % 4)).astype(np.float32) for p in params]
            for step in range(STEPS)]


def _run(kind):
    """Parameters and second moments after STEPS steps on the gradients multiplied by the clip factor (in numpy,
    fp32); ``kind``: fused (GPTLocalAdamW), kernel (the same with the CPU AdamW kernel) or MindFormers' AdamW."""
    ms.set_context(mode=0, device_target="CPU")
    net = Params()
    groups = [{"params": [getattr(net, n) for n in DECAYED], "weight_decay": 0.1},
              {"params": [getattr(net, n) for n in SHAPES if n not in DECAYED], "weight_decay": 0.0}]
    schedule = nn.CosineDecayLR(1e-4, 1e-2, STEPS)
    if kind == "mindformers":
        optimizer = AdamW(groups, learning_rate=schedule, betas=(0.9, 0.95), eps=1e-8)
    else:
        optimizer = GPTLocalAdamW(groups, learning_rate=schedule, betas=(0.9, 0.95), eps=1e-8)
        if kind == "kernel":  # as GPTLocalTrainOneStepCell does with its model's provider (auto on CPU)
            optimizer.use_kernels(KernelProvider())
            assert isinstance(optimizer.kernel, CPUAdamW)
    params = list(optimizer._parameters)  # group order, which the gradients follow
    start = [p.asnumpy().copy() for p in params]
    for grads, coefficient in zip(_gradients(params), COEFFICIENTS):
        optimizer(tuple(Tensor(g * np.float32(coefficient)) for g in grads))
    moved = max(float(np.abs(p.asnumpy() - s).max()) for p, s in zip(params, start))
    return ({p.name: p.asnumpy() for p in params}, {v.name: v.asnumpy() for v in optimizer.exp_avg_sq},
            {m.name: m.asnumpy() for m in optimizer.exp_avg}, moved)


@pytest.fixture(scope="module")
def runs():
    return {kind: _run(kind) for kind in ("fused", "kernel", "mindformers")}


def test_fused_step_matches_mindformers_on_clipped_gradients(runs):
    fused, ref = runs["fused"], runs["mindformers"]
    assert fused[3] > 1e-2 and ref[3] > 1e-2  # the parameters really move
    for state in range(3):  # parameters, second moments, first moments: same names, same values
        assert fused[state].keys() == ref[state].keys()
        for name, value in fused[state].items():
            np.testing.assert_allclose(value, ref[state][name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_adamw_kernel_matches_adamweightdecay_and_mindformers(runs):
    """The CPU kernel's parameters and moments after every step equal AdamWeightDecay's to rounding (the same
    formula), so MindFormers' AdamW's too."""
    kernel = runs["kernel"]
    assert kernel[3] > 1e-2
    for reference, rtol in ((runs["fused"], 1e-6), (runs["mindformers"], 1e-5)):
        for state in range(3):
            assert kernel[state].keys() == reference[state].keys()
            for name, value in kernel[state].items():
                np.testing.assert_allclose(value, reference[state][name], rtol=rtol, atol=rtol, err_msg=name)


def test_the_train_step_gives_the_optimizer_its_models_adamw_kernel():
    """GPTLocalTrainOneStepCell hands the model's provider to GPTLocalAdamW: the kernel under cpu_kernels auto,
    AdamWeightDecay under {adamw: plain}."""
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, GPTLocalTrainOneStepCell
    from conftest import TINY
    ms.set_context(mode=0, device_target="CPU")
    for modes, kind in (("auto", CPUAdamW), ({"adamw": "plain"}, ops.AdamWeightDecay)):
        model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, cpu_kernels=modes)))
        optimizer = GPTLocalAdamW(model.trainable_params())
        GPTLocalTrainOneStepCell(model, optimizer, use_clip_grad=True, max_grad_norm=1.0, scale_sense=1.0)
        assert isinstance(optimizer.kernel, kind)
