"""Bad input gives one clear error naming the key or file and the fix, never a deep traceback."""
import os

import numpy as np
import pytest

from mindformers_gptlocal import GPTLocalConfig
from mindformers_gptlocal.errors import ConfigError
from conftest import TINY, run_launcher, tiny_yaml


def test_unknown_key_is_named_with_suggestion():
    with pytest.raises(ConfigError, match=r"model_config.num_hiden_layers .*Did you mean 'num_hidden_layers'"):
        GPTLocalConfig(**dict(TINY, num_hiden_layers=3))


def test_heads_must_divide_hidden():
    with pytest.raises(ConfigError, match=r"hidden_size \(64\) must be divisible by .*num_attention_heads \(5\)"):
        GPTLocalConfig(**dict(TINY, num_attention_heads=5))


def test_seq_length_beyond_positions():
    with pytest.raises(ConfigError, match=r"seq_length \(128\) is larger than .*max_position_embeddings \(64\)"):
        GPTLocalConfig(**dict(TINY, seq_length=128))


@pytest.mark.parametrize("key,value,pattern", [
    ("hidden_size", "64", "must be a positive integer"),
    ("hidden_act", "swish", "hidden_act 'swish' is not supported"),
    ("compute_dtype", "fp8", "compute_dtype 'fp8' is not a dtype"),
    ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn=True is not supported"),
    ("scale_attn_weights", False, "scale_attn_weights=False .* is not supported"),
])
def test_wrong_values(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        GPTLocalConfig(**dict(TINY, **{key: value}))


def test_gpt2_names_are_accepted_and_conflicts_refused():
    config = GPTLocalConfig(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, seq_length=64)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    with pytest.raises(ConfigError, match="sets num_hidden_layers twice"):
        GPTLocalConfig(**dict(TINY, n_layer=3))


def _launch_error(tmp_path, corpus, *extra, **changes):
    yaml_path = tiny_yaml(tmp_path, corpus=corpus, **changes)
    code, out = run_launcher(["--config", yaml_path, *extra], cwd=str(tmp_path))
    errors = [line for line in out.splitlines() if line.startswith("gpt_local: error:")]
    assert code == 2, out[-2000:]
    assert len(errors) == 1 and "Traceback" not in out, out[-2000:]
    return errors[0]


def test_launcher_unknown_key(tmp_path, corpus):
    line = _launch_error(tmp_path, corpus, model__model_config__hiden_size=64)
    assert "model_config.hiden_size" in line and "hidden_size" in line


def test_launcher_missing_data_path(tmp_path, corpus):
    line = _launch_error(tmp_path, corpus, train_dataset__data_loader__dataset_dir=str(tmp_path / "nope.mindrecord"))
    assert "train_dataset.data_loader.dataset_dir" in line and "prepare-data" in line


def test_launcher_token_ids_beyond_vocab(tmp_path, corpus):
    from mindformers_gptlocal.data.prepare import write_mindrecord
    windows = np.random.default_rng(0).integers(0, 600, (8, 65)).astype(np.int32)  # vocab is 512
    path = str(tmp_path / "big.mindrecord")
    write_mindrecord(path, windows)
    line = _launch_error(tmp_path, corpus, train_dataset__data_loader__dataset_dir=path)
    assert "outside model_config.vocab_size (512)" in line and "vocab_size to at least" in line


def test_launcher_seq_length_mismatch(tmp_path, corpus):
    line = _launch_error(tmp_path, corpus, model__model_config__seq_length=32)
    assert "seq_length" in line and "--seq-length" in line


def test_legacy_yaml_is_switched_to_mcore(tmp_path, corpus):
    """A gpt_local YAML that forgets use_legacy: False still runs (and says so)."""
    yaml_path = tiny_yaml(tmp_path, corpus=corpus, use_legacy=True, train_dataset__data_loader__num_samples=8)
    code, out = run_launcher(["--config", yaml_path], cwd=str(tmp_path))
    assert code == 0, out[-2000:]
    assert "using use_legacy: False" in out
    assert os.path.isfile(tmp_path / "output" / "model" / "model.safetensors")
