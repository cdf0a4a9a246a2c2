"""The shipped SFT and LoRA YAMLs write checkpoints (their own GPTLocalCheckpointMonitor entry) and resume from
them (issue 26, item 2): a 4-step run saves at steps 2 and 4; a second run resumes from its step-2 file and its
steps 3-4 equal the first run's bit for bit. Shrunk to TINY; the callbacks are the YAML's own, with only the
save interval and the print interval lowered. The LoRA YAML keeps its lora_dropout (0.05): its masks come from the
model's forward counter, which the checkpoints hold.
"""
import json
import os

import pytest

from mindformers_gptlocal import yaml_io
from conftest import TINY, Launch, run_launcher, step_losses, tiny_yaml

STEPS = 4
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, corpus):
    """A model directory to finetune, Alpaca records, and those records prepared with the model's tokenizer."""
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from mindformers_gptlocal.data.prepare import prepare
    root = tmp_path_factory.mktemp("resume_shipped")
    model_dir = str(root / "model")
    GPTLocalForCausalLM(GPTLocalConfig(**TINY)).save_pretrained(model_dir, tokenizer_dir=corpus["model_dir"])
    records = root / "alpaca.jsonl"
    with open(records, "w", encoding="utf-8") as handle:
        for i in range(64):
            handle.write(json.dumps({"instruction": f"repeat {WORDS[i % 8]} {i}", "input": WORDS[(i * 3) % 8],
                                     "output": f"{WORDS[i % 8]} {WORDS[(i * 5) % 8]} {i}"}) + "\n")
    sft = prepare([str(records)], out=str(root / "sft"), seq_length=64, fmt="alpaca", tokenizer_path=model_dir,
                  eval_fraction=0)
    return {"model_dir": model_dir, "records": str(records), "sft": sft}


def _shipped_yaml(tmp_path, name, base, **changes):
    path = tiny_yaml(tmp_path, name, load_checkpoint=base["model_dir"], **changes)
    config = yaml_io.load_yaml(path)
    monitors = [c for c in config["callbacks"] if c["type"] == "GPTLocalCheckpointMonitor"]
    assert len(monitors) == 1, config["callbacks"]  # the shipped YAML's own entry
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalCheckpointMonitor":
            callback["save_checkpoint_steps"] = 2
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
        if callback["type"] == "GPTLocalSaveModelDir":
            callback["tokenizer_dir"] = base["model_dir"] if "pretrained_model_dir" in config else \
                base["sft"]["model_dir"]
    loader = config["train_dataset"]["data_loader"]
    if loader["type"] == "HFDataLoader":
        config["pretrained_model_dir"] = base["model_dir"]
        loader.update(data_files=base["records"], compressed_eod_mask_length=64)
        for handler in loader["handler"]:
            handler.update(seq_length=64, max_docs=64)
    else:
        loader["dataset_dir"] = base["sft"]["train_mindrecord"]
    config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    return yaml_io.dump_yaml(config, path)


RUNS = {"lora": ("finetune_gpt_local_tiny_sft_lora_cpu.yaml", {}),  # the YAML's lora_dropout (0.05) kept
        "sft": ("finetune_gpt_local_tiny_sft_cpu.yaml", {})}


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory, base):
    """Both shipped YAMLs' 4-step runs, started at once (independent: they overlap); {key: (folder, yaml, Launch)}."""
    runs = {}
    for key, (name, changes) in RUNS.items():
        folder = tmp_path_factory.mktemp(f"shipped_{key}")
        (folder / "full").mkdir()
        path = _shipped_yaml(folder / "full", name, base, **changes)
        runs[key] = folder, path, Launch(["--config", path, "--runner_config.stop_step", str(STEPS)],
                                         cwd=str(folder / "full"))
    return runs


def _assert_resumes(full_runs, key):
    from mindformers_gptlocal.checkpoint import manifest
    tmp_path, path, launch = full_runs[key]
    code, out = launch.result()
    assert code == 0, out[-3000:]
    reference = step_losses(out)
    assert len(reference) == STEPS, out[-3000:]
    folder = tmp_path / "full" / "output" / "checkpoint"
    saved = {entry["step"]: entry["file"] for entry in manifest.read_manifest(str(folder))}
    assert 2 in saved, saved
    code, resumed = run_launcher(["--config", path, "--load_checkpoint", str(folder), "--resume_training",
                                  saved[2], "--output_dir", str(tmp_path / "resumed"), "--runner_config.stop_step",
                                  str(STEPS - 2)], cwd=str(tmp_path / "full"))
    assert code == 0, resumed[-3000:]
    assert "(step 2)" in resumed, resumed[-3000:]
    assert step_losses(resumed) == reference[2:], (step_losses(resumed), reference)


def test_shipped_lora_yaml_writes_checkpoints_and_resumes_exactly(full_runs):
    _assert_resumes(full_runs, "lora")


def test_shipped_sft_yaml_writes_checkpoints_and_resumes_exactly(full_runs):
    _assert_resumes(full_runs, "sft")
