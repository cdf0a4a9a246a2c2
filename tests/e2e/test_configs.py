"""Every YAML in model_configs/ parses, holds a valid gpt_local model, and has a consistent layout."""
import glob
import os
import re

import pytest
from mindformers.tools.register import MindFormerConfig

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, yaml_io
from mindformers_gptlocal.parallel.layout import layers_per_stage
from conftest import CONFIGS

YAMLS = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))


def _model_config(config):
    values = {k: v for k, v in config["model"]["model_config"].items() if k not in ("model_type", "architectures")}
    return GPTLocalConfig(**values, parallel_config=config.get("parallel_config"))


@pytest.mark.parametrize("path", YAMLS, ids=os.path.basename)
def test_config_is_valid(path):
    config = yaml_io.load_yaml(path)
    assert MindFormerConfig(path).model.model_config.model_type == "gpt_local"  # MindFormers reads it too
    assert config["use_legacy"] is False
    assert config["run_mode"] in ("train", "finetune", "eval", "predict")
    model_config = _model_config(config)
    parallel = config["parallel_config"]
    stages = parallel.get("pipeline_stage", 1)
    assert sum(layers_per_stage(model_config.num_hidden_layers, stages)) == model_config.num_hidden_layers
    assert model_config.num_attention_heads % parallel.get("model_parallel", 1) == 0
    devices = parallel.get("data_parallel", 1) * parallel.get("model_parallel", 1) * stages
    cards = re.search(r"_(\d+)p\.yaml$", path)
    if cards and cards.group(1) != "1":
        assert devices == int(cards.group(1)) and config["use_parallel"] is True
    elif path.endswith("_dp2.yaml"):
        assert devices == 2
    else:
        assert devices == 1


@pytest.mark.parametrize("name", ["pretrain_gpt_local_tiny_cpu.yaml", "pretrain_gpt2_small_1p.yaml"])
def test_small_configs_build_their_model(name):
    config = yaml_io.load_yaml(os.path.join(CONFIGS, name))
    model = GPTLocalForCausalLM(_model_config(config))
    c = model.config
    count = sum(p.size for p in model.trainable_params())
    h = c.hidden_size
    # embeddings + per layer (QKV, proj, fc1, fc2 with biases; two LayerNorms) + final LayerNorm; head tied
    assert count == (c.vocab_size + c.max_position_embeddings) * h + c.num_hidden_layers * (12 * h * h + 13 * h) + 2 * h
    if "gpt2_small" in name:
        assert count == 124_439_808  # Hugging Face gpt2's parameter count
