"""What the first hour meets on the command line (issue 63): a flag from another tool gets what to do instead of a
near spelling, quantize's dtype defaults to int8, convert hf2ms on a gpt_local folder says there is nothing to
convert, and `gptlocal --help` lists the commands in README's order (a user's workflow)."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, save_tiny_base, source_env


def _cli(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", *args], cwd=str(cwd),
                          capture_output=True, text=True, env=source_env(), timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("help") / "model", None, seed=0)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flag", ["--do-sample", "--do_sample"])
def test_do_sample_says_sampling_is_the_default_and_temperature_0_is_greedy(tmp_path, command, flag):
    code, out = _cli(command, "--model", "m", "--prompt", "hi", flag, cwd=tmp_path) if command == "generate" \
        else _cli(command, "--model", "m", flag, cwd=tmp_path)
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1, out
    assert f"{flag}: sampling is already the default; --temperature 0 is greedy" in lines[0], out
    assert "did you mean" not in lines[0], out
    assert os.listdir(tmp_path) == []


def test_greedy_says_temperature_0(tmp_path):
    code, out = _cli("generate", "--model", "m", "--prompt", "hi", "--greedy", cwd=tmp_path)
    assert code == 2 and "--greedy: use --temperature 0 for greedy decoding; sampling is the default" in out, out


def test_a_near_spelling_still_gets_the_closest_flags(tmp_path):
    code, out = _cli("generate", "--model", "m", "--prompt", "hi", "--temprature", "0", cwd=tmp_path)
    assert code == 2 and "--temprature: did you mean --temperature?" in out, out


def test_run_keeps_its_own_do_sample_flag(tmp_path):
    code, out = _cli("run", "--help", cwd=tmp_path)
    assert code == 0 and "--do_sample" in out, out  # MindFormers' run_mindformer.py flag, no hint there


def test_quantize_defaults_to_int8(tmp_path, model_dir):
    code, out = _cli("quantize", "--help", cwd=tmp_path)
    assert code == 0 and re.search(r"int8 \(the\s+default\)", out), out
    code, out = _cli("quantize", "--model", model_dir, "--out", "q", cwd=tmp_path)
    assert code == 0 and "int8" in out, out
    config = json.load(open(tmp_path / "q" / "config.json", encoding="utf-8"))
    assert config["quantization"] and config["compute_dtype"] == "float32", config


def test_convert_hf2ms_of_a_gpt_local_folder_says_there_is_nothing_to_convert(tmp_path, model_dir):
    code, out = _cli("convert", "hf2ms", "--hf-dir", model_dir, "--out", "again", cwd=tmp_path)
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gptlocal convert: error:"), out
    assert "is already a gpt_local model directory" in lines[0] and "nothing to convert" in lines[0], out
    assert f"--model {model_dir}" in lines[0], out  # what to do with it instead
    assert os.listdir(tmp_path) == []


def _readme_commands():
    """The commands of README's command table, in its order (`gptlocal generate` / `chat`: both)."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    table = text[text.index("## The command line"):]
    table = table[:table.index("\n\n", table.index("| command |"))]
    names = []
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        names += [name.split()[0] for name in re.findall(r"`(?:gptlocal )?([a-z-]+(?: merge)?)`", first)]
    return names


def test_help_lists_the_commands_in_readmes_order(tmp_path):
    code, out = _cli("--help", cwd=tmp_path)
    assert code == 0, out
    listed = re.findall(r"^    ([a-z-]+)\s", out, re.M)
    assert listed == _readme_commands(), (listed, _readme_commands())
    assert listed[:4] == ["prepare-data", "run", "generate", "chat"], listed
    code, out = _cli("generat", cwd=tmp_path)  # an unknown command lists them in the same order
    assert code == 2 and ", ".join(listed) in out, out
