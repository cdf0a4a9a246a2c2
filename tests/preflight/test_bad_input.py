"""Bad input gives one clear error naming the key or file and the fix, never a deep traceback."""
import functools
import os

import numpy as np
import pytest

from mindformers_gptlocal import GPTLocalConfig
from mindformers_gptlocal.errors import ConfigError
from conftest import TINY, launch_in_process, run_launcher, tiny_yaml


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


@pytest.fixture
def launch_error(tmp_path, corpus, capsys, monkeypatch):
    """``gptlocal run`` on the tiny YAML with ``changes``, refused by the pre-flight: its one error line. In this
    process (``conftest.launch_in_process``: the CLI's main, no subprocess start); the entry point's own
    subprocess is kept by test_launcher_prints_one_clean_line_for_bad_yaml."""
    return functools.partial(_launch_error, tmp_path, corpus, capsys, monkeypatch)


def _launch_error(tmp_path, corpus, capsys, monkeypatch, *extra, **changes):
    yaml_path = tiny_yaml(tmp_path, corpus=corpus, **changes)
    code, out = launch_in_process(["--config", yaml_path, *extra], str(tmp_path), capsys, monkeypatch)
    errors = [line for line in out.splitlines() if line.startswith("gptlocal run: error:")]
    assert code == 2, out[-2000:]
    assert len(errors) == 1 and "Traceback" not in out, out[-2000:]
    return errors[0]


def test_launcher_wrong_type(tmp_path, launch_error):
    line = launch_error(model__model_config__num_hidden_layers="four")
    assert "model_config.num_hidden_layers must be a positive integer, got 'four'" in line
    assert not os.path.exists(tmp_path / "output" / "checkpoint")


def test_launcher_unknown_key(launch_error):
    line = launch_error(model__model_config__hiden_size=64)
    assert "model_config.hiden_size" in line and "hidden_size" in line


def test_launcher_missing_data_path(tmp_path, launch_error):
    line = launch_error(train_dataset__data_loader__dataset_dir=str(tmp_path / "nope.mindrecord"))
    assert "train_dataset.data_loader.dataset_dir" in line and "prepare-data" in line


def test_launcher_token_ids_beyond_vocab(tmp_path, launch_error):
    from mindformers_gptlocal.data.prepare import write_mindrecord
    windows = np.random.default_rng(0).integers(0, 600, (8, 65)).astype(np.int32)  # vocab is 512
    path = str(tmp_path / "big.mindrecord")
    write_mindrecord(path, windows)
    line = launch_error(train_dataset__data_loader__dataset_dir=path)
    assert "outside model_config.vocab_size (512)" in line and "vocab_size to at least" in line


def test_launcher_seq_length_mismatch(launch_error):
    line = launch_error(model__model_config__seq_length=32)
    assert "seq_length" in line and "--seq-length" in line


def test_legacy_yaml_is_switched_to_mcore(tmp_path, corpus):
    """A gpt_local YAML that forgets use_legacy: False still runs (and says so)."""
    yaml_path = tiny_yaml(tmp_path, corpus=corpus, use_legacy=True, train_dataset__data_loader__num_samples=8)
    code, out = run_launcher(["--config", yaml_path], cwd=str(tmp_path))
    assert code == 0, out[-2000:]
    assert "using use_legacy: False" in out
    assert os.path.isfile(tmp_path / "output" / "model" / "model.safetensors")


# --- more bad input, checked in-process (the launcher's own pre-flight, no subprocess) ----------------------

def _preflight_error(tmp_path, corpus, *args, name="pretrain_gpt_local_tiny_cpu.yaml", **changes):
    """Run the launcher's config loading and pre-flight in this process; return the GPTLocalError's text."""
    from mindformers_gptlocal.errors import GPTLocalError
    from mindformers_gptlocal.cli.launcher import load_config
    from mindformers_gptlocal.mf.run_yaml import preflight
    yaml_path = tiny_yaml(tmp_path, name, corpus=corpus, **changes)
    with pytest.raises(GPTLocalError) as caught:
        preflight(load_config(["--config", yaml_path, *args]), log=lambda _: None)
    assert not os.path.exists(tmp_path / "output"), "a refused run wrote into output_dir"
    return str(caught.value)


def test_wrong_types(tmp_path, corpus):
    assert "model_config.num_hidden_layers must be a positive integer, got 'four'" in \
        _preflight_error(tmp_path, corpus, model__model_config__num_hidden_layers="four")
    assert "model_config.seq_length must be a positive integer, got 64.5" in \
        _preflight_error(tmp_path, corpus, model__model_config__seq_length=64.5)
    assert "model_config.hidden_dropout must be a number" in \
        _preflight_error(tmp_path, corpus, model__model_config__hidden_dropout="high")
    assert "runner_config.batch_size must be a positive integer" in \
        _preflight_error(tmp_path, corpus, runner_config__batch_size="4x")


def _fake_checkpoint(path, **shapes):
    from safetensors.numpy import save_file
    save_file({name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, str(path))
    return str(path)


def test_checkpoint_of_another_size_or_architecture(tmp_path, corpus):
    bigger = _fake_checkpoint(tmp_path / "big.safetensors", **{
        "model.embedding.word_embeddings": (512, 128), "model.embedding.position_embeddings": (64, 128)})
    line = _preflight_error(tmp_path, corpus, "--load_checkpoint", bigger, run_mode="finetune")
    assert "model.embedding.word_embeddings" in line and "(512, 128)" in line and "another size" in line
    deeper = _fake_checkpoint(tmp_path / "deep.safetensors", **{
        "model.embedding.word_embeddings": (512, 64), "model.layers.3.mlp.linear_fc1.bias": (256,)})
    assert "has 4 layers but model_config.num_hidden_layers is 2" in \
        _preflight_error(tmp_path, corpus, "--load_checkpoint", deeper, run_mode="finetune")
    hf = _fake_checkpoint(tmp_path / "hf.safetensors", **{"wte.weight": (512, 64), "wpe.weight": (64, 64)})
    assert "not a gpt_local checkpoint" in _preflight_error(tmp_path, corpus, "--load_checkpoint", hf,
                                                           run_mode="finetune")


def test_truncated_or_corrupt_safetensors(tmp_path, corpus):
    path = _fake_checkpoint(tmp_path / "w.safetensors", **{"model.embedding.word_embeddings": (512, 64)})
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 100)
    assert "truncated" in _preflight_error(tmp_path, corpus, "--load_checkpoint", path, run_mode="finetune")
    with open(path, "wb") as handle:
        handle.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert "unreadable safetensors header" in _preflight_error(tmp_path, corpus, "--load_checkpoint", path,
                                                              run_mode="finetune")


def test_pickle_checkpoint_is_refused(tmp_path, corpus):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x80\x04not really a pickle")
    line = _preflight_error(tmp_path, corpus, "--load_checkpoint", str(path), run_mode="finetune")
    assert "pickle-based" in line and "--allow-pickle" in line


def test_mindrecord_wrong_schema(tmp_path, corpus):
    from mindspore.mindrecord import FileWriter
    path = str(tmp_path / "text.mindrecord")
    writer = FileWriter(path, shard_num=1, overwrite=True)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "no_labels")
    writer.write_raw_data([{"input_ids": np.arange(64, dtype=np.int32)} for _ in range(8)])
    writer.commit()
    line = _preflight_error(tmp_path, corpus, train_dataset__data_loader__dataset_dir=path)
    assert "lacks column(s) ['labels', 'loss_mask', 'position_ids']" in line


def test_empty_dataset_or_smaller_than_a_batch(tmp_path, corpus):
    from mindformers_gptlocal.data.prepare import write_mindrecord
    path = str(tmp_path / "empty.mindrecord")
    write_mindrecord(path, np.ones((0, 65), np.int32))
    assert "holds no samples" in _preflight_error(tmp_path, corpus, train_dataset__data_loader__dataset_dir=path)
    path = str(tmp_path / "tiny.mindrecord")
    write_mindrecord(path, np.ones((2, 65), np.int32))
    assert "holds 2 sample(s), fewer than one batch (4)" in \
        _preflight_error(tmp_path, corpus, train_dataset__data_loader__dataset_dir=path)


def _megatron_copy(corpus, tmp_path):
    import shutil
    source = os.path.join(os.path.dirname(corpus["train_mindrecord"]), "megatron", "train_text_document")
    prefix = str(tmp_path / "doc")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(source + suffix, prefix + suffix)
    return prefix


def test_megatron_truncated_bin_and_foreign_idx(tmp_path, corpus):
    prefix = _megatron_copy(corpus, tmp_path)
    changes = dict(name="pretrain_gpt_local_tiny_cpu_megatron.yaml",
                   train_dataset__data_loader__config__data_path=["1", prefix])
    with open(prefix + ".bin", "r+b") as handle:
        handle.truncate(os.path.getsize(prefix + ".bin") - 10)
    assert "does not belong together or one is truncated" in _preflight_error(tmp_path, corpus, **changes)
    with open(prefix + ".idx", "wb") as handle:
        handle.write(b"NOT AN INDEX" * 10)
    assert "is not a Megatron index" in _preflight_error(tmp_path, corpus, **changes)


def test_tokenizer_larger_than_vocab(tmp_path, corpus):
    line = _preflight_error(tmp_path, corpus, model__model_config__vocab_size=300)
    assert "tokenizer.json has 512 token ids but model_config.vocab_size is 300" in line


def test_unwritable_output_dir(tmp_path, corpus):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    line = _preflight_error(tmp_path, corpus, "--output_dir", str(blocker / "out"))
    assert "cannot be created" in line and "is a file" in line
    assert "is not writable" in _preflight_error(tmp_path, corpus, "--output_dir", "/proc/gptlocal-out")
    assert blocker.read_text() == "x"


def test_launcher_prints_one_clean_line_for_bad_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model_config:\n    model_type: gpt_local\n   hidden_size: [\n")
    code, out = run_launcher(["--config", str(bad)], cwd=str(tmp_path))
    errors = [line for line in out.splitlines() if line.startswith("gptlocal run: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out[-2000:]
    assert f"{bad}:4:4: YAML syntax error" in errors[0]  # named by line and column
    assert os.listdir(tmp_path) == ["bad.yaml"]  # nothing created, not even MindFormers' log folder


def test_megatron_token_ids_beyond_vocab(tmp_path, corpus):
    from mindformers_gptlocal.data.prepare import write_megatron
    prefix = str(tmp_path / "big")
    write_megatron(prefix, [np.arange(500, 700, dtype=np.int32)])  # vocab is 512
    line = _preflight_error(tmp_path, corpus, name="pretrain_gpt_local_tiny_cpu_megatron.yaml",
                            train_dataset__data_loader__config__data_path=["1", prefix])
    assert "holds token id 699, outside model_config.vocab_size (512)" in line


def test_fused_mindformers_adamw_on_cpu_points_to_gptlocal_adamw(tmp_path, corpus):
    """MindFormers' use_fused AdamW has no CPU kernel; refused before compile, with the replacement named."""
    message = _preflight_error(tmp_path, corpus, optimizer__type="AdamW", optimizer__use_fused=True)
    assert "optimizer.use_fused" in message and "GPTLocalAdamW" in message
