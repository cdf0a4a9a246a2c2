"""``compute_dtype: bfloat16`` trained on CPU through the launcher (MindFormers' trainer, the shipped tiny YAML with
the dtype keys of MindFormers' YAMLs): the bf16 GEMMs, float32 master weights; every loss finite, within 2% of the
float32 run's step by step (conftest's shared tiny_trained_run: the same YAML, data, steps and learning rate) and
not equal to it (the rounding happens); the model directory it writes keeps compute_dtype bfloat16. And a LoRA
finetune with bf16 through the launcher."""
import json
import os

import numpy as np

from mindformers_gptlocal import yaml_io
from conftest import TRAINED_STEPS, run_launcher, step_losses, tiny_yaml


def test_bf16_training_follows_float32(corpus, tmp_path, tiny_trained_run):
    path = tiny_yaml(tmp_path, corpus=corpus, train_dataset__data_loader__num_samples=TRAINED_STEPS * 4,
                     lr_schedule__learning_rate=3e-3, model__model_config__compute_dtype="bfloat16",
                     model__model_config__layernorm_compute_dtype="float32",
                     model__model_config__softmax_compute_dtype="float32")
    config = yaml_io.load_yaml(path)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
    yaml_io.dump_yaml(config, path)
    code, out = run_launcher(["--config", path], cwd=str(tmp_path))
    assert code == 0, out[-3000:]
    assert "Unsupported data type" not in out
    bf16, fp32 = np.array(step_losses(out)), np.array(tiny_trained_run["losses"])
    assert len(bf16) == len(fp32) == TRAINED_STEPS and np.isfinite(bf16).all()
    relative = np.abs(bf16 / fp32 - 1)
    print("bf16 vs float32 losses, max relative difference:", float(relative.max()))
    assert relative.max() <= 0.02, (bf16, fp32)
    assert relative.max() > 0, "bf16 gave float32's losses exactly: no rounding happened"
    assert bf16[-1] < bf16[0] - 0.5
    with open(os.path.join(str(tmp_path), "output", "model", "config.json"), encoding="utf-8") as handle:
        assert json.load(handle)["compute_dtype"] == "bfloat16"


def test_bf16_lora_finetune_through_the_launcher(corpus, tmp_path):
    """The finetune YAML with MindFormers' LoRA pet_config and compute_dtype bfloat16, from a tiny model directory:
    it runs, every loss finite and falling, the base weights bit-identical afterwards (float32 master weights
    frozen), the adapters trained."""
    from safetensors.numpy import load_file
    from conftest import save_tiny_base, write_yaml
    import mindspore as ms
    ms.set_context(mode=ms.PYNATIVE_MODE)
    base = save_tiny_base(tmp_path / "base", corpus, seed=5)
    pet = dict(pet_type="lora", lora_rank=8, lora_alpha=16, lora_dropout=0.0,
               target_modules=".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2",
               freeze_include=["*"], freeze_exclude=["*lora*"])
    path = write_yaml(tmp_path / "run", corpus, "finetune_gpt_local_tiny_cpu.yaml", keep=1,
                      train_dataset__data_loader__num_samples=40, model__model_config__pet_config=pet,
                      model__model_config__compute_dtype="bfloat16", load_checkpoint=base,
                      lr_schedule__learning_rate=5e-3, lr_schedule__lr_end=5e-3)
    code, out = run_launcher(["--config", path], cwd=str(tmp_path / "run"))
    assert code == 0, out[-3000:]
    losses = step_losses(out)
    assert len(losses) == 10 and np.isfinite(losses).all(), losses
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05, losses
    weights = load_file(os.path.join(base, "model.safetensors"))
    tuned = load_file(str(tmp_path / "run" / "output" / "model" / "model.safetensors"))
    for name, value in weights.items():
        assert np.array_equal(tuned[name], value), name
    assert min(np.abs(tuned[n]).max() for n in tuned if n.endswith(".lora_b")) > 0
    with open(str(tmp_path / "run" / "output" / "model" / "config.json"), encoding="utf-8") as handle:
        assert json.load(handle)["compute_dtype"] == "bfloat16"
