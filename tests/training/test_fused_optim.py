"""GPTLocalAdamW's opt-in clip-in-kernel step (FusedCastAdamWeightDecay, ``fused_clip: True``) against its two-pass
reference (grad x clip factor, then AdamWeightDecay) and MindFormers' AdamW on the clipped gradients."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, Tensor, Parameter

from mindformers.core.optim import AdamW
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.training.optim import GPTLocalAdamW

# odd sizes: the kernels' 16-wide SIMD loop and their scalar remainder both run
SHAPES = {"w1": (33, 17), "b1": (33,), "w2": (7, 5, 3), "g": (1,)}
DECAYED = ("w1", "w2")
STEPS = 8
# clip factors per step: clipping active (< 1) and inactive (just below 1, as clip_coefficient gives)
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
    """Parameters and second moments after STEPS steps; ``kind``: clip-in-kernel, two-pass or MindFormers'
    AdamW given the gradients already multiplied by the clip factor (in numpy, fp32)."""
    ms.set_context(mode=0, device_target="CPU")
    net = Params()
    groups = [{"params": [getattr(net, n) for n in DECAYED], "weight_decay": 0.1},
              {"params": [getattr(net, n) for n in SHAPES if n not in DECAYED], "weight_decay": 0.0}]
    schedule = nn.CosineDecayLR(1e-4, 1e-2, STEPS)
    if kind == "mindformers":
        optimizer = AdamW(groups, learning_rate=schedule, betas=(0.9, 0.95), eps=1e-8)
    else:
        optimizer = GPTLocalAdamW(groups, learning_rate=schedule, betas=(0.9, 0.95), eps=1e-8,
                                  fused_clip=kind == "clip-in-kernel")
        assert optimizer.fused_clip == (kind == "clip-in-kernel")
    params = list(optimizer._parameters)  # group order, which the gradients follow
    start = [p.asnumpy().copy() for p in params]
    for grads, coefficient in zip(_gradients(params), COEFFICIENTS):
        if kind == "mindformers":
            optimizer(tuple(Tensor(g * np.float32(coefficient)) for g in grads))
        else:
            optimizer(tuple(Tensor(g) for g in grads), Tensor(np.array([coefficient], np.float32)))
    moved = max(float(np.abs(p.asnumpy() - s).max()) for p, s in zip(params, start))
    return ({p.name: p.asnumpy() for p in params}, {v.name: v.asnumpy() for v in optimizer.exp_avg_sq},
            {m.name: m.asnumpy() for m in optimizer.exp_avg}, moved)


@pytest.fixture(scope="module")
def runs():
    return {kind: _run(kind) for kind in ("clip-in-kernel", "two-pass", "mindformers")}


@pytest.mark.parametrize("reference", ["two-pass", "mindformers"])
def test_clip_in_kernel_matches_references_step_by_step(runs, reference):
    fused, ref = runs["clip-in-kernel"], runs[reference]
    assert fused[3] > 1e-2 and ref[3] > 1e-2  # the parameters really move
    for state in range(3):  # parameters, second moments, first moments: same names, same values
        assert fused[state].keys() == ref[state].keys()
        for name, value in fused[state].items():
            np.testing.assert_allclose(value, ref[state][name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_clip_in_kernel_is_opt_in(monkeypatch):
    """Off by default (slower than the two-pass path on an idle CPU, docs/performance.md); fused_clip: True on
    CPU takes it, unless GPTLOCAL_PLAIN_KERNELS=1."""
    ms.set_context(mode=0, device_target="CPU")
    net = Params()
    assert not GPTLocalAdamW(net.trainable_params()).fused_clip
    assert GPTLocalAdamW(net.trainable_params(), fused_clip=True).fused_clip
    monkeypatch.setenv("GPTLOCAL_PLAIN_KERNELS", "1")
    assert not GPTLocalAdamW(net.trainable_params(), fused_clip=True).fused_clip
    with pytest.raises(ConfigError, match="optimizer.fused_clip"):
        GPTLocalAdamW(net.trainable_params(), fused_clip="yes")
