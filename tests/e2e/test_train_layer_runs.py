"""The tiny YAMLs (GPT-2's and the Llama-style one: RMSNorm, rope, GQA, SwiGLU, no biases) trained through MindFormers'
trainer (its train step: clip, loss scale, gpt_local's fused AdamW) with every layer's training step one kernel node
each way (``cpu_kernels.train_layer: kernel``; ``kernels/csrc/cpu_train_layer.cc``), dropout on: each step's loss within
1e-4 relative of the plain graph's (``cpu_kernels: plain``), falling; and a run SIGKILLed after a complete checkpoint,
then resumed, ends bit for bit like an uninterrupted one. Each YAML's model_config is checked to build the kernel in
this process (the run's subprocess builds it from the same keys)."""
import os
import signal
import time

import pytest

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, yaml_io
from mindformers_gptlocal.checkpoint.resume import find_resume_checkpoint
from mindformers_gptlocal.errors import CheckpointError
from conftest import Launch, run_launcher, start_run, step_losses, uninterrupted_run, write_yaml

KERNEL = {"train_layer": "kernel"}
KILL_STEPS = 12


def _changes(steps, kernels):
    return dict(model__model_config__hidden_dropout=0.1, model__model_config__attention_dropout=0.1,
                model__model_config__cpu_kernels=kernels, train_dataset__data_loader__num_samples=4 * steps,
                lr_schedule__warmup_ratio=0.3)


# GPT-2's runs KILL_STEPS steps: its kernel run (conftest's uninterrupted_run) is the SIGKILL test's reference too.
@pytest.mark.parametrize("name,steps", [("pretrain_gpt_local_tiny_cpu.yaml", KILL_STEPS),
                                        ("pretrain_llama_style_tiny_cpu.yaml", 4)], ids=["gpt2", "llama"])
def test_tiny_yaml_trains_with_the_layer_kernel_like_the_plain_graph(tmp_path, tmp_path_factory, corpus, name,
                                                                      steps):
    plain = Launch(["--config", write_yaml(tmp_path / "plain", corpus, name, **_changes(steps, "plain"))],
                   cwd=str(tmp_path / "plain"))
    kernel = write_yaml(tmp_path / "kernel", corpus, name, **_changes(steps, KERNEL))
    builds_the_kernel(kernel)
    losses = {}
    for side, (code, out) in (("kernel", uninterrupted_run(tmp_path_factory, corpus, kernel)),
                              ("plain", plain.result())):
        assert code == 0, out[-3000:]
        losses[side] = step_losses(out)
        assert len(losses[side]) == steps, out[-3000:]
    for got, want in zip(losses["kernel"], losses["plain"]):
        assert abs(got - want) <= 1e-4 * abs(want), losses
    assert losses["kernel"][-1] < losses["kernel"][0], losses


def builds_the_kernel(yaml_path):
    """The YAML's model_config, built here, runs the training layer kernel in every layer."""
    values = {k: v for k, v in yaml_io.load_yaml(yaml_path)["model"]["model_config"].items()
              if k not in ("model_type", "architectures")}
    layers = GPTLocalForCausalLM(GPTLocalConfig(**values)).model.layers
    assert all(type(layer.train_kernel).__name__ == "CPUTrainLayer" for layer in layers)


def test_sigkill_then_resume_with_the_layer_kernel_is_exact(tmp_path, tmp_path_factory, corpus):
    """Dropout on (hidden and attention 0.1), the kernel on: a run SIGKILLed once a complete checkpoint of step 3 or
    later exists, then resumed (``--resume_training True``), gives the uninterrupted run's losses bit for bit."""
    killed = write_yaml(tmp_path / "killed", corpus, **_changes(KILL_STEPS, KERNEL))
    builds_the_kernel(killed)
    checkpoints = str(tmp_path / "killed" / "output" / "checkpoint")
    with open(tmp_path / "killed.log", "w", encoding="utf-8") as log:
        proc = start_run(["--config", killed], str(tmp_path / "killed"), log)
        deadline, step = time.time() + 300, 0
        while time.time() < deadline and proc.poll() is None and step < 3:
            try:
                step = int(find_resume_checkpoint(checkpoints, log=lambda _: None)[1]["step_num"])
            except (CheckpointError, OSError, KeyError, ValueError):
                step = 0
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 3 <= step < KILL_STEPS
    code, resumed = run_launcher(["--config", killed, "--resume_training", "True"], cwd=str(tmp_path / "killed"))
    assert code == 0, resumed[-3000:]
    code, full = uninterrupted_run(tmp_path_factory, corpus, killed)  # the gpt2 test's kernel run (checkpoints aside)
    assert code == 0, full[-3000:]
    losses, want = step_losses(resumed), step_losses(full)
    assert len(want) == KILL_STEPS and 0 < len(losses) < KILL_STEPS, (losses, want)
    assert losses == want[-len(losses):], (losses, want)
