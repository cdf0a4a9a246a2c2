"""The first hour's remaining mistakes (issue 53): each is one ``gptlocal COMMAND: error:`` line naming the file or
flag and the fix, exit code 2, nothing written."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import CONFIGS, launch_in_process, source_env, tiny_yaml


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", *args], cwd=str(cwd),
                          capture_output=True, text=True, env=source_env(), timeout=300)


def _one_line(code, out, command):
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2, out[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"gptlocal {command}: error:"), lines[-20:]
    return lines[0]


@pytest.fixture
def broken_model(tmp_path):
    """A model directory whose config.json a hand edit broke."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt_local",\n "hidden_size": 64,,\n}\n')
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi", "--model"], ["chat", "--model"],
                                     ["quantize", "--dtype", "int8", "--out", "q", "--model"],
                                     ["convert", "ms2hf", "--out", "hf", "--ms-dir"]])
def test_a_model_directory_whose_config_json_is_not_json(tmp_path, broken_model, command):
    proc = _cli(*command, "model", cwd=tmp_path)
    line = _one_line(proc.returncode, proc.stdout + proc.stderr, command[0])
    assert f"{os.path.join('model', 'config.json')} is not valid JSON (line 2, column 20" in line, line
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_serve_checks_config_json_before_it_starts(tmp_path, broken_model):
    pytest.importorskip("uvicorn")
    proc = _cli("serve", "--model", "model", "--port", "0", cwd=tmp_path)
    assert "config.json is not valid JSON" in _one_line(proc.returncode, proc.stdout + proc.stderr, "serve")


def test_a_file_given_as_the_model_directory_is_named_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    proc = _cli("generate", "--model", "notes.txt", "--prompt", "hi", cwd=tmp_path)
    line = _one_line(proc.returncode, proc.stdout + proc.stderr, "generate")
    assert "--model notes.txt is a file, not a model directory" in line and "does not exist" not in line, line


def test_a_mistyped_run_flag_without_config_gets_its_suggestion(tmp_path, capsys, monkeypatch):
    """README's own example (`gptlocal run --stepz 5`) without --config: the suggestion, not argparse's usage."""
    proc = _cli("run", "--stepz", "5", cwd=tmp_path)
    line = _one_line(proc.returncode, proc.stdout + proc.stderr, "run")
    assert "unknown flag --stepz" in line and "--runner_config.stop_step" in line, line
    code, out = launch_in_process([], str(tmp_path), capsys, monkeypatch)
    assert "--config is missing" in _one_line(code, out, "run")
    assert os.listdir(tmp_path) == []


def test_argparse_mistakes_are_one_line_too(tmp_path):
    proc = _cli("generate", "--model", "somewhere", cwd=tmp_path)
    line = _one_line(proc.returncode, proc.stdout + proc.stderr, "generate")
    assert "--prompt" in line and "gptlocal generate --help" in line, line


def test_a_yaml_copied_away_from_its_base_config_names_base_config(tmp_path, capsys, monkeypatch):
    """The LoRA YAML's base_config is a sibling file; copied alone, the error names base_config and the fix."""
    shutil.copy(os.path.join(CONFIGS, "finetune_gpt_local_tiny_sft_lora_cpu.yaml"), tmp_path / "lora.yaml")
    code, out = launch_in_process(["--config", "lora.yaml"], str(tmp_path), capsys, monkeypatch)
    line = _one_line(code, out, "run")
    assert "its base_config './finetune_gpt_local_tiny_sft_mindrecord_cpu.yaml' is not there" in line, line
    assert "relative to the YAML" in line and "Traceback" not in out
    proc = _cli("plan", "--config", "lora.yaml", cwd=tmp_path)
    assert "its base_config" in _one_line(proc.returncode, proc.stdout + proc.stderr, "plan")
    assert sorted(os.listdir(tmp_path)) == ["lora.yaml"]


def test_a_missing_dataset_file_is_named_missing(tmp_path, corpus, capsys, monkeypatch):
    """Not "has no meta.json beside it" (the tokenizer check reads what lies beside the data): the file is not
    there."""
    yaml_path = tiny_yaml(tmp_path, corpus=corpus)
    (tmp_path / "cwd").mkdir()
    code, out = launch_in_process(["--config", yaml_path, "--train_dataset_dir", "data/nowhere/train.mindrecord"],
                                  str(tmp_path / "cwd"), capsys, monkeypatch)
    line = _one_line(code, out, "run")
    assert "train_dataset.data_loader.dataset_dir: 'data/nowhere/train.mindrecord' does not exist" in line, line
    assert "meta.json" not in out
    assert not os.path.exists(tmp_path / "output") and os.listdir(tmp_path / "cwd") == []


def test_config_json_check_reads_only_what_is_there(tmp_path):
    """The check passes a good config.json and a folder without one (the other checks name that)."""
    from mindformers_gptlocal.errors import ConfigError
    from mindformers_gptlocal.model.loader import check_config_json
    check_config_json(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_local"}))
    check_config_json(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON list"):
        check_config_json(str(tmp_path))
