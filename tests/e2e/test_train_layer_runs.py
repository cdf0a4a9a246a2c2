"""The tiny YAMLs (GPT-2's and the Llama-style one: RMSNorm, rope, GQA, SwiGLU, no biases) trained through MindFormers'
trainer (its train step: clip, loss scale, gpt_local's fused AdamW) with every layer's training step one kernel node
each way (``cpu_kernels.train_layer: kernel``; ``kernels/cpu_train_layer.cc``), dropout on: each step's loss within
1e-4 relative of the plain graph's (``cpu_kernels: plain``), falling. Each YAML's model_config is checked to build
the kernel in this process (the run's subprocess builds it from the same keys)."""
import pytest

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, yaml_io
from conftest import Launch, step_losses, write_yaml

STEPS = 4
KERNEL = {"train_layer": "kernel"}


@pytest.mark.parametrize("name", ["pretrain_gpt_local_tiny_cpu.yaml", "pretrain_llama_style_tiny_cpu.yaml"],
                         ids=["gpt2", "llama"])
def test_tiny_yaml_trains_with_the_layer_kernel_like_the_plain_graph(tmp_path, corpus, name):
    changes = dict(model__model_config__hidden_dropout=0.1, model__model_config__attention_dropout=0.1,
                   train_dataset__data_loader__num_samples=4 * STEPS, lr_schedule__warmup_ratio=0.3)
    runs = {}
    for side, kernels in (("kernel", KERNEL), ("plain", "plain")):
        path = write_yaml(tmp_path / side, corpus, name, model__model_config__cpu_kernels=kernels, **changes)
        if side == "kernel":
            values = {k: v for k, v in yaml_io.load_yaml(path)["model"]["model_config"].items()
                      if k not in ("model_type", "architectures")}
            layers = GPTLocalForCausalLM(GPTLocalConfig(**values)).model.layers
            assert all(type(layer.train_kernel).__name__ == "CPUTrainLayer" for layer in layers)
        runs[side] = Launch(["--config", path], cwd=str(tmp_path / side))
    losses = {}
    for side, run in runs.items():
        code, out = run.result()
        assert code == 0, out[-3000:]
        losses[side] = step_losses(out)
        assert len(losses[side]) == STEPS, out[-3000:]
    for got, want in zip(losses["kernel"], losses["plain"]):
        assert abs(got - want) <= 1e-4 * abs(want), losses
    assert losses["kernel"][-1] < losses["kernel"][0], losses
