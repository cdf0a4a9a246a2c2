"""GPTLocalAdamW is MindFormers' AdamW (bias correction, decoupled decay, decay groups), fused."""
import numpy as np
import mindspore as ms
from mindspore import nn, Tensor, Parameter

from mindformers.core.optim import AdamW
from mindformers_gptlocal import yaml_io
from mindformers_gptlocal.training.optim import GPTLocalAdamW

from conftest import TRAINED_STEPS, run_launcher, step_losses, tiny_yaml


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


def test_training_loss_curve_unchanged_through_the_trainer(corpus, tmp_path, tiny_trained_run):
    """20 steps through MindFormers' trainer: the CPU fast path (GPTLocalAdamW, TanhGeLU, two-stage
    clipping) gives the plain path's losses (MindFormers' AdamW and ClipGradNorm, the GeLU kernel).
    The fast side is conftest's shared tiny_trained_run (the same YAML, data, steps and learning rate)."""
    assert TRAINED_STEPS == 20
    path = tiny_yaml(tmp_path, corpus=corpus, train_dataset__data_loader__num_samples=80,
                     lr_schedule__learning_rate=3e-3, optimizer__type="AdamW", model__model_config__cpu_kernels="plain")
    config = yaml_io.load_yaml(path)
    config["callbacks"] = [{"type": "GPTLocalThroughputMonitor", "per_print_times": 1}]
    yaml_io.dump_yaml(config, path)
    code, out = run_launcher(["--config", path], cwd=str(tmp_path))
    assert code == 0, out[-3000:]
    plain, fast = np.array(step_losses(out)), np.array(tiny_trained_run["losses"])
    assert len(plain) == 20 and plain[-1] < plain[0] - 0.5
    print("max relative loss difference over 20 steps:", float(np.max(np.abs(fast / plain - 1))))
    np.testing.assert_allclose(fast, plain, rtol=1e-4, atol=0)


def test_plain_kernels_switch(tiny_config, mcore_context):
    """cpu_kernels plain (or {composed_ops: plain}) keeps MindSpore's GeLU kernel and MindFormers' clipping on CPU."""
    from mindformers.core.clip_grad import ClipGradNorm
    from mindformers_gptlocal import GPTLocalForCausalLM, GPTLocalTrainOneStepCell
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.layers import Activation
    from mindformers_gptlocal.mf.wrapper import GPTLocalClipGradNorm
    assert Activation("gelu_new", KernelProvider.from_config(tiny_config)).composed_tanh_gelu
    for cpu_kernels in ("plain", {"composed_ops": "plain"}):
        assert not Activation("gelu_new", KernelProvider(cpu_kernels)).composed_tanh_gelu
    for cpu_kernels, clip in (("auto", GPTLocalClipGradNorm), ("plain", ClipGradNorm)):
        tiny_config.cpu_kernels = cpu_kernels
        model = GPTLocalForCausalLM(tiny_config)
        cell = GPTLocalTrainOneStepCell(model, nn.SGD(model.trainable_params(), learning_rate=0.1),
                                        use_clip_grad=True, scale_sense=1.0)
        assert type(cell.clip_grad_norm) is clip  # noqa: E721 pylint: disable=unidiomatic-typecheck
