"""Training or finetuning from an int8 model directory (``gptlocal quantize``) is refused by the pre-flight with
one line and exit 2, whichever way the run names it: load_checkpoint, pretrained_model_dir or model_config."""
import pytest

from mindformers_gptlocal.model.quantization import QUANTIZATION
from mindformers_gptlocal.quantize import quantize_model
from conftest import launch_in_process, save_tiny_base, tiny_yaml


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("int8run")
    base = save_tiny_base(root / "fp32", corpus, 2)
    quantize_model(base, str(root / "int8"), "int8", log=lambda line: None)
    return str(root / "int8")


@pytest.mark.parametrize("how", ["load_checkpoint", "pretrained_model_dir", "model_config"])
def test_training_from_int8_is_one_line_exit_2(tmp_path, corpus, int8_dir, capsys, monkeypatch, how):
    extra, changes = [], {"run_mode": "finetune"}
    if how == "load_checkpoint":
        extra = ["--load_checkpoint", int8_dir]
    elif how == "pretrained_model_dir":
        changes["pretrained_model_dir"] = int8_dir
    else:
        changes["model__model_config__quantization"] = dict(QUANTIZATION)
    yaml_path = tiny_yaml(tmp_path, corpus=corpus, **changes)
    code, out = launch_in_process(["--config", yaml_path, *extra], str(tmp_path), capsys, monkeypatch)
    errors = [line for line in out.splitlines() if line.startswith("gptlocal run: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out[-2000:]
    assert "int8 model" in errors[0] and "inference only" in errors[0], errors
    assert {"load_checkpoint": "load_checkpoint", "pretrained_model_dir": "pretrained_model_dir",
            "model_config": "model_config.quantization"}[how] in errors[0]
    assert not (tmp_path / "output").exists()
