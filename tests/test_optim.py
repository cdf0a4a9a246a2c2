"""GPTLocalAdamW is MindFormers' AdamW (bias correction, decoupled decay, decay groups), fused."""
import numpy as np
import mindspore as ms
from mindspore import nn, Tensor, Parameter

from mindformers.core.optim import AdamW
from mindformers_gptlocal.optim import GPTLocalAdamW


class TwoParams(nn.Cell):
    def __init__(self, rng):
        super().__init__()
        self.weight = Parameter(Tensor(rng.standard_normal((32, 16)).astype(np.float32)), name="weight")
        self.bias = Parameter(Tensor(rng.standard_normal((32,)).astype(np.float32)), name="bias")


def _run(optimizer_cls, steps=30):
    ms.set_context(mode=0, device_target="CPU")
    net = TwoParams(np.random.default_rng(0))
    groups = [{"params": [net.weight], "weight_decay": 0.1}, {"params": [net.bias], "weight_decay": 0.0}]
    schedule = nn.CosineDecayLR(1e-4, 1e-2, steps)
    optimizer = optimizer_cls(groups, learning_rate=schedule, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(1)
    trajectory = []
    for step in range(steps):
        # weight gradients shrink by orders of magnitude; bias gradients stay near eps, so the
        # bias-corrected eps matters as much as the corrected moments
        scales = (10.0 ** (-step / 4), 1e-8)
        grads = tuple(Tensor((rng.standard_normal(p.shape) * scale).astype(np.float32))
                      for p, scale in zip((net.weight, net.bias), scales))
        optimizer(grads)
        trajectory.append(np.concatenate([net.weight.asnumpy().ravel(), net.bias.asnumpy().ravel()]))
    return np.array(trajectory), optimizer


def test_fused_adamw_follows_mindformers_adamw_step_by_step():
    ours, fused = _run(GPTLocalAdamW)
    reference, plain = _run(AdamW)
    moved = np.abs(reference[-1] - reference[0]).max()
    assert moved > 1e-2  # the parameters really move
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-6)
    for a, b in zip(fused.exp_avg_sq, plain.exp_avg_sq):
        assert a.name == b.name  # same state names: checkpoints carry over
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-12)
