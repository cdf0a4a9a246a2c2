"""``compute_dtype: bfloat16`` trained on CPU through the launcher (MindFormers' trainer, the shipped tiny YAML with
the dtype keys of MindFormers' YAMLs): the bf16 GEMMs, float32 master weights; every loss finite, within 2% of the
float32 run's step by step (conftest's shared tiny_trained_run: the same YAML, data, steps and learning rate) and
not equal to it (the rounding happens); the model directory it writes keeps compute_dtype bfloat16."""
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
    print("bf16 vs float32 losses, max relative difference:", float(relative.max()), list(bf16), list(fp32))
    assert relative.max() <= 0.02, (bf16, fp32)
    assert relative.max() > 0, "bf16 gave float32's losses exactly: no rounding happened"
    assert bf16[-1] < bf16[0] - 0.5
    with open(os.path.join(str(tmp_path), "output", "model", "config.json"), encoding="utf-8") as handle:
        assert json.load(handle)["compute_dtype"] == "bfloat16"
