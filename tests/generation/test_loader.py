"""model/loader.py, the one loader of generate, chat, eval and serve, and ``from_pretrained``: a model directory
without weights (prepare-data's model folder: a config and a tokenizer) is refused with one line naming the
folder and what it lacks (on the CLI ``gptlocal COMMAND: error: ...``, exit 2); a random model is asked for
explicitly (``random_init=True``)."""
import json
import os
import shutil

import pytest

from conftest import TINY, save_tiny_base


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, corpus):
    """A trained-looking model directory (weights + tokenizer) and a copy without its weights."""
    root = tmp_path_factory.mktemp("loader")
    full = save_tiny_base(root / "full", corpus, 0)
    bare = root / "bare"
    shutil.copytree(full, bare)
    os.remove(bare / "model.safetensors")
    return str(full), str(bare)


def test_from_pretrained_refuses_a_folder_without_weights_unless_random_init(dirs):
    from mindformers_gptlocal import CheckpointError, GPTLocalForCausalLM
    full, bare = dirs
    with pytest.raises(CheckpointError) as err:
        GPTLocalForCausalLM.from_pretrained(bare)
    message = str(err.value)
    assert bare in message and "has no weights (model.safetensors)" in message and "random_init=True" in message
    assert "\n" not in message
    model = GPTLocalForCausalLM.from_pretrained(bare, random_init=True)  # asked for: built, nothing loaded
    assert model.config.vocab_size == json.load(open(os.path.join(bare, "config.json")))["vocab_size"]
    assert GPTLocalForCausalLM.from_pretrained(full).config.hidden_size == TINY["hidden_size"]


@pytest.mark.parametrize("command", ["generate", "chat", "eval"])
def test_commands_refuse_a_folder_without_weights_in_one_line(dirs, command, capsys, monkeypatch):
    import io
    import sys
    from mindformers_gptlocal.cli.main import main
    _, bare = dirs
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    extra = {"generate": ["--prompt", "x"], "chat": [], "eval": ["--tasks", "anything"]}[command]
    assert main([command, "--model", bare, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"gptlocal {command}: error: ") and bare in err[0]
    assert "has no weights (model.safetensors)" in err[0]


def test_check_model_dir_names_the_folder_and_what_it_lacks(dirs, tmp_path):
    from mindformers_gptlocal.errors import ConfigError, DataError
    from mindformers_gptlocal.model.loader import check_model_dir
    full, _ = dirs
    check_model_dir(full)
    with pytest.raises(ConfigError, match="--model .*nowhere does not exist, so it is not a model directory"):
        check_model_dir(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="pretrained=.* has no config.json, so it is not a model directory"):
        check_model_dir(str(tmp_path), "pretrained=")
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(full, no_tokenizer)
    os.remove(no_tokenizer / "tokenizer.json")
    check_model_dir(str(no_tokenizer), tokenizer=False)  # serve: token ids only
    with pytest.raises(DataError, match="has no tokenizer.json"):
        check_model_dir(str(no_tokenizer))


def test_a_bad_compile_cache_bound_is_one_line_before_loading(dirs, capsys):
    from mindformers_gptlocal.cli.main import main
    full, _ = dirs
    assert main(["generate", "--model", full, "--prompt", "x", "--compile-cache-days", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gptlocal generate: error: --compile-cache-days -1.0 must be")
